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
//! # Prepared transactions
//!
//! ```text
//!  stream:  BeginPrepare ev Prepare(end=140)  Begin ev Commit(end=180)  CommitPrepared
//!  tracker: [tx#0: prepared, 1 parked, end 140] [tx#1: 1 unfinished, end 180]
//!  sink:    finishes tx#1's event      → nothing moves (tx#0 is not resolved)
//!  COMMIT PREPARED: tx#0 resolved, its event handed on; once finished → confirmed = 180
//! ```
//!
//! A transaction opened by [`AckTracker::begin_prepared`] (pgoutput's Begin
//! Prepare) and closed by [`AckTracker::prepare`] keeps its place in the queue
//! like any other, but its events are *parked*: nothing may finish them until
//! the caller learns how it ended and calls [`AckTracker::resolve`] (then
//! hands them on at COMMIT PREPARED, or finishes them unpublished at
//! ROLLBACK PREPARED). Until it is resolved and its events are finished the
//! confirmed position stays before it, so before the start of its PREPARE
//! record: a walsender that restarts from there sends the prepared
//! transaction again; one that restarts past it would send only its COMMIT
//! PREPARED, without the rows. A prepared transaction without events holds
//! nothing and is confirmed at its Prepare, like an empty commit.
//!
//! The tracker is pure logic (no I/O, no clock) so it can be tested against a
//! model; the replication loop feeds it and reports [`AckTracker::confirmed`]
//! to the server.

use std::collections::VecDeque;

/// A position in the write-ahead log.
pub(crate) type Lsn = u64;

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
    /// Commit closing a transaction begun by Begin Prepare, or Prepare
    /// closing one begun by Begin.
    #[error("{0} received for a transaction that began with {1}")]
    Mismatched(&'static str, &'static str),
    /// A message the relay never asks for (Stream Prepare: streaming).
    #[error("{0} received, but the relay does not ask for streaming")]
    Unexpected(&'static str),
}

#[derive(Debug)]
struct Tx {
    /// Commit end LSN; `None` while the transaction is still being received.
    end_lsn: Option<Lsn>,
    unfinished: usize,
    /// Events received in it (finished or not).
    events: usize,
    /// Begun by Begin Prepare and not yet [resolved](AckTracker::resolve):
    /// its events are parked.
    parked: bool,
    /// Bytes its events hold while parked.
    parked_bytes: usize,
}

/// A prepared transaction with events, to [resolve](AckTracker::resolve)
/// when its COMMIT PREPARED or ROLLBACK PREPARED arrives.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct PreparedTx {
    tx: u64,
}

/// Tracks transactions in commit order and computes the confirmable LSN.
#[derive(Debug)]
pub(crate) struct AckTracker {
    confirmed: Lsn,
    /// Transactions not yet confirmed, oldest first; `txs[i]` has number `first + i`.
    txs: VecDeque<Tx>,
    first: u64,
    open: bool,
    unfinished: usize,
    /// Bytes the unfinished events hold ([`AckTracker::hold`]).
    held: usize,
    /// Events of prepared transactions not yet resolved (counted in `unfinished`).
    parked: usize,
    /// Bytes they hold (counted in `held`).
    parked_bytes: usize,
}

impl AckTracker {
    /// Start from the slot's confirmed position.
    pub(crate) fn new(confirmed: Lsn) -> Self {
        Self {
            confirmed,
            txs: VecDeque::new(),
            first: 0,
            open: false,
            unfinished: 0,
            held: 0,
            parked: 0,
            parked_bytes: 0,
        }
    }

    /// The LSN that may be reported to the server as flushed.
    pub(crate) fn confirmed(&self) -> Lsn {
        self.confirmed
    }

    /// Events received and not yet finished.
    pub(crate) fn unfinished(&self) -> usize {
        self.unfinished
    }

    /// Bytes the unfinished events hold, as [`AckTracker::hold`] was told.
    pub(crate) fn held_bytes(&self) -> usize {
        self.held
    }

    /// Events of prepared transactions not yet resolved: unfinished, but
    /// nothing in flight can finish them (part of [`AckTracker::unfinished`]).
    pub(crate) fn parked(&self) -> usize {
        self.parked
    }

    /// Bytes those events hold (part of [`AckTracker::held_bytes`]).
    pub(crate) fn parked_bytes(&self) -> usize {
        self.parked_bytes
    }

    /// Whether a transaction is being received.
    pub(crate) fn in_transaction(&self) -> bool {
        self.open
    }

    /// Nothing received is unfinished and no transaction is open.
    pub(crate) fn is_idle(&self) -> bool {
        !self.open && self.txs.is_empty()
    }

    /// A transaction begins.
    pub(crate) fn begin(&mut self) -> Result<(), FramingError> {
        self.open(false)
    }

