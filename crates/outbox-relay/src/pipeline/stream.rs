//! The replication stream: from the slot to the sink, and acknowledgements back.
//!
//! ```text
//!  Postgres walsender ──pgoutput──► WalStream (read in place) ──WalMessage──► Stream
//!      ▲                                                                      │ decode, map, encode
//!      │  status updates                                                      ▼
//!      └── WalStream::send_status(confirmed) ◄── AckTracker ◄── Completion ◄── publisher ──► Sink
//! ```
//!
//! # Progress tracking
//!
//! The only position ever reported to Postgres is [`AckTracker::confirmed`]:
//! the end of the last commit whose events, and all earlier ones, the sink has
//! finished, or a keepalive's `wal_end` when nothing is open or unfinished (see
//! [`crate::pipeline::ack`] for why that is safe). The loop sends it in standby status
//! updates every `min(1 s, wal_sender_timeout / 2)`, on a timer of its own
//! that runs whether or not it reads, after a burst in which the server
//! asked for a reply, and, when it moved, `PROMPT_ACK` (200 ms) after the
//! last update: while events finish, and when a keepalive moved it past the
//! W of a pair the derived keeper waits to store.
//!
//! A session starts at the slot's `confirmed_flush_lsn` and reports that
//! position until it confirms more, so a restart never moves the slot.
//!
//! # Prepared transactions
//!
//! A slot created with `two_phase` is streamed with protocol version 3 and
//! `two_phase 'on'` from PostgreSQL 15 on ([`readiness::Readiness::protocol`];
//! version 1 otherwise, and on 14, whose pgoutput sends prepared transactions
//! at COMMIT PREPARED as ordinary ones). A prepared transaction then arrives
//! at PREPARE TRANSACTION: its events are held (the `prepared` submodule)
//! and parked in the tracker, which keeps the confirmed position before it;
//! COMMIT PREPARED hands them to the publisher at its own place in the
//! stream, after what committed in between, and ROLLBACK PREPARED drops them. A session that
//! ends meanwhile loses nothing: the walsender sends a prepared transaction
//! again to a session that starts before its PREPARE record (and only its
//! COMMIT PREPARED, without the rows, to one that starts after it, which is
//! why the position may not pass it).
//!
//! # Backpressure
//!
//! The loop reads the socket only while three things are under their
//! ceilings; at any of them it stops reading (status updates go on) and the
//! walsender waits, so memory stays bounded however large the backlog:
//!
//! * the events between receipt and their final outcome: at most
//!   `[stream] max_in_flight`;
//! * the bytes they hold ([`held_bytes`]: the pgoutput message the event
//!   shares, the encoded envelope and the sink's copy of it, and a fixed
//!   share for the rest): at most
//!   `[stream] max_in_flight_bytes`. The check comes before each message,
//!   so one event larger than the whole budget still passes (the budget is
//!   exceeded by at most one event), and the stream never deadlocks;
//! * events of prepared transactions waiting for their COMMIT PREPARED count
//!   in both, up to half of each (`under_budget`): only a later message of
//!   the stream can release them, so they may not stop it. Beyond half a
//!   budget they are held without bound (the rows of the prepared
//!   transactions open at once; the server allows `max_prepared_transactions`
//!   of them), and the events that flow keep the other half;
//! * the rows published but not yet marked or deleted
//!   ([`Marker::full`], `[lifecycle] max_unmarked`), so marking never falls
//!   behind without bound; it does not hold the confirmed position
//!   (see [`crate::postgres::outbox::marking`]). In the derived lifecycle
//!   only rows in a hole, rows without an id and filtered-out rows are
//!   marked: the rest write nothing.
//!
//! # Graceful shutdown
//!
//! On the stop signal the loop reads on to the end of the open transaction (so
//! nothing half-emitted is left unconfirmed), stops reading, waits for the
//! in-flight events (up to `[stream] shutdown_timeout`; not for those of
//! prepared transactions, which the next session gets again), reports the final
//! position and waits until the slot shows it, then closes the stream
//! (CopyDone, Terminate). Without this step a clean restart would send the
//! last events again.
//!
//! # Errors
//!
//! [`RelayError::class`] says what to do: transient errors (the connection
//! broke, the slot is busy) end the session and [`run`] starts another after a
//! backoff; fatal errors (the slot or table does not fit, the stream cannot be
//! decoded) stop the relay with a message that says how to fix them. Neither
//! acknowledges anything: what was in flight is sent again.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use pgoutput::{
    Begin, BeginPrepare, Commit, CommitPrepared, Insert, LogicalMessage, Message as Pgoutput,
    Prepare, Relation, RollbackPrepared,
};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::config::{Config, OnPublished, TableName};
use crate::event::RowMapping;
use crate::pipeline::ack::{AckTracker, FramingError, Ticket};
pub(crate) use crate::pipeline::error::{ErrorClass, RelayError};
use crate::pipeline::outgoing::{Outgoing, Prepared};
use crate::pipeline::publish::{self, Completion, Dispatch};
use crate::pipeline::sink::Message;
use crate::pipeline::sink::Sink;
use crate::postgres::lsn::{format_lsn, parse_lsn};
use crate::postgres::outbox::marking::{self, Mark, Marker};
use crate::postgres::outbox::record::{RecordError, Recorder};
use crate::postgres::outbox::table::Table;
use crate::postgres::position;
use crate::postgres::readiness::{self, Admission, Names, Problem};
use crate::postgres::walstream::{Protocol, WalMessage, WalStream, WireError};
use crate::postgres::{self, ConnInfo};
use crate::retry::Backoff;

use super::prepared::{Held, PreparedTxs};

/// Prefix of the relay's heartbeat messages.
const HEARTBEAT_PREFIX: &str = "outbox-relay-heartbeat";

/// While events finish, the confirmed position goes to the server (and to
/// the kept position) at most this often, besides the status timer.
const PROMPT_ACK: Duration = Duration::from_millis(200);

/// How often a standby relay looks whether the slot is free.
const STANDBY_POLL: Duration = Duration::from_secs(2);

/// How long connecting and START_REPLICATION may take.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// How long to wait for the server to show the final acknowledgement.
const FINAL_ACK_TIMEOUT: Duration = Duration::from_secs(10);

/// What an event holds besides its row and its envelope, counted against
/// `stream.max_in_flight_bytes`: the message and event structs, their queue
/// slots, the group key and the id marking keeps. An estimate, on the
/// generous side (about half of this is measured in structs alone).
const HELD_PER_EVENT: usize = 512;

/// The bytes a message holds until its outcome: the replicated row (`row`
/// bytes of pgoutput message, which the event's fields share), the encoded
/// envelope twice (the sink copies it into the request or the output buffer
/// of its batch: the SNS sink form-encoded, the stdout sink as a line), and
/// [`HELD_PER_EVENT`]. Counting the copy for every event, not only for those
/// in a batch in flight, is generous; without it the stdout sink's buffer
/// of up to 1,024 large envelopes would double what the budget allows.
fn held_bytes(row: usize, message: &Message) -> usize {
    row + 2 * message.body.len() + HELD_PER_EVENT
}

/// Most events the loop reads in one burst before it looks at completions,
/// the heartbeat and the stop signal again.
const BURST_MAX: usize = 1024;

/// A read of fewer events than this, when it took everything there was, is
/// followed by the `stream.coalesce` pause.
pub(crate) const COALESCE_BELOW: usize = 64;

