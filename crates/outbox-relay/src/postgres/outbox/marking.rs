//! After a confirmed publish: mark rows PUBLISHED (or delete them), batched.
//!
//! `[lifecycle] on_published`:
//! * `mark`: `publish_state = 'PUBLISHED', published_at = now()`; filtered-out
//!   events become `SKIPPED`;
//! * `delete`: the rows are deleted (filtered-out ones too);
//! * `none`: the table is left alone (application-managed, Debezium style);
//! * `derive`: as `mark`, but a row the stream published is marked only when
//!   no snapshot may vouch for it ([`Holes::needs_mark`]: no `relay_txid`, or
//!   an id in a hole); every other delivery writes nothing, its state is
//!   derived ([`crate::postgres::outbox::derived`]). Filtered-out rows are
//!   still marked `SKIPPED`, and the back-pressure below applies to the marks
//!   that remain.
//!
//! ```text
//!  publisher / stream ──Mark──► queue ──up to BATCH ids──► UPDATE … WHERE id = ANY($1)  (connection 1)
//!         ▲                        │  ──up to BATCH ids──► UPDATE … WHERE id = ANY($1)  (connection 2)
//!         └── the loop reads only while `unmarked` < lifecycle.max_unmarked ◄── written
//! ```
//!
//! Marks are collected from the publisher and the stream and written in
//! batches, one statement per batch, up to [`CONNECTIONS`] statements at
//! once. The publication carries inserts only, so these updates and deletes
//! never come back through the stream.
//!
//! # Keeping up
//!
//! A statement costs a round trip and a plan; a row costs its update. A batch
//! is written as soon as a connection is free and it is full, or its oldest
//! mark has waited [`GATHER`]: under load the batches fill while the
//! statements run, so the fixed cost is spread over thousands of rows, and
//! two connections keep the server busy while the relay builds the next one
//! (measurements in docs/benchmarks.md).
//!
//! # Back-pressure
//!
//! Rows published but not yet written count as *unmarked*; at
//! `lifecycle.max_unmarked` the replication loop stops reading the stream
//! ([`Marker::full`]) and waits for [`Marker::room`]. Events already in
//! flight still finish, so the queue holds at most `max_unmarked` plus
//! `stream.max_in_flight` marks. The publisher is never blocked: it only
//! queues, so a slow marking step never delays a confirmed publish nor the
//! acknowledgement.
//!
//! # Acknowledgements
//!
//! Marking is not part of the acknowledgement: a row the relay published but
//! could not mark (a crash in between) stays PENDING and the poller publishes
//! it again after its grace period, a bounded, identifiable repeat (at most
//! the unmarked ceiling plus what was in flight). Holding the slot until rows
//! are marked would repeat the same events after a crash (through the stream
//! instead of the poller) and would let a slow or failing table write hold
//! WAL on the server.
//!
//! A statement that fails is retried with backoff. When the connection itself
//! is gone (PostgreSQL restarted, failed over), the task opens its own and
//! keeps trying for [`RECONNECT_FOR`], so that a restart does not drop the
//! marks of events already delivered.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, Notify};
use tokio::task::JoinSet;
use tokio::time::Instant;

use tokio::sync::watch;

use crate::config::OnPublished;
use crate::postgres::outbox::derived::Holes;
use crate::postgres::outbox::table::Table;
use crate::postgres::ConnInfo;
use crate::retry::Backoff;

/// Most ids in one statement: the statement's fixed cost (a round trip, a
/// plan) shrinks to a fraction of a microsecond a row, and one statement
/// still takes tens of milliseconds, not seconds.
const BATCH: usize = 5000;
/// Statements in flight at once, each on a connection of its own (the first
/// is the session's): while one runs, the next batch is built and sent.
const CONNECTIONS: usize = 2;
/// How long a partial batch gathers marks while a connection is free.
const GATHER: Duration = Duration::from_millis(20);
/// How long a statement is retried on a lost connection before its marks are
/// given up: longer than the default `postgres.receive_timeout`, so a
/// connection taken for dead is opened again and the statement retried.
const RECONNECT_FOR: Duration = Duration::from_secs(150);

/// What to record about a row.
#[derive(Debug, Clone)]
pub(crate) enum Mark {
    /// It was published.
    Published(String),
    /// It was filtered out.
    Skipped(String),
}

