//! The fallback poller: publishes from the table what the log cannot give back.
//!
//! Each round, in one transaction, it claims due rows with
//! `FOR UPDATE SKIP LOCKED` (so several relays can poll one table and no row
//! is claimed twice), publishes them through the same mapping, envelope,
//! routing and sink as the stream, and records the outcome:
//!
//! | due rows | |
//! |---|---|
//! | `PENDING`, older than `poller.grace` | missed by the stream (a crash between publish and marking, a stream that is down: the slot inactive at every round for `poller.grace`, see [`Down`]); while the slot is active, only once the slot has passed them (see [`Passed`]) |
//! | `PENDING`, created before a slot was recreated | swept at once by this instance's poller, without waiting for the grace period |
//! | `FAILED`, `attempts < poller.max_attempts`, `next_attempt_at` passed | retries of rejected events |
//!
//! On a table whose state is derived (`on_published = "derive"` on a table
//! with `relay_txid`, [`derived::Reader`]) rows the stream published stay
//! `PENDING` and are published by the derived rule, so `PENDING` alone no
//! longer means due. A round then claims, in one transaction and one batch:
//!
//! 1. **explicit work** through `{table}_explicit_idx`, oldest `created_at`
//!    first: `FAILED` rows as above, and `PENDING` rows without an id (from
//!    before the migration) with the age rules above;
//! 2. **rows in a hole** (before the slot's boundary, or written while the
//!    relay could not vouch for the stream), one `{table}_txid_idx` range per
//!    hole, then
//! 3. **rows not visible in the vouched snapshot**: those of the
//!    transactions in progress at it (`= ANY` of its in-progress ids) and
//!    those after it (the range from its xmax; [`derived::Ranges`]),
//!
//! each in id order (≈ the order the transactions started) and only rows
//! not derived published, with the age rules of `PENDING` rows and one
//! more: their id is visible in the snapshot of a passed sample
//! ([`Passed`]): the transaction had committed when the sample was taken,
//! so the stream passed it. That snapshot's xmax closes the range above, so
//! a round reads the index only between the vouched snapshot and the
//! stream, and the rows of transactions open at the vouched snapshot, never
//! the table's published rows (also not while a long or prepared
//! transaction keeps the snapshot's xmin back). While the slot streams
//! under `derive`, the ranges after the vouched snapshot (not the holes)
//! also wait for a pair stored since that sample, for a grace at most: what
//! the stream passed there it delivered, and the keeper's next pair vouches
//! for it ([`Poller::claim_range_sql`], [`Withheld`]). The claimed rows are
//! then published oldest `created_at` first, and every outcome is written
//! explicitly, as above.
//!
//! | outcome | row becomes |
//! |---|---|
//! | delivered | `PUBLISHED` (`published_at = now()`), or deleted in delete mode |
//! | rejected (or unmappable) | `FAILED`, `attempts + 1`, `last_error`, `next_attempt_at = now() + backoff`; `DEAD` at `max_attempts` or past `max_age` (error log, optional notice to `poller.dead_letter_topic`) |
//! | transient failure (SNS down, throttled) | unchanged: the round ends, the rows are retried next round, no attempt is counted |
//! | filtered out (`[filter]`) | `SKIPPED` (deleted in delete mode) |
//!
//! The backoff of a FAILED row is `backoff_initial × multiplier^attempts`,
//! capped at `backoff_max`, with jitter. Rows are taken oldest first (by
//! `created_at`), so a group's retries keep their relative order; a retried
//! FAILED row is by nature later than the events of its group that followed it.

use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::watch;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, RetryConfig};
use crate::pipeline::ack::Ticket;
use crate::pipeline::rows::{batches, Prepared, Rows, TEXT_SETTINGS};
use crate::pipeline::sink::{Message, Outcome, Sink};
use crate::postgres::lsn::WalLayout;
use crate::postgres::outbox::derived::{self, Reader};
use crate::postgres::outbox::marking;
use crate::postgres::outbox::table::{storable, Table};
use crate::postgres::ConnInfo;
use crate::retry::Backoff;

/// Samples kept by [`Passed`]; when full, every other one goes.
const PASSED_SAMPLES: usize = 600;

/// How many rows whose state the poller could not write it remembers
/// ([`Poller::unrecordable`]); beyond it, further ones are published again
/// each round they are claimed.
const MAX_UNRECORDABLE: usize = 10_000;

/// Which PENDING rows an active slot has already passed.
///
/// A PENDING row past `poller.grace` is missed only if the stream has gone
/// past it (published but not marked: a crash in between, a marking failure).
/// One the stream has not reached yet is still its to publish; claiming it
/// would publish a backlog twice. Rows carry no LSN, so each round samples
/// the server's clock with `pg_current_wal_insert_lsn()` (as the end of the
/// last record: [`WalLayout::last_record_end`]): every transaction that
/// committed before the sample's time lies before its LSN. Once the slot's
/// `confirmed_flush_lsn` reaches a sample, the stream has passed every row
/// committed before that time. The poller then claims PENDING rows created
/// more than `poller.grace` before the newest passed sample: a transaction
/// open longer than `grace` may be published twice, never missed.
///
/// Each sample also keeps the snapshot (`pg_current_snapshot()`) it was
/// taken under, before its LSN was read: every transaction visible in it had
/// its commit record before the LSN. On a derived table that tells, by id,
/// the rows the stream has passed (see the module's documentation); unlike
/// the snapshot's xmin alone, a transaction left open (a forgotten prepared
/// one) holds back only its own rows.
#[derive(Debug, Default)]
pub(crate) struct Passed {
    /// (server time in seconds since the epoch, WAL position, snapshot),
    /// oldest first.
    samples: std::collections::VecDeque<(f64, i64, String)>,
}

