//! The relay's own record of the position it confirmed, so a restart of
//! PostgreSQL does not send published events again.
//!
//! PostgreSQL keeps a slot's `confirmed_flush_lsn` in memory and writes it
//! to disk only at a checkpoint (before 17, only when another field of the
//! slot moved too). After a crash, an immediate or (before 17) a fast
//! shutdown, the slot comes back at an older position and the walsender
//! sends again everything after it: every event the relay had published
//! since. PostgreSQL's own subscribers keep their position on their side
//! (replication origins) and ask for it at START_REPLICATION; so does the
//! relay, in a table (`<table>_position`, created by `setup`: one row per
//! slot), which needs no privilege beyond the table's.
//!
//! # Invariants
//!
//! * **It never skips.** The row holds a position the relay had confirmed to
//!   the server: every event before it was published or recorded. A session
//!   starts from the later of it and the slot's `confirmed_flush_lsn`, and
//!   the walsender skips what committed before the start
//!   ([`choose`] decides, table-tested).
//! * **When its provenance is in doubt, the slot wins**: a row written by
//!   another system (a different `system_identifier`: a restored or cloned
//!   cluster), on another timeline (a promoted standby, a point-in-time
//!   recovery), in another database (a copy made with `CREATE DATABASE …
//!   TEMPLATE`), or ahead of the server's WAL is ignored, with a warning.
//!   A slot dropped and created again starts at the WAL's end, past anything
//!   the row can hold, so the slot's position wins there by itself.
//! * **Repeats are bounded by one acknowledgement.** The row is written in
//!   the background with the status updates (every 200 ms while events
//!   finish, else every status interval), when events were finished since
//!   the last write and the previous write is done, and once more, waited
//!   for, when the relay stops gracefully. A position that only skips transactions without
//!   events (a keepalive's advance) is written only along with events
//!   finished since: starting before it repeats nothing, and writing it on
//!   its own would make WAL every interval (an idle relay writes nothing).
//! * **It is optional.** Without the table (or the privileges to read and
//!   write it) the relay starts from the slot as before; `check` and `run` warn.
//!
//! # The derived lifecycle: the vouched pair and the holes
//!
//! With `on_published = "derive"` the same row keeps what lets every reader
//! derive a row's state without the relay writing the row
//! ([`crate::postgres::outbox::derived`] states the rule). The keeper owns
//! the writing side:
//!
//! * **The pair.** While events finish, the keeper takes a *candidate* once
//!   a status interval on its SQL connection (and once at each session's
//!   start): S = `pg_current_snapshot()` (the
//!   statement's snapshot, taken before it runs), then W =
//!   `pg_current_wal_insert_lsn()` (read while it runs, as the end of the
//!   last record: [`WalLayout::last_record_end`]). PostgreSQL inserts
//!   a commit record before the transaction leaves the proc array, so every
//!   transaction visible in S has its commit record before W. Once the
//!   confirmed position passes W (every transaction committed before it was
//!   published or recorded) *and* `pg_current_wal_flush_lsn() >= W`, S, W
//!   and `snapshot_at` of the newest candidate it passed are stored with the
//!   confirmed position, in one transaction with `SET LOCAL
//!   synchronous_commit = local`. Candidates wait in a queue, so while the
//!   stream keeps up with the writers the vouched S trails it by about an
//!   interval. A backlog already in the WAL when a session starts (after a
//!   restart or an outage) is another matter: every candidate's W lies past
//!   its end, so S stays where it was until the stream has worked through
//!   it. The poller's samples are taken the same way (their W too lies past
//!   the backlog), so it takes none of those rows while the stream streams
//!   (while the slot is inactive, rows past `poller.grace` are the poller's,
//!   as under every lifecycle). A session that
//!   ends in the middle of such a catch-up in a way that leaves the slot
//!   ahead of the kept confirmed position (a fast shutdown on 17+, which
//!   writes the slot's position, after the relay's last acknowledgement
//!   but before the row's write) opens a hole from that S at the next start:
//!   the rows of the catch-up are published again by the poller, at least
//!   once (docs/chaos.md measured it). An idle
//!   relay takes one candidate at a session's start (stored once the stream
//!   passes it) and none after, and writes nothing; a graceful stop stores
//!   the pair if it qualifies.
//! * **Every delivered transaction is vouched for, with or without events
//!   after it.** The commit record comes first, so the stream can deliver a
//!   transaction that no snapshot sees yet: under synchronous replication
//!   until the standby answers, and under load while its backend waits to
//!   leave the proc array. A candidate taken then does not see it. The
//!   keeper holds the ids of the transactions the stream confirmed
//!   (`pgoutput`'s 32-bit xid, [`Snapshot::visible_xid32`]) until a
//!   candidate sees them, and takes candidates while any is left, whether
//!   or not events finish meanwhile: the last transaction before a quiet
//!   spell is derived published without waiting for the next event (the
//!   poller would otherwise publish it again after its grace). Each
//!   session's start owes a candidate too, for what earlier sessions
//!   delivered after their last one (a transaction delivered and still
//!   unseen when a session ends is not known to the next: its rows go to
//!   the poller after its grace, at least once). A candidate passed but not
//!   stored (W not flushed, the write failed) owes a fresh one. While the
//!   stream is quiet and a transaction stays unseen (a synchronous standby
//!   that does not answer), candidates come a second apart for ten, then
//!   ever less often, up to one a minute.
//! * **Why flush ≥ W.** A transaction committed with `synchronous_commit =
//!   off` is visible before its commit record is flushed. If the server then
//!   stops (crash, immediate shutdown) the commit is lost and its xid is
//!   handed out again, to a transaction the stream has not seen, which S
//!   would still call visible. Once W is flushed, every commit S can see is
//!   durable and no id in S can be reused.
//! * **Why a synchronous commit, and only a local one.** The stored pair
//!   vouches for rows at once (every reader joins the row), so it is flushed
//!   before the keeper moves on; were its own commit lost in a crash, no harm
//!   (the older pair stays). Not `on`: waiting for synchronous standbys adds
//!   nothing (a standby promoted holds the pair only with the WAL before it,
//!   below) and would stall the session's shared connection, and with it the
//!   recorder and the stream, while a synchronous standby is away. The
//!   holes, when a look closes some, and the confirmed position, under every
//!   lifecycle, are written the same way: a
//!   row a promoted standby lacks is on another timeline, which the next
//!   session ignores anyway (above).
//! * **Identity.** At a session's start ([`prepare`]) a stored S is
//!   discarded (set NULL, with a warning: the poller publishes its rows again,
//!   at least once, until a new pair is stored) when the row was written by
//!   another system (`system_identifier`), when S's xmax is above the
//!   server's current xmax (a restore to an earlier point, the epoch moved
//!   back), or when W is ahead of the server's flushed WAL. A row from another
//!   system also loses its holes: its snapshots name another history, so the
//!   slot's boundary is taken again.
//! * **Timelines.** A pair stored on an earlier timeline stays valid when the
//!   row reached this server through replication: the row's own commit comes
//!   after W (it was written after the flush check), and was replayed here,
//!   so the branch point is after it, hence after W: every commit S vouches
//!   for is on this timeline. (A row restored by other means is caught by the
//!   checks above or by the slot's position: a slot behind the row is ahead
//!   of nothing, a slot ahead of it opens a hole.)
//! * **Holes.** Rows the slot may not have streamed: the boundary (first
//!   start, or no holes kept: from `1:1:` to a snapshot taken now, after the
//!   slot exists, so every transaction the slot will not stream, having
//!   committed before its consistent point, is visible in it), and a hole
//!   from the vouched S (or `1:1:`) to a snapshot taken now when the relay
//!   (re)created the slot or finds the slot ahead of the kept confirmed
//!   position. They are written with a synchronous commit *before*
//!   START_REPLICATION, and published to the stream, which marks the rows it
//!   publishes in them. Once a minute the keeper closes every hole with no
//!   `PENDING` row left in it (an index range on `<table>_txid_idx` per
//!   hole, stopping at the first row); beyond [`MAX_HOLES`] the two oldest
//!   are merged, which hands the rows between them to the poller (published
//!   again, at least once; warned).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::postgres::lsn::{format_lsn, parse_lsn, WalLayout};
use crate::postgres::outbox::derived::{self, Hole, Holes, Snapshot, BEGINNING};
use crate::postgres::sql::quote_literal;

pub(crate) use crate::postgres::outbox::derived::position_table as table_name;

/// What the server says about itself (`IDENTIFY_SYSTEM` on the replication
/// connection).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct System {
    /// The cluster's `system_identifier`, as text.
    pub id: String,
    /// The current timeline.
    pub timeline: u32,
    /// Where the server's WAL ends (flushed).
    pub wal_end: u64,
}

/// A position the relay kept, read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kept {
    /// The confirmed position.
    pub lsn: u64,
    /// The system it was written on.
    pub system_id: String,
    /// The timeline it was written on.
    pub timeline: u32,
    /// Whether it was written in this database (by its oid).
    pub same_database: bool,
}

