//! How many batches a sink has in flight, and how fast it starts them: a
//! fixed number in flight, or a limit that finds itself from what the
//! destination answers (adaptive request concurrency, in the spirit of
//! Vector's), and a pace once the destination has throttled.
//!
//! ```text
//!  publisher ──start batch (in flight < limit, and the pace allows)──► sink ── answer after RTT ──┐
//!      ▲                                                                                           │
//!      └──── limit, pace ◄── Limiter::finished(now, rtt, Signal) ◄────────────────────────────────┘
//! ```
//!
//! # Why a limit of calls in flight is not enough
//!
//! A destination's quota is usually a token bucket: it takes a burst (as
//! much as the bucket holds, a size AWS does not publish) at any speed, and
//! then its refill rate. While the burst lasts nothing is throttled and the
//! RTT holds, so a limit of calls in flight keeps growing; when the burst is
//! spent, every call in flight is throttled at once, and a limit halved once
//! a round trip still sends several times the refill rate for several round
//! trips. At small quotas it cannot get low enough at all: one call at a
//! time 20 ms away is 50 calls a second, and a quota of 300 messages a
//! second is 30 `PublishBatch` calls of ten. So once the destination
//! throttles, the limiter *paces*: it spaces the starts of calls at a rate,
//! and moves the rate, as TCP does best against traffic policers (Flach et
//! al., "An Internet-Wide Analysis of Traffic Policing", SIGCOMM 2016:
//! bursts into a policer are what it drops; a sender paced at the policed
//! rate loses little).
//!
//! # The limit of calls in flight
//!
//! Time is cut into windows one baseline RTT long. During a window the
//! limiter keeps the mean RTT of the batches that came back cleanly, whether
//! any came back with [`Signal::BackPressure`] (timed out, the destination
//! unavailable), and whether the publisher had work for every slot
//! ([`Limiter::saturated`]). At the end of a window:
//!
//! * **Back pressure**: the limit is multiplied by [`BACK_OFF`] (halved, as
//!   TCP halves its window on loss). Back pressure on a batch sent before
//!   the last decrease is not counted again: it was sent under the old
//!   limit, which is already paid for (TCP's recovery rule).
//! * **An RTT well above the baseline** (mean plus [`DEVIATIONS`] standard
//!   deviations, and at least [`FALL_RISE`] above it) while the limit was
//!   reached, before any pace: queueing somewhere; the limit is multiplied
//!   by [`DECREASE`], as Vector does. Only when the limit was reached: with
//!   slots to spare it only queued messages in the relay; and only for a
//!   clear rise: a shared host's own CPU load raises the RTT too.
//! * Either way at least 1 less, never under 1, and slow start is over.
//! * **The limit was reached and the RTT held** (at most the baseline mean
//!   plus [`RISE`]): the limit grows by [`SLOW_START`] of itself until the
//!   first back pressure or rise, by one afterwards (additive increase near
//!   the knee, as Vector does). An eighth a round trip takes a drain 20 ms
//!   away from 8 to a few hundred calls in flight within a second; and when
//!   a bucket's burst runs out before anything paces, what is in flight then
//!   (all throttled: an answer cannot recall calls already sent) is about an
//!   eighth of what the burst took, where growth by half would have a third.
//! * Otherwise it stays: a limit nobody used is no evidence for a higher one.
//!
//! Once paced, the pace decides how fast calls start and the limit only has
//! to keep up with it: it grows by [`SLOW_START`] whenever it is reached
//! before the pace, whatever the RTT, and an RTT rise no longer lowers it (on
//! a shared host at thousands of calls a second, that rise is mostly the
//! host's own load). Back pressure still halves it.
//!
//! # The pace, once the destination throttles
//!
//! [`Signal::Throttled`] (the destination said to slow down: a quota) on a
//! call sent after the pace's last cut (on calls sent before it the cut is
//! already paid for, so at most one cut a round trip):
//!
//! * **The first** starts the pace, for good. It starts at [`FIRST`]
//!   (a quarter) of the rate calls were being sent at, measured over the
//!   last [`STARTS`] starts: a burst may have paid for slow start's rate
//!   several times over. That rate is the *peak*, where the destination
//!   said no.
//! * **Again, before [`TAKEN`] calls in a row sent after the last cut came
//!   back taken** (an empty bucket still takes a call now and then, as it
//!   refills): the pace is cut to the share of the calls sent since the last
//!   cut that were taken (about the share of the pace the destination takes),
//!   once [`JUDGED`] have answered; at least to [`EASE`] of it and at most to
//!   [`RETREAT`] (half). If the destination took any call since it began
//!   throttling, it limits a rate below the pace it refused, which becomes
//!   the peak; if it took none, the peak stays, so the pace goes back there
//!   once calls are taken again (at [`FLOOR`], one call taken is enough).
//! * **After the destination took the pace**: the rate calls were being
//!   sent at (at most the pace) is the new peak, and the pace falls to
//!   [`EASE`] of it.
//!
//! Between cuts the pace follows CUBIC's curve (RFC 9438), in calls a second
//! rather than a window: from the cut it climbs back towards the peak,
//! quickly at first and levelling off, reaching it after [`RETURN`] (or the
//! time of [`RETURN_CALLS`] calls at the peak, when that is longer, up to
//! [`MAX_RETURN`]: a slow pace probes no more often than every hundred
//! calls); then it probes above the peak, slowly and then faster, so a quota
//! raised to twice is found within seconds. The curve advances only while
//! the pace held back batches that were ready and calls started at
//! [`BINDING`] of it or faster (a pace nobody used, because there was
//! nothing to send or the relay could not go faster, is no evidence), and
//! not while the destination still refuses. While paced, at most twice the
//! calls the pace keeps in flight (the pace times the baseline RTT) are in
//! flight: the pace decides, and the limit only bounds what a destination
//! that stops answering can hold.
//!
//! Timeouts and 5xx answers are not a quota: they halve the limit, as
//! above, and do not pace. A destination with a failing node answers some
//! calls with 5xx whatever the rate; chasing its pace down would starve it,
//! where the limit stops at one call in flight.
//!
//! # Why it is polite
//!
//! * Near the peak the curve is flat, so the pace crosses a quota slowly:
//!   the destination's first refusal comes with the pace barely above the
//!   quota, and costs about one throttled call (of [`RETURN_CALLS`] or more
//!   sent since the last). The account's quota is shared with the
//!   application's own publishers; this is how often the relay takes their
//!   turn.
//! * Against a bucket with a large burst, what the pace leaves below the
//!   quota the bucket saves, and what it takes above spends the savings; the
//!   refusal comes when they are spent, again with the pace just above the
//!   quota. The dips cost no throughput: the savings make up for them.
//! * The one costly moment is the end of slow start against a large burst:
//!   about an eighth of the calls the burst took, once in the life of the
//!   process; the pace never returns to slow start.
//!
//! The unit tests hold this against a simulated token bucket (deterministic:
//! the clock is the test's): at quotas of 300, 3,000 and 30,000 messages a
//! second, with a bucket holding a tenth of a second and five seconds of
//! quota, at most 5 % of calls throttled and at least 85 % of the quota
//! delivered, and a doubled quota found within ten seconds.
//!
//! # Why it is safe
//!
//! The limiter only says when a call may start. A paced batch waits; nothing
//! is dropped, reordered or confirmed here (the publisher's per-group order,
//! retries and acknowledgements do not depend on it). The pace never falls
//! below [`FLOOR`] calls a second, and the curve returns to the peak within
//! seconds once calls are taken, most of the way in the first. Outcomes that
//! say nothing about load (a rejected message, bad credentials) are
//! [`Signal::Neutral`]: they move neither the limit, nor the pace, nor the
//! baseline. A [`Concurrency::Fixed`] limit never moves and is never paced.
//!
//! The limiter is pure logic: the caller passes the time, so tests drive it
//! with a clock of their own.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// The limit an adaptive limiter starts from.
pub(crate) const INITIAL: usize = 8;
/// Slow start: the limit grows by this fraction of itself a round trip.
pub(crate) const SLOW_START: f64 = 0.125;
/// Multiplicative decrease of the limit on back pressure (timeouts, 5xx).
pub(crate) const BACK_OFF: f64 = 0.5;
/// Multiplicative decrease of the limit on a rising RTT.
pub(crate) const DECREASE: f64 = 0.9;
/// An RTT this many standard deviations above the baseline mean is a rise.
pub(crate) const DEVIATIONS: f64 = 2.5;
/// RTTs within this fraction of the baseline mean count as holding (jitter
/// of a constant link must not read as a rise).
pub(crate) const RISE: f64 = 0.05;
/// An RTT this fraction above the baseline mean (or more) may lower the limit.
pub(crate) const FALL_RISE: f64 = 0.25;
/// The pace after the first throttling: this fraction of the rate calls
/// were being sent at (slow start's rate, which a burst may have paid for
/// several times over).
pub(crate) const FIRST: f64 = 0.25;
/// The pace after throttling again before the lowered pace was taken: this
/// fraction of it.
pub(crate) const RETREAT: f64 = 0.5;
/// The pace after throttling of a pace the destination had taken: this
/// fraction of the rate it said no at.
pub(crate) const EASE: f64 = 0.85;
/// After a cut by [`EASE`], the pace is back at the rate the destination
/// said no at after this long (while the relay has work to send)...
pub(crate) const RETURN: Duration = Duration::from_secs(2);
/// ...or after the time this many calls take at that rate, when longer...
pub(crate) const RETURN_CALLS: f64 = 100.0;
/// ...but never longer than this.
pub(crate) const MAX_RETURN: Duration = Duration::from_secs(10);
/// Calls sent after a cut that must be taken in a row before the pace counts
/// as taken (an empty bucket still takes a call now and then, as it
/// refills).
pub(crate) const TAKEN: u32 = 3;
/// Answers to calls sent after a cut needed before the share of them taken
/// says how far to cut again.
pub(crate) const JUDGED: u32 = 8;
/// The slowest pace, in calls a second.
pub(crate) const FLOOR: f64 = 1.0;
/// Starts kept to measure the rate calls are sent at.
pub(crate) const STARTS: usize = 256;
/// The pace grows only while calls start at this share of it or more.
pub(crate) const BINDING: f64 = 0.9;
/// How far behind its pace a call may start and the next still keep its
/// place: a timer that wakes late starts what it owes, up to this much.
const SLACK: Duration = Duration::from_millis(2);
/// Weight of a new window's RTT in the baseline.
const ALPHA: f64 = 0.4;
/// Shortest window, so a destination that answers in microseconds does not
/// move the limit on every answer.
const MIN_WINDOW: Duration = Duration::from_millis(1);

