//! The derived lifecycle (`on_published = "derive"`): a row's state read
//! from a snapshot the relay vouched for, without writing the row.
//!
//! # The rule
//!
//! Every row carries its writing transaction's top-level id in
//! [`COLUMN`] (`xid8 DEFAULT pg_current_xact_id()`: the top-level id also
//! inside savepoints, unlike the `xmin` system column). The relay takes, on
//! an ordinary connection, a snapshot S (`pg_current_snapshot()`) and *then*
//! W = `pg_current_wal_insert_lsn()` (as the end of the last record, which
//! is where a walsender stops on an idle server:
//! `crate::postgres::lsn::WalLayout::last_record_end`). PostgreSQL inserts a transaction's
//! commit record before the transaction leaves the proc array (also for
//! `COMMIT PREPARED` and `synchronous_commit = off`), so every transaction
//! visible in S has its commit record before W. Once the relay's confirmed
//! position passes W (every transaction committed before it was published
//! or recorded) and `pg_current_wal_flush_lsn() >= W`, the pair is stored,
//! with a synchronous commit, in the slot's row of the position table. A row
//! is then **published** when:
//!
//! * its `publish_state` is still `PENDING` (explicit states win: FAILED,
//!   DEAD, SKIPPED, and PUBLISHED written by the poller or `replay`);
//! * its id is not NULL (rows from before the migration keep explicit states);
//! * its id is visible in the vouched S;
//! * its id is in no *hole* (below), and the pair's provenance holds (the
//!   same system identifier; S's xmax not above the server's current one).
//!
//! # Holes
//!
//! A hole is a span of transactions the stream may not have sent: begun
//! before its `to` snapshot was taken, and not visible in its `from`
//! snapshot ([`Hole`]). The first hole is the slot's boundary: `from` is
//! [`BEGINNING`] (nothing visible), `to` a snapshot taken after the slot
//! existed (every transaction the slot will not stream wrote its commit
//! record before the consistent point, so it began before that snapshot,
//! visible there or, waiting for a synchronous standby, not yet). Another
//! is opened, from the vouched S to a fresh snapshot, when
//! the relay cannot vouch for what happened in between: the slot was
//! (re)created, or it is ahead of the kept position at start (moved by
//! something else, or a crash before the position was kept). Rows in a hole
//! are never derived published: the poller publishes them (after its grace,
//! once the stream has passed them) and the stream marks those it publishes
//! itself ([`Holes::needs_mark`]); so they end with explicit states, and a
//! hole with no transaction of it in progress and no `PENDING` row left is
//! closed.
//!
//! Every reader (the poller, retention, `status`, `replay --state`, the
//! metrics and the `<table>_state` view that `setup` creates) uses the SQL
//! built here, so they agree on one rule.

/// The column holding the writing transaction's top-level id.
pub(crate) const COLUMN: &str = "relay_txid";

/// PostgreSQL's `xid8` type oid.
pub(crate) const XID8_OID: u32 = 5069;

/// A snapshot in which no transaction is visible: the `from` of the slot's
/// boundary hole.
pub(crate) const BEGINNING: &str = "1:1:";

/// A snapshot in which every transaction is visible: the `to` of a hole
/// opened while the publication did not carry the table, until a session
/// that finds it carried again narrows it (`position::prepare`).
pub(crate) const OPEN: &str = "9223372036854775807:9223372036854775807:";

/// How far past a snapshot's xmax [`Snapshot::seeing`] raises it for a
/// transaction begun after the snapshot: each id skipped is listed in
/// progress. A transaction it is given that began after the snapshot
/// committed in the instant between the snapshot and the WAL read beside
/// it: a few ids away at most.
const SEEING_AHEAD_MAX: u64 = 1024;

/// Whether a 64-bit id is one a transaction can have: its low 32 bits are
/// none of PostgreSQL's special ids (0 to 2), which it skips at each wrap
/// and which `pg_snapshot`'s input refuses as xmax.
fn normal(full: u64) -> bool {
    full as u32 >= 3
}

/// The first id a transaction can have after `full`.
fn next_normal(full: u64) -> u64 {
    let next = full + 1;
    if normal(next) {
        next
    } else {
        (next & !u64::from(u32::MAX)) | 3
    }
}

/// A `pg_snapshot`: what `pg_visible_in_snapshot` needs of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Snapshot {
    /// Every id below is finished.
    pub xmin: u64,
    /// Every id at or above is not visible.
    pub xmax: u64,
    /// Ids between that were in progress.
    pub xip: Vec<u64>,
}

