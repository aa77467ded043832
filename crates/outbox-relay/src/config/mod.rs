//! Configuration: one TOML file, every key overridable from the environment.
//!
//! A key `[section] key` is overridden by the environment variable
//! `OUTBOX_RELAY__SECTION__KEY` (upper case, sections joined by `__`). The
//! variable's value is read as a TOML value when it is one (`true`, `42`,
//! `["a", "b"]`, `"quoted"`) and as a plain string otherwise, so
//! `OUTBOX_RELAY__POSTGRES__URL=postgres://…` needs no quotes.
//!
//! Loading fails on the first key that is unknown or of the wrong type, naming
//! the key (and the variable, when it came from the environment);
//! [`Config::validate`] then reports every remaining problem at once, each with
//! its key. Secrets (the Postgres URL, passwords) are held in [`Secret`], whose
//! `Debug` and `Display` print `***`, so a logged config never leaks them.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use serde::Deserialize;

pub(crate) mod allow;
pub(crate) mod columns;
pub(crate) mod settings;
pub(crate) mod tls;
pub(crate) mod value;

use crate::config::settings::Settings;
use crate::sink::Sections;

pub(crate) use crate::sink::Kind as SinkKind;
pub(crate) use columns::ColumnMapping;
#[cfg(test)]
use value::field_names;
pub(crate) use value::{de_duration, parse_duration, Secret};

/// Every key at its default, commented: what `outbox-relay config` prints.
/// A test keeps it equal to the real defaults and complete: every key the
/// structs declare (`keys`, compiled for the tests only) is in it.
pub(crate) const DEFAULT_CONFIG: &str = include_str!("default-config.toml");

/// Prefix of the environment variables that override configuration keys.
pub(crate) const ENV_PREFIX: &str = "OUTBOX_RELAY__";

/// Default replication slot name.
pub(crate) const DEFAULT_SLOT: &str = "outbox_relay";
/// Default publication name.
pub(crate) const DEFAULT_PUBLICATION: &str = "outbox_relay";
/// Default outbox table.
pub(crate) const DEFAULT_TABLE: &str = "public.outbox";
/// Default `application_name` of the relay's connections.
pub(crate) const DEFAULT_APPLICATION_NAME: &str = "outbox-relay";
/// Default `postgres.receive_timeout`, PostgreSQL's `wal_receiver_timeout`.
pub(crate) const DEFAULT_RECEIVE_TIMEOUT: Duration = Duration::from_secs(60);
/// Default ceiling of events received but not yet finished by the sink.
pub(crate) const DEFAULT_MAX_IN_FLIGHT: usize = 10_000;
/// Default ceiling of the bytes those events hold (`stream.max_in_flight_bytes`):
/// with the relay's own few tens of MiB, it fits a 256 MiB container.
pub(crate) const DEFAULT_MAX_IN_FLIGHT_BYTES: usize = 64 << 20;
/// Default ceiling of rows published but not yet marked (`lifecycle.max_unmarked`).
pub(crate) const DEFAULT_MAX_UNMARKED: usize = 50_000;
/// Default time a graceful shutdown waits for in-flight events.
pub(crate) const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);
/// Default age at which a prepared transaction is a stall
/// (`stream.prepared_transaction_max_age`).
pub(crate) const DEFAULT_PREPARED_TRANSACTION_MAX_AGE: Duration = Duration::from_secs(300);
/// Default pause after a small read of the stream (`stream.coalesce`).
pub(crate) const DEFAULT_COALESCE: Duration = Duration::from_millis(1);
/// Longest `stream.coalesce` allowed.
pub(crate) const MAX_COALESCE: Duration = Duration::from_millis(10);
/// Default listen address of the metrics and health endpoint.
pub(crate) const DEFAULT_HTTP_LISTEN: &str = "127.0.0.1:9187";
/// Default first retry delay.
pub(crate) const DEFAULT_RETRY_INITIAL: Duration = Duration::from_millis(100);
/// Default retry delay ceiling.
pub(crate) const DEFAULT_RETRY_MAX: Duration = Duration::from_secs(30);

/// The whole configuration tree.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The source database.
    #[serde(default)]
    pub postgres: PostgresConfig,
    /// Which outbox column holds which part of an event.
    #[serde(default)]
    pub columns: ColumnMapping,
    /// Where envelopes go.
    #[serde(default)]
    pub sink: SinkConfig,
    /// Each destination's own section (`[sns]`, `[sqs]`, `[webhook]`, …),
    /// read from the file beside the others ([`Sections::NAMES`]).
    #[serde(skip)]
    pub destinations: Sections,
    /// How an event becomes a message.
    #[serde(default)]
    pub envelope: EnvelopeConfig,
    /// Flow control of the replication stream.
    #[serde(default)]
    pub stream: StreamConfig,
    /// Retry policy for transient sink failures.
    #[serde(default)]
    pub retry: RetryConfig,
    /// What happens to rows after publishing; slot recovery.
    #[serde(default)]
    pub lifecycle: LifecycleConfig,
    /// The fallback poller.
    #[serde(default)]
    pub poller: PollerConfig,
    /// The retention worker.
    #[serde(default)]
    pub retention: RetentionConfig,
    /// Events not to publish.
    #[serde(default)]
    pub filter: FilterConfig,
    /// Metrics and health endpoint.
    #[serde(default)]
    pub http: HttpConfig,
    /// Logging.
    #[serde(default)]
    pub log: LogConfig,
    /// The async runtime.
    #[serde(default)]
    pub runtime: RuntimeConfig,
}