/// Where a session starts, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// The position asked for at START_REPLICATION.
    pub lsn: u64,
    /// The kept position was used.
    pub kept: bool,
    /// Why, for the log (`None`: the usual case, nothing to say).
    pub why: Option<String>,
    /// Whether the reason is worth a warning (a kept position was refused).
    pub doubt: bool,
}

/// The start: the slot's position `slot`, or `kept` when it is later and
/// comes from this system, timeline and database and within its WAL.
pub(crate) fn choose(slot: u64, kept: Option<&Kept>, system: &System) -> Choice {
    let from_slot = |why: Option<String>, doubt: bool| Choice {
        lsn: slot,
        kept: false,
        why,
        doubt,
    };
    let Some(kept) = kept else {
        return from_slot(None, false);
    };
    let at = format_lsn(kept.lsn);
    if kept.system_id != system.id {
        return from_slot(
            Some(format!(
                "the kept position {at} was written by another PostgreSQL system ({}, this is {}): \
                 a restored or cloned cluster; starting from the slot",
                kept.system_id, system.id
            )),
            true,
        );
    }
    if kept.timeline != system.timeline {
        return from_slot(
            Some(format!(
                "the kept position {at} was written on timeline {}, the server is on {} (promoted or \
                 recovered to a point in time); starting from the slot",
                kept.timeline, system.timeline
            )),
            true,
        );
    }
    if !kept.same_database {
        return from_slot(
            Some(format!(
                "the kept position {at} was written in another database (this one is a copy); \
                 starting from the slot"
            )),
            true,
        );
    }
    if kept.lsn > system.wal_end {
        return from_slot(
            Some(format!(
                "the kept position {at} is ahead of the server's WAL ({}); starting from the slot",
                format_lsn(system.wal_end)
            )),
            true,
        );
    }
    if kept.lsn <= slot {
        return from_slot(None, false);
    }
    Choice {
        lsn: kept.lsn,
        kept: true,
        why: Some(format!(
            "the slot is at {}, behind the position the relay confirmed ({at}; PostgreSQL restarted \
             before it wrote the slot to disk): starting from the relay's, nothing published is sent again",
            format_lsn(slot)
        )),
        doubt: false,
    }
}

/// The kept position of `slot` in `table` (schema-qualified, quoted), or
/// `None` when there is none or the table cannot be read (logged once).
pub(crate) async fn load(
    client: &tokio_postgres::Client,
    table: &str,
    slot: &str,
) -> Result<Option<Kept>, tokio_postgres::Error> {
    let sql = format!(
        "SELECT p.confirmed_lsn::text, p.system_identifier, p.timeline, \
                p.database_oid = (SELECT oid FROM pg_database WHERE datname = current_database()) \
         FROM {table} p WHERE p.slot_name = $1"
    );
    let row = match client.query_opt(&sql, &[&slot]).await {
        Ok(row) => row,
        Err(error) if missing_or_denied(&error) => {
            tracing::debug!(error = %crate::report::Chain(&error), "no kept position");
            return Ok(None);
        }
        Err(error) => return Err(error),
    };
    Ok(row.and_then(|row| {
        Some(Kept {
            lsn: parse_lsn(row.get::<_, &str>(0))?,
            system_id: row.get(1),
            timeline: u32::try_from(row.get::<_, i32>(2)).ok()?,
            same_database: row.get(3),
        })
    }))
}

/// Whether `table` exists and the relay may read and write it (for `check`
/// and the start-up warning).
pub(crate) async fn writable(
    client: &tokio_postgres::Client,
    table: &str,
) -> Result<bool, tokio_postgres::Error> {
    client
        .query_one(
            // Each separately: a list means any of them.
            "SELECT coalesce(has_table_privilege(t, 'SELECT') AND has_table_privilege(t, 'INSERT') \
                    AND has_table_privilege(t, 'UPDATE'), false) FROM to_regclass($1) AS t",
            &[&table],
        )
        .await
        .map(|row| row.get(0))
}

fn missing_or_denied(error: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    error
        .code()
        .is_some_and(|c| *c == SqlState::UNDEFINED_TABLE || *c == SqlState::INSUFFICIENT_PRIVILEGE)
}

/// What the derived lifecycle keeps of a slot's row at a session's start
/// ([`prepare`]): the vouched snapshot (when its identity held) and the
/// holes, written before the stream starts.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Vouching {
    /// The vouched S, `None` when there is none (or it was discarded).
    pub snapshot: Option<Snapshot>,
    /// When it was stored (unix seconds), for the lag metric.
    pub at: Option<f64>,
    /// The slot's holes, never empty once prepared (the boundary first).
    pub holes: Holes,
    /// What the publication sends of the table, as this session found it:
    /// a pair is stored only while it is the same.
    pub publication: Option<String>,
    /// The server's WAL layout, for the candidates' W (unknown when it
    /// cannot be read: then a W just past a page's header waits for the
    /// next write to the WAL).
    pub wal: WalLayout,
}

/// Most holes kept: beyond, the two oldest are merged ([`merge`]).
pub(crate) const MAX_HOLES: usize = 16;

/// Most pairs waiting for the stream to pass their W.
const MAX_CANDIDATES: usize = 256;

/// Most ids of delivered transactions waiting for a candidate that sees
/// them ([`Cycle::uncovered`]): about a second of transactions at 64k/s.
const MAX_UNCOVERED: usize = 1 << 16;

/// How often a pair is taken while events finish (and no older one waits
/// for nothing: an empty queue takes one at once).
const CANDIDATE_EVERY: Duration = Duration::from_secs(1);

/// The longest spacing of candidates while the stream is quiet and a
/// delivered transaction stays unseen.
const CANDIDATE_QUIET_MAX: Duration = Duration::from_secs(60);

/// Quiet candidates taken a [`CANDIDATE_EVERY`] apart before the spacing
/// grows.
const QUIET_STEADY: u32 = 10;

/// How often the keeper looks for holes to close.
const TIDY_EVERY: Duration = Duration::from_secs(60);

/// The first look, this long into a session: the holes opened at its start
/// hold the rows committed while no relay streamed, which the stream marks
/// within seconds when the poller has not taken them already.
const TIDY_FIRST: Duration = Duration::from_secs(5);

/// The slot's derived row as read at a session's start, after the identity
/// checks.
struct Stored {
    snapshot: Option<Snapshot>,
    at: Option<f64>,
    holes: Option<Holes>,
    /// The kept confirmed position.
    confirmed: Option<u64>,
    /// Written by another system: its snapshots name another history.
    foreign: bool,
    /// Why the stored S was refused (it is discarded).
    refused: Option<String>,
    /// The publication as the last session found it.
    publication: Option<String>,
}

/// Read the derived columns of `slot`'s row (`None`: no row) and check the
/// pair's identity.
async fn read_stored(
    client: &tokio_postgres::Client,
    table: &str,
    slot: &str,
) -> Result<Option<Stored>, tokio_postgres::Error> {
    let sql = format!(
        "SELECT p.snapshot::text, p.snapshot_lsn::text, extract(epoch FROM p.snapshot_at)::float8, \
                p.hole_from::text[], p.hole_to::text[], p.confirmed_lsn::text, \
                p.system_identifier = (SELECT system_identifier::text FROM pg_control_system()), \
                pg_snapshot_xmax(p.snapshot) <= pg_snapshot_xmax(pg_current_snapshot()), \
                p.snapshot_lsn <= pg_current_wal_flush_lsn(), \
                pg_snapshot_xmax(pg_current_snapshot())::text, pg_current_wal_flush_lsn()::text, \
                p.publication_id \
         FROM {table} p WHERE p.slot_name = $1"
    );
    let Some(row) = client.query_opt(&sql, &[&slot]).await? else {
        return Ok(None);
    };
    let text: Option<String> = row.get(0);
    let lsn: Option<String> = row.get(1);
    let snapshot = text.as_deref().and_then(Snapshot::parse);
    let holes = match (
        row.get::<_, Option<Vec<String>>>(3),
        row.get::<_, Option<Vec<String>>>(4),
    ) {
        (Some(from), Some(to)) => Holes::parse(&from, &to),
        _ => None,
    };
    let foreign = !row.get::<_, bool>(6);
    let refused = match (&text, snapshot.is_some()) {
        (None, _) => None,
        (Some(_), _) if foreign => Some("it was written by another PostgreSQL system".to_owned()),
        (Some(t), false) => Some(format!("it cannot be read ({t:?})")),
        (Some(t), true) if !row.get::<_, Option<bool>>(7).unwrap_or(false) => Some(format!(
            "its snapshot {t} is ahead of the server's transaction ids (xmax {}): the server was \
             restored to an earlier point or its epoch moved back",
            row.get::<_, String>(9)
        )),
        (Some(_), true) if !row.get::<_, Option<bool>>(8).unwrap_or(false) => Some(format!(
            "its WAL position {} is ahead of the server's WAL ({}): the server was restored to an \
             earlier point",
            lsn.as_deref().unwrap_or("NULL"),
            row.get::<_, String>(10)
        )),
        _ => None,
    };
    Ok(Some(Stored {
        snapshot: snapshot.filter(|_| refused.is_none()),
        at: row.get::<_, Option<f64>>(2).filter(|_| refused.is_none()),
        holes,
        confirmed: parse_lsn(row.get::<_, &str>(5)),
        foreign,
        refused,
        publication: row.get(11),
    }))
}

