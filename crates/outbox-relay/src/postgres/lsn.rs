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

/// What a WAL page's header takes: `XLogPageHeaderData`, and at a
/// segment's start `XLogLongPageHeaderData`, each MAXALIGNed (8 bytes on
/// the 64-bit servers the relay supports).
const SHORT_PAGE_HEADER: u64 = 24;
const LONG_PAGE_HEADER: u64 = 40;

/// The columns [`last_record_end`] needs beside an insert position: the
/// server's WAL page and segment sizes, in bytes.
pub(crate) const WAL_LAYOUT_SQL: &str =
    "current_setting('wal_block_size')::int8, pg_size_bytes(current_setting('wal_segment_size'))::int8";

/// The end of the WAL's last record, from `insert`, the position
/// `pg_current_wal_insert_lsn()` gave on a server whose WAL pages are `block`
/// bytes and segments `segment` bytes.
///
/// When the last record ended exactly at a page's end, the insert position
/// points past the next page's header, where no record is yet; a walsender
/// reports the record's end, the page boundary, and goes no further until
/// more WAL is written. Every record ended at or before the position this
/// returns, so a wait for a confirmed position to reach it also ends on an
/// idle server (about one insert position in a thousand is such a one).
pub(crate) fn last_record_end(insert: u64, block: u64, segment: u64) -> u64 {
    let sane = |size: u64| size.is_power_of_two() && size > LONG_PAGE_HEADER;
    if !sane(block) || !sane(segment) || segment < block {
        return insert;
    }
    if insert % segment == LONG_PAGE_HEADER {
        insert - LONG_PAGE_HEADER
    } else if insert % block == SHORT_PAGE_HEADER && insert % segment != SHORT_PAGE_HEADER {
        insert - SHORT_PAGE_HEADER
    } else {
        insert
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_insert_position_past_a_page_header_ends_at_the_page_boundary() {
        let (block, segment) = (8192, 16 << 20);
        let end = |insert| last_record_end(insert, block, segment);
        // Past a page's short header, and past a segment's long one.
        assert_eq!(end(0x1_0300_2018), 0x1_0300_2000);
        assert_eq!(end(0x1_0300_0028), 0x1_0300_0000);
        // Anywhere else, the position as it is: within a page, a page's
        // start (a record ended there and the next one is being written),
        // and 24 bytes into a segment, which is inside its long header.
        for insert in [
            0x1_0300_2020,
            0x1_0300_2010,
            0x1_0300_2000,
            0x1_0300_0018,
            0x1_0300_2028,
        ] {
            assert_eq!(end(insert), insert, "{insert:X}");
        }
        // Other page and segment sizes (`initdb --wal-segsize`, a server
        // built with another block size).
        assert_eq!(last_record_end(0x8018, 32768, 1 << 20), 0x8000);
        assert_eq!(last_record_end(0x4_0000_0028, 8192, 1 << 30), 0x4_0000_0000);
        // 40 bytes into a page that starts no segment: a record's start.
        assert_eq!(last_record_end(0x4010_0028, 8192, 1 << 30), 0x4010_0028);
        // Sizes that make no sense leave the position alone.
        assert_eq!(last_record_end(0x2018, 0, segment), 0x2018);
        assert_eq!(last_record_end(0x2018, 8000, segment), 0x2018);
    }

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
