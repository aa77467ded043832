//! Prometheus metrics and the readiness state, one set per process.
//!
//! Names follow `outbox_relay_<name>_<unit>[_total]`, base units, low
//! cardinality labels (`path`, `outcome`, `state`, `status`). What each one
//! means, and alert rules on them: docs/operations.md.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::OnceLock;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use crate::time::unix_ms;

/// One label.
pub(crate) type Labels = Vec<(String, String)>;

fn label(key: &str, value: &str) -> Labels {
    vec![(key.to_owned(), value.to_owned())]
}

/// Why nothing flows: the `cause` label of `outbox_relay_stall_seconds`
/// (each one is explained, and found, in [`crate::postgres::stall`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum StallCause {
    /// The walsender waits for a slot of `synchronized_standby_slots`.
    StandbySlot,
    /// The slot's process waits for an open transaction to end.
    OpenTransaction,
    /// The slot's process waits for another lock.
    Lock,
    /// A prepared transaction: too old, or waited for.
    PreparedTransaction,
}

impl StallCause {
    /// Every cause, in the order stalls are reported.
    pub const ALL: [StallCause; 4] = [
        StallCause::StandbySlot,
        StallCause::OpenTransaction,
        StallCause::Lock,
        StallCause::PreparedTransaction,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            StallCause::StandbySlot => "standby_slot",
            StallCause::OpenTransaction => "open_transaction",
            StallCause::Lock => "lock",
            StallCause::PreparedTransaction => "prepared_transaction",
        }
    }
}

/// A counter family whose label values are known up front. Each known value
/// has its counter made once, at start-up: counting on the hot path neither
/// hashes nor allocates a label set (and every known series is exported
/// from the start, at 0).
struct Labelled {
    family: Family<Labels, Counter>,
    key: &'static str,
    known: Vec<(&'static str, Counter)>,
}

impl Labelled {
    fn new(key: &'static str, values: &[&'static str]) -> Self {
        let family = Family::<Labels, Counter>::default();
        let known = values
            .iter()
            .map(|v| (*v, family.get_or_create(&label(key, v)).clone()))
            .collect();
        Self { family, key, known }
    }

    fn inc_by(&self, value: &str, n: u64) {
        match self.known.iter().find(|(v, _)| *v == value) {
            Some((_, counter)) => {
                counter.inc_by(n);
            }
            None => {
                self.family.get_or_create(&label(self.key, value)).inc_by(n);
            }
        }
    }
}

/// A classic Prometheus histogram that takes a run of equal observations
/// in one step: a batch's events of one transaction share their latency,
/// and one lock a run replaces one a message (prometheus-client's
/// `Histogram` observes one value at a time). Exposed exactly as that
/// `Histogram` is: `_bucket{le}`, `_sum`, `_count`.
#[derive(Debug, Clone)]
pub struct Latency(std::sync::Arc<std::sync::Mutex<LatencyState>>);

#[derive(Debug)]
struct LatencyState {
    sum: f64,
    count: u64,
    /// (upper bound, observations in this bucket alone); the last is +Inf.
    buckets: Vec<(f64, u64)>,
}

impl Latency {
    fn new(bounds: impl Iterator<Item = f64>) -> Self {
        let buckets = bounds
            .filter(|b| b.is_finite())
            .chain(std::iter::once(f64::INFINITY))
            .map(|b| (b, 0))
            .collect();
        Self(std::sync::Arc::new(std::sync::Mutex::new(LatencyState {
            sum: 0.0,
            count: 0,
            buckets,
        })))
    }

    /// Observe `value` `n` times.
    pub fn observe_n(&self, value: f64, n: u64) {
        let mut state = self.0.lock().unwrap_or_else(|p| p.into_inner());
        state.sum += value * n as f64;
        state.count += n;
        // NaN fits no bound: the last bucket, as prometheus-client does.
        let last = state.buckets.len() - 1;
        let i = state
            .buckets
            .iter()
            .position(|(upper, _)| value <= *upper)
            .unwrap_or(last);
        state.buckets[i].1 += n;
    }
}