/// What the publication sends of the outbox table now
/// ([`derived::publication_identity`]; `None`: it does not carry it).
pub(crate) async fn publication_identity(
    client: &tokio_postgres::Client,
    publication: &str,
    outbox: &str,
) -> Result<Option<String>, tokio_postgres::Error> {
    let namespaces: bool = client
        .query_one(
            "SELECT to_regclass('pg_catalog.pg_publication_namespace') IS NOT NULL",
            &[],
        )
        .await?
        .get(0);
    client
        .query_one(
            &derived::publication_identity(namespaces),
            &[&publication, &outbox],
        )
        .await
        .map(|row| row.get(0))
}

/// Whether the identity `now` ([`derived::publication_identity`]) says that
/// rows may have gone unstreamed since `seen`: the publication's entries
/// differ, or a relation of the outbox's tree has a storage `seen` did not
/// list (rewritten since, or new and rewritten). A rewritten relation that
/// left the tree (a partition dropped or detached) cannot hold rows of the
/// outbox: its entry gone alone is no change. `None` (not carried) differs
/// from anything carried.
fn changed(seen: Option<&str>, now: Option<&str>) -> bool {
    let (Some(seen), Some(now)) = (seen, now) else {
        return seen != now;
    };
    let before: std::collections::BTreeSet<&str> = seen.split(',').collect();
    let after: std::collections::BTreeSet<&str> = now.split(',').collect();
    let publication = |e: &&&str| !e.starts_with('s');
    !before
        .iter()
        .filter(publication)
        .eq(after.iter().filter(publication))
        || after
            .iter()
            .any(|e| e.starts_with('s') && !before.contains(e))
}

/// Merge the two oldest holes while there are more than [`MAX_HOLES`]: the
/// rows between them (published by the stream, derived published until now)
/// then lie in the merged hole and become the poller's: published once more.
/// How many merges.
pub(crate) fn merge(holes: &mut Holes) -> usize {
    let mut merged = 0;
    // The slot's boundary (from the beginning) is never merged: that would
    // hand every row the stream delivered since it to the poller.
    let beginning = Snapshot::parse(BEGINNING).expect("BEGINNING is a snapshot");
    let first = usize::from(holes.0.first().is_some_and(|h| h.from == beginning));
    while holes.0.len() > MAX_HOLES && holes.0.len() >= first + 2 {
        let second = holes.0.remove(first + 1);
        holes.0[first].to = second.to;
        merged += 1;
    }
    merged
}

/// The snapshot a hole opened now is taken to: `pg_current_snapshot()`,
/// widened ([`Snapshot::widened`]) to an id taken after it, so that the hole
/// holds every transaction begun before it, also one in progress above the
/// snapshot's xmax (a commit record written, synchronous replication
/// waiting: [`Hole`]). The id is taken in a transaction rolled back, sent as
/// one simple query so that no other statement on the connection runs in it.
async fn hole_snapshot(client: &tokio_postgres::Client) -> Result<Snapshot, tokio_postgres::Error> {
    let messages = client
        .simple_query(
            "BEGIN; SELECT pg_current_snapshot()::text, pg_current_xact_id()::text; ROLLBACK",
        )
        .await?;
    let row = messages
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => Some(row),
            _ => None,
        })
        .expect("the query returns a row");
    let snapshot = row
        .get(0)
        .and_then(Snapshot::parse)
        .expect("pg_current_snapshot() prints a snapshot");
    let upper: u64 = row
        .get(1)
        .and_then(|x| x.parse().ok())
        .expect("pg_current_xact_id() prints an id");
    Ok(snapshot.widened(upper))
}

/// Prepare the derived lifecycle for a session of `slot`, before
/// START_REPLICATION (the slot exists): read the row, discard a pair whose
/// identity fails, open the holes the session needs and write them with a
/// synchronous commit. `kept_slot` is the slot's `confirmed_flush_lsn` (its
/// start); `recreated` says the relay has just created the slot.
///
/// A hole is opened, to a snapshot taken now, when:
/// * the row has none (the first start, a table migrated, a row written by
///   another system): the slot's **boundary**, from [`BEGINNING`]. The slot
///   exists, so every transaction it will not stream committed before its
///   consistent point, hence before now: each is visible in the snapshot;
/// * the relay created the slot now, or the slot is ahead of the kept
///   confirmed position (something else moved it, or the relay died before
///   it kept what it confirmed): from the vouched S (or [`BEGINNING`]):
///   nothing between the two may be vouched for by a later snapshot.
pub(crate) async fn prepare(
    client: &tokio_postgres::Client,
    table: &str,
    slot: &str,
    slot_confirmed: u64,
    recreated: bool,
    publication: &str,
    outbox: &str,
) -> Result<Vouching, tokio_postgres::Error> {
    let stored = read_stored(client, table, slot).await?;
    let (snapshot, at, holes, confirmed, foreign, refused, seen) = match stored {
        Some(s) => (
            s.snapshot,
            s.at,
            s.holes,
            s.confirmed,
            s.foreign,
            s.refused,
            s.publication,
        ),
        None => (None, None, None, None, false, None, None),
    };
    let identity = publication_identity(client, publication, outbox).await?;
    // A publication that changed since the last session may have left the
    // table out for a while, a relation rewritten may have been unlogged:
    // what committed then was never streamed.
    let changed = seen.is_some() && changed(seen.as_deref(), identity.as_deref());
    if let Some(why) = &refused {
        tracing::warn!(
            slot = %slot,
            "the vouched snapshot in the position table is discarded: {why}; rows it covered are no \
             longer derived published, the poller publishes them again (at least once) until a new \
             snapshot is vouched for"
        );
    }
    let now = hole_snapshot(client).await?;
    let beginning = Snapshot::parse(BEGINNING).expect("BEGINNING is a snapshot");
    // NULL arrays: never prepared (empty ones: every hole closed).
    let kept_holes = holes.filter(|_| !foreign);
    let fresh = kept_holes.is_none();
    let mut holes = kept_holes.unwrap_or_default();
    // A hole left open while the publication did not carry the table (the
    // session's readiness found it carried again): every transaction
    // committed until now is in it; the stream sends what commits after.
    let open = Snapshot::parse(derived::OPEN).expect("OPEN is a snapshot");
    let mut narrowed = false;
    for hole in holes.0.iter_mut().filter(|h| h.to == open) {
        hole.to = now.clone();
        narrowed = true;
    }
    let why = if fresh {
        holes.0.push(Hole {
            from: beginning,
            to: now,
        });
        Some(if foreign {
            "the slot's boundary (the row was written by another system)"
        } else {
            "the slot's boundary (no holes were kept)"
        })
    } else {
        let ahead = confirmed.is_none_or(|kept| slot_confirmed > kept);
        (recreated || ahead || changed).then(|| {
            holes.0.push(Hole {
                from: snapshot.clone().unwrap_or(beginning),
                to: now,
            });
            if recreated {
                "the relay created the slot"
            } else if changed {
                "the publication or the outbox table's storage changed since the last session (the \
                 table taken out and put back, the publication's options altered, a relation set \
                 UNLOGGED and back or otherwise rewritten; also once after an upgrade of the relay \
                 that reads the storage too): what committed meanwhile may not have been streamed"
            } else {
                "the slot is ahead of the kept position (moved by something else, or the relay \
                 stopped before it kept what it confirmed)"
            }
        })
    };
    let merged = merge(&mut holes);
    if merged > 0 {
        tracing::warn!(
            slot = %slot, merged, "more than {MAX_HOLES} holes: the oldest merged; rows between them \
             are no longer derived published and the poller publishes them again (at least once)"
        );
    }
    if identity.is_none() {
        // Readiness refuses a table the publication does not carry before
        // a session gets here; a partition that writes no WAL it only warns
        // of (`check`). Either way, vouch for nothing new.
        tracing::warn!(
            slot = %slot, table = %outbox,
            "the publication does not carry the outbox table, or a partition of it writes no WAL \
             (UNLOGGED, or a foreign table): its rows are never streamed, so the relay vouches for \
             nothing new; every row is marked or published by the poller until that is mended and \
             the relay restarted"
        );
        holes.0.push(Hole {
            from: snapshot
                .clone()
                .unwrap_or_else(|| Snapshot::parse(BEGINNING).expect("BEGINNING is a snapshot")),
            to: Snapshot::parse(derived::OPEN).expect("OPEN is a snapshot"),
        });
    }
    if why.is_some() || refused.is_some() || narrowed || seen != identity {
        write_holes(
            client,
            table,
            slot,
            slot_confirmed,
            &holes,
            refused.is_some(),
            Some(identity.as_deref()),
        )
        .await?;
    }
    if let Some(why) = why {
        let hole = holes.0.last().expect("a hole was opened");
        tracing::info!(
            slot = %slot, from = %hole.from, to = %hole.to, holes = holes.0.len(),
            "derived lifecycle: a hole opened ({why}); rows in it keep explicit states (the poller \
             publishes them, the stream marks those it publishes)"
        );
    }
    let wal = WalLayout::read(client).await.unwrap_or_else(|error| {
        tracing::warn!(
            error = %crate::report::Chain(&error),
            "cannot read the WAL's layout (pg_control_init()): a pair taken when the WAL ends at a \
             page's end waits for the next write to the WAL"
        );
        WalLayout::default()
    });
    Ok(Vouching {
        snapshot,
        at,
        holes,
        publication: identity,
        wal,
    })
}

