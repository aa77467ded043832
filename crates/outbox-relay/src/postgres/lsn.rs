//! Log sequence numbers as PostgreSQL writes them.
//!
//! The server speaks of WAL positions as text (`16/B374D848`, two
//! hexadecimal halves) in SQL results and in replication commands, and as a
//! `u64` on the replication stream; the relay keeps them as `u64` and
//! converts at those edges.

/// Parse Postgres's `X/Y` LSN text (two hexadecimal halves).
pub(crate) fn parse_lsn(text: &str) -> Option<u64> {
    let (high, low) = text.split_once('/')?;
    let half = |h: &str| {
        (!h.is_empty() && h.len() <= 8)
            .then(|| u32::from_str_radix(h, 16).ok())
            .flatten()
    };
    Some((u64::from(half(high)?) << 32) | u64::from(half(low)?))
}

/// Format an LSN as Postgres does (`16/B374D848`).
pub(crate) fn format_lsn(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lsns_read_and_print_as_postgres_does() {
        for (text, lsn) in [
            ("0/0", 0),
            ("16/B374D848", 0x16_B374_D848),
            ("FFFFFFFF/FFFFFFFF", u64::MAX),
        ] {
            assert_eq!(parse_lsn(text), Some(lsn), "{text}");
            assert_eq!(format_lsn(lsn), text);
        }
        assert_eq!(parse_lsn("16/b374d848"), Some(0x16_B374_D848));
        for bad in ["", "16", "/1", "1/", "1/2/3", "G/0", "100000000/0"] {
            assert_eq!(parse_lsn(bad), None, "{bad:?}");
        }
    }
}