/// After a read of fewer than [`COALESCE_BELOW`] events that took everything
/// there was, hold the thread for `pause` (`stream.coalesce`, default 1 ms)
/// before anything reads again.
///
/// Why pause: the walsender sends each change as it decodes it. A relay that
/// keeps up would otherwise wake for every few rows, and each wake costs more
/// than the rows: a readiness wait, a `recv` (which sends a TCP window
/// update), the hand-over to the publisher, one sink call and its completion.
/// During the pause the kernel gathers what arrives, so the next read takes a
/// run of rows at once and they share those costs.
///
/// Why 1 ms: a longer pause gathers longer runs, so the CPU a row falls as
/// the pause grows, while an event that arrives during it waits up to the
/// whole pause. 1 ms buys most of the saving for a latency well inside the
/// 50 ms p99 target: on the drain benchmark (docs/benchmarks.md) it costs
/// 1.95 µs of CPU a row, against 2.3–2.4 at 300–700 µs and about 7 without
/// the pause, and adds about 3 ms to the median and 4 ms to the p99 latency
/// at 5,000 events/s (11.9 ms p99).
///
/// Why the thread, not a timer: a tokio sleep rounds up to whole
/// milliseconds and more, and a 1 ms tokio sleep halves throughput. The
/// thread's sleep ends within the kernel's timer slack (some 50 µs), but it
/// holds the runtime's thread: everything else (completions, health,
/// metrics) waits about this long, and so may an event, which is why the
/// pause stays small.
///
/// Why only when caught up: a relay that is behind already reads runs, and a
/// pause would only add to its backlog; so no pause after a read of a full
/// run, one cut short by the in-flight ceiling or the task's budget, or
/// during a graceful stop. And the pause cannot stall the walsender: at
/// 130,000 rows/s, 1 ms is about 80 KiB of stream, below the read buffer
/// and the socket's receive buffer.
fn coalesce(taken: usize, pause: Duration) {
    if taken < COALESCE_BELOW && !pause.is_zero() {
        std::thread::sleep(pause);
    }
}

/// Poll `future` once: its output if it is ready now. For cancel-safe futures
/// only (a pending one is dropped). Tokio's task budget may make a ready
/// future look pending: the burst then ends early (after about 128 messages,
/// the loop taking one unit a message), and the task yields to the publisher,
/// which keeps the pipeline, and the memory it holds, shallow.
fn now_or_never<F: std::future::Future>(future: F) -> Option<F::Output> {
    let mut future = std::pin::pin!(future);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match future.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(output) => Some(output),
        std::task::Poll::Pending => None,
    }
}

/// Counts over the life of [`run`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    /// Events the sink accepted.
    pub delivered: u64,
    /// Events rejected as never publishable.
    pub rejected: u64,
    /// Events filtered out (`[filter]`).
    pub skipped: u64,
    /// Replication sessions started.
    pub sessions: u64,
    /// The last position confirmed to the server.
    pub confirmed_lsn: u64,
}

/// Relay from the slot to `sink` until `stop` is cancelled (then shut down
/// gracefully) or a fatal error. Transient errors start a new session after a
/// backoff.
pub(crate) async fn run<S: Sink>(
    config: &Config,
    sink: Arc<S>,
    stop: CancellationToken,
    sweep: watch::Sender<Option<String>>,
) -> Result<Summary, RelayError> {
    let conn = ConnInfo::new(&config.postgres)?;
    let backoff = Backoff::new(&config.retry);
    let mut summary = Summary::default();
    let mut attempt = 0;
    loop {
        let sessions_before = summary.sessions;
        match session(
            config,
            &conn,
            Arc::clone(&sink),
            &stop,
            &mut summary,
            &sweep,
        )
        .await
        {
            Ok(()) => return Ok(summary),
            // Stopped while a session was failing for a passing reason (a
            // standby looking at the busy slot): a clean stop all the same.
            Err(e) if e.class() == ErrorClass::Transient && stop.is_cancelled() => {
                return Ok(summary)
            }
            Err(e) if e.class() == ErrorClass::Transient => {
                if summary.sessions > sessions_before {
                    attempt = 0; // it streamed: start the backoff over
                }
                let standby = e.is_slot_busy();
                let delay = if standby {
                    // Another relay holds the slot: poll it often, to take over
                    // within seconds when that one dies.
                    STANDBY_POLL
                } else {
                    backoff.delay(attempt)
                };
                attempt = attempt.saturating_add(1);
                if standby {
                    if attempt == 1 || attempt % 30 == 0 {
                        tracing::info!(reason = %crate::report::Chain(&e), "standing by: the slot is in use; taking over when it is free");
                    }
                } else {
                    tracing::warn!(error = %crate::report::Chain(&e), attempt, retry_in_ms = delay.as_millis() as u64, "replication session ended, reconnecting");
                }
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = stop.cancelled() => return Ok(summary),
                }
            }
            Err(e) => return Err(e),
        }
    }
}

fn sql(context: &'static str) -> impl FnOnce(tokio_postgres::Error) -> RelayError {
    move |source| RelayError::Sql { context, source }
}

/// Why the relay cannot start with the slot, publication and table as they
/// are; `check` reports the same [`Problem`] in the same words.
fn refusal(problem: Problem, names: &Names) -> RelayError {
    match problem {
        // As the stream says it when the table changes under it.
        Problem::Mapping(e) => RelayError::Mapping(e),
        problem => RelayError::Unusable {
            message: problem.describe(names),
            transient: problem.effect().transient(),
            lost: problem.effect().lost(),
        },
    }
}

/// Whether a poller can publish what a lost slot held ([`readiness::Readiness::sweepable`]).
/// Without one, recreating the slot would silently skip what was written
/// meanwhile: better to stop loudly.
fn can_sweep(config: &Config, sweepable: bool) -> bool {
    if sweepable {
        if !config.poller.enabled {
            tracing::warn!("this instance's poller is off: another instance's poller must sweep the rows the lost slot held (after poller.grace)");
        }
    } else {
        tracing::error!("lifecycle.recreate_slot is set, but the table lacks the relay-managed columns or created_at: no poller could publish what the lost slot held, so the slot is not recreated");
    }
    sweepable
}

/// Drop `slot` if it exists (invalidated) and create it anew; its start
/// position and the database time before which PENDING rows must be swept.
async fn recreate_slot(
    client: &tokio_postgres::Client,
    slot: &str,
    failover: bool,
) -> Result<(u64, String), RelayError> {
    client
        .execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
             WHERE slot_name = $1 AND wal_status = 'lost'",
            &[&slot],
        )
        .await
        .map_err(|source| {
            // 42704: another relay dropped it first: look again next session.
            if source.code().is_some_and(|c| c.code() == "42704") {
                RelayError::Unusable {
                    message: format!(
                        "replication slot {slot:?} was dropped by another process meanwhile; looking again"
                    ),
                    transient: true,
                    lost: false,
                }
            } else {
                RelayError::Sql {
                    context: "dropping the invalidated slot",
                    source,
                }
            }
        })?;
    let create = if failover {
        // postgres.failover_slot, as sql/003_slot_failover.sql creates it.
        "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)"
    } else {
        "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')"
    };
    let row = client
        .query_one(create, &[&slot])
        .await
        .map_err(|source| {
            // 42710: another relay created it first (duplicate object):
            // stand by, and look at it again in the next session.
            if source.code().is_some_and(|c| c.code() == "42710") {
                RelayError::Unusable {
                    message: format!(
                        "replication slot {slot:?} was created by another process meanwhile; looking again"
                    ),
                    transient: true,
                    lost: false,
                }
            } else {
                RelayError::Sql {
                    context: "creating the replication slot",
                    source,
                }
            }
        })?;
    let start = parse_lsn(row.get(0)).unwrap_or(0);
    // now() is the transaction start; the slot exists from here on.
    let before: String = client
        .query_one("SELECT clock_timestamp()::text", &[])
        .await
        .map_err(sql("reading the clock"))?
        .get(0);
    Ok((start, before))
}

/// One replication session: start, run, stop ([`Session`]). An error in any
/// phase ends it ([`run`] starts another after a transient one); the tasks it
/// spawned end with it ([`AbortOnDrop`]), and what was in flight is sent
/// again (nothing was acknowledged for it).
async fn session<S: Sink>(
    config: &Config,
    conn: &ConnInfo,
    sink: Arc<S>,
    stop: &CancellationToken,
    summary: &mut Summary,
    sweep: &watch::Sender<Option<String>>,
) -> Result<(), RelayError> {
    let Some(mut session) = Session::start(config, conn, sink, stop, summary, sweep).await? else {
        return Ok(()); // stopped before the stream opened
    };
    let ran = session.run().await;
    if ran.is_err() && !session.stopping() {
        return ran;
    }
    // Drained for the stop: an error while it read on for its last pair
    // ([`Settle`]) still reports and keeps what is confirmed, then counts.
    summary.confirmed_lsn = session.stop().await;
    ran
}

/// What inspection admitted: the outbox table and where and how to stream it.
struct Admitted {
    table: Table,
    /// The slot's confirmed position (or a recreated slot's start).
    start: u64,
    protocol: Protocol,
    /// Whether the position table exists (the relay keeps its position there).
    keep: bool,
    /// Whether the relay created the slot in this start (a hole opens:
    /// [`position::prepare`]).
    recreated: bool,
}