/// A session that keeps no holes (the lifecycle in force is not `derive`)
/// on a slot whose row holds derived state: the slot may be lost, created
/// again or moved meanwhile, and no session would see it, so a hole from the
/// stored S to every later transaction ([`derived::OPEN`]) is written first
/// (once); the next `derive` session narrows it ([`prepare`]). Rows the
/// stream publishes meanwhile are marked anyway. Without derived state (or
/// the columns, or the privilege) nothing to do.
pub(crate) async fn suspend(
    client: &tokio_postgres::Client,
    table: &str,
    slot: &str,
) -> Result<(), tokio_postgres::Error> {
    let sql = format!(
        "UPDATE {table} SET hole_from = hole_from || coalesce(snapshot, {beginning}::pg_snapshot), \
                hole_to = hole_to || {open}::pg_snapshot \
         WHERE slot_name = $1 AND hole_to IS NOT NULL AND NOT ({open} = ANY(hole_to::text[]))",
        beginning = quote_literal(BEGINNING),
        open = quote_literal(derived::OPEN),
    );
    match client.execute(&sql, &[&slot]).await {
        Ok(0) => Ok(()),
        Ok(_) => {
            tracing::info!(slot = %slot, "derived lifecycle suspended: a hole open to every later transaction until a `derive` session narrows it");
            Ok(())
        }
        Err(error)
            if missing_or_denied(&error)
                || error.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_COLUMN) =>
        {
            Ok(())
        }
        Err(error) => Err(error),
    }
}

/// SQL array literal of `snapshots`.
fn snapshot_array(snapshots: impl Iterator<Item = String>) -> String {
    literal_array(snapshots, "pg_snapshot")
}

/// An array of `items` as SQL literals, of type `element[]`.
fn literal_array(items: impl Iterator<Item = String>, element: &str) -> String {
    let items: Vec<String> = items.map(|s| quote_literal(&s)).collect();
    format!("ARRAY[{}]::{element}[]", items.join(", "))
}

/// Write `holes` into `slot`'s row (created when missing, at `confirmed`,
/// the slot's own position), and NULL the pair when `discard`, in one
/// transaction with a synchronous commit: the stream starts only once they
/// are durable.
async fn write_holes(
    client: &tokio_postgres::Client,
    table: &str,
    slot: &str,
    confirmed: u64,
    holes: &Holes,
    discard: bool,
    publication: Option<Option<&str>>,
) -> Result<(), tokio_postgres::Error> {
    let from = snapshot_array(holes.0.iter().map(|h| h.from.to_string()));
    let publication = match publication {
        Some(Some(id)) => format!(", publication_id = {}", quote_literal(id)),
        Some(None) => ", publication_id = NULL".to_owned(),
        None => String::new(),
    };
    let to = snapshot_array(holes.0.iter().map(|h| h.to.to_string()));
    let discard = if discard {
        ", snapshot = NULL, snapshot_lsn = NULL, snapshot_at = NULL"
    } else {
        ""
    };
    // One simple query: no statement of another task on this connection
    // can fall inside the transaction.
    client
        .batch_execute(&format!(
            "BEGIN; SET LOCAL synchronous_commit = local; \
             INSERT INTO {table} AS p (slot_name, system_identifier, timeline, database_oid, confirmed_lsn, \
                 updated_at, hole_from, hole_to) \
             SELECT {slot}, (SELECT system_identifier::text FROM pg_control_system()), \
                 (SELECT timeline_id FROM pg_control_checkpoint()), oid, {confirmed}::pg_lsn, now(), {from}, {to} \
             FROM pg_database WHERE datname = current_database() \
             ON CONFLICT (slot_name) DO UPDATE SET hole_from = excluded.hole_from, \
                 hole_to = excluded.hole_to{discard}{publication}; \
             COMMIT",
            slot = quote_literal(slot),
            confirmed = quote_literal(&format_lsn(confirmed)),
        ))
        .await
}

