//! Stalls: why nothing flows, in the server's own words.
//!
//! ```text
//!  the slot's server process ── pg_stat_activity.wait_event ──┐
//!    (walsender, or the backend creating the slot)            │
//!  pg_locks (its ungranted lock, waitstart) ─ pg_blocking_pids ┤  look ──► diagnose ──► [Stall]
//!  synchronized_standby_slots × pg_replication_slots ─────────┤             (pure)      cause, subject,
//!  pg_prepared_xacts ──────────────────────────────────────────┘                         message, fix
//! ```
//!
//! From its side of the connection the relay sees only that nothing arrives,
//! or that a position stays where it is: a walsender that waits sends
//! keepalives and answers them, so the stream looks healthy. The server knows
//! why, and says so on an ordinary SQL connection: [`look`] reads it and
//! [`diagnose`] names each [`Stall`] with a [`Cause`] (the
//! `outbox_relay_stall_seconds` metric's `cause` label), what is wrong and the
//! fix. Three commands read the same stalls:
//!
//! * `run`: the monitor looks every few seconds ([`crate::postgres::monitor`]); a
//!   [`Watch`] logs each stall once when it starts (again when its cause or
//!   subject changes) and once when it is over, fails `/readyz` with it and
//!   exports how long it has lasted;
//! * `status` prints the stalls one look finds ([`Stall::lasting`] ones: one
//!   look cannot tell a passing wait from a stall otherwise);
//! * `check` warns of them.
//!
//! # Causes
//!
//! * [`Cause::StandbySlot`]: from PostgreSQL 17 the walsender of a failover
//!   slot sends nothing a standby named in `synchronized_standby_slots` has
//!   not confirmed (wait event `WaitForStandbyConfirmation`). A slot named
//!   there that does not exist, is logical, is invalidated or has no standby
//!   streaming from it holds the relay forever; a promoted standby that kept
//!   its old primary's setting is the usual way to get there.
//! * [`Cause::OpenTransaction`]: the slot's process waits for a transaction
//!   to end (a lock on a transaction id): creating a logical slot waits for
//!   every transaction running at the time, however long it stays open.
//! * [`Cause::Lock`]: it waits for another lock (a catalog locked by a
//!   migration or `VACUUM FULL`).
//! * [`Cause::PreparedTransaction`]: a prepared transaction of the slot's
//!   database older than `stream.prepared_transaction_max_age`, or one the
//!   slot's process waits for. Nobody is connected to a prepared transaction,
//!   so nothing ends it but COMMIT PREPARED or ROLLBACK PREPARED. On a
//!   `two_phase` slot it holds the confirmed position (every restart sends
//!   again everything since); on any slot it holds the WAL the slot keeps and
//!   VACUUM's horizon.
//!
//! A wait the server gives a start time for (`pg_locks.waitstart`, a prepared
//! transaction's `prepared`) is a stall once it lasts [`STALL_AFTER`]; a
//! standby slot that cannot confirm is one at once. A walsender that waits for
//! standbys whose slots are fine is a stall only when `run` sees it on two
//! looks in a row ([`Stall::lasting`] is false).

use std::time::{Duration, Instant};

use crate::postgres::sql::quote_literal;

/// How long a wait lasts before it is a stall.
pub(crate) const STALL_AFTER: Duration = Duration::from_secs(10);

/// The wait event of a walsender that waits for `synchronized_standby_slots`.
pub(crate) const WAIT_FOR_STANDBY: &str = "WaitForStandbyConfirmation";

/// The metric's label vocabulary is the causes' names: it lives with the
/// metric, below this wing.
pub(crate) use crate::metrics::StallCause as Cause;

/// One stall: its cause, what it is about, and what to do.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Stall {
    /// The cause.
    pub cause: Cause,
    /// What it waits for: standby slot names, a backend's PID, a gid. With
    /// the cause, what tells one stall from another.
    pub subject: String,
    /// What is wrong.
    pub message: String,
    /// How to fix it.
    pub fix: String,
    /// How long it has lasted, where the server says (a lock's `waitstart`,
    /// a prepared transaction's age).
    pub seconds: Option<f64>,
    /// Whether one look is enough to call it a stall; otherwise `run` waits
    /// for a second look.
    pub lasting: bool,
}

impl Stall {
    /// The message and the fix, as the log, `/readyz`, `status` and `check` say it.
    pub(crate) fn describe(&self) -> String {
        format!("{}: {}", self.message, self.fix)
    }

    fn key(&self) -> (Cause, &str) {
        (self.cause, &self.subject)
    }
}