/// How a sink's batches are limited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Concurrency {
    /// Always this many batches in flight (at least 1), never paced.
    Fixed(usize),
    /// Adaptive, up to `ceiling` batches.
    Adaptive {
        /// The most batches in flight.
        ceiling: usize,
    },
}

/// What a finished batch says about the destination's load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Signal {
    /// Answered, nothing throttled: its RTT is a sample.
    Clean,
    /// The destination said to slow down (a quota: SNS `Throttling`, 429).
    Throttled,
    /// Timed out, or the destination unavailable (5xx, no connection).
    BackPressure,
    /// Nothing about load (a rejection, a client or credential error).
    Neutral,
}

/// An exponentially weighted mean and variance.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Ewma {
    state: Option<(f64, f64)>,
}

impl Ewma {
    /// Take in `x`.
    pub(crate) fn update(&mut self, x: f64) {
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
    pub(crate) fn mean(&self) -> Option<f64> {
        self.state.map(|(m, _)| m)
    }

    /// The standard deviation (0 before two values).
    pub(crate) fn deviation(&self) -> f64 {
        self.state.map_or(0.0, |(_, v)| v.max(0.0).sqrt())
    }
}

/// The limit of batches in flight for one sink, and its pace.
#[derive(Debug, Clone)]
pub(crate) struct Limiter {
    /// The limit from round-trip times and back pressure.
    limit: usize,
    ceiling: usize,
    adaptive: bool,
    slow_start: bool,
    baseline: Ewma,
    window: Window,
    /// When the limit was last lowered.
    decreased: Option<Instant>,
    /// From the first throttling on.
    pace: Option<Pace>,
    /// The last [`STARTS`] starts.
    starts: VecDeque<Instant>,
}

#[derive(Debug, Clone, Default)]
struct Window {
    /// When it began and ends (`None`: at the first sample).
    began: Option<Instant>,
    ends: Option<Instant>,
    rtt_sum: f64,
    samples: u32,
    back_pressure: bool,
    /// Every slot was in use.
    saturated: bool,
    /// The pace held back a batch that was ready.
    held: bool,
}

/// Calls a second, and where the rate goes next.
#[derive(Debug, Clone)]
struct Pace {
    /// Calls a second allowed now.
    rate: f64,
    /// Calls in flight the pace needs room for: twice the pace times the RTT.
    room: usize,
    /// The earliest start of the next call.
    next: Instant,
    /// The last call's start.
    last: Option<Instant>,
    /// When the pace was last cut.
    cut: Instant,
    /// The rate the destination last said no at: where the curve levels off.
    peak: f64,
    /// Seconds of growth from the last cut to the peak.
    k: f64,
    /// Seconds of growth since the last cut.
    grown: f64,
    /// Throttled since the last cut, and not yet [`TAKEN`] calls in a row
    /// sent after it taken.
    refused: bool,
    /// Calls sent after the last cut taken in a row.
    taken: u32,
    /// Calls sent after the last cut answered, and of them taken.
    answered: u32,
    took: u32,
    /// The destination took a call sent since it began throttling.
    trickle: bool,
}

impl Pace {
    /// Seconds the curve takes back to the peak after a cut by [`EASE`].
    fn back(&self) -> f64 {
        (RETURN_CALLS / self.peak)
            .min(MAX_RETURN.as_secs_f64())
            .max(RETURN.as_secs_f64())
    }

