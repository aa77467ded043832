//! Retention: deletes PUBLISHED (and SKIPPED) rows older than `retention.keep`,
//! in batches, never PENDING, FAILED or DEAD ones.
//!
//! Each batch is its own short transaction (`retention.batch_size` rows,
//! default 1,000), so retention never holds locks long or bloats one
//! transaction, and runs beside concurrent inserts. On a partitioned table
//! with `retention.drop_partitions`, a partition whose rows are all expired
//! PUBLISHED/SKIPPED rows is detached and dropped instead.

use std::time::Duration;

use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::postgres::ConnInfo;
use crate::setup::quote_ident;
use crate::table::Table;

/// What one run removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Purged {
    /// Rows deleted.
    pub rows: u64,
    /// Transactions (batches) used.
    pub batches: u64,
    /// Partitions dropped.
    pub partitions: Vec<String>,
}

/// Delete what is older than `older_than` now, batch by batch, until nothing is left.
pub async fn purge(
    client: &Client,
    table: &Table,
    older_than: Duration,
    batch_size: usize,
    drop_partitions: bool,
) -> Result<Purged, tokio_postgres::Error> {
    let mut purged = Purged::default();
    if drop_partitions && table.partitioned {
        purged.partitions = drop_expired_partitions(client, table, older_than).await?;
    }
    let created_at = table.created_at.as_deref().unwrap_or("published_at");
    let sql = format!(
        "DELETE FROM {t} WHERE {id} IN (SELECT {id} FROM {t} \
           WHERE (publish_state = 'PUBLISHED' AND published_at < now() - make_interval(secs => $1)) \
              OR (publish_state = 'SKIPPED' AND {created_at} < now() - make_interval(secs => $1)) \
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
        if deleted < batch_size as u64 {
            return Ok(purged);
        }
    }
}

/// Detach and drop partitions holding only expired PUBLISHED/SKIPPED rows.
async fn drop_expired_partitions(
    client: &Client,
    table: &Table,
    older_than: Duration,
) -> Result<Vec<String>, tokio_postgres::Error> {
    let partitions = client
        .query(
            "SELECT n.nspname::text, c.relname::text FROM pg_inherits i \
             JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE i.inhparent = $1::text::regclass",
            &[&table.qualified],
        )
        .await?;
    let created_at = table.created_at.as_deref().unwrap_or("published_at");
    let mut dropped = Vec::new();
    for row in partitions {
        let name = format!(
            "{}.{}",
            quote_ident(row.get::<_, &str>(0)),
            quote_ident(row.get::<_, &str>(1))
        );
        // Keep it if any row is not an expired PUBLISHED/SKIPPED one (or it is empty and may still fill).
        let keep: bool = client
            .query_one(
                &format!(
                    "SELECT NOT EXISTS (SELECT 1 FROM {name}) OR EXISTS (SELECT 1 FROM {name} WHERE NOT ( \
                       (publish_state = 'PUBLISHED' AND published_at < now() - make_interval(secs => $1)) \
                       OR (publish_state = 'SKIPPED' AND {created_at} < now() - make_interval(secs => $1))))"
                ),
                &[&older_than.as_secs_f64()],
            )
            .await?
            .get(0);
        if keep {
            continue;
        }
        client
            .batch_execute(&format!(
                "ALTER TABLE {} DETACH PARTITION {name}; DROP TABLE {name};",
                table.qualified
            ))
            .await?;
        tracing::info!(partition = %name, "dropped an expired partition");
        dropped.push(name);
    }
    Ok(dropped)
}

/// Run retention every `retention.interval` until `stop`.
pub async fn run(config: Config, stop: CancellationToken) {
    let retention = &config.retention;
    let conn = match ConnInfo::new(&config.postgres) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "retention cannot start");
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
        }
        .await;
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
            Err(e) => tracing::warn!(error = %e, "retention run failed; retrying next interval"),
        }
        tokio::select! {
            _ = tokio::time::sleep(retention.interval) => {}
            _ = stop.cancelled() => return,
        }
    }
}