/// The tasks that take the stream's events to the sink and the table.
struct Spawned {
    /// Hands marking what the publisher finished (`None`: no marking).
    marker: Option<Marker>,
    marking_task: Option<tokio::task::JoinHandle<()>>,
    to_publisher: mpsc::Sender<Vec<Dispatch>>,
    done: mpsc::UnboundedReceiver<Vec<Completion>>,
    publisher: AbortOnDrop<Result<(), RecordError>>,
}

/// A replication session, in three phases:
///
/// * **start** ([`Session::start`]): *inspect* the slot, publication and
///   table (a problem refuses the start before anything runs), *recreate* a
///   lost slot (only when `lifecycle.recreate_slot` is set and a poller can
///   sweep what it held), *spawn* marking and the publisher, read the kept
///   *position* (in the derived lifecycle also the vouched snapshot, and the
///   *holes*, opened and written with a synchronous commit as
///   [`position::prepare`] says: the stream marks a delivery only in one of
///   them), then *START_REPLICATION* last, since from then on the
///   walsender expects status updates. The stream starts at the slot's
///   position (or the kept one, when it is ahead and of certain provenance:
///   invariant 8), and reports it until it confirms more, so a restart never
///   moves the slot.
/// * **run** ([`Session::run`]): read, decode and publish, and report only
///   [`AckTracker::confirmed`] (invariants 1 and 3); read only under the
///   in-flight budgets (invariant 6); end a silent stream (invariant 7). On
///   the stop signal it drains: reads on to the end of the open transaction,
///   then waits for the in-flight events, up to `stream.shutdown_timeout`.
/// * **stop** ([`Session::stop`]): report the final position, keep it, let
///   marking write what it holds, wait until the slot shows the position,
///   then close the stream, so a clean restart sends nothing again
///   (invariant 5).
struct Session<'a> {
    config: &'a Config,
    /// Cancelled to stop: the session drains, then stops.
    stop_signal: &'a CancellationToken,
    /// The session's SQL connection: inspection, recording, heartbeats, and
    /// (when marking has none of its own) marking.
    sql_client: Arc<tokio_postgres::Client>,
    wal: WalStream,
    stream: Stream<'a>,
    /// The stream's marker too: for the read condition and to wake when
    /// marking makes room.
    marking: Option<Marker>,
    marking_task: Option<tokio::task::JoinHandle<()>>,
    publisher: AbortOnDrop<Result<(), RecordError>>,
    done: mpsc::UnboundedReceiver<Vec<Completion>>,
    /// Writes the confirmed position to the position table, when it exists.
    keeper: Option<position::Keeper>,
    /// `min(1 s, wal_sender_timeout / 2)`: the status updates' period.
    interval: Duration,
    /// Status updates go out on this clock whether or not the loop reads.
    status: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// What the last status update said, and when (prompt acknowledgements).
    acknowledged: u64,
    last_ack: tokio::time::Instant,
    beat: tokio::time::Interval,
    /// When draining must end: set by the stop signal.
    deadline: Option<tokio::time::Instant>,
    /// The derived lifecycle's last pair at a graceful stop.
    settle: Settle,
    _streaming: Streaming,
}

/// A graceful stop under the derived lifecycle, once drained: the keeper
/// takes a last candidate pair after every delivered commit, and the session
/// reads on until the confirmed position passes its W, so the stop stores a
/// pair that vouches for everything it delivered. It reads keepalives (asked
/// for) and the transactions that committed before W (published as usual;
/// visible in the pair's S, and one committed in the instant between the
/// snapshot and the WAL read is made visible in the stored one:
/// [`position::Keeper::finish`]), and stops at the first transaction that
/// commits at or after W: transactions come in commit order, so everything
/// before W has come, and W is confirmed once it has finished. That one is
/// left to the next session, which streams it from W. Without it the rows of
/// the last second read `PENDING` while the relay is stopped (`status`,
/// `replay --state`, a standby's poller), until the next session's first
/// pair. Bounded by [`SETTLE_MAX`]: a stop behind a backlog does not wait
/// for the stream to work through it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settle {
    /// Not drained yet.
    Later,
    /// Reading on until the confirmed position reaches `lsn`, until `until`.
    Waiting {
        lsn: u64,
        until: tokio::time::Instant,
    },
    /// Nothing (more) to wait for.
    Done,
}

/// The longest a graceful stop reads on for its last pair ([`Settle`]).
const SETTLE_MAX: Duration = Duration::from_secs(2);

/// How often a settling stop asks the walsender for a keepalive.
const SETTLE_ASK: Duration = Duration::from_millis(50);