impl Passed {
    /// Record a sample; the time and snapshot of the newest sample at or
    /// before `confirmed`, if any.
    pub(crate) fn update(
        &mut self,
        sample: (f64, i64, String),
        confirmed: Option<i64>,
    ) -> Option<(f64, String)> {
        if self.samples.len() == PASSED_SAMPLES {
            // Thin out rather than forget the oldest: a slot far behind still
            // reaches a sample, later and coarser.
            let mut keep = false;
            self.samples.retain(|_| {
                keep = !keep;
                keep
            });
        }
        self.samples.push_back(sample);
        let confirmed = confirmed?;
        let newest = self
            .samples
            .iter()
            .rposition(|(_, lsn, _)| *lsn <= confirmed)?;
        self.samples.drain(..newest);
        self.samples
            .front()
            .map(|(at, _, snapshot)| (*at, snapshot.clone()))
    }
}

/// Which PENDING rows past their grace the stream has missed (the claim's
/// `$2` and, on a derived table, `$3`).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Missed {
    /// Created before this time (seconds since the epoch); `None` while the
    /// streaming slot has passed no sample (or has not been down for
    /// `poller.grace` yet), infinite once it is down.
    pub before: Option<f64>,
    /// On a derived table, with an id visible in this snapshot (text);
    /// `None` as `before`, the round's own once the slot is down.
    pub passed: Option<String>,
    /// The slot streams: on a derived table a row after the vouched
    /// snapshot is then due only once a pair stored since `before` still
    /// leaves it unpublished ([`Poller::claim_range_sql`]).
    pub streaming: bool,
}

/// Since when the poller has seen the slot inactive at every look
/// ([`Poller::missed`]). The stream is down, and what it missed the
/// poller's, only once it has been so for `poller.grace`: a relay that
/// starts polls before its own stream is up, and rows written while it
/// was stopped are the stream's to send, not the poller's too.
#[derive(Debug, Default)]
struct Down(Since);

impl Down {
    /// Record a look at `now` (`active`: the slot streams); whether the
    /// slot has been inactive at every look for at least `grace`.
    fn look(&mut self, active: bool, grace: std::time::Duration, now: std::time::Instant) -> bool {
        self.0.look(!active, now).is_some_and(|held| held >= grace)
    }
}

/// How long a condition has held at every look, from the first look that
/// found it: the clock of [`Down`] and [`Withheld`].
#[derive(Debug, Default)]
struct Since(Option<std::time::Instant>);

impl Since {
    /// Record a look at `now` that found the condition holding (`holds`) or
    /// not; how long it has held, `None` when it does not now.
    fn look(&mut self, holds: bool, now: std::time::Instant) -> Option<std::time::Duration> {
        if !holds {
            self.0 = None;
            return None;
        }
        Some(now.saturating_duration_since(*self.0.get_or_insert(now)))
    }
}

/// `created_at` (Postgres timestamptz text) before which PENDING rows are
/// swept without grace, after a slot was recreated.
pub(crate) type Sweep = watch::Receiver<Option<String>>;

/// What one round did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Round {
    /// Rows claimed.
    pub claimed: usize,
    /// Published (and marked or deleted).
    pub published: usize,
    /// Recorded FAILED.
    pub failed: usize,
    /// Recorded DEAD.
    pub dead: usize,
    /// Filtered out.
    pub skipped: usize,
    /// Left for the next round after a transient failure.
    pub deferred: usize,
    /// Whose outcome the table refused to record ([`Poller::unrecordable`]).
    pub unrecorded: usize,
}

/// A row whose outcome the table refused to record: why, and how long it
/// is left out of the claims ([`Poller::unrecordable`]).
struct Refused {
    id: String,
    why: String,
    again_in: std::time::Duration,
}

/// A round's claimed rows, by what becomes of them.
#[derive(Default)]
struct Claimed {
    /// To publish: the message, the row's attempts so far, whether it is
    /// past `poller.max_age`.
    messages: Vec<(Message, i32, bool)>,
    /// Ids the sink accepted.
    published: Vec<String>,
    /// Ids filtered out.
    skipped: Vec<String>,
    /// (id, attempts so far, past `max_age`, reason): unmappable or rejected.
    failures: Vec<(String, i32, bool, String)>,
}

impl Claimed {
    /// Sort the claimed rows: messages to publish, filtered out, unmappable.
    fn new(rows_to_messages: &mut Rows, rows: &[tokio_postgres::Row]) -> Self {
        let width = rows_to_messages.width();
        let mut claimed = Claimed::default();
        for row in rows {
            let attempts: i32 = row.get(width);
            let too_old: bool = row.get::<_, Option<bool>>(width + 1).unwrap_or(false);
            match rows_to_messages.prepare(row) {
                Prepared::Publish(message) => claimed.messages.push((message, attempts, too_old)),
                Prepared::Skip(id) => claimed.skipped.push(id.to_string()),
                Prepared::Fail(id, reason) => {
                    claimed.failures.push((id, attempts, too_old, reason))
                }
            }
        }
        claimed
    }
}

/// Since when rows after the vouched snapshot, passed by the stream, have
/// waited at every round for a pair to vouch for them
/// ([`Poller::claim_derived`]). They wait for `poller.grace` from the first
/// round that left any to the keeper; then the poller takes them: nothing
/// vouched for them (a keeper that cannot store, or something other than a
/// relay's stream holds the slot and confirms).
#[derive(Debug, Default)]
struct Withheld {
    since: Since,
    /// The wait is over, and was said to be.
    over: bool,
}

