//! `outbox-relay replay`: publish selected rows again.
//!
//! Rows are selected by time range (`created_at`, from inclusive, to
//! exclusive), ids, aggregate type or id, event type and publish state, and
//! published oldest first through the same mapping, filter, routing, envelope
//! and sink as the stream. Delivered rows become PUBLISHED (or are deleted in
//! delete mode); a rejected row is recorded like any failed attempt (FAILED,
//! or DEAD at `poller.max_attempts`). The selected ids are read first (about
//! 50 bytes each), then the rows page by page. `--dry-run` prints the count and a sample and publishes nothing.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use tokio_postgres::types::ToSql;
use tokio_postgres::Client;

use crate::config::{Config, OnPublished};
use crate::pipeline::rows::{batches, Prepared, Rows, TEXT_SETTINGS};
use crate::pipeline::sink::{Message, Outcome, Sink};
use crate::postgres::outbox::table::Table;
use crate::postgres::sql::quote_ident;
use crate::retry::Backoff;

/// Rows fetched per page.
const PAGE: usize = 100;
/// Transient failures of one batch before replay gives up.
const MAX_RETRIES: u32 = 10;

/// Which rows to replay; every given criterion must hold. Also the
/// `replay` command's selection flags.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct Selection {
    /// Rows created at or after this time (e.g. 2026-11-22T06:00:00Z).
    #[arg(long)]
    pub from: Option<String>,
    /// Rows created before this time.
    #[arg(long)]
    pub to: Option<String>,
    /// These ids (repeat the flag or separate with commas).
    #[arg(long = "id", value_delimiter = ',')]
    pub ids: Vec<String>,
    /// This aggregate type.
    #[arg(long)]
    pub aggregate_type: Option<String>,
    /// This aggregate id.
    #[arg(long)]
    pub aggregate_id: Option<String>,
    /// This event type.
    #[arg(long)]
    pub event_type: Option<String>,
    /// Rows in these publish states, e.g. FAILED,DEAD.
    #[arg(long = "state", value_delimiter = ',')]
    pub states: Vec<String>,
    /// At most this many rows.
    #[arg(long)]
    pub limit: Option<i64>,
}

/// What a replay did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Replayed {
    /// Rows selected.
    pub selected: usize,
    /// Published.
    pub published: usize,
    /// Rejected by the sink, or unpublishable.
    pub rejected: usize,
    /// Filtered out.
    pub skipped: usize,
}

/// Why a replay stopped.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// A database error.
    #[error("postgres: {0}")]
    Sql(#[from] tokio_postgres::Error),
    /// The selection or the table cannot be used.
    #[error("{0}")]
    Invalid(String),
    /// The sink kept failing.
    #[error("the sink kept failing ({0}); {1} rows were published before it stopped")]
    Sink(String, usize),
}

struct Query {
    clause: String,
    params: Vec<Box<dyn ToSql + Sync + Send>>,
}

impl Query {
    fn param(&mut self, value: impl ToSql + Sync + Send + 'static) -> String {
        self.params.push(Box::new(value));
        format!("${}", self.params.len())
    }

    fn refs(&self) -> Vec<&(dyn ToSql + Sync)> {
        self.params
            .iter()
            .map(|p| p.as_ref() as &(dyn ToSql + Sync))
            .collect()
    }
}

