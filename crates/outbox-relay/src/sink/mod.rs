//! Sinks: where envelopes go, and what they say about each one.
//!
//! A sink answers every message of a batch with an [`Outcome`]:
//!
//! * [`Outcome::Delivered`]: the destination has *durably accepted* the
//!   message (for SNS: the publish call answered with a message id). Only
//!   now may the replication slot move past the message's transaction.
//! * [`Outcome::Retryable`]: not accepted, for a reason unrelated to the
//!   message (network, throttling, the destination down, credentials). The
//!   publisher sends it again, forever, with backoff; the slot waits.
//! * [`Outcome::Rejected`]: this message can never be accepted (too large,
//!   invalid, routed nowhere). It is recorded as failed with the reason and
//!   the stream moves on.
//!
//! A sink must answer with exactly one outcome per message, in the batch's
//! order, and must not report `Delivered` for anything it has not handed
//! over durably. Ordering across batches is the publisher's job: a batch
//! holds messages for one destination, and no two batches in flight hold
//! messages of the same ordering group.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::ack::Ticket;
use crate::event::OutboxEvent;

pub mod sns;
pub mod stdout;

pub use sns::SnsSink;
pub use stdout::StdoutSink;

/// One envelope on its way to the sink.
#[derive(Debug, Clone)]
pub struct Message {
    /// Reports the outcome back to the ack tracker.
    pub ticket: Ticket,
    /// The event (routing, attributes, ordering group). Boxed: a message
    /// moves through several queues, and the event is most of its bytes.
    pub event: Box<OutboxEvent>,
    /// The encoded envelope.
    pub body: Bytes,
    /// Where it goes (a topic ARN; empty for single-destination sinks).
    /// A batch holds messages of one destination.
    pub destination: Arc<str>,
    /// Commit time of the event's transaction, µs since 2000-01-01.
    pub commit_time: i64,
}

/// What a sink says about one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Durably accepted by the destination.
    Delivered,
    /// Not accepted this time; try again later.
    Retryable(String),
    /// Never acceptable; record it as failed.
    Rejected(String),
}

/// A destination for envelopes.
pub trait Sink: Send + Sync + 'static {
    /// Short name for logs and metrics.
    fn name(&self) -> &'static str;

    /// Most messages a batch may hold.
    fn max_batch(&self) -> usize;

    /// Batches in flight at once (per-group order is kept regardless).
    fn max_in_flight_batches(&self) -> usize {
        1
    }

    /// How long a partial batch waits for more messages.
    fn linger(&self) -> Duration {
        Duration::ZERO
    }

    /// Deliver `batch`; one outcome per message, in order.
    fn publish(&self, batch: &[Message]) -> impl Future<Output = Vec<Outcome>> + Send;
}

/// The sink `[sink] kind` names, behind one type so callers need one code path.
pub enum Configured {
    /// `stdout`.
    Stdout(StdoutSink),
    /// `sns`.
    Sns(Box<SnsSink>),
}

impl Configured {
    /// Build the configured sink.
    pub async fn new(config: &crate::config::Config) -> Result<Self, sns::SnsSetupError> {
        Ok(match config.sink.kind {
            crate::config::SinkKind::Stdout => Self::Stdout(StdoutSink::new()),
            crate::config::SinkKind::Sns => Self::Sns(Box::new(SnsSink::new(&config.sns).await?)),
        })
    }
}

impl Sink for Configured {
    fn name(&self) -> &'static str {
        match self {
            Self::Stdout(s) => s.name(),
            Self::Sns(s) => s.name(),
        }
    }

    fn max_batch(&self) -> usize {
        match self {
            Self::Stdout(s) => s.max_batch(),
            Self::Sns(s) => s.max_batch(),
        }
    }

    fn max_in_flight_batches(&self) -> usize {
        match self {
            Self::Stdout(s) => s.max_in_flight_batches(),
            Self::Sns(s) => s.max_in_flight_batches(),
        }
    }

    fn linger(&self) -> Duration {
        match self {
            Self::Stdout(s) => s.linger(),
            Self::Sns(s) => s.linger(),
        }
    }

    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        match self {
            Self::Stdout(s) => s.publish(batch).await,
            // Boxed: the SNS call's state is kilobytes, and the publisher
            // moves each batch's future into a task of its own. Unboxed, the
            // stdout sink's few-byte future would be as large as it.
            Self::Sns(s) => Box::pin(s.publish(batch)).await,
        }
    }
}