impl Withheld {
    /// Record a round at `now` that left rows to the keeper (`withheld`) or
    /// none; once they have waited `grace` or more, how long, and whether
    /// this is the first round to find so.
    fn look(
        &mut self,
        withheld: bool,
        grace: std::time::Duration,
        now: std::time::Instant,
    ) -> Option<(std::time::Duration, bool)> {
        let Some(waited) = self.since.look(withheld, now) else {
            self.over = false;
            return None;
        };
        if waited < grace {
            return None;
        }
        let first = !self.over;
        self.over = true;
        Some((waited, first))
    }
}

/// The poller of one relay.
pub(crate) struct Poller<S> {
    config: Config,
    conn: ConnInfo,
    sink: Arc<S>,
    sweep: Sweep,
    backoff: Backoff,
    passed: Passed,
    down: Down,
    withheld: Withheld,
    wal: Option<WalLayout>,
    /// Rows whose outcome the table refused to record (a trigger that
    /// raises or suppresses the update, a constraint the row breaks, a
    /// row-level security policy), until when they are passed over: not
    /// claimed again (and published again) every round, but once a
    /// `poller.backoff_max` (a failure: once its backoff), so that a row set
    /// back to `PENDING` after the cause is mended is sent again. Every
    /// other row of their round is recorded ([`record_each`],
    /// [`marking::refused`]).
    unrecordable: std::collections::HashMap<String, std::time::Instant>,
}

impl<S: Sink> Poller<S> {
    /// A poller for `config`, publishing with `sink`.
    pub(crate) fn new(
        config: &Config,
        sink: Arc<S>,
        sweep: Sweep,
    ) -> Result<Self, crate::postgres::ConnInfoError> {
        Ok(Self {
            conn: ConnInfo::new(&config.postgres)?,
            backoff: Backoff::new(&RetryConfig {
                initial: config.poller.backoff_initial,
                max: config.poller.backoff_max,
                ..config.retry.clone()
            }),
            config: config.clone(),
            sink,
            sweep,
            passed: Passed::default(),
            down: Down::default(),
            withheld: Withheld::default(),
            wal: None,
            unrecordable: std::collections::HashMap::new(),
        })
    }

    /// Poll every `poller.interval` until `stop`; a round that claimed a full
    /// batch is followed by another at once.
    pub(crate) async fn run(mut self, stop: CancellationToken) {
        let mut client: Option<(Client, Table, Option<Reader>)> = None;
        let mut failed_rounds = 0u32;
        loop {
            let full = match self.connected(&mut client).await {
                Some((c, table, reader)) => match self.round(c, table, reader).await {
                    Ok(round) => {
                        failed_rounds = 0;
                        if round.claimed > 0 {
                            tracing::info!(
                                claimed = round.claimed,
                                published = round.published,
                                failed = round.failed,
                                dead = round.dead,
                                skipped = round.skipped,
                                deferred = round.deferred,
                                "poller round"
                            );
                        }
                        // A round of rows the table refused is not a full
                        // one: the next would claim them again at once.
                        round.claimed >= self.config.poller.batch_size
                            && round.deferred == 0
                            && round.unrecorded == 0
                    }
                    Err(e) => {
                        failed_rounds = failed_rounds.saturating_add(1);
                        tracing::warn!(error = %crate::report::Chain(&e), failed_rounds, "poller round failed; retrying with backoff");
                        client = None;
                        false
                    }
                },
                None => false,
            };
            if full {
                if stop.is_cancelled() {
                    return;
                }
                continue;
            }
            // Back off after failed rounds, so a persistent error (a missing
            // grant, a broken column) does not republish a batch every interval.
            let wait = self.config.poller.interval * 2u32.saturating_pow(failed_rounds.min(6));
            tokio::select! {
                _ = tokio::time::sleep(wait.min(std::time::Duration::from_secs(300))) => {}
                _ = stop.cancelled() => return,
            }
        }
    }