fn build(config: &Config, table: &Table, selection: &Selection) -> Result<Query, ReplayError> {
    let mut q = Query {
        clause: String::new(),
        params: Vec::new(),
    };
    let mut parts = Vec::new();
    let created_at = || {
        table.created_at.clone().ok_or_else(|| {
            ReplayError::Invalid("the table has no created_at column (columns.created_at): select by ids or aggregate".into())
        })
    };
    if let Some(from) = &selection.from {
        let c = created_at()?;
        parts.push(format!(
            "{c} >= {}::text::timestamptz",
            q.param(from.clone())
        ));
    }
    if let Some(to) = &selection.to {
        let c = created_at()?;
        parts.push(format!("{c} < {}::text::timestamptz", q.param(to.clone())));
    }
    if !selection.ids.is_empty() {
        let p = q.param(selection.ids.clone());
        parts.push(format!(
            "{} = ANY({p}::text[]::{}[])",
            table.id, table.id_type
        ));
    }
    let c = &config.columns;
    for (column, value) in [
        (&c.aggregate_type, &selection.aggregate_type),
        (&c.aggregate_id, &selection.aggregate_id),
        (&c.event_type, &selection.event_type),
    ] {
        if let Some(value) = value {
            let p = q.param(value.clone());
            parts.push(format!("{}::text = {p}", quote_ident(column)));
        }
    }
    if !selection.states.is_empty() {
        if !table.managed {
            return Err(ReplayError::Invalid(
                "--state needs the relay-managed publish_state column".into(),
            ));
        }
        let states: Vec<String> = selection.states.iter().map(|s| s.to_uppercase()).collect();
        let p = q.param(states);
        parts.push(format!("publish_state = ANY({p}::text[])"));
    }
    q.clause = if parts.is_empty() {
        "true".into()
    } else {
        parts.join(" AND ")
    };
    Ok(q)
}

/// Oldest first, on the table aliased `o` (see [`Table::text_columns`]).
fn order(table: &Table) -> String {
    match &table.created_at {
        Some(c) => format!("o.{c}, o.{}", table.id),
        None => format!("o.{}", table.id),
    }
}

/// Count the selected rows and show a few; publishes nothing.
pub async fn dry_run(
    client: &Client,
    config: &Config,
    table: &Table,
    selection: &Selection,
) -> Result<(i64, Vec<String>), ReplayError> {
    let q = build(config, table, selection)?;
    let count: i64 = client
        .query_one(
            &format!(
                "SELECT count(*) FROM {} WHERE {}",
                table.qualified, q.clause
            ),
            &q.refs(),
        )
        .await?
        .get(0);
    let c = &config.columns;
    let state = if table.managed {
        "publish_state"
    } else {
        "'-'"
    };
    let sample = client
        .query(
            &format!(
                "SELECT concat_ws(' ', {id}::text, {et}::text, {at}::text || '/' || {ai}::text, {state}::text, {created}) \
                 FROM {t} AS o WHERE {w} ORDER BY {o} LIMIT 5",
                id = table.id,
                et = quote_ident(&c.event_type),
                at = quote_ident(&c.aggregate_type),
                ai = quote_ident(&c.aggregate_id),
                created = table.created_at.as_ref().map_or("''".to_owned(), |c| format!("{c}::text")),
                t = table.qualified,
                w = q.clause,
                o = order(table),
            ),
            &q.refs(),
        )
        .await?;
    let count = selection.limit.map_or(count, |l| count.min(l));
    Ok((count, sample.iter().map(|r| r.get(0)).collect()))
}