/// What the server said, read by [`look`].
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Look {
    /// The slot's name.
    pub slot: String,
    /// The slot exists and was created with `two_phase`, on a server whose
    /// pgoutput decodes at PREPARE (15+).
    pub two_phase: bool,
    /// The server process holding the slot, when one does.
    pub holder: Option<Holder>,
    /// The slots `synchronized_standby_slots` names, as the server has them;
    /// read only while the holder waits for them.
    pub standby_slots: Vec<StandbySlot>,
    /// Prepared transactions of the slot's database and the one the holder
    /// waits for, oldest first.
    pub prepared: Vec<PreparedXact>,
}

/// The server process holding the slot: its walsender, or the backend
/// creating it.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Holder {
    /// Its PID.
    pub pid: i32,
    /// `pg_stat_activity.backend_type` (`walsender`, `client backend`).
    pub kind: Option<String>,
    /// The slot has no confirmed position yet: it is being created.
    pub creating: bool,
    /// `wait_event_type`.
    pub wait_event_type: Option<String>,
    /// `wait_event`.
    pub wait_event: Option<String>,
    /// The lock it waits for, when it waits for one.
    pub lock: Option<LockWait>,
}

/// A lock the slot's process waits for.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct LockWait {
    /// Seconds since `pg_locks.waitstart`.
    pub waited: Option<f64>,
    /// `locktype`: `transactionid`, `virtualxid`, `relation`, …
    pub locktype: String,
    /// `mode`.
    pub mode: String,
    /// The relation, when it is a relation's lock.
    pub relation: Option<String>,
    /// The transaction id waited for, for a `transactionid` lock.
    pub xid: Option<String>,
    /// The backends holding it (`pg_blocking_pids`), 0 for a prepared transaction.
    pub blockers: Vec<Backend>,
}

/// A backend, as far as `pg_stat_activity` shows it to the relay's role
/// (without `pg_read_all_stats` the state and ages of another role's
/// backends are hidden: `None`).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Backend {
    /// Its PID; 0: a prepared transaction.
    pub pid: i32,
    /// `datname`.
    pub database: Option<String>,
    /// `usename`.
    pub user: Option<String>,
    /// `application_name`.
    pub application: Option<String>,
    /// `state`, e.g. `idle in transaction`.
    pub state: Option<String>,
    /// Seconds since `xact_start`.
    pub transaction_age: Option<f64>,
}

/// A slot `synchronized_standby_slots` names.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct StandbySlot {
    /// Its name.
    pub name: String,
    /// `slot_type` (`physical`, `logical`); `None`: no such slot.
    pub kind: Option<String>,
    /// A standby streams from it.
    pub active: bool,
    /// `wal_status`.
    pub wal_status: Option<String>,
    /// Bytes its `restart_lsn` trails the server's WAL.
    pub behind: Option<i64>,
}

impl StandbySlot {
    /// Why it can never confirm, if that is so.
    fn dead_end(&self) -> Option<&'static str> {
        match self.kind.as_deref() {
            None => Some("does not exist"),
            Some(kind) if kind != "physical" => Some("is not a physical slot"),
            Some(_) if self.wal_status.as_deref() == Some("lost") => Some("is invalidated"),
            Some(_) if !self.active => Some("has no standby streaming from it"),
            Some(_) => None,
        }
    }
}

/// A prepared transaction.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct PreparedXact {
    /// `gid`.
    pub gid: String,
    /// `database`.
    pub database: String,
    /// `owner`.
    pub owner: String,
    /// Seconds since it was prepared.
    pub age: f64,
    /// `transaction`, as text.
    pub xid: String,
    /// It belongs to the slot's database.
    pub here: bool,
}

/// The stalls `look` shows: what the slot's process waits for first, then a
/// prepared transaction older than `max_prepared_age` (0: not looked at).
pub(crate) fn diagnose(look: &Look, max_prepared_age: Duration) -> Vec<Stall> {
    let mut stalls = Vec::new();
    if let Some(holder) = &look.holder {
        stalls.extend(waiting(look, holder));
    }
    if !max_prepared_age.is_zero() {
        let over = look
            .prepared
            .iter()
            .filter(|p| p.here && p.age >= max_prepared_age.as_secs_f64());
        let mut over = over.peekable();
        if let Some(oldest) = over.next() {
            let more = over.count();
            if !stalls.iter().any(|s| s.subject == oldest.gid) {
                stalls.push(too_old(look, oldest, more, max_prepared_age));
            }
        }
    }
    stalls
}