/// `[postgres]`: the database whose outbox is relayed.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PostgresConfig {
    /// Connection URL, `postgres://user[:password]@host[:port]/database[?sslmode=…]`.
    pub url: Option<Secret>,
    /// Password, when not in the URL (best from `OUTBOX_RELAY__POSTGRES__PASSWORD`).
    pub password: Option<Secret>,
    /// File holding the password (its first line), e.g. a mounted secret.
    pub password_file: Option<PathBuf>,
    /// Logical replication slot (plugin pgoutput).
    pub slot: String,
    /// Publication that carries the outbox table's inserts.
    pub publication: String,
    /// The outbox table, `schema.table` or `table` (schema `public`).
    pub table: String,
    /// `application_name` of the relay's sessions.
    pub application_name: String,
    /// How long a connection to Postgres may stay silent while the relay
    /// waits on it (the stream: for anything, with a reply asked for at half
    /// of it; SQL: for the answer to a request sent) before it is taken for
    /// dead and opened again; also bounds TCP keepalives and unacknowledged
    /// sends. `0s` switches the bound off (TCP's own limits remain).
    #[serde(deserialize_with = "de_duration")]
    pub receive_timeout: Duration,
    /// Create the slot with `failover = true` (PostgreSQL 17+), so a standby
    /// with `sync_replication_slots = on` keeps a copy and a promoted standby
    /// has it (`setup`, and `lifecycle.recreate_slot`).
    pub failover_slot: bool,
    /// TLS mode of both connections: `disable`, `prefer` (default), `require`,
    /// `verify-ca`, `verify-full` (or `sslmode=` in the URL).
    pub ssl_mode: Option<String>,
    /// CA certificates (PEM) that verify the server, or `system` for the
    /// operating system's trust store (which makes `verify-full` the default
    /// and the only mode allowed); required by `verify-ca` and `verify-full`.
    pub ssl_root_cert: Option<String>,
    /// Client certificate (PEM) for servers that ask for one.
    pub ssl_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    pub ssl_key: Option<PathBuf>,
    /// How TLS starts: `postgres` (default: SSLRequest first) or `direct`
    /// (PostgreSQL 17+, needs `ssl_mode` `require` or stronger); or
    /// `sslnegotiation=` in the URL.
    pub ssl_negotiation: Option<String>,
    /// SCRAM channel binding of both connections: `disable`, `prefer`
    /// (default), `require` (or `channel_binding=` in the URL).
    pub channel_binding: Option<String>,
}

impl PostgresConfig {
    /// The TLS settings, from the URL and the `ssl_*` keys; problems name their key.
    pub fn tls(&self) -> Result<tls::TlsSettings, Vec<(String, String)>> {
        let (rest, url) = self
            .url
            .as_ref()
            .map(|u| tls::split_url(u.expose()))
            .unwrap_or_default();
        let unix_socket = tokio_postgres::Config::from_str(&rest).is_ok_and(|c| {
            matches!(
                c.get_hosts().first(),
                Some(tokio_postgres::config::Host::Unix(_))
            )
        });
        tls::TlsSettings::resolve(
            &url,
            tls::KeyValues {
                ssl_mode: self.ssl_mode.as_deref(),
                ssl_root_cert: self.ssl_root_cert.as_deref(),
                ssl_cert: self.ssl_cert.as_deref(),
                ssl_key: self.ssl_key.as_deref(),
                ssl_negotiation: self.ssl_negotiation.as_deref(),
                channel_binding: self.channel_binding.as_deref(),
                unix_socket,
            },
        )
    }

    /// The `[postgres]` problems: the URL and its TLS, the password, names.
    fn check(&self, bad: &mut dyn FnMut(&str, String)) {
        match &self.url {
            None => bad(
                "postgres.url",
                "missing: set it in [postgres] or with OUTBOX_RELAY__POSTGRES__URL, \
                 e.g. postgres://outbox_relay@localhost:5432/app"
                    .into(),
            ),
            Some(url) => {
                if let Err(message) = check_url(url.expose()) {
                    bad("postgres.url", message);
                }
                if let Err(problems) = self.tls() {
                    for (key, message) in problems {
                        bad(&key, message);
                    }
                }
            }
        }
        if self.password.is_some() && self.password_file.is_some() {
            bad(
                "postgres.password_file",
                "set either postgres.password or postgres.password_file, not both".into(),
            );
        }
        for (key, value) in [
            ("postgres.slot", &self.slot),
            ("postgres.publication", &self.publication),
        ] {
            if let Err(message) = check_identifier(value) {
                bad(key, message);
            }
        }
        if let Err(message) = TableName::parse(&self.table) {
            bad("postgres.table", message);
        }
        if !self.receive_timeout.is_zero() && self.receive_timeout < Duration::from_secs(2) {
            bad(
                "postgres.receive_timeout",
                "must be at least 2s (a reply is asked for at half of it), or 0s to switch it off"
                    .into(),
            );
        }
    }
}

impl Default for PostgresConfig {
    fn default() -> Self {
        Self {
            url: None,
            password: None,
            password_file: None,
            slot: DEFAULT_SLOT.to_owned(),
            publication: DEFAULT_PUBLICATION.to_owned(),
            table: DEFAULT_TABLE.to_owned(),
            application_name: DEFAULT_APPLICATION_NAME.to_owned(),
            receive_timeout: DEFAULT_RECEIVE_TIMEOUT,
            failover_slot: false,
            ssl_mode: None,
            ssl_root_cert: None,
            ssl_cert: None,
            ssl_key: None,
            ssl_negotiation: None,
            channel_binding: None,
        }
    }
}

/// `[sink]`: where envelopes are delivered.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SinkConfig {
    /// The destination: `stdout` (NDJSON, one envelope a line), `sns`,
    /// `sqs`, `eventbridge`, `kinesis` or `webhook` ([`SinkKind`]).
    pub kind: SinkKind,
}

/// `[envelope]`: the message format.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EnvelopeConfig {
    /// `cloudevents` (structured JSON, CloudEvents 1.0) or `raw` (the payload as is).
    pub format: EnvelopeFormat,
    /// CloudEvents `source`; default `/<database>/<schema>.<table>`.
    pub source: Option<String>,
}

/// Envelope formats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EnvelopeFormat {
    /// CloudEvents 1.0 structured JSON.
    #[default]
    Cloudevents,
    /// The payload alone.
    Raw,
}