    /// The rate after `grown` seconds of growth: CUBIC's
    /// `W(t) = C (t - K)^3 + W_max`, with `C` relative to the peak so the
    /// curve has the same shape at 3 calls a second as at 3,000.
    fn curve(&self) -> f64 {
        let c = (1.0 - EASE) / self.back().powi(3);
        self.peak * (1.0 + c * (self.grown - self.k).powi(3))
    }

    /// Cut (or set) the pace to `rate` at `now`: the curve starts again from it.
    fn set(&mut self, now: Instant, rate: f64) {
        self.rate = rate.max(FLOOR);
        self.cut = now;
        self.grown = 0.0;
        self.taken = 0;
        self.answered = 0;
        self.took = 0;
        let gap = (1.0 - self.rate / self.peak).max(0.0);
        self.k = self.back() * (gap / (1.0 - EASE)).cbrt();
        self.next = self.next.max(now + interval(self.rate));
    }

    /// Room for twice the calls the pace keeps in flight over `rtt` seconds.
    fn make_room(&mut self, rtt: f64) {
        self.room = ((2.0 * self.rate * rtt).ceil() as usize).max(1);
    }
}

/// The time between starts at `rate` calls a second.
fn interval(rate: f64) -> Duration {
    Duration::from_secs_f64(1.0 / rate.max(FLOOR))
}

impl Limiter {
    /// A limiter for `concurrency`.
    pub(crate) fn new(concurrency: Concurrency) -> Self {
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
            pace: None,
            starts: VecDeque::with_capacity(if adaptive { STARTS } else { 0 }),
        }
    }