/// What the slot's process waits for, if that stalls it.
fn waiting(look: &Look, holder: &Holder) -> Option<Stall> {
    let slot = &look.slot;
    let who = match holder.kind.as_deref() {
        _ if holder.creating => format!("the backend creating slot {slot:?} (PID {})", holder.pid),
        Some("walsender") | None => format!("the walsender of slot {slot:?} (PID {})", holder.pid),
        Some(kind) => format!("the {kind} holding slot {slot:?} (PID {})", holder.pid),
    };
    if holder.wait_event.as_deref() == Some(WAIT_FOR_STANDBY) {
        return Some(standby(look, &who));
    }
    if holder.wait_event_type.as_deref() != Some("Lock") {
        return None;
    }
    let lock = holder.lock.as_ref()?;
    let waited = lock.waited?;
    if waited < STALL_AFTER.as_secs_f64() {
        return None;
    }
    let what = match (&lock.relation, lock.locktype.as_str()) {
        (Some(relation), _) => format!("a {} lock on {relation}", lock.mode),
        (None, "transactionid" | "virtualxid") => "a transaction to end".to_owned(),
        (None, locktype) => format!("a {} lock ({locktype})", lock.mode),
    };
    if lock.blockers.iter().any(|b| b.pid == 0) {
        return Some(held_by_prepared(look, lock, &who, &what, waited));
    }
    let holders: Vec<String> = lock.blockers.iter().map(backend).collect();
    let pids: Vec<String> = lock.blockers.iter().map(|b| b.pid.to_string()).collect();
    let held_by = if holders.is_empty() {
        String::new()
    } else {
        format!(", held by {}", holders.join("; "))
    };
    let end = if pids.is_empty() {
        "end the transaction holding it (SELECT pid, state, xact_start FROM pg_stat_activity \
         WHERE pid = ANY(pg_blocking_pids(<PID>)))"
            .to_owned()
    } else {
        format!(
            "end that transaction: COMMIT or ROLLBACK in its session, or SELECT pg_terminate_backend({})",
            pids.join("), pg_terminate_backend(")
        )
    };
    let transaction = matches!(lock.locktype.as_str(), "transactionid" | "virtualxid");
    Some(Stall {
        cause: if transaction {
            Cause::OpenTransaction
        } else {
            Cause::Lock
        },
        subject: pids.join(","),
        message: if holder.creating && transaction {
            format!(
                "{who} has waited {} for {what}{held_by}; creating a logical slot waits for \
                 every transaction open when it starts",
                age(waited)
            )
        } else {
            format!("{who} has waited {} for {what}{held_by}", age(waited))
        },
        fix: end,
        seconds: Some(waited),
        lasting: true,
    })
}

/// `who` has waited `waited` seconds for `what`, a lock a prepared
/// transaction holds (its holder has no PID).
fn held_by_prepared(look: &Look, lock: &LockWait, who: &str, what: &str, waited: f64) -> Stall {
    // The one whose id is waited for, else the oldest one there is.
    let prepared = look
        .prepared
        .iter()
        .find(|p| Some(&p.xid) == lock.xid.as_ref())
        .or_else(|| look.prepared.first());
    let (gid, about, fix) = match prepared {
        Some(p) => (
            p.gid.clone(),
            format!(
                "prepared transaction {} (database {:?}, owner {:?}, prepared {} ago)",
                quote_literal(&p.gid),
                p.database,
                p.owner,
                age(p.age)
            ),
            finish_prepared(p),
        ),
        None => (
            String::new(),
            "a prepared transaction".to_owned(),
            "COMMIT PREPARED or ROLLBACK PREPARED it (SELECT gid, database FROM pg_prepared_xacts)"
                .to_owned(),
        ),
    };
    Stall {
        cause: Cause::PreparedTransaction,
        subject: gid,
        message: format!(
            "{who} has waited {} for {what}, held by {about}; nobody is connected to a \
             prepared transaction, so it never ends by itself",
            age(waited)
        ),
        fix,
        seconds: Some(waited),
        lasting: true,
    }
}

