//! outbox-relay: the transactional outbox pattern by log tailing.
//!
//! ```text
//!  app tx: INSERT business rows + INSERT outbox row ── COMMIT
//!                                  │ WAL
//!                                  ▼
//!  replication  (slot, pgoutput, publication WITH (publish = 'insert'))
//!    → pgoutput decoder            (crate `pgoutput`)
//!    → row → OutboxEvent           ([`event`], column mapping from config)
//!    → envelope bytes              ([`envelope`], CloudEvents 1.0 or raw)
//!    → publisher → sink            ([`publish`], [`sink`]: per-event outcomes, retries)
//!    → ack tracker                 ([`ack`]: in-order watermark over commits)
//!    → standby status update (flush LSN) to Postgres
//! ```
//!
//! The module docs of [`ack`] and [`replication`] state the delivery
//! invariants and why they hold.

// Inside the crate an item is `pub(crate)` at most: what leaves it is listed
// below, so a `pub` elsewhere would claim a reach it does not have.
#![deny(unreachable_pub)]

mod cli;
mod config;
mod event;
mod http;
mod metrics;
mod pipeline;
mod postgres;
mod relay;
mod report;
mod retry;
mod signals;
mod sink;
mod time;

// What the binary, the end-to-end tests, the benchmarks and the fuzz targets
// use; everything else is the crate's own.
pub use cli::main;
pub use config::tls::percent_decode;
pub use config::value::{parse_duration, Secret};
pub use config::Config;
pub use metrics::get as metrics;
pub use pipeline::error::ErrorClass;
pub use pipeline::error::RelayError;
pub use pipeline::sink::{Message, Outcome, Sink};
pub use pipeline::stream::Summary;
pub use postgres::walstream::{WalStream, WireError};
pub use postgres::{check, setup, ConnInfo};
pub use relay::run;
pub use report::{Chain, CHANNEL_BINDING_NOT_OFFERED};
pub use sink::aws::errors::{classify as classify_aws_error, Class as AwsErrorClass};
pub use sink::aws::json::parse_error as parse_aws_json_error;
pub use sink::sns::SnsSink;