    /// Batches allowed in flight now.
    pub(crate) fn limit(&self) -> usize {
        match &self.pace {
            Some(pace) => self.limit.min(pace.room),
            None => self.limit,
        }
    }

    /// The pace in calls a second, once the destination has throttled.
    #[cfg(test)]
    pub(crate) fn rate(&self) -> Option<f64> {
        self.pace.as_ref().map(|p| p.rate)
    }

    /// The baseline round-trip time, once one was measured.
    pub(crate) fn rtt(&self) -> Option<Duration> {
        self.baseline
            .mean()
            .map(|s| Duration::from_secs_f64(s.max(0.0)))
    }

    /// The publisher had a batch for every slot: the limit is binding.
    pub(crate) fn saturated(&mut self) {
        self.window.saturated = true;
    }

    /// The publisher has a batch ready and a slot free at `now`: when it may
    /// start it, if not now (the pace holds it back until then).
    pub(crate) fn paced_until(&mut self, now: Instant) -> Option<Instant> {
        let next = self.pace.as_ref()?.next;
        (now < next).then(|| {
            self.window.held = true;
            next
        })
    }

    /// A batch started at `now`.
    pub(crate) fn started(&mut self, now: Instant) {
        if !self.adaptive {
            return;
        }
        if self.starts.len() == STARTS {
            self.starts.pop_front();
        }
        self.starts.push_back(now);
        if let Some(pace) = &mut self.pace {
            let owed = now.checked_sub(SLACK).unwrap_or(now);
            pace.next = pace.next.max(owed) + interval(pace.rate);
            pace.last = Some(now);
        }
    }

    /// Calls a second started over the last [`STARTS`] starts (at most a
    /// second back).
    fn sending(&self, now: Instant) -> Option<f64> {
        let recent = || {
            self.starts
                .iter()
                .filter(move |&&s| now.saturating_duration_since(s) <= Duration::from_secs(1))
        };
        let first = *recent().next()?;
        let span = now.saturating_duration_since(first).as_secs_f64();
        let n = recent().count();
        (n >= 2 && span > 0.0).then(|| n as f64 / span)
    }