    /// Whether the open transaction has events so far.
    pub(crate) fn open_has_events(&self) -> bool {
        self.open && self.txs.back().is_some_and(|tx| tx.events > 0)
    }

    /// A transaction being prepared begins (Begin Prepare): its events are
    /// parked until it is [resolved](AckTracker::resolve).
    pub(crate) fn begin_prepared(&mut self) -> Result<(), FramingError> {
        self.open(true)
    }

    fn open(&mut self, parked: bool) -> Result<(), FramingError> {
        if self.open {
            return Err(FramingError::NestedBegin);
        }
        self.open = true;
        self.txs.push_back(Tx {
            end_lsn: None,
            unfinished: 0,
            events: 0,
            parked,
            parked_bytes: 0,
        });
        Ok(())
    }

    /// An event of the open transaction was received (and handed on, or
    /// parked in a prepared transaction).
    pub(crate) fn event(&mut self) -> Result<Ticket, FramingError> {
        if !self.open {
            return Err(FramingError::OutsideTransaction("an event"));
        }
        let tx = self.txs.back_mut().expect("an open transaction is queued");
        tx.unfinished += 1;
        tx.events += 1;
        self.unfinished += 1;
        if tx.parked {
            self.parked += 1;
        }
        Ok(Ticket {
            tx: self.first + self.txs.len() as u64 - 1,
            bytes: 0,
        })
    }

    /// The event behind `ticket` (unfinished, not held before) holds `bytes`
    /// until it is finished: the ticket to carry with it, which gives them
    /// back in [`AckTracker::finish`].
    pub(crate) fn hold(&mut self, ticket: Ticket, bytes: usize) -> Ticket {
        debug_assert_eq!(ticket.bytes, 0, "an event is held once");
        self.held += bytes;
        if let Some(tx) = self.tx_mut(ticket.tx).filter(|tx| tx.parked) {
            tx.parked_bytes += bytes;
            self.parked_bytes += bytes;
        }
        Ticket { bytes, ..ticket }
    }

    fn tx_mut(&mut self, number: u64) -> Option<&mut Tx> {
        let index = number.checked_sub(self.first)?;
        self.txs.get_mut(usize::try_from(index).ok()?)
    }

    /// The open transaction committed, its commit record ending at `end_lsn`.
    /// Returns the new confirmed LSN when it moved.
    pub(crate) fn commit(&mut self, end_lsn: Lsn) -> Result<Option<Lsn>, FramingError> {
        if !self.open {
            return Err(FramingError::OutsideTransaction("Commit"));
        }
        if self.txs.back().is_some_and(|tx| tx.parked) {
            return Err(FramingError::Mismatched("Commit", "Begin Prepare"));
        }
        Ok(self.close(end_lsn))
    }

    /// The open transaction (begun by [`AckTracker::begin_prepared`]) was
    /// prepared, ending at `end_lsn`. With events, it holds the confirmed
    /// position until [`AckTracker::resolve`] is given what this returns;
    /// without, it is done, like an empty commit (`None`).
    pub(crate) fn prepare(&mut self, end_lsn: Lsn) -> Result<Option<PreparedTx>, FramingError> {
        if !self.open {
            return Err(FramingError::OutsideTransaction("Prepare"));
        }
        match self.txs.back_mut() {
            Some(tx) if !tx.parked => Err(FramingError::Mismatched("Prepare", "Begin")),
            Some(tx) if tx.events == 0 => {
                tx.parked = false;
                self.close(end_lsn);
                Ok(None)
            }
            _ => {
                let number = self.first + self.txs.len() as u64 - 1;
                self.close(end_lsn);
                Ok(Some(PreparedTx { tx: number }))
            }
        }
    }

    /// The prepared transaction was committed or rolled back: its events are
    /// no longer parked, and finishing them (published, or dropped for a
    /// rollback) lets the confirmed position pass it. Returns the new
    /// confirmed LSN when it moved.
    pub(crate) fn resolve(&mut self, prepared: PreparedTx) -> Option<Lsn> {
        let tx = self.tx_mut(prepared.tx).filter(|tx| tx.parked)?;
        tx.parked = false;
        let (events, bytes) = (tx.unfinished, std::mem::take(&mut tx.parked_bytes));
        self.parked -= events;
        self.parked_bytes -= bytes;
        self.advance()
    }

    fn close(&mut self, end_lsn: Lsn) -> Option<Lsn> {
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
        self.advance()
    }

