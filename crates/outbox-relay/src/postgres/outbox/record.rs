//! Recording rejected events, so nothing is lost silently.
//!
//! An event the sink can never accept (too large, invalid, routed to a topic
//! that does not exist) or a row that cannot become an event is recorded
//! before its position is acknowledged:
//!
//! * when the outbox table has the relay-managed columns, the row itself is
//!   marked `FAILED` with the reason, its attempt count raised and its next
//!   attempt due after `poller.backoff_initial` (the poller retries it), or
//!   `DEAD` once it reached `poller.max_attempts`;
//! * otherwise, into `<table>_dead_letter` (created by `outbox-relay setup`),
//!   with the envelope and the reason;
//! * with neither, the relay refuses to start ([`RecordError::Nowhere`]).
//!
//! A rejected event whose row is gone (the application deleted it in the
//! same transaction, as Debezium-style outboxes do) can only go to the
//! dead-letter table. Without one the relay stops before acknowledging the
//! event ([`RecordError::RowGone`], fatal): a log line is not a record. After
//! the table is created, the restarted relay reads the event again and
//! records it there. `check` and the start-up warn when the table has the
//! managed columns but no dead-letter table (`readiness`).
//!
//! Recording retries database errors a few times with backoff; if it still
//! fails, the session ends and starts over on a fresh connection. Either way
//! the acknowledgement waits for it: nothing is acknowledged unrecorded.

use std::sync::Arc;

use crate::config::Config;
use crate::postgres::outbox::table::{dead_letter_table, Table};
use crate::postgres::sql::{qualified, quote_literal};
use crate::retry::Backoff;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Mode {
    /// Mark the row; when it is gone (deleted in its own transaction), the
    /// dead-letter insert if there is a dead-letter table.
    InTable(String, Option<String>),
    DeadLetter(String),
}

/// Rejected events would have nowhere to go.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// Neither the relay-managed columns nor a dead-letter table.
    #[error(
        "table {table} has no publish_state/attempts/last_error columns and there is no {dead_letter} table: \
         a rejected event would have nowhere to be recorded. Create the dead-letter table with \
         `outbox-relay setup --config FILE --apply` (or add the columns)"
    )]
    Nowhere {
        /// The outbox table.
        table: String,
        /// The dead-letter table looked for.
        dead_letter: String,
    },
    /// A rejected event's row is gone and there is no dead-letter table to
    /// take it: stop before acknowledging it.
    #[error(
        "event {id:?} was rejected ({reason}), no row of {table} has that id (it was deleted, e.g. in \
         its own transaction, or the id could not be read) or the table refused the update (a \
         trigger, a constraint or a row-level security policy), and there is no {dead_letter} table \
         to record it in. Nothing from it on was acknowledged. Create the dead-letter table \
         (`outbox-relay setup --config FILE --apply`, or sql/005_dead_letter.sql) and start the relay \
         again: the event is read again and recorded there"
    )]
    RowGone {
        /// The event.
        id: String,
        /// Why it was rejected.
        reason: String,
        /// The outbox table.
        table: String,
        /// The dead-letter table looked for.
        dead_letter: String,
    },
    /// A database error while looking.
    #[error("postgres: {0}")]
    Sql(#[from] tokio_postgres::Error),
    /// Recording kept failing.
    #[error("cannot record rejected event {id}: {source}")]
    Failed {
        /// The event.
        id: String,
        /// The last error.
        #[source]
        source: tokio_postgres::Error,
    },
}

/// Records rejected events in the database.
pub(crate) struct Recorder {
    client: Arc<tokio_postgres::Client>,
    mode: Mode,
    /// The outbox table and its dead-letter table, for messages.
    table: String,
    dead_letter: String,
    backoff: Backoff,
    /// Seconds until the poller's first retry of a failed row.
    retry_in: f64,
}

