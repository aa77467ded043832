//! The publisher: batches messages for a sink, retries what failed, and
//! reports each message's final outcome back to the replication loop.
//!
//! ```text
//!  replication loop ──Message──► [batch ≤ max_batch] ──► sink.publish
//!         ▲                                                  │
//!         └────────────── Completion (Delivered | Rejected) ◄┘  Retryable: back off, send again
//! ```
//!
//! # Ordering
//!
//! Batches go out one at a time, in the order the messages were received
//! (commit order). A retryable failure holds everything behind it: the failed
//! messages are sent again, in order, before the next batch is formed, so no
//! event overtakes an earlier one that is still unconfirmed. A message that
//! was delivered in a partly failed batch is not sent again.
//!
//! Transient failures are retried forever with capped, jittered exponential
//! backoff ([`Backoff`]); nothing is reported for them, so the slot does not
//! move past them.

use std::sync::Arc;

use tokio::sync::mpsc;

use crate::ack::Ticket;
use crate::retry::Backoff;
use crate::sink::{Message, Outcome, Sink};

/// The final word on one message.
#[derive(Debug, Clone)]
pub enum Completion {
    /// Durably accepted by the sink.
    Delivered(Ticket),
    /// Never acceptable: to be recorded as failed, with the reason.
    Rejected(Ticket, Box<Message>, String),
}

/// Drive `sink` until `input` closes; report every message's final outcome on `done`.
pub async fn run<S: Sink>(
    sink: Arc<S>,
    mut input: mpsc::Receiver<Message>,
    done: mpsc::UnboundedSender<Completion>,
    backoff: Backoff,
) {
    let max_batch = sink.max_batch().max(1);
    let mut batch: Vec<Message> = Vec::with_capacity(max_batch);
    loop {
        if input.recv_many(&mut batch, max_batch).await == 0 {
            return;
        }
        let mut attempt: u32 = 0;
        while !batch.is_empty() {
            let outcomes = sink.publish(&batch).await;
            debug_assert_eq!(outcomes.len(), batch.len(), "one outcome per message");
            let mut retry = Vec::new();
            let mut last_error = None;
            for (message, outcome) in batch.drain(..).zip(outcomes) {
                let report = match outcome {
                    Outcome::Delivered => Completion::Delivered(message.ticket),
                    Outcome::Rejected(reason) => {
                        Completion::Rejected(message.ticket, Box::new(message), reason)
                    }
                    Outcome::Retryable(reason) => {
                        last_error = Some(reason);
                        retry.push(message);
                        continue;
                    }
                };
                if done.send(report).is_err() {
                    return; // the replication loop is gone
                }
            }
            batch = retry;
            if let Some(error) = last_error {
                let delay = backoff.delay(attempt);
                attempt = attempt.saturating_add(1);
                tracing::warn!(
                    sink = sink.name(),
                    attempt,
                    messages = batch.len(),
                    retry_in_ms = delay.as_millis() as u64,
                    error = %error,
                    "publish failed, retrying"
                );
                tokio::time::sleep(delay).await;
            }
        }
    }
}