impl Snapshot {
    /// Parse PostgreSQL's text form, `xmin:xmax:xip,xip,…`.
    pub(crate) fn parse(text: &str) -> Option<Self> {
        let mut parts = text.trim().splitn(3, ':');
        let xmin = parts.next()?.parse().ok()?;
        let xmax = parts.next()?.parse().ok()?;
        let xip = match parts.next()? {
            "" => Vec::new(),
            list => list
                .split(',')
                .map(|x| x.parse().ok())
                .collect::<Option<Vec<u64>>>()?,
        };
        (xmin <= xmax).then_some(Self { xmin, xmax, xip })
    }

    /// `pg_visible_in_snapshot(xid, self)`.
    pub(crate) fn visible(&self, xid: u64) -> bool {
        xid < self.xmin || (xid < self.xmax && !self.xip.contains(&xid))
    }

    /// This snapshot with its xmax raised to `upper`, every id from its xmax
    /// to `upper` in progress: what it sees is unchanged. A snapshot's xmax
    /// is one past the last *completed* id, so a transaction begun before it
    /// and still in progress may be at or above it; an id taken after the
    /// snapshot (`upper`) bounds every transaction begun before it.
    pub(crate) fn widened(mut self, upper: u64) -> Self {
        if upper > self.xmax {
            self.xip.extend((self.xmax..upper).filter(|&x| normal(x)));
            self.xmax = upper;
        }
        self
    }

    /// This snapshot, seeing as well every id `other` sees: an id is in
    /// progress only when it is in both (xmax raised to `other`'s, the ids
    /// between in progress unless `other` sees them). Sound when both
    /// vouch for what they see.
    pub(crate) fn joined(self, other: &Snapshot) -> Self {
        let mut joined = self.widened(other.xmax);
        joined.xip.retain(|&x| !other.visible(x));
        joined
    }

    /// [`Snapshot::visible`] for the 32-bit id the replication protocol
    /// sends, read as PostgreSQL reads short ids: within 2^31 of `xmax`,
    /// before it or at and after it (begun after the snapshot: not visible).
    /// The stream's ids are of transactions it just received, well within.
    pub(crate) fn visible_xid32(&self, xid: u32) -> bool {
        self.full_xid(xid).is_some_and(|full| self.visible(full))
    }

    /// The 64-bit id of the stream's 32-bit `xid`, read within 2^31 of
    /// `xmax` (`None`: before the first id).
    fn full_xid(&self, xid: u32) -> Option<u64> {
        // Wrapping difference from xmax's low bits, as a signed distance.
        let distance = i64::from(xid.wrapping_sub(self.xmax as u32) as i32);
        self.xmax.checked_add_signed(distance)
    }

    /// This snapshot, seeing besides the committed transactions `xids`
    /// (32-bit, as the stream sends them) and nothing else more: each is
    /// taken out of the in-progress list, and one begun after the snapshot
    /// (at or past xmax, by less than [`SEEING_AHEAD_MAX`] ids) raises xmax
    /// past it with every id skipped in progress ([`Snapshot::widened`]). One
    /// further ahead is left unseen: what the snapshot sees only grows by
    /// the ids given. xmin stays: `pg_snapshot` takes an xmin below its
    /// least in-progress id, and a reader that bounds a scan by it reads a
    /// little more, never less.
    pub(crate) fn seeing(self, xids: impl IntoIterator<Item = u32>) -> Self {
        let limit = self.xmax + SEEING_AHEAD_MAX;
        let seen: std::collections::HashSet<u64> = xids
            .into_iter()
            .filter_map(|xid| self.full_xid(xid))
            .filter(|&full| full < limit)
            .collect();
        let upper = seen.iter().map(|&full| next_normal(full)).max();
        let mut seeing = match upper {
            Some(upper) => self.widened(upper),
            None => self,
        };
        seeing.xip.retain(|x| !seen.contains(x));
        seeing
    }
}

impl std::fmt::Display for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}:", self.xmin, self.xmax)?;
        for (i, x) in self.xip.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{x}")?;
        }
        Ok(())
    }
}

/// A span the stream may not have sent: the transactions begun before `to`
/// was taken (below its xmax, which [`Snapshot::widened`] raised to an id
/// taken after it) that `from` does not see.
///
/// Begun before `to`, not only visible in it: a transaction may write its
/// commit record and stay in progress for as long as synchronous replication
/// waits for a standby. Committed before the slot's consistent point, it is
/// never streamed, yet it was not visible when `to` was taken; bounded by
/// visibility, a later snapshot would vouch for it once it is. Bounded by
/// xmax, it is in the hole whether it committed before `to` or after, and a
/// hole is not closed while any transaction begun before `to` is in
/// progress ([`crate::postgres::position`]'s tidying). A transaction in
/// progress at `to` that commits later is streamed and costs one mark.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hole {
    /// What was vouched for before it ([`BEGINNING`] for the boundary).
    pub from: Snapshot,
    /// Taken once the slot streams everything after it.
    pub to: Snapshot,
}

