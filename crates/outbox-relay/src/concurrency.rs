//! How many batches a sink has in flight: a fixed number, or a limit that
//! finds itself from what the destination answers (adaptive request
//! concurrency, in the spirit of Vector's).
//!
//! ```text
//!  publisher ──start batch (if in flight < limit)──► sink ── answer after RTT ──┐
//!      ▲                                                                         │
//!      └──── limit ◄── Limiter::finished(now, rtt, Signal) ◄────────────────────┘
//! ```
//!
//! # The adaptive rule
//!
//! Time is cut into windows one baseline RTT long. During a window the
//! limiter keeps the mean RTT of the batches that came back cleanly, whether
//! any came back with back pressure ([`Signal::BackPressure`]: throttled,
//! timed out, the destination unavailable), and whether the publisher had
//! work for every slot ([`Limiter::saturated`]). At the end of a window:
//!
//! * **Back pressure**: the limit is multiplied by [`BACK_OFF`]. The
//!   destination said no outright (throttled, failed, or did not answer), so
//!   it is halved as TCP halves its window on loss: a quota is usually a
//!   token bucket, which says nothing until its burst is spent, by when the
//!   limit may be well above the rate the quota allows.
//! * **An RTT well above the baseline** (mean plus [`DEVIATIONS`] standard
//!   deviations, and at least [`FALL_RISE`] above it) while the limit was
//!   reached: queueing somewhere; the limit is multiplied by [`DECREASE`], as
//!   Vector does. Only when the limit was reached: with slots to spare the
//!   limit is not what loads the destination, and lowering it would only
//!   queue messages in the relay. And only for a clear rise: on a shared
//!   host the RTT also rises with the host's own CPU load, which fewer calls
//!   in flight do not cure.
//! * Either way at least 1 less, never under 1. Back pressure on a batch
//!   sent before the last decrease is not counted again: it was sent under
//!   the old limit, which is already paid for (TCP's recovery rule).
//! * **The limit was reached and the RTT held** (at most the baseline mean
//!   plus [`RISE`]): the limit grows: by half of itself while no back pressure
//!   nor rise has been seen since start (slow start: from the initial limit
//!   to hundreds of batches in a few round trips, as a drain at 20 ms needs),
//!   by one afterwards (additive increase near the knee, as Vector does).
//! * Otherwise it stays: a limit nobody used is no evidence for a higher one.
//!
//! The baseline is an exponentially weighted moving average of each
//! window's mean RTT, with its deviation ([`Ewma`]). The limit never exceeds
//! the ceiling and starts at [`INITIAL`] (or the ceiling, when lower).
//! Outcomes that say nothing about load (a rejected message, bad
//! credentials) are [`Signal::Neutral`]: they neither move the limit nor the
//! baseline.
//!
//! The limiter is pure logic: the caller passes the time, so tests drive it
//! with a clock of their own.

use std::time::{Duration, Instant};

/// The limit an adaptive limiter starts from.
pub const INITIAL: usize = 8;
/// Multiplicative decrease on back pressure (throttling, timeouts, 5xx).
pub const BACK_OFF: f64 = 0.5;
/// Multiplicative decrease on a rising RTT.
pub const DECREASE: f64 = 0.9;
/// An RTT this many standard deviations above the baseline mean is a rise.
pub const DEVIATIONS: f64 = 2.5;
/// RTTs within this fraction of the baseline mean count as holding (jitter
/// of a constant link must not read as a rise).
pub const RISE: f64 = 0.05;
/// An RTT this fraction above the baseline mean (or more) may lower the limit.
pub const FALL_RISE: f64 = 0.25;
/// Weight of a new window's RTT in the baseline.
const ALPHA: f64 = 0.4;
/// Shortest window, so a destination that answers in microseconds does not
/// move the limit on every answer.
const MIN_WINDOW: Duration = Duration::from_millis(1);

/// How a sink's batches are limited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Concurrency {
    /// Always this many batches in flight (at least 1).
    Fixed(usize),
    /// Adaptive, up to `ceiling` batches.
    Adaptive {
        /// The most batches in flight.
        ceiling: usize,
    },
}