impl<'a> Session<'a> {
    /// Start: inspect, recreate, spawn, position, START_REPLICATION. `None`
    /// when `stop` came while the stream was opening.
    async fn start<S: Sink>(
        config: &'a Config,
        conn: &'a ConnInfo,
        sink: Arc<S>,
        stop: &'a CancellationToken,
        summary: &'a mut Summary,
        sweep: &watch::Sender<Option<String>>,
    ) -> Result<Option<Session<'a>>, RelayError> {
        let sql_client = Arc::new(conn.connect().await?);
        let admitted = Self::inspect(config, conn, &sql_client, sweep).await?;
        let interval = Self::status_interval(config, &sql_client).await?;
        // The derived lifecycle: the stream marks a delivery only in a hole
        // (or without an id); the holes come from the keeper, known before
        // the stream starts. Without the position table every delivery is
        // marked (the holes stay unknown).
        let derive = config.lifecycle.on_published == OnPublished::Derive && admitted.keep;
        let (holes_tx, holes_rx) = watch::channel(None);
        let holes_rx = (config.lifecycle.on_published == OnPublished::Derive).then_some(holes_rx);
        let spawned =
            Self::spawn(config, conn, &sql_client, &admitted.table, &sink, holes_rx).await?;
        let (position_table, kept) = Self::position(config, &sql_client).await?;
        // Holes written (synchronously committed) before START_REPLICATION.
        let derived = if derive {
            let vouching = position::prepare(
                &sql_client,
                &position_table,
                &config.postgres.slot,
                admitted.start,
                admitted.recreated,
                &config.postgres.publication,
                &admitted.table.qualified,
            )
            .await
            .map_err(sql("preparing the derived lifecycle's holes"))?;
            Some(position::Derived::new(
                vouching,
                &admitted.table.qualified,
                &config.postgres.publication,
                holes_tx,
            ))
        } else {
            if admitted.table.derived {
                position::suspend(&sql_client, &position_table, &config.postgres.slot)
                    .await
                    .map_err(sql("suspending the derived lifecycle"))?;
            }
            None
        };
        let replicating = Self::start_replication(config, conn, stop, &admitted, kept.as_ref());
        let Some(wal) = replicating.await? else {
            return Ok(None);
        };
        summary.sessions += 1;
        sink.source(&crate::pipeline::sink::Source {
            system: wal.system().id.clone(),
            database: conn.dbname.clone(),
            table: config.table().to_string(),
        });
        let choice = wal.choice().clone();
        let slot = &config.postgres.slot;
        match &choice.why {
            Some(why) if choice.doubt => tracing::warn!(slot = %slot, "{why}"),
            Some(why) => tracing::info!(slot = %slot, "{why}"),
            None => {}
        }
        let start = choice.lsn;
        let keeper = admitted.keep.then(|| {
            position::Keeper::new(
                Arc::clone(&sql_client),
                &position_table,
                slot,
                wal.system().clone(),
                start,
                summary.delivered + summary.rejected,
                derived,
            )
        });
        let streaming = Streaming::new();
        tracing::info!(
            database = %conn.display(),
            slot = %slot,
            publication = %config.postgres.publication,
            start_lsn = %format_lsn(start),
            protocol = ?admitted.protocol,
            status_interval_ms = interval.as_millis() as u64,
            sink = sink.name(),
            "streaming"
        );
        let mut stream = Stream::new(
            config,
            &conn.dbname,
            admitted.table.oid,
            start,
            spawned.to_publisher,
            spawned.marker.clone(),
            summary,
        );
        if keeper.as_ref().is_some_and(position::Keeper::derives) {
            stream.unvouched = Some(std::collections::VecDeque::new());
        }
        Ok(Some(Session {
            config,
            stop_signal: stop,
            sql_client,
            wal,
            stream,
            marking: spawned.marker,
            marking_task: spawned.marking_task,
            publisher: spawned.publisher,
            done: spawned.done,
            keeper,
            interval,
            status: Box::pin(tokio::time::sleep(interval)),
            acknowledged: start,
            last_ack: tokio::time::Instant::now(),
            beat: heartbeat(config),
            deadline: None,
            settle: Settle::Later,
            _streaming: streaming,
        }))
    }

    /// Inspect the slot, publication and table, as `check` does: warnings are
    /// logged, a problem that stops the relay is returned before anything
    /// runs, and a lost slot is recreated when the configuration allows it.
    async fn inspect(
        config: &Config,
        conn: &ConnInfo,
        sql_client: &tokio_postgres::Client,
        sweep: &watch::Sender<Option<String>>,
    ) -> Result<Admitted, RelayError> {
        let ready = readiness::inspect(sql_client, config)
            .await
            .map_err(sql("inspecting the slot, table and publication"))?;
        let names = ready.names.clone();
        for problem in &ready.problems {
            if problem.effect() == readiness::Effect::Warns {
                tracing::warn!(problem = %problem.describe(&names), "the relay runs, but check this");
            }
        }
        let sweepable = ready.sweepable();
        let keep = !ready
            .problems
            .iter()
            .any(|p| matches!(p, Problem::NoPositionTable { .. }));
        let protocol = ready.protocol();
        match ready.admit() {
            Admission::Start { table, start } => Ok(Admitted {
                table,
                start,
                protocol,
                keep,
                recreated: false,
            }),
            Admission::SlotLost { table, problem }
                if config.lifecycle.recreate_slot && can_sweep(config, sweepable) =>
            {
                let start = Self::recreate(config, conn, &problem, &names, sweep).await?;
                Ok(Admitted {
                    table,
                    start,
                    protocol: Protocol::V1, // created without two_phase
                    keep,
                    recreated: true,
                })
            }
            Admission::SlotLost { problem, .. } | Admission::Refused(problem) => {
                Err(refusal(problem, &names))
            }
        }
    }

    /// Recreate the lost slot; its start position. The rows it held are left
    /// to the poller (`sweep` names the time before which PENDING rows are
    /// swept without grace), so nothing written meanwhile is skipped.
    async fn recreate(
        config: &Config,
        conn: &ConnInfo,
        problem: &Problem,
        names: &Names,
        sweep: &watch::Sender<Option<String>>,
    ) -> Result<u64, RelayError> {
        let slot = &config.postgres.slot;
        tracing::error!(slot = %slot, problem = %problem.describe(names), "replication slot lost; recreating it (lifecycle.recreate_slot)");
        // Creating a slot waits for every running transaction, perhaps
        // for minutes: on a session without the silence bound.
        let creating = conn.without_silence_bound().connect().await?;
        let (start, before) = recreate_slot(&creating, slot, config.postgres.failover_slot).await?;
        tracing::error!(
            slot = %slot,
            start_lsn = %format_lsn(start),
            "replication slot recreated: events written while it was missing are published by the poller \
             (rows still PENDING created up to {before}); see docs/recovery.md"
        );
        sweep.send_replace(Some(before));
        Ok(start)
    }

    /// The status updates' period, from the server's `wal_sender_timeout`;
    /// warns when `postgres.receive_timeout` is too short for it.
    async fn status_interval(
        config: &Config,
        sql_client: &tokio_postgres::Client,
    ) -> Result<Duration, RelayError> {
        let sender_timeout = postgres::wal_sender_timeout(sql_client)
            .await
            .map_err(sql("reading wal_sender_timeout"))?;
        let receive_timeout = config.postgres.receive_timeout;
        if !receive_timeout.is_zero() && receive_timeout < sender_timeout {
            // While it decodes a large transaction of other tables, a walsender
            // reads its client only every wal_sender_timeout / 2.
            tracing::warn!(
                receive_timeout_s = receive_timeout.as_secs(),
                wal_sender_timeout_s = sender_timeout.as_secs(),
                "postgres.receive_timeout is below the server's wal_sender_timeout: a walsender busy decoding \
                 a large transaction may answer too late, and the session would end and start over; keep \
                 receive_timeout at least wal_sender_timeout"
            );
        }
        Ok(postgres::status_interval(sender_timeout))
    }

    /// Spawn marking and the publisher, before the stream opens: from then on
    /// events have somewhere to go.
    async fn spawn<S: Sink>(
        config: &Config,
        conn: &ConnInfo,
        sql_client: &Arc<tokio_postgres::Client>,
        table: &Table,
        sink: &Arc<S>,
        holes: Option<marking::HolesWatch>,
    ) -> Result<Spawned, RelayError> {
        let recorder = Recorder::detect(Arc::clone(sql_client), config, table).await?;
        // Marking has a connection of its own: a statement of its that waits or
        // fails ends only its connection, never the session's.
        let marking_client = match table.published_sql(config.lifecycle.on_published) {
            Some(_) => Arc::new(conn.connect().await?),
            None => Arc::clone(sql_client),
        };
        let marking = marking::spawn(
            marking_client,
            conn.clone(),
            table,
            config.lifecycle.on_published,
            Backoff::new(&config.retry),
            config.lifecycle.max_unmarked,
            holes,
        );
        let (marker, marking_task) = match marking {
            Some((marker, task)) => (Some(marker), Some(task)),
            None => (None, None),
        };
        // Bursts, not events: `max_in_flight` bounds the events (the read condition).
        let (to_publisher, from_stream) = mpsc::channel(64);
        let (done_tx, done) = mpsc::unbounded_channel();
        let publisher = AbortOnDrop(tokio::spawn(publish::run(
            Arc::clone(sink),
            Some(Arc::new(recorder)),
            marker.clone(),
            from_stream,
            done_tx,
            Backoff::new(&config.retry),
        )));
        Ok(Spawned {
            marker,
            marking_task,
            to_publisher,
            done,
            publisher,
        })
    }

    /// The position the relay kept ([`crate::postgres::position`]), and the
    /// table it keeps it in: the start when the slot is behind it and its
    /// provenance is certain.
    async fn position(
        config: &Config,
        sql_client: &tokio_postgres::Client,
    ) -> Result<(String, Option<position::Kept>), RelayError> {
        let name = config.table();
        let position_table =
            crate::postgres::sql::qualified(&name.schema, &position::table_name(&name.name));
        let kept = position::load(sql_client, &position_table, &config.postgres.slot)
            .await
            .map_err(sql("reading the kept position"))?;
        Ok((position_table, kept))
    }

    /// START_REPLICATION, within [`START_TIMEOUT`]; `None` when `stop` came
    /// first. Opened once everything else is ready: from here on the session
    /// must answer the walsender (status updates), which nothing before
    /// [`Session::run`] would.
    async fn start_replication(
        config: &Config,
        conn: &ConnInfo,
        stop: &CancellationToken,
        admitted: &Admitted,
        kept: Option<&position::Kept>,
    ) -> Result<Option<WalStream>, RelayError> {
        let opening = conn.replicate_with(
            &config.postgres.slot,
            &config.postgres.publication,
            admitted.start,
            kept,
            admitted.protocol,
        );
        tokio::select! {
            opened = tokio::time::timeout(START_TIMEOUT, opening) => match opened {
                Ok(opened) => Ok(Some(opened?)),
                Err(_) => Err(RelayError::Replication(WireError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("replication did not start within {} s", START_TIMEOUT.as_secs()),
                )))),
            },
            _ = stop.cancelled() => Ok(None),
        }
    }

    /// Run: the loop, until drained after the stop signal, or an error. Each
    /// turn takes the first of, in this order: the status timer, completions,
    /// room in marking, the heartbeat, the stop signal, the shutdown
    /// deadline, the stream (only while [`Session::may_read`]).
    async fn run(&mut self) -> Result<(), RelayError> {
        loop {
            let draining = self.deadline.is_some();
            let tracker = &self.stream.tracker;
            // Parked events wait for a COMMIT PREPARED further on: the position
            // stays before them, and the next session gets them again.
            if draining && !tracker.in_transaction() && tracker.unfinished() == tracker.parked() {
                match self.settle {
                    Settle::Later => {
                        self.begin_settle().await?;
                        continue;
                    }
                    Settle::Waiting { lsn, until } => {
                        if self.stream.settle_cut {
                            // Every transaction committed before W came and
                            // finished (the stream is drained): W is passed.
                            self.stream.tracker.keepalive(lsn);
                        }
                        let tracker = &self.stream.tracker;
                        if tracker.confirmed() >= lsn {
                            break;
                        }
                        if self.stream.settle_cut || tokio::time::Instant::now() >= until {
                            tracing::info!(
                                confirmed = %format_lsn(tracker.confirmed()),
                                lsn = %format_lsn(lsn),
                                "stopping without the last pair: the stream did not reach it in \
                                 time; the rows delivered since the last one read PENDING until \
                                 the next session vouches for them"
                            );
                            break;
                        }
                    }
                    Settle::Done => break,
                }
            }
            let read = self.may_read(draining);
            let wait_for_marking = !read && self.marking_full();
            let heartbeat = !self.config.stream.heartbeat_interval.is_zero();
            tokio::select! {
                biased;
                () = &mut self.status => self.status_due(read).await?,
                completions = self.done.recv() => match completions {
                    Some(batch) => self.completed(batch).await?,
                    None => return Err(self.publisher.stopped().await),
                },
                () = room(self.marking.as_ref()), if wait_for_marking => {}
                _ = self.beat.tick(), if heartbeat && !draining => self.heartbeat(),
                _ = self.stop_signal.cancelled(), if !draining => self.drain(),
                // Before the stream: a stream that always has more must not
                // keep the stop past its timeout.
                _ = tokio::time::sleep_until(self.deadline.unwrap_or_else(tokio::time::Instant::now)), if draining => {
                    tracing::warn!(
                        unfinished = self.stream.tracker.unfinished() - self.stream.tracker.parked(),
                        "shutdown timeout: stopping with events unfinished; they will be sent again after a restart"
                    );
                    break;
                }
                first = self.wal.next(), if read => self.burst(first, draining).await?,
            }
            if self.sql_client.is_closed() {
                // Recording and marking need it: start over on a fresh connection.
                return Err(RelayError::SqlSessionClosed);
            }
            self.gauges();
        }
        Ok(())
    }

    /// Whether the loop reads the stream: while draining only to the end of
    /// the open transaction, and only while the in-flight events, their
    /// bytes and the unmarked rows are under their ceilings (invariant 6).
    fn may_read(&self, draining: bool) -> bool {
        let tracker = &self.stream.tracker;
        let stream = &self.config.stream;
        (!draining || tracker.in_transaction() || self.settling())
            && under_budget(tracker.unfinished(), tracker.parked(), stream.max_in_flight)
            && under_budget(
                tracker.held_bytes(),
                tracker.parked_bytes(),
                stream.max_in_flight_bytes,
            )
            && !self.marking_full()
    }

    fn marking_full(&self) -> bool {
        self.marking.as_ref().is_some_and(Marker::full)
    }

    /// Whether the stop has drained the session (it reads on for its last
    /// pair, or has done so).
    fn stopping(&self) -> bool {
        self.settle != Settle::Later
    }

    /// Whether a graceful stop reads on for its last pair ([`Settle`]): not
    /// past the first transaction at or after W, and not past its time
    /// (then only to the end of the open transaction, as the drain reads).
    fn settling(&self) -> bool {
        match self.settle {
            Settle::Waiting { until, .. } => {
                !self.stream.settle_cut && tokio::time::Instant::now() < until
            }
            Settle::Later | Settle::Done => false,
        }
    }

    /// Drained: under the derived lifecycle, have the keeper take the last
    /// candidate and, unless the confirmed position has passed its W
    /// already, read on for it ([`Settle`]).
    async fn begin_settle(&mut self) -> Result<(), RelayError> {
        self.settle = Settle::Done;
        // Parked events (a prepared transaction waiting for its COMMIT
        // PREPARED) hold the confirmed position before them: no W after it
        // can be passed this session.
        if !self.keeper.as_ref().is_some_and(position::Keeper::derives)
            || self.stream.tracker.parked() > 0
        {
            return Ok(());
        }
        // Offers the transactions confirmed since the last status update:
        // those the last candidate must see.
        self.acknowledge(false).await?;
        let finished = self.stream.summary.delivered + self.stream.summary.rejected;
        // One bound for the snapshot and the reading on, within the
        // shutdown timeout.
        let until = tokio::time::Instant::now() + SETTLE_MAX;
        let until = self.deadline.map_or(until, |deadline| deadline.min(until));
        let Some(keeper) = &mut self.keeper else {
            return Ok(());
        };
        let Some(lsn) = keeper.final_candidate(finished, until).await else {
            return Ok(());
        };
        if self.stream.tracker.confirmed() >= lsn {
            return Ok(());
        }
        self.settle = Settle::Waiting { lsn, until };
        self.stream.settle_at = Some(lsn);
        self.acknowledge(true).await?;
        self.status
            .as_mut()
            .reset(tokio::time::Instant::now() + SETTLE_ASK);
        Ok(())
    }

    /// Report the confirmed position (asking for a reply if `reply`), and
    /// offer it to the keeper.
    async fn acknowledge(&mut self, reply: bool) -> Result<(), RelayError> {
        let confirmed = self.stream.tracker.confirmed();
        self.wal.send_status(confirmed, reply).await?;
        self.acknowledged = confirmed;
        self.last_ack = tokio::time::Instant::now();
        if let Some(keeper) = &mut self.keeper {
            let finished = self.stream.summary.delivered + self.stream.summary.rejected;
            let delivered = self.stream.confirmed_xids(confirmed);
            keeper.offer(confirmed, finished, &delivered);
            if keeper.waits_for(confirmed) {
                // Its previous round still runs: offered again soon.
                let at = tokio::time::Instant::now() + PROMPT_ACK;
                if at < self.status.deadline() {
                    self.status.as_mut().reset(at);
                }
            }
        }
        Ok(())
    }

    /// The status timer: a status update, and the silence bound (invariant 7).
    async fn status_due(&mut self, read: bool) -> Result<(), RelayError> {
        if !read {
            self.wal.heard_now();
        }
        // A quiet stream is asked for a reply after two status
        // intervals, reported not ready at half the receive timeout,
        // and taken for dead at all of it (crate::postgres::silence).
        let receive_timeout = self.config.postgres.receive_timeout;
        let bounded = !receive_timeout.is_zero();
        let quiet = self.wal.quiet();
        let silent = bounded && quiet >= receive_timeout / 2;
        crate::metrics::get().health.stream_silent_ms.store(
            if silent { quiet.as_millis() as u64 } else { 0 },
            std::sync::atomic::Ordering::Relaxed,
        );
        if silent && quiet >= receive_timeout {
            return Err(RelayError::Replication(WireError::Silent(receive_timeout)));
        }
        let settling = self.settling();
        let ask = (bounded && quiet >= 2 * self.interval) || settling;
        let next = if settling { SETTLE_ASK } else { self.interval };
        self.status
            .as_mut()
            .reset(tokio::time::Instant::now() + next);
        self.acknowledge(ask).await
    }

    /// Outcomes from the publisher: finished in the tracker, and the
    /// confirmed position reported promptly when it moved.
    async fn completed(&mut self, batch: Vec<Completion>) -> Result<(), RelayError> {
        batch.into_iter().for_each(|c| self.stream.completed(c));
        // Acknowledged promptly while events finish, not only on
        // the status timer: what a crash of the relay (the slot's
        // position) or of PostgreSQL (the kept one) sends again
        // is then at most PROMPT_ACK of output.
        let confirmed = self.stream.tracker.confirmed();
        if confirmed > self.acknowledged && self.last_ack.elapsed() >= PROMPT_ACK {
            self.acknowledge(false).await?;
        } else {
            self.prompt(true);
        }
        Ok(())
    }

    /// Bring the status update forward to [`PROMPT_ACK`] after the last one
    /// when the confirmed position moved and it is worth telling soon: by
    /// events finished (`events`: what a crash sends again), or past the W
    /// of a pair the keeper waits to store (a keepalive's advance: the rows
    /// it vouches for read published an interval sooner).
    fn prompt(&mut self, events: bool) {
        let confirmed = self.stream.tracker.confirmed();
        if confirmed <= self.acknowledged
            || !(events || self.keeper.as_ref().is_some_and(|k| k.waits_for(confirmed)))
        {
            return;
        }
        let at = self.last_ack + PROMPT_ACK;
        if at < self.status.deadline() {
            self.status.as_mut().reset(at);
        }
    }

    /// Emit a heartbeat message, measured when it comes back through the
    /// stream ([`Stream::handle_message`]).
    fn heartbeat(&self) {
        // Non-transactional: it comes back through the stream at once.
        let client = Arc::clone(&self.sql_client);
        tokio::spawn(async move {
            let sent = crate::time::unix_ms();
            match client
                .execute(
                    "SELECT pg_logical_emit_message(false, $1, $2)",
                    &[&HEARTBEAT_PREFIX, &sent.to_string()],
                )
                .await
            {
                Ok(_) => crate::metrics::get().heartbeat_sent(sent),
                Err(e) => {
                    tracing::warn!(error = %crate::report::Chain(&e), "cannot emit a heartbeat")
                }
            }
        });
    }

    /// The stop signal: drain, up to `stream.shutdown_timeout`.
    fn drain(&mut self) {
        tracing::info!(
            in_flight = self.stream.tracker.unfinished(),
            "stopping: finishing the open transaction and in-flight events"
        );
        self.deadline = Some(tokio::time::Instant::now() + self.config.stream.shutdown_timeout);
    }

    /// Read a burst: `first`, then what is already buffered or readable now,
    /// without a round through select, while [`Session::may_read`]; hand it
    /// to the publisher in one piece.
    async fn burst(
        &mut self,
        first: Result<WalMessage, WireError>,
        draining: bool,
    ) -> Result<(), RelayError> {
        let mut next = Some(first);
        let mut taken = 0;
        // Whether the burst ended because nothing more had come in
        // (not at the in-flight ceiling, the burst limit, or the end
        // of the task's budget): only then has the relay caught up.
        let mut caught_up = false;
        while let Some(message) = next.take() {
            self.stream.received(message?)?;
            taken += 1;
            // One unit of tokio's task budget a message: a spent
            // budget ends the burst (see `now_or_never`).
            if taken < BURST_MAX
                && self.may_read(draining)
                && now_or_never(tokio::task::coop::consume_budget()).is_some()
            {
                next = match self.wal.buffered()? {
                    Some(message) => Some(Ok(message)),
                    None => now_or_never(self.wal.next()),
                };
                caught_up = next.is_none() && tokio::task::coop::has_budget_remaining();
            }
        }
        match self.stream.flush().await {
            Err(RelayError::PublisherStopped) => return Err(self.publisher.stopped().await),
            other => other?,
        }
        if self.wal.reply_wanted() {
            self.status
                .as_mut()
                .reset(tokio::time::Instant::now() + self.interval);
            self.acknowledge(false).await?;
        }
        self.prompt(false);
        if caught_up && !draining {
            coalesce(taken, self.config.stream.coalesce);
        }
        Ok(())
    }

    /// The gauges that follow the loop: in flight, unmarked, status updates.
    fn gauges(&self) {
        let metrics = crate::metrics::get();
        metrics
            .in_flight
            .set(self.stream.tracker.unfinished() as i64);
        metrics
            .in_flight_bytes
            .set(self.stream.tracker.held_bytes() as i64);
        if let Some(marker) = &self.marking {
            metrics.unmarked.set(marker.unmarked() as i64);
        }
        metrics.status_updates_total(self.wal.status_updates());
    }

    /// Stop: report the final position, keep it, let marking finish, wait
    /// until the slot shows the position, close the stream; the position.
    /// Without this phase a clean restart would send the last events again.
    async fn stop(self) -> u64 {
        let Session {
            config,
            sql_client,
            mut wal,
            stream,
            marking,
            marking_task,
            publisher,
            keeper,
            _streaming,
            ..
        } = self;
        let mut stream = stream;
        let confirmed = stream.tracker.confirmed();
        // Confirmed since the last status update: the last pair sees them.
        let delivered = stream.confirmed_xids(confirmed);
        // Every marker goes, so that marking writes what it holds and ends.
        drop(marking);
        drop(stream);
        drop(publisher);
        // Reported before waiting for marking, which does not hold the position
        // back, so the walsender has it even if it times the session out then.
        let reported = report_final(&mut wal, confirmed).await;
        let mut marked = true;
        if let Some(task) = marking_task {
            // Every marker is gone now: the task writes what it holds, then
            // ends. Before the last pair is stored: a filtered-out row it
            // vouches for reads PUBLISHED until its SKIPPED is written.
            if tokio::time::timeout(Duration::from_secs(5), task)
                .await
                .is_err()
            {
                tracing::warn!("marking did not finish in time; unmarked rows stay PENDING");
                marked = false;
            }
        }
        if let Some(keeper) = keeper {
            // Kept whether or not the server took it: every event before it is
            // published or recorded. A pair only once every mark is written.
            keeper
                .finish(confirmed, &delivered, Duration::from_secs(5), marked)
                .await;
        }
        if reported {
            confirm_final(&sql_client, &config.postgres.slot, confirmed).await;
        }
        // CopyDone, Terminate: the server ends the session at once.
        let _ = tokio::time::timeout(Duration::from_secs(2), wal.close()).await;
        confirmed
    }
}

