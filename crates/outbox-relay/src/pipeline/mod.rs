//! How an event travels: from the replication stream ([`stream`]) or the
//! table ([`poller`], [`replay`]), through routing and the envelope
//! ([`route`], [`envelope`], [`outgoing`]), to the publisher ([`publish`])
//! that hands batches to a destination under the sink contract ([`sink`]),
//! and back as acknowledgements ([`ack`]) that move the slot.
//!
//! The pipeline calls down into [`crate::postgres`]; destinations
//! ([`crate::sink`]) implement [`sink::Sink`] and are handed in from above.

pub mod ack;
pub mod concurrency;
pub mod envelope;
pub mod error;
pub mod outgoing;
pub mod poller;
mod prepared;
pub mod publish;
pub mod replay;
pub mod route;
pub mod rows;
pub mod sink;
pub mod stream;