impl Hole {
    /// Whether transaction `xid` lies in the hole.
    pub(crate) fn holds(&self, xid: u64) -> bool {
        xid < self.to.xmax && !self.from.visible(xid)
    }
}

/// A slot's holes, as the stream knows them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Holes(pub Vec<Hole>);

impl Holes {
    /// Whether the stream must mark a row it published explicitly: its
    /// transaction id is unknown (a row from before the migration) or lies
    /// in a hole, where no snapshot may vouch for it.
    pub(crate) fn needs_mark(&self, txid: Option<u64>) -> bool {
        txid.is_none_or(|x| self.0.iter().any(|h| h.holds(x)))
    }

    /// Read the position table's `hole_from` / `hole_to` arrays (as text).
    pub(crate) fn parse(from: &[String], to: &[String]) -> Option<Self> {
        if from.len() != to.len() {
            return None;
        }
        from.iter()
            .zip(to)
            .map(|(f, t)| {
                Some(Hole {
                    from: Snapshot::parse(f)?,
                    to: Snapshot::parse(t)?,
                })
            })
            .collect::<Option<Vec<_>>>()
            .map(Self)
    }
}

/// The name of the position table of outbox table `table`, where
/// [`crate::postgres::position`] keeps the confirmed position and the
/// derived lifecycle its pair and holes.
pub(crate) fn position_table(table: &str) -> String {
    format!("{table}_position")
}

/// Columns of the position table the derived lifecycle adds (nullable, so
/// `ALTER TABLE … ADD COLUMN IF NOT EXISTS` migrates a table in place):
/// the vouched snapshot, its W, when it was stored, the holes, and the
/// publication as a session found it ([`publication_identity`]).
pub(crate) const POSITION_COLUMNS: [(&str, &str); 6] = [
    ("snapshot", "pg_snapshot"),
    ("snapshot_lsn", "pg_lsn"),
    ("snapshot_at", "timestamptz"),
    ("hole_from", "pg_snapshot[]"),
    ("hole_to", "pg_snapshot[]"),
    ("publication_id", "text"),
];

/// SQL boolean on `pg_class` row `c`: the relation writes no WAL (unlogged,
/// temporary, or a foreign table), so its rows are never streamed.
pub(crate) const WRITES_NO_WAL: &str = "(c.relpersistence <> 'p' OR c.relkind = 'f')";

/// SQL: the relations of `table`'s partition tree (`table` an SQL
/// expression of type `regclass`), as a subquery of one column, `relid`:
/// the table itself and, when it is partitioned, every partition at every
/// level. (`pg_partition_tree` alone lists nothing for a plain table.)
pub(crate) fn tree(table: &str) -> String {
    format!("(SELECT {table} AS relid UNION SELECT relid FROM pg_partition_tree({table}))")
}

/// SQL (`$1` the publication's name, `$2` the outbox table, qualified and
/// quoted): text that changes whenever what the publication sends of the
/// table may have changed, NULL when it does not carry the table. The
/// catalog rows that decide it (the publication's, the table's or an
/// ancestor's membership, its schema's on 15+) each by oid and by the xmin
/// of their version: taking the table out and putting it back makes a new
/// membership row, and every `ALTER PUBLICATION … SET` a new version.
/// Rows committed while the publication did not carry the table are never
/// streamed (the walsender decodes with the catalog as it was), yet later
/// snapshots see them: a change between two looks opens a hole.
///
/// The storage too: every relation of the table's partition tree that was
/// rewritten since it was created (its `relfilenode` is no longer its oid),
/// by its new `relfilenode`. A partition (or a table published by schema)
/// set `UNLOGGED`, loaded and set `LOGGED` again, even in one transaction,
/// wrote its rows without WAL, so they are never streamed, and reads the
/// same as before but for this: `SET LOGGED` rewrites it. So do `TRUNCATE`,
/// `VACUUM FULL` and `CLUSTER`, which cost a hole as well. A partition
/// created and never rewritten (pg_partman's) changes nothing.
///
/// NULL too while the table or one of its partitions writes no WAL (an
/// `UNLOGGED` partition, which PostgreSQL allows under a published root, or
/// a foreign table as a partition): its rows are never streamed, yet carry
/// ids that snapshots see. The relay then vouches for nothing new, as for a
/// table the publication does not carry.
pub(crate) fn publication_identity(namespaces: bool) -> String {
    let no_wal = WRITES_NO_WAL;
    let schemas = if namespaces {
        " UNION ALL SELECT 'n' || n.oid || ':' || n.xmin FROM pg_publication_namespace n \
           WHERE n.pnpubid = p.oid AND n.pnnspid IN (SELECT c.relnamespace FROM pg_class c WHERE c.oid IN (SELECT r FROM rels))"
    } else {
        ""
    };
    let tree = tree("to_regclass($2)");
    format!(
        "WITH rels AS (SELECT to_regclass($2) AS r UNION ALL SELECT relid FROM pg_partition_ancestors(to_regclass($2))) \
         SELECT CASE WHEN EXISTS (SELECT 1 FROM {tree} t JOIN pg_class c ON c.oid = t.relid \
                     WHERE {no_wal}) THEN NULL \
                WHEN EXISTS (SELECT 1 FROM pg_publication_tables t WHERE t.pubname = $1 \
                     AND (t.schemaname, t.tablename) IN (SELECT n.nspname, c.relname \
                         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                         WHERE c.oid IN (SELECT r FROM rels UNION ALL SELECT relid FROM pg_partition_tree(to_regclass($2))))) \
           THEN (SELECT string_agg(x, ',' ORDER BY x) FROM pg_publication p, LATERAL ( \
                   SELECT 'p' || p.oid || ':' || p.xmin || ':' || p.pubinsert || p.puballtables \
                   UNION ALL SELECT 'r' || pr.oid || ':' || pr.xmin FROM pg_publication_rel pr \
                     WHERE pr.prpubid = p.oid AND pr.prrelid IN (SELECT r FROM rels){schemas} \
                   UNION ALL SELECT 's' || c.oid || ':' || c.relfilenode FROM {tree} t \
                     JOIN pg_class c ON c.oid = t.relid WHERE c.relkind = 'r' AND c.relfilenode <> c.oid) AS q(x) \
                 WHERE p.pubname = $1) END"
    )
}