    /// The event behind `ticket` is finished. Returns the new confirmed LSN when it moved.
    pub(crate) fn finish(&mut self, ticket: Ticket) -> Option<Lsn> {
        // None: its transaction was already confirmed or dropped.
        let tx = self.tx_mut(ticket.tx)?;
        if tx.unfinished == 0 {
            return None;
        }
        tx.unfinished -= 1;
        if tx.parked {
            tx.parked_bytes -= ticket.bytes;
            self.parked -= 1;
            self.parked_bytes -= ticket.bytes;
        }
        self.unfinished -= 1;
        self.held -= ticket.bytes;
        self.advance()
    }

    /// A keepalive reported the server's `wal_end`. Returns the new confirmed
    /// LSN when it moved.
    pub(crate) fn keepalive(&mut self, wal_end: Lsn) -> Option<Lsn> {
        if self.is_idle() && wal_end > self.confirmed {
            self.confirmed = wal_end;
            return Some(wal_end);
        }
        None
    }

    fn advance(&mut self) -> Option<Lsn> {
        let before = self.confirmed;
        while let Some(front) = self.txs.front() {
            let done = front.unfinished == 0 && !front.parked;
            let Some(end) = front.end_lsn.filter(|_| done) else {
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
        assert!(t.prepare(1).is_err());
        t.begin().unwrap();
        assert_eq!(t.begin(), Err(FramingError::NestedBegin));
        assert_eq!(t.begin_prepared(), Err(FramingError::NestedBegin));
        assert_eq!(
            t.prepare(2),
            Err(FramingError::Mismatched("Prepare", "Begin"))
        );
        t.commit(3).unwrap();
        t.begin_prepared().unwrap();
        assert_eq!(
            t.commit(4),
            Err(FramingError::Mismatched("Commit", "Begin Prepare"))
        );
    }

    #[test]
    fn a_prepared_transaction_holds_the_position_until_resolved_and_finished() {
        let mut t = AckTracker::new(0);
        t.begin().unwrap();
        let a = t.event().unwrap();
        t.commit(10).unwrap();
        t.begin_prepared().unwrap();
        let p = t.event().unwrap();
        let p = t.hold(p, 700);
        let prepared = t.prepare(20).unwrap().expect("it has an event");
        assert_eq!((t.parked(), t.parked_bytes()), (1, 700));
        assert_eq!(t.finish(a), Some(10), "the commit before it");
        // A transaction committed after the PREPARE, finished: still held.
        t.begin().unwrap();
        let b = t.event().unwrap();
        t.commit(30).unwrap();
        assert_eq!(t.finish(b), None);
        assert_eq!(t.keepalive(99), None, "not idle");
        assert_eq!(t.confirmed(), 10);
        // COMMIT PREPARED: handed on, then finished.
        assert_eq!(t.resolve(prepared), None, "its event is unfinished");
        assert_eq!((t.parked(), t.parked_bytes()), (0, 0));
        assert_eq!((t.unfinished(), t.held_bytes()), (1, 700));
        assert_eq!(t.finish(p), Some(30));
        assert!(t.is_idle());
        assert_eq!(t.held_bytes(), 0);
    }

    #[test]
    fn a_rolled_back_prepared_transaction_passes_once_its_events_are_dropped() {
        let mut t = AckTracker::new(0);
        t.begin_prepared().unwrap();
        let events = [t.event().unwrap(), t.event().unwrap()];
        let prepared = t.prepare(20).unwrap().unwrap();
        assert_eq!(t.parked(), 2);
        t.resolve(prepared);
        assert_eq!(t.finish(events[0]), None);
        assert_eq!(t.finish(events[1]), Some(20));
        assert_eq!((t.unfinished(), t.parked()), (0, 0));
    }

    #[test]
    fn a_prepared_transaction_without_events_holds_nothing() {
        let mut t = AckTracker::new(0);
        t.begin_prepared().unwrap();
        assert_eq!(t.prepare(20).unwrap(), None);
        assert_eq!(t.confirmed(), 20);
        assert!(t.is_idle());
        assert_eq!(t.keepalive(40), Some(40));
    }

    #[test]
    fn events_of_a_prepared_transaction_are_parked_from_its_first() {
        // While it is still being received, too: nothing can finish them.
        let mut t = AckTracker::new(0);
        t.begin_prepared().unwrap();
        let e = t.event().unwrap();
        t.hold(e, 100);
        assert_eq!((t.parked(), t.parked_bytes()), (1, 100));
        assert!(t.in_transaction());
    }

    /// Operations for the model test.
    #[derive(Debug, Clone)]
    enum Op {
        /// A whole transaction with this many events arrives.
        Tx(usize),
        /// A whole prepared transaction with this many events arrives.
        Prepared(usize),
        /// The k-th (mod len) unresolved prepared transaction is committed
        /// or rolled back: its events may be finished from now on.
        Resolve(usize),
        /// Finish the k-th (mod len) outstanding event.
        Finish(usize),
        /// A keepalive arrives.
        Keepalive,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0usize..4).prop_map(Op::Tx),
            1 => (0usize..4).prop_map(Op::Prepared),
            1 => any::<usize>().prop_map(Op::Resolve),
            4 => any::<usize>().prop_map(Op::Finish),
            1 => Just(Op::Keepalive),
        ]
    }