impl Recorder {
    /// Find out where rejections can be recorded for `table`; an error when
    /// there is nowhere (the relay must not acknowledge what it cannot record).
    pub(crate) async fn detect(
        client: Arc<tokio_postgres::Client>,
        config: &Config,
        table: &Table,
    ) -> Result<Self, RecordError> {
        let name = config.table();
        let dead_letter = dead_letter_table(&name.name);
        let qualified = qualified(&name.schema, &dead_letter);
        let exists: bool = client
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&qualified])
            .await?
            .get(0);
        let insert = exists.then(|| {
            format!(
                "INSERT INTO {qualified} (event_id, event_type, aggregate_type, aggregate_id, envelope, reason) \
                 VALUES ($1, $3, $4, $5, $6, $2)"
            )
        });
        let mode = if table.managed {
            Mode::InTable(table.failure_sql(config.poller.max_attempts), insert)
        } else if let Some(insert) = insert {
            Mode::DeadLetter(insert)
        } else {
            return Err(RecordError::Nowhere {
                table: name.to_string(),
                dead_letter: quote_literal(&dead_letter),
            });
        };
        Ok(Self {
            client,
            mode,
            table: name.to_string(),
            dead_letter,
            backoff: Backoff::new(&config.retry),
            retry_in: config.poller.backoff_initial.as_secs_f64(),
        })
    }

    /// Record that event `id` was rejected for `reason`; `event` and
    /// `envelope` when there is one. Retries a few times, then gives up with
    /// an error (the session then restarts on a fresh connection, and nothing
    /// is acknowledged meanwhile). [`RecordError::RowGone`] when the row is
    /// gone and there is no dead-letter table.
    pub(crate) async fn record(
        &self,
        id: &str,
        event: Option<&crate::event::OutboxEvent>,
        envelope: Option<&[u8]>,
        reason: &str,
    ) -> Result<(), RecordError> {
        const ATTEMPTS: u32 = 5;
        let mut attempt = 0;
        loop {
            match self.try_record(id, event, envelope, reason).await {
                Ok(true) => return Ok(()),
                Ok(false) => {
                    return Err(RecordError::RowGone {
                        id: id.to_owned(),
                        reason: reason.to_owned(),
                        table: self.table.clone(),
                        dead_letter: self.dead_letter.clone(),
                    })
                }
                Err(e) if attempt + 1 >= ATTEMPTS || self.client.is_closed() => {
                    return Err(RecordError::Failed {
                        id: id.to_owned(),
                        source: e,
                    })
                }
                Err(e) => {
                    let delay = self.backoff.delay(attempt);
                    attempt += 1;
                    tracing::warn!(id = %id, attempt, error = %crate::report::Chain(&e), "cannot record a rejected event yet, retrying");
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    async fn try_record(
        &self,
        id: &str,
        event: Option<&crate::event::OutboxEvent>,
        envelope: Option<&[u8]>,
        reason: &str,
    ) -> Result<bool, tokio_postgres::Error> {
        let reason = &*super::table::storable(reason);
        let dead_letter = |sql: &str| {
            let envelope = envelope.map(|e| String::from_utf8_lossy(e).into_owned());
            let sql = sql.to_owned();
            async move {
                self.client
                    .execute(
                        sql.as_str(),
                        &[
                            &id,
                            &reason,
                            &event.map(|e| e.event_type()),
                            &event.map(|e| e.aggregate_type()),
                            &event.map(|e| e.aggregate_id()),
                            &envelope.as_deref(),
                        ],
                    )
                    .await
            }
        };
        match &self.mode {
            Mode::InTable(update, insert) => {
                // An unreadable id cannot name its row: only the dead-letter table can take it.
                let updated = if id.is_empty() {
                    0
                } else {
                    match self
                        .client
                        .execute(update.as_str(), &[&id, &reason, &false, &self.retry_in])
                        .await
                    {
                        Ok(n) => n,
                        // Writing it again will not mend it: as for a row
                        // gone, the dead-letter table takes it, or the
                        // relay stops saying so (not a retry for ever).
                        Err(e) if super::marking::refused(&e) => {
                            tracing::error!(id = %id, error = %crate::report::Chain(&e), "the table refused to record this rejected event (a trigger, a constraint or a row-level security policy on the outbox table); it goes to the dead-letter table");
                            0
                        }
                        Err(e) => return Err(e),
                    }
                };
                if updated > 0 {
                    return Ok(true);
                }
                match insert {
                    Some(insert) => dead_letter(insert).await.map(|_| true),
                    None => Ok(false),
                }
            }
            Mode::DeadLetter(insert) => dead_letter(insert).await.map(|_| true),
        }
    }
}