/// SQL: the join that brings the slot's position row in as `p` (`slot` is an
/// SQL expression: a `$n` parameter or a quoted literal; `position` the
/// qualified, quoted position table). A `LEFT JOIN`: without a row nothing
/// is derived published.
pub(crate) fn join(position: &str, slot: &str, p: &str) -> String {
    format!("LEFT JOIN {position} {p} ON {p}.slot_name = {slot}")
}

/// SQL boolean: position row `p` holds a pair the rule may trust: its holes
/// were written (a session prepared the slot), by this PostgreSQL system,
/// and its snapshot is not ahead of the server's transaction ids (as after a
/// restore, before a session's start discards it). NULL without a row.
fn trusted(p: &str) -> String {
    format!(
        "{p}.hole_to IS NOT NULL \
         AND {p}.system_identifier = (SELECT system_identifier::text FROM pg_control_system()) \
         AND pg_snapshot_xmax({p}.snapshot) <= pg_snapshot_xmax(pg_current_snapshot())"
    )
}

/// SQL boolean: row `r` is derived published under position row `p`. Never
/// NULL.
pub(crate) fn published(r: &str, p: &str) -> String {
    let x = format!("{r}.{COLUMN}");
    format!(
        "coalesce({r}.publish_state = 'PENDING' AND {x} IS NOT NULL \
         AND {trusted} \
         AND pg_visible_in_snapshot({x}, {p}.snapshot) \
         AND NOT {in_hole}, \
         false)",
        trusted = trusted(p),
        in_hole = in_hole(r, p),
    )
}

/// SQL boolean: row `r`'s id lies in one of position row `p`'s holes.
pub(crate) fn in_hole(r: &str, p: &str) -> String {
    let x = format!("{r}.{COLUMN}");
    format!(
        "EXISTS (SELECT 1 FROM unnest({p}.hole_from, {p}.hole_to) AS h(f, t) \
                 WHERE {x} < pg_snapshot_xmax(h.t) AND NOT pg_visible_in_snapshot({x}, h.f))"
    )
}

/// SQL text expression: the row's state, derived (`PUBLISHED`) or explicit.
pub(crate) fn state(r: &str, p: &str) -> String {
    format!(
        "CASE WHEN {} THEN 'PUBLISHED' ELSE {r}.publish_state END",
        published(r, p)
    )
}

/// SQL boolean: row `r` is still to publish (`PENDING` and not derived
/// published).
pub(crate) fn pending(r: &str, p: &str) -> String {
    format!(
        "({r}.publish_state = 'PENDING' AND NOT {})",
        published(r, p)
    )
}