    async fn connected<'a>(
        &self,
        client: &'a mut Option<(Client, Table, Option<Reader>)>,
    ) -> Option<(&'a mut Client, &'a Table, Option<&'a Reader>)> {
        if client.as_ref().is_none_or(|(c, _, _)| c.is_closed()) {
            *client = None;
            match self.conn.connect().await {
                Ok(c) => match Table::inspect(&c, &self.config).await {
                    Ok(Some(table)) if table.managed && table.created_at.is_some() => {
                        let name = self.config.table();
                        // The stream tells the sink too (IDENTIFY_SYSTEM, which
                        // needs no grant): a database that revoked
                        // pg_control_system() only leaves the poller unable to.
                        match crate::postgres::source(&c, &self.conn.dbname, &name).await {
                            Ok(source) => self.sink.source(&source),
                            Err(e) => {
                                tracing::debug!(error = %crate::report::Chain(&e), "poller cannot read the system identifier");
                            }
                        }
                        let reader = match Reader::of(&c, &self.config, table.derived).await {
                            Ok(reader) => reader,
                            Err(e) => {
                                tracing::warn!(error = %crate::report::Chain(&e), "poller cannot read the position table");
                                return None;
                            }
                        };
                        *client = Some((c, table, reader))
                    }
                    Ok(_) => {
                        tracing::warn!(
                            table = %self.config.table(),
                            "the poller needs the relay-managed columns and created_at; it is idle"
                        );
                        return None;
                    }
                    Err(e) => {
                        tracing::warn!(error = %crate::report::Chain(&e), "poller cannot inspect the table");
                        return None;
                    }
                },
                Err(e) => {
                    tracing::warn!(error = %crate::report::Chain(&e), "poller cannot connect");
                    return None;
                }
            }
        }
        client.as_mut().map(|(c, t, r)| (c, &*t, r.as_ref()))
    }

    /// One round: claim, publish, record, commit. The claim, the outcomes
    /// and the commit are one transaction: a round that fails before its
    /// commit leaves every row as it was, to be claimed again.
    pub(crate) async fn round(
        &mut self,
        client: &mut Client,
        table: &Table,
        reader: Option<&Reader>,
    ) -> Result<Round, tokio_postgres::Error> {
        let mut rows_to_messages = match Rows::new(&self.config, table, &self.conn.dbname) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %crate::report::Chain(&e), "the poller cannot map the table");
                return Ok(Round::default());
            }
        };
        let sweep = self.sweep.borrow().clone();
        let missed = self.missed(client).await?;
        let tx = client.transaction().await?;
        // Deferred constraints are checked at each statement, inside its
        // savepoint ([`record_each`]), not at the commit, where one row's
        // refusal would roll the whole round back.
        tx.batch_execute(&format!("{TEXT_SETTINGS}; SET CONSTRAINTS ALL IMMEDIATE"))
            .await?;
        let rows = match reader {
            None => {
                let passed_over = self.passed_over();
                tx.query(
                    &self.claim_sql(table),
                    &[&sweep, &missed.before, &passed_over],
                )
                .await?
            }
            Some(reader) => {
                self.claim_derived(&tx, table, reader, &sweep, &missed)
                    .await?
            }
        };
        let metrics = crate::metrics::get();
        metrics.poller_ran();
        metrics.received("poller", rows.len() as u64);
        let mut round = Round {
            claimed: rows.len(),
            ..Round::default()
        };
        if rows.is_empty() {
            tx.commit().await?;
            return Ok(round);
        }
        let mut claimed = Claimed::new(&mut rows_to_messages, &rows);
        self.publish(&mut claimed, &mut round).await;
        let (dead_notices, unrecorded) = self.record(&tx, table, &claimed, &mut round).await?;
        tx.commit().await?;
        let now = std::time::Instant::now();
        round.unrecorded = unrecorded.len();
        for Refused { id, why, again_in } in unrecorded {
            tracing::error!(
                id = %id, error = %why, again_in_s = again_in.as_secs(),
                "the poller published (or failed) this row but the table refused to record it (a \
                 trigger, a constraint or a row-level security policy on the outbox table): it stays \
                 as it was, and is taken again only after a while. Let the relay's role update \
                 publish_state and the relay-managed columns"
            );
            claimed.published.retain(|p| *p != id);
            claimed.skipped.retain(|p| *p != id);
            if self.unrecordable.len() < MAX_UNRECORDABLE {
                self.unrecordable.insert(id, now + again_in);
            }
        }
        round.published = claimed.published.len();
        round.skipped = claimed.skipped.len();
        metrics.published("delivered", claimed.published.len() as u64);
        metrics.published("skipped", claimed.skipped.len() as u64);
        metrics.published("rejected", (round.failed + round.dead) as u64);
        metrics.published("retried", round.deferred as u64);
        self.notify_dead(&dead_notices, &claimed.messages).await;
        Ok(round)
    }

    /// The claim's `$2` (and `$3`): PENDING rows past the grace period and
    /// created before this (with an id visible in this) are missed. While the
    /// slot streams, only those it has passed (see [`Passed`]; `None` while
    /// it has passed none of the samples); once it has been down for
    /// `poller.grace` ([`Down`]), all of them; none before.
    async fn missed(&mut self, client: &Client) -> Result<Missed, tokio_postgres::Error> {
        // The snapshot (the statement's) is taken before the LSN is read:
        // every transaction visible in it has its commit record before it,
        // which is at most the last record's end (what a walsender reports
        // on an idle server).
        let row = client
            .query_one(
                "SELECT extract(epoch FROM now())::float8, (pg_current_wal_insert_lsn() - '0/0')::bigint, \
                        coalesce(bool_or(active), false), max((confirmed_flush_lsn - '0/0')::bigint), \
                        pg_current_snapshot()::text \
                 FROM pg_replication_slots WHERE slot_name = $1",
                &[&self.config.postgres.slot],
            )
            .await?;
        let snapshot: String = row.get(4);
        let streaming: bool = row.get(2);
        let insert: i64 = row.get(1);
        let end = self.wal(client).await.last_record_end(insert as u64) as i64;
        let passed = self
            .passed
            .update((row.get(0), end, snapshot.clone()), row.get(3));
        // NULL: nothing missed can be told from the backlog yet. (The claim
        // keeps it as a condition of its own: `least(now(), NULL)` is now().)
        Ok(if streaming {
            self.down
                .look(true, self.config.poller.grace, std::time::Instant::now());
            let (before, passed) = passed.unzip();
            Missed {
                before,
                passed,
                streaming,
            }
        } else if self
            .down
            .look(false, self.config.poller.grace, std::time::Instant::now())
        {
            Missed {
                before: Some(f64::INFINITY),
                passed: Some(snapshot),
                streaming,
            }
        } else {
            Missed::default()
        })
    }

    /// The server's WAL layout, read once for the poller's life, across
    /// reconnections ([`WalLayout::read`]: a cluster's standbys share it);
    /// unknown (positions as they are) while it cannot be read, and read
    /// again the next round.
    async fn wal(&mut self, client: &Client) -> WalLayout {
        if let Some(wal) = self.wal {
            return wal;
        }
        match WalLayout::read(client).await {
            Ok(wal) => *self.wal.insert(wal),
            Err(error) => {
                tracing::debug!(error = %crate::report::Chain(&error), "poller cannot read the WAL's layout");
                WalLayout::default()
            }
        }
    }

    /// The rows passed over for now ([`Poller::unrecordable`]), as text
    /// (the claims' `$3`, or their `$4` on a derived table's ranges);
    /// entries past their time are forgotten.
    fn passed_over(&mut self) -> Vec<String> {
        let now = std::time::Instant::now();
        self.unrecordable.retain(|_, until| *until > now);
        self.unrecordable.keys().cloned().collect()
    }

    /// The claim: due rows, oldest first, locked and skipping rows another
    /// poller holds. `$1` is the sweep time after a recreated slot (PENDING
    /// rows created up to it are due at once), `$2` [`Poller::missed_before`].
    fn claim_sql(&self, table: &Table) -> String {
        let poller = &self.config.poller;
        let created_at = table.created_at.as_deref().unwrap_or("created_at");
        format!(
            "SELECT {cols}, o.attempts::int4, ({max_age} > 0 AND o.{created_at} < now() - make_interval(secs => {max_age})) \
             FROM {t} AS o \
             WHERE ((o.publish_state = 'PENDING' AND ((o.{created_at} < now() - make_interval(secs => {grace}) \
                                                      AND o.{created_at} < to_timestamp($2::float8) - make_interval(secs => {grace})) \
                                                     OR o.{created_at} <= $1::text::timestamptz)) \
                OR (o.publish_state = 'FAILED' AND o.attempts < {max_attempts} \
                    AND coalesce(o.next_attempt_at, '-infinity') <= now())) \
               AND NOT (o.{id}::text = ANY($3::text[])) \
             ORDER BY o.{created_at}, o.{id} LIMIT {limit} FOR UPDATE SKIP LOCKED",
            cols = table.text_columns("o"),
            t = table.qualified,
            id = table.id,
            grace = poller.grace.as_secs_f64(),
            max_age = poller.max_age.as_secs_f64(),
            max_attempts = poller.max_attempts,
            limit = poller.batch_size,
        )
    }

    /// The age rules of a PENDING row of `o`: past the grace period and
    /// passed by the stream (`$2`), or created before a recreated slot
    /// (`$1`); `passed`, on a derived table's ranges: with an id visible in
    /// the passed sample's snapshot `$3` (its xmax bounds the index range).
    fn due_pending(&self, created_at: &str, passed: bool) -> String {
        let grace = self.config.poller.grace.as_secs_f64();
        let below = if passed {
            let x = derived::COLUMN;
            format!(
                " AND o.{x} < pg_snapshot_xmax($3::text::pg_snapshot) \
                  AND pg_visible_in_snapshot(o.{x}, $3::text::pg_snapshot)"
            )
        } else {
            String::new()
        };
        format!(
            "((o.{created_at} < now() - make_interval(secs => {grace}) \
               AND o.{created_at} < to_timestamp($2::float8) - make_interval(secs => {grace}){below}) \
              OR o.{created_at} <= $1::text::timestamptz)"
        )
    }

    /// The select list of a derived table's claims: the columns, attempts,
    /// too old (as [`Poller::claim_sql`]), then `created_at` in seconds (to
    /// put the round's rows in order) and the id as text.
    fn claim_columns(&self, table: &Table) -> String {
        let created_at = table.created_at.as_deref().unwrap_or("created_at");
        let max_age = self.config.poller.max_age.as_secs_f64();
        format!(
            "{cols}, o.attempts::int4, ({max_age} > 0 AND o.{created_at} < now() - make_interval(secs => {max_age})), \
             extract(epoch FROM o.{created_at})::float8, o.{id}::text",
            cols = table.text_columns("o"),
            id = table.id,
        )
    }

    /// A derived table's explicit work (`$1`, `$2` as [`Poller::claim_sql`]):
    /// FAILED rows due again and PENDING rows without an id, on
    /// `{table}_explicit_idx` (its predicate is the union of the two arms,
    /// so the planner can prove it), oldest first.
    fn claim_explicit_sql(&self, table: &Table, limit: usize) -> String {
        let created_at = table.created_at.as_deref().unwrap_or("created_at");
        format!(
            "SELECT {cols} FROM {t} AS o \
             WHERE ((o.publish_state = 'FAILED' AND o.attempts < {max_attempts} \
                    AND coalesce(o.next_attempt_at, '-infinity') <= now()) \
                OR (o.publish_state = 'PENDING' AND o.{txid} IS NULL AND {due})) \
               AND NOT (o.{id}::text = ANY($3::text[])) \
             ORDER BY o.{created_at}, o.{id} LIMIT {limit} FOR UPDATE SKIP LOCKED",
            cols = self.claim_columns(table),
            t = table.qualified,
            id = table.id,
            txid = derived::COLUMN,
            due = self.due_pending(created_at, false),
            max_attempts = self.config.poller.max_attempts,
        )
    }

    /// A derived table's claim in one `{table}_txid_idx` range (`range`, an
    /// index-friendly SQL boolean on `o`): PENDING rows not derived
    /// published, due by the age rules and passed (`$3`), not among the ids
    /// claimed already this round (`$4`), lowest id first.
    ///
    /// `vouched_since`: only when the pair the statement reads was stored at
    /// or after the passed sample's time (`$2`). For the ranges after the
    /// vouched snapshot while the slot streams: a row there that the stream
    /// passed was delivered (invariant 1) unless it lies in a hole, and the
    /// keeper vouches for it with its next pair; a pair stored after the
    /// sample that still leaves it unpublished is the sign it will not. So a
    /// poller does not race the keeper for what the stream delivered: after
    /// a stop, the new session's first pair vouches for what the last one
    /// delivered after its last pair before any of it is due. Not for ever:
    /// rows left waiting for a grace are taken ([`Poller::keeper_first`]).
    fn claim_range_sql(
        &self,
        table: &Table,
        reader: &Reader,
        range: &str,
        limit: usize,
        vouched_since: bool,
    ) -> String {
        let vouched = if vouched_since {
            format!(
                " AND {p}.snapshot_at >= to_timestamp($2::float8)",
                p = reader.p
            )
        } else {
            String::new()
        };
        format!(
            "SELECT {cols} FROM {t} AS o \
             WHERE {unpublished}{vouched} \
               AND NOT (o.{id} = ANY($4::text[]::{id_type}[])) \
             ORDER BY o.{txid} LIMIT {limit} FOR UPDATE SKIP LOCKED",
            cols = self.claim_columns(table),
            t = table.qualified,
            id = table.id,
            id_type = table.id_type,
            txid = derived::COLUMN,
            unpublished = self.due_unpublished(table, reader, range),
        )
    }

    /// SQL on `o`: a row of `range` (one of `{table}_txid_idx`'s), due by
    /// the age rules and passed (`$1`–`$3` as [`Poller::claim_range_sql`]),
    /// not derived published.
    fn due_unpublished(&self, table: &Table, reader: &Reader, range: &str) -> String {
        let created_at = table.created_at.as_deref().unwrap_or("created_at");
        format!(
            "{range} AND {due} AND NOT {published}",
            due = self.due_pending(created_at, true),
            published = derived::published("o", &reader.p),
        )
    }

    /// Whether rows after the vouched snapshot still wait for the keeper
    /// ([`Withheld`]); says so when they no longer do.
    fn keeper_first(&mut self, withheld: bool, now: std::time::Instant) -> bool {
        let Some((waited, first)) = self.withheld.look(withheld, self.config.poller.grace, now)
        else {
            return true;
        };
        if !first {
            return false;
        }
        tracing::warn!(
            waited_s = waited.as_secs(),
            "rows the stream passed wait for a pair that vouches for them, and none was stored for \
             poller.grace: the poller publishes them (at least once); is the position table \
             writable, and is the slot held by this relay's stream?"
        );
        false
    }

    /// SQL: a row of one range after the vouched snapshot (`range`), not in
    /// a hole (those are the poller's anyway), due but for a pair stored
    /// since the passed sample (`$1`–`$3` as [`Poller::claim_range_sql`]);
    /// read along `{table}_txid_idx`, so the first one found ends it.
    fn withheld_sql(&self, table: &Table, reader: &Reader, range: &str) -> String {
        format!(
            "SELECT 1 FROM {t} AS o \
             WHERE {unpublished} AND NOT {in_hole} \
               AND NOT coalesce({p}.snapshot_at >= to_timestamp($2::float8), false) \
             ORDER BY o.{txid} LIMIT 1",
            t = table.qualified,
            txid = derived::COLUMN,
            unpublished = self.due_unpublished(table, reader, range),
            in_hole = derived::in_hole("o", &reader.p),
            p = reader.p,
        )
    }

    /// Claim a derived table's due rows, at most a batch: explicit work,
    /// then the rows in each hole, then those of the transactions in
    /// progress at the vouched snapshot, then the rows after it (see the
    /// module's documentation); in `created_at` order.
    async fn claim_derived(
        &mut self,
        tx: &tokio_postgres::Transaction<'_>,
        table: &Table,
        reader: &Reader,
        sweep: &Option<String>,
        missed: &Missed,
    ) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
        let batch = self.config.poller.batch_size;
        let passed_over = self.passed_over();
        let mut rows = tx
            .query(
                &self.claim_explicit_sql(table, batch),
                &[sweep, &missed.before, &passed_over],
            )
            .await?;
        let ranges = reader.ranges(tx).await?;
        let holes = ranges.hole_arms("o").into_iter().map(|arm| (arm, false));
        // After the vouched snapshot: the keeper's first while the slot
        // streams under `derive` (under `mark` and `delete` no pair is
        // stored, and the stream marks what it publishes), for a grace.
        let mut keeper_first = missed.streaming
            && self.config.lifecycle.on_published == crate::config::OnPublished::Derive;
        let after_arms = ranges.after_arms("o");
        if keeper_first {
            let mut withheld = false;
            // One range at a time, in id order: the first row found ends it.
            for arm in &after_arms {
                withheld = tx
                    .query_opt(
                        &self.withheld_sql(table, reader, arm),
                        &[sweep, &missed.before, &missed.passed],
                    )
                    .await?
                    .is_some();
                if withheld {
                    break;
                }
            }
            keeper_first = self.keeper_first(withheld, std::time::Instant::now());
        } else {
            self.withheld = Withheld::default();
        }
        let after = after_arms.into_iter().map(|arm| (arm, keeper_first));
        // The table's columns come first ([`Table::text_columns`]).
        let width = table.columns.len();
        for (range, vouched_since) in holes.chain(after) {
            if rows.len() >= batch {
                break;
            }
            // A row in a hole may lie in another range too: claimed once.
            // And rows passed over for now ([`Poller::unrecordable`]).
            let claimed: Vec<String> = rows
                .iter()
                .map(|r| r.get(width + 3))
                .chain(passed_over.iter().cloned())
                .collect();
            let more = tx
                .query(
                    &self.claim_range_sql(table, reader, &range, batch - rows.len(), vouched_since),
                    &[sweep, &missed.before, &missed.passed, &claimed],
                )
                .await?;
            rows.extend(more);
        }
        rows.sort_by(|a, b| {
            let key = |r: &tokio_postgres::Row| r.get::<_, Option<f64>>(width + 2);
            key(a)
                .partial_cmp(&key(b))
                .unwrap_or(std::cmp::Ordering::Equal)
        });
        Ok(rows)
    }

    /// Publish the claimed messages in claim order, batches of one
    /// destination. At the first transient failure the rest is left for the
    /// next round (counted as deferred), unchanged and without an attempt.
    async fn publish(&self, claimed: &mut Claimed, round: &mut Round) {
        let (outgoing, meta): (Vec<Message>, Vec<(i32, bool)>) = claimed
            .messages
            .iter()
            .map(|(m, a, o)| (m.clone(), (*a, *o)))
            .unzip();
        let mut offset = 0;
        for batch in batches(&outgoing, self.sink.max_batch().max(1)) {
            let outcomes = self.sink.publish(batch).await;
            let mut transient = None;
            for ((message, (attempts, too_old)), outcome) in
                batch.iter().zip(&meta[offset..]).zip(outcomes)
            {
                let id = message.event.id().to_string();
                match outcome {
                    Outcome::Delivered => claimed.published.push(id),
                    Outcome::Rejected(reason) => {
                        claimed.failures.push((id, *attempts, *too_old, reason))
                    }
                    Outcome::Retryable(retry) => {
                        transient.get_or_insert(retry.reason);
                        round.deferred += 1;
                    }
                }
            }
            offset += batch.len();
            if let Some(reason) = transient {
                tracing::warn!(error = %reason, "the sink is failing; the poller leaves the rest for the next round");
                round.deferred += outgoing.len() - offset;
                break;
            }
        }
    }

    /// Record the outcomes in the round's transaction: delivered and skipped
    /// rows per `lifecycle.on_published`, failures FAILED (with their
    /// backoff) or DEAD; the DEAD rows' (id, attempts, reason), for their
    /// notices.
    async fn record(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        table: &Table,
        claimed: &Claimed,
        round: &mut Round,
    ) -> Result<(Vec<(String, i32, String)>, Vec<Refused>), tokio_postgres::Error> {
        let poller = &self.config.poller;
        let mode = self.config.lifecycle.on_published;
        let mut unrecorded = Vec::new();
        for (ids, sql) in [
            (&claimed.published, table.published_sql(mode)),
            (&claimed.skipped, table.skipped_sql(mode)),
        ] {
            if let (Some(sql), false) = (sql, ids.is_empty()) {
                let sql = format!("{sql} RETURNING {}::text", table.id);
                unrecorded.extend(record_each(tx, &sql, ids).await?.into_iter().map(
                    |(id, why)| Refused {
                        id,
                        why,
                        again_in: poller.backoff_max,
                    },
                ));
            }
        }
        let fail_sql = table.failure_sql(poller.max_attempts);
        let mut dead_notices = Vec::new();
        for (id, attempts, too_old, reason) in &claimed.failures {
            let dead = attempts + 1 >= poller.max_attempts || *too_old;
            let delay = self
                .backoff
                .delay(u32::try_from(*attempts).unwrap_or(0))
                .as_secs_f64();
            let reason = storable(reason);
            if let Some(refusal) = write_one(tx, &fail_sql, &[id, &reason, too_old, &delay]).await?
            {
                // Not sent: taken again once its backoff is over.
                unrecorded.push(Refused {
                    id: id.clone(),
                    why: refusal,
                    again_in: std::time::Duration::from_secs_f64(delay),
                });
                continue;
            }
            if dead {
                round.dead += 1;
                tracing::error!(id = %id, attempts = attempts + 1, error = %reason, "event is DEAD: it will not be retried; replay it once the cause is fixed");
                dead_notices.push((id.clone(), attempts + 1, reason.into_owned()));
            } else {
                round.failed += 1;
            }
        }
        Ok((dead_notices, unrecorded))
    }

    /// Publish a notice for each row that went DEAD to `poller.dead_letter_topic`.
    async fn notify_dead(&self, dead: &[(String, i32, String)], messages: &[(Message, i32, bool)]) {
        let topic = &self.config.poller.dead_letter_topic;
        if topic.is_empty() || dead.is_empty() {
            return;
        }
        let destination: Arc<str> = Arc::from(topic.as_str());
        let notices: Vec<Message> = dead
            .iter()
            .filter_map(|(id, attempts, reason)| {
                let (m, _, _) = messages.iter().find(|(m, _, _)| m.event.id() == id)?;
                let notice = serde_json::json!({
                    "id": id,
                    "attempts": attempts,
                    "error": reason,
                    "envelope": String::from_utf8_lossy(&m.body),
                });
                let mut event = m.event.clone();
                event.set_group("outbox-relay-dead-letters");
                // Not the event: the notice's ids (FIFO deduplication id,
                // webhook-id, claim-check key) must not name the event's.
                event.set_id(&format!("dead-{id}"));
                Some(Message {
                    ticket: Ticket::detached(),
                    event,
                    body: Bytes::from(notice.to_string()),
                    destination: Arc::clone(&destination),
                    commit_time: 0,
                })
            })
            .collect();
        for chunk in notices.chunks(self.sink.max_batch().max(1)) {
            for outcome in self.sink.publish(chunk).await {
                if outcome != Outcome::Delivered {
                    tracing::warn!(topic = %topic, outcome = ?outcome, "dead-letter notice not delivered");
                }
            }
        }
    }
}