/// What a finished batch says about the destination's load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// Answered, nothing throttled: its RTT is a sample.
    Clean,
    /// Throttled, timed out, or the destination unavailable (5xx, no connection).
    BackPressure,
    /// Nothing about load (a rejection, a client or credential error).
    Neutral,
}

/// An exponentially weighted mean and variance.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ewma {
    state: Option<(f64, f64)>,
}

impl Ewma {
    /// Take in `x`.
    pub fn update(&mut self, x: f64) {
        self.state = Some(match self.state {
            None => (x, 0.0),
            Some((mean, var)) => {
                let diff = x - mean;
                let incr = ALPHA * diff;
                (mean + incr, (1.0 - ALPHA) * (var + diff * incr))
            }
        });
    }

    /// The mean, once anything was taken in.
    pub fn mean(&self) -> Option<f64> {
        self.state.map(|(m, _)| m)
    }

    /// The standard deviation (0 before two values).
    pub fn deviation(&self) -> f64 {
        self.state.map_or(0.0, |(_, v)| v.max(0.0).sqrt())
    }
}

/// The limit of batches in flight for one sink.
#[derive(Debug, Clone)]
pub struct Limiter {
    limit: usize,
    ceiling: usize,
    adaptive: bool,
    slow_start: bool,
    baseline: Ewma,
    window: Window,
    /// When the limit was last lowered.
    decreased: Option<Instant>,
}

#[derive(Debug, Clone, Default)]
struct Window {
    /// When it ends (`None`: at the first sample).
    ends: Option<Instant>,
    rtt_sum: f64,
    samples: u32,
    back_pressure: bool,
    saturated: bool,
}

impl Limiter {
    /// A limiter for `concurrency`.
    pub fn new(concurrency: Concurrency) -> Self {
        let (limit, ceiling, adaptive) = match concurrency {
            Concurrency::Fixed(n) => (n.max(1), n.max(1), false),
            Concurrency::Adaptive { ceiling } => {
                let ceiling = ceiling.max(1);
                (INITIAL.min(ceiling), ceiling, true)
            }
        };
        Self {
            limit,
            ceiling,
            adaptive,
            slow_start: true,
            baseline: Ewma::default(),
            window: Window::default(),
            decreased: None,
        }
    }

    /// Batches allowed in flight now.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// The baseline round-trip time, once one was measured.
    pub fn rtt(&self) -> Option<Duration> {
        self.baseline
            .mean()
            .map(|s| Duration::from_secs_f64(s.max(0.0)))
    }

    /// The publisher had a batch for every slot: the limit is binding.
    pub fn saturated(&mut self) {
        self.window.saturated = true;
    }

    /// A batch came back at `now`, `rtt` after it was sent, saying `signal`.
    pub fn finished(&mut self, now: Instant, rtt: Duration, signal: Signal) {
        if !self.adaptive {
            return;
        }
        match signal {
            Signal::Clean => {
                self.window.rtt_sum += rtt.as_secs_f64();
                self.window.samples += 1;
            }
            Signal::BackPressure => {
                let sent = now.checked_sub(rtt).unwrap_or(now);
                if self.decreased.is_some_and(|at| sent < at) {
                    return;
                }
                self.window.back_pressure = true;
            }
            Signal::Neutral => return,
        }
        let ends = *self.window.ends.get_or_insert(now);
        if now < ends {
            return;
        }
        self.end_window(now);
    }

