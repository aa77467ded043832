//! The publisher: forms batches for a sink, keeps each ordering group in
//! order, retries what failed, records what was rejected, and reports every
//! message's final outcome back to the replication loop.
//!
//! ```text
//!  replication loop ──[Dispatch] (one Vec per burst)──► queue (commit order) ──batch (one destination, ≤ max_batch)──► sink.publish
//!         ▲                                  ▲ failed entries go back to the front, their group waits (backoff)
//!         └──── Completion (Delivered | Rejected, after recording) ◄──────────────────────────────┘
//! ```
//!
//! # Ordering (per group; the group is the aggregate id unless configured)
//!
//! * A group is *blocked* while one of its messages is in a batch in flight,
//!   or while it waits out a retry backoff. A batch never takes a message of a
//!   blocked group, and once it passes over a message of some group it takes
//!   no later message of that group: so a later event of a group is never
//!   published before an earlier one is confirmed, except behind it in the
//!   same batch.
//! * After a partial batch failure, the failed entry and every later entry of
//!   its group in that batch (even ones the sink accepted) go back to the
//!   front of the queue, in order, and are sent again after the group's
//!   backoff. Other groups keep flowing.
//! * Transient failures are retried forever with capped, jittered exponential
//!   backoff; nothing is reported for them, so the slot does not move past them.
//! * Rejected messages are recorded in the database ([`Recorder`]) before they
//!   are reported, so the slot never passes an event that is neither delivered
//!   nor recorded.

use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::ack::Ticket;
use crate::marking::{Mark, Marker};
use crate::record::{RecordError, Recorder};
use crate::retry::Backoff;
use crate::sink::{Message, Outcome, Sink};