/// Where a reader finds, on `<table>_txid_idx`, every row with an id that
/// may not be derived published: the ids not visible in the vouched
/// snapshot S and those in a hole, read from the slot's row
/// ([`Reader::ranges`]) as constants, so the planner estimates each range
/// from the column's statistics.
///
/// An id is not visible in S exactly when it is at or above S's xmax
/// ([`Ranges::after`]) or in progress at S ([`Ranges::in_progress`]): ids
/// below S's xmin are finished and visible, and so are those between xmin
/// and xmax not in progress. Both ranges hold only the rows written since S
/// and those of the transactions still open at S, so a long or prepared
/// transaction, which keeps S's xmin back, costs a reader its own rows, not
/// every row committed since it began (as a range from S's xmin would).
///
/// Read in a statement of its own, before the reader's, which still filters
/// by the whole rule ([`pending`]) under the position row as its own
/// statement reads it: a stored S is only ever replaced by a later one,
/// which sees every id the earlier one saw, so the ranges of the earlier one
/// hold every row the later one leaves unpublished; holes are opened from
/// the stored S. (Only a pair discarded in between escapes them, for one
/// statement: the reader reads the new row the next time.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Ranges {
    /// Each hole's `[xmin(from), xmax(to))`, lowest first.
    pub holes: Vec<(u64, u64)>,
    /// S's xmax; 0 without a vouched snapshot (every id).
    pub after: u64,
    /// S's in-progress ids, lowest first.
    pub in_progress: Vec<u64>,
}

impl Ranges {
    /// The ranges of vouched snapshot `s` (none: every id) and `holes`.
    pub(crate) fn new(s: Option<&Snapshot>, holes: &Holes) -> Self {
        let mut holes: Vec<(u64, u64)> = holes.0.iter().map(|h| (h.from.xmin, h.to.xmax)).collect();
        holes.sort_unstable();
        let mut in_progress = s.map(|s| s.xip.clone()).unwrap_or_default();
        in_progress.sort_unstable();
        Self {
            holes,
            after: s.map_or(0, |s| s.xmax),
            in_progress,
        }
    }

    /// Whether id `x` lies in one of the ranges: what [`Ranges::arms`]
    /// select, for the model test.
    #[cfg(test)]
    fn holds(&self, x: u64) -> bool {
        x >= self.after
            || self.in_progress.contains(&x)
            || self.holes.iter().any(|(lo, hi)| (*lo..*hi).contains(&x))
    }

    /// Each range as an index-friendly SQL boolean on `r` (`PENDING` and
    /// within it), in id order: the holes, the ids in progress at S (`=
    /// ANY` of a constant array), the ids after S. A row may be in more
    /// than one.
    pub(crate) fn arms(&self, r: &str) -> Vec<String> {
        let mut arms = self.hole_arms(r);
        arms.extend(self.after_arms(r));
        arms
    }

    /// [`Ranges::arms`]'s holes alone.
    pub(crate) fn hole_arms(&self, r: &str) -> Vec<String> {
        let pending = format!("{r}.publish_state = 'PENDING'");
        self.holes
            .iter()
            .map(|(lo, hi)| format!("{pending} AND {}", hole_arm(r, *lo, *hi)))
            .collect()
    }

    /// [`Ranges::arms`] but the holes: the ids in progress at S and those
    /// after it.
    pub(crate) fn after_arms(&self, r: &str) -> Vec<String> {
        let pending = format!("{r}.publish_state = 'PENDING'");
        let mut arms = Vec::new();
        if !self.in_progress.is_empty() {
            let ids: Vec<String> = self.in_progress.iter().map(u64::to_string).collect();
            arms.push(format!(
                "{pending} AND {r}.{COLUMN} = ANY('{{{}}}'::xid8[])",
                ids.join(",")
            ));
        }
        arms.push(format!(
            "{pending} AND {r}.{COLUMN} >= '{}'::xid8",
            self.after
        ));
        arms
    }
}

// ---- readers ----

/// SQL: the slot's position row as a scalar subquery, to pass as `p` to
/// [`published`], [`state`] and [`pending`]
/// (`position` the qualified, quoted position table, `slot` an SQL
/// expression). Unlike [`join`] it keeps a reader's statement on the outbox
/// table alone, so an ordered index scan under a `LIMIT` stops early: each
/// `p.<column>` becomes an InitPlan, run once per statement and under its
/// one snapshot (so they agree). Without a row every column is NULL and
/// nothing is derived published, as with the `LEFT JOIN`.
pub(crate) fn position_row(position: &str, slot: &str) -> String {
    format!("(SELECT pos FROM {position} pos WHERE pos.slot_name = {slot})")
}

/// How the readers (the poller, retention and `purge`, `status`, the
/// metrics, `replay --state`) read the rows of a table whose state is
/// derived. They read explicit states only, exactly as under `mark`, when
/// there is no reader ([`Reader::of`] gives `None`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reader {
    /// [`position_row`] of the configured slot: the `p` of the predicates.
    pub(crate) p: String,
    position: String,
    slot: String,
}