/// `[stream]`: flow control of the replication stream.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StreamConfig {
    /// Run the replication stream on this instance.
    pub enabled: bool,
    /// Emit a heartbeat (`pg_logical_emit_message`) this often and watch it
    /// come back through the stream; 0 switches it off.
    #[serde(deserialize_with = "de_duration")]
    pub heartbeat_interval: Duration,
    /// `/readyz` fails when a heartbeat has not come back within this.
    #[serde(deserialize_with = "de_duration")]
    pub heartbeat_timeout: Duration,
    /// Events received but not yet finished by the sink, at most. At the
    /// ceiling the relay stops reading the stream (backpressure).
    pub max_in_flight: usize,
    /// Bytes those events hold (the replicated row, the event, the encoded
    /// envelope and the sink's copy of it), at most; at the ceiling the relay stops reading too. An
    /// event larger than the whole budget still passes: it may exceed it by
    /// one event.
    pub max_in_flight_bytes: usize,
    /// How long a graceful shutdown waits for in-flight events before it
    /// exits without acknowledging them (they are sent again on restart).
    #[serde(deserialize_with = "de_duration")]
    pub shutdown_timeout: Duration,
    /// After a read of fewer than a few dozen events that took all there was,
    /// pause this long before the next, so that the next read takes more at
    /// once: fewer wake-ups and system calls a row, about this much more
    /// latency; 0 switches it off.
    /// See `replication::COALESCE_BELOW`.
    #[serde(deserialize_with = "de_duration")]
    pub coalesce: Duration,
    /// A prepared transaction of the slot's database older than this is a
    /// stall ([`crate::postgres::stall`]): logged, in `/readyz`, the metric and
    /// `status`; 0 switches the check off.
    #[serde(deserialize_with = "de_duration")]
    pub prepared_transaction_max_age: Duration,
}

impl Default for StreamConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            heartbeat_interval: Duration::ZERO,
            heartbeat_timeout: Duration::from_secs(60),
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            max_in_flight_bytes: DEFAULT_MAX_IN_FLIGHT_BYTES,
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            coalesce: DEFAULT_COALESCE,
            prepared_transaction_max_age: DEFAULT_PREPARED_TRANSACTION_MAX_AGE,
        }
    }
}

/// What to do with a row once it is published.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnPublished {
    /// Write nothing: a row is published when its transaction id
    /// (`relay_txid`) is visible in the snapshot the relay vouched for
    /// (`postgres::outbox::derived`); rows the stream did not publish keep
    /// explicit states. On a table without `relay_txid` (or without the
    /// position table) the relay runs as `Mark` and says why.
    #[default]
    Derive,
    /// `publish_state = 'PUBLISHED'`, `published_at = now()`, row by row.
    Mark,
    /// Delete the row.
    Delete,
    /// Leave the table alone (application-managed, Debezium style).
    None,
}

impl OnPublished {
    /// Whether the relay keeps each row's state on the row (`derive` and
    /// `mark`): the poller, `replay` and retention then write explicit states.
    pub(crate) fn tracks_rows(self) -> bool {
        matches!(self, Self::Derive | Self::Mark)
    }
}

/// `[lifecycle]`: rows after publishing, and slot recovery.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LifecycleConfig {
    /// `derive`, `mark`, `delete` or `none`.
    pub on_published: OnPublished,
    /// Rows published (or filtered out) but not yet marked or deleted, at
    /// most; at the ceiling the relay stops reading the stream until marking
    /// catches up.
    pub max_unmarked: usize,
    /// Create the slot when it is missing, or drop and create it when it is
    /// invalidated; the poller then sweeps the rows the old slot held.
    pub recreate_slot: bool,
}

impl Default for LifecycleConfig {
    fn default() -> Self {
        Self {
            on_published: OnPublished::default(),
            max_unmarked: DEFAULT_MAX_UNMARKED,
            recreate_slot: false,
        }
    }
}

/// `[poller]`: the fallback poller (mark and delete modes).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PollerConfig {
    /// Run the poller on this instance.
    pub enabled: bool,
    /// Time between rounds.
    #[serde(deserialize_with = "de_duration")]
    pub interval: Duration,
    /// A PENDING row older than this is taken as missed by the stream
    /// (once the active slot passed it, or the slot has been inactive this
    /// long: `pipeline::poller`).
    #[serde(deserialize_with = "de_duration")]
    pub grace: Duration,
    /// Rows claimed per round.
    pub batch_size: usize,
    /// Failed attempts after which a row is DEAD.
    pub max_attempts: i32,
    /// Age after which a failing row is DEAD; 0 = no limit.
    #[serde(deserialize_with = "de_duration")]
    pub max_age: Duration,
    /// Delay before the first retry of a FAILED row; grows by `retry.multiplier`.
    #[serde(deserialize_with = "de_duration")]
    pub backoff_initial: Duration,
    /// Ceiling of that delay; also how long a row whose state the table
    /// refused to record is left out of the poller's claims.
    #[serde(deserialize_with = "de_duration")]
    pub backoff_max: Duration,
    /// Topic that receives a notice for each row that goes DEAD; empty = none.
    pub dead_letter_topic: String,
}

impl Default for PollerConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            interval: Duration::from_secs(5),
            grace: Duration::from_secs(300),
            batch_size: 100,
            max_attempts: 10,
            max_age: Duration::ZERO,
            backoff_initial: Duration::from_secs(10),
            backoff_max: Duration::from_secs(3600),
            dead_letter_topic: String::new(),
        }
    }
}

/// `[retention]`: deleting published rows.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetentionConfig {
    /// Run retention on this instance (mark mode only).
    pub enabled: bool,
    /// Keep PUBLISHED rows this long after publishing.
    #[serde(deserialize_with = "de_duration")]
    pub keep: Duration,
    /// Time between runs.
    #[serde(deserialize_with = "de_duration")]
    pub interval: Duration,
    /// Rows deleted per transaction.
    pub batch_size: usize,
    /// On a partitioned table, detach and drop partitions that hold only
    /// expired PUBLISHED (or SKIPPED) rows instead of deleting rows.
    pub drop_partitions: bool,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            keep: Duration::from_secs(7 * 86_400),
            interval: Duration::from_secs(15),
            batch_size: 1000,
            drop_partitions: false,
        }
    }
}

/// `[filter]`: events that are not published (counted, acknowledged, and
/// marked SKIPPED in mark mode). An empty include list includes everything.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FilterConfig {
    /// Publish only these event types.
    pub include_event_types: Vec<String>,
    /// Never publish these event types.
    pub exclude_event_types: Vec<String>,
    /// Publish only these aggregate types.
    pub include_aggregate_types: Vec<String>,
    /// Never publish these aggregate types.
    pub exclude_aggregate_types: Vec<String>,
}