/// The walsender waits for `synchronized_standby_slots`.
fn standby(look: &Look, who: &str) -> Stall {
    let dead: Vec<(&StandbySlot, &str)> = look
        .standby_slots
        .iter()
        .filter_map(|s| Some((s, s.dead_end()?)))
        .collect();
    let names = |slots: &mut dyn Iterator<Item = &StandbySlot>| -> String {
        slots
            .map(|s| s.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let change = "or take it out of synchronized_standby_slots: ALTER SYSTEM SET \
         synchronized_standby_slots = '<this server's standbys' physical slots>' (or ALTER SYSTEM \
         RESET synchronized_standby_slots), then SELECT pg_reload_conf(); a promoted standby \
         keeps its old primary's setting (docs/recovery.md)";
    if dead.is_empty() {
        let behind = look
            .standby_slots
            .iter()
            .map(|s| match s.behind {
                Some(bytes) => format!("{} ({bytes} bytes behind)", s.name),
                None => s.name.clone(),
            })
            .collect::<Vec<_>>()
            .join(", ");
        return Stall {
            cause: Cause::StandbySlot,
            subject: names(&mut look.standby_slots.iter()),
            message: format!(
                "{who} waits for standby slots {behind} of synchronized_standby_slots to confirm \
                 the WAL before it sends it ({WAIT_FOR_STANDBY})"
            ),
            fix: format!(
                "look at why the standby lags (pg_stat_replication on this server), {change}"
            ),
            seconds: None,
            lasting: false,
        };
    }
    let said = dead
        .iter()
        .map(|(s, why)| format!("{} {why}", s.name))
        .collect::<Vec<_>>()
        .join(", ");
    let fix = if dead.iter().all(|(s, _)| s.kind.is_none()) {
        format!("create the standby's physical slot, {change}")
    } else {
        format!("start the standby (or make a new one from a base backup), {change}")
    };
    Stall {
        cause: Cause::StandbySlot,
        subject: names(&mut dead.iter().map(|(s, _)| *s)),
        message: format!(
            "{who} waits for synchronized_standby_slots ({WAIT_FOR_STANDBY}): standby slot \
             {said}, so it never confirms, and the relay receives nothing"
        ),
        fix,
        seconds: None,
        lasting: true,
    }
}

/// A prepared transaction older than `stream.prepared_transaction_max_age`.
fn too_old(look: &Look, p: &PreparedXact, more: usize, max: Duration) -> Stall {
    let more = match more {
        0 => String::new(),
        1 => " (and 1 more)".to_owned(),
        n => format!(" (and {n} more)"),
    };
    let holds = if look.two_phase {
        format!(
            "slot {:?} is two_phase, so its confirmed position stays before it: every restart of \
             the relay sends again everything since, and the slot keeps the WAL since",
            look.slot
        )
    } else {
        format!(
            "slot {:?} keeps the WAL since it (restart_lsn), and VACUUM keeps the rows it could remove",
            look.slot
        )
    };
    Stall {
        cause: Cause::PreparedTransaction,
        subject: p.gid.clone(),
        message: format!(
            "prepared transaction {} (database {:?}, owner {:?}) was prepared {} ago, over \
             stream.prepared_transaction_max_age ({}){more}: {holds}",
            quote_literal(&p.gid),
            p.database,
            p.owner,
            age(p.age),
            age(max.as_secs_f64())
        ),
        fix: finish_prepared(p),
        seconds: Some(p.age),
        lasting: true,
    }
}

fn finish_prepared(p: &PreparedXact) -> String {
    let gid = quote_literal(&p.gid);
    format!(
        "finish it: COMMIT PREPARED {gid} or ROLLBACK PREPARED {gid}, in database {:?} as {:?} or a superuser",
        p.database, p.owner
    )
}

/// A backend as the messages name it.
fn backend(b: &Backend) -> String {
    let mut parts = vec![format!("PID {}", b.pid)];
    if let Some(database) = &b.database {
        parts.push(format!("database {database:?}"));
    }
    if let Some(user) = &b.user {
        parts.push(format!("user {user:?}"));
    }
    if let Some(application) = b.application.as_deref().filter(|a| !a.is_empty()) {
        parts.push(format!("application {application:?}"));
    }
    if let Some(state) = &b.state {
        parts.push(state.clone());
    }
    if let Some(open) = b.transaction_age {
        parts.push(format!("its transaction open for {}", age(open)));
    }
    parts.join(", ")
}

/// `42 s`, `7 min`, `3.5 h`.
pub(crate) fn age(seconds: f64) -> String {
    let seconds = seconds.max(0.0);
    if seconds < 120.0 {
        format!("{seconds:.0} s")
    } else if seconds < 7200.0 {
        format!("{:.0} min", seconds / 60.0)
    } else {
        format!("{:.1} h", seconds / 3600.0)
    }
}

/// Ask the server about slot `slot` (see the module docs).
pub(crate) async fn look(
    client: &tokio_postgres::Client,
    slot: &str,
) -> Result<Look, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "SELECT s.active_pid, \
               coalesce((to_jsonb(s) ->> 'two_phase')::bool, false) \
                 AND current_setting('server_version_num')::int >= 150000, \
               a.backend_type, a.wait_event_type, a.wait_event, \
               extract(epoch FROM now() - l.waitstart)::float8, l.locktype, l.mode, \
               CASE WHEN l.relation IS NOT NULL THEN l.relation::regclass::text END, \
               l.transactionid::text, \
               CASE WHEN s.active_pid IS NOT NULL THEN pg_blocking_pids(s.active_pid) END, \
               s.confirmed_flush_lsn IS NULL \
             FROM pg_replication_slots s \
             LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid \
             LEFT JOIN LATERAL (SELECT * FROM pg_locks l \
               WHERE l.pid = s.active_pid AND NOT l.granted LIMIT 1) l ON true \
             WHERE s.slot_name = $1",
            &[&slot],
        )
        .await?;
    let mut look = Look {
        slot: slot.to_owned(),
        ..Look::default()
    };
    let mut waited_xid = None;
    if let Some(row) = row {
        look.two_phase = row.get(1);
        if let Some(pid) = row.get::<_, Option<i32>>(0) {
            let locktype: Option<String> = row.get(6);
            let blocking: Vec<i32> = row.get::<_, Option<Vec<i32>>>(10).unwrap_or_default();
            let lock = match locktype {
                Some(locktype) => {
                    waited_xid = row.get::<_, Option<String>>(9);
                    Some(LockWait {
                        waited: row.get(5),
                        locktype,
                        mode: row.get::<_, Option<String>>(7).unwrap_or_default(),
                        relation: row.get(8),
                        xid: waited_xid.clone(),
                        blockers: backends(client, &blocking).await?,
                    })
                }
                None => None,
            };
            look.holder = Some(Holder {
                pid,
                kind: row.get(2),
                creating: row.get(11),
                wait_event_type: row.get(3),
                wait_event: row.get(4),
                lock,
            });
        }
    }
    look.prepared = client
        .query(
            "SELECT gid, database::text, owner::text, \
               extract(epoch FROM now() - prepared)::float8, transaction::text, \
               database = current_database() \
             FROM pg_prepared_xacts \
             WHERE database = current_database() OR transaction::text = $1 \
             ORDER BY prepared",
            &[&waited_xid],
        )
        .await?
        .iter()
        .map(|r| PreparedXact {
            gid: r.get(0),
            database: r.get(1),
            owner: r.get(2),
            age: r.get(3),
            xid: r.get(4),
            here: r.get(5),
        })
        .collect();
    let for_standby = look
        .holder
        .as_ref()
        .is_some_and(|h| h.wait_event.as_deref() == Some(WAIT_FOR_STANDBY));
    if for_standby {
        look.standby_slots = standby_slots(client).await?;
    }
    Ok(look)
}