/// Whether `table` (schema-qualified, quoted) holds every column the derived
/// lifecycle keeps ([`derived::POSITION_COLUMNS`]): the missing ones, by
/// name, in [`derived::POSITION_COLUMNS`]'s order (none: it does). For
/// the lifecycle in force ([`crate::postgres::readiness`]).
pub(crate) async fn missing_derived_columns(
    client: &tokio_postgres::Client,
    table: &str,
) -> Result<Vec<String>, tokio_postgres::Error> {
    let names: Vec<&str> = derived::POSITION_COLUMNS.iter().map(|(n, _)| *n).collect();
    let rows = client
        .query(
            "SELECT c FROM unnest($2::text[]) WITH ORDINALITY AS w(c, n) WHERE NOT EXISTS \
             (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = c AND NOT attisdropped) \
             ORDER BY n",
            &[&table, &names],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// A pair taken and not yet stored: S, then W.
#[derive(Debug, Clone)]
struct Candidate {
    snapshot: Snapshot,
    lsn: u64,
}

/// The derived lifecycle's state in the keeper, shared with its background
/// write.
struct Cycle {
    /// The pairs waiting for the confirmed position to pass their W, oldest
    /// first, one taken a status interval while events finish: while the
    /// stream catches up on a backlog, each W it passes has a pair ready,
    /// so the vouched S trails the stream by about an interval, not by the
    /// backlog ([`MAX_CANDIDATES`]).
    candidates: std::collections::VecDeque<Candidate>,
    /// Ids of transactions the stream confirmed that no candidate taken
    /// since sees yet: a candidate is taken while any is left (oldest
    /// first, at most [`MAX_UNCOVERED`]).
    uncovered: std::collections::VecDeque<u32>,
    /// A candidate is owed whatever `uncovered` holds: at a session's start.
    owed: bool,
    /// Events finished when the last candidate was taken, and how many
    /// candidates in a row were taken with none finished since: while the
    /// stream is quiet and a transaction stays unseen (a synchronous standby
    /// that does not answer holds it out of every snapshot), candidates
    /// come less often ([`Cycle::due`]), not a write a second.
    finished_at_take: u64,
    quiet_takes: u32,
    /// When the last candidate was taken.
    taken: Instant,
    /// The vouched S (for a hole's `from` at the next start, and the log).
    vouched: Option<Snapshot>,
    /// When the vouched pair was stored (unix seconds).
    vouched_at: Option<f64>,
    holes: Arc<Holes>,
    /// The stream's copy of the holes ([`crate::postgres::outbox::marking`]).
    published: watch::Sender<Option<Arc<Holes>>>,
    /// When holes were last looked at for closing.
    tidied: Instant,
    /// An open hole was written: the publication stopped carrying the table.
    opened: bool,
    /// The publication and the outbox's storage as last looked at
    /// ([`derived::publication_identity`]): a pair is stored only while
    /// they are the same; a change opens a hole ([`close_behind`]).
    identity: Option<String>,
    /// The row's holes were written by another session since this one read
    /// them: this one closes none ([`close_holes`]).
    holes_taken: bool,
}

impl Cycle {
    /// The holes are `holes` from now on: kept, handed to the stream (which
    /// marks what it publishes in them) and counted in
    /// `outbox_relay_derived_holes`.
    fn set_holes(&mut self, holes: Holes) {
        let holes = Arc::new(holes);
        crate::metrics::get()
            .derived_holes
            .set(holes.0.len() as i64);
        self.holes = Arc::clone(&holes);
        self.published.send_replace(Some(holes));
    }

    /// Whether the next candidate may be taken: while events finish
    /// (`finished` moved since the last), at once when none waits, else a
    /// [`CANDIDATE_EVERY`] after the last; while the stream is quiet, a
    /// [`CANDIDATE_EVERY`] apart for [`QUIET_STEADY`] candidates (a commit
    /// that leaves the proc array late under load is seen within seconds),
    /// then a spacing that doubles with each, up to [`CANDIDATE_QUIET_MAX`].
    fn due(&self, finished: u64) -> bool {
        let elapsed = self.taken.elapsed();
        if finished != self.finished_at_take {
            return self.candidates.is_empty() || elapsed >= CANDIDATE_EVERY;
        }
        let doublings = self.quiet_takes.saturating_sub(QUIET_STEADY).min(8);
        elapsed >= (CANDIDATE_EVERY * 2u32.pow(doublings)).min(CANDIDATE_QUIET_MAX)
    }

    /// The stream confirmed the transactions `delivered`.
    /// Those the newest candidate taken (or the vouched S, when none
    /// waits) sees are covered already: it, or a later one that sees more,
    /// is stored, else a fresh one is owed ([`Cycle::dropped`]).
    fn delivered(&mut self, delivered: &[u32]) {
        let newest = self.candidates.back().map(|c| &c.snapshot);
        let seen = newest.or(self.vouched.as_ref());
        self.uncovered.extend(
            delivered
                .iter()
                .filter(|&&xid| !seen.is_some_and(|s| s.visible_xid32(xid))),
        );
        // Liveness only: the oldest left are the likeliest to stay unseen a
        // while (held out by a standby); the newest, seen by the next
        // candidate. A row left uncovered is the poller's, at least once.
        self.uncovered.truncate(MAX_UNCOVERED);
    }

    /// The session's last pair (a graceful stop), `candidate` made to see
    /// as well every transaction the session confirmed that no candidate
    /// saw ([`Snapshot::seeing`]): one that committed in the instant
    /// between a candidate's S and its W read, or was delivered before it
    /// was visible (a synchronous standby holds it). Each is committed and
    /// its events finished, so vouching for it is true; and no later
    /// candidate will see it this session. Without it its rows read
    /// `PENDING` while the relay is stopped, and a poller past their grace
    /// sends them again before the next session's first pair.
    ///
    /// Its W becomes `confirmed` (the walsender sends nothing unflushed):
    /// at or past each one's commit, so that every commit the pair vouches
    /// for lies before its W, as for any pair, and the flush check and the
    /// next start's identity checks weigh them all.
    fn last(&mut self, candidate: Candidate, confirmed: u64) -> Candidate {
        let uncovered = std::mem::take(&mut self.uncovered);
        if uncovered.is_empty() {
            return candidate;
        }
        let snapshot = candidate.snapshot.clone().seeing(uncovered.iter().copied());
        let lsn = candidate.lsn.max(confirmed);
        tracing::debug!(
            transactions = uncovered.len(), was = %candidate.snapshot, snapshot = %snapshot,
            lsn = %format_lsn(lsn),
            "derived lifecycle: the last pair also sees the transactions delivered that no candidate saw"
        );
        Candidate { snapshot, lsn }
    }

    /// A candidate the stream passed was not stored (W not flushed, the
    /// write failed): what it saw is owed to a fresh one, which sees at
    /// least as much. (A changed publication opens a hole instead, and no
    /// pair is stored until the next session.)
    fn dropped(&mut self) {
        self.owed = true;
    }

    /// A candidate was taken with `finished` events finished: queued for
    /// the stream to pass its W.
    fn took(&mut self, candidate: Candidate, finished: u64) {
        tracing::debug!(snapshot = %candidate.snapshot, lsn = %format_lsn(candidate.lsn), "derived lifecycle: a candidate pair taken");
        self.owed = false;
        self.quiet_takes = if finished == self.finished_at_take {
            self.quiet_takes.saturating_add(1)
        } else {
            0
        };
        self.finished_at_take = finished;
        // Seen by S: committed before W, vouched for once stored.
        self.uncovered
            .retain(|&xid| !candidate.snapshot.visible_xid32(xid));
        self.taken = Instant::now();
        if self.candidates.len() >= MAX_CANDIDATES {
            // Thin out, keeping the oldest and the newest: the stream still
            // finds a pair within twice the spacing.
            let mut keep = false;
            self.candidates.retain(|_| {
                keep = !keep;
                keep
            });
        }
        self.candidates.push_back(candidate);
    }

    /// Take out the newest pair whose W the stream passed (`confirmed`),
    /// and the older ones, which it vouches for.
    fn passed(&mut self, confirmed: u64) -> Option<Candidate> {
        let mut newest = None;
        while self.candidates.front().is_some_and(|c| confirmed >= c.lsn) {
            newest = self.candidates.pop_front();
        }
        newest
    }
}

/// The derived lifecycle's part of a [`Keeper`].
pub(crate) struct Derived {
    cycle: Arc<Mutex<Cycle>>,
    /// The relay's publication.
    publication: String,
    /// The outbox table, schema-qualified and quoted (holes are closed by
    /// its `relay_txid` index).
    outbox: String,
    /// The server's WAL layout ([`Vouching::wal`]).
    wal: WalLayout,
}

impl Derived {
    /// Keep the pair and the holes of `vouching` (as [`prepare`] left them)
    /// for the outbox table `outbox`, publishing the holes on `published`.
    pub(crate) fn new(
        vouching: Vouching,
        outbox: &str,
        publication: &str,
        published: watch::Sender<Option<Arc<Holes>>>,
    ) -> Self {
        let identity = vouching.publication;
        let wal = vouching.wal;
        let holes = Arc::new(vouching.holes);
        published.send_replace(Some(Arc::clone(&holes)));
        let metrics = crate::metrics::get();
        metrics.derived_holes.set(holes.0.len() as i64);
        Self {
            cycle: Arc::new(Mutex::new(Cycle {
                candidates: std::collections::VecDeque::new(),
                uncovered: std::collections::VecDeque::new(),
                owed: true,
                finished_at_take: u64::MAX,
                quiet_takes: 0,
                taken: Instant::now(),
                vouched: vouching.snapshot,
                vouched_at: vouching.at,
                holes,
                published,
                // As if looked at TIDY_EVERY − TIDY_FIRST ago.
                tidied: Instant::now()
                    .checked_sub(TIDY_EVERY - TIDY_FIRST)
                    .unwrap_or_else(Instant::now),
                opened: false,
                holes_taken: false,
                identity,
            })),
            publication: publication.to_owned(),
            outbox: outbox.to_owned(),
            wal,
        }
    }
}

/// Writes the confirmed position to the table as the session goes, and in
/// the derived lifecycle the vouched pair and the holes (module doc).
pub(crate) struct Keeper {
    client: Arc<tokio_postgres::Client>,
    table: String,
    /// The position's write, with `{lsn}` to fill in.
    sql: String,
    slot: String,
    system: System,
    /// The last position written (or being written).
    written: u64,
    /// Events finished when it was written.
    finished_then: u64,
    writing: Option<tokio::task::JoinHandle<()>>,
    derived: Option<Derived>,
}

impl Keeper {
    /// A keeper of `slot`'s position in `table` (schema-qualified, quoted)
    /// on `system`, starting at `start`; of the pair and holes too with
    /// `derived`.
    pub(crate) fn new(
        client: Arc<tokio_postgres::Client>,
        table: &str,
        slot: &str,
        system: System,
        start: u64,
        finished: u64,
        derived: Option<Derived>,
    ) -> Self {
        // `{lsn}` is filled in at each write; the rest are the relay's own
        // names and the server's identity, as literals: one simple query, so
        // no statement of another task on this connection falls inside it.
        let sql = format!(
            "BEGIN; SET LOCAL synchronous_commit = local; \
             INSERT INTO {table} AS p (slot_name, system_identifier, timeline, database_oid, confirmed_lsn, updated_at) \
             SELECT {slot}, {system}, {timeline}, oid, '{{lsn}}'::pg_lsn, now() FROM pg_database WHERE datname = current_database() \
             ON CONFLICT (slot_name) DO UPDATE SET system_identifier = excluded.system_identifier, \
                 timeline = excluded.timeline, database_oid = excluded.database_oid, \
                 confirmed_lsn = excluded.confirmed_lsn, updated_at = excluded.updated_at; \
             COMMIT",
            slot = quote_literal(slot),
            system = quote_literal(&system.id),
            timeline = i32::try_from(system.timeline).unwrap_or(i32::MAX),
        );
        Self {
            client,
            table: table.to_owned(),
            sql,
            slot: slot.to_owned(),
            system,
            written: start,
            finished_then: finished,
            writing: None,
            derived,
        }
    }

    /// Whether a pair waits for the confirmed position to reach its W, and
    /// `confirmed` does.
    pub(crate) fn waits_for(&self, confirmed: u64) -> bool {
        self.derived.as_ref().is_some_and(|d| {
            d.cycle
                .lock()
                .expect("cycle")
                .candidates
                .front()
                .is_some_and(|c| confirmed >= c.lsn)
        })
    }

    /// Whether it keeps the derived lifecycle's pair.
    pub(crate) fn derives(&self) -> bool {
        self.derived.is_some()
    }

    /// The session confirmed `confirmed` with `finished` events finished so
    /// far, and `delivered`, the ids of the transactions with events it
    /// confirmed since the last offer (offered with each status update: at
    /// most every 200 ms while events finish, else once per status
    /// interval). In the background, when the previous round is done:
    /// * the position is written when events were finished since the last
    ///   write;
    /// * derived: a candidate pair is taken while a delivered transaction
    ///   is seen by no candidate yet (or one is owed), one a
    ///   [`CANDIDATE_EVERY`]; the candidate is stored with the position once
    ///   `confirmed` passed its W and the server flushed W; holes are looked
    ///   at for closing every [`TIDY_EVERY`] (first [`TIDY_FIRST`] into
    ///   the session).
    pub(crate) fn offer(&mut self, confirmed: u64, finished: u64, delivered: &[u32]) {
        if let Some(derived) = &self.derived {
            let mut cycle = derived.cycle.lock().expect("cycle");
            lag_gauge(cycle.vouched_at);
            // Before anything returns: a round in progress sees them too.
            cycle.delivered(delivered);
        }
        if self.writing.as_ref().is_some_and(|w| !w.is_finished()) {
            return;
        }
        let position_due = confirmed > self.written && finished != self.finished_then;
        let Some(derived) = &self.derived else {
            if !position_due {
                return;
            }
            self.written = confirmed;
            self.finished_then = finished;
            let write = self.write(confirmed);
            self.writing = Some(tokio::spawn(async move {
                if let Err(error) = write.await {
                    warn_unkept(&error);
                }
            }));
            return;
        };
        let (take, store, tidy) = {
            let mut cycle = derived.cycle.lock().expect("cycle");
            let store = cycle.passed(confirmed);
            let take = (cycle.owed || !cycle.uncovered.is_empty()) && cycle.due(finished);
            let tidy = !cycle.holes.0.is_empty()
                && !cycle.holes_taken
                && cycle.tidied.elapsed() >= TIDY_EVERY;
            (take, store, tidy)
        };
        if !(take || store.is_some() || position_due || tidy) {
            return;
        }
        if position_due || store.is_some() {
            self.written = confirmed;
            self.finished_then = finished;
        }
        let round = self.round(derived, confirmed);
        self.writing = Some(tokio::spawn(async move {
            round
                .run(confirmed, finished, take, store, position_due, tidy)
                .await;
        }));
    }

    /// A graceful stop's last pair, before [`Keeper::finish`]: when a
    /// transaction the session confirmed is seen by no candidate yet (or
    /// the session's start owes one), a candidate is taken now, after every
    /// delivered commit. The W the confirmed position must reach for
    /// `finish` to store the newest candidate; `None` when none waits (or
    /// the snapshot could not be taken by `until`: the rows of the last
    /// second then read `PENDING` until the next session's first pair).
    pub(crate) async fn final_candidate(
        &mut self,
        finished: u64,
        until: tokio::time::Instant,
    ) -> Option<u64> {
        self.derived.as_ref()?;
        // A round in progress may take or store a candidate itself.
        if !self.round_ended(until).await {
            return None;
        }
        let derived = self.derived.as_ref()?;
        let owes = {
            let cycle = derived.cycle.lock().expect("cycle");
            cycle.owed || !cycle.uncovered.is_empty()
        };
        if owes {
            match tokio::time::timeout_at(until, take_candidate(&self.client, derived.wal)).await {
                Ok(Ok(candidate)) => derived
                    .cycle
                    .lock()
                    .expect("cycle")
                    .took(candidate, finished),
                Ok(Err(error)) => {
                    tracing::warn!(error = %crate::report::Chain(&error), "cannot take the final snapshot to vouch for");
                    return None;
                }
                Err(_) => return None,
            }
        }
        let cycle = derived.cycle.lock().expect("cycle");
        cycle.candidates.back().map(|c| c.lsn)
    }

    /// Whether no background round runs, once the one in progress (if any)
    /// ended by `until`. One that does not stays the keeper's: no write may
    /// go beside it, whose older pair could land after a newer one.
    async fn round_ended(&mut self, until: tokio::time::Instant) -> bool {
        let Some(mut writing) = self.writing.take() else {
            return true;
        };
        if tokio::time::timeout_at(until, &mut writing).await.is_ok() {
            return true;
        }
        self.writing = Some(writing);
        false
    }

    /// Write `confirmed` (with the pair, when it qualifies and `vouch`) and
    /// wait for it (a graceful stop), within `limit`; `delivered`: the ids
    /// of the transactions confirmed since the last offer. Nothing when a
    /// round in progress does not end in time: a write beside it could land
    /// before its older one.
    pub(crate) async fn finish(
        mut self,
        confirmed: u64,
        delivered: &[u32],
        limit: Duration,
        vouch: bool,
    ) {
        if !self.round_ended(tokio::time::Instant::now() + limit).await {
            tracing::warn!(
                "the keeper's last round did not end in time: the final position is not kept"
            );
            return;
        }
        let store = self.derived.as_ref().filter(|_| vouch).and_then(|d| {
            let mut cycle = d.cycle.lock().expect("cycle");
            cycle.delivered(delivered);
            // None passed: a round stored the last one already; the vouched
            // S, at `confirmed`, carries what no candidate saw.
            let last = cycle.passed(confirmed).or_else(|| {
                let vouched = cycle
                    .vouched
                    .clone()
                    .filter(|_| !cycle.uncovered.is_empty())?;
                Some(Candidate {
                    snapshot: vouched,
                    lsn: confirmed,
                })
            })?;
            Some(cycle.last(last, confirmed))
        });
        if confirmed <= self.written && store.is_none() {
            return;
        }
        let done = match (store, &self.derived) {
            (Some(candidate), Some(derived)) => {
                let round = self.round(derived, confirmed);
                tokio::time::timeout(limit, async move {
                    round.store_or_write(confirmed, candidate, true).await
                })
                .await
            }
            _ => tokio::time::timeout(limit, self.write(confirmed)).await,
        };
        match done {
            Ok(Ok(())) => {
                tracing::debug!(lsn = %format_lsn(confirmed), "final position kept");
            }
            Ok(Err(error)) => {
                tracing::warn!(error = %crate::report::Chain(&error), "cannot keep the final position");
            }
            Err(_) => tracing::warn!("the final position could not be kept in time"),
        }
    }

    /// A background round of the derived keeper at `confirmed`.
    fn round(
        &self,
        derived: &Derived,
        confirmed: u64,
    ) -> Round<impl std::future::Future<Output = Result<(), tokio_postgres::Error>> + Send + 'static>
    {
        Round {
            client: Arc::clone(&self.client),
            table: self.table.clone(),
            slot: self.slot.clone(),
            system: self.system.clone(),
            outbox: derived.outbox.clone(),
            publication: derived.publication.clone(),
            wal: derived.wal,
            cycle: Arc::clone(&derived.cycle),
            position: self.write(confirmed),
        }
    }

    fn write(
        &self,
        lsn: u64,
    ) -> impl std::future::Future<Output = Result<(), tokio_postgres::Error>> + Send + 'static {
        let client = Arc::clone(&self.client);
        // An LSN prints as hex digits and a slash only.
        let sql = self.sql.replacen("{lsn}", &format_lsn(lsn), 1);
        async move { client.batch_execute(&sql).await }
    }
}

fn warn_unkept(error: &tokio_postgres::Error) {
    tracing::warn!(error = %crate::report::Chain(error), "cannot keep the confirmed position; a PostgreSQL restart may send published events again");
}

/// `outbox_relay_derived_lag_seconds`: how old the vouched pair is (−1: none).
fn lag_gauge(vouched_at: Option<f64>) {
    let lag = vouched_at.map_or(-1.0, |at| {
        (crate::time::unix_ms() as f64 / 1000.0 - at).max(0.0)
    });
    crate::metrics::get().derived_lag.set(lag);
}

/// One background round of a derived keeper ([`Keeper::offer`]).
struct Round<F> {
    client: Arc<tokio_postgres::Client>,
    table: String,
    slot: String,
    system: System,
    outbox: String,
    publication: String,
    wal: WalLayout,
    cycle: Arc<Mutex<Cycle>>,
    /// Writes the confirmed position alone.
    position: F,
}

impl<F> Round<F>
where
    F: std::future::Future<Output = Result<(), tokio_postgres::Error>> + Send,
{
    async fn run(
        self,
        confirmed: u64,
        finished: u64,
        take: bool,
        store: Option<Candidate>,
        position_due: bool,
        tidy: bool,
    ) {
        let client = Arc::clone(&self.client);
        let outbox = self.outbox.clone();
        let table = self.table.clone();
        let slot = self.slot.clone();
        let cycle = Arc::clone(&self.cycle);
        let wal = self.wal;
        let storing = store.is_some();
        let kept = match store {
            Some(candidate) => {
                self.store_or_write(confirmed, candidate, position_due)
                    .await
            }
            None if position_due => self.position.await,
            None => Ok(()),
        };
        if let Err(error) = kept {
            if storing {
                cycle.lock().expect("cycle").dropped();
            }
            warn_unkept(&error);
            return;
        }
        if take {
            match take_candidate(&client, wal).await {
                Ok(candidate) => cycle.lock().expect("cycle").took(candidate, finished),
                Err(error) => {
                    tracing::warn!(error = %crate::report::Chain(&error), "cannot take a snapshot to vouch for");
                }
            }
        }
        if tidy {
            if let Err(error) = close_holes(&client, &table, &slot, &outbox, &cycle).await {
                tracing::warn!(error = %crate::report::Chain(&error), "cannot close the derived lifecycle's holes; trying again later");
            }
        }
    }

    /// Store `candidate` with `confirmed` when the server has flushed its W
    /// (then the candidate is gone); otherwise write the position alone when
    /// `position_due`.
    async fn store_or_write(
        self,
        confirmed: u64,
        candidate: Candidate,
        position_due: bool,
    ) -> Result<(), tokio_postgres::Error> {
        let w = format_lsn(candidate.lsn);
        let flushed: bool = self
            .client
            .query_one(
                "SELECT pg_current_wal_flush_lsn() >= $1::text::pg_lsn",
                &[&w],
            )
            .await?
            .get(0);
        // After the flush check: a publication and a storage unchanged since
        // the last look carried the table over every commit the pair vouches
        // for.
        let now = publication_identity(&self.client, &self.publication, &self.outbox).await?;
        let seen = self.cycle.lock().expect("cycle").identity.clone();
        let opened = match now {
            None => {
                open_hole(
                    &self.client,
                    &self.table,
                    &self.slot,
                    &self.publication,
                    &self.outbox,
                    &self.cycle,
                )
                .await?;
                true
            }
            Some(now) if seen.as_deref() != Some(now.as_str()) => {
                if changed(seen.as_deref(), Some(&now)) {
                    close_behind(&self.client, &self.table, &self.slot, &self.cycle, now).await?;
                    // Its S was taken before the look: a fresh one is owed.
                    self.cycle.lock().expect("cycle").dropped();
                    true
                } else {
                    // A rewritten relation left the tree: nothing to fear
                    // from it.
                    self.cycle.lock().expect("cycle").identity = Some(now);
                    false
                }
            }
            Some(_) => false,
        };
        if opened {
            return if position_due {
                self.position.await
            } else {
                Ok(())
            };
        }
        if !flushed {
            self.cycle.lock().expect("cycle").dropped();
            return if position_due {
                self.position.await
            } else {
                Ok(())
            };
        }
        // Sees every id the vouched S saw: a reader's ranges, read from the
        // stored S a statement before, hold every row the new one leaves
        // unpublished ([`derived::Ranges`]). A later snapshot does, but for
        // what the last pair of a session was made to see while it was in
        // progress ([`Cycle::last`]).
        let candidate = match &self.cycle.lock().expect("cycle").vouched {
            Some(vouched) => Candidate {
                snapshot: candidate.snapshot.joined(vouched),
                ..candidate
            },
            None => candidate,
        };
        tracing::debug!(snapshot = %candidate.snapshot, lsn = %format_lsn(candidate.lsn), confirmed = %format_lsn(confirmed), "derived lifecycle: a pair stored");
        store_pair(
            &self.client,
            &self.table,
            &self.slot,
            &self.system,
            confirmed,
            &candidate,
        )
        .await?;
        let mut cycle = self.cycle.lock().expect("cycle");
        cycle.vouched = Some(candidate.snapshot);
        cycle.vouched_at = Some(crate::time::unix_ms() as f64 / 1000.0);
        lag_gauge(cycle.vouched_at);
        Ok(())
    }
}

/// The publication no longer carries the outbox table: rows committed
/// from now on are not streamed, yet they would be visible in every later
/// snapshot. Open a hole from the vouched S to [`derived::OPEN`] (every
/// later transaction), durably, once: nothing after S is derived
/// published until a session that finds the table carried again narrows
/// it to a snapshot taken then ([`prepare`]); the poller publishes the
/// rows in it and the stream marks those it publishes.
async fn open_hole(
    client: &tokio_postgres::Client,
    table: &str,
    slot: &str,
    publication: &str,
    outbox: &str,
    cycle: &Mutex<Cycle>,
) -> Result<(), tokio_postgres::Error> {
    let (holes, first) = {
        let cycle = cycle.lock().expect("cycle");
        let from = cycle
            .vouched
            .clone()
            .unwrap_or_else(|| Snapshot::parse(BEGINNING).expect("BEGINNING is a snapshot"));
        let mut holes = (*cycle.holes).clone();
        if !cycle.opened {
            holes.0.push(Hole {
                from,
                to: Snapshot::parse(derived::OPEN).expect("OPEN is a snapshot"),
            });
        }
        (holes, !cycle.opened)
    };
    if !first {
        return Ok(());
    }
    write_holes(client, table, slot, 0, &holes, false, None).await?;
    tracing::error!(
        slot = %slot, publication = %publication, table = %outbox,
        "the publication no longer carries the outbox table, or a partition of it writes no WAL \
         (UNLOGGED, or a foreign table): rows written now are not streamed; \
         nothing after the last vouched snapshot is derived published until the table is in the \
         publication again and the relay restarted (the poller publishes those rows after its grace)"
    );
    let mut cycle = cycle.lock().expect("cycle");
    cycle.opened = true;
    cycle.set_holes(holes);
    Ok(())
}

/// The publication or the outbox's storage changed since the last look
/// (`now` is what it reads as now, still carrying the table): rows committed
/// in between may not have been streamed (the table was out of the
/// publication for a while, or a partition went `UNLOGGED` and back, which
/// rewrites it), and every later snapshot sees them. Every such commit came
/// before this look, and after the look that stored the vouched S (that one
/// found the identity unchanged), so a hole from the vouched S (or
/// [`BEGINNING`]) to a snapshot taken now ([`hole_snapshot`]) holds them:
/// the poller publishes them, the stream marks what it publishes in it.
/// Appended to the row's arrays, never written over them (another session
/// may have written them), durably; `now` is the new baseline.
async fn close_behind(
    client: &tokio_postgres::Client,
    table: &str,
    slot: &str,
    cycle: &Mutex<Cycle>,
    now: String,
) -> Result<(), tokio_postgres::Error> {
    let to = hole_snapshot(client).await?;
    let from = cycle
        .lock()
        .expect("cycle")
        .vouched
        .clone()
        .unwrap_or_else(|| Snapshot::parse(BEGINNING).expect("BEGINNING is a snapshot"));
    client
        .batch_execute(&format!(
            "BEGIN; SET LOCAL synchronous_commit = local; \
             UPDATE {table} SET hole_from = hole_from || {from}::pg_snapshot, \
                 hole_to = hole_to || {to}::pg_snapshot, publication_id = {now} \
             WHERE slot_name = {slot} AND hole_to IS NOT NULL; \
             COMMIT",
            from = quote_literal(&from.to_string()),
            to = quote_literal(&to.to_string()),
            now = quote_literal(&now),
            slot = quote_literal(slot),
        ))
        .await?;
    tracing::warn!(
        slot = %slot, from = %from, to = %to,
        "derived lifecycle: the publication or the outbox table's storage changed since the last \
         look (a partition set UNLOGGED and back, TRUNCATE, VACUUM FULL, CLUSTER, or the table taken \
         out of the publication and put back): rows committed meanwhile may not have been streamed; \
         a hole opened over them (the poller publishes them, at least once)"
    );
    let mut cycle = cycle.lock().expect("cycle");
    let mut holes = (*cycle.holes).clone();
    holes.0.push(Hole { from, to });
    cycle.set_holes(holes);
    cycle.identity = Some(now);
    Ok(())
}

/// A candidate pair: S = the statement's own snapshot (taken before it
/// runs), then W = the WAL's insert position, read while it runs, as the end
/// of the last record on a server laid out as `wal`
/// ([`WalLayout::last_record_end`]: a walsender reports no further on an
/// idle server). Every transaction visible in S has its commit record
/// before W.
async fn take_candidate(
    client: &tokio_postgres::Client,
    wal: WalLayout,
) -> Result<Candidate, tokio_postgres::Error> {
    let row = client
        .query_one(
            "SELECT pg_current_snapshot()::text, pg_current_wal_insert_lsn()::text",
            &[],
        )
        .await?;
    let snapshot = Snapshot::parse(row.get(0)).expect("pg_current_snapshot() prints a snapshot");
    let insert = parse_lsn(row.get(1)).expect("pg_current_wal_insert_lsn() prints an LSN");
    Ok(Candidate {
        snapshot,
        lsn: wal.last_record_end(insert),
    })
}

/// Store the pair with the confirmed position, in one transaction with a
/// synchronous commit.
async fn store_pair(
    client: &tokio_postgres::Client,
    table: &str,
    slot: &str,
    system: &System,
    confirmed: u64,
    pair: &Candidate,
) -> Result<(), tokio_postgres::Error> {
    // One simple query (literals, all of them the relay's own): no
    // statement of another task on this connection can fall inside it.
    client
        .batch_execute(&format!(
            "BEGIN; SET LOCAL synchronous_commit = local; \
             INSERT INTO {table} AS p (slot_name, system_identifier, timeline, database_oid, confirmed_lsn, \
                 updated_at, snapshot, snapshot_lsn, snapshot_at) \
             SELECT {slot}, {system}, {timeline}, oid, {confirmed}::pg_lsn, now(), {s}::pg_snapshot, \
                 {w}::pg_lsn, now() \
             FROM pg_database WHERE datname = current_database() \
             ON CONFLICT (slot_name) DO UPDATE SET system_identifier = excluded.system_identifier, \
                 timeline = excluded.timeline, database_oid = excluded.database_oid, \
                 confirmed_lsn = excluded.confirmed_lsn, updated_at = excluded.updated_at, \
                 snapshot = excluded.snapshot, snapshot_lsn = excluded.snapshot_lsn, \
                 snapshot_at = excluded.snapshot_at; \
             COMMIT",
            slot = quote_literal(slot),
            system = quote_literal(&system.id),
            timeline = system.timeline,
            confirmed = quote_literal(&format_lsn(confirmed)),
            s = quote_literal(&pair.snapshot.to_string()),
            w = quote_literal(&format_lsn(pair.lsn)),
        ))
        .await
}

/// Close every hole with no `PENDING` row left in it (one index range on
/// `<table>_txid_idx` a hole, stopping at its first row), merge beyond
/// [`MAX_HOLES`], and write the holes when they changed.
async fn close_holes(
    client: &tokio_postgres::Client,
    table: &str,
    slot: &str,
    outbox: &str,
    cycle: &Mutex<Cycle>,
) -> Result<(), tokio_postgres::Error> {
    let holes = {
        let mut cycle = cycle.lock().expect("cycle");
        cycle.tidied = Instant::now();
        Arc::clone(&cycle.holes)
    };
    let x = derived::COLUMN;
    // Open while a transaction begun before `to` is in progress (it may have
    // written its commit record before the slot's consistent point, and its
    // rows are not visible yet: [`derived::Hole`]), or while a PENDING row
    // of one is left. One statement, one snapshot: once the first holds no
    // more, every such transaction's rows are visible to the second.
    let sql = format!(
        "SELECT pg_snapshot_xmin(pg_current_snapshot()) < pg_snapshot_xmax($2::text::pg_snapshot) \
             OR EXISTS (SELECT 1 FROM {outbox} o WHERE o.publish_state = 'PENDING' \
             AND o.{x} >= pg_snapshot_xmin($1::text::pg_snapshot) AND o.{x} < pg_snapshot_xmax($2::text::pg_snapshot) \
             AND NOT pg_visible_in_snapshot(o.{x}, $1::text::pg_snapshot))"
    );
    let mut open = Holes::default();
    let unbounded = Snapshot::parse(derived::OPEN).expect("OPEN is a snapshot");
    for hole in &holes.0 {
        // Rows may still come into a hole left open (the publication does
        // not carry the table): only a session's start narrows it.
        if hole.to == unbounded {
            open.0.push(hole.clone());
            continue;
        }
        let (from, to) = (hole.from.to_string(), hole.to.to_string());
        let pending: bool = client.query_one(&sql, &[&from, &to]).await?.get(0);
        if pending {
            open.0.push(hole.clone());
        } else {
            tracing::info!(slot = %slot, from = %from, to = %to, "derived lifecycle: a hole closed (no transaction of it in progress, no PENDING row left in it)");
        }
    }
    merge(&mut open);
    if open == *holes {
        return Ok(());
    }
    let from = snapshot_array(open.0.iter().map(|h| h.from.to_string()));
    let to = snapshot_array(open.0.iter().map(|h| h.to.to_string()));
    // Only over the holes this round read: a round outlives its session
    // (its statements run on), and a later session, of this relay or of one
    // that took the slot over, may have opened a hole meanwhile; writing the
    // arrays read before it would erase that hole. Compared as text, which
    // PostgreSQL prints as the relay parses and prints it.
    let (was_from, was_to): (Vec<String>, Vec<String>) = holes
        .0
        .iter()
        .map(|h| (h.from.to_string(), h.to.to_string()))
        .unzip();
    // A local commit, as the pair's (a synchronous standby away would hold
    // the round, and the connection, at it), in one simple query of
    // literals, so no statement of another task falls inside it.
    let written: u64 = client
        .simple_query(&format!(
            "BEGIN; SET LOCAL synchronous_commit = local; \
             UPDATE {table} SET hole_from = {from}, hole_to = {to} \
             WHERE slot_name = {slot} AND hole_from::text[] = {was_from} AND hole_to::text[] = {was_to}; \
             COMMIT",
            slot = quote_literal(slot),
            was_from = literal_array(was_from.into_iter(), "text"),
            was_to = literal_array(was_to.into_iter(), "text"),
        ))
        .await?
        .iter()
        .map(|m| match m {
            tokio_postgres::SimpleQueryMessage::CommandComplete(rows) => *rows,
            _ => 0,
        })
        .sum();
    if written == 0 {
        tracing::warn!(
            slot = %slot,
            "derived lifecycle: the position row's holes changed since this session read them (another \
             session of the slot wrote them); they are left as they are, and this session closes none"
        );
        cycle.lock().expect("cycle").holes_taken = true;
        return Ok(());
    }
    cycle.lock().expect("cycle").set_holes(open);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_identity_changes_with_the_publication_or_a_new_storage_not_with_one_gone() {
        let seen = Some("p1:700:truefalse,r2:701,s16384:16390");
        // The same.
        assert!(!changed(seen, seen));
        // The publication's version moved, or its membership row.
        assert!(changed(seen, Some("p1:720:truefalse,r2:701,s16384:16390")));
        assert!(changed(seen, Some("p1:700:truefalse,r9:730,s16384:16390")));
        // A relation rewritten again (SET UNLOGGED and back), or one more
        // rewritten.
        assert!(changed(seen, Some("p1:700:truefalse,r2:701,s16384:16402")));
        assert!(changed(
            seen,
            Some("p1:700:truefalse,r2:701,s16384:16390,s16500:16511")
        ));
        // A rewritten partition dropped: no rows of the outbox can be in it.
        assert!(!changed(seen, Some("p1:700:truefalse,r2:701")));
        // Not carried now, or carried again.
        assert!(changed(seen, None));
        assert!(changed(None, seen));
        assert!(!changed(None, None));
        // A row from before the storage was read (an upgrade): once.
        assert!(changed(Some("p1:700:truefalse,r2:701"), seen));
    }

    fn system() -> System {
        System {
            id: "7300000000000000001".into(),
            timeline: 1,
            wal_end: 0x5000,
        }
    }

    fn kept(lsn: u64) -> Kept {
        Kept {
            lsn,
            system_id: "7300000000000000001".into(),
            timeline: 1,
            same_database: true,
        }
    }

    #[test]
    fn the_later_position_wins_only_when_its_provenance_is_certain() {
        let s = system();
        // Nothing kept, or kept behind the slot: the slot, nothing to say.
        assert_eq!(choose(0x3000, None, &s).lsn, 0x3000);
        let behind = choose(0x3000, Some(&kept(0x2000)), &s);
        assert_eq!(
            (behind.lsn, behind.kept, behind.doubt),
            (0x3000, false, false)
        );
        // Kept ahead of the slot, same system, timeline, database, within the WAL.
        let ahead = choose(0x3000, Some(&kept(0x4000)), &s);
        assert_eq!((ahead.lsn, ahead.kept, ahead.doubt), (0x4000, true, false));
        // Each doubt: the slot, with a warning that says which.
        let promoted = System {
            timeline: 2,
            ..system()
        };
        let cases = [
            (
                Kept {
                    system_id: "7300000000000000002".into(),
                    ..kept(0x4000)
                },
                &s,
                "another PostgreSQL system",
            ),
            (kept(0x4000), &promoted, "timeline 1, the server is on 2"),
            (
                Kept {
                    same_database: false,
                    ..kept(0x4000)
                },
                &s,
                "another database",
            ),
            (kept(0x6000), &s, "ahead of the server's WAL"),
        ];
        for (kept, system, words) in cases {
            let c = choose(0x3000, Some(&kept), system);
            assert_eq!((c.lsn, c.kept, c.doubt), (0x3000, false, true), "{words}");
            assert!(c.why.as_deref().unwrap().contains(words), "{:?}", c.why);
        }
    }

    #[test]
    fn beyond_the_most_holes_the_two_oldest_merge_into_one_span() {
        let snap = |x: u64| Snapshot::parse(&format!("{x}:{x}:")).unwrap();
        let mut holes = Holes(
            (0..MAX_HOLES as u64 + 2)
                .map(|k| Hole {
                    from: snap(100 * k + 10),
                    to: snap(100 * k + 50),
                })
                .collect(),
        );
        assert_eq!(merge(&mut holes), 2);
        assert_eq!(holes.0.len(), MAX_HOLES);
        // The first now spans the first three; a row between them is in it.
        assert_eq!(holes.0[0].from, snap(10));
        assert_eq!(holes.0[0].to, snap(250));
        assert!(holes.needs_mark(Some(80)) && holes.needs_mark(Some(180)));
        assert_eq!(holes.0[1].from, snap(310));
        assert_eq!(merge(&mut holes), 0);
        // The slot's boundary is never merged: the two after it are.
        let mut holes = Holes(
            std::iter::once(Hole {
                from: Snapshot::parse(BEGINNING).unwrap(),
                to: snap(5),
            })
            .chain((1..MAX_HOLES as u64 + 1).map(|k| Hole {
                from: snap(100 * k + 10),
                to: snap(100 * k + 50),
            }))
            .collect(),
        );
        assert_eq!(merge(&mut holes), 1);
        assert_eq!(holes.0[0].to, snap(5));
        assert_eq!((holes.0[1].from.xmin, holes.0[1].to.xmin), (110, 250));
        assert!(
            !holes.needs_mark(Some(60)),
            "between the boundary and the next hole"
        );
    }
}
