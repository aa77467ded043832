//! outbox-relay: the transactional outbox pattern by log tailing.
//!
//! Three wings on a shared ground, imports running downward
//! (docs/architecture.md):
//!
//! ```text
//!  composition  main, cli, relay      builds the sink, runs the workers
//!  sink         destinations, aws     implement the pipeline's contract
//!  pipeline     stream, publish, ack  how an event travels
//!  postgres     walstream, outbox     every conversation with the database
//!  ground       config, event, metrics
//! ```
//!
//! An event's path: the replication stream ([`pipeline::stream`]) decodes
//! an insert into an event ([`event`]), [`pipeline::outgoing`] routes and
//! encodes it, [`pipeline::publish`] hands batches to the sink
//! ([`pipeline::sink::Sink`]), and [`pipeline::ack`] turns the answers into
//! the confirmed LSN the stream reports. The module docs of
//! [`pipeline::ack`] and [`pipeline::stream`] state the delivery invariants
//! and why they hold.

// The modules are private on purpose and their docs are read with
// --document-private-items, so links into them are meant to resolve there.
#![allow(rustdoc::private_intra_doc_links)]
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