/// The backends with these PIDs (0, a prepared transaction, as it is).
async fn backends(
    client: &tokio_postgres::Client,
    pids: &[i32],
) -> Result<Vec<Backend>, tokio_postgres::Error> {
    if pids.is_empty() {
        return Ok(Vec::new());
    }
    let rows = client
        .query(
            "SELECT p.pid, a.datname::text, a.usename::text, a.application_name, a.state, \
               extract(epoch FROM now() - a.xact_start)::float8 \
             FROM unnest($1::int[]) WITH ORDINALITY AS p(pid, n) \
             LEFT JOIN pg_stat_activity a ON a.pid = p.pid ORDER BY p.n",
            &[&pids],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| Backend {
            pid: r.get(0),
            database: r.get(1),
            user: r.get(2),
            application: r.get(3),
            state: r.get(4),
            transaction_age: r.get(5),
        })
        .collect())
}

/// The slots `synchronized_standby_slots` names (none before PostgreSQL 17).
async fn standby_slots(
    client: &tokio_postgres::Client,
) -> Result<Vec<StandbySlot>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT n.name, p.slot_type, coalesce(p.active, false), p.wal_status, \
               (pg_current_wal_lsn() - p.restart_lsn)::bigint \
             FROM unnest(string_to_array(coalesce(current_setting('synchronized_standby_slots', true), ''), ',')) \
               WITH ORDINALITY AS u(raw, i) \
             CROSS JOIN LATERAL (SELECT trim(u.raw) AS name) n \
             LEFT JOIN pg_replication_slots p ON p.slot_name = n.name \
             WHERE n.name NOT IN ('', '*') ORDER BY u.i",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| StandbySlot {
            name: r.get(0),
            kind: r.get(1),
            active: r.get(2),
            wal_status: r.get(3),
            behind: r.get(4),
        })
        .collect())
}

/// `run`'s memory of the stalls across looks: which are on, since when.
#[derive(Debug, Default)]
pub(crate) struct Watch {
    on: Vec<On>,
    /// What the last look found that one look does not make a stall.
    passing: Vec<(Cause, String)>,
}

#[derive(Debug)]
struct On {
    stall: Stall,
    since: Instant,
    /// Looks in a row that did not find it.
    misses: u32,
}

/// What changed with a look ([`Watch::observe`]).
#[derive(Debug, Default)]
pub(crate) struct Changes {
    /// Stalls that started (or whose cause or subject changed): log them.
    pub started: Vec<Stall>,
    /// Stalls that are over.
    pub over: Vec<Stall>,
}

/// Looks in a row without a stall before it is over: one look may fall
/// between two waits of the walsender.
const MISSES_TO_END: u32 = 2;

impl Watch {
    /// Take in what a look at `now` found ([`diagnose`]).
    pub(crate) fn observe(&mut self, found: Vec<Stall>, now: Instant) -> Changes {
        let mut changes = Changes::default();
        let passing: Vec<(Cause, String)> = found
            .iter()
            .filter(|s| !s.lasting)
            .map(|s| (s.cause, s.subject.clone()))
            .collect();
        for on in &mut self.on {
            on.misses += 1;
        }
        for stall in found {
            let key = (stall.cause, stall.subject.clone());
            match self.on.iter_mut().find(|on| on.stall.key() == stall.key()) {
                Some(on) => {
                    on.misses = 0;
                    on.stall = stall;
                }
                None if stall.lasting || self.passing.contains(&key) => {
                    changes.started.push(stall.clone());
                    self.on.push(On {
                        stall,
                        since: now,
                        misses: 0,
                    });
                }
                None => {}
            }
        }
        self.passing = passing;
        let (over, on): (Vec<On>, Vec<On>) = std::mem::take(&mut self.on)
            .into_iter()
            .partition(|on| on.misses >= MISSES_TO_END);
        self.on = on;
        changes.over = over.into_iter().map(|on| on.stall).collect();
        self.on.sort_by_key(|on| on.stall.cause);
        changes
    }