impl FilterConfig {
    /// Whether an event of these types is published.
    pub fn admits(&self, event_type: &str, aggregate_type: &str) -> bool {
        let listed = |list: &[String], v: &str| list.iter().any(|x| x == v);
        (self.include_event_types.is_empty() || listed(&self.include_event_types, event_type))
            && !listed(&self.exclude_event_types, event_type)
            && (self.include_aggregate_types.is_empty()
                || listed(&self.include_aggregate_types, aggregate_type))
            && !listed(&self.exclude_aggregate_types, aggregate_type)
    }
}

/// `[retry]`: capped, jittered exponential backoff for transient failures.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// First delay.
    #[serde(deserialize_with = "de_duration")]
    pub initial: Duration,
    /// Ceiling of the delay.
    #[serde(deserialize_with = "de_duration")]
    pub max: Duration,
    /// Growth factor per attempt (≥ 1).
    pub multiplier: f64,
    /// Fraction of the delay drawn at random, 0 to 1.
    pub jitter: f64,
}

impl RetryConfig {
    /// The back-off's bounds, growth and jitter.
    fn check(&self, bad: &mut dyn FnMut(&str, String)) {
        if self.initial.is_zero() {
            bad("retry.initial", "must be greater than zero".into());
        }
        if self.max > Duration::from_secs(86_400) {
            bad("retry.max", "must be at most 1d".into());
        }
        if self.max < self.initial {
            bad(
                "retry.max",
                format!(
                    "must be at least retry.initial ({:?}), is {:?}",
                    self.initial, self.max
                ),
            );
        }
        if !(self.multiplier >= 1.0 && self.multiplier.is_finite()) {
            bad("retry.multiplier", "must be a number ≥ 1".into());
        }
        if !(0.0..=1.0).contains(&self.jitter) {
            bad("retry.jitter", "must be between 0 and 1".into());
        }
    }
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            initial: DEFAULT_RETRY_INITIAL,
            max: DEFAULT_RETRY_MAX,
            multiplier: 2.0,
            jitter: 0.2,
        }
    }
}

/// `[http]`: the metrics and health listener.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// Listen address; empty switches the listener off.
    pub listen: String,
    /// `/readyz` fails when the slot's confirmed-flush lag is over this many bytes.
    pub ready_max_lag_bytes: i64,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            listen: DEFAULT_HTTP_LISTEN.to_owned(),
            ready_max_lag_bytes: 256 << 20,
        }
    }
}

/// `[log]`: where and how the relay logs (always to standard error).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// `pretty` for people, `json` for machines.
    pub format: LogFormat,
    /// A tracing filter, e.g. `info` or `outbox_relay=debug,info`.
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            format: LogFormat::Pretty,
            level: "info".to_owned(),
        }
    }
}

/// `[runtime]`: the threads the relay runs on.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeConfig {
    /// 1: every task on one thread. The relay's work per event is far less
    /// than the walsender's, and one thread pays nothing to hand events
    /// between threads. More: a multi-threaded runtime with this many
    /// workers, which lets the SNS sink sign and send batches in parallel on
    /// a machine with cores to spare.
    pub worker_threads: usize,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self { worker_threads: 1 }
    }
}

/// Log formats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Pretty,
    /// One JSON object per line.
    Json,
}

/// One thing wrong with the configuration, with the key it is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The key, `section.key`.
    pub key: String,
    /// What is wrong and what to do.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.key, self.message)
    }
}

/// Why a configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML.
    #[error("config file {path} is not valid TOML: {message}")]
    Syntax {
        /// The file.
        path: PathBuf,
        /// The parser's message, with line and column.
        message: String,
    },
    /// One or more keys are unknown, missing or invalid.
    #[error("invalid configuration:\n{}", list(.0))]
    Invalid(Vec<Problem>),
}