const SAVEPOINT: &str = "SAVEPOINT outbox_relay_record";
const RELEASE: &str = "RELEASE SAVEPOINT outbox_relay_record";
const ROLLBACK_TO: &str = "ROLLBACK TO SAVEPOINT outbox_relay_record";

/// Why a row's write did nothing.
const SUPPRESSED: &str =
    "the update or delete changed no row (a BEFORE trigger on the table returned NULL)";

/// Run `sql` (one array parameter, `$1`; `RETURNING` the ids written, as
/// text) over `ids` under a savepoint; when the table refuses it
/// ([`marking::refused`]) or leaves a row unwritten (a trigger returned
/// NULL), row by row, each under its own: one row the table will not let
/// the relay update must not keep the others of its round from being
/// recorded, or the poller would publish them all again every round. The
/// rows refused, with why.
async fn record_each(
    tx: &tokio_postgres::Transaction<'_>,
    sql: &str,
    ids: &[String],
) -> Result<Vec<(String, String)>, tokio_postgres::Error> {
    tx.batch_execute(SAVEPOINT).await?;
    match tx.query(sql, &[&ids]).await {
        Ok(rows) => {
            let written: std::collections::HashSet<String> =
                rows.iter().map(|r| r.get::<_, String>(0)).collect();
            if ids.iter().all(|id| written.contains(id)) {
                tx.batch_execute(RELEASE).await?;
                return Ok(Vec::new());
            }
            tx.batch_execute(ROLLBACK_TO).await?;
        }
        Err(error) if marking::refused(&error) => tx.batch_execute(ROLLBACK_TO).await?,
        Err(error) => return Err(error),
    }
    tx.batch_execute(RELEASE).await?;
    let mut unrecorded = Vec::new();
    for id in ids {
        if let Some(why) = write_one(tx, sql, &[&std::slice::from_ref(id)]).await? {
            unrecorded.push((id.clone(), why));
        }
    }
    Ok(unrecorded)
}

