//! `outbox-relay replay`: publish selected rows again.
//!
//! Rows are selected by time range (`created_at`, from inclusive, to
//! exclusive), ids, aggregate type or id, event type and publish state, and
//! published oldest first through the same mapping, filter, routing, envelope
//! and sink as the stream. Delivered rows become PUBLISHED (or are deleted in
//! delete mode); a rejected row is recorded like any failed attempt (FAILED,
//! or DEAD at `poller.max_attempts`). The selected ids are read first (about
//! 50 bytes each), then the rows page by page. `--dry-run` prints the count and a sample and publishes nothing.
//!
//! On a table whose state is derived (`on_published = "derive"`,
//! [`derived::Reader`]) `--state` and the sample read each row's derived
//! state ([`derived::state`]): a row the stream published is PUBLISHED
//! though its `publish_state` is still `PENDING`; explicit states win.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use tokio_postgres::types::ToSql;
use tokio_postgres::Client;

use crate::config::{Config, OnPublished};
use crate::pipeline::rows::{batches, Prepared, Rows, TEXT_SETTINGS};
use crate::pipeline::sink::{Message, Outcome, Sink};
use crate::postgres::outbox::derived::{self, Reader};
use crate::postgres::outbox::table::{storable, Table};
use crate::postgres::sql::quote_ident;
use crate::retry::Backoff;

/// Rows fetched per page.
const PAGE: usize = 100;
/// Transient failures of one batch before replay gives up.
const MAX_RETRIES: u32 = 10;