fn list(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(|p| format!("  - {p}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `root` as a `T`; an error names its key (and the variable that set it).
fn deserialize<T: for<'de> Deserialize<'de>>(
    root: toml::Table,
    origins: &BTreeMap<String, String>,
) -> Result<T, ConfigError> {
    serde_path_to_error::deserialize(toml::Value::Table(root)).map_err(|e| {
        let key = e.path().to_string();
        let origin = origins
            .get(&key)
            .map(|var| format!(" (set by environment variable {var})"))
            .unwrap_or_default();
        let message = e.inner().to_string();
        let message = message.lines().next().unwrap_or_default().to_owned();
        ConfigError::Invalid(vec![Problem {
            key: if key == "." {
                "(top level)".into()
            } else {
                key
            },
            message: format!("{message}{origin}"),
        }])
    })
}

impl Config {
    /// Load `path`, apply the process environment's overrides, and validate.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_parts(&text, path, std::env::vars())
    }

    /// Parse `text` (read from `path`, named in errors), apply the overrides in
    /// `env` (only variables starting with [`ENV_PREFIX`] are looked at), and
    /// validate.
    pub fn from_parts(
        text: &str,
        path: &Path,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let mut root: toml::Table = text.parse().map_err(|e: toml::de::Error| {
            // The parser's own text quotes the offending line, which may hold
            // a password: say where, and what, but not the line.
            let at = e.span().map_or(String::new(), |span| {
                let before = &text[..span.start.min(text.len())];
                let line = before.matches('\n').count() + 1;
                let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
                format!("line {line}, column {column}: ")
            });
            ConfigError::Syntax {
                path: path.to_owned(),
                message: format!("{at}{}", e.message()),
            }
        })?;
        let origins = apply_env(&mut root, env)?;
        // The destinations' sections are read on their own: `Config` cannot
        // both flatten them and refuse unknown keys.
        let mut sections = toml::Table::new();
        for name in Sections::NAMES {
            if let Some(section) = root.remove(*name) {
                sections.insert((*name).to_owned(), section);
            }
        }
        let mut config: Config = deserialize(root, &origins)?;
        config.destinations = deserialize(sections, &origins)?;
        config.validate().map_err(ConfigError::Invalid)?;
        Ok(config)
    }

    /// Every problem with the values, each naming its key; empty when valid.
    pub fn validate(&self) -> Result<(), Vec<Problem>> {
        let mut problems = Vec::new();
        let mut bad = |key: &str, message: String| {
            problems.push(Problem {
                key: key.to_owned(),
                message,
            })
        };
        self.postgres.check(&mut bad);
        check_columns(&self.columns, &mut bad);
        self.destination().validate(&mut bad);
        self.check_background_work(&mut bad);
        self.check_limits(&mut bad);
        self.retry.check(&mut bad);
        self.check_http_and_log(&mut bad);
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems)
        }
    }

    /// The slot's lifecycle, the poller and retention: what they need to
    /// publish and clean up what the stream cannot.
    fn check_background_work(&self, bad: &mut dyn FnMut(&str, String)) {
        if self.lifecycle.recreate_slot && self.lifecycle.on_published == OnPublished::None {
            bad(
                "lifecycle.recreate_slot",
                "needs lifecycle.on_published = \"derive\", \"mark\" or \"delete\": with \"none\" no poller can publish \
                 what was written while the slot was missing, and recreating it would lose those events"
                    .into(),
            );
        }
        if self.poller.grace < Duration::from_secs(1) {
            bad(
                "poller.grace",
                "must be at least 1s (the stream needs time to mark what it published)".into(),
            );
        }
        if self.poller.batch_size == 0 {
            bad("poller.batch_size", "must be at least 1".into());
        }
        if self.poller.max_attempts < 1 {
            bad("poller.max_attempts", "must be at least 1".into());
        }
        if self.poller.interval.is_zero() {
            bad("poller.interval", "must be greater than zero".into());
        }
        if self.poller.backoff_max < self.poller.backoff_initial {
            bad(
                "poller.backoff_max",
                "must be at least poller.backoff_initial".into(),
            );
        }
        if self.retention.batch_size == 0 {
            bad("retention.batch_size", "must be at least 1".into());
        }
        if self.retention.interval.is_zero() {
            bad("retention.interval", "must be greater than zero".into());
        }
        if !self.poller.dead_letter_topic.is_empty() {
            if let Err(message) = self
                .destination()
                .dead_letter(&self.poller.dead_letter_topic)
            {
                bad("poller.dead_letter_topic", message);
            }
        }
    }

    /// The bounds on threads, events in flight and pauses.
    fn check_limits(&self, bad: &mut dyn FnMut(&str, String)) {
        if self.runtime.worker_threads == 0 {
            bad("runtime.worker_threads", "must be at least 1".into());
        }
        if self.stream.max_in_flight == 0 {
            bad("stream.max_in_flight", "must be at least 1".into());
        }
        if self.stream.max_in_flight_bytes == 0 {
            bad("stream.max_in_flight_bytes", "must be at least 1".into());
        }
        if self.lifecycle.max_unmarked == 0 {
            bad("lifecycle.max_unmarked", "must be at least 1".into());
        }
        if self.stream.coalesce > MAX_COALESCE {
            bad(
                "stream.coalesce",
                format!(
                    "must be at most {}ms: the pause holds the relay's thread, and a few hundred \
                     microseconds already gather most of what a busy stream sends",
                    MAX_COALESCE.as_millis()
                ),
            );
        }
    }

    /// The HTTP listener's address and the log filter.
    fn check_http_and_log(&self, bad: &mut dyn FnMut(&str, String)) {
        if !self.http.listen.is_empty() && self.http.listen.parse::<std::net::SocketAddr>().is_err()
        {
            bad(
                "http.listen",
                format!(
                    "{:?} is not an address with a port, e.g. 127.0.0.1:9187 (empty switches it off)",
                    self.http.listen
                ),
            );
        }
        if let Err(e) = tracing_subscriber::EnvFilter::builder().parse(&self.log.level) {
            bad("log.level", format!("not a tracing filter: {e}"));
        }
    }

    /// The settings of the destination `[sink] kind` names.
    pub fn destination(&self) -> &dyn Settings {
        self.destinations.get(self.sink.kind)
    }

    /// The outbox table's schema and name.
    pub fn table(&self) -> TableName {
        TableName::parse(&self.postgres.table).expect("validated")
    }
}

/// Every required column named, and no column mapped twice.
fn check_columns(columns: &ColumnMapping, bad: &mut dyn FnMut(&str, String)) {
    for (key, name) in columns.required() {
        if name.is_empty() {
            bad(
                &format!("columns.{key}"),
                "must name a column of the outbox table".into(),
            );
        }
    }
    let mut seen: BTreeMap<&str, &str> = BTreeMap::new();
    for (key, name) in columns.required().into_iter().chain(columns.optional()) {
        if name.is_empty() {
            continue;
        }
        if let Some(first) = seen.insert(name, key) {
            bad(
                &format!("columns.{key}"),
                format!("column {name:?} is already mapped by columns.{first}"),
            );
        }
    }
}

/// Check the URL without echoing it (it may hold a password).
fn check_url(url: &str) -> Result<(), String> {
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err("must be a URL starting with postgres:// or postgresql://".into());
    }
    let (url, _) = tls::split_url(url);
    let parsed = tokio_postgres::Config::from_str(&url)
        .map_err(|e| format!("not a valid Postgres URL: {e}"))?;
    if parsed.get_user().is_none() {
        return Err("names no user: postgres://USER@host/database".into());
    }
    if parsed.get_hosts().is_empty() {
        return Err("names no host: postgres://user@HOST/database".into());
    }
    use tokio_postgres::config::{Host, TargetSessionAttrs};
    let sockets = parsed
        .get_hosts()
        .iter()
        .filter(|h| matches!(h, Host::Unix(_)))
        .count();
    if sockets > 0 && sockets < parsed.get_hosts().len() {
        // TLS settings apply to TCP hosts only: mixed, one kind would go
        // without what the other needs.
        return Err("mixes unix sockets and TCP hosts: name hosts of one kind".into());
    }
    match parsed.get_target_session_attrs() {
        TargetSessionAttrs::ReadOnly => {
            return Err(
                "asks for target_session_attrs=read-only; the relay writes (the slot, marking): \
                 use read-write"
                    .into(),
            )
        }
        TargetSessionAttrs::Any if parsed.get_hosts().len() > 1 => {
            return Err(
                "names several hosts without target_session_attrs=read-write: add it, so that the \
                 relay connects to the primary among them (after a failover, the promoted one)"
                    .into(),
            )
        }
        _ => {}
    }
    if parsed.get_dbname().is_none() {
        return Err("names no database: postgres://user@host/DATABASE".into());
    }
    Ok(())
}