    fn end_window(&mut self, now: Instant) {
        let window = std::mem::take(&mut self.window);
        let current = (window.samples > 0).then(|| window.rtt_sum / f64::from(window.samples));
        let mean = self.baseline.mean();
        let deviation = self.baseline.deviation();
        let holds = |c: f64, mean: f64| c <= mean * (1.0 + RISE);
        let risen = match (mean, current) {
            (Some(mean), Some(c)) => {
                window.saturated
                    && c >= mean * (1.0 + FALL_RISE)
                    && c >= mean + DEVIATIONS * deviation
            }
            _ => false,
        };
        let held = match (mean, current) {
            (Some(mean), Some(c)) => holds(c, mean),
            // The first samples only set the baseline.
            _ => false,
        };
        if window.back_pressure || risen {
            self.slow_start = false;
            let factor = if window.back_pressure {
                BACK_OFF
            } else {
                DECREASE
            };
            let lower = (self.limit as f64 * factor) as usize;
            self.limit = lower.min(self.limit - 1).max(1);
            self.decreased = Some(now);
        } else if window.saturated && held {
            let step = if self.slow_start {
                (self.limit / 2).max(1)
            } else {
                1
            };
            self.limit = (self.limit + step).min(self.ceiling);
        }
        if let Some(current) = current {
            self.baseline.update(current);
        }
        let length = self.rtt().unwrap_or(MIN_WINDOW).max(MIN_WINDOW);
        self.window.ends = Some(now + length);
    }
}

/// A destination's `concurrency` key: `"adaptive"` or a fixed number of
/// calls in flight.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ConcurrencyMode {
    /// Found from round-trip times and throttling ([`crate::concurrency`]).
    #[default]
    Adaptive,
    /// Always this many.
    Fixed(usize),
}

impl<'de> serde::Deserialize<'de> for ConcurrencyMode {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(u64),
            Text(String),
        }
        let wrong =
            || serde::de::Error::custom("expected \"adaptive\" or a number of calls in flight");
        match <Raw as serde::Deserialize>::deserialize(d).map_err(|_| wrong())? {
            Raw::Number(n) => Ok(Self::Fixed(usize::try_from(n).map_err(|_| wrong())?)),
            Raw::Text(t) if t == "adaptive" => Ok(Self::Adaptive),
            Raw::Text(t) => match t.parse() {
                Ok(n) => Ok(Self::Fixed(n)),
                Err(_) => Err(wrong()),
            },
        }
    }
}

impl ConcurrencyMode {
    /// Report to `bad` what is wrong with a section's `concurrency` (under
    /// `section.concurrency`) and its ceiling (`section.ceiling_key`).
    pub fn validate(
        self,
        section: &str,
        (ceiling_key, ceiling): (&str, usize),
        bad: &mut dyn FnMut(&str, String),
    ) {
        if ceiling == 0 {
            bad(
                &format!("{section}.{ceiling_key}"),
                "must be at least 1".into(),
            );
        }
        if let Self::Fixed(n) = self {
            if n == 0 || n > ceiling {
                bad(
                    &format!("{section}.concurrency"),
                    format!(
                        "{n} must be between 1 and {section}.{ceiling_key} ({ceiling}), or \"adaptive\""
                    ),
                );
            }
        }
    }

