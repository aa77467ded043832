//! The ack tracker: which LSN may be confirmed to Postgres.
//!
//! ```text
//!  stream:  Begin  ev ev  Commit(end=120) Begin ev Commit(end=180)  Keepalive(wal_end=300)
//!  tracker: [tx#0: 2 unfinished, end 120] [tx#1: 1 unfinished, end 180]
//!  sink:    finishes tx#1's event first → nothing moves (tx#0 still open work)
//!           finishes tx#0's events      → confirmed = 180 (both done, in commit order)
//!           keepalive with nothing open → confirmed = 300 (idle rule)
//! ```
//!
//! # Invariants
//!
//! * **No loss.** [`AckTracker::confirmed`] is the commit end LSN of the last
//!   transaction which, together with every transaction before it, has all of
//!   its events finished (delivered, or rejected and recorded). It never passes
//!   the end LSN of a transaction with an unfinished event, and stops at the
//!   first such transaction.
//! * **Monotonic.** The confirmed LSN never moves backward.
//! * **Idle slots do not hold WAL.** When no transaction is open and nothing
//!   received is unfinished, a keepalive's `wal_end` becomes the confirmed LSN:
//!   every commit before `wal_end` has been received and finished (the server
//!   sends keepalives in stream order, after the data they follow), and every
//!   commit still to come ends after it.
//!
//! Confirming a commit's *end* LSN is what makes a restart skip exactly the
//! transactions already handled: Postgres resumes decoding with the first
//! commit whose record starts at or after the confirmed position.
//!
//! The tracker is pure logic (no I/O, no clock) so it can be tested against a
//! model; the replication loop feeds it and reports [`AckTracker::confirmed`]
//! to the server.

use std::collections::VecDeque;

/// A position in the write-ahead log.
pub type Lsn = u64;

/// Names one received event so its outcome can be reported back, and
/// carries the bytes it holds until then ([`AckTracker::hold`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket {
    tx: u64,
    bytes: usize,
}

impl Ticket {
    /// A ticket no tracker knows, for messages published outside the stream
    /// (the poller, replays): finishing it changes nothing.
    pub fn detached() -> Self {
        Self {
            tx: u64::MAX,
            bytes: 0,
        }
    }

    /// The bytes its event holds, as [`AckTracker::hold`] counted them.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

/// The stream broke the Begin/Commit framing: a bug or a protocol mismatch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FramingError {
    /// Begin while a transaction was open.
    #[error("Begin received while a transaction is open")]
    NestedBegin,
    /// Commit or an event without Begin.
    #[error("{0} received outside a transaction")]
    OutsideTransaction(&'static str),
}

#[derive(Debug)]
struct Tx {
    /// Commit end LSN; `None` while the transaction is still being received.
    end_lsn: Option<Lsn>,
    unfinished: usize,
    /// Events received in it (finished or not).
    events: usize,
}

/// Tracks transactions in commit order and computes the confirmable LSN.
#[derive(Debug)]
pub struct AckTracker {
    confirmed: Lsn,
    /// Transactions not yet confirmed, oldest first; `txs[i]` has number `first + i`.
    txs: VecDeque<Tx>,
    first: u64,
    open: bool,
    unfinished: usize,
    /// Bytes the unfinished events hold ([`AckTracker::hold`]).
    held: usize,
}

impl AckTracker {
    /// Start from the slot's confirmed position.
    pub fn new(confirmed: Lsn) -> Self {
        Self {
            confirmed,
            txs: VecDeque::new(),
            first: 0,
            open: false,
            unfinished: 0,
            held: 0,
        }
    }

    /// The LSN that may be reported to the server as flushed.
    pub fn confirmed(&self) -> Lsn {
        self.confirmed
    }

    /// Events received and not yet finished.
    pub fn unfinished(&self) -> usize {
        self.unfinished
    }

    /// Bytes the unfinished events hold, as [`AckTracker::hold`] was told.
    pub fn held_bytes(&self) -> usize {
        self.held
    }

    /// Whether a transaction is being received.
    pub fn in_transaction(&self) -> bool {
        self.open
    }

    /// Nothing received is unfinished and no transaction is open.
    pub fn is_idle(&self) -> bool {
        !self.open && self.txs.is_empty()
    }