fn check_identifier(value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Err("must not be empty".into());
    }
    if value.len() > 63 {
        return Err(format!(
            "{value:?} is longer than Postgres's 63-byte identifier limit"
        ));
    }
    if !value
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        || value.as_bytes()[0].is_ascii_digit()
    {
        return Err(format!(
            "{value:?} must be lower-case letters, digits and _ (replication slot rules), not starting with a digit"
        ));
    }
    Ok(())
}

/// The longest name PostgreSQL keeps (NAMEDATALEN - 1 bytes); it cuts longer
/// ones, quoted or not, at a character boundary.
pub(crate) const NAME_MAX: usize = 63;

/// What PostgreSQL makes of `name` as an identifier: cut to [`NAME_MAX`]
/// bytes at a character boundary (its `truncate_identifier`, UTF-8). A name
/// the relay compares with the catalog by value must be cut the same way.
pub(crate) fn pg_name(name: &str) -> &str {
    let mut end = name.len().min(NAME_MAX);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    &name[..end]
}

/// The relations `setup` names after the outbox table `<table>`
/// (`<table><suffix>` in one schema, where relations share one namespace).
pub(crate) const RELATION_SUFFIXES: [&str; 10] = [
    "_dead_letter",
    "_dead_letter_failed_idx",
    "_position",
    "_state",
    "_txid_idx",
    "_explicit_idx",
    "_due_idx",
    "_published_idx",
    "_default",
    "_id_idx",
];

/// The longest of [`RELATION_SUFFIXES`]: a table name of at most
/// `NAME_MAX - LONGEST_SUFFIX` bytes names every relation in full.
const LONGEST_SUFFIX: usize = "_dead_letter_failed_idx".len();

/// A schema-qualified table name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableName {
    /// The schema (default `public`).
    pub schema: String,
    /// The table.
    pub name: String,
}

impl TableName {
    /// Parse `schema.table` or `table`.
    pub fn parse(value: &str) -> Result<Self, String> {
        let (schema, name) = match value.split_once('.') {
            Some((schema, name)) => (schema, name),
            None => ("public", value),
        };
        if schema.is_empty() || name.is_empty() || name.contains('.') {
            return Err(format!(
                "{value:?} must be `table` or `schema.table`, e.g. public.outbox"
            ));
        }
        for part in [schema, name] {
            if part.len() > NAME_MAX {
                return Err(format!(
                    "{part:?} is {} bytes, longer than PostgreSQL's {NAME_MAX}-byte names: \
                     PostgreSQL would cut it; use a shorter name",
                    part.len()
                ));
            }
        }
        // The relay names its relations after the table; PostgreSQL cuts each
        // name at 63 bytes, so a long table name can make two of them one (and
        // `CREATE … IF NOT EXISTS` then skips the second without an error).
        let mut seen: Vec<(String, String)> = vec![(name.to_owned(), name.to_owned())];
        for suffix in RELATION_SUFFIXES {
            let full = format!("{name}{suffix}");
            let cut = pg_name(&full).to_owned();
            if let Some((other, _)) = seen.iter().find(|(_, c)| *c == cut) {
                return Err(format!(
                    "{name:?} is too long to name the relay's relations after it: PostgreSQL cuts \
                     names at {NAME_MAX} bytes, so {full:?} and {other:?} would both be {cut:?}; \
                     use a table name of at most {} bytes",
                    NAME_MAX - LONGEST_SUFFIX
                ));
            }
            seen.push((full, cut));
        }
        Ok(Self {
            schema: schema.to_owned(),
            name: name.to_owned(),
        })
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.schema, self.name)
    }
}

/// Keys whose values are secrets.
const SECRET_KEYS: [&str; 2] = ["postgres.url", "postgres.password"];

