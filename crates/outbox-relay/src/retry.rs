//! Capped, jittered exponential backoff.
//!
//! The delay before attempt `n` (counting from 0) is
//! `min(initial × multiplier^n, max)`, less a random part of up to `jitter` of
//! it, so concurrent retriers spread out and the cap is never exceeded.

use std::time::Duration;

use crate::config::RetryConfig;

/// A backoff policy.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Backoff {
    initial: Duration,
    max: Duration,
    multiplier: f64,
    jitter: f64,
}

impl Backoff {
    /// The policy of `[retry]`.
    pub(crate) fn new(config: &RetryConfig) -> Self {
        Self {
            initial: config.initial,
            max: config.max,
            multiplier: config.multiplier,
            jitter: config.jitter,
        }
    }

    /// The delay before retry number `attempt` (0 = the first retry).
    pub(crate) fn delay(&self, attempt: u32) -> Duration {
        let base = self.initial.as_secs_f64() * self.multiplier.powi(attempt.min(1000) as i32);
        let capped = base.min(self.max.as_secs_f64());
        let jittered = capped * (1.0 - self.jitter * fastrand::f64());
        Duration::try_from_secs_f64(jittered.max(0.0)).unwrap_or(self.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_and_stay_under_the_cap() {
        let b = Backoff::new(&RetryConfig {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(2),
            multiplier: 2.0,
            jitter: 0.2,
        });
        let d0 = b.delay(0);
        assert!(d0 <= Duration::from_millis(100) && d0 >= Duration::from_millis(80));
        let d3 = b.delay(3);
        assert!(d3 <= Duration::from_millis(800) && d3 >= Duration::from_millis(640));
        for n in [10, 100, u32::MAX] {
            let d = b.delay(n);
            assert!(
                d <= Duration::from_secs(2) && d >= Duration::from_millis(1600),
                "{d:?}"
            );
        }
    }
}
