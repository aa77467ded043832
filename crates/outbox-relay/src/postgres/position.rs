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

use std::sync::Arc;
use std::time::Duration;

use crate::postgres::lsn::{format_lsn, parse_lsn};

/// The name of the position table of outbox table `table`.
pub(crate) fn table_name(table: &str) -> String {
    format!("{table}_position")
}

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

/// Writes the confirmed position to the table as the session goes.
pub(crate) struct Keeper {
    client: Arc<tokio_postgres::Client>,
    sql: String,
    slot: String,
    system: System,
    /// The last position written (or being written).
    written: u64,
    /// Events finished when it was written.
    finished_then: u64,
    writing: Option<tokio::task::JoinHandle<()>>,
}

impl Keeper {
    /// A keeper of `slot`'s position in `table` (schema-qualified, quoted)
    /// on `system`, starting at `start`.
    pub(crate) fn new(
        client: Arc<tokio_postgres::Client>,
        table: &str,
        slot: &str,
        system: System,
        start: u64,
        finished: u64,
    ) -> Self {
        let sql = format!(
            "INSERT INTO {table} AS p (slot_name, system_identifier, timeline, database_oid, confirmed_lsn, updated_at) \
             SELECT $1, $2, $3, oid, $4::text::pg_lsn, now() FROM pg_database WHERE datname = current_database() \
             ON CONFLICT (slot_name) DO UPDATE SET system_identifier = excluded.system_identifier, \
                 timeline = excluded.timeline, database_oid = excluded.database_oid, \
                 confirmed_lsn = excluded.confirmed_lsn, updated_at = excluded.updated_at"
        );
        Self {
            client,
            sql,
            slot: slot.to_owned(),
            system,
            written: start,
            finished_then: finished,
            writing: None,
        }
    }

    /// The session confirmed `confirmed` with `finished` events finished so
    /// far: written in the background when events were finished since the
    /// last write and the previous write is done (the session offers it with
    /// each status update: at most every 200 ms while events finish, else
    /// once per status interval).
    pub(crate) fn offer(&mut self, confirmed: u64, finished: u64) {
        if confirmed <= self.written || finished == self.finished_then {
            return;
        }
        if self.writing.as_ref().is_some_and(|w| !w.is_finished()) {
            return;
        }
        self.written = confirmed;
        self.finished_then = finished;
        let write = self.write(confirmed);
        self.writing = Some(tokio::spawn(async move {
            if let Err(error) = write.await {
                tracing::warn!(error = %crate::report::Chain(&error), "cannot keep the confirmed position; a PostgreSQL restart may send published events again");
            }
        }));
    }

    /// Write `confirmed` and wait for it (a graceful stop), within `limit`.
    pub(crate) async fn finish(mut self, confirmed: u64, limit: Duration) {
        if let Some(writing) = self.writing.take() {
            let _ = tokio::time::timeout(limit, writing).await;
        }
        if confirmed <= self.written {
            return;
        }
        match tokio::time::timeout(limit, self.write(confirmed)).await {
            Ok(Ok(())) => {
                tracing::debug!(lsn = %format_lsn(confirmed), "final position kept");
            }
            Ok(Err(error)) => {
                tracing::warn!(error = %crate::report::Chain(&error), "cannot keep the final position");
            }
            Err(_) => tracing::warn!("the final position could not be kept in time"),
        }
    }

    fn write(
        &self,
        lsn: u64,
    ) -> impl std::future::Future<Output = Result<(), tokio_postgres::Error>> + Send + 'static {
        let client = Arc::clone(&self.client);
        let sql = self.sql.clone();
        let slot = self.slot.clone();
        let system = self.system.id.clone();
        let timeline = i32::try_from(self.system.timeline).unwrap_or(i32::MAX);
        let lsn = format_lsn(lsn);
        async move {
            client
                .execute(&sql, &[&slot, &system, &timeline, &lsn])
                .await
                .map(drop)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
