//! The publisher: forms batches for a sink, keeps each ordering group in
//! order, retries what failed, records what was rejected, and reports every
//! message's final outcome back to the replication loop.
//!
//! ```text
//!  replication loop ──[Dispatch] (one Vec per burst)──► a queue per group ──batch (one destination, ≤ max_batch)──► sink.publish
//!         ▲                                  ▲ failed entries go back to their group's front, the group waits (backoff)
//!         └──── Completion (Delivered | Rejected, after recording) ◄──────────────────────────────┘
//! ```
//!
//! # Batches and concurrency
//!
//! * Messages wait in one queue per ordering group, in commit order; a pick
//!   costs the batch's size, not the messages waiting behind blocked groups.
//!   With one batch in flight, a batch takes the oldest messages of the
//!   groups that may send (not blocked, see below), merging their queues by
//!   arrival, so the sink publishes in commit order across groups too. With
//!   several, it takes the ready groups oldest first and from each the run at
//!   its queue's front: several messages of one group travel in one batch, in
//!   order, so a backlog of few groups fills batches and is not held to one
//!   message a group a round trip.
//! * A partial batch goes at once when no batch is in flight (an idle relay
//!   does not wait); otherwise it waits up to the sink's linger for more.
//! * At most [`Limiter::limit`] batches are in flight: fixed, or adaptive
//!   from each batch's round-trip time and [`Cause`] (see
//!   [`crate::pipeline::concurrency`]), as [`Sink::concurrency`] says. Once an
//!   adaptive sink was throttled, batches also start no faster than the
//!   limiter's pace ([`Limiter::paced_until`]).
//!
//! # Ordering (per group; the group is the aggregate id unless configured)
//!
//! * A group is *blocked* while one of its messages is in a batch in flight,
//!   or while it waits out a retry backoff. A batch never takes a message of a
//!   blocked group, and takes a group's messages only from the front of its
//!   queue, in order: so a later event of a group is never published before
//!   an earlier one is confirmed, except behind it in the same batch.
//! * After a partial batch failure, the failed entry and every later entry of
//!   its group in that batch (even ones the sink accepted) go back to the
//!   front of the group's queue, in order, and are sent again after the
//!   group's backoff. Other groups keep flowing.
//! * Transient failures are retried forever with capped, jittered exponential
//!   backoff; nothing is reported for them, so the slot does not move past them.
//! * Rejected messages are recorded in the database ([`Recorder`]) before they
//!   are reported, so the slot never passes an event that is neither delivered
//!   nor recorded.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::pipeline::ack::Ticket;
use crate::pipeline::concurrency::{Limiter, Signal};
use crate::pipeline::sink::{Cause, Message, Outcome, Retry, Sink};
use crate::postgres::outbox::marking::{Mark, Marker};
use crate::postgres::outbox::record::{RecordError, Recorder};
use crate::retry::Backoff;

/// What the replication loop hands the publisher.
#[derive(Debug)]
pub(crate) enum Dispatch {
    /// Publish this message.
    Publish(Message),
    /// This row cannot be published (it did not map, or has no route): record it.
    Reject {
        /// Its ticket.
        ticket: Ticket,
        /// The event id, when known.
        id: String,
        /// Why.
        reason: String,
    },
}

/// The final word on one message.
#[derive(Debug, Clone)]
pub(crate) enum Completion {
    /// Durably accepted by the sink.
    Delivered(Ticket),
    /// Never acceptable; recorded in the database.
    Rejected {
        /// Its ticket.
        ticket: Ticket,
        /// The event id.
        id: String,
        /// Why.
        reason: String,
    },
}

/// What became of one message of a finished batch.
enum Verdict {
    Delivered,
    Rejected(String),
    Retry(Retry),
}

/// What a publish task hands back.
enum Done {
    /// A batch: its messages, each one's verdict (rejections already
    /// recorded), group key and queue sequence number, in the same order;
    /// and how long the sink took.
    Batch {
        messages: Vec<Message>,
        verdicts: Vec<Verdict>,
        keys: Vec<GroupKey>,
        seqs: Vec<u64>,
        rtt: Duration,
    },
    /// A row that could not be published, recorded.
    Rejected {
        ticket: Ticket,
        id: String,
        reason: String,
    },
}

struct Queued {
    /// Arrival order (a retried message keeps its own): groups are taken by
    /// their oldest queued message.
    seq: u64,
    arrived: Instant,
    message: Message,
}

/// One ordering group's queue and state.
#[derive(Default)]
struct Group {
    queue: VecDeque<Queued>,
    block: Option<Block>,
}

