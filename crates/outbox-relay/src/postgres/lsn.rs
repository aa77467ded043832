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

/// `sizeof(XLogPageHeaderData)` before its padding: the magic, the info
/// bits, the timeline, the page's address and the continuation's length.
const PAGE_HEADER_FIELDS: u64 = 20;
/// What `XLogLongPageHeaderData`, a segment's first page's header, adds: the
/// system identifier, the segment size and the page size.
const LONG_HEADER_FIELDS: u64 = 16;

/// How a server lays out its WAL: page and segment sizes, and the alignment
/// of what it writes (MAXALIGN: 8 on 64-bit servers, 4 on some 32-bit ones).
/// The default is an unknown layout, which leaves every position as it is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct WalLayout {
    block: u64,
    segment: u64,
    align: u64,
}

impl WalLayout {
    /// The server's layout: `wal_block_size`, `wal_segment_size` and
    /// MAXALIGN (`pg_control_init()`, executable by anyone unless revoked,
    /// like the `pg_control_system()` the derived lifecycle reads). It
    /// cannot change while the server runs, nor differ on its standbys, so
    /// it is read once: a session's keeper and the poller each keep it.
    pub(crate) async fn read(
        client: &tokio_postgres::Client,
    ) -> Result<Self, tokio_postgres::Error> {
        let row = client
            .query_one(
                "SELECT current_setting('wal_block_size')::int8, \
                        pg_size_bytes(current_setting('wal_segment_size'))::int8, \
                        (SELECT max_data_alignment FROM pg_control_init())::int8",
                &[],
            )
            .await?;
        Ok(Self::new(row.get(0), row.get(1), row.get(2)))
    }

    /// From the page size, the segment size and the alignment, in bytes.
    pub(crate) fn new(block: i64, segment: i64, align: i64) -> Self {
        let size = |v: i64| u64::try_from(v).unwrap_or(0);
        Self {
            block: size(block),
            segment: size(segment),
            align: size(align),
        }
    }

    /// The end of the WAL's last record, from `insert`, the position
    /// `pg_current_wal_insert_lsn()` gave.
    ///
    /// When the last record ended exactly at a page's end, the insert
    /// position points past the next page's header (MAXALIGNed: 24 bytes on
    /// a 64-bit server, 40 at a segment's start), where no record is yet; a
    /// walsender reports the record's end, the page boundary, and goes no
    /// further until more WAL is written. Every record ended at or before
    /// the position this returns (a record continued onto a page ends at
    /// least one alignment past its header), so a wait for a confirmed
    /// position to reach it also ends on an idle server (about one insert
    /// position in a thousand is such a one). A layout that makes no sense
    /// leaves the position as it is.
    pub(crate) fn last_record_end(self, insert: u64) -> u64 {
        let Self {
            block,
            segment,
            align,
        } = self;
        let aligned = |n: u64| n.div_ceil(align) * align;
        let sane = |size: u64| size.is_power_of_two() && size >= 1024;
        if !sane(block) || !sane(segment) || segment < block || !matches!(align, 4 | 8) {
            return insert;
        }
        let short = aligned(PAGE_HEADER_FIELDS);
        let long = aligned(short + LONG_HEADER_FIELDS);
        if insert % segment == long {
            insert - long
        } else if insert % block == short && insert % segment != short {
            insert - short
        } else {
            insert
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_insert_position_past_a_page_header_ends_at_the_page_boundary() {
        let usual = WalLayout::new(8192, 16 << 20, 8);
        let end = |insert| usual.last_record_end(insert);
        // Past a page's short header, and past a segment's long one.
        assert_eq!(end(0x1_0300_2018), 0x1_0300_2000);
        assert_eq!(end(0x1_0300_0028), 0x1_0300_0000);
        // Anywhere else, the position as it is: within a page, a page's
        // start (a record ended there and the next one is being written),
        // 24 bytes into a segment (inside its long header), and 40 into a
        // page that starts no segment (a record's start).
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
        let other = WalLayout::new(32768, 1 << 20, 8);
        assert_eq!(other.last_record_end(0x8018), 0x8000);
        let large = WalLayout::new(8192, 1 << 30, 8);
        assert_eq!(large.last_record_end(0x4_0000_0028), 0x4_0000_0000);
        assert_eq!(large.last_record_end(0x4010_0028), 0x4010_0028);
        // A server aligning to 4 bytes: its headers are 20 and 36 bytes, and
        // 24 bytes past a page is the end of a record continued onto it.
        let narrow = WalLayout::new(8192, 16 << 20, 4);
        assert_eq!(narrow.last_record_end(0x2014), 0x2000);
        assert_eq!(narrow.last_record_end(0x100_0024), 0x100_0000);
        assert_eq!(narrow.last_record_end(0x2018), 0x2018);
        // Layouts that make no sense leave the position alone.
        for layout in [
            WalLayout::new(0, 16 << 20, 8),
            WalLayout::new(8000, 16 << 20, 8),
            WalLayout::new(8192, 4096, 8),
            WalLayout::new(8192, 16 << 20, 0),
            WalLayout::new(8192, 16 << 20, -8),
            WalLayout::new(8192, 16 << 20, 16),
            WalLayout::default(),
        ] {
            assert_eq!(layout.last_record_end(0x2018), 0x2018, "{layout:?}");
        }
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