/// Publish the selected rows with `sink`, at most `rate` per second.
pub async fn run<S: Sink>(
    client: &mut Client,
    config: &Config,
    table: &Table,
    database: &str,
    selection: &Selection,
    sink: &S,
    rate: Option<f64>,
) -> Result<Replayed, ReplayError> {
    let q = build(config, table, selection)?;
    // Names claim-check objects as the stream does; a database that revoked
    // pg_control_system() leaves only such large payloads unable to go.
    match crate::postgres::source(client, database, &config.table()).await {
        Ok(source) => sink.source(&source),
        Err(e) => tracing::warn!(
            error = %crate::report::Chain(&e),
            "cannot read the system identifier (pg_control_system()): a payload over its topic's limit cannot be stored in S3"
        ),
    }
    let limit = selection
        .limit
        .map_or(String::new(), |l| format!(" LIMIT {l}"));
    let ids: Vec<String> = client
        .query(
            &format!(
                "SELECT o.{}::text FROM {} AS o WHERE {} ORDER BY {}{limit}",
                table.id,
                table.qualified,
                q.clause,
                order(table)
            ),
            &q.refs(),
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut done = Replayed {
        selected: ids.len(),
        ..Replayed::default()
    };
    let mut rows_to_messages =
        Rows::new(config, table, database).map_err(|e| ReplayError::Invalid(e.to_string()))?;
    let backoff = Backoff::new(&config.retry);
    let started = Instant::now();
    let progress = std::io::stderr().is_terminal();
    let fetch = format!(
        "SELECT {} FROM {} AS o WHERE o.{} ORDER BY {}",
        table.text_columns("o"),
        table.qualified,
        table.id_in(1),
        order(table)
    );
    let mode = config.lifecycle.on_published;
    let published_sql = match mode {
        OnPublished::Mark if !table.managed => None,
        _ => table.published_sql(mode),
    };
    let rejected_sql = table
        .managed
        .then(|| table.failure_sql(config.poller.max_attempts));
    let retry_in = config.poller.backoff_initial.as_secs_f64();
    for page in ids.chunks(PAGE) {
        let page: Vec<String> = page.to_vec();
        let tx = client.transaction().await?;
        tx.batch_execute(TEXT_SETTINGS).await?;
        let rows = tx.query(&fetch, &[&page]).await?;
        tx.commit().await?;
        let mut messages: Vec<Message> = Vec::new();
        let mut rejected: Vec<(String, String)> = Vec::new();
        for row in &rows {
            match rows_to_messages.prepare(row) {
                Prepared::Publish(m) => messages.push(m),
                Prepared::Skip(_) => done.skipped += 1,
                Prepared::Fail(id, reason) => rejected.push((id, reason)),
            }
        }
        let mut published: Vec<String> = Vec::new();
        for batch in batches(&messages, sink.max_batch().max(1)) {
            let mut attempt = 0;
            let outcomes = loop {
                let outcomes = sink.publish(batch).await;
                let transient = outcomes.iter().find_map(|o| match o {
                    Outcome::Retryable(r) => Some(r.reason.clone()),
                    _ => None,
                });
                match transient {
                    None => break outcomes,
                    Some(reason) if attempt >= MAX_RETRIES => {
                        return Err(ReplayError::Sink(reason, done.published + published.len()))
                    }
                    Some(reason) => {
                        tracing::warn!(attempt, error = %reason, "publish failed, retrying");
                        tokio::time::sleep(backoff.delay(attempt)).await;
                        attempt += 1;
                    }
                }
            };
            // A retried batch is sent whole again; what was delivered before is delivered again.
            for (m, outcome) in batch.iter().zip(outcomes) {
                match outcome {
                    Outcome::Delivered => published.push(m.event.id().to_string()),
                    Outcome::Rejected(reason) => rejected.push((m.event.id().to_string(), reason)),
                    // Not left after the loop above; counted as rejected if it ever were.
                    Outcome::Retryable(retry) => {
                        rejected.push((m.event.id().to_string(), retry.reason))
                    }
                }
            }
            if let Some(rate) = rate {
                let due = Duration::from_secs_f64((done.published + published.len()) as f64 / rate);
                if let Some(wait) = due.checked_sub(started.elapsed()) {
                    tokio::time::sleep(wait).await;
                }
            }
        }
        if let (Some(sql), false) = (&published_sql, published.is_empty()) {
            client.execute(sql.as_str(), &[&published]).await?;
        }
        for (id, reason) in &rejected {
            eprintln!("rejected {id}: {reason}");
            if let Some(sql) = &rejected_sql {
                client
                    .execute(sql.as_str(), &[id, reason, &false, &retry_in])
                    .await?;
            }
        }
        done.published += published.len();
        done.rejected += rejected.len();
        if progress {
            eprint!(
                "\rreplayed {}/{} ({} rejected, {:.0}/s)",
                done.published,
                done.selected,
                done.rejected,
                done.published as f64 / started.elapsed().as_secs_f64().max(0.001)
            );
            let _ = std::io::stderr().flush();
        }
    }
    if progress {
        eprintln!();
    }
    Ok(done)
}