/// What the replication loop hands the publisher.
#[derive(Debug)]
pub enum Dispatch {
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
pub enum Completion {
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
    Retry(String),
}

/// What a publish task hands back.
enum Done {
    /// A batch: its messages, each one's verdict (rejections already
    /// recorded) and group key, in the same order.
    Batch {
        messages: Vec<Message>,
        verdicts: Vec<Verdict>,
        keys: Vec<GroupKey>,
    },
    /// A row that could not be published, recorded.
    Rejected {
        ticket: Ticket,
        id: String,
        reason: String,
    },
}

struct Queued {
    arrived: Instant,
    key: GroupKey,
    message: Message,
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
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
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
    InFlight,
    RetryAt(Instant),
}

/// The publisher's state.
struct Publisher<S> {
    sink: Arc<S>,
    recorder: Option<Arc<Recorder>>,
    marker: Option<Marker>,
    backoff: Backoff,
    done: mpsc::UnboundedSender<Vec<Completion>>,
    queue: VecDeque<Queued>,
    blocked: ByGroup<Block>,
    /// Consecutive failed attempts per group.
    failures: ByGroup<u32>,
    tasks: JoinSet<Result<Done, RecordError>>,
    max_batch: usize,
    max_in_flight: usize,
    linger: Duration,
}

/// Drive `sink` until `input` closes and everything is settled; report every
/// message's final outcome on `done` (a finished batch's outcomes together:
/// one wake-up of the replication loop per batch, not per message). Rejections are recorded with
/// `recorder`; deliveries are marked with `marker`.
pub async fn run<S: Sink>(
    sink: Arc<S>,
    recorder: Option<Arc<Recorder>>,
    marker: Option<Marker>,
    mut input: mpsc::Receiver<Vec<Dispatch>>,
    done: mpsc::UnboundedSender<Vec<Completion>>,
    backoff: Backoff,
) -> Result<(), RecordError> {
    let mut p = Publisher {
        max_batch: sink.max_batch().max(1),
        max_in_flight: sink.max_in_flight_batches().max(1),
        linger: sink.linger(),
        sink,
        recorder,
        marker,
        backoff,
        done,
        queue: VecDeque::new(),
        blocked: ByGroup::default(),
        failures: ByGroup::default(),
        tasks: JoinSet::new(),
    };
    let mut open = true;
    loop {
        let wake = p.dispatch(open);
        if !open && p.queue.is_empty() && p.tasks.is_empty() {
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
                Ok(Ok(Done::Batch { messages, verdicts, keys })) => {
                    if !p.settle(messages, verdicts, keys) {
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
                    tracing::error!(error = %crate::postgres::Chain(&e), "a publish task failed");
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
            Dispatch::Publish(message) => self.queue.push_back(Queued {
                arrived: now,
                key: GroupKey::of(message.event.group()),
                message,
            }),
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
            if self.tasks.len() >= self.max_in_flight {
                return None;
            }
            let now = Instant::now();
            self.blocked
                .retain(|_, b| !matches!(b, Block::RetryAt(at) if *at <= now));
            let (picked, wake) = self.pick(now, open);
            if picked.is_empty() {
                return wake;
            }
            let (batch, keys) = self.take(&picked);
            for &key in &keys {
                self.blocked.insert(key, Block::InFlight);
            }
            let sink = Arc::clone(&self.sink);
            let recorder = self.recorder.clone();
            self.tasks.spawn(async move {
                let started = std::time::Instant::now();
                let outcomes = sink.publish(&batch).await;
                crate::metrics::get()
                    .publish_duration
                    .observe(started.elapsed().as_secs_f64());
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
                })
            });
        }
    }

    /// Take the messages at `picked` (ascending positions) out of the queue,
    /// keeping the others in order. Costs O(last position), not O(queue ×
    /// batch): the prefix up to the last pick is drained once and what was
    /// passed over goes back to the front.
    /// The batch's messages come with their group keys.
    fn take(&mut self, picked: &[usize]) -> (Vec<Message>, Vec<GroupKey>) {
        let Some(&last) = picked.last() else {
            return (Vec::new(), Vec::new());
        };
        let mut batch = Vec::with_capacity(picked.len());
        let mut keys = Vec::with_capacity(picked.len());
        let mut passed = Vec::with_capacity(last + 1 - picked.len());
        let mut wanted = picked.iter().peekable();
        for (i, q) in self.queue.drain(..=last).enumerate() {
            if wanted.next_if_eq(&&i).is_some() {
                batch.push(q.message);
                keys.push(q.key);
            } else {
                passed.push(q);
            }
        }
        for q in passed.into_iter().rev() {
            self.queue.push_front(q);
        }
        (batch, keys)
    }

    /// Queue positions of the next batch, in order; or when to look again.
    fn pick(&self, now: Instant, open: bool) -> (Vec<usize>, Option<Instant>) {
        let mut picked = Vec::new();
        let mut passed = GroupSet::default();
        let mut destination: Option<&str> = None;
        let mut wake: Option<Instant> = None;
        for (i, q) in self.queue.iter().enumerate() {
            let group = q.key;
            if passed.contains(&group) {
                continue;
            }
            match self.blocked.get(&group) {
                Some(Block::InFlight) => {
                    passed.insert(group);
                    continue;
                }
                Some(Block::RetryAt(at)) => {
                    wake = Some(wake.map_or(*at, |w| w.min(*at)));
                    passed.insert(group);
                    continue;
                }
                None => {}
            }
            if destination.is_some_and(|d| d != &*q.message.destination) {
                passed.insert(group);
                continue;
            }
            destination = Some(&q.message.destination);
            picked.push(i);
            if picked.len() == self.max_batch {
                return (picked, wake);
            }
        }
        // A partial batch waits for more messages until its oldest has lingered.
        if let Some(&first) = picked.first() {
            let ready_at = self.queue[first].arrived + self.linger;
            if open && ready_at > now {
                return (Vec::new(), Some(wake.map_or(ready_at, |w| w.min(ready_at))));
            }
        }
        (picked, wake)
    }

    /// Handle a finished batch (its messages, their verdicts and group keys,
    /// in order); false when the replication loop is gone.
    fn settle(
        &mut self,
        messages: Vec<Message>,
        verdicts: Vec<Verdict>,
        keys: Vec<GroupKey>,
    ) -> bool {
        let mut retry: Vec<(Message, GroupKey)> = Vec::new();
        let mut failed: ByGroup<String> = ByGroup::default();
        // The batch's groups, each once (a set: batches hold up to 1024 messages).
        let mut groups = GroupSet::with_capacity_and_hasher(messages.len(), Default::default());
        let mut completions = Vec::with_capacity(messages.len());
        let metrics = crate::metrics::get();
        // One clock reading and one counter update a batch, not a message.
        let delivered_at = crate::metrics::unix_micros_now();
        let mut delivered = 0;
        // Events of one transaction (one commit time) side by side are
        // observed together.
        let mut run: (i64, u64) = (0, 0);
        for ((message, verdict), group) in messages.into_iter().zip(verdicts).zip(keys) {
            groups.insert(group);
            if failed.contains_key(&group) {
                retry.push((message, group)); // behind a failed entry of its group: send again, in order
                continue;
            }
            let completion = match verdict {
                Verdict::Delivered => {
                    delivered += 1;
                    if run.0 != message.commit_time {
                        metrics.delivered_after_commit_at(run.0, delivered_at, run.1);
                        run = (message.commit_time, 0);
                    }
                    run.1 += 1;
                    if let Some(marker) = &self.marker {
                        marker.send(Mark::Published(message.event.id().to_owned()));
                    }
                    Completion::Delivered(message.ticket)
                }
                Verdict::Rejected(reason) => Completion::Rejected {
                    ticket: message.ticket,
                    id: message.event.id().to_string(),
                    reason,
                },
                Verdict::Retry(reason) => {
                    failed.insert(group, reason);
                    retry.push((message, group));
                    continue;
                }
            };
            completions.push(completion);
        }
        metrics.delivered_after_commit_at(run.0, delivered_at, run.1);
        if delivered > 0 {
            metrics.published("delivered", delivered);
        }
        if !completions.is_empty() && self.done.send(completions).is_err() {
            return false;
        }
        let now = Instant::now();
        let mut worst = 0;
        for group in groups {
            match failed.get(&group) {
                Some(_) => {
                    let attempts = self.failures.entry(group).or_insert(0);
                    let delay = self.backoff.delay(*attempts);
                    *attempts = attempts.saturating_add(1);
                    worst = worst.max(*attempts);
                    self.blocked.insert(group, Block::RetryAt(now + delay));
                }
                None => {
                    self.failures.remove(&group);
                    self.blocked.remove(&group);
                }
            }
        }
        if !retry.is_empty() {
            metrics.published("retried", retry.len() as u64);
        }
        if let Some(reason) = failed.values().next() {
            tracing::warn!(
                sink = self.sink.name(),
                attempt = worst,
                groups = failed.len(),
                messages = retry.len(),
                error = %reason,
                "publish failed, retrying with backoff"
            );
        }
        for (message, key) in retry.into_iter().rev() {
            self.queue.push_front(Queued {
                arrived: now,
                key,
                message,
            });
        }
        true
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
        verdicts.push(Verdict::Retry("the sink gave no outcome".into()));
    }
    verdicts.truncate(batch.len());
    verdicts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ack::AckTracker;
    use crate::event::{Fields, OutboxEvent, Payload};
    use std::sync::Mutex;

    /// A sink that fails the first attempt of chosen messages and records the
    /// order in which it accepted messages.
    struct Flaky {
        accepted: Mutex<Vec<(String, String)>>,
        fail_once: Mutex<HashSet<String>>,
        in_flight: usize,
    }

    impl Sink for Flaky {
        fn name(&self) -> &'static str {
            "flaky"
        }
        fn max_batch(&self) -> usize {
            4
        }
        fn max_in_flight_batches(&self) -> usize {
            self.in_flight
        }
        async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
            tokio::time::sleep(Duration::from_millis(fastrand::u64(0..3))).await;
            batch
                .iter()
                .map(|m| {
                    let id = m.event.id().to_string();
                    if self.fail_once.lock().unwrap().remove(&id) {
                        Outcome::Retryable("injected".into())
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
            event: Box::new(OutboxEvent::new(
                Fields {
                    id: &format!("{group}-{n}"),
                    aggregate_type: "t",
                    aggregate_id: group,
                    event_type: "E",
                    group,
                    time: "t",
                    headers: None,
                    topic: None,
                },
                Payload::Json("{}".into()),
            )),
            body: bytes::Bytes::new(),
            destination: crate::route::nowhere(),
            commit_time: 0,
        }
    }

    /// Many groups, concurrent batches, random first-attempt failures: every
    /// message is reported exactly once, and each group's *last* acceptance of
    /// each message is in order (a retried entry may repeat a later one
    /// already accepted, never the other way round).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn groups_stay_in_order_across_partial_failures() {
        for round in 0..5 {
            let mut tracker = AckTracker::new(0);
            tracker.begin().unwrap();
            let sink = Arc::new(Flaky {
                accepted: Mutex::new(Vec::new()),
                fail_once: Mutex::new(HashSet::new()),
                in_flight: 1 + round,
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
}
