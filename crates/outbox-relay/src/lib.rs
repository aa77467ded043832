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

pub mod ack;
pub mod aws;
pub mod check;
pub mod cli;
pub mod concurrency;
pub mod config;
pub mod envelope;
pub mod error;
pub mod event;
pub mod failover;
pub mod http;
pub mod lsn;
pub mod marking;
pub mod metrics;
pub mod monitor;
pub mod outgoing;
pub mod platform;
pub mod poller;
pub mod position;
pub mod postgres;
pub mod publish;
pub mod readiness;
pub mod record;
pub mod relay;
pub mod replay;
pub mod replication;
pub mod report;
pub mod retention;
pub mod retry;
pub mod route;
pub mod rows;
pub mod setup;
pub mod signals;
pub mod silence;
pub mod sink;
pub mod sql;
pub mod stall;
pub mod table;
pub mod time;
pub mod tls;
pub mod walstream;

pub use config::Config;
pub use relay::run;
pub use replication::{RelayError, Summary};
