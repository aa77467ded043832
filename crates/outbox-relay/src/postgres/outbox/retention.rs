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

use std::time::Duration;

use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
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
/// is left or `stop` is cancelled.
pub(crate) async fn purge(
    client: &Client,
    table: &Table,
    older_than: Duration,
    batch_size: usize,
    drop_partitions: bool,
) -> Result<Purged, tokio_postgres::Error> {
    purge_until(
        client,
        table,
        older_than,
        batch_size,
        drop_partitions,
        &CancellationToken::new(),
    )
    .await
}

async fn purge_until(
    client: &Client,
    table: &Table,
    older_than: Duration,
    batch_size: usize,
    drop_partitions: bool,
    stop: &CancellationToken,
) -> Result<Purged, tokio_postgres::Error> {
    let mut purged = Purged::default();
    if drop_partitions && table.partitioned {
        purged.partitions = drop_expired_partitions(client, table, older_than).await;
    }
    // SKIPPED rows carry published_at too (the time they were skipped), so one
    // partial index serves both.
    let sql = format!(
        "DELETE FROM {t} WHERE {id} IN (SELECT {id} FROM {t} \
           WHERE publish_state IN ('PUBLISHED', 'SKIPPED') AND published_at < now() - make_interval(secs => $1) \
           LIMIT $2)",
        t = table.qualified,
        id = table.id,
    );
    let limit = i64::try_from(batch_size).unwrap_or(i64::MAX);
    loop {
        let deleted = client
            .execute(&sql, &[&older_than.as_secs_f64(), &limit])
            .await?;
        if deleted > 0 {
            purged.batches += 1;
            purged.rows += deleted;
        }
        if deleted < batch_size as u64 || stop.is_cancelled() {
            return Ok(purged);
        }
    }
}

/// Detach and drop partitions whose whole range is older than `older_than`
/// and whose rows are all expired PUBLISHED/SKIPPED ones. Never the DEFAULT
/// partition; a partition is re-checked after it is detached (no insert can
/// reach it then) and put back if anything else is in it. Errors are logged,
/// never fatal to row retention.
async fn drop_expired_partitions(
    client: &Client,
    table: &Table,
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
        match drop_partition(client, table, &name, seconds).await {
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

async fn drop_partition(
    client: &Client,
    table: &Table,
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
                "SELECT EXISTS (SELECT 1 FROM {name} WHERE (publish_state IN ('PUBLISHED', 'SKIPPED') \
                   AND published_at < now() - make_interval(secs => $1)) IS NOT TRUE)"
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
            purge(
                &client,
                &table,
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