impl Reader {
    /// The reader for `position` (qualified, quoted) and `slot` (the name).
    pub(crate) fn new(position: &str, slot: &str) -> Self {
        let slot = crate::postgres::sql::quote_literal(slot);
        Self {
            p: position_row(position, &slot),
            position: position.to_owned(),
            slot,
        }
    }

    /// The configured table's reader when its state is derived:
    /// `on_published` is not `"none"`, the table has [`COLUMN`] (`table_derived`,
    /// `Table::derived`), and the position table exists with
    /// [`POSITION_COLUMNS`] and may be read. Otherwise `None`: the relay runs
    /// `derive` as `mark` (nothing is vouched for, the stream marks what it
    /// publishes), so explicit states are the whole truth.
    pub(crate) async fn of(
        client: &tokio_postgres::Client,
        config: &crate::config::Config,
        table_derived: bool,
    ) -> Result<Option<Self>, tokio_postgres::Error> {
        // Under `mark` and `delete` too: a derived table switched to either
        // keeps the rows the stream published under `derive` published (its
        // last vouched snapshot stays; a session in another mode opens a hole
        // from it), so the poller does not take the whole history again.
        if !table_derived || config.lifecycle.on_published == crate::config::OnPublished::None {
            return Ok(None);
        }
        let name = config.table();
        let position = crate::postgres::sql::qualified(&name.schema, &position_table(&name.name));
        let columns: Vec<&str> = POSITION_COLUMNS.iter().map(|(c, _)| *c).collect();
        let ready: bool = client
            .query_one(
                "SELECT coalesce(has_table_privilege(t, 'SELECT'), false) \
                        AND (SELECT count(*) FROM pg_attribute a WHERE a.attrelid = t AND NOT a.attisdropped \
                             AND a.attname::text = ANY($2::text[])) = cardinality($2::text[]) \
                 FROM to_regclass($1) AS t",
                &[&position, &columns],
            )
            .await?
            .get(0);
        Ok(ready.then(|| Self::new(&position, &config.postgres.slot)))
    }

    /// The slot's [`Ranges`], read from its row in one statement. A row
    /// that does not parse reads as no vouched snapshot and no holes: every
    /// id. So does a snapshot the rule does not trust ([`trusted`]: no
    /// holes kept, another system's, or ahead of the server's xmax, as after
    /// a restore before a session's start discards it): the rule then calls
    /// every row with an id pending, and the ranges must hold them all.
    pub(crate) async fn ranges(
        &self,
        client: &impl tokio_postgres::GenericClient,
    ) -> Result<Ranges, tokio_postgres::Error> {
        let row = client
            .query_opt(
                &format!(
                    "SELECT CASE WHEN {} THEN p.snapshot::text END, \
                            coalesce(p.hole_from::text[], '{{}}'), coalesce(p.hole_to::text[], '{{}}') \
                     FROM {} p WHERE p.slot_name = {}",
                    trusted("p"),
                    self.position,
                    self.slot
                ),
                &[],
            )
            .await?;
        let Some(row) = row else {
            return Ok(Ranges::new(None, &Holes::default()));
        };
        let snapshot: Option<String> = row.get(0);
        let snapshot = match snapshot.as_deref().map(Snapshot::parse) {
            Some(None) => return Ok(Ranges::new(None, &Holes::default())),
            parsed => parsed.flatten(),
        };
        let holes = Holes::parse(&row.get::<_, Vec<String>>(1), &row.get::<_, Vec<String>>(2));
        Ok(match holes {
            Some(holes) => Ranges::new(snapshot.as_ref(), &holes),
            None => Ranges::new(None, &Holes::default()),
        })
    }

    /// SQL boolean, index-friendly: every row of `r` that may be pending by
    /// the derived rule, a superset to AND with [`pending`]: `PENDING`
    /// without an id (the poller's `{table}_explicit_idx`) or within one of
    /// `ranges` ([`Ranges::arms`]), each an OR arm on `{table}_txid_idx`,
    /// which a bitmap scan ORs together.
    pub(crate) fn candidates(&self, r: &str, ranges: &Ranges) -> String {
        let mut arms = vec![format!(
            "({r}.publish_state = 'PENDING' AND {r}.{COLUMN} IS NULL)"
        )];
        arms.extend(ranges.arms(r).into_iter().map(|a| format!("({a})")));
        format!("({})", arms.join(" OR "))
    }

    /// SQL boolean: row `r` is still to publish ([`pending`]), found through
    /// the indexes ([`Reader::candidates`]).
    pub(crate) fn pending(&self, r: &str, ranges: &Ranges) -> String {
        format!(
            "({} AND {})",
            self.candidates(r, ranges),
            pending(r, &self.p)
        )
    }
}