    /// The publisher's concurrency: adaptive up to `ceiling`, or fixed.
    pub fn with_ceiling(self, ceiling: usize) -> Concurrency {
        match self {
            Self::Adaptive => Concurrency::Adaptive { ceiling },
            Self::Fixed(n) => Concurrency::Fixed(n),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drive `limiter` for `windows` round trips of `rtt`: each round trip the
    /// publisher fills every slot and each batch comes back with `signal(limit)`.
    fn run(
        limiter: &mut Limiter,
        clock: &mut Instant,
        windows: usize,
        rtt: Duration,
        signal: impl Fn(usize) -> Signal,
    ) {
        for _ in 0..windows {
            let limit = limiter.limit();
            limiter.saturated();
            *clock += rtt;
            for _ in 0..limit {
                limiter.finished(*clock, rtt, signal(limit));
            }
        }
    }

    #[test]
    fn a_fixed_limit_never_moves() {
        let mut limiter = Limiter::new(Concurrency::Fixed(3));
        let mut clock = Instant::now();
        run(
            &mut limiter,
            &mut clock,
            50,
            Duration::from_millis(20),
            |_| Signal::BackPressure,
        );
        assert_eq!(limiter.limit(), 3);
        run(
            &mut limiter,
            &mut clock,
            50,
            Duration::from_millis(20),
            |_| Signal::Clean,
        );
        assert_eq!(limiter.limit(), 3);
    }

    #[test]
    fn the_limit_grows_to_the_ceiling_while_the_rtt_holds() {
        let mut limiter = Limiter::new(Concurrency::Adaptive { ceiling: 500 });
        assert_eq!(limiter.limit(), INITIAL);
        let mut clock = Instant::now();
        let rtt = Duration::from_millis(20);
        // Slow start: a second of a steady 20 ms link fills a 500-batch ceiling.
        run(&mut limiter, &mut clock, 50, rtt, |_| Signal::Clean);
        assert_eq!(limiter.limit(), 500);
        assert_eq!(limiter.rtt(), Some(rtt));
    }

    #[test]
    fn the_limit_does_not_grow_when_it_is_not_reached() {
        let mut limiter = Limiter::new(Concurrency::Adaptive { ceiling: 500 });
        let mut clock = Instant::now();
        for _ in 0..50 {
            clock += Duration::from_millis(20);
            limiter.finished(clock, Duration::from_millis(20), Signal::Clean);
        }
        assert_eq!(limiter.limit(), INITIAL);
    }

    #[test]
    fn the_limit_shrinks_under_throttling_and_settles_near_the_quota() {
        let mut limiter = Limiter::new(Concurrency::Adaptive { ceiling: 500 });
        let mut clock = Instant::now();
        let rtt = Duration::from_millis(20);
        run(&mut limiter, &mut clock, 20, rtt, |_| Signal::Clean);
        let high = limiter.limit();
        assert!(high > 100, "{high}");
        // The destination takes 20 batches a round trip; above that it throttles.
        let quota = |limit: usize| {
            if limit > 20 {
                Signal::BackPressure
            } else {
                Signal::Clean
            }
        };
        run(&mut limiter, &mut clock, 60, rtt, quota);
        let settled: Vec<usize> = (0..40)
            .map(|_| {
                run(&mut limiter, &mut clock, 1, rtt, quota);
                limiter.limit()
            })
            .collect();
        assert!(
            settled.iter().all(|&l| (10..=21).contains(&l)),
            "{settled:?}"
        );
        // Additive increase near the knee: few windows are over the quota.
        let over = settled.iter().filter(|&&l| l > 20).count();
        assert!(over * 8 <= settled.len(), "{settled:?}");
    }

    #[test]
    fn a_rising_rtt_shrinks_the_limit_and_neutral_outcomes_do_not() {
        let mut limiter = Limiter::new(Concurrency::Adaptive { ceiling: 64 });
        let mut clock = Instant::now();
        run(
            &mut limiter,
            &mut clock,
            20,
            Duration::from_millis(20),
            |_| Signal::Clean,
        );
        assert_eq!(limiter.limit(), 64);
        run(
            &mut limiter,
            &mut clock,
            20,
            Duration::from_millis(20),
            |_| Signal::Neutral,
        );
        assert_eq!(limiter.limit(), 64, "rejections say nothing about load");
        // Queueing at the destination: each round trip longer than the last.
        let mut rtt = Duration::from_millis(20);
        for _ in 0..5 {
            rtt = rtt * 3 / 2;
            run(&mut limiter, &mut clock, 1, rtt, |_| Signal::Clean);
        }
        assert!(limiter.limit() < 64 * 3 / 4, "{}", limiter.limit());
        assert!(limiter.limit() >= 1);
    }

    #[test]
    fn the_limit_never_falls_under_one() {
        let mut limiter = Limiter::new(Concurrency::Adaptive { ceiling: 4 });
        let mut clock = Instant::now();
        run(
            &mut limiter,
            &mut clock,
            3,
            Duration::from_millis(5),
            |_| Signal::Clean,
        );
        run(
            &mut limiter,
            &mut clock,
            100,
            Duration::from_millis(5),
            |_| Signal::BackPressure,
        );
        assert_eq!(limiter.limit(), 1);
    }
}
