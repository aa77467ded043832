//! Retention: deletes PUBLISHED (and SKIPPED) rows whose `published_at` is
//! older than `retention.keep`, in batches, never PENDING, FAILED or DEAD ones.
//!
//! Each batch is its own short transaction (`retention.batch_size` rows,
//! default 1,000), so retention never holds locks long or bloats one
//! transaction, and runs beside concurrent inserts. On a partitioned table
//! with `retention.drop_partitions`, a partition whose rows are all expired
//! PUBLISHED/SKIPPED rows, and whose range ended before the cut-off, is
//! detached and dropped first (never the DEFAULT partition); rows are then
//! deleted as usual.
//!
//! On a table whose state is derived ([`derived::Reader`]) the rows the
//! stream published stay `PENDING` and have no `published_at`: retention
//! also deletes rows **derived published whose `created_at`** is older than
//! `retention.keep`, through `{table}_txid_idx`: ids below the vouched
//! snapshot's xmax (not its xmin: a transaction left open while it was
//! taken would hold back every row after it), and below the lowest id of a
//! row still within `keep`
//! (taken once per run, so a batch reads only the expired end of the index;
//! a row of a transaction that started within `keep` holds the rows after
//! it until it expires too). Rows without an id, or not derived published
//! (in a hole, after the snapshot), are never deleted by that rule; the
//! explicit rule above deletes them once the poller has marked them.

use std::time::Duration;

use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::postgres::outbox::derived::{self, Reader};
use crate::postgres::outbox::table::Table;
use crate::postgres::sql::qualified;
use crate::postgres::ConnInfo;

/// What one run removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Purged {
    /// Rows deleted.
    pub rows: u64,
    /// Transactions (batches) used.
    pub batches: u64,
    /// Partitions dropped.
    pub partitions: Vec<String>,
}

/// Delete what is older than `older_than` now, batch by batch, until nothing
/// is left; rows derived published too when `reader` is given (a derived
/// table, [`Reader::of`]).
pub(crate) async fn purge(
    client: &Client,
    table: &Table,
    reader: Option<&Reader>,
    older_than: Duration,
    batch_size: usize,
    drop_partitions: bool,
) -> Result<Purged, tokio_postgres::Error> {
    let mut purged = Purged::default();
    if drop_partitions && table.partitioned {
        purged.partitions = drop_expired_partitions(client, table, reader, older_than).await;
    }
    // SKIPPED rows carry published_at too (the time they were skipped), so one
    // partial index serves both. `= ANY(ARRAY(…))`, not `IN (…)`: the batch's
    // ids are then found by the id's index, where `IN` may be planned as a
    // join with a scan of the whole table.
    let sql = format!(
        "DELETE FROM {t} WHERE {id} = ANY(ARRAY(SELECT {id} FROM {t} \
           WHERE publish_state IN ('PUBLISHED', 'SKIPPED') AND published_at < now() - make_interval(secs => $1) \
           LIMIT $2))",
        t = table.qualified,
        id = table.id,
    );
    let limit = i64::try_from(batch_size).unwrap_or(i64::MAX);
    let seconds = older_than.as_secs_f64();
    delete_batches(client, &sql, &[&seconds, &limit], batch_size, &mut purged).await?;
    if let (Some(reader), Some(created_at)) = (reader, &table.created_at) {
        let bound: Option<String> = client
            .query_one(&derived_bound_sql(table, reader, created_at), &[&seconds])
            .await?
            .get(0);
        if let Some(bound) = bound {
            let sql = derived_delete_sql(table, reader, created_at);
            delete_batches(
                client,
                &sql,
                &[&seconds, &limit, &bound],
                batch_size,
                &mut purged,
            )
            .await?;
        }
    }
    Ok(purged)
}