    /// A batch came back at `now`, `rtt` after it was sent, saying `signal`.
    pub(crate) fn finished(&mut self, now: Instant, rtt: Duration, signal: Signal) {
        if !self.adaptive {
            return;
        }
        let sent = now.checked_sub(rtt).unwrap_or(now);
        // Sent after the pace's last cut: it answers for the pace as it is.
        let current = self.pace.as_ref().is_none_or(|p| sent >= p.cut);
        match signal {
            Signal::Clean => {
                self.window.rtt_sum += rtt.as_secs_f64();
                self.window.samples += 1;
                if let Some(pace) = self.pace.as_mut().filter(|_| current) {
                    pace.answered += 1;
                    pace.took += 1;
                }
                if let Some(pace) = self.pace.as_mut().filter(|p| p.refused && current) {
                    pace.taken += 1;
                    pace.trickle = true;
                    // At the floor one call taken is enough.
                    if pace.taken >= TAKEN || pace.rate <= FLOOR {
                        // The destination takes the pace: the curve may grow
                        // again, from now.
                        pace.refused = false;
                        self.window.began = Some(now);
                    }
                }
            }
            Signal::Throttled if current => self.throttled(now),
            Signal::Throttled => {}
            Signal::BackPressure => {
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

    /// Throttling of a call sent after the pace's last cut: cut the pace.
    fn throttled(&mut self, now: Instant) {
        let sending = self.sending(now);
        let rtt = self.baseline.mean().unwrap_or(0.0);
        match &mut self.pace {
            None => {
                let min_window = MIN_WINDOW.as_secs_f64();
                let rate = sending
                    .unwrap_or(self.limit as f64 / rtt.max(min_window))
                    .max(FLOOR);
                let mut pace = Pace {
                    rate,
                    room: self.limit,
                    next: now,
                    last: None,
                    cut: now,
                    peak: rate,
                    k: 0.0,
                    grown: 0.0,
                    refused: true,
                    taken: 0,
                    answered: 0,
                    took: 0,
                    trickle: false,
                };
                pace.set(now, rate * FIRST);
                pace.make_room(rtt);
                self.pace = Some(pace);
            }
            Some(pace) if pace.refused => {
                // Still refused. Taking a trickle, the destination limits a
                // rate below this pace: it is the peak now. Taking nothing,
                // it is not there, and the peak stays where it was.
                if pace.trickle {
                    pace.peak = pace.peak.min(pace.rate);
                }
                // The share of calls taken since the last cut is about the
                // share of this pace the destination takes (when enough
                // answered to tell): cut to it, by at least EASE and at most
                // RETREAT.
                pace.answered += 1;
                let taken = if pace.answered >= JUDGED {
                    f64::from(pace.took) / f64::from(pace.answered)
                } else {
                    0.0
                };
                let rate = pace.rate * taken.clamp(RETREAT, EASE);
                pace.set(now, rate);
                pace.make_room(rtt);
            }
            Some(pace) => {
                let rate = sending.map_or(pace.rate, |s| s.min(pace.rate)).max(FLOOR);
                pace.peak = rate;
                pace.refused = true;
                pace.trickle = false;
                pace.set(now, rate * EASE);
                pace.make_room(rtt);
            }
        }
    }

    fn end_window(&mut self, now: Instant) {
        let window = std::mem::take(&mut self.window);
        let current = (window.samples > 0).then(|| window.rtt_sum / f64::from(window.samples));
        let mean = self.baseline.mean();
        let deviation = self.baseline.deviation();
        // Whether the limit (not the pace) is what held the publisher back.
        let binding = self.pace.as_ref().is_none_or(|p| self.limit <= p.room);
        let paced = self.pace.is_some();
        let risen = match (mean, current) {
            (Some(mean), Some(c)) => {
                window.saturated
                    && !paced
                    && c >= mean * (1.0 + FALL_RISE)
                    && c >= mean + DEVIATIONS * deviation
            }
            _ => false,
        };
        let held = match (mean, current) {
            (Some(mean), Some(c)) => c <= mean * (1.0 + RISE),
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
        } else if window.saturated && binding && (held || paced) {
            let step = if self.slow_start || paced {
                (self.limit as f64 * SLOW_START) as usize
            } else {
                1
            };
            self.limit = (self.limit + step.max(1)).min(self.ceiling);
        }
        if let Some(current) = current {
            self.baseline.update(current);
        }
        let rtt = self.baseline.mean().unwrap_or(0.0);
        let sending = self.sending(now);
        if let Some(pace) = &mut self.pace {
            // The pace held calls back, and calls went about as fast as it
            // let them (not slower, held back by the relay's own speed or
            // the limit): only then is the pace what limits, and worth
            // raising.
            let binding = sending.is_none_or(|s| s >= BINDING * pace.rate);
            if window.held && binding && !pace.refused {
                if let Some(began) = window.began {
                    pace.grown += now.saturating_duration_since(began).as_secs_f64();
                }
                // Above what the ceiling can carry, pacing means nothing.
                let cap = if rtt > 0.0 {
                    2.0 * self.ceiling as f64 / rtt
                } else {
                    f64::MAX
                };
                let rate = pace.curve().min(cap).max(FLOOR);
                if let Some(last) = pace.last.filter(|_| rate > pace.rate) {
                    // A faster pace lets the next call go sooner.
                    pace.next = pace.next.min(last + interval(rate));
                }
                pace.rate = rate;
            }
            pace.make_room(rtt);
        }
        let length = self.rtt().unwrap_or(MIN_WINDOW).max(MIN_WINDOW);
        self.window.began = Some(now);
        self.window.ends = Some(now + length);
    }
}

/// A destination's `concurrency` key: `"adaptive"` or a fixed number of
/// calls in flight.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ConcurrencyMode {
    /// Found from round-trip times and throttling ([`crate::pipeline::concurrency`]).
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
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;

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
        assert_eq!(limiter.paced_until(clock), None, "never paced");
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
        assert_eq!(limiter.rate(), None, "nothing pushed back: no pace");
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
    fn a_rising_rtt_shrinks_the_limit_and_neutral_outcomes_do_not() {
        let mut limiter = Limiter::new(Concurrency::Adaptive { ceiling: 64 });
        let mut clock = Instant::now();
        run(
            &mut limiter,
            &mut clock,
            30,
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
        assert_eq!(limiter.rate(), None);
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
        assert_eq!(limiter.rate(), None, "timeouts and 5xx do not pace");
    }

    /// 100 calls started `every` apart, then one answered throttled after `rtt`.
    fn throttled_after(limiter: &mut Limiter, clock: &mut Instant, every: Duration, rtt: Duration) {
        for _ in 0..100 {
            limiter.started(*clock);
            *clock += every;
        }
        limiter.finished(*clock, rtt, Signal::Throttled);
    }

    #[test]
    fn once_throttled_calls_are_spaced_by_the_pace() {
        let mut limiter = Limiter::new(Concurrency::Adaptive { ceiling: 500 });
        let mut clock = Instant::now();
        let rtt = Duration::from_millis(20);
        run(&mut limiter, &mut clock, 10, rtt, |_| Signal::Clean);
        // 100 calls a second for a while, then one throttled.
        throttled_after(&mut limiter, &mut clock, Duration::from_millis(10), rtt);
        let rate = limiter.rate().expect("paced");
        assert!((22.0..=28.0).contains(&rate), "a quarter of 100/s: {rate}");
        // The next call waits for the pace, and the one after it too.
        let first = limiter.paced_until(clock).expect("held back");
        assert!(first > clock);
        assert_eq!(limiter.paced_until(first), None);
        limiter.started(first);
        let second = limiter.paced_until(first).expect("held back");
        let gap = second - first;
        assert!(gap >= interval(rate) - Duration::from_micros(1), "{gap:?}");
        // Throttling of calls sent before the cut is already paid for.
        limiter.finished(clock + rtt / 2, rtt, Signal::Throttled);
        assert_eq!(limiter.rate(), Some(rate));
    }

    /// Messages a call: SNS's `PublishBatch` holds ten.
    const BATCH: f64 = 10.0;

    /// A quota of messages a second as a token bucket: `burst` seconds of it,
    /// full at the start (an account that was quiet).
    struct Bucket {
        rate: f64,
        capacity: f64,
        tokens: f64,
        at: f64,
    }

    impl Bucket {
        fn new(quota: f64, burst: f64) -> Self {
            let capacity = (quota * burst).max(BATCH);
            Self {
                rate: quota,
                capacity,
                tokens: capacity,
                at: 0.0,
            }
        }

        fn refill(&mut self, t: f64) {
            self.tokens = (self.tokens + (t - self.at) * self.rate).min(self.capacity);
            self.at = t;
        }

        fn take(&mut self, t: f64) -> bool {
            self.refill(t);
            let taken = self.tokens >= BATCH;
            if taken {
                self.tokens -= BATCH;
            }
            taken
        }

        /// The quota becomes `quota` at `t`, the bucket `burst` seconds of it.
        fn set(&mut self, t: f64, quota: f64, burst: f64) {
            self.refill(t);
            self.rate = quota;
            self.capacity = (quota * burst).max(BATCH);
            self.tokens = self.tokens.min(self.capacity);
        }
    }

    /// What a destination behind a bucket saw over a stretch of time.
    #[derive(Debug, Default)]
    struct Seen {
        calls: u64,
        throttled: u64,
        failed: u64,
        /// Messages accepted in each tenth of a second.
        accepted: Vec<u64>,
    }

    impl Seen {
        fn messages(&self) -> f64 {
            self.accepted.iter().sum::<u64>() as f64
        }
        fn throttled_share(&self) -> f64 {
            self.throttled as f64 / self.calls.max(1) as f64
        }
        /// Seconds until a second's worth of accepted messages first reached `rate`.
        fn reached(&self, rate: f64) -> Option<f64> {
            (10..=self.accepted.len())
                .find(|&i| self.accepted[i - 10..i].iter().sum::<u64>() as f64 >= rate)
                .map(|i| i as f64 / 10.0)
        }
    }

    /// A relay that always has batches to send, as fast as `cpu` calls a
    /// second, publishing to a destination `rtt` away (± 10 %, drawn from a
    /// seeded generator) through `limiter`. It works in slices of `slice`
    /// seconds (a process sharing its cores runs in bursts), each of which
    /// may start `cpu × slice` calls at once; its timer wakes on whole
    /// milliseconds, as tokio's does. Deterministic: the clock is simulated.
    struct Relay {
        limiter: Limiter,
        start: Instant,
        now: f64,
        rtt: f64,
        cpu: f64,
        slice: f64,
        /// Calls the current slice may still start, and its number.
        budget: f64,
        current: i64,
        /// (answer at, sent at, what it says), in nanoseconds.
        answers: BinaryHeap<Reverse<(u64, u64, Answer)>>,
        seed: u64,
        /// The share of calls the destination fails (5xx) whatever the rate.
        failing: f64,
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
    enum Answer {
        Taken,
        Throttled,
        Failed,
    }

    impl Relay {
        fn new(seed: u64) -> Self {
            Self {
                limiter: Limiter::new(Concurrency::Adaptive { ceiling: 500 }),
                start: Instant::now(),
                now: 0.0,
                rtt: 0.020,
                cpu: 10_000.0,
                slice: 0.005,
                budget: 0.0,
                current: -1,
                answers: BinaryHeap::new(),
                seed,
                failing: 0.0,
            }
        }

        fn at(&self, t: f64) -> Instant {
            self.start + Duration::from_secs_f64(t)
        }

        /// Uniform in [0, 1).
        fn random(&mut self) -> f64 {
            self.seed ^= self.seed << 13;
            self.seed ^= self.seed >> 7;
            self.seed ^= self.seed << 17;
            (self.seed >> 11) as f64 / (1u64 << 53) as f64
        }

        /// Run for `seconds` against `bucket` (`None`: no quota).
        fn run(&mut self, seconds: f64, mut bucket: Option<&mut Bucket>) -> Seen {
            let began = self.now;
            let end = began + seconds;
            let mut seen = Seen {
                accepted: vec![0; (seconds * 10.0).ceil() as usize],
                ..Seen::default()
            };
            while self.now < end {
                let mut wake = None;
                while self.answers.len() < self.limiter.limit() {
                    // Rounded, so that waking at a slice's start is in it.
                    let current = (self.now / self.slice + 1e-6).floor() as i64;
                    if current > self.current {
                        self.current = current;
                        self.budget = self.cpu * self.slice;
                    }
                    if self.budget < 1.0 {
                        wake = Some((self.current + 1) as f64 * self.slice);
                        break;
                    }
                    if let Some(at) = self.limiter.paced_until(self.at(self.now)) {
                        let at = (at - self.start).as_secs_f64();
                        wake = Some((at * 1000.0).ceil() / 1000.0);
                        break;
                    }
                    self.limiter.started(self.at(self.now));
                    if self.answers.len() + 1 >= self.limiter.limit() {
                        self.limiter.saturated();
                    }
                    self.budget -= 1.0;
                    seen.calls += 1;
                    let answer = if self.random() < self.failing {
                        seen.failed += 1;
                        Answer::Failed
                    } else if bucket.as_mut().is_none_or(|b| b.take(self.now)) {
                        let tenth = ((self.now - began) * 10.0) as usize;
                        if let Some(n) = seen.accepted.get_mut(tenth) {
                            *n += BATCH as u64;
                        }
                        Answer::Taken
                    } else {
                        seen.throttled += 1;
                        Answer::Throttled
                    };
                    let at = self.now + self.rtt * (0.9 + 0.2 * self.random());
                    let ns = |t: f64| (t * 1e9) as u64;
                    self.answers.push(Reverse((ns(at), ns(self.now), answer)));
                }
                let next = self
                    .answers
                    .peek()
                    .map(|Reverse((at, _, _))| *at as f64 / 1e9);
                self.now = match (next, wake) {
                    (Some(a), Some(w)) => a.min(w),
                    (a, w) => a.or(w).expect("work in flight or a wake-up"),
                }
                .max(self.now);
                while let Some(&Reverse((at, sent, answer))) = self.answers.peek() {
                    if at as f64 / 1e9 > self.now {
                        break;
                    }
                    self.answers.pop();
                    let signal = match answer {
                        Answer::Taken => Signal::Clean,
                        Answer::Throttled => Signal::Throttled,
                        Answer::Failed => Signal::BackPressure,
                    };
                    let now = self.start + Duration::from_nanos(at);
                    self.limiter
                        .finished(now, Duration::from_nanos(at - sent), signal);
                }
            }
            seen
        }
    }

    /// The issue's list of quotas at both ends of the burst sizes AWS might
    /// use: a tenth of a second of quota in the bucket, and five seconds.
    /// For each, 30 s at the quota (delivered against what the bucket gave:
    /// its burst and its refill), then 15 s at twice it.
    #[test]
    fn behind_a_token_bucket_the_pace_delivers_the_quota_and_few_calls_are_throttled() {
        for burst in [0.1, 5.0] {
            for quota in [300.0, 3_000.0, 30_000.0] {
                let mut relay = Relay::new(0x9e37_79b9_7f4a_7c15);
                let mut bucket = Bucket::new(quota, burst);
                let available = bucket.capacity + quota * 30.0;
                let seen = relay.run(30.0, Some(&mut bucket));
                let case = format!("quota {quota}/s, burst {burst} s: {seen:?}");
                let delivered = seen.messages() / available;
                assert!(delivered >= 0.85, "delivered {delivered:.3}; {case}");
                let share = seen.throttled_share();
                assert!(share <= 0.05, "throttled {share:.4}; {case}");
                assert_eq!(
                    seen.calls - seen.throttled,
                    seen.messages() as u64 / BATCH as u64
                );
                assert_eq!(seen.failed, 0);

                let raised = 2.0 * quota;
                bucket.set(relay.now, raised, burst);
                let seen = relay.run(15.0, Some(&mut bucket));
                let found = seen.reached(0.85 * raised);
                assert!(
                    found.is_some_and(|s| s <= 10.0),
                    "quota {quota} raised to {raised}/s: 85 % after {found:?} s; {seen:?}"
                );
                let share = seen.throttled_share();
                assert!(
                    share <= 0.05,
                    "after the raise: throttled {share:.4}; {case}"
                );
            }
        }
    }

    #[test]
    fn without_a_quota_the_relay_runs_at_its_own_speed_within_a_second() {
        let mut relay = Relay::new(7);
        relay.cpu = 6_000.0;
        let first = relay.run(1.0, None);
        let second = relay.run(1.0, None);
        assert_eq!(relay.limiter.rate(), None, "nothing pushed back");
        assert!(first.calls > 3_000, "{}", first.calls);
        assert!(second.calls >= 5_900, "{}", second.calls);
    }

    #[test]
    fn throttling_every_call_slows_the_pace_to_the_floor_and_its_end_restores_it() {
        let mut relay = Relay::new(11);
        relay.cpu = 6_000.0;
        relay.run(5.0, None);
        // Every call throttled for 5 s (a bucket that never refills).
        let mut down = Bucket::new(0.0, 0.0);
        down.tokens = 0.0;
        let outage = relay.run(5.0, Some(&mut down));
        assert_eq!(relay.limiter.rate(), Some(FLOOR));
        assert!(
            outage.calls < 400,
            "what was in flight, then a call a second: {}",
            outage.calls
        );
        // Back: within a second the next call goes, within a few the pace
        // is back near where it was.
        let after: Vec<u64> = (0..5).map(|_| relay.run(1.0, None).calls).collect();
        assert!(after[0] >= 1, "{after:?}");
        assert!(after[3] >= 5_000, "{after:?}");
    }

    #[test]
    fn a_pace_the_relay_cannot_keep_up_with_does_not_grow() {
        let mut limiter = Limiter::new(Concurrency::Adaptive { ceiling: 500 });
        let mut clock = Instant::now();
        let rtt = Duration::from_millis(20);
        run(&mut limiter, &mut clock, 10, rtt, |_| Signal::Clean);
        // 1,000 calls a second, then throttled: paced at a quarter of it.
        throttled_after(&mut limiter, &mut clock, Duration::from_millis(1), rtt);
        let paced = limiter.rate().expect("paced");
        // For 30 s the relay starts a call every 10 ms (its CPU taken by
        // something else), under half the pace, though the pace holds back
        // the next one each time: the pace is not what limits. It climbs
        // only while the starts before the throttling still count.
        for _ in 0..3_000 {
            clock += Duration::from_millis(10);
            if limiter.paced_until(clock).is_none() {
                limiter.started(clock);
            }
            limiter.paced_until(clock);
            limiter.finished(clock, rtt, Signal::Clean);
        }
        let rate = limiter.rate().expect("paced");
        assert!(rate < paced * 2.0, "{paced} then {rate}");
    }

    #[test]
    fn failures_whatever_the_rate_lower_the_limit_and_do_not_pace() {
        // A destination with a failing node: a fifth of calls answer 5xx.
        let mut relay = Relay::new(13);
        relay.cpu = 6_000.0;
        relay.failing = 0.2;
        let seen = relay.run(5.0, None);
        assert_eq!(relay.limiter.rate(), None);
        assert!(relay.limiter.limit() >= 1);
        // At least one call in flight, a round trip each.
        assert!(seen.calls as f64 >= 5.0 / relay.rtt, "{}", seen.calls);
        assert!(seen.failed > 0);
    }
}