/// An ordering group as the publisher tracks it: a 64-bit hash of the
/// group's text, taken once a message, so the maps below hash a number, not
/// a string, and hold no reference to the message's buffer.
///
/// Two groups whose texts hash alike are one group here: each waits for the
/// other's batches and backoffs, and an entry of one behind a failed entry of
/// the other in a batch is sent again. That is slower for those two and may
/// repeat a message (at least once, as ever), never out of order; so the
/// hash needs no defence against chosen group names.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
struct GroupKey(u64);

impl GroupKey {
    fn of(group: &str) -> Self {
        // A fixed seed: the key only has to agree with itself within a process.
        Self(foldhash::fast::FixedState::with_seed(0x6f75_7462_6f78).hash_one(group))
    }
}

/// A map by group key: the key is already a hash, so the map uses it as is.
type ByGroup<V> = HashMap<GroupKey, V, BuildHasherDefault<KeyHasher>>;

/// A set of group keys, hashed as [`ByGroup`] is.
type GroupSet = HashSet<GroupKey, BuildHasherDefault<KeyHasher>>;

/// Passes a [`GroupKey`]'s hash through.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is called for a `GroupKey`; anything else still hashes.
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(0x517c_c1b7_2722_0a95);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

#[derive(Clone, Copy)]
enum Block {
    /// In a batch in flight.
    InFlight,
    /// Waiting out a retry backoff (until its entry in `waiting`).
    Backoff,
}

/// The publisher's state.
struct Publisher<S> {
    sink: Arc<S>,
    recorder: Option<Arc<Recorder>>,
    marker: Option<Marker>,
    backoff: Backoff,
    done: mpsc::UnboundedSender<Vec<Completion>>,
    /// Groups with messages queued or blocked (or both).
    groups: ByGroup<Group>,
    /// Unblocked groups with messages queued, by their front's `seq`.
    ready: BTreeSet<(u64, GroupKey)>,
    /// Groups waiting out a backoff, by when it ends.
    waiting: BTreeSet<(Instant, GroupKey)>,
    /// Messages queued in `groups`.
    queued: usize,
    next_seq: u64,
    /// Consecutive failed attempts per group.
    failures: ByGroup<u32>,
    tasks: JoinSet<Result<Done, RecordError>>,
    /// Batches in flight (`tasks` also records rejected rows).
    batches: usize,
    max_batch: usize,
    /// Most messages of one group in a batch ([`Sink::max_run`]).
    max_run: usize,
    limiter: Limiter,
    linger: Duration,
}

/// How many ready groups a pick passes over for going elsewhere than the
/// batch's destination before it settles for what it has.
const MAX_SKIPPED_GROUPS: usize = 1024;

