//! How an event travels: from the replication stream ([`stream`]) or the
//! table ([`poller`], [`replay`]), through routing and the envelope
//! ([`route`], [`envelope`], [`outgoing`]), to the publisher ([`publish`])
//! that hands batches to a destination under the sink contract ([`sink`]),
//! and back as acknowledgements ([`ack`]) that move the slot.
//!
//! The pipeline calls down into [`crate::postgres`]; destinations
//! ([`crate::sink`]) implement [`sink::Sink`] and are handed in from above.

pub(crate) mod ack;
pub(crate) mod concurrency;
pub(crate) mod envelope;
pub(crate) mod error;
pub(crate) mod outgoing;
pub(crate) mod poller;
mod prepared;
pub(crate) mod publish;
pub(crate) mod replay;
pub(crate) mod route;
pub(crate) mod rows;
pub(crate) mod sink;
pub(crate) mod stream;