    /// A transaction begins.
    pub fn begin(&mut self) -> Result<(), FramingError> {
        if self.open {
            return Err(FramingError::NestedBegin);
        }
        self.open = true;
        self.txs.push_back(Tx {
            end_lsn: None,
            unfinished: 0,
            events: 0,
        });
        Ok(())
    }

    /// An event of the open transaction was received and handed on.
    pub fn event(&mut self) -> Result<Ticket, FramingError> {
        if !self.open {
            return Err(FramingError::OutsideTransaction("an event"));
        }
        let tx = self.txs.back_mut().expect("an open transaction is queued");
        tx.unfinished += 1;
        tx.events += 1;
        self.unfinished += 1;
        Ok(Ticket {
            tx: self.first + self.txs.len() as u64 - 1,
            bytes: 0,
        })
    }

    /// The event behind `ticket` (unfinished, not held before) holds `bytes`
    /// until it is finished: the ticket to carry with it, which gives them
    /// back in [`AckTracker::finish`].
    pub fn hold(&mut self, ticket: Ticket, bytes: usize) -> Ticket {
        debug_assert_eq!(ticket.bytes, 0, "an event is held once");
        self.held += bytes;
        Ticket { bytes, ..ticket }
    }

    /// The open transaction committed, its commit record ending at `end_lsn`.
    /// Returns the new confirmed LSN when it moved.
    pub fn commit(&mut self, end_lsn: Lsn) -> Result<Option<Lsn>, FramingError> {
        if !self.open {
            return Err(FramingError::OutsideTransaction("Commit"));
        }
        self.open = false;
        let tx = self.txs.pop_back().expect("an open transaction is queued");
        match self.txs.back_mut() {
            // A transaction without events (other tables, logical messages)
            // behind unfinished work: fold it into the one before, so the
            // queue stays bounded by events, not by transactions. Confirming
            // that one later confirms this one too, which holds nothing.
            Some(previous) if tx.events == 0 => previous.end_lsn = Some(end_lsn),
            _ => self.txs.push_back(Tx {
                end_lsn: Some(end_lsn),
                ..tx
            }),
        }
        Ok(self.advance())
    }

    /// The event behind `ticket` is finished. Returns the new confirmed LSN when it moved.
    pub fn finish(&mut self, ticket: Ticket) -> Option<Lsn> {
        let Some(index) = ticket.tx.checked_sub(self.first) else {
            return None; // its transaction was already confirmed or dropped
        };
        let tx = self.txs.get_mut(index as usize)?;
        if tx.unfinished == 0 {
            return None;
        }
        tx.unfinished -= 1;
        self.unfinished -= 1;
        self.held -= ticket.bytes;
        self.advance()
    }

    /// A keepalive reported the server's `wal_end`. Returns the new confirmed
    /// LSN when it moved.
    pub fn keepalive(&mut self, wal_end: Lsn) -> Option<Lsn> {
        if self.is_idle() && wal_end > self.confirmed {
            self.confirmed = wal_end;
            return Some(wal_end);
        }
        None
    }

