//! Prepared transactions: their events, held between PREPARE TRANSACTION and
//! COMMIT PREPARED or ROLLBACK PREPARED.
//!
//! ```text
//!  stream:  Begin Prepare (xid 7) ─ Insert ─ Insert ─ Prepare ─ … other transactions … ─ Commit Prepared (xid 7)
//!  here:    open ──────────── held ── held ─► waiting[7] ──────────────────────────────► released, in order
//! ```
//!
//! With two-phase decoding (a slot created with `two_phase`, PostgreSQL 15+)
//! the walsender sends a prepared transaction's changes when it is prepared,
//! and its outcome later, in a message of its own that may come after other
//! transactions. Its outbox rows are not committed yet: nothing may publish
//! them. They become messages (filter, route, envelope) as they arrive, as
//! every event does, and wait here, in the order received, until their
//! transaction's outcome: COMMIT PREPARED hands them to the publisher at its
//! place in the stream (so after the transactions that committed before it),
//! ROLLBACK PREPARED drops them.
//!
//! The [`AckTracker`](crate::pipeline::ack::AckTracker) parks them meanwhile and keeps
//! the confirmed position before the prepared transaction; a session that
//! ends (a restart, a crash) drops what is held here, and the walsender sends
//! the prepared transaction again from that position. What is held counts
//! against the stream's in-flight budgets (see [`super`]).
//!
//! A transaction is known by its xid, which the four messages carry (the gid
//! too, for logs).

use std::collections::HashMap;

use crate::pipeline::ack::{PreparedTx, Ticket};
use crate::pipeline::publish::Dispatch;

/// One event of a prepared transaction.
#[derive(Debug)]
pub(super) enum Held {
    /// For the publisher (a message, or a row to record as rejected).
    Dispatch(Dispatch),
    /// Filtered out (`[filter]`): marked SKIPPED once committed.
    Skipped {
        /// The event id.
        id: String,
        /// Its ticket, finished when marked or dropped.
        ticket: Ticket,
    },
}

impl Held {
    /// The ticket that reports its outcome.
    pub(super) fn ticket(&self) -> Ticket {
        match self {
            Held::Dispatch(Dispatch::Publish(message)) => message.ticket,
            Held::Dispatch(Dispatch::Reject { ticket, .. }) | Held::Skipped { ticket, .. } => {
                *ticket
            }
        }
    }
}

/// A prepared transaction waiting for its outcome.
#[derive(Debug)]
pub(super) struct Waiting {
    /// Its global transaction identifier.
    pub(super) gid: String,
    /// What resolves it in the ack tracker.
    pub(super) tracked: PreparedTx,
    /// Its events, in the order received.
    pub(super) events: Vec<Held>,
}

/// The prepared transaction being received, and those waiting for their outcome.
#[derive(Debug, Default)]
pub(super) struct PreparedTxs {
    /// Between Begin Prepare and Prepare: the events so far.
    open: Option<Vec<Held>>,
    /// Prepared, by xid.
    waiting: HashMap<u32, Waiting>,
}

impl PreparedTxs {
    /// Begin Prepare: the events that follow are held.
    pub(super) fn begin(&mut self) {
        self.open = Some(Vec::new());
    }

    /// Whether a prepared transaction is being received (its events go to
    /// [`PreparedTxs::hold`]).
    pub(super) fn is_open(&self) -> bool {
        self.open.is_some()
    }

    /// Hold an event of the transaction being received.
    pub(super) fn hold(&mut self, event: Held) {
        if let Some(events) = &mut self.open {
            events.push(event);
        }
    }

    /// Prepare: the transaction being received waits for its outcome, if the
    /// tracker holds it (`tracked`: it has events).
    pub(super) fn prepared(&mut self, xid: u32, gid: String, tracked: Option<PreparedTx>) {
        let events = self.open.take().unwrap_or_default();
        if let Some(tracked) = tracked {
            self.waiting.insert(
                xid,
                Waiting {
                    gid,
                    tracked,
                    events,
                },
            );
        }
    }

    /// Commit Prepared or Rollback Prepared for `xid`: what was held for it;
    /// `None` when nothing was (no outbox events, or it was prepared before
    /// the session's start position, and so already confirmed).
    pub(super) fn resolve(&mut self, xid: u32) -> Option<Waiting> {
        self.waiting.remove(&xid)
    }
}