/// Run `sql` (a bounded `DELETE`) until a batch deletes fewer than
/// `batch_size` rows.
async fn delete_batches(
    client: &Client,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    batch_size: usize,
    purged: &mut Purged,
) -> Result<(), tokio_postgres::Error> {
    loop {
        let deleted = client.execute(sql, params).await?;
        if deleted > 0 {
            purged.batches += 1;
            purged.rows += deleted;
        }
        if deleted < batch_size as u64 {
            return Ok(());
        }
    }
}

/// SQL, `$1` `keep` in seconds: the upper bound (`xid8` text) of the ids of
/// expired derived published rows: the vouched snapshot's xmax, or the
/// lowest id of a row still within `keep` if lower. NULL without a vouched
/// snapshot. The lowest-id scan reads `{table}_txid_idx` from its expired end
/// and stops at the first row within `keep`.
fn derived_bound_sql(table: &Table, reader: &Reader, created_at: &str) -> String {
    let x = derived::COLUMN;
    format!(
        "SELECT least(pg_snapshot_xmax({p}.snapshot), \
                      (SELECT o.{x} FROM {t} AS o WHERE o.publish_state = 'PENDING' AND o.{x} IS NOT NULL \
                         AND o.{created_at} >= now() - make_interval(secs => $1) ORDER BY o.{x} LIMIT 1))::text",
        p = reader.p,
        t = table.qualified,
    )
}

/// SQL, `$1` `keep` in seconds, `$2` the batch, `$3` [`derived_bound_sql`]:
/// one batch of expired derived published rows, on `{table}_txid_idx`.
fn derived_delete_sql(table: &Table, reader: &Reader, created_at: &str) -> String {
    let x = derived::COLUMN;
    format!(
        "DELETE FROM {t} WHERE {id} = ANY(ARRAY(SELECT o.{id} FROM {t} AS o \
           WHERE o.publish_state = 'PENDING' AND o.{x} < $3::text::xid8 \
             AND o.{created_at} < now() - make_interval(secs => $1) AND {published} \
           ORDER BY o.{x} LIMIT $2))",
        t = table.qualified,
        id = table.id,
        published = derived::published("o", &reader.p),
    )
}

/// Detach and drop partitions whose whole range is older than `older_than`
/// and whose rows are all expired PUBLISHED/SKIPPED ones (or, with a
/// `reader`, derived published and created before the cut-off: no row of it
/// is pending by the derived rule, FAILED or DEAD). Never the DEFAULT
/// partition; a partition is re-checked after it is detached (no insert can
/// reach it then) and put back if anything else is in it. Errors are logged,
/// never fatal to row retention.
async fn drop_expired_partitions(
    client: &Client,
    table: &Table,
    reader: Option<&Reader>,
    older_than: Duration,
) -> Vec<String> {
    let partitions = match client
        .query(
            "SELECT n.nspname::text, c.relname::text, pg_get_expr(c.relpartbound, c.oid) \
             FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE i.inhparent = $1::text::regclass",
            &[&table.qualified],
        )
        .await
    {
        Ok(rows) => rows,
        Err(e) => {
            tracing::warn!(error = %crate::report::Chain(&e), "retention cannot list partitions");
            return Vec::new();
        }
    };
    let seconds = older_than.as_secs_f64();
    let mut dropped = Vec::new();
    for row in partitions {
        let name = qualified(row.get(0), row.get(1));
        let bound: &str = row.get(2);
        // `FOR VALUES FROM ('…') TO ('…')`: only ranges that ended long enough ago.
        let Some(upper) = bound
            .split_once(" TO ('")
            .and_then(|(_, rest)| rest.split_once("')"))
            .map(|(upper, _)| upper.to_owned())
        else {
            continue; // DEFAULT, or not a range partition
        };
        let expired: bool = match client
            .query_one(
                "SELECT $1::text::timestamptz <= now() - make_interval(secs => $2)",
                &[&upper, &seconds],
            )
            .await
        {
            Ok(r) => r.get(0),
            Err(_) => continue, // not partitioned by a timestamp
        };
        if !expired {
            continue;
        }
        match drop_partition(client, table, reader, &name, seconds).await {
            Ok(true) => {
                tracing::info!(partition = %name, "dropped an expired partition");
                dropped.push(name);
            }
            Ok(false) => {}
            Err(e) => {
                let _ = client.batch_execute("ROLLBACK").await;
                let hint = if e.code()
                    == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE)
                {
                    "dropping partitions needs the table's owner (the least-privilege role may only \
                     delete rows); run retention as the owner or set retention.drop_partitions = false"
                } else {
                    "deleting its rows instead"
                };
                tracing::warn!(partition = %name, error = %crate::report::Chain(&e), "cannot drop an expired partition: {hint}");
            }
        }
    }
    dropped
}