/// Merge `OUTBOX_RELAY__A__B` variables into `root`; returns which key came
/// from which variable.
fn apply_env(
    root: &mut toml::Table,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<BTreeMap<String, String>, ConfigError> {
    let mut origins = BTreeMap::new();
    let mut vars: Vec<_> = env
        .into_iter()
        .filter(|(k, _)| k.starts_with(ENV_PREFIX))
        .collect();
    vars.sort();
    for (var, raw) in vars {
        let path: Vec<String> = var[ENV_PREFIX.len()..]
            .split("__")
            .map(str::to_ascii_lowercase)
            .collect();
        if path.iter().any(String::is_empty) {
            return Err(ConfigError::Invalid(vec![Problem {
                key: var.clone(),
                message: "malformed variable name: use OUTBOX_RELAY__SECTION__KEY".into(),
            }]));
        }
        // Secrets are taken as they are: never parsed (a password of digits
        // would otherwise become a number, and an error would print it).
        let key = path.join(".");
        let value = if SECRET_KEYS.contains(&key.as_str()) || Sections::secret_keys().contains(&key)
        {
            toml::Value::String(raw)
        } else {
            env_value(&raw)
        };
        let mut table = &mut *root;
        let (last, sections) = path.split_last().expect("split yields one part at least");
        for section in sections {
            let entry = table
                .entry(section.clone())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            table = match entry {
                toml::Value::Table(t) => t,
                _ => {
                    return Err(ConfigError::Invalid(vec![Problem {
                        key: section.clone(),
                        message: format!("is not a section, but {var} treats it as one"),
                    }]))
                }
            };
        }
        table.insert(last.clone(), value);
        origins.insert(path.join("."), var);
    }
    Ok(origins)
}

/// A TOML value when the text is one, the text as a string otherwise.
fn env_value(raw: &str) -> toml::Value {
    format!("v = {raw}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_owned()))
}

/// Every configuration key, `section.key`, in declaration order. Read from
/// the structs themselves (what serde asks a deserializer for), so a new
/// field is a new key here without anyone listing it.
#[cfg(test)]
pub(crate) fn keys() -> Vec<String> {
    let mut keys = Vec::new();
    for section in field_names::<Config>() {
        let fields = match *section {
            "postgres" => field_names::<PostgresConfig>(),
            "columns" => field_names::<ColumnMapping>(),
            "sink" => {
                keys.extend(
                    field_names::<SinkConfig>()
                        .iter()
                        .map(|f| format!("sink.{f}")),
                );
                keys.extend(Sections::keys());
                continue;
            }
            "envelope" => field_names::<EnvelopeConfig>(),
            "stream" => field_names::<StreamConfig>(),
            "retry" => field_names::<RetryConfig>(),
            "lifecycle" => field_names::<LifecycleConfig>(),
            "poller" => field_names::<PollerConfig>(),
            "retention" => field_names::<RetentionConfig>(),
            "filter" => field_names::<FilterConfig>(),
            "http" => field_names::<HttpConfig>(),
            "log" => field_names::<LogConfig>(),
            "runtime" => field_names::<RuntimeConfig>(),
            other => panic!("config section {other:?} is missing from config::keys"),
        };
        keys.extend(fields.iter().map(|f| format!("{section}.{f}")));
    }
    keys
}

/// The environment variable that overrides `key` (`section.key`).
#[cfg(test)]
pub(crate) fn env_var(key: &str) -> String {
    format!("{ENV_PREFIX}{}", key.replace('.', "__").to_uppercase())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) const MINIMAL: &str = r#"
[postgres]
url = "postgres://relay:secret@localhost:5432/app"
"#;

    pub(crate) fn load(text: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
        Config::from_parts(
            text,
            Path::new("relay.toml"),
            env.iter().map(|(k, v)| (k.to_string(), v.to_string())),
        )
    }

    pub(crate) fn problems(err: ConfigError) -> Vec<Problem> {
        match err {
            ConfigError::Invalid(p) => p,
            other => panic!("expected Invalid, got {other}"),
        }
    }

    #[test]
    fn a_minimal_file_gets_the_documented_defaults() {
        let c = load(MINIMAL, &[]).unwrap();
        assert_eq!(c.postgres.slot, DEFAULT_SLOT);
        assert_eq!(c.postgres.publication, DEFAULT_PUBLICATION);
        assert_eq!(
            c.table(),
            TableName {
                schema: "public".into(),
                name: "outbox".into()
            }
        );
        assert_eq!(c.columns, ColumnMapping::default());
        assert_eq!(c.sink.kind, SinkKind::Stdout);
        assert_eq!(c.stream.max_in_flight, DEFAULT_MAX_IN_FLIGHT);
    }

    #[test]
    fn an_unknown_key_is_rejected_with_its_path() {
        let p = problems(load(&format!("{MINIMAL}slto = \"x\"\n"), &[]).unwrap_err());
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].key, "postgres.slto");
        assert!(p[0].message.contains("unknown field"), "{}", p[0].message);
    }

    #[test]
    fn an_unknown_section_is_rejected() {
        let p = problems(load(&format!("{MINIMAL}[postgress]\nurl = \"x\"\n"), &[]).unwrap_err());
        assert_eq!(p[0].key, "postgress");
    }

    #[test]
    fn a_table_name_whose_relations_postgres_would_cut_into_one_is_rejected() {
        let table = |name: &str| {
            let text = MINIMAL.replace("[postgres]", &format!("[postgres]\ntable = \"{name}\""));
            load(&text, &[]).map(|c| c.table().name)
        };
        // 40 bytes: every relation named in full; 45: `…_dead_letter_failed_idx`
        // is cut, but to a name of its own.
        for n in [40, 45, 50] {
            assert_eq!(table(&"t".repeat(n)).unwrap(), "t".repeat(n));
        }
        // 51 bytes: `<t>_dead_letter_failed_idx` is cut to `<t>_dead_letter`.
        let p = problems(table(&"t".repeat(51)).unwrap_err());
        assert_eq!(p[0].key, "postgres.table");
        assert!(
            p[0].message.contains("at most 40 bytes"),
            "{}",
            p[0].message
        );
        assert!(
            p[0].message.contains("_dead_letter_failed_idx"),
            "{}",
            p[0].message
        );
        // Longer than PostgreSQL keeps at all, and cut inside a character.
        let p = problems(table(&format!("s.{}", "x".repeat(64))).unwrap_err());
        assert!(p[0].message.contains("64 bytes"), "{}", p[0].message);
        assert_eq!(pg_name(&format!("{}é", "x".repeat(62))), "x".repeat(62));
        assert_eq!(pg_name("outbox_requeue"), "outbox_requeue");
    }

    #[test]
    fn a_missing_url_names_the_key_and_the_variable() {
        let p = problems(load("", &[]).unwrap_err());
        assert_eq!(p[0].key, "postgres.url");
        assert!(p[0].message.contains("OUTBOX_RELAY__POSTGRES__URL"));
    }

    #[test]
    fn a_bad_url_names_the_key_without_echoing_the_password() {
        let p = problems(
            load(
                "[postgres]\nurl = \"postgres://u:hunter2@host:notaport/db\"\n",
                &[],
            )
            .unwrap_err(),
        );
        assert_eq!(p[0].key, "postgres.url");
        assert!(!p[0].message.contains("hunter2"), "{}", p[0].message);
        let p = problems(load("[postgres]\nurl = \"mysql://u@h/db\"\n", &[]).unwrap_err());
        assert_eq!(p[0].key, "postgres.url");
    }

    #[test]
    fn several_hosts_need_read_write_and_read_only_is_refused() {
        let url = |u: &str| format!("[postgres]\nurl = \"{u}\"\n");
        let p = problems(load(&url("postgres://u@a,b/db"), &[]).unwrap_err());
        assert_eq!(p[0].key, "postgres.url");
        assert!(
            p[0].message.contains("target_session_attrs=read-write"),
            "{}",
            p[0].message
        );
        let p = problems(
            load(
                &url("postgres://u@a/db?target_session_attrs=read-only"),
                &[],
            )
            .unwrap_err(),
        );
        assert!(p[0].message.contains("use read-write"), "{}", p[0].message);
        load(
            &url("postgres://u@a:5432,b:5433/db?target_session_attrs=read-write"),
            &[],
        )
        .expect("several hosts with read-write");
        let p = problems(
            load(
                &url("postgres://u@%2Frun%2Fpg,db.example/db?target_session_attrs=read-write"),
                &[],
            )
            .unwrap_err(),
        );
        assert!(
            p[0].message.contains("mixes unix sockets"),
            "{}",
            p[0].message
        );
    }

    #[test]
    fn every_problem_is_reported_at_once() {
        let text = r#"
[postgres]
slot = "Bad-Slot"
table = "a.b.c"
[columns]
payload = ""
[stream]
max_in_flight = 0
max_in_flight_bytes = 0
coalesce = "50ms"
[lifecycle]
max_unmarked = 0
[retry]
jitter = 3.0
[runtime]
worker_threads = 0
"#;
        let keys: Vec<String> = problems(load(text, &[]).unwrap_err())
            .into_iter()
            .map(|p| p.key)
            .collect();
        for key in [
            "postgres.url",
            "postgres.slot",
            "postgres.table",
            "columns.payload",
            "stream.max_in_flight",
            "stream.max_in_flight_bytes",
            "stream.coalesce",
            "lifecycle.max_unmarked",
            "retry.jitter",
            "runtime.worker_threads",
        ] {
            assert!(
                keys.contains(&key.to_string()),
                "{key} missing from {keys:?}"
            );
        }
    }

    #[test]
    fn environment_variables_override_keys() {
        let c = load(
            MINIMAL,
            &[
                ("OUTBOX_RELAY__POSTGRES__SLOT", "from_env"),
                ("OUTBOX_RELAY__STREAM__MAX_IN_FLIGHT", "42"),
                ("OUTBOX_RELAY__STREAM__SHUTDOWN_TIMEOUT", "1500ms"),
                ("OUTBOX_RELAY__COLUMNS__HEADERS", "\"\""),
                ("OUTBOX_RELAY_UNRELATED", "ignored"),
            ],
        )
        .unwrap();
        assert_eq!(c.postgres.slot, "from_env");
        assert_eq!(c.stream.max_in_flight, 42);
        assert_eq!(c.stream.shutdown_timeout, Duration::from_millis(1500));
        assert_eq!(c.columns.headers, "");
        let c = load("", &[("OUTBOX_RELAY__POSTGRES__URL", "postgres://u@h/db")]).unwrap();
        assert_eq!(c.postgres.url.unwrap().expose(), "postgres://u@h/db");
    }

    #[test]
    fn an_unknown_environment_key_names_the_variable() {
        let p = problems(load(MINIMAL, &[("OUTBOX_RELAY__POSTGRES__SLTO", "x")]).unwrap_err());
        assert_eq!(p[0].key, "postgres.slto");
        assert!(p[0].message.contains("OUTBOX_RELAY__POSTGRES__SLTO"));
    }

    #[test]
    fn secrets_never_appear_in_errors() {
        let err = load("[postgres]\nurl = \"postgres://u:hunter2@h/db\n", &[]).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("line 2") && !text.contains("hunter2"),
            "{text}"
        );
        let c = load(MINIMAL, &[("OUTBOX_RELAY__POSTGRES__PASSWORD", "12345")]).unwrap();
        assert_eq!(c.postgres.password.unwrap().expose(), "12345");
        let c = load(
            MINIMAL,
            &[("OUTBOX_RELAY__POSTGRES__PASSWORD", "\"quoted\"")],
        )
        .unwrap();
        assert_eq!(c.postgres.password.unwrap().expose(), "\"quoted\"");
    }

    #[test]
    fn secrets_are_not_printed_by_debug() {
        let c = load(
            MINIMAL,
            &[
                ("OUTBOX_RELAY__POSTGRES__PASSWORD", "hunter2"),
                (
                    "OUTBOX_RELAY__WEBHOOK__SECRET",
                    "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
                ),
            ],
        )
        .unwrap();
        let printed = format!("{c:?}");
        for secret in [":secret@", "hunter2", "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"] {
            assert!(!printed.contains(secret), "{secret} in {printed}");
        }
    }

    #[test]
    fn durations_take_units() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("100us").unwrap(), Duration::from_micros(100));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("3").unwrap(), Duration::from_secs(3));
        assert!(parse_duration("3 fortnights").is_err());
    }

    #[test]
    fn the_printed_default_configuration_is_complete_and_true() {
        let printed = Config::from_parts(
            DEFAULT_CONFIG,
            Path::new("default.toml"),
            std::iter::empty(),
        )
        .unwrap_or_else(|e| panic!("the default configuration does not load: {e}"));
        let minimal = Config::from_parts(
            "[postgres]\nurl = \"postgres://outbox_relay@localhost:5432/app\"\n",
            Path::new("minimal.toml"),
            std::iter::empty(),
        )
        .unwrap();
        assert_eq!(
            format!("{printed:?}"),
            format!("{minimal:?}"),
            "every value in default-config.toml is the default"
        );
        let mut section = "";
        let mut present = std::collections::BTreeSet::new();
        for line in DEFAULT_CONFIG.lines() {
            let line = line.trim();
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                section = name;
            } else if let Some((key, _)) = line.trim_start_matches("# ").split_once(" = ") {
                present.insert(format!("{section}.{key}"));
            }
        }
        let keys = keys();
        assert!(keys.len() > 50, "{keys:?}");
        let missing: Vec<_> = keys.iter().filter(|k| !present.contains(*k)).collect();
        assert!(missing.is_empty(), "default-config.toml lacks {missing:?}");
    }

    #[test]
    fn every_key_is_documented_with_its_environment_variable() {
        let doc = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/configuration.md"),
        )
        .expect("docs/configuration.md");
        let undocumented: Vec<String> = keys()
            .into_iter()
            .filter(|key| {
                !doc.lines().any(|l| {
                    l.starts_with(&format!("| `{key}` |"))
                        && l.contains(&format!("`{}`", env_var(key)))
                })
            })
            .collect();
        assert!(
            undocumented.is_empty(),
            "docs/configuration.md has no row `| `key` | … `OUTBOX_RELAY__…` |` for {undocumented:?}"
        );
    }
}