/// Run `sql`, which writes one row, under a savepoint: `None` once written;
/// when the table refuses it ([`marking::refused`]) or a trigger suppresses
/// it (no row changed), rolled back to the savepoint and why. Another error
/// fails the round.
async fn write_one(
    tx: &tokio_postgres::Transaction<'_>,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Option<String>, tokio_postgres::Error> {
    tx.batch_execute(SAVEPOINT).await?;
    let refusal = match tx.execute(sql, params).await {
        Ok(n) if n > 0 => None,
        Ok(_) => Some(SUPPRESSED.to_owned()),
        Err(error) if marking::refused(&error) => Some(crate::report::Chain(&error).to_string()),
        Err(error) => return Err(error),
    };
    if refusal.is_some() {
        tx.batch_execute(ROLLBACK_TO).await?;
    }
    tx.batch_execute(RELEASE).await?;
    Ok(refusal)
}

#[cfg(test)]
mod tests {
    use super::Passed;

    #[test]
    fn rows_wait_for_the_keeper_for_a_grace_from_the_first_round_that_withheld_any() {
        let grace = std::time::Duration::from_secs(5);
        let t0 = std::time::Instant::now();
        let at = |s: u64| t0 + std::time::Duration::from_secs(s);
        let mut withheld = super::Withheld::default();
        assert_eq!(withheld.look(false, grace, at(0)), None);
        assert_eq!(withheld.look(true, grace, at(1)), None);
        assert_eq!(withheld.look(true, grace, at(5)), None);
        assert_eq!(withheld.look(true, grace, at(6)), Some((grace, true)));
        // Said once; taken every round after.
        assert_eq!(
            withheld.look(true, grace, at(7)),
            Some((grace + std::time::Duration::from_secs(1), false))
        );
        // A pair vouched for them: the next rows wait a grace again.
        assert_eq!(withheld.look(false, grace, at(8)), None);
        assert_eq!(withheld.look(true, grace, at(9)), None);
        assert_eq!(withheld.look(true, grace, at(13)), None);
        assert_eq!(withheld.look(true, grace, at(14)), Some((grace, true)));
    }