/// The rows that let a partition go: expired explicit PUBLISHED/SKIPPED
/// rows, and with a `reader` rows derived published created before the
/// cut-off. SQL boolean on `o`, `$1` the age in seconds.
fn expired(table: &Table, reader: Option<&Reader>) -> String {
    let explicit = "o.publish_state IN ('PUBLISHED', 'SKIPPED') AND o.published_at < now() - make_interval(secs => $1)";
    match (reader, &table.created_at) {
        (Some(reader), Some(created_at)) => format!(
            "({explicit}) OR (o.{created_at} < now() - make_interval(secs => $1) AND {})",
            derived::published("o", &reader.p)
        ),
        _ => explicit.to_owned(),
    }
}

async fn drop_partition(
    client: &Client,
    table: &Table,
    reader: Option<&Reader>,
    name: &str,
    seconds: f64,
) -> Result<bool, tokio_postgres::Error> {
    client
        .batch_execute(&format!(
            "BEGIN; SET LOCAL lock_timeout = '2s'; ALTER TABLE {} DETACH PARTITION {name};",
            table.qualified
        ))
        .await?;
    let keep: bool = client
        .query_one(
            &format!(
                "SELECT EXISTS (SELECT 1 FROM {name} AS o WHERE ({}) IS NOT TRUE)",
                expired(table, reader)
            ),
            &[&seconds],
        )
        .await?
        .get(0);
    if keep {
        client.batch_execute("ROLLBACK").await?;
        return Ok(false);
    }
    client
        .batch_execute(&format!("DROP TABLE {name}; COMMIT;"))
        .await?;
    Ok(true)
}

/// Run retention every `retention.interval` until `stop`.
pub(crate) async fn run(config: Config, stop: CancellationToken) {
    let retention = &config.retention;
    let conn = match ConnInfo::new(&config.postgres) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %crate::report::Chain(&e), "retention cannot start");
            return;
        }
    };
    loop {
        let result = async {
            let client = conn.connect().await?;
            let Some(table) = Table::inspect(&client, &config).await? else {
                return Ok(None);
            };
            if !table.managed {
                return Ok(None);
            }
            let reader = Reader::of(&client, &config, table.derived).await?;
            purge(
                &client,
                &table,
                reader.as_ref(),
                retention.keep,
                retention.batch_size,
                retention.drop_partitions,
            )
            .await
            .map(Some)
            .map_err(crate::postgres::SqlError::from)
        }
        .await;
        if let Ok(Some(p)) = &result {
            crate::metrics::get().retention_ran(p.rows);
        }
        match result {
            Ok(Some(p)) if p.rows > 0 || !p.partitions.is_empty() => tracing::info!(
                rows = p.rows,
                batches = p.batches,
                partitions = p.partitions.len(),
                "retention removed published rows"
            ),
            Ok(Some(_)) => {}
            Ok(None) => {
                tracing::debug!("retention: the table has no relay-managed columns; nothing to do")
            }
            Err(e) => {
                tracing::warn!(error = %crate::report::Chain(&e), "retention run failed; retrying next interval")
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(retention.interval) => {}
            _ = stop.cancelled() => return,
        }
    }
}