    /// A transaction as the model sees it.
    struct Modelled {
        /// Where its first record starts (after the previous one's end).
        start: Lsn,
        end: Lsn,
        /// Events not finished.
        remaining: usize,
        /// Prepared and not yet resolved.
        unresolved: bool,
    }

    proptest! {
        /// Against a model: the confirmed LSN is monotonic, never passes the
        /// start of a transaction with an unfinished event or an unresolved
        /// prepared transaction, and equals the end of the longest fully
        /// finished prefix (or a keepalive past it when idle).
        #[test]
        fn the_confirmed_lsn_is_the_end_of_the_finished_prefix(ops in prop::collection::vec(op(), 0..200)) {
            let mut t = AckTracker::new(0);
            let mut lsn: Lsn = 0;
            let mut model: Vec<Modelled> = Vec::new();
            let mut outstanding: Vec<(Ticket, usize)> = Vec::new();
            // Unresolved prepared transactions: their handle, index and parked tickets.
            let mut unresolved: Vec<(PreparedTx, usize, Vec<Ticket>)> = Vec::new();
            let mut last = 0;
            for op in ops {
                match op {
                    Op::Tx(n) | Op::Prepared(n) => {
                        let prepared = matches!(op, Op::Prepared(_));
                        if prepared {
                            t.begin_prepared().unwrap();
                        } else {
                            t.begin().unwrap();
                        }
                        let index = model.len();
                        let tickets: Vec<Ticket> = (0..n)
                            .map(|k| {
                                let ticket = t.event().unwrap();
                                t.hold(ticket, 100 * k + index)
                            })
                            .collect();
                        let start = lsn + 1;
                        lsn += 10;
                        let parked = if prepared {
                            t.prepare(lsn).unwrap()
                        } else {
                            t.commit(lsn).unwrap();
                            None
                        };
                        prop_assert_eq!(parked.is_some(), prepared && n > 0);
                        match parked {
                            Some(handle) => unresolved.push((handle, index, tickets)),
                            None => outstanding.extend(tickets.into_iter().map(|t| (t, index))),
                        }
                        model.push(Modelled { start, end: lsn, remaining: n, unresolved: prepared && n > 0 });
                    }
                    Op::Resolve(k) => {
                        if !unresolved.is_empty() {
                            let (handle, index, tickets) = unresolved.remove(k % unresolved.len());
                            t.resolve(handle);
                            model[index].unresolved = false;
                            outstanding.extend(tickets.into_iter().map(|t| (t, index)));
                        }
                    }
                    Op::Finish(k) => {
                        if !outstanding.is_empty() {
                            let (ticket, index) = outstanding.remove(k % outstanding.len());
                            t.finish(ticket);
                            model[index].remaining -= 1;
                        }
                    }
                    Op::Keepalive => {
                        lsn += 5;
                        let idle = model.iter().all(|m| m.remaining == 0 && !m.unresolved);
                        let moved = t.keepalive(lsn);
                        prop_assert_eq!(moved.is_some(), idle);
                    }
                }
                let c = t.confirmed();
                prop_assert!(c >= last, "moved backward: {} -> {}", last, c);
                last = c;
                // Never past the start of the first transaction holding anything.
                let held = |m: &&Modelled| m.remaining > 0 || m.unresolved;
                if let Some(first) = model.iter().find(held) {
                    prop_assert!(c < first.start, "confirmed {} passes {} at {}", c, first.end, first.start);
                }
                // At least the end of the finished prefix.
                let prefix_end = model.iter().take_while(|m| !held(m)).map(|m| m.end).max().unwrap_or(0);
                prop_assert!(c >= prefix_end, "confirmed {} behind finished prefix {}", c, prefix_end);
                let parked: usize = unresolved.iter().map(|(_, _, tickets)| tickets.len()).sum();
                prop_assert_eq!(t.unfinished(), outstanding.len() + parked);
                prop_assert_eq!(t.parked(), parked);
                let bytes = |tickets: &mut dyn Iterator<Item = &Ticket>| tickets.map(Ticket::bytes).sum::<usize>();
                let parked_bytes = bytes(&mut unresolved.iter().flat_map(|(_, _, tickets)| tickets));
                prop_assert_eq!(t.parked_bytes(), parked_bytes);
                prop_assert_eq!(t.held_bytes(), bytes(&mut outstanding.iter().map(|(t, _)| t)) + parked_bytes);
            }
        }
    }
}