impl EncodeMetric for Latency {
    fn encode(&self, mut encoder: MetricEncoder) -> std::fmt::Result {
        let state = self.0.lock().unwrap_or_else(|p| p.into_inner());
        encoder.encode_histogram::<NoLabelSet>(state.sum, state.count, &state.buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// Every metric of the relay.
pub struct Metrics {
    registry: Registry,
    events_received: Labelled,
    envelopes_published: Labelled,
    /// Duration of one sink call (a PublishBatch).
    pub publish_duration: Histogram,
    /// Commit timestamp to confirmed publish.
    pub end_to_end_latency: Latency,
    /// Events received and not yet finished.
    pub in_flight: Gauge,
    /// Batches the sink may have in flight now (the concurrency limit).
    pub sink_concurrency_limit: Gauge,
    /// The concurrency limiter's baseline round-trip time of a sink call.
    pub sink_rtt: Gauge<f64, AtomicU64>,
    /// Bytes those events hold (`stream.max_in_flight_bytes`).
    pub in_flight_bytes: Gauge,
    /// Rows published and not yet marked or deleted (`lifecycle.max_unmarked`).
    pub unmarked: Gauge,
    /// Derived lifecycle: seconds since the vouched snapshot was stored (−1:
    /// none, or another lifecycle).
    pub derived_lag: Gauge<f64, AtomicU64>,
    /// Derived lifecycle: holes open (spans whose rows keep explicit states).
    pub derived_holes: Gauge,
    /// WAL between the server's current position and the slot's confirmed flush.
    pub confirmed_flush_lag: Gauge,
    /// WAL the slot holds (current position − restart_lsn).
    pub retained_wal: Gauge,
    /// `safe_wal_size` of the slot (−1 when unlimited).
    pub safe_wal_size: Gauge,
    slot_wal_status: Family<Labels, Gauge>,
    /// 1 while a replication session streams.
    pub streaming: Gauge,
    status_updates: Counter,
    status_updates_seen: AtomicU64,
    poller_runs: Counter,
    retention_runs: Counter,
    retention_deleted: Counter,
    rows: Family<Labels, Gauge>,
    slot_losses: Counter,
    /// Time from emitting a heartbeat to receiving it on the stream.
    pub heartbeat_round_trip: Histogram,
    /// How long the current stall of each cause has lasted ([`crate::postgres::stall`]).
    stall_seconds: Family<Labels, Gauge<f64, AtomicU64>>,
    /// Readiness inputs.
    pub health: Health,
}

/// What readiness is judged on.
#[derive(Default)]
pub struct Health {
    /// The stream runs on this instance.
    pub stream_enabled: AtomicBool,
    /// A session streams now.
    pub streaming: AtomicBool,
    /// The slot is missing or invalidated.
    pub slot_lost: AtomicBool,
    /// Last measured confirmed-flush lag in bytes (−1: unknown).
    pub lag_bytes: AtomicI64,
    /// Heartbeat timeout in ms (0: no heartbeat).
    pub heartbeat_timeout_ms: AtomicU64,
    /// How long the replication connection had been silent when a reply was
    /// last asked for; 0 while it is not silent.
    pub stream_silent_ms: AtomicU64,
    /// When the oldest heartbeat not yet seen back was sent (unix ms, 0: none).
    pub heartbeat_pending_since: AtomicU64,
    /// The first stall on now, with its fix ([`crate::postgres::stall`]).
    pub stall: std::sync::Mutex<Option<String>>,
}

impl Metrics {
    /// Every metric made and registered, in the order of the exposition.
    fn new() -> Self {
        let mut metrics = Self {
            registry: Registry::default(),
            events_received: Labelled::new("path", &["replication", "poller"]),
            envelopes_published: Labelled::new(
                "outcome",
                &["delivered", "rejected", "retried", "skipped"],
            ),
            publish_duration: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            end_to_end_latency: Latency::new(exponential_buckets(0.001, 2.0, 18)),
            in_flight: Gauge::default(),
            sink_concurrency_limit: Gauge::default(),
            sink_rtt: Gauge::<f64, AtomicU64>::default(),
            in_flight_bytes: Gauge::default(),
            unmarked: Gauge::default(),
            derived_lag: Gauge::<f64, AtomicU64>::default(),
            derived_holes: Gauge::default(),
            confirmed_flush_lag: Gauge::default(),
            retained_wal: Gauge::default(),
            safe_wal_size: Gauge::default(),
            slot_wal_status: Family::<Labels, Gauge>::default(),
            streaming: Gauge::default(),
            status_updates: Counter::default(),
            poller_runs: Counter::default(),
            retention_runs: Counter::default(),
            retention_deleted: Counter::default(),
            rows: Family::<Labels, Gauge>::default(),
            slot_losses: Counter::default(),
            heartbeat_round_trip: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            stall_seconds: Family::<Labels, Gauge<f64, AtomicU64>>::default(),
            status_updates_seen: AtomicU64::new(0),
            health: Health {
                lag_bytes: AtomicI64::new(-1),
                ..Health::default()
            },
        };
        metrics.register_delivery();
        metrics.register_slot();
        metrics.register_background();
        metrics.register_readiness();
        metrics
    }

    /// Events on their way: received, published, in flight, and the sink's pace.
    fn register_delivery(&mut self) {
        self.registry.register(
            "outbox_relay_events_received",
            "Outbox events received, by path (replication, poller)",
            self.events_received.family.clone(),
        );
        self.registry.register(
            "outbox_relay_envelopes_published",
            "Envelopes by outcome: delivered, rejected (recorded FAILED/DEAD), retried (transient failure), skipped (filtered out)",
            self.envelopes_published.family.clone(),
        );
        self.registry.register_with_unit(
            "outbox_relay_publish_duration",
            "Duration of one sink call (one PublishBatch)",
            Unit::Seconds,
            self.publish_duration.clone(),
        );
        self.registry.register_with_unit(
            "outbox_relay_end_to_end_latency",
            "From the transaction's commit timestamp to the sink's confirmation",
            Unit::Seconds,
            self.end_to_end_latency.clone(),
        );
        self.registry.register(
            "outbox_relay_in_flight_envelopes",
            "Events received and not yet delivered or recorded",
            self.in_flight.clone(),
        );
        self.registry.register(
            "outbox_relay_sink_concurrency_limit",
            "Sink calls (batches) allowed in flight now: fixed, or found by the adaptive limiter",
            self.sink_concurrency_limit.clone(),
        );
        self.registry.register_with_unit(
            "outbox_relay_sink_rtt",
            "Baseline round-trip time of one sink call, as the adaptive limiter measures it",
            Unit::Seconds,
            self.sink_rtt.clone(),
        );
        self.registry.register_with_unit(
            "outbox_relay_in_flight",
            "Bytes the events received and not yet delivered or recorded hold (row, event, envelope, the sink's copy)",
            Unit::Bytes,
            self.in_flight_bytes.clone(),
        );
        self.registry.register(
            "outbox_relay_unmarked_rows",
            "Rows published or filtered out and not yet marked or deleted in the table",
            self.unmarked.clone(),
        );
        self.derived_lag.set(-1.0);
        self.registry.register_with_unit(
            "outbox_relay_derived_lag",
            "Derived lifecycle: age of the snapshot the relay vouched for (rows committed since are not yet derived published); -1 when there is none",
            Unit::Seconds,
            self.derived_lag.clone(),
        );
        self.registry.register(
            "outbox_relay_derived_holes",
            "Derived lifecycle: holes open (spans of transactions a snapshot may not vouch for; their rows keep explicit states)",
            self.derived_holes.clone(),
        );
    }

    /// The slot's WAL and the replication session.
    fn register_slot(&mut self) {
        self.registry.register_with_unit(
            "outbox_relay_confirmed_flush_lag",
            "pg_current_wal_lsn() - confirmed_flush_lsn of the slot",
            Unit::Bytes,
            self.confirmed_flush_lag.clone(),
        );
        self.registry.register_with_unit(
            "outbox_relay_retained_wal",
            "WAL the slot holds: pg_current_wal_lsn() - restart_lsn",
            Unit::Bytes,
            self.retained_wal.clone(),
        );
        self.registry.register_with_unit(
            "outbox_relay_slot_safe_wal_size",
            "WAL that can still be written before the slot is invalidated (-1: no limit)",
            Unit::Bytes,
            self.safe_wal_size.clone(),
        );
        self.registry.register(
            "outbox_relay_slot_wal_status",
            "1 for the slot's current wal_status (reserved, extended, unreserved, lost, missing)",
            self.slot_wal_status.clone(),
        );
        self.registry.register(
            "outbox_relay_streaming",
            "1 while a replication session streams",
            self.streaming.clone(),
        );
        self.registry.register(
            "outbox_relay_status_updates_sent",
            "Standby status updates (flush positions) sent to Postgres",
            self.status_updates.clone(),
        );
    }

    /// The poller's and retention's runs, and the table's rows.
    fn register_background(&mut self) {
        self.registry.register(
            "outbox_relay_poller_runs",
            "Poller rounds",
            self.poller_runs.clone(),
        );
        self.registry.register(
            "outbox_relay_retention_runs",
            "Retention runs",
            self.retention_runs.clone(),
        );
        self.registry.register(
            "outbox_relay_retention_deleted_rows",
            "Published rows deleted by retention",
            self.retention_deleted.clone(),
        );
        self.registry.register(
            "outbox_relay_rows",
            "Outbox rows by publish state (PENDING, FAILED, DEAD)",
            self.rows.clone(),
        );
    }

    /// What readiness watches: slot losses, heartbeats, stalls.
    fn register_readiness(&mut self) {
        self.registry.register(
            "outbox_relay_slot_losses",
            "Times the slot was found missing or invalidated",
            self.slot_losses.clone(),
        );
        self.registry.register_with_unit(
            "outbox_relay_heartbeat_round_trip",
            "From emitting a heartbeat message to receiving it on the replication stream",
            Unit::Seconds,
            self.heartbeat_round_trip.clone(),
        );
        for cause in StallCause::ALL {
            let _ = self
                .stall_seconds
                .get_or_create(&label("cause", cause.label()));
        }
        self.registry.register_with_unit(
            "outbox_relay_stall",
            "How long the stall of each cause (standby_slot, open_transaction, lock, prepared_transaction) has lasted; 0: none",
            Unit::Seconds,
            self.stall_seconds.clone(),
        );
    }

    /// `n` events came in by `path` (`replication` or `poller`).
    pub fn received(&self, path: &str, n: u64) {
        if n > 0 {
            self.events_received.inc_by(path, n);
        }
    }

    /// An envelope's outcome: `delivered`, `rejected`, `retried` or `skipped`.
    pub fn published(&self, outcome: &str, n: u64) {
        self.envelopes_published.inc_by(outcome, n);
    }

    /// The end-to-end latency of `n` events committed at `commit_time` (µs
    /// since 2000-01-01) and delivered at `now_unix_micros` (µs since the
    /// Unix epoch, [`crate::time::unix_micros_now`], read once for a batch);
    /// unknown commit times (0) are not observed.
    pub fn delivered_after_commit_at(&self, commit_time: i64, now_unix_micros: i64, n: u64) {
        if commit_time == 0 || n == 0 {
            return;
        }
        let micros = now_unix_micros - crate::time::unix_micros_from_pg(commit_time);
        self.end_to_end_latency
            .observe_n(micros.max(0) as f64 / 1e6, n);
    }

    /// The replication client's cumulative count of status updates.
    pub fn status_updates_total(&self, total: u64) {
        let seen = self.status_updates_seen.swap(total, Ordering::Relaxed);
        if total > seen {
            self.status_updates.inc_by(total - seen);
        }
    }

    /// A poller round ran.
    pub fn poller_ran(&self) {
        self.poller_runs.inc();
    }

    /// A retention run deleted `rows`.
    pub fn retention_ran(&self, rows: u64) {
        self.retention_runs.inc();
        self.retention_deleted.inc_by(rows);
    }

    /// The slot's state as the monitor saw it.
    pub fn slot(&self, wal_status: &str, lag: i64, retained: i64, safe: i64) {
        for status in ["reserved", "extended", "unreserved", "lost", "missing"] {
            self.slot_wal_status
                .get_or_create(&label("status", status))
                .set(i64::from(status == wal_status));
        }
        self.confirmed_flush_lag.set(lag);
        self.retained_wal.set(retained);
        self.safe_wal_size.set(safe);
        let lost = matches!(wal_status, "lost" | "missing");
        if lost && !self.health.slot_lost.swap(true, Ordering::Relaxed) {
            self.slot_losses.inc();
        } else if !lost {
            self.health.slot_lost.store(false, Ordering::Relaxed);
        }
        self.health.lag_bytes.store(lag, Ordering::Relaxed);
    }

    /// Rows in `state`.
    pub fn rows(&self, state: &str, n: i64) {
        self.rows.get_or_create(&label("state", state)).set(n);
    }

    /// How long the stall of `cause` has lasted (0: none).
    pub fn stall_seconds(&self, cause: StallCause, seconds: f64) {
        self.stall_seconds
            .get_or_create(&label("cause", cause.label()))
            .set(seconds);
    }

    /// Whether a session streams.
    pub fn set_streaming(&self, on: bool) {
        self.streaming.set(i64::from(on));
        self.health.streaming.store(on, Ordering::Relaxed);
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }

    /// Why the relay is not ready, if it is not (`max_lag` in bytes).
    pub fn not_ready(&self, max_lag: i64) -> Option<String> {
        let h = &self.health;
        if h.slot_lost.load(Ordering::Relaxed) {
            return Some("the replication slot is missing or invalidated".into());
        }
        if let Some(stall) = h.stall.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            return Some(format!("stalled: {stall}"));
        }
        if h.stream_enabled.load(Ordering::Relaxed) && !h.streaming.load(Ordering::Relaxed) {
            return Some("the replication stream is not running".into());
        }
        let silent = h.stream_silent_ms.load(Ordering::Relaxed);
        if silent > 0 {
            return Some(format!(
                "the replication connection has been silent for {} s; a reply was asked for",
                silent / 1000
            ));
        }
        let timeout = h.heartbeat_timeout_ms.load(Ordering::Relaxed);
        let pending = h.heartbeat_pending_since.load(Ordering::Relaxed);
        if timeout > 0 && pending > 0 && unix_ms().saturating_sub(pending) > timeout {
            return Some(format!(
                "a heartbeat sent {} ms ago has not come back through the stream",
                unix_ms().saturating_sub(pending)
            ));
        }
        let lag = h.lag_bytes.load(Ordering::Relaxed);
        if lag > max_lag {
            return Some(format!("slot lag {lag} bytes is over {max_lag}"));
        }
        None
    }
}

impl Metrics {
    /// A heartbeat was emitted at `sent_ms`.
    pub fn heartbeat_sent(&self, sent_ms: u64) {
        let _ = self.health.heartbeat_pending_since.compare_exchange(
            0,
            sent_ms,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }

    /// A heartbeat emitted at `sent_ms` came back.
    pub fn heartbeat_seen(&self, sent_ms: u64) {
        self.heartbeat_round_trip
            .observe(unix_ms().saturating_sub(sent_ms) as f64 / 1e3);
        // Everything sent up to it has come back (the stream is in order).
        let _ = self.health.heartbeat_pending_since.fetch_update(
            Ordering::Relaxed,
            Ordering::Relaxed,
            |pending| (pending != 0 && pending <= sent_ms).then_some(0),
        );
    }
}

/// The process's metrics.
pub fn get() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_uses_the_documented_names() {
        let m = Metrics::new();
        m.received("replication", 1);
        m.published("delivered", 3);
        m.slot("reserved", 10, 20, -1);
        let text = m.encode();
        for name in [
            "outbox_relay_events_received_total{path=\"replication\"} 1",
            "outbox_relay_envelopes_published_total{outcome=\"delivered\"} 3",
            "outbox_relay_confirmed_flush_lag_bytes 10",
            "outbox_relay_retained_wal_bytes 20",
            "outbox_relay_slot_wal_status{status=\"reserved\"} 1",
            "outbox_relay_publish_duration_seconds_bucket",
            "outbox_relay_end_to_end_latency_seconds_count",
            "outbox_relay_stall_seconds{cause=\"standby_slot\"} 0",
        ] {
            assert!(text.contains(name), "{name} missing from:\n{text}");
        }
        assert!(m.not_ready(100).is_none());
        m.slot("lost", 10, 20, 0);
        assert!(m.not_ready(100).unwrap().contains("invalidated"));
    }

    /// A run observed at once is exposed as prometheus-client's histogram
    /// exposes the same values observed one at a time.
    #[test]
    fn a_latency_run_reads_as_its_observations_one_by_one() {
        let bounds = || exponential_buckets(0.001, 2.0, 18);
        let ours = Latency::new(bounds());
        let theirs = Histogram::new(bounds());
        for (value, n) in [
            (0.0004, 3),
            (0.0031, 1),
            (0.5, 1000),
            (7.0, 2),
            (1e9, 5),
            (0.004, 2),
            (0.002, 0),
        ] {
            ours.observe_n(value, n);
            (0..n).for_each(|_| theirs.observe(value));
        }
        fn expose(metric: impl prometheus_client::registry::Metric) -> String {
            let mut registry = Registry::default();
            registry.register_with_unit("l", "latency", Unit::Seconds, metric);
            let mut text = String::new();
            encode(&mut text, &registry).unwrap();
            text
        }
        // The sums may differ in the last digits (n × v against v added n times).
        let split = |text: String| {
            let (sum, rest): (Vec<&str>, Vec<&str>) =
                text.lines().partition(|l| l.starts_with("l_seconds_sum "));
            let sum: f64 = sum[0]["l_seconds_sum ".len()..].parse().unwrap();
            (sum, rest.join("\n"))
        };
        let ((sum_a, a), (sum_b, b)) = (split(expose(ours)), split(expose(theirs)));
        assert!(a.contains("l_seconds_count 1013"), "{a}");
        assert_eq!(a, b);
        assert!(
            (sum_a - sum_b).abs() <= sum_b * 1e-12,
            "{sum_a} against {sum_b}"
        );
    }
}
