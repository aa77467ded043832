//! Failures of unknown cause, retried for a while and then recorded: what a
//! destination's `retry_unknown_errors_for` bounds. An AWS service's answer
//! of an unknown class (`aws::errors::Class::Unknown`) and a webhook
//! receiver's 404, 409 or 425 (or 401 or 403 from a URL a row chose) are
//! such failures: perhaps passing (a receiver deploying, a resource being
//! created), perhaps not, and nobody can tell which from the answer alone.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Since when each event has failed for an unknown reason without another
/// outcome in between: such failures are retried for `limit`, then the event
/// is recorded as failed, so an error nobody classified cannot hold the slot
/// forever. Keyed by event id; an event leaves the map at its next other
/// outcome, and the map is bounded by the events in flight (a retried event
/// always comes back).
pub(crate) struct UnknownSince {
    since: Mutex<HashMap<Box<str>, Instant>>,
    limit: Duration,
}

impl UnknownSince {
    /// Retry unknown failures for `limit`.
    pub(crate) fn new(limit: Duration) -> Self {
        Self {
            since: Mutex::new(HashMap::new()),
            limit,
        }
    }

    /// How long unknown failures are retried.
    pub(crate) fn limit(&self) -> Duration {
        self.limit
    }

    /// Settle a batch: `unknown` are the ids that failed for an unknown
    /// reason now, `other` those that had any other outcome. The ids of
    /// `unknown` that have failed so for `limit` are returned (and forgotten).
    pub(crate) fn settle<'a>(
        &self,
        now: Instant,
        unknown: impl IntoIterator<Item = &'a str>,
        other: impl IntoIterator<Item = &'a str>,
    ) -> Vec<&'a str> {
        let mut since = self.since.lock().unwrap_or_else(PoisonError::into_inner);
        let mut given_up = Vec::new();
        for id in unknown {
            let first = *since.entry(id.into()).or_insert(now);
            if now.saturating_duration_since(first) >= self.limit {
                since.remove(id);
                given_up.push(id);
            }
        }
        if !since.is_empty() {
            for id in other {
                since.remove(id);
            }
        }
        given_up
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_failures_are_retried_for_the_limit_then_given_up() {
        let unknown = UnknownSince::new(Duration::from_secs(60));
        let t0 = Instant::now();
        let none: [&str; 0] = [];
        assert!(unknown.settle(t0, ["a", "b"], none).is_empty());
        assert!(unknown
            .settle(t0 + Duration::from_secs(59), ["a", "b"], none)
            .is_empty());
        // b had another outcome in between: its clock starts again.
        assert!(unknown
            .settle(t0 + Duration::from_secs(59), none, ["b"])
            .is_empty());
        assert_eq!(
            unknown.settle(t0 + Duration::from_secs(60), ["a", "b"], none),
            vec!["a"]
        );
        assert_eq!(
            unknown.settle(t0 + Duration::from_secs(120), ["a", "b"], none),
            vec!["b"],
            "a starts again after it was given up"
        );
        let at_once = UnknownSince::new(Duration::ZERO);
        assert_eq!(at_once.settle(t0, ["c"], none), vec!["c"]);
    }
}