/// Drive `sink` until `input` closes and everything is settled; report every
/// message's final outcome on `done` (a finished batch's outcomes together:
/// one wake-up of the replication loop per batch, not per message). Rejections are recorded with
/// `recorder`; deliveries are marked with `marker` (in the derived lifecycle
/// only those outside what a snapshot may vouch for: [`Marker::deliveries`]).
pub(crate) async fn run<S: Sink>(
    sink: Arc<S>,
    recorder: Option<Arc<Recorder>>,
    marker: Option<Marker>,
    mut input: mpsc::Receiver<Vec<Dispatch>>,
    done: mpsc::UnboundedSender<Vec<Completion>>,
    backoff: Backoff,
) -> Result<(), RecordError> {
    let limiter = Limiter::new(sink.concurrency());
    let metrics = crate::metrics::get();
    metrics.sink_concurrency_limit.set(limiter.limit() as i64);
    let mut p = Publisher {
        max_batch: sink.max_batch().max(1),
        max_run: sink.max_run().max(1),
        limiter,
        linger: sink.linger(),
        sink,
        recorder,
        marker,
        backoff,
        done,
        groups: ByGroup::default(),
        ready: BTreeSet::new(),
        waiting: BTreeSet::new(),
        queued: 0,
        next_seq: 0,
        failures: ByGroup::default(),
        tasks: JoinSet::new(),
        batches: 0,
    };
    let mut open = true;
    loop {
        let wake = p.dispatch(open);
        if !open && p.queued == 0 && p.tasks.is_empty() {
            return Ok(());
        }
        tokio::select! {
            received = input.recv(), if open => match received {
                Some(first) => {
                    // Take what else is waiting too: one pass of the loop
                    // (and one batch pick) per burst, not per message.
                    // One clock reading for all of it.
                    let now = Instant::now();
                    let mut taken = first.len();
                    first.into_iter().for_each(|d| p.accept(d, now));
                    while taken < p.max_batch {
                        match input.try_recv() {
                            Ok(more) => {
                                taken += more.len();
                                more.into_iter().for_each(|d| p.accept(d, now));
                            }
                            Err(_) => break,
                        }
                    }
                }
                None => open = false,
            },
            Some(finished) = p.tasks.join_next() => match finished {
                Ok(Ok(Done::Batch { messages, verdicts, keys, seqs, rtt })) => {
                    p.batches -= 1;
                    p.observe(&verdicts, rtt);
                    if !p.settle(messages, verdicts, keys, seqs) {
                        return Ok(());
                    }
                }
                Ok(Ok(Done::Rejected { ticket, id, reason })) => {
                    if p.done.send(vec![Completion::Rejected { ticket, id, reason }]).is_err() {
                        return Ok(());
                    }
                }
                Ok(Err(e)) => {
                    // Nothing is reported for what could not be recorded: the
                    // session ends with the reason (its class says whether a
                    // fresh connection may help), acknowledging nothing more.
                    return Err(e);
                }
                Err(e) => {
                    tracing::error!(error = %crate::report::Chain(&e), "a publish task failed");
                    return Ok(()); // the session restarts; unconfirmed events are sent again
                }
            },
            _ = sleep_until(wake) => {}
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

impl<S: Sink> Publisher<S> {
    /// Queue a message that arrived at `now`, or start recording a row that
    /// cannot be published.
    fn accept(&mut self, dispatch: Dispatch, now: Instant) {
        match dispatch {
            Dispatch::Publish(message) => {
                let key = GroupKey::of(message.event.group());
                let seq = self.next_seq;
                self.next_seq += 1;
                self.queued += 1;
                let group = self.groups.entry(key).or_default();
                if group.queue.is_empty() && group.block.is_none() {
                    self.ready.insert((seq, key));
                }
                group.queue.push_back(Queued {
                    seq,
                    arrived: now,
                    message,
                });
            }
            Dispatch::Reject { ticket, id, reason } => {
                let recorder = self.recorder.clone();
                self.tasks.spawn(async move {
                    if let Some(recorder) = recorder {
                        recorder.record(&id, None, None, &reason).await?;
                    }
                    Ok(Done::Rejected { ticket, id, reason })
                });
            }
        }
    }

    /// Start as many batches as allowed; when to look again (a linger or
    /// backoff ending), if anything waits on time.
    fn dispatch(&mut self, open: bool) -> Option<Instant> {
        loop {
            if self.batches >= self.limiter.limit() {
                return None; // a batch finishing wakes the loop
            }
            let now = Instant::now();
            // The limiter's own clock (pure logic: it is handed the time).
            let clock = std::time::Instant::now();
            while let Some(&(at, key)) = self.waiting.first() {
                if at > now {
                    break;
                }
                self.waiting.pop_first();
                self.unblock(key);
            }
            if !self.ready.is_empty() {
                if let Some(at) = self.limiter.paced_until(clock) {
                    // Paced: the next batch starts then (or when a backoff ends).
                    let at = now + at.saturating_duration_since(clock);
                    let backoff = self.waiting.first().map(|&(w, _)| w);
                    return Some(backoff.map_or(at, |w| w.min(at)));
                }
            }
            let (picked, wake) = self.pick(now, open);
            if picked.is_empty() {
                return wake;
            }
            let (batch, keys, seqs) = self.take(&picked);
            self.batches += 1;
            self.limiter.started(clock);
            if self.batches >= self.limiter.limit() {
                self.limiter.saturated();
            }
            let sink = Arc::clone(&self.sink);
            let recorder = self.recorder.clone();
            self.tasks.spawn(async move {
                let started = std::time::Instant::now();
                let outcomes = sink.publish(&batch).await;
                let rtt = started.elapsed();
                crate::metrics::get()
                    .publish_duration
                    .observe(rtt.as_secs_f64());
                let verdicts = verdicts(&batch, outcomes);
                if let Some(recorder) = recorder {
                    // Record only what `settle` will report: a rejection behind a
                    // failed entry of its group is sent again, not reported.
                    let mut failed = GroupSet::default();
                    for ((m, v), key) in batch.iter().zip(&verdicts).zip(&keys) {
                        match v {
                            _ if failed.contains(key) => {}
                            Verdict::Retry(_) => {
                                failed.insert(*key);
                            }
                            Verdict::Rejected(reason) => {
                                // Boxed: rare, and its state would make every batch's task large.
                                Box::pin(recorder.record(
                                    m.event.id(),
                                    Some(&m.event),
                                    Some(&m.body),
                                    reason,
                                ))
                                .await?;
                            }
                            Verdict::Delivered => {}
                        }
                    }
                }
                Ok(Done::Batch {
                    messages: batch,
                    verdicts,
                    keys,
                    seqs,
                    rtt,
                })
            });
        }
    }

    /// A group's backoff ended: it may send again.
    fn unblock(&mut self, key: GroupKey) {
        let Some(group) = self.groups.get_mut(&key) else {
            return;
        };
        group.block = None;
        match group.queue.front() {
            Some(front) => {
                self.ready.insert((front.seq, key));
            }
            None => {
                self.groups.remove(&key);
            }
        }
    }

    /// Take `picked` (one group key per message, in the batch's order) out
    /// of the groups' queues and block those groups: the batch's messages
    /// with their group keys and sequence numbers.
    fn take(&mut self, picked: &[GroupKey]) -> (Vec<Message>, Vec<GroupKey>, Vec<u64>) {
        for &key in picked {
            let group = self.groups.get_mut(&key).expect("a picked group is queued");
            if group.block.is_none() {
                if let Some(front) = group.queue.front() {
                    self.ready.remove(&(front.seq, key));
                }
                group.block = Some(Block::InFlight);
            }
        }
        let mut batch = Vec::with_capacity(picked.len());
        let mut seqs = Vec::with_capacity(picked.len());
        for &key in picked {
            let q = self.groups.get_mut(&key).and_then(|g| g.queue.pop_front());
            let q = q.expect("a picked message is queued");
            batch.push(q.message);
            seqs.push(q.seq);
        }
        self.queued -= picked.len();
        (batch, picked.to_vec(), seqs)
    }

    /// The next batch: the group of each of its messages, in the batch's
    /// order (each group's from the front of its queue); or when to look again.
    fn pick(&self, now: Instant, open: bool) -> (Vec<GroupKey>, Option<Instant>) {
        let (picked, oldest) = if self.limiter.limit() > 1 {
            self.pick_runs()
        } else {
            self.pick_merged()
        };
        let wake = self.waiting.first().map(|&(at, _)| at);
        // A partial batch waits for more messages while others are in
        // flight, until its oldest has lingered; with none in flight it goes.
        if let Some(oldest) = oldest {
            let ready_at = oldest + self.linger;
            if open && picked.len() < self.max_batch && self.batches > 0 && ready_at > now {
                return (Vec::new(), Some(wake.map_or(ready_at, |w| w.min(ready_at))));
            }
        }
        (picked, wake)
    }

    /// With several batches in flight: the ready groups oldest first, from
    /// each the run at the front of its queue that goes to the batch's
    /// destination. Batches in flight already finish in any order, so
    /// across groups there is no commit order left to keep; taking runs lets
    /// a group move several messages a round trip, which a backlog of few
    /// groups needs at a distance (1,000 groups, one message each per 20 ms
    /// round trip, would cap the relay at 50,000 events/s).
    fn pick_runs(&self) -> (Vec<GroupKey>, Option<Instant>) {
        let mut picked = Vec::new();
        let mut skipped = 0;
        let mut destination: Option<&str> = None;
        let mut oldest: Option<Instant> = None;
        for &(_, key) in &self.ready {
            let queue = &self.groups[&key].queue;
            let Some(front) = queue.front() else { continue };
            let here = &*front.message.destination;
            if destination.is_some_and(|d| d != here) {
                skipped += 1;
                if skipped > MAX_SKIPPED_GROUPS {
                    break;
                }
                continue;
            }
            destination = Some(here);
            oldest = Some(oldest.map_or(front.arrived, |o| o.min(front.arrived)));
            let room = (self.max_batch - picked.len()).min(self.max_run);
            let run = queue
                .iter()
                .take(room)
                .take_while(|q| &*q.message.destination == here)
                .count();
            picked.extend(std::iter::repeat_n(key, run));
            if picked.len() == self.max_batch {
                break;
            }
        }
        (picked, oldest)
    }

    /// With one batch in flight: the merge of the ready groups' queues by
    /// arrival, so the sink publishes in commit order across groups too.
    fn pick_merged(&self) -> (Vec<GroupKey>, Option<Instant>) {
        use std::cmp::Reverse;
        let mut picked = Vec::new();
        let mut skipped = 0;
        let mut destination: Option<&str> = None;
        let mut oldest: Option<Instant> = None;
        // Groups already in the batch: their next message, as (seq, key, index).
        let mut next: std::collections::BinaryHeap<Reverse<(u64, GroupKey, usize)>> =
            std::collections::BinaryHeap::new();
        let mut heads = self.ready.iter().peekable();
        while picked.len() < self.max_batch {
            let from_head = match (heads.peek(), next.peek()) {
                (Some(&&(h, _)), Some(Reverse((n, _, _)))) => h < *n,
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (None, None) => break,
            };
            let (key, index) = if from_head {
                let &(_, key) = heads.next().expect("peeked");
                (key, 0)
            } else {
                let Reverse((_, key, index)) = next.pop().expect("peeked");
                (key, index)
            };
            let queue = &self.groups[&key].queue;
            let q = &queue[index];
            let here = &*q.message.destination;
            if destination.is_some_and(|d| d != here) {
                // This group's run for the batch ends here.
                skipped += 1;
                if skipped > MAX_SKIPPED_GROUPS {
                    break;
                }
                continue;
            }
            destination = Some(here);
            oldest = Some(oldest.map_or(q.arrived, |o| o.min(q.arrived)));
            picked.push(key);
            if let Some(after) = queue.get(index + 1).filter(|_| index + 1 < self.max_run) {
                next.push(Reverse((after.seq, key, index + 1)));
            }
        }
        (picked, oldest)
    }

    /// What a finished batch says about the sink's load, to the limiter.
    fn observe(&mut self, verdicts: &[Verdict], rtt: Duration) {
        let mut signal = Signal::Clean;
        for verdict in verdicts {
            match verdict {
                // A quota said no: the limiter paces the sink.
                Verdict::Retry(r) if matches!(r.cause, Cause::Throttled) => {
                    signal = Signal::Throttled;
                    break;
                }
                Verdict::Retry(r) if r.cause.is_load() => signal = Signal::BackPressure,
                // A rejection may have cost the sink extra calls to find it:
                // its time is no sample of the round trip.
                Verdict::Retry(_) | Verdict::Rejected(_) if signal == Signal::Clean => {
                    signal = Signal::Neutral;
                }
                Verdict::Retry(_) | Verdict::Rejected(_) | Verdict::Delivered => {}
            }
        }
        self.limiter
            .finished(std::time::Instant::now(), rtt, signal);
        let metrics = crate::metrics::get();
        metrics
            .sink_concurrency_limit
            .set(self.limiter.limit() as i64);
        if let Some(rtt) = self.limiter.rtt() {
            metrics.sink_rtt.set(rtt.as_secs_f64());
        }
    }

    /// Handle a finished batch (its messages, their verdicts and group keys,
    /// in order); false when the replication loop is gone.
    ///
    /// The steps keep the publisher's per-outcome bookkeeping in this order:
    /// outcomes reported (deliveries counted first), failed entries back at
    /// their groups' fronts, then each group blocked for its backoff or
    /// released, then the retries counted and logged.
    fn settle(
        &mut self,
        messages: Vec<Message>,
        verdicts: Vec<Verdict>,
        keys: Vec<GroupKey>,
        seqs: Vec<u64>,
    ) -> bool {
        let sorted = self.sort(messages, verdicts, keys, seqs);
        if !sorted.completions.is_empty() && self.done.send(sorted.completions).is_err() {
            return false;
        }
        let now = Instant::now();
        let retried = sorted.retry.len();
        self.requeue(sorted.retry, now);
        let worst = self.reschedule(sorted.groups, &sorted.failed, now);
        if retried > 0 {
            crate::metrics::get().published("retried", retried as u64);
        }
        if let Some(reason) = sorted.failed.values().next() {
            tracing::warn!(
                sink = self.sink.name(),
                attempt = worst,
                groups = sorted.failed.len(),
                messages = retried,
                error = %reason,
                "publish failed, retrying with backoff"
            );
        }
        true
    }

    /// A finished batch by outcome: every delivered or rejected entry as a
    /// completion (deliveries marked and counted), and every entry to send
    /// again; an entry behind a failed entry of its group is sent again
    /// whatever the sink said of it, so a group never overtakes itself.
    fn sort(
        &self,
        messages: Vec<Message>,
        verdicts: Vec<Verdict>,
        keys: Vec<GroupKey>,
        seqs: Vec<u64>,
    ) -> Sorted {
        let mut sorted = Sorted {
            retry: Vec::new(),
            failed: ByGroup::default(),
            // A set: batches hold up to 1024 messages.
            groups: GroupSet::with_capacity_and_hasher(messages.len(), Default::default()),
            completions: Vec::with_capacity(messages.len()),
        };
        let mut delivered = Deliveries::new();
        // Derive mode: a delivery is marked only outside what a snapshot may vouch for.
        let marks = self.marker.as_ref().map(Marker::deliveries);
        for (((message, verdict), group), seq) in
            messages.into_iter().zip(verdicts).zip(keys).zip(seqs)
        {
            sorted.groups.insert(group);
            if sorted.failed.contains_key(&group) {
                sorted.retry.push((message, group, seq)); // behind a failed entry of its group: send again, in order
                continue;
            }
            let completion = match verdict {
                Verdict::Delivered => {
                    delivered.count(message.commit_time);
                    if let (Some(marker), Some(marks)) = (&self.marker, &marks) {
                        if marks.marks(message.event.txid) {
                            marker.send(Mark::Published(message.event.id().to_owned()));
                        }
                    }
                    Completion::Delivered(message.ticket)
                }
                Verdict::Rejected(reason) => Completion::Rejected {
                    ticket: message.ticket,
                    id: message.event.id().to_string(),
                    reason,
                },
                Verdict::Retry(reason) => {
                    sorted.failed.insert(group, reason);
                    sorted.retry.push((message, group, seq));
                    continue;
                }
            };
            sorted.completions.push(completion);
        }
        delivered.finish();
        sorted
    }

    /// Entries to send again back at the front of their groups, in batch
    /// order, ahead of anything that arrived meanwhile; before the groups
    /// are unblocked, so none can be picked without them.
    fn requeue(&mut self, retry: Vec<(Message, GroupKey, u64)>, now: Instant) {
        for (message, key, seq) in retry.into_iter().rev() {
            self.queued += 1;
            self.groups
                .entry(key)
                .or_default()
                .queue
                .push_front(Queued {
                    seq,
                    arrived: now,
                    message,
                });
        }
    }

    /// Each of a batch's groups blocked for its next backoff when one of its
    /// entries failed, otherwise its failures forgotten and the group
    /// released; the most attempts any failed group has made.
    fn reschedule(&mut self, groups: GroupSet, failed: &ByGroup<Retry>, now: Instant) -> u32 {
        let mut worst = 0;
        for group in groups {
            match failed.get(&group) {
                Some(_) => {
                    let attempts = self.failures.entry(group).or_insert(0);
                    let delay = self.backoff.delay(*attempts);
                    *attempts = attempts.saturating_add(1);
                    worst = worst.max(*attempts);
                    let at = now + delay;
                    self.groups.entry(group).or_default().block = Some(Block::Backoff);
                    self.waiting.insert((at, group));
                }
                None => {
                    self.failures.remove(&group);
                    self.unblock(group);
                }
            }
        }
        worst
    }
}

/// A finished batch sorted by outcome ([`Publisher::sort`]).
struct Sorted {
    /// Entries to send again, in batch order.
    retry: Vec<(Message, GroupKey, u64)>,
    /// Groups with a failed entry, each with its first failure.
    failed: ByGroup<Retry>,
    /// The batch's groups, each once.
    groups: GroupSet,
    /// Delivered and rejected entries, in batch order.
    completions: Vec<Completion>,
}

/// A batch's deliveries as the metrics see them: one clock reading and one
/// counter update a batch, not a message; events of one transaction (one
/// commit time) side by side observed together.
struct Deliveries {
    metrics: &'static crate::metrics::Metrics,
    at: i64,
    total: u64,
    /// The current run of one commit time: the time and its count.
    run: (i64, u64),
}

impl Deliveries {
    fn new() -> Self {
        Self {
            metrics: crate::metrics::get(),
            at: crate::time::unix_micros_now(),
            total: 0,
            run: (0, 0),
        }
    }

    /// One more delivered message, committed at `commit_time`.
    fn count(&mut self, commit_time: i64) {
        self.total += 1;
        if self.run.0 != commit_time {
            self.metrics
                .delivered_after_commit_at(self.run.0, self.at, self.run.1);
            self.run = (commit_time, 0);
        }
        self.run.1 += 1;
    }

    /// The last run observed and the deliveries counted.
    fn finish(self) {
        self.metrics
            .delivered_after_commit_at(self.run.0, self.at, self.run.1);
        if self.total > 0 {
            self.metrics.published("delivered", self.total);
        }
    }
}

fn verdicts(batch: &[Message], outcomes: Vec<Outcome>) -> Vec<Verdict> {
    let mut verdicts: Vec<Verdict> = outcomes
        .into_iter()
        .map(|o| match o {
            Outcome::Delivered => Verdict::Delivered,
            Outcome::Rejected(r) => Verdict::Rejected(r),
            Outcome::Retryable(r) => Verdict::Retry(r),
        })
        .collect();
    // A sink that answered too few outcomes: the rest were not confirmed.
    while verdicts.len() < batch.len() {
        verdicts.push(Verdict::Retry(Retry {
            cause: Cause::Other,
            reason: "the sink gave no outcome".into(),
        }));
    }
    verdicts.truncate(batch.len());
    verdicts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::ack::AckTracker;
    use crate::pipeline::concurrency::Concurrency;
    use std::sync::Mutex;

    /// A sink that fails the first attempt of chosen messages and records the
    /// order in which it accepted messages.
    struct Flaky {
        accepted: Mutex<Vec<(String, String)>>,
        fail_once: Mutex<HashSet<String>>,
        concurrency: Concurrency,
    }

    impl Sink for Flaky {
        fn name(&self) -> &'static str {
            "flaky"
        }
        fn max_batch(&self) -> usize {
            4
        }
        fn concurrency(&self) -> Concurrency {
            self.concurrency
        }
        async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
            tokio::time::sleep(Duration::from_millis(fastrand::u64(0..3))).await;
            batch
                .iter()
                .map(|m| {
                    let id = m.event.id().to_string();
                    if self.fail_once.lock().unwrap().remove(&id) {
                        // Load and non-load causes: the limiter moves too.
                        // (A 5xx: throttling this often, whatever the rate,
                        // would pace the sink down to a call a second.)
                        let cause = if id.len() % 2 == 0 {
                            Cause::Unavailable
                        } else {
                            Cause::Other
                        };
                        Outcome::retry(cause, "injected")
                    } else {
                        self.accepted
                            .lock()
                            .unwrap()
                            .push((m.event.group().to_string(), id));
                        Outcome::Delivered
                    }
                })
                .collect()
        }
    }

    fn message(tracker: &mut AckTracker, group: &str, n: usize) -> Message {
        Message {
            ticket: tracker.event().unwrap(),
            ..Message::for_test(&format!("{group}-{n}"), group, "", "")
        }
    }

    /// Many groups, concurrent batches, random first-attempt failures: every
    /// message is reported exactly once, and each group's *last* acceptance of
    /// each message is in order (a retried entry may repeat a later one
    /// already accepted, never the other way round).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn groups_stay_in_order_across_partial_failures() {
        for round in 0..6 {
            let mut tracker = AckTracker::new(0);
            tracker.begin().unwrap();
            let sink = Arc::new(Flaky {
                accepted: Mutex::new(Vec::new()),
                fail_once: Mutex::new(HashSet::new()),
                concurrency: match round {
                    0..=2 => Concurrency::Fixed(1 + round),
                    _ => Concurrency::Adaptive {
                        ceiling: [2, 8, 64][round - 3],
                    },
                },
            });
            let (tx, rx) = mpsc::channel(10_000);
            let (done_tx, mut done_rx) = mpsc::unbounded_channel();
            let backoff = Backoff::new(&crate::config::RetryConfig {
                initial: Duration::from_millis(1),
                max: Duration::from_millis(5),
                ..Default::default()
            });
            let task = tokio::spawn(run(Arc::clone(&sink), None, None, rx, done_tx, backoff));
            let mut expected: HashMap<String, Vec<String>> = HashMap::new();
            for n in 0..400 {
                let group = format!("g{}", fastrand::usize(0..7));
                let m = message(&mut tracker, &group, n);
                if fastrand::u8(0..10) == 0 {
                    sink.fail_once
                        .lock()
                        .unwrap()
                        .insert(m.event.id().to_string());
                }
                expected
                    .entry(group)
                    .or_default()
                    .push(m.event.id().to_string());
                tx.send(vec![Dispatch::Publish(m)]).await.unwrap();
            }
            drop(tx);
            task.await.unwrap().unwrap();
            let mut reported = 0;
            while let Ok(batch) = done_rx.try_recv() {
                for c in batch {
                    assert!(matches!(c, Completion::Delivered(_)));
                    tracker.finish(match c {
                        Completion::Delivered(t) => t,
                        Completion::Rejected { ticket, .. } => ticket,
                    });
                    reported += 1;
                }
            }
            assert_eq!(reported, 400, "each message reported once");
            assert_eq!(tracker.unfinished(), 0);
            let accepted = sink.accepted.lock().unwrap();
            for (group, ids) in &expected {
                // The last acceptance of each id, in acceptance order, must be `ids`.
                let mut last: Vec<&String> = Vec::new();
                for (g, id) in accepted.iter().rev() {
                    if g == group && !last.contains(&id) {
                        last.push(id);
                    }
                }
                last.reverse();
                let ids: Vec<&String> = ids.iter().collect();
                assert_eq!(last, ids, "group {group} out of order");
            }
        }
    }

    /// Records the size of each batch and the most messages of one group
    /// in a batch; answers after `delay`.
    struct Sizes {
        sizes: Mutex<Vec<usize>>,
        delay: Duration,
        linger: Duration,
        max_run: usize,
        longest_run: Mutex<usize>,
    }

    impl Sizes {
        fn new(delay: Duration, linger: Duration) -> Self {
            Self {
                sizes: Mutex::new(Vec::new()),
                delay,
                linger,
                max_run: usize::MAX,
                longest_run: Mutex::new(0),
            }
        }
    }

    impl Sink for Sizes {
        fn name(&self) -> &'static str {
            "sizes"
        }
        fn max_batch(&self) -> usize {
            4
        }
        fn concurrency(&self) -> Concurrency {
            Concurrency::Fixed(2)
        }
        fn linger(&self) -> Duration {
            self.linger
        }
        fn max_run(&self) -> usize {
            self.max_run
        }
        async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
            self.sizes.lock().unwrap().push(batch.len());
            let mut runs = HashMap::new();
            for m in batch {
                *runs.entry(m.event.group().to_owned()).or_insert(0) += 1;
            }
            let longest = runs.values().copied().max().unwrap_or(0);
            {
                let mut longest_run = self.longest_run.lock().unwrap();
                *longest_run = (*longest_run).max(longest);
            }
            tokio::time::sleep(self.delay).await;
            vec![Outcome::Delivered; batch.len()]
        }
    }

    /// The publisher's input, its completions, and its task.
    type Running = (
        mpsc::Sender<Vec<Dispatch>>,
        mpsc::UnboundedReceiver<Vec<Completion>>,
        tokio::task::JoinHandle<Result<(), RecordError>>,
    );

    fn start(sink: &Arc<Sizes>) -> Running {
        let (tx, rx) = mpsc::channel(100);
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        let backoff = Backoff::new(&crate::config::RetryConfig::default());
        let task = tokio::spawn(run(Arc::clone(sink), None, None, rx, done_tx, backoff));
        (tx, done_rx, task)
    }

    /// Publish `n` messages through a publisher on `sink`, message `k` in
    /// group `group(k)`, until the publisher ends: how many it reported.
    async fn publish_all(
        sink: &Arc<Sizes>,
        n: usize,
        group: impl Fn(usize) -> &'static str,
    ) -> usize {
        let (tx, mut done, task) = start(sink);
        let mut tracker = AckTracker::new(0);
        tracker.begin().unwrap();
        let backlog = (0..n)
            .map(|k| Dispatch::Publish(message(&mut tracker, group(k), k)))
            .collect();
        tx.send(backlog).await.unwrap();
        drop(tx);
        task.await.unwrap().unwrap();
        let mut reported = 0;
        while let Ok(batch) = done.try_recv() {
            reported += batch.len();
        }
        reported
    }

    #[tokio::test]
    async fn a_backlog_of_few_groups_fills_every_batch() {
        let sink = Arc::new(Sizes::new(
            Duration::from_millis(5),
            Duration::from_millis(1),
        ));
        // Two groups, twenty messages each: one batch at a time per group.
        assert_eq!(publish_all(&sink, 40, |k| ["a", "b"][k % 2]).await, 40);
        assert_eq!(*sink.sizes.lock().unwrap(), vec![4; 10]);
    }

    #[tokio::test]
    async fn a_sink_that_takes_one_message_a_group_gets_batches_of_distinct_groups() {
        let sink = Arc::new(Sizes {
            max_run: 1,
            ..Sizes::new(Duration::from_millis(2), Duration::from_millis(1))
        });
        // Three groups, eight messages each, arriving group by group.
        assert_eq!(publish_all(&sink, 24, |k| ["a", "b", "c"][k / 8]).await, 24);
        assert_eq!(*sink.longest_run.lock().unwrap(), 1);
        let sizes = sink.sizes.lock().unwrap();
        assert!(sizes.iter().all(|&n| n <= 3), "{sizes:?}");
        assert!(
            sizes.iter().any(|&n| n > 1),
            "groups still share batches: {sizes:?}"
        );
    }

    #[tokio::test]
    async fn an_idle_publisher_sends_a_lone_message_without_lingering() {
        let sink = Arc::new(Sizes::new(Duration::ZERO, Duration::from_secs(30)));
        let (tx, mut done, task) = start(&sink);
        let mut tracker = AckTracker::new(0);
        tracker.begin().unwrap();
        tx.send(vec![Dispatch::Publish(message(&mut tracker, "a", 0))])
            .await
            .unwrap();
        let first = tokio::time::timeout(Duration::from_secs(5), done.recv())
            .await
            .expect("not held back by the linger")
            .unwrap();
        assert_eq!(first.len(), 1);
        drop(tx);
        task.await.unwrap().unwrap();
    }
}