    /// The stalls on now, first cause first.
    pub(crate) fn stalls(&self) -> impl Iterator<Item = &Stall> {
        self.on.iter().map(|on| &on.stall)
    }

    /// How long the longest stall of `cause` has lasted at `now` (0: none):
    /// the server's figure where it has one, else since the first look that
    /// found it.
    pub(crate) fn seconds(&self, cause: Cause, now: Instant) -> f64 {
        self.on
            .iter()
            .filter(|on| on.stall.cause == cause)
            .map(|on| {
                on.stall
                    .seconds
                    .unwrap_or_else(|| now.duration_since(on.since).as_secs_f64())
            })
            .fold(0.0, f64::max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn walsender(event_type: &str, event: &str, lock: Option<LockWait>) -> Holder {
        Holder {
            pid: 4242,
            kind: Some("walsender".into()),
            creating: false,
            wait_event_type: Some(event_type.into()),
            wait_event: Some(event.into()),
            lock,
        }
    }

    fn look(holder: Option<Holder>) -> Look {
        Look {
            slot: "outbox_relay".into(),
            two_phase: false,
            holder,
            standby_slots: Vec::new(),
            prepared: Vec::new(),
        }
    }

    fn standby_slot(
        name: &str,
        kind: Option<&str>,
        active: bool,
        wal: Option<&str>,
    ) -> StandbySlot {
        StandbySlot {
            name: name.into(),
            kind: kind.map(str::to_owned),
            active,
            wal_status: wal.map(str::to_owned),
            behind: Some(1024),
        }
    }

    fn prepared(gid: &str, age: f64, here: bool) -> PreparedXact {
        PreparedXact {
            gid: gid.into(),
            database: if here { "app" } else { "other" }.into(),
            owner: "app_user".into(),
            age,
            xid: format!("7{}", gid.len()),
            here,
        }
    }

    const FIVE_MIN: Duration = Duration::from_secs(300);

    #[test]
    fn a_walsender_waiting_for_a_missing_standby_slot_names_the_slot_and_the_setting() {
        let mut l = look(Some(walsender("Client", WAIT_FOR_STANDBY, None)));
        l.standby_slots = vec![standby_slot("standby1", None, false, None)];
        let stalls = diagnose(&l, FIVE_MIN);
        assert_eq!(stalls.len(), 1);
        let s = &stalls[0];
        assert_eq!(
            (s.cause, s.subject.as_str(), s.lasting),
            (Cause::StandbySlot, "standby1", true)
        );
        assert_eq!(s.cause.label(), "standby_slot");
        let text = s.describe();
        for says in [
            "standby slot standby1 does not exist",
            "WaitForStandbyConfirmation",
            "PID 4242",
            "\"outbox_relay\"",
            "create the standby's physical slot",
            "ALTER SYSTEM RESET synchronized_standby_slots",
            "pg_reload_conf()",
        ] {
            assert!(text.contains(says), "{says:?} in {text}");
        }
    }

    #[test]
    fn each_standby_slot_that_cannot_confirm_says_why_and_a_lagging_one_needs_a_second_look() {
        for (slot, says, fix) in [
            (
                standby_slot("s1", Some("logical"), true, Some("reserved")),
                "s1 is not a physical slot",
                "start the standby",
            ),
            (
                standby_slot("s1", Some("physical"), false, Some("lost")),
                "s1 is invalidated",
                "base backup",
            ),
            (
                standby_slot("s1", Some("physical"), false, None),
                "s1 has no standby streaming from it",
                "start the standby",
            ),
        ] {
            let mut l = look(Some(walsender("Client", WAIT_FOR_STANDBY, None)));
            l.standby_slots = vec![
                standby_slot("ok", Some("physical"), true, Some("reserved")),
                slot,
            ];
            let s = &diagnose(&l, FIVE_MIN)[0];
            assert!(s.lasting && s.subject == "s1", "{s:?}");
            assert!(
                s.message.contains(says) && s.fix.contains(fix),
                "{}",
                s.describe()
            );
        }
        let mut l = look(Some(walsender("Client", WAIT_FOR_STANDBY, None)));
        l.standby_slots = vec![standby_slot("s1", Some("physical"), true, Some("reserved"))];
        let s = &diagnose(&l, FIVE_MIN)[0];
        assert!(!s.lasting, "{s:?}");
        assert!(
            s.message.contains("s1 (1024 bytes behind)"),
            "{}",
            s.message
        );
    }

    #[test]
    fn a_walsender_that_waits_for_wal_or_works_is_no_stall() {
        for (event_type, event) in [
            ("Activity", "WalSenderMain"),
            ("IPC", "WalSenderWaitForWal"),
            ("Client", "WalSenderWaitForWal"),
            ("IO", "WalRead"),
        ] {
            let l = look(Some(walsender(event_type, event, None)));
            assert!(diagnose(&l, FIVE_MIN).is_empty(), "{event}");
        }
        assert!(diagnose(&look(None), FIVE_MIN).is_empty());
    }

    fn lock(
        waited: f64,
        locktype: &str,
        relation: Option<&str>,
        blockers: Vec<Backend>,
    ) -> LockWait {
        LockWait {
            waited: Some(waited),
            locktype: locktype.into(),
            mode: "ShareLock".into(),
            relation: relation.map(str::to_owned),
            xid: Some("75".into()),
            blockers,
        }
    }

    fn idle_in_transaction(pid: i32) -> Backend {
        Backend {
            pid,
            database: Some("app".into()),
            user: Some("app_user".into()),
            application: Some("billing".into()),
            state: Some("idle in transaction".into()),
            transaction_age: Some(600.0),
        }
    }

    #[test]
    fn a_slot_waiting_for_an_open_transaction_names_its_backend_and_how_to_end_it() {
        let mut creating = walsender(
            "Lock",
            "transactionid",
            Some(lock(
                25.0,
                "transactionid",
                None,
                vec![idle_in_transaction(77)],
            )),
        );
        creating.kind = Some("client backend".into());
        creating.creating = true;
        let stalls = diagnose(&look(Some(creating)), FIVE_MIN);
        let s = &stalls[0];
        assert_eq!(
            (s.cause, s.subject.as_str()),
            (Cause::OpenTransaction, "77")
        );
        assert_eq!(s.seconds, Some(25.0));
        let text = s.describe();
        for says in [
            "the backend creating slot \"outbox_relay\" (PID 4242)",
            "has waited 25 s for a transaction to end",
            "PID 77, database \"app\", user \"app_user\", application \"billing\", idle in transaction, its transaction open for 10 min",
            "pg_terminate_backend(77)",
        ] {
            assert!(text.contains(says), "{says:?} in {text}");
        }
        // Without pg_read_all_stats the relay sees less of another role's
        // backend; it still names it.
        let hidden = Backend {
            pid: 77,
            ..Backend::default()
        };
        let l = look(Some(walsender(
            "Lock",
            "transactionid",
            Some(lock(25.0, "transactionid", None, vec![hidden])),
        )));
        assert!(diagnose(&l, FIVE_MIN)[0].message.contains("held by PID 77"));
    }

    #[test]
    fn a_short_lock_wait_is_no_stall_and_a_long_one_on_a_relation_is_a_lock() {
        let short = look(Some(walsender(
            "Lock",
            "relation",
            Some(lock(
                3.0,
                "relation",
                Some("pg_class"),
                vec![idle_in_transaction(9)],
            )),
        )));
        assert!(diagnose(&short, FIVE_MIN).is_empty());
        let long = look(Some(walsender(
            "Lock",
            "relation",
            Some(lock(
                30.0,
                "relation",
                Some("pg_class"),
                vec![idle_in_transaction(9)],
            )),
        )));
        let s = &diagnose(&long, FIVE_MIN)[0];
        assert_eq!((s.cause, s.cause.label()), (Cause::Lock, "lock"));
        assert!(
            s.message.contains("a ShareLock lock on pg_class"),
            "{}",
            s.message
        );
        assert!(s.fix.contains("pg_terminate_backend(9)"), "{}", s.fix);
    }

    #[test]
    fn a_lock_held_by_a_prepared_transaction_names_its_gid() {
        let prepared_blocker = Backend {
            pid: 0,
            ..Backend::default()
        };
        let mut l = look(Some(walsender(
            "Lock",
            "transactionid",
            Some(lock(40.0, "transactionid", None, vec![prepared_blocker])),
        )));
        let mut theirs = prepared("elsewhere", 50.0, false);
        theirs.xid = "75".into();
        l.prepared = vec![prepared("older-but-not-it", 500.0, true), theirs];
        let stalls = diagnose(&l, FIVE_MIN);
        assert_eq!(stalls[0].cause, Cause::PreparedTransaction);
        assert_eq!(stalls[0].subject, "elsewhere");
        assert!(
            stalls[0]
                .fix
                .contains("ROLLBACK PREPARED 'elsewhere', in database \"other\""),
            "{}",
            stalls[0].fix
        );
        // The old one of this database is a stall of its own.
        assert_eq!(stalls[1].subject, "older-but-not-it");
        assert_eq!(stalls.len(), 2);
    }

    #[test]
    fn a_prepared_transaction_is_a_stall_once_older_than_the_configured_age() {
        let mut l = look(Some(walsender("Activity", "WalSenderMain", None)));
        l.prepared = vec![
            prepared("young", 10.0, true),
            prepared("other-db", 9000.0, false),
        ];
        assert!(diagnose(&l, FIVE_MIN).is_empty());
        l.prepared.insert(0, prepared("it's old", 400.0, true));
        l.prepared.insert(1, prepared("old too", 350.0, true));
        let stalls = diagnose(&l, FIVE_MIN);
        assert_eq!(stalls.len(), 1);
        let s = &stalls[0];
        assert_eq!(
            (s.cause, s.subject.as_str()),
            (Cause::PreparedTransaction, "it's old")
        );
        assert_eq!(s.seconds, Some(400.0));
        assert!(
            s.message.contains("'it''s old'") && s.message.contains("(and 1 more)"),
            "{}",
            s.message
        );
        assert!(
            s.message.contains("prepared 7 min ago") && s.message.contains("(5 min)"),
            "{}",
            s.message
        );
        assert!(s.message.contains("restart_lsn"), "{}", s.message);
        assert!(
            s.fix
                .contains("COMMIT PREPARED 'it''s old' or ROLLBACK PREPARED 'it''s old'"),
            "{}",
            s.fix
        );
        l.two_phase = true;
        let s = &diagnose(&l, FIVE_MIN)[0];
        assert!(
            s.message.contains("confirmed position stays before it"),
            "{}",
            s.message
        );
        // 0 switches the age check off.
        assert!(diagnose(&l, Duration::ZERO).is_empty());
    }

    #[test]
    fn the_watch_logs_a_stall_once_keeps_it_across_one_quiet_look_and_ends_it_after_two() {
        let mut l = look(Some(walsender("Client", WAIT_FOR_STANDBY, None)));
        l.standby_slots = vec![standby_slot("standby1", None, false, None)];
        let found = |l: &Look| diagnose(l, FIVE_MIN);
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut watch = Watch::default();
        let c = watch.observe(found(&l), at(0));
        assert_eq!(c.started.len(), 1);
        assert!(watch.observe(found(&l), at(5)).started.is_empty());
        assert_eq!(watch.seconds(Cause::StandbySlot, at(12)), 12.0);
        assert_eq!(watch.seconds(Cause::Lock, at(12)), 0.0);
        // One look between two waits does not end it.
        let c = watch.observe(Vec::new(), at(10));
        assert!(c.over.is_empty() && watch.stalls().count() == 1);
        assert!(watch.observe(found(&l), at(15)).started.is_empty());
        watch.observe(Vec::new(), at(20));
        let c = watch.observe(Vec::new(), at(25));
        assert_eq!(c.over.len(), 1);
        assert_eq!(watch.stalls().count(), 0);
        // Another slot named: the cause changed, said again.
        l.standby_slots = vec![standby_slot("standby2", None, false, None)];
        assert_eq!(
            watch.observe(found(&l), at(30)).started[0].subject,
            "standby2"
        );
    }

    #[test]
    fn the_watch_takes_a_passing_wait_for_a_stall_on_the_second_look() {
        let mut l = look(Some(walsender("Client", WAIT_FOR_STANDBY, None)));
        l.standby_slots = vec![standby_slot("s1", Some("physical"), true, Some("reserved"))];
        let t0 = Instant::now();
        let mut watch = Watch::default();
        assert!(watch.observe(diagnose(&l, FIVE_MIN), t0).started.is_empty());
        assert_eq!(watch.stalls().count(), 0);
        let c = watch.observe(diagnose(&l, FIVE_MIN), t0 + Duration::from_secs(5));
        assert_eq!(c.started.len(), 1);
        // A prepared transaction's stall lasts as long as it is old.
        let mut l = look(None);
        l.prepared = vec![prepared("g", 301.0, true)];
        let mut watch = Watch::default();
        watch.observe(diagnose(&l, FIVE_MIN), t0);
        assert_eq!(watch.seconds(Cause::PreparedTransaction, t0), 301.0);
    }

    #[test]
    fn ages_read_as_people_say_them() {
        assert_eq!(age(0.4), "0 s");
        assert_eq!(age(59.6), "60 s");
        assert_eq!(age(119.0), "119 s");
        assert_eq!(age(600.0), "10 min");
        assert_eq!(age(9000.0), "2.5 h");
        assert_eq!(age(-3.0), "0 s");
    }

    #[test]
    fn every_cause_has_its_own_label() {
        let labels: std::collections::BTreeSet<_> = Cause::ALL.iter().map(|c| c.label()).collect();
        assert_eq!(labels.len(), Cause::ALL.len());
    }
}
