//! Wall-clock time in the two epochs the relay meets.
//!
//! The system clock counts from the Unix epoch; PostgreSQL counts its
//! timestamps (commit times in pgoutput, the clock field of a standby status
//! update) in microseconds from 2000-01-01 00:00 UTC. The offset between the
//! two and the conversions live here, so every crossing agrees on them.

use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds from the Unix epoch to PostgreSQL's (2000-01-01 00:00 UTC).
const PG_EPOCH_UNIX_SECS: i64 = 946_684_800;

/// [`PG_EPOCH_UNIX_SECS`] in microseconds.
const PG_EPOCH_UNIX_MICROS: i64 = PG_EPOCH_UNIX_SECS * 1_000_000;

/// Now, in µs since the Unix epoch (0 if the clock is before it).
pub(crate) fn unix_micros_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn unix_ms() -> u64 {
    (unix_micros_now() / 1000) as u64
}

/// µs since PostgreSQL's epoch as µs since the Unix epoch.
pub(crate) fn unix_micros_from_pg(pg_micros: i64) -> i64 {
    pg_micros + PG_EPOCH_UNIX_MICROS
}

/// µs since the Unix epoch as µs since PostgreSQL's epoch.
pub(crate) fn pg_micros_from_unix(unix_micros: i64) -> i64 {
    unix_micros - PG_EPOCH_UNIX_MICROS
}

/// µs since PostgreSQL's epoch as whole seconds since the Unix epoch and the
/// µs past them (`0..1_000_000`, also before either epoch). It cannot
/// overflow, whatever time the server sends.
pub(crate) fn unix_secs_from_pg_micros(pg_micros: i64) -> (i64, i64) {
    (
        pg_micros.div_euclid(1_000_000) + PG_EPOCH_UNIX_SECS,
        pg_micros.rem_euclid(1_000_000),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn postgres_epoch_is_2000_01_01_in_unix_time() {
        // 2000-01-01T00:00:00Z is 10,957 days after 1970-01-01.
        assert_eq!(unix_micros_from_pg(0), 10_957 * 86_400 * 1_000_000);
        assert_eq!(pg_micros_from_unix(unix_micros_from_pg(-7)), -7);
        assert_eq!(unix_secs_from_pg_micros(0), (10_957 * 86_400, 0));
        assert_eq!(unix_secs_from_pg_micros(-1), (10_957 * 86_400 - 1, 999_999));
        unix_secs_from_pg_micros(i64::MIN);
        unix_secs_from_pg_micros(i64::MAX);
    }
}