/// Marks queued or being written, shared by the [`Marker`]s and the task.
#[derive(Debug)]
struct Backlog {
    unmarked: AtomicUsize,
    /// `lifecycle.max_unmarked`.
    limit: usize,
    /// Marks were written (or the task ended).
    room: Notify,
    /// The task has ended: nothing is waited for any more.
    ended: AtomicBool,
}

impl Backlog {
    fn written(&self, marks: usize) {
        self.unmarked.fetch_sub(marks, Ordering::Relaxed);
        self.room.notify_one();
    }
}

/// Ends the backlog when the task ends, however it ends, so that the loop
/// never waits for a task that is gone.
struct Ending(Arc<Backlog>);

impl Drop for Ending {
    fn drop(&mut self) {
        self.0.ended.store(true, Ordering::Relaxed);
        self.0.room.notify_one();
    }
}

/// The holes of the derived lifecycle as the position keeper publishes
/// them: `None` until they are known (then every delivery is marked).
pub(crate) type HolesWatch = watch::Receiver<Option<Arc<Holes>>>;

/// Sends marks to the marking task; cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct Marker {
    tx: mpsc::UnboundedSender<Mark>,
    backlog: Arc<Backlog>,
    /// `on_published = "derive"`: deliveries are marked only when these
    /// holes say so; `None`: every delivery is marked.
    holes: Option<HolesWatch>,
}

/// Which deliveries of a batch are marked ([`Marker::deliveries`]).
pub(crate) struct Deliveries(Option<Option<Arc<Holes>>>);

impl Deliveries {
    /// Whether a delivered row with transaction id `txid` is marked.
    pub(crate) fn marks(&self, txid: Option<u64>) -> bool {
        match &self.0 {
            None | Some(None) => true,
            Some(Some(holes)) => holes.needs_mark(txid),
        }
    }
}

impl Marker {
    /// Which deliveries to mark, for one batch: the holes are read once a
    /// batch (they change at a session's start and when one closes).
    pub(crate) fn deliveries(&self) -> Deliveries {
        Deliveries(self.holes.as_ref().map(|h| h.borrow().clone()))
    }