    fn advance(&mut self) -> Option<Lsn> {
        let before = self.confirmed;
        while let Some(front) = self.txs.front() {
            let Some(end) = front.end_lsn.filter(|_| front.unfinished == 0) else {
                break;
            };
            self.confirmed = self.confirmed.max(end);
            self.txs.pop_front();
            self.first += 1;
        }
        (self.confirmed > before).then_some(self.confirmed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_transaction_is_confirmed_when_all_its_events_finish() {
        let mut t = AckTracker::new(100);
        t.begin().unwrap();
        let a = t.event().unwrap();
        let b = t.event().unwrap();
        assert_eq!(t.commit(200).unwrap(), None);
        assert_eq!(t.finish(a), None);
        assert_eq!(t.confirmed(), 100);
        assert_eq!(t.finish(b), Some(200));
        assert!(t.is_idle());
    }

    #[test]
    fn a_later_transaction_waits_for_an_earlier_one() {
        let mut t = AckTracker::new(0);
        t.begin().unwrap();
        let a = t.event().unwrap();
        t.commit(10).unwrap();
        t.begin().unwrap();
        let b = t.event().unwrap();
        t.commit(20).unwrap();
        assert_eq!(t.finish(b), None, "tx 2 finished but tx 1 has not");
        assert_eq!(t.keepalive(99), None, "not idle");
        assert_eq!(t.finish(a), Some(20));
        assert_eq!(t.keepalive(99), Some(99));
    }

    #[test]
    fn a_transaction_without_events_confirms_at_commit() {
        let mut t = AckTracker::new(0);
        t.begin().unwrap();
        assert_eq!(t.commit(50).unwrap(), Some(50));
    }

    #[test]
    fn a_keepalive_during_an_open_transaction_changes_nothing() {
        let mut t = AckTracker::new(0);
        t.begin().unwrap();
        assert_eq!(t.keepalive(500), None);
        t.commit(60).unwrap();
        assert_eq!(t.confirmed(), 60);
    }

    #[test]
    fn transactions_without_events_do_not_grow_the_queue() {
        let mut t = AckTracker::new(0);
        t.begin().unwrap();
        let a = t.event().unwrap();
        t.commit(10).unwrap();
        for end in 11..10_000 {
            t.begin().unwrap();
            t.commit(end).unwrap();
        }
        assert_eq!(t.txs.len(), 1, "folded into the unfinished one");
        assert_eq!(t.confirmed(), 0);
        assert_eq!(t.finish(a), Some(9_999));
    }

    #[test]
    fn framing_errors_are_reported() {
        let mut t = AckTracker::new(0);
        assert!(t.event().is_err());
        assert!(t.commit(1).is_err());
        t.begin().unwrap();
        assert_eq!(t.begin(), Err(FramingError::NestedBegin));
    }

    /// Operations for the model test.
    #[derive(Debug, Clone)]
    enum Op {
        /// A whole transaction with this many events arrives.
        Tx(usize),
        /// Finish the k-th (mod len) outstanding event.
        Finish(usize),
        /// A keepalive arrives.
        Keepalive,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0usize..4).prop_map(Op::Tx),
            4 => any::<usize>().prop_map(Op::Finish),
            1 => Just(Op::Keepalive),
        ]
    }

    proptest! {
        /// Against a model: the confirmed LSN is monotonic, never passes a
        /// transaction with an unfinished event, and equals the end of the
        /// longest fully finished prefix (or a keepalive past it when idle).
        #[test]
        fn the_confirmed_lsn_is_the_end_of_the_finished_prefix(ops in prop::collection::vec(op(), 0..200)) {
            let mut t = AckTracker::new(0);
            let mut lsn: Lsn = 0;
            // Model: committed transactions (end, remaining events); broken ones are None.
            let mut model: Vec<(Option<Lsn>, usize)> = Vec::new();
            let mut outstanding: Vec<(Ticket, usize)> = Vec::new();
            let mut last = 0;
            for op in ops {
                match op {
                    Op::Tx(n) => {
                        t.begin().unwrap();
                        let index = model.len();
                        for k in 0..n {
                            let ticket = t.event().unwrap();
                            outstanding.push((t.hold(ticket, 100 * k + index), index));
                        }
                        lsn += 10;
                        t.commit(lsn).unwrap();
                        model.push((Some(lsn), n));
                    }
                    Op::Finish(k) => {
                        if !outstanding.is_empty() {
                            let (ticket, index) = outstanding.remove(k % outstanding.len());
                            t.finish(ticket);
                            model[index].1 -= 1;
                        }
                    }
                    Op::Keepalive => {
                        lsn += 5;
                        let idle = model.iter().all(|(_, n)| *n == 0);
                        let moved = t.keepalive(lsn);
                        prop_assert_eq!(moved.is_some(), idle);
                    }
                }
                let c = t.confirmed();
                prop_assert!(c >= last, "moved backward: {} -> {}", last, c);
                last = c;
                // Never past the first transaction with unfinished events.
                if let Some((Some(end), _)) = model.iter().find(|(_, n)| *n > 0) {
                    prop_assert!(c < *end, "confirmed {} passes unfinished commit {}", c, end);
                }
                // At least the end of the finished prefix.
                let prefix_end = model.iter().take_while(|(_, n)| *n == 0).filter_map(|(e, _)| *e).max().unwrap_or(0);
                prop_assert!(c >= prefix_end, "confirmed {} behind finished prefix {}", c, prefix_end);
                prop_assert_eq!(t.unfinished(), outstanding.len());
                prop_assert_eq!(t.held_bytes(), outstanding.iter().map(|(ticket, _)| ticket.bytes()).sum::<usize>());
            }
        }
    }
}
