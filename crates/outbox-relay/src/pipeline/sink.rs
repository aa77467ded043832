//! The sink contract: what a destination is given and what it answers.
//!
//! A sink answers every message of a batch with an [`Outcome`]:
//!
//! * [`Outcome::Delivered`]: the destination has *durably accepted* the
//!   message (for SNS: the publish call answered with a message id). Only
//!   now may the replication slot move past the message's transaction.
//! * [`Outcome::Retryable`]: not accepted, for a reason unrelated to the
//!   message (network, throttling, the destination down, credentials). The
//!   publisher sends it again, forever, with backoff; the slot waits. The
//!   [`Retry`] says why in a typed [`Cause`], so the concurrency limiter
//!   ([`crate::pipeline::concurrency`]) backs off on load (throttling, timeouts,
//!   unavailability) and not on a client-side fault.
//! * [`Outcome::Rejected`]: this message can never be accepted (too large,
//!   invalid, routed nowhere). It is recorded as failed with the reason and
//!   the stream moves on.
//!
//! A sink must answer with exactly one outcome per message, in the batch's
//! order, and must not report `Delivered` for anything it has not handed
//! over durably. Ordering across batches is the publisher's job: a batch
//! holds messages for one destination, and no two batches in flight hold
//! messages of the same ordering group. How many batches are in flight is the
//! publisher's too, within what [`Sink::concurrency`] allows.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::event::OutboxEvent;
/// Where events come from is a fact about the database; sinks learn it here.
pub(crate) use crate::event::Source;
use crate::pipeline::ack::Ticket;
pub(crate) use crate::pipeline::concurrency::Concurrency;

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
    /// Where it goes (an SNS topic ARN, a webhook URL; empty for
    /// single-destination sinks), as the sink's routes named it.
    /// A batch holds messages of one destination.
    pub destination: Arc<str>,
    /// Commit time of the event's transaction, µs since 2000-01-01.
    pub commit_time: i64,
}

#[cfg(test)]
impl Message {
    /// A message of event `id` in ordering group `group` (also its aggregate
    /// id), with `body`, for `destination`; no tracker knows its ticket.
    pub fn for_test(id: &str, group: &str, body: &str, destination: &str) -> Self {
        Self {
            ticket: Ticket::detached(),
            event: Box::new(crate::event::OutboxEvent::new(
                crate::event::Fields {
                    id,
                    aggregate_type: "t",
                    aggregate_id: group,
                    event_type: "E",
                    group,
                    time: "t",
                    headers: None,
                    topic: None,
                },
                crate::event::Payload::Json("{}".into()),
            )),
            body: Bytes::from(body.to_owned()),
            destination: Arc::from(destination),
            commit_time: 0,
        }
    }
}

/// What a sink says about one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Durably accepted by the destination.
    Delivered,
    /// Not accepted this time; try again later.
    Retryable(Retry),
    /// Never acceptable; record it as failed.
    Rejected(String),
}

impl Outcome {
    /// Not accepted this time, because of `cause`.
    pub fn retry(cause: Cause, reason: impl Into<String>) -> Self {
        Self::Retryable(Retry {
            cause,
            reason: reason.into(),
        })
    }
}

/// Why a message is to be sent again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retry {
    /// What kind of failure: whether it says the destination is loaded.
    pub cause: Cause,
    /// What happened, for logs.
    pub reason: String,
}

impl std::fmt::Display for Retry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

/// The kind of a transient failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// The destination said to slow down (SNS `Throttling`, HTTP 429).
    Throttled,
    /// No answer in time.
    TimedOut,
    /// The destination failed or could not be reached (5xx, connection errors).
    Unavailable,
    /// Anything else (credentials, signing, an unknown client error, a local
    /// write): nothing about the destination's load.
    Other,
}

impl Cause {
    /// Whether the failure says the destination is loaded (back pressure).
    pub fn is_load(self) -> bool {
        !matches!(self, Self::Other)
    }
}

/// A destination for envelopes.
pub trait Sink: Send + Sync + 'static {
    /// Short name for logs and metrics.
    fn name(&self) -> &'static str;

    /// Most messages a batch may hold.
    fn max_batch(&self) -> usize;

    /// Most messages of one ordering group in a batch. A sink whose
    /// destination may take a later message of a group and fail an earlier
    /// one of the same request, where consumers rely on the group's order
    /// (Kinesis with `strict_order`, an SQS FIFO queue), keeps each group to
    /// one message a batch.
    fn max_run(&self) -> usize {
        usize::MAX
    }

    /// Batches in flight at once: fixed, or adaptive up to a ceiling
    /// (per-group order is kept regardless).
    fn concurrency(&self) -> Concurrency {
        Concurrency::Fixed(1)
    }

    /// How long a partial batch waits for more messages while other batches
    /// are in flight (with none in flight it goes at once).
    fn linger(&self) -> Duration {
        Duration::ZERO
    }

    /// Learn where the events come from, before the first batch of each
    /// stream, poller connection or replay (the same every time for one
    /// relay: a promotion keeps the system identifier).
    fn source(&self, _source: &Source) {}

    /// Deliver `batch`; one outcome per message, in order.
    fn publish(&self, batch: &[Message]) -> impl Future<Output = Vec<Outcome>> + Send;
}