/// Which rows to replay; every given criterion must hold. Also the
/// `replay` command's selection flags.
#[derive(Debug, Clone, Default, clap::Args)]
pub(crate) struct Selection {
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
pub(crate) struct Replayed {
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
pub(crate) enum ReplayError {
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

/// The rows' state on the table aliased `o`: derived with a `reader`.
fn state(reader: Option<&Reader>) -> String {
    match reader {
        Some(reader) => derived::state("o", &reader.p),
        None => "o.publish_state".to_owned(),
    }
}

/// The selection's `WHERE` clause, on the table aliased `o`.
fn build(
    config: &Config,
    table: &Table,
    reader: Option<&Reader>,
    selection: &Selection,
) -> Result<Query, ReplayError> {
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
        parts.push(format!("{} = ANY({p}::text[])", state(reader)));
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
pub(crate) async fn dry_run(
    client: &Client,
    config: &Config,
    table: &Table,
    selection: &Selection,
) -> Result<(i64, Vec<String>), ReplayError> {
    let reader = Reader::of(client, config, table.derived).await?;
    let q = build(config, table, reader.as_ref(), selection)?;
    let count: i64 = client
        .query_one(
            &format!(
                "SELECT count(*) FROM {} AS o WHERE {}",
                table.qualified, q.clause
            ),
            &q.refs(),
        )
        .await?
        .get(0);
    let c = &config.columns;
    let state = if table.managed {
        state(reader.as_ref())
    } else {
        "'-'".to_owned()
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
pub(crate) async fn run<S: Sink>(
    client: &mut Client,
    config: &Config,
    table: &Table,
    database: &str,
    selection: &Selection,
    sink: &S,
    rate: Option<f64>,
) -> Result<Replayed, ReplayError> {
    let reader = Reader::of(client, config, table.derived).await?;
    let q = build(config, table, reader.as_ref(), selection)?;
    name_source(client, config, database, sink).await;
    let ids = select_ids(client, table, selection, &q).await?;
    let mut done = Replayed {
        selected: ids.len(),
        ..Replayed::default()
    };
    let mut rows_to_messages =
        Rows::new(config, table, database).map_err(|e| ReplayError::Invalid(e.to_string()))?;
    let pass = Pass {
        sink,
        backoff: Backoff::new(&config.retry),
        rate,
        started: Instant::now(),
    };
    let progress = std::io::stderr().is_terminal();
    let statements = Statements::new(config, table);
    for page in ids.chunks(PAGE) {
        let rows = fetch(client, &statements.fetch, page).await?;
        let (messages, mut rejected) = prepare(&mut rows_to_messages, &rows, &mut done);
        let published = pass.publish(&messages, &mut rejected, &done).await?;
        statements.record(client, &published, &rejected).await?;
        done.published += published.len();
        done.rejected += rejected.len();
        if progress {
            show_progress(&done, pass.started);
        }
    }
    if progress {
        eprintln!();
    }
    Ok(done)
}

/// The sink told the source's identity, so claim-check objects are named as
/// the stream names them; a database that revoked pg_control_system() only
/// leaves payloads over their topic's limit unable to go.
async fn name_source<S: Sink>(client: &Client, config: &Config, database: &str, sink: &S) {
    match crate::postgres::source(client, database, &config.table()).await {
        Ok(source) => sink.source(&source),
        Err(e) => tracing::warn!(
            error = %crate::report::Chain(&e),
            "cannot read the system identifier (pg_control_system()): a payload over its topic's limit cannot be stored in S3"
        ),
    }
}

/// The ids of the selected rows, oldest first, at most the selection's
/// limit: read first (about 50 bytes each), the rows then fetched page by
/// page by id.
async fn select_ids(
    client: &Client,
    table: &Table,
    selection: &Selection,
    q: &Query,
) -> Result<Vec<String>, ReplayError> {
    let limit = selection
        .limit
        .map_or(String::new(), |l| format!(" LIMIT {l}"));
    Ok(client
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
        .collect())
}

/// The SQL a replay runs for each page: the rows of a page of ids, and how
/// published and rejected rows are recorded (none where the table keeps no
/// state for them).
struct Statements {
    fetch: String,
    published: Option<String>,
    rejected: Option<String>,
    /// When a rejected row is due again, in seconds.
    retry_in: f64,
}

impl Statements {
    fn new(config: &Config, table: &Table) -> Self {
        let fetch = format!(
            "SELECT {} FROM {} AS o WHERE o.{} ORDER BY {}",
            table.text_columns("o"),
            table.qualified,
            table.id_in(1),
            order(table)
        );
        let mode = config.lifecycle.on_published;
        let published = match mode {
            // Nothing to mark on a table without the managed columns.
            OnPublished::Mark | OnPublished::Derive if !table.managed => None,
            _ => table.published_sql(mode),
        };
        let rejected = table
            .managed
            .then(|| table.failure_sql(config.poller.max_attempts));
        Self {
            fetch,
            published,
            rejected,
            retry_in: config.poller.backoff_initial.as_secs_f64(),
        }
    }

    /// A page's outcomes in the table: the published rows marked (or
    /// deleted) together, then each rejected row printed and recorded as a
    /// failed attempt.
    async fn record(
        &self,
        client: &Client,
        published: &[String],
        rejected: &[(String, String)],
    ) -> Result<(), ReplayError> {
        if let (Some(sql), false) = (&self.published, published.is_empty()) {
            client.execute(sql.as_str(), &[&published]).await?;
        }
        for (id, reason) in rejected {
            eprintln!("rejected {id}: {reason}");
            if let Some(sql) = &self.rejected {
                client
                    .execute(
                        sql.as_str(),
                        &[id, &storable(reason), &false, &self.retry_in],
                    )
                    .await?;
            }
        }
        Ok(())
    }
}

/// The rows of one page of ids, read as text under the relay's session
/// settings (so values render as the stream renders them).
async fn fetch(
    client: &mut Client,
    sql: &str,
    page: &[String],
) -> Result<Vec<tokio_postgres::Row>, ReplayError> {
    let page: Vec<String> = page.to_vec();
    let tx = client.transaction().await?;
    tx.batch_execute(TEXT_SETTINGS).await?;
    let rows = tx.query(sql, &[&page]).await?;
    tx.commit().await?;
    Ok(rows)
}

/// A page's rows as messages to publish and rows rejected before any sink
/// sees them (they did not map); filtered rows only counted.
fn prepare(
    rows_to_messages: &mut Rows,
    rows: &[tokio_postgres::Row],
    done: &mut Replayed,
) -> (Vec<Message>, Vec<(String, String)>) {
    let mut messages: Vec<Message> = Vec::new();
    let mut rejected: Vec<(String, String)> = Vec::new();
    for row in rows {
        match rows_to_messages.prepare(row) {
            Prepared::Publish(m) => messages.push(m),
            Prepared::Skip(_) => done.skipped += 1,
            Prepared::Fail(id, reason) => rejected.push((id, reason)),
        }
    }
    (messages, rejected)
}

/// Publishing a replay's batches: with retries, and paced to the rate.
struct Pass<'a, S> {
    sink: &'a S,
    backoff: Backoff,
    rate: Option<f64>,
    started: Instant,
}

impl<S: Sink> Pass<'_, S> {
    /// A page's messages published batch by batch: the ids delivered, and
    /// each rejected one added to `rejected` with the sink's reason.
    async fn publish(
        &self,
        messages: &[Message],
        rejected: &mut Vec<(String, String)>,
        done: &Replayed,
    ) -> Result<Vec<String>, ReplayError> {
        let mut published: Vec<String> = Vec::new();
        for batch in batches(messages, self.sink.max_batch().max(1)) {
            let outcomes = self
                .publish_batch(batch, done.published + published.len())
                .await?;
            // A retried batch is sent whole again; what was delivered before is delivered again.
            for (m, outcome) in batch.iter().zip(outcomes) {
                match outcome {
                    Outcome::Delivered => published.push(m.event.id().to_string()),
                    Outcome::Rejected(reason) => rejected.push((m.event.id().to_string(), reason)),
                    // Not left after `publish_batch`; counted as rejected if it ever were.
                    Outcome::Retryable(retry) => {
                        rejected.push((m.event.id().to_string(), retry.reason))
                    }
                }
            }
            self.pace(done.published + published.len()).await;
        }
        Ok(published)
    }

    /// One batch's outcomes once none is transient: the whole batch sent
    /// again after a backoff while one is, at most [`MAX_RETRIES`] times;
    /// then the replay stops, saying how many rows (`published` so far) went.
    async fn publish_batch(
        &self,
        batch: &[Message],
        published: usize,
    ) -> Result<Vec<Outcome>, ReplayError> {
        let mut attempt = 0;
        loop {
            let outcomes = self.sink.publish(batch).await;
            let transient = outcomes.iter().find_map(|o| match o {
                Outcome::Retryable(r) => Some(r.reason.clone()),
                _ => None,
            });
            match transient {
                None => return Ok(outcomes),
                Some(reason) if attempt >= MAX_RETRIES => {
                    return Err(ReplayError::Sink(reason, published))
                }
                Some(reason) => {
                    tracing::warn!(attempt, error = %reason, "publish failed, retrying");
                    tokio::time::sleep(self.backoff.delay(attempt)).await;
                    attempt += 1;
                }
            }
        }
    }

    /// Wait until `published` rows are no more than the rate allows since
    /// the replay started.
    async fn pace(&self, published: usize) {
        if let Some(rate) = self.rate {
            let due = Duration::from_secs_f64(published as f64 / rate);
            if let Some(wait) = due.checked_sub(self.started.elapsed()) {
                tokio::time::sleep(wait).await;
            }
        }
    }
}

/// One line of progress on a terminal, overwritten by the next.
fn show_progress(done: &Replayed, started: Instant) {
    eprint!(
        "\rreplayed {}/{} ({} rejected, {:.0}/s)",
        done.published,
        done.selected,
        done.rejected,
        done.published as f64 / started.elapsed().as_secs_f64().max(0.001)
    );
    let _ = std::io::stderr().flush();
}