    #[test]
    fn the_slot_is_down_once_inactive_at_every_look_for_the_grace() {
        let grace = std::time::Duration::from_secs(5);
        let t0 = std::time::Instant::now();
        let at = |s: u64| t0 + std::time::Duration::from_secs(s);
        let mut down = super::Down::default();
        // A relay's first look, its stream not up yet: not down.
        assert!(!down.look(false, grace, at(0)));
        assert!(!down.look(false, grace, at(4)));
        assert!(down.look(false, grace, at(5)));
        // Active once: the clock starts over.
        assert!(!down.look(true, grace, at(6)));
        assert!(!down.look(false, grace, at(7)));
        assert!(!down.look(false, grace, at(11)));
        assert!(down.look(false, grace, at(12)));
    }

    #[test]
    fn the_newest_sample_the_slot_confirmed_is_the_cutoff() {
        let mut passed = Passed::default();
        let at = |t: f64, lsn: i64| (t, lsn, format!("{lsn}:{lsn}:"));
        // The slot has confirmed nothing we sampled: nothing is passed yet.
        assert_eq!(passed.update(at(10.0, 1000), Some(900)), None);
        assert_eq!(passed.update(at(11.0, 2000), Some(999)), None);
        // It reached the first sample, then went past the second: their
        // time and the snapshot they were taken under.
        assert_eq!(
            passed.update(at(12.0, 3000), Some(1000)),
            Some((10.0, "1000:1000:".into()))
        );
        assert_eq!(
            passed.update(at(13.0, 4000), Some(2500)),
            Some((11.0, "2000:2000:".into()))
        );
        // Caught up: the round's own sample.
        assert_eq!(
            passed.update(at(14.0, 5000), Some(5000)),
            Some((14.0, "5000:5000:".into()))
        );
        // No slot: nothing is passed.
        assert_eq!(passed.update(at(15.0, 6000), None), None);
    }

    #[test]
    fn samples_stay_bounded_and_keep_the_oldest_while_the_slot_lags() {
        let mut passed = Passed::default();
        for i in 0..(super::PASSED_SAMPLES as i64 * 3) {
            passed.update((i as f64, 1000 + i, i.to_string()), Some(999));
            assert!(passed.samples.len() <= super::PASSED_SAMPLES);
        }
        // The slot reaches the first sample's position: it still counts.
        assert_eq!(
            passed.update((5000.0, 9000, String::new()), Some(1000)),
            Some((0.0, "0".into()))
        );
    }
}