/// The heartbeat's clock (`stream.heartbeat_interval`; an hour, never
/// polled, when off), and its timeout published for `/readyz`.
fn heartbeat(config: &Config) -> tokio::time::Interval {
    let heartbeat = config.stream.heartbeat_interval;
    crate::metrics::get().health.heartbeat_timeout_ms.store(
        if heartbeat.is_zero() {
            0
        } else {
            config.stream.heartbeat_timeout.as_millis() as u64
        },
        std::sync::atomic::Ordering::Relaxed,
    );
    let mut beat = tokio::time::interval(if heartbeat.is_zero() {
        Duration::from_secs(3600)
    } else {
        heartbeat
    });
    beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    beat
}

/// Send the final position, within 5 s; whether it went.
async fn report_final(wal: &mut WalStream, confirmed: u64) -> bool {
    match tokio::time::timeout(Duration::from_secs(5), wal.send_status(confirmed, false)).await {
        Ok(Ok(())) => {
            crate::metrics::get().status_updates_total(wal.status_updates());
            true
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "cannot send the final position; the last events may be sent again");
            false
        }
        Err(_) => {
            tracing::warn!(
                "the final position could not be sent in 5 s; the last events may be sent again"
            );
            false
        }
    }
}

/// Wait until the slot shows `lsn` (reported already), up to [`FINAL_ACK_TIMEOUT`].
async fn confirm_final(sql_client: &tokio_postgres::Client, slot: &str, lsn: u64) {
    let started = Instant::now();
    let mut shown = None;
    while started.elapsed() < FINAL_ACK_TIMEOUT {
        let state = tokio::time::timeout(
            Duration::from_secs(2),
            postgres::slot_state(sql_client, slot),
        );
        match state.await.unwrap_or(Ok(None)) {
            Ok(Some(state)) if state.confirmed_flush >= Some(lsn) => {
                shown = state.confirmed_flush;
                break;
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %crate::report::Chain(&e), "cannot read the slot to check the final acknowledgement");
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    match shown {
        Some(at) => tracing::info!(confirmed_lsn = %format_lsn(at), "final position acknowledged"),
        None => tracing::warn!(
            lsn = %format_lsn(lsn),
            "the server did not show the final acknowledgement in time; the last events may be sent again"
        ),
    }
}

/// Per-session state of the loop.
struct Stream<'a> {
    config: &'a Config,
    table: TableName,
    /// Filter, routing and envelope.
    outgoing: Outgoing,
    tracker: AckTracker,
    /// Relation oid → mapping for the outbox table, `None` for other tables.
    /// By relation oid; looked up for every row, so not with SipHash.
    relations: HashMap<u32, Option<RowMapping>, foldhash::fast::FixedState>,
    /// The outbox table's oid (Relation messages carry it).
    table_oid: u32,
    /// Commit time of the open transaction.
    commit_time: i64,
    /// The open transaction's id.
    xid: u32,
    /// Under the derived lifecycle, the transactions with events received
    /// and not yet confirmed: (commit end, id), in commit order. Confirmed,
    /// they go to the keeper, which vouches for each
    /// ([`position::Keeper::offer`]).
    unvouched: Option<std::collections::VecDeque<(u64, u32)>>,
    /// A settling stop's W ([`Settle`]): a transaction that commits at or
    /// after it is not begun, and `settle_cut` says one came.
    settle_at: Option<u64>,
    settle_cut: bool,
    /// Prepared transactions' events, until their COMMIT PREPARED.
    prepared: PreparedTxs,
    to_publisher: mpsc::Sender<Vec<Dispatch>>,
    /// Dispatches of the burst being read, handed over by [`Stream::flush`].
    burst: Vec<Dispatch>,
    /// Outbox events read in this burst (for the metric).
    received_in_burst: u64,
    marker: Option<Marker>,
    summary: &'a mut Summary,
}

impl<'a> Stream<'a> {
    /// A stream that reports `start` until it confirms more.
    fn new(
        config: &'a Config,
        database: &str,
        table_oid: u32,
        start: u64,
        to_publisher: mpsc::Sender<Vec<Dispatch>>,
        marker: Option<Marker>,
        summary: &'a mut Summary,
    ) -> Self {
        Stream {
            config,
            table: config.table(),
            table_oid,
            outgoing: Outgoing::new(config, database),
            tracker: AckTracker::new(start),
            relations: HashMap::default(),
            commit_time: 0,
            xid: 0,
            unvouched: None,
            settle_at: None,
            settle_cut: false,
            prepared: PreparedTxs::default(),
            to_publisher,
            burst: Vec::new(),
            received_in_burst: 0,
            marker,
            summary,
        }
    }

    /// An event `[filter]` left out: marked SKIPPED, never published.
    fn skipped(&mut self, id: String, ticket: Ticket) {
        tracing::debug!(id = %id, "filtered out; not published");
        self.summary.skipped += 1;
        crate::metrics::get().published("skipped", 1);
        if let Some(marker) = &self.marker {
            marker.send(Mark::Skipped(id));
        }
        self.tracker.finish(ticket);
    }

    fn completed(&mut self, completion: Completion) {
        let ticket = match completion {
            Completion::Delivered(ticket) => {
                self.summary.delivered += 1;
                ticket
            }
            Completion::Rejected { ticket, id, reason } => {
                self.summary.rejected += 1;
                crate::metrics::get().published("rejected", 1);
                tracing::error!(id = %id, error = %reason, "event rejected and recorded as failed; the stream moves on");
                ticket
            }
        };
        self.tracker.finish(ticket);
    }

    /// Hand the burst's dispatches to the publisher in one piece.
    async fn flush(&mut self) -> Result<(), RelayError> {
        // Counted per burst: a labelled counter's lookup per event showed in profiles.
        crate::metrics::get().received("replication", std::mem::take(&mut self.received_in_burst));
        if self.burst.is_empty() {
            return Ok(());
        }
        // The next burst is likely about as long: sized once, not grown.
        let next = Vec::with_capacity(self.burst.len());
        self.to_publisher
            .send(std::mem::replace(&mut self.burst, next))
            .await
            .map_err(|_| RelayError::PublisherStopped)
    }

    /// One message of the stream: a keepalive, or pgoutput data.
    fn received(&mut self, message: WalMessage) -> Result<(), RelayError> {
        match message {
            WalMessage::KeepAlive { wal_end } => self.handle_keepalive(wal_end),
            WalMessage::Data { start, data } => self.data(start, data),
        }
    }

    /// Decode a pgoutput message at `at` and hand it to its `handle_*`.
    fn data(&mut self, at: u64, data: Bytes) -> Result<(), RelayError> {
        let row = data.len();
        let message = pgoutput::decode(data).map_err(|source| RelayError::Decode {
            lsn: format_lsn(at),
            source,
        })?;
        match message {
            Pgoutput::Begin(begin) => self.handle_begin(&begin),
            Pgoutput::Relation(relation) => self.handle_relation(&relation),
            Pgoutput::Insert(insert) => self.handle_insert(at, row, &insert),
            Pgoutput::Commit(commit) => self.handle_commit(&commit),
            Pgoutput::Message(message) => self.handle_message(&message),
            Pgoutput::Update(_) | Pgoutput::Delete(_) | Pgoutput::Truncate(_) => {
                self.handle_update_delete_truncate(at)
            }
            // Origin and Type describe what follows; nothing of theirs is published.
            Pgoutput::Origin(_) | Pgoutput::Type(_) => Ok(()),
            Pgoutput::BeginPrepare(begin) => self.handle_begin_prepare(&begin),
            Pgoutput::Prepare(prepare) => self.handle_prepare(at, prepare),
            Pgoutput::CommitPrepared(commit) => self.handle_commit_prepared(&commit),
            Pgoutput::RollbackPrepared(rollback) => self.handle_rollback_prepared(&rollback),
            // Sent only to a client that asked for streaming; the relay does not.
            Pgoutput::StreamPrepare(_) => Err(FramingError::Unexpected("Stream Prepare").into()),
        }
    }

    /// A keepalive: its `wal_end` is the confirmed position when nothing is
    /// open or unfinished (invariant 3, kept by [`AckTracker::keepalive`]).
    fn handle_keepalive(&mut self, wal_end: u64) -> Result<(), RelayError> {
        self.tracker.keepalive(wal_end);
        Ok(())
    }

    /// Begin: a transaction opens; its commit time dates the events without
    /// `created_at`.
    fn handle_begin(&mut self, begin: &Begin) -> Result<(), RelayError> {
        if self.settle_at.is_some_and(|w| begin.final_lsn >= w) {
            // Not begun, so nothing of it is published or confirmed: the
            // session reads no further ([`Session::settling`]).
            self.settle_cut = true;
            return Ok(());
        }
        self.tracker.begin()?;
        self.commit_time = begin.commit_time;
        self.xid = begin.xid;
        Ok(())
    }

    /// Commit: the transaction closes at its end position, which the
    /// confirmed position may reach once its events finish.
    fn handle_commit(&mut self, commit: &Commit) -> Result<(), RelayError> {
        if let Some(unvouched) = &mut self.unvouched {
            if self.tracker.open_has_events() {
                unvouched.push_back((commit.end_lsn, self.xid));
            }
        }
        self.tracker.commit(commit.end_lsn)?;
        Ok(())
    }

    /// The ids of the transactions with events confirmed at `confirmed`
    /// since the last call (none outside the derived lifecycle).
    fn confirmed_xids(&mut self, confirmed: u64) -> Vec<u32> {
        let Some(unvouched) = &mut self.unvouched else {
            return Vec::new();
        };
        let upto = unvouched.partition_point(|&(end, _)| end <= confirmed);
        unvouched.drain(..upto).map(|(_, xid)| xid).collect()
    }

    /// Relation: whether the table announced is the outbox, and if so its
    /// mapping (a mismatch with `[columns]` stops the relay before its rows).
    fn handle_relation(&mut self, relation: &Relation) -> Result<(), RelayError> {
        // By oid or by name. By oid: a row written before a rename is
        // announced under the old name, one written after under the
        // new. By name: a table dropped and created again under a
        // publication FOR ALL TABLES or FOR TABLES IN SCHEMA has a
        // new oid, and its rows are the outbox's; skipping them would
        // confirm them unpublished. Its columns are checked like any
        // Relation's (a mismatch stops the relay before its rows).
        let named = relation.namespace == self.table.schema && relation.name == self.table.name;
        let ours = relation.oid == self.table_oid || named;
        if named && relation.oid != self.table_oid {
            tracing::warn!(
                table = %self.table, oid = relation.oid, was = self.table_oid,
                "the outbox table was created again (a new oid); its rows are published as the outbox's"
            );
        }
        if ours && !named {
            tracing::warn!(
                table = %self.table, now = %format!("{}.{}", relation.namespace, relation.name),
                "the outbox table was renamed; its rows are still published, but marking, the poller \
                 and retention use postgres.table: set it to the new name (the relay will not start \
                 with the old one)"
            );
        }
        let mapping = if ours {
            let mapping = RowMapping::new(relation, &self.config.columns)?;
            for (key, column) in &mapping.absent_optional {
                tracing::warn!(
                    table = %self.table, column = %column, key = %format!("columns.{key}"),
                    "optional column not in the table; set the key to \"\" to silence this"
                );
            }
            Some(mapping)
        } else {
            tracing::debug!(namespace = %relation.namespace, name = %relation.name, "table in the publication is not the outbox; its rows are ignored");
            None
        };
        self.relations.insert(relation.oid, mapping);
        Ok(())
    }

    /// Insert: a row of the outbox becomes a dispatch for this burst, or is
    /// held with its prepared transaction; rows of other tables are ignored.
    /// Every outbox row takes a ticket before anything else, so the confirmed
    /// position cannot pass it until its outcome (invariant 1).
    fn handle_insert(&mut self, at: u64, row: usize, insert: &Insert) -> Result<(), RelayError> {
        let mapping = self
            .relations
            .get(&insert.relation_oid)
            .ok_or(RelayError::UnknownRelation(insert.relation_oid))?;
        let Some(mapping) = mapping else {
            return Ok(());
        };
        let ticket = self.tracker.event()?;
        self.received_in_burst += 1;
        let dispatch = match mapping.event(&insert.tuple, self.commit_time) {
            Ok(event) => match self.outgoing.prepare(event, ticket, self.commit_time) {
                Prepared::Publish(mut message) => {
                    let held = held_bytes(row, &message);
                    message.ticket = self.tracker.hold(message.ticket, held);
                    Dispatch::Publish(message)
                }
                Prepared::Skip(id) => {
                    if self.prepared.is_open() {
                        self.prepared.hold(Held::Skipped { id, ticket });
                    } else {
                        self.skipped(id, ticket);
                    }
                    return Ok(());
                }
                Prepared::Fail(id, reason) => Dispatch::Reject {
                    ticket: self.tracker.hold(ticket, HELD_PER_EVENT),
                    id,
                    reason,
                },
            },
            Err(e) => {
                let id = mapping.id_of(&insert.tuple).unwrap_or_default();
                tracing::error!(lsn = %format_lsn(at), id = %id, error = %crate::report::Chain(&e), "outbox row cannot become an event");
                Dispatch::Reject {
                    ticket: self.tracker.hold(ticket, HELD_PER_EVENT),
                    id,
                    reason: e.to_string(),
                }
            }
        };
        if self.prepared.is_open() {
            self.prepared.hold(Held::Dispatch(dispatch));
        } else {
            self.burst.push(dispatch);
        }
        Ok(())
    }

    /// Update, Delete, Truncate: the outbox is append-only for the relay;
    /// only inserts are events.
    fn handle_update_delete_truncate(&mut self, at: u64) -> Result<(), RelayError> {
        tracing::debug!(lsn = %format_lsn(at), "update, delete or truncate skipped; the relay publishes inserts");
        Ok(())
    }

    /// Message (`pg_logical_emit_message`): the relay's own heartbeat is
    /// measured; any other is ignored.
    fn handle_message(&mut self, message: &LogicalMessage) -> Result<(), RelayError> {
        if message.prefix != HEARTBEAT_PREFIX {
            tracing::debug!(prefix = %message.prefix, "logical decoding message ignored");
            return Ok(());
        }
        if let Some(sent) = std::str::from_utf8(&message.content)
            .ok()
            .and_then(|s| s.parse().ok())
        {
            crate::metrics::get().heartbeat_seen(sent);
        }
        Ok(())
    }

    /// Begin Prepare: a prepared transaction opens; its events are held
    /// until its outcome.
    fn handle_begin_prepare(&mut self, begin: &BeginPrepare) -> Result<(), RelayError> {
        self.tracker.begin_prepared()?;
        self.prepared.begin();
        // Not committed yet: an event without created_at takes the
        // prepare time as its time.
        self.commit_time = begin.prepare_time;
        Ok(())
    }

    /// Prepare: the transaction's events wait for COMMIT PREPARED, parked in
    /// the tracker, which keeps the confirmed position before them.
    fn handle_prepare(&mut self, at: u64, prepare: Prepare) -> Result<(), RelayError> {
        let tracked = self.tracker.prepare(prepare.end_lsn)?;
        if tracked.is_some() {
            tracing::debug!(gid = %prepare.gid, xid = prepare.xid, lsn = %format_lsn(at), "prepared transaction: its events wait for COMMIT PREPARED");
        }
        self.prepared.prepared(prepare.xid, prepare.gid, tracked);
        Ok(())
    }

    /// Commit Prepared: the held events go to the publisher here, after what
    /// committed in between, dated by the commit.
    fn handle_commit_prepared(&mut self, commit: &CommitPrepared) -> Result<(), RelayError> {
        let outcome = "COMMIT PREPARED: its events are published";
        let events = self.resolve_prepared(commit.xid, outcome);
        if let (Some(unvouched), false) = (&mut self.unvouched, events.is_empty()) {
            unvouched.push_back((commit.end_lsn, commit.xid));
        }
        for event in events {
            match event {
                Held::Dispatch(mut dispatch) => {
                    if let Dispatch::Publish(message) = &mut dispatch {
                        message.commit_time = commit.commit_time;
                    }
                    self.burst.push(dispatch);
                }
                Held::Skipped { id, ticket } => self.skipped(id, ticket),
            }
        }
        Ok(())
    }

    /// Rollback Prepared: the held events finish at once, never published.
    fn handle_rollback_prepared(&mut self, rollback: &RollbackPrepared) -> Result<(), RelayError> {
        let outcome = "ROLLBACK PREPARED: its events are dropped, never published";
        for event in self.resolve_prepared(rollback.xid, outcome) {
            self.tracker.finish(event.ticket());
        }
        Ok(())
    }

    /// The events held for prepared transaction `xid`, its parked place in
    /// the tracker released; none when nothing was held (no outbox events,
    /// or it was confirmed before this session).
    fn resolve_prepared(&mut self, xid: u32, outcome: &str) -> Vec<Held> {
        let Some(waiting) = self.prepared.resolve(xid) else {
            return Vec::new();
        };
        tracing::debug!(gid = %waiting.gid, events = waiting.events.len(), "{outcome}");
        self.tracker.resolve(waiting.tracked);
        waiting.events
    }
}

/// Whether a budget of `max` (events or bytes) has room with `used` taken,
/// `parked` of it by prepared transactions waiting for their COMMIT PREPARED.
/// Those count up to half of the budget, no more: nothing in flight can make
/// room for them (only their outcome, further on in the stream, can), so
/// counting them whole could stop the stream for good, while up to half
/// leaves the other half to the events that flow.
fn under_budget(used: usize, parked: usize, max: usize) -> bool {
    used - parked + parked.min(max / 2) < max
}

/// Resolves when marking has made room ([`Marker::room`]); never without marking.
async fn room(marker: Option<&Marker>) {
    match marker {
        Some(marker) => marker.room().await,
        None => std::future::pending().await,
    }
}

/// The session shows as streaming in the metrics while this lives (however
/// the session ends).
struct Streaming;

impl Streaming {
    fn new() -> Self {
        let metrics = crate::metrics::get();
        metrics.set_streaming(true);
        metrics.status_updates_total(0); // this stream counts from zero
        Streaming
    }
}

impl Drop for Streaming {
    fn drop(&mut self) {
        let metrics = crate::metrics::get();
        metrics.set_streaming(false);
        metrics
            .health
            .stream_silent_ms
            .store(0, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Aborts the task when dropped (a session that ends with an error leaves
/// nothing running; what was in flight is sent again by the next session).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl AbortOnDrop<Result<(), RecordError>> {
    /// Why the publisher ended, once it has: a rejection it could not record,
    /// or (having ended without a reason) [`RelayError::PublisherStopped`].
    async fn stopped(&mut self) -> RelayError {
        match (&mut self.0).await {
            Ok(Err(e)) => RelayError::Record(e),
            Ok(Ok(())) | Err(_) => RelayError::PublisherStopped,
        }
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::under_budget;

    #[test]
    fn parked_events_take_at_most_half_of_a_budget() {
        assert!(under_budget(9, 0, 10));
        assert!(!under_budget(10, 0, 10));
        // Parked alone never stop the stream, however many.
        assert!(under_budget(1_000, 1_000, 10));
        // Beyond half, they count as half: five in flight fill the rest.
        assert!(under_budget(104, 100, 10));
        assert!(!under_budget(105, 100, 10));
        // Under half, they count whole.
        assert!(!under_budget(10, 3, 10));
    }
}