/// SQL boolean: `r`'s id within `[lo, hi)`.
fn hole_arm(r: &str, lo: u64, hi: u64) -> String {
    format!("({r}.{COLUMN} >= '{lo}'::xid8 AND {r}.{COLUMN} < '{hi}'::xid8)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_read_as_postgres_writes_them_and_answer_as_pg_visible_in_snapshot() {
        let s = Snapshot::parse("100:105:100,103").unwrap();
        assert_eq!(s.to_string(), "100:105:100,103");
        assert!(s.visible(99));
        assert!(!s.visible(100));
        assert!(s.visible(101));
        assert!(!s.visible(103));
        assert!(s.visible(104));
        assert!(!s.visible(105));
        let empty = Snapshot::parse(BEGINNING).unwrap();
        assert!(!empty.visible(1) && !empty.visible(3));
        for bad in ["", "1", "5:4:", "a:b:", "1:2:x"] {
            assert_eq!(Snapshot::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_snapshot_made_to_see_delivered_ids_sees_those_and_nothing_more() {
        let s = Snapshot::parse("100:105:100,103").unwrap();
        let seen = s.clone().seeing([103]);
        assert_eq!(seen.to_string(), "100:105:100");
        // Begun after the snapshot: xmax rises past it, the ids skipped
        // stay in progress.
        let ahead = s.clone().seeing([107]);
        assert_eq!(ahead.to_string(), "100:108:100,103,105,106");
        for xid in 90..120 {
            assert_eq!(
                ahead.visible(xid),
                s.visible(xid) || xid == 107,
                "{xid} in {ahead}"
            );
        }
        // Seen already, or too far ahead to list what lies between: as was.
        assert_eq!(s.clone().seeing([99, 101]), s);
        assert_eq!(s.clone().seeing([105 + 1024]), s);
        assert_eq!(s.clone().seeing([105 + 1023]).xmax, 105 + 1024);
        // The in-progress least: xmin stays, and the text form reads back.
        let least = s.clone().seeing([100]);
        assert!(least.visible(100) && !least.visible(103));
        assert_eq!(Snapshot::parse(&least.to_string()), Some(least));
        // Across an epoch, as the stream's ids are read.
        let epoch = 1u64 << 32;
        let wrapped = Snapshot {
            xmin: epoch - 10,
            xmax: epoch + 5,
            xip: vec![epoch - 3, epoch + 2],
        };
        let seen = wrapped.seeing([u32::MAX - 2, 2]);
        assert!(seen.xip.is_empty() && seen.visible(epoch - 3) && seen.visible(epoch + 2));
        // The bound counts from the snapshot's own xmax, whatever the order.
        let chain = s.clone().seeing([105 + 2000, 105 + 1000]);
        assert_eq!(chain.xmax, 105 + 1001);
        assert!(!chain.visible(105 + 2000));
        // Begun at the last id of an epoch: xmax passes the special ids
        // PostgreSQL skips (its input refuses them as xmax), none listed.
        let edge = Snapshot {
            xmin: epoch - 5,
            xmax: epoch - 2,
            xip: vec![epoch - 5],
        };
        let seen = edge.seeing([u32::MAX]);
        assert_eq!(seen.xmax, epoch + 3);
        assert_eq!(seen.xip, vec![epoch - 5, epoch - 2]);
        assert!(seen.visible(epoch - 1) && !seen.visible(epoch - 2));
    }

    #[test]
    fn a_joined_snapshot_sees_what_either_sees_and_nothing_else() {
        for (a, b, want) in [
            ("100:110:100,103,107", "100:108:100,105", "100:110:100"),
            ("100:110:100,103,107", "100:107:100,105", "100:110:100,107"),
            ("100:105:100", "100:108:100,106", "100:108:100,106"),
            ("100:105:100,103", "90:95:90", "100:105:100,103"),
        ] {
            let (a, b) = (Snapshot::parse(a).unwrap(), Snapshot::parse(b).unwrap());
            let joined = a.clone().joined(&b);
            assert_eq!(joined.to_string(), want);
            for xid in 80..120 {
                assert_eq!(
                    joined.visible(xid),
                    a.visible(xid) || b.visible(xid),
                    "{xid}: {a} joined with {b}"
                );
            }
        }
    }

    #[test]
    fn a_32_bit_id_is_widened_below_xmax_across_an_epoch() {
        let s = Snapshot::parse("100:105:103").unwrap();
        assert!(s.visible_xid32(104) && s.visible_xid32(99));
        assert!(!s.visible_xid32(103));
        // At or after xmax: begun after the snapshot.
        assert!(!s.visible_xid32(105) && !s.visible_xid32(105 + (1 << 30)));
        // Before the first id: none such.
        assert!(!s.visible_xid32(u32::MAX));
        // Epoch 1, xmax just past the wrap: a low id of this epoch, a high
        // one of the last.
        let epoch = 1u64 << 32;
        let wrapped = Snapshot {
            xmin: epoch - 10,
            xmax: epoch + 5,
            xip: vec![epoch - 3, epoch + 2],
        };
        assert!(wrapped.visible_xid32(4));
        assert!(!wrapped.visible_xid32(2));
        assert!(!wrapped.visible_xid32(u32::MAX - 2));
        assert!(wrapped.visible_xid32(u32::MAX - 1));
        assert!(wrapped.visible_xid32(u32::MAX - 20));
        assert!(!wrapped.visible_xid32(5));
    }

    #[test]
    fn a_widened_snapshot_sees_the_same_and_bounds_every_id_taken_before_the_upper_one() {
        let s = Snapshot::parse("100:105:100,103").unwrap();
        let w = s.clone().widened(108);
        assert_eq!(w.to_string(), "100:108:100,103,105,106,107");
        assert!((90..120).all(|x| w.visible(x) == s.visible(x)));
        assert_eq!(s.clone().widened(105), s);
        assert_eq!(s.clone().widened(50), s);
        let hole = Hole {
            from: Snapshot::parse(BEGINNING).unwrap(),
            to: w,
        };
        assert!(hole.holds(107) && !hole.holds(108));
    }

    #[test]
    fn the_stream_marks_rows_without_an_id_or_in_a_hole_and_no_others() {
        let holes = Holes::parse(
            &[BEGINNING.into(), "200:200:".into()],
            &["50:52:50".into(), "210:212:211".into()],
        )
        .unwrap();
        assert!(holes.needs_mark(None));
        assert!(holes.needs_mark(Some(49))); // before the boundary
                                             // In progress at the boundary: its commit record may precede the
                                             // slot's consistent point (synchronous replication kept it in
                                             // progress), so it is the hole's.
        assert!(holes.needs_mark(Some(50)));
        assert!(holes.needs_mark(Some(51)));
        assert!(!holes.needs_mark(Some(52))); // begun after the boundary
        assert!(!holes.needs_mark(Some(150))); // between the holes
        assert!(!holes.needs_mark(Some(199))); // visible in the second's `from`
        assert!(holes.needs_mark(Some(205)));
        assert!(holes.needs_mark(Some(211))); // in progress at the second's `to`
        assert!(!holes.needs_mark(Some(212)));
        assert!(!holes.needs_mark(Some(300)));
        assert_eq!(Holes::parse(&[BEGINNING.into()], &[]), None);
    }

    #[test]
    fn the_readers_ranges_hold_every_id_not_derived_published_and_no_other_outside_the_holes() {
        let cases = [
            ("100:100:", vec![]),
            ("100:180:100,150", vec![]),
            // A transaction open long before the others: xmin far back.
            (
                "20:180:20,170",
                vec![(BEGINNING, "10:12:10"), ("60:70:61", "90:95:")],
            ),
            ("20:180:20,170", vec![("20:180:20,170", OPEN)]),
        ];
        for (s, holes) in cases {
            let snapshot = Snapshot::parse(s).unwrap();
            let (from, to): (Vec<String>, Vec<String>) = holes
                .iter()
                .map(|(f, t)| (f.to_string(), t.to_string()))
                .unzip();
            let holes = Holes::parse(&from, &to).unwrap();
            let ranges = Ranges::new(Some(&snapshot), &holes);
            for x in 1..250 {
                let in_hole = holes.0.iter().any(|h| h.holds(x));
                let not_published = !snapshot.visible(x) || in_hole;
                assert!(!not_published || ranges.holds(x), "{s}: {x}");
                let in_hole_range = ranges.holes.iter().any(|(lo, hi)| (*lo..*hi).contains(&x));
                if !in_hole_range {
                    assert_eq!(ranges.holds(x), !snapshot.visible(x), "{s}: {x}");
                }
            }
        }
        // Nothing vouched: every id.
        let none = Ranges::new(None, &Holes::default());
        assert!(none.holds(0) && none.holds(1) && none.holds(u64::MAX));
        // Xmin held back by 20: the ids between the open transactions are outside.
        let pinned = Ranges::new(
            Some(&Snapshot::parse("20:180:20,170").unwrap()),
            &Holes::default(),
        );
        assert_eq!(
            pinned.arms("o"),
            [
                "o.publish_state = 'PENDING' AND o.relay_txid = ANY('{20,170}'::xid8[])",
                "o.publish_state = 'PENDING' AND o.relay_txid >= '180'::xid8",
            ]
        );
        assert_eq!((21..170).filter(|x| pinned.holds(*x)).count(), 0);
    }
}