    /// Record `mark` (a no-op once the task is gone). Never waits: the
    /// queue is bounded by the replication loop, which stops reading while
    /// [`Marker::full`].
    pub(crate) fn send(&self, mark: Mark) {
        // Counted before it is sent, so the task never counts it down first.
        self.backlog.unmarked.fetch_add(1, Ordering::Relaxed);
        if self.tx.send(mark).is_err() {
            self.backlog.unmarked.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Rows published or filtered out and not yet marked (queued or being written).
    pub(crate) fn unmarked(&self) -> usize {
        self.backlog.unmarked.load(Ordering::Relaxed)
    }

    /// Whether the unmarked rows are at `lifecycle.max_unmarked` (and the
    /// task still runs): then the stream waits for [`Marker::room`].
    pub(crate) fn full(&self) -> bool {
        self.unmarked() >= self.backlog.limit && !self.backlog.ended.load(Ordering::Relaxed)
    }

    /// Resolves once marks have been written since the last call (at once
    /// when that happened meanwhile). Cancel-safe.
    pub(crate) async fn room(&self) {
        self.backlog.room.notified().await
    }
}

/// The statements of one mode and how to run them.
struct Writer {
    published: String,
    skipped: String,
    conn: ConnInfo,
    backoff: Backoff,
}

impl Writer {
    /// Write `marks` on `client` (or on a connection of its own, opened
    /// now); the connection to use next time, if one is open.
    async fn write(
        &self,
        client: Option<Arc<tokio_postgres::Client>>,
        marks: Vec<Mark>,
    ) -> Option<Arc<tokio_postgres::Client>> {
        let mut done: Vec<&str> = Vec::with_capacity(marks.len());
        let mut filtered: Vec<&str> = Vec::new();
        for m in &marks {
            match m {
                Mark::Published(id) => done.push(id.as_str()),
                Mark::Skipped(id) => filtered.push(id.as_str()),
            }
        }
        let mut client = client;
        for (sql, ids) in [(&self.published, &done), (&self.skipped, &filtered)] {
            if ids.is_empty() {
                continue;
            }
            let mut attempt = 0;
            let started = Instant::now();
            loop {
                let result: Result<(), Box<dyn std::error::Error + Send + Sync>> = match &client {
                    Some(c) => mark(c, sql, ids).await.map_err(Into::into),
                    None => match self.conn.connect().await {
                        Ok(fresh) => {
                            client = Some(Arc::new(fresh));
                            continue;
                        }
                        Err(e) => Err(e.into()),
                    },
                };
                let Err(e) = result else { break };
                let e: &(dyn std::error::Error + 'static) = &*e;
                let lost = client.as_ref().is_none_or(|c| c.is_closed());
                if (!lost && attempt >= 5) || started.elapsed() > RECONNECT_FOR {
                    tracing::error!(rows = ids.len(), error = %crate::report::Chain(e), "cannot mark rows; they stay as they were (the poller may publish them again)");
                    break;
                }
                let delay = self.backoff.delay(attempt);
                attempt += 1;
                tracing::warn!(rows = ids.len(), attempt, error = %crate::report::Chain(e), "marking rows failed, retrying");
                tokio::time::sleep(delay).await;
                if lost {
                    client = None; // the next round opens a fresh one
                }
            }
        }
        client.filter(|c| !c.is_closed())
    }
}

/// Start the marking task for `mode`; `None` when the table is left alone.
/// `client` is the session's connection; the task opens more as it needs
/// them. Unmarked rows are held to `max_unmarked` by the caller
/// ([`Marker::full`]). The task ends (after writing what it has) when every
/// [`Marker`] is dropped. `holes` (derive mode) says which deliveries are
/// marked.
pub(crate) fn spawn(
    client: Arc<tokio_postgres::Client>,
    conn: ConnInfo,
    table: &Table,
    mode: OnPublished,
    backoff: Backoff,
    max_unmarked: usize,
    holes: Option<HolesWatch>,
) -> Option<(Marker, tokio::task::JoinHandle<()>)> {
    let (Some(published), Some(skipped)) = (table.published_sql(mode), table.skipped_sql(mode))
    else {
        return None;
    };
    let backlog = Arc::new(Backlog {
        unmarked: AtomicUsize::new(0),
        limit: max_unmarked.max(1),
        room: Notify::new(),
        ended: AtomicBool::new(false),
    });
    let (tx, rx) = mpsc::unbounded_channel::<Mark>();
    let writer = Arc::new(Writer {
        published,
        skipped,
        conn,
        backoff,
    });
    let task = tokio::spawn(run(rx, writer, client, Arc::clone(&backlog)));
    Some((Marker { tx, backlog, holes }, task))
}

async fn run(
    mut rx: mpsc::UnboundedReceiver<Mark>,
    writer: Arc<Writer>,
    client: Arc<tokio_postgres::Client>,
    backlog: Arc<Backlog>,
) {
    let _ending = Ending(Arc::clone(&backlog));
    // Connections not in use; a statement without one opens its own.
    let mut idle = vec![client];
    let mut running = JoinSet::new();
    // Marks in each running statement, by task.
    let mut sizes = HashMap::new();
    let mut pending: Vec<Mark> = Vec::new();
    // When the oldest pending mark arrived.
    let mut since: Option<Instant> = None;
    let mut open = true;
    loop {
        while running.len() < CONNECTIONS && !pending.is_empty() {
            let due =
                !open || pending.len() >= BATCH || since.is_some_and(|t| t.elapsed() >= GATHER);
            if !due {
                break;
            }
            let batch: Vec<Mark> = if pending.len() <= BATCH {
                std::mem::take(&mut pending)
            } else {
                pending.drain(..BATCH).collect()
            };
            if pending.is_empty() {
                since = None; // what is left, if anything, is as old as what went
            }
            let size = batch.len();
            let client = idle.pop();
            let writer = Arc::clone(&writer);
            let handle = running.spawn(async move { writer.write(client, batch).await });
            sizes.insert(handle.id(), size);
        }
        if !open && pending.is_empty() && running.is_empty() {
            return;
        }
        let gathered = since.map(|t| t + GATHER);
        tokio::select! {
            received = rx.recv_many(&mut pending, BATCH), if open => {
                if received == 0 {
                    open = false;
                } else {
                    since.get_or_insert_with(Instant::now);
                }
            }
            Some(finished) = running.join_next_with_id() => {
                let id = match finished {
                    Ok((id, client)) => {
                        idle.extend(client);
                        id
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "a marking statement failed; its rows stay as they were");
                        e.id()
                    }
                };
                backlog.written(sizes.remove(&id).unwrap_or(0));
            }
            () = sleep_until(gathered), if gathered.is_some() && running.len() < CONNECTIONS => {}
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Whether the table refused a row's update: an error the row's own write
/// raised (a trigger's exception, a constraint it breaks, a row-level
/// security policy's `WITH CHECK`, a value the table will not take), which
/// writing it again will not mend. Anything else (a lost connection, a lock
/// or statement timeout, a deadlock or serialization failure, a read-only
/// server, a shutdown, a lack of resources, a table or column gone) fails
/// the whole write, which is tried again (the poller's round, the marker's
/// batch). Refused, a batch is written again row by row, so that one row the
/// table will not let the relay update does not keep the others unwritten.
pub(crate) fn refused(error: &tokio_postgres::Error) -> bool {
    error.as_db_error().is_some_and(|db| {
        let code = db.code().code();
        let class = &code[..2];
        // The session's or the server's, wherever raised.
        let transient = matches!(class, "08" | "40" | "53" | "57" | "58" | "XX")
            || matches!(code, "55P03" | "55006" | "25006");
        // 09 triggered action, 22 data exception, 23 integrity constraint,
        // 27 triggered data change, 38 external routine, 39 its invocation,
        // 44 WITH CHECK OPTION, P0 PL/pgSQL (RAISE), 2F SQL routine; 42501 a
        // row-level security policy refusing the row. And anything else a
        // trigger or function raised (it has a context: `RAISE … USING
        // ERRCODE` may name any code).
        let row = matches!(
            class,
            "09" | "22" | "23" | "27" | "38" | "39" | "44" | "P0" | "2F"
        ) || code == "42501"
            || db.where_().is_some_and(|w| !w.is_empty());
        row && !transient
    })
}

/// Write `sql` (ids in `$1`) over `ids`; when the table refuses it
/// ([`refused`]), one row at a time, logging each row it refuses: one row
/// must not leave the others unmarked. An error of another kind fails the
/// write, to be tried again whole.
async fn mark(
    client: &tokio_postgres::Client,
    sql: &str,
    ids: &[&str],
) -> Result<(), tokio_postgres::Error> {
    match client.execute(sql, &[&ids]).await {
        Ok(_) => Ok(()),
        Err(e) if refused(&e) => each(client, sql, ids).await,
        Err(e) => Err(e),
    }
}

/// Write `sql` (ids in `$1`) one row at a time, logging each row the table
/// refuses ([`refused`]); the first error of another kind ends it.
async fn each(
    client: &tokio_postgres::Client,
    sql: &str,
    ids: &[&str],
) -> Result<(), tokio_postgres::Error> {
    for id in ids {
        match client.execute(sql, &[&std::slice::from_ref(id)]).await {
            Ok(_) => {}
            Err(e) if refused(&e) => {
                tracing::error!(id = %id, error = %crate::report::Chain(&e), "the table refused to mark this row (a trigger, a constraint or a row-level security policy on the outbox table); it stays as it was (the poller may publish it again)");
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn marker(limit: usize) -> (Marker, mpsc::UnboundedReceiver<Mark>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let backlog = Arc::new(Backlog {
            unmarked: AtomicUsize::new(0),
            limit,
            room: Notify::new(),
            ended: AtomicBool::new(false),
        });
        (
            Marker {
                tx,
                backlog,
                holes: None,
            },
            rx,
        )
    }

    #[tokio::test]
    async fn the_queue_is_full_at_the_ceiling_and_has_room_once_marks_are_written() {
        let (marker, _rx) = marker(3);
        for n in 0..3 {
            assert!(!marker.full(), "{n} marks are under the ceiling");
            marker.send(Mark::Published(n.to_string()));
        }
        assert!(marker.full());
        assert_eq!(marker.unmarked(), 3);
        marker.backlog.written(2);
        tokio::time::timeout(Duration::from_secs(1), marker.room())
            .await
            .expect("written marks make room");
        assert!(!marker.full());
        assert_eq!(marker.unmarked(), 1);
    }

    #[tokio::test]
    async fn a_mark_for_a_task_that_is_gone_is_not_counted() {
        let (marker, rx) = marker(1);
        drop(rx);
        marker.send(Mark::Skipped("a".into()));
        assert_eq!(marker.unmarked(), 0);
        assert!(!marker.full());
    }

    #[tokio::test]
    async fn an_ended_task_never_holds_the_stream() {
        let (marker, _rx) = marker(1);
        marker.send(Mark::Published("a".into()));
        assert!(marker.full());
        drop(Ending(Arc::clone(&marker.backlog)));
        assert!(!marker.full(), "nothing will write the queued mark");
        tokio::time::timeout(Duration::from_secs(1), marker.room())
            .await
            .expect("the end wakes the stream");
    }
}
