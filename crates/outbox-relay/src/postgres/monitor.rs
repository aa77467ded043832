//! Slot monitoring on an ordinary connection, every few seconds:
//! `pg_current_wal_lsn()` against the slot's `confirmed_flush_lsn` and
//! `restart_lsn`, its `wal_status` and `safe_wal_size`; every sixth time also
//! the outbox rows by publish state (on a table whose state is derived,
//! `PENDING` counts only rows not derived published:
//! [`crate::postgres::outbox::derived`]). Feeds the metrics and readiness.
//!
//! Each look also asks the server why the slot's process waits, and for old
//! prepared transactions ([`crate::postgres::stall`]): a stall is logged with its fix
//! when it starts and when it is over, fails `/readyz` and is exported as
//! `outbox_relay_stall_seconds{cause}`.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::metrics;
use crate::postgres::outbox::derived::Reader;
use crate::postgres::outbox::table::Table;
use crate::postgres::ConnInfo;

/// Time between looks.
pub(crate) const INTERVAL: Duration = Duration::from_secs(5);

/// What the monitor measured.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SlotLag {
    /// `reserved`, `extended`, `unreserved`, `lost`, or `missing`.
    pub wal_status: String,
    /// pg_current_wal_lsn() − confirmed_flush_lsn.
    pub lag_bytes: i64,
    /// pg_current_wal_lsn() − restart_lsn.
    pub retained_bytes: i64,
    /// safe_wal_size, −1 when unlimited.
    pub safe_wal_size: i64,
    /// Backend streaming from it.
    pub active_pid: Option<i32>,
    /// The slot's confirmed_flush_lsn, as text.
    pub confirmed_flush_lsn: Option<String>,
    /// Seconds the walsender's last reported flush trails the server (pg_stat_replication.flush_lag).
    pub flush_lag_seconds: Option<f64>,
}

/// Measure `slot`.
pub(crate) async fn slot_lag(
    client: &tokio_postgres::Client,
    slot: &str,
) -> Result<SlotLag, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "SELECT coalesce(s.wal_status, 'unknown'), \
                    coalesce((pg_current_wal_lsn() - s.confirmed_flush_lsn)::bigint, -1), \
                    coalesce((pg_current_wal_lsn() - s.restart_lsn)::bigint, -1), \
                    coalesce(s.safe_wal_size, -1), s.active_pid, s.confirmed_flush_lsn::text, \
                    extract(epoch FROM r.flush_lag)::float8 \
             FROM pg_replication_slots s LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid \
             WHERE s.slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(match row {
        Some(r) => SlotLag {
            wal_status: r.get(0),
            lag_bytes: r.get(1),
            retained_bytes: r.get(2),
            safe_wal_size: r.get(3),
            active_pid: r.get(4),
            confirmed_flush_lsn: r.get(5),
            flush_lag_seconds: r.get(6),
        },
        None => SlotLag {
            wal_status: "missing".into(),
            lag_bytes: -1,
            retained_bytes: -1,
            safe_wal_size: -1,
            active_pid: None,
            confirmed_flush_lsn: None,
            flush_lag_seconds: None,
        },
    })
}

/// Rows in PENDING, FAILED and DEAD state; with a `reader` (a derived
/// table) PENDING counts the rows still to publish by the derived rule,
/// found through the indexes ([`Reader::pending`]), not every row the
/// stream left `PENDING`.
pub(crate) async fn row_counts(
    client: &tokio_postgres::Client,
    table: &Table,
    reader: Option<&Reader>,
) -> Result<Vec<(String, i64)>, tokio_postgres::Error> {
    let pending = match reader {
        Some(reader) => reader.pending("o", &reader.ranges(client).await?),
        None => "o.publish_state = 'PENDING'".to_owned(),
    };
    let row = client
        .query_one(
            &format!(
                "SELECT (SELECT count(*) FROM {t} AS o WHERE {pending}), \
                        (SELECT count(*) FROM {t} AS o WHERE o.publish_state = 'FAILED'), \
                        (SELECT count(*) FROM {t} AS o WHERE o.publish_state = 'DEAD')",
                t = table.qualified
            ),
            &[],
        )
        .await?;
    Ok(["PENDING", "FAILED", "DEAD"]
        .iter()
        .enumerate()
        .map(|(i, s)| (s.to_string(), row.get(i)))
        .collect())
}

/// Ask the server why the slot waits, and report what changed.
async fn look_for_stalls(
    client: &tokio_postgres::Client,
    config: &Config,
    watch: &mut crate::postgres::stall::Watch,
) {
    use crate::postgres::stall::{self, Cause};
    let look = match stall::look(client, &config.postgres.slot).await {
        Ok(look) => look,
        Err(e) => {
            tracing::debug!(error = %crate::report::Chain(&e), "stall look failed");
            return;
        }
    };
    let now = std::time::Instant::now();
    let found = stall::diagnose(&look, config.stream.prepared_transaction_max_age);
    let changes = watch.observe(found, now);
    for s in &changes.over {
        tracing::info!(
            cause = s.cause.label(),
            subject = %s.subject,
            "stall over: the server no longer names it"
        );
    }
    for s in &changes.started {
        tracing::warn!(cause = s.cause.label(), subject = %s.subject, "stalled: {}", s.describe());
    }
    let m = metrics::get();
    for cause in Cause::ALL {
        m.stall_seconds(cause, watch.seconds(cause, now));
    }
    *m.health.stall.lock().unwrap_or_else(|p| p.into_inner()) =
        watch.stalls().next().map(|s| s.describe());
}

/// Watch the slot and the table until `stop`.
pub(crate) async fn run(config: Config, stop: CancellationToken) {
    let Ok(conn) = ConnInfo::new(&config.postgres) else {
        return;
    };
    let m = metrics::get();
    let mut client = None;
    let mut stalls = crate::postgres::stall::Watch::default();
    for round in 0u64.. {
        if client
            .as_ref()
            .is_none_or(|c: &tokio_postgres::Client| c.is_closed())
        {
            client = conn.connect().await.ok();
            if let Some(c) = &client {
                // A look that meets a locked catalog gives up instead of
                // holding the next ones.
                let _ = c.batch_execute("SET lock_timeout = '5s'").await;
            }
        }
        if let Some(c) = &client {
            look_for_stalls(c, &config, &mut stalls).await;
            match slot_lag(c, &config.postgres.slot).await {
                Ok(s) => m.slot(
                    &s.wal_status,
                    s.lag_bytes,
                    s.retained_bytes,
                    s.safe_wal_size,
                ),
                Err(e) => {
                    tracing::debug!(error = %crate::report::Chain(&e), "slot monitor query failed")
                }
            }
            if round % 6 == 0 {
                if let Ok(Some(table)) = Table::inspect(c, &config).await {
                    if table.managed {
                        // Not the explicit counts when the position table
                        // cannot be read: on a derived table they would be wrong.
                        if let Ok(reader) = Reader::of(c, &config, table.derived).await {
                            if let Ok(counts) = row_counts(c, &table, reader.as_ref()).await {
                                for (state, n) in counts {
                                    m.rows(&state, n);
                                }
                            }
                        }
                    }
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(INTERVAL) => {}
            _ = stop.cancelled() => return,
        }
    }
}
