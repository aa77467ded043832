//! Recording rejected events, so nothing is lost silently.
//!
//! An event the sink can never accept (too large, invalid, routed to a topic
//! that does not exist) or a row that cannot become an event is recorded
//! before its position is acknowledged:
//!
//! * when the outbox table has the relay-managed columns (`publish_state`,
//!   `last_error`, `attempts`), the row itself is marked `FAILED` with the
//!   reason and its attempt count raised;
//! * otherwise, into `<table>_dead_letter` (created by `outbox-relay setup`),
//!   with the envelope and the reason;
//! * with neither, the relay logs the event id and reason at error level and
//!   says at start-up that it has nowhere to record.
//!
//! Recording retries on database errors (with backoff) until it succeeds, so
//! the acknowledgement waits for it.

use std::sync::Arc;

use crate::config::Config;
use crate::retry::Backoff;
use crate::setup::{quote_ident, quote_literal};

/// Name of the dead-letter table for outbox table `table`.
pub fn dead_letter_table(table: &str) -> String {
    format!("{table}_dead_letter")
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Mode {
    InTable(String),
    DeadLetter(String),
    Nowhere,
}

/// Records rejected events in the database.
pub struct Recorder {
    client: Arc<tokio_postgres::Client>,
    mode: Mode,
    backoff: Backoff,
}

impl Recorder {
    /// Find out where rejections can be recorded for the configured table.
    pub async fn detect(
        client: Arc<tokio_postgres::Client>,
        config: &Config,
    ) -> Result<Self, tokio_postgres::Error> {
        let table = config.table();
        let qualified = format!(
            "{}.{}",
            quote_ident(&table.schema),
            quote_ident(&table.name)
        );
        let columns = client
            .query(
                "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod) \
                 FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid \
                 JOIN pg_namespace n ON n.oid = c.relnamespace \
                 WHERE n.nspname = $1 AND c.relname = $2 AND a.attnum > 0 AND NOT a.attisdropped",
                &[&table.schema, &table.name],
            )
            .await?;
        let type_of = |name: &str| {
            columns
                .iter()
                .find(|r| r.get::<_, &str>(0) == name)
                .map(|r| r.get::<_, String>(1))
        };
        let managed = ["publish_state", "last_error", "attempts"]
            .iter()
            .all(|c| type_of(c).is_some());
        let id_type = type_of(&config.columns.id).unwrap_or_else(|| "text".to_owned());
        let mode = if managed {
            Mode::InTable(format!(
                "UPDATE {qualified} SET publish_state = 'FAILED', last_error = $2, attempts = attempts + 1 \
                 WHERE {} = $1::text::{id_type}",
                quote_ident(&config.columns.id)
            ))
        } else {
            let dead_letter = dead_letter_table(&table.name);
            let exists: bool = client
                .query_one(
                    "SELECT to_regclass($1) IS NOT NULL",
                    &[&format!(
                        "{}.{}",
                        quote_ident(&table.schema),
                        quote_ident(&dead_letter)
                    )],
                )
                .await?
                .get(0);
            if exists {
                Mode::DeadLetter(format!(
                    "INSERT INTO {}.{} (event_id, event_type, aggregate_type, aggregate_id, envelope, reason) \
                     VALUES ($1, $3, $4, $5, $6, $2)",
                    quote_ident(&table.schema),
                    quote_ident(&dead_letter)
                ))
            } else {
                tracing::warn!(
                    table = %table,
                    "the outbox table has no publish_state/last_error/attempts columns and there is no {} table: \
                     rejected events will only be logged; create it with `outbox-relay setup`",
                    quote_literal(&dead_letter)
                );
                Mode::Nowhere
            }
        };
        Ok(Self {
            client,
            mode,
            backoff: Backoff::new(&config.retry),
        })
    }

    /// Record that event `id` was rejected for `reason`; `event` and
    /// `envelope` when there is one. Returns once it is recorded.
    pub async fn record(
        &self,
        id: &str,
        event: Option<&crate::event::OutboxEvent>,
        envelope: Option<&[u8]>,
        reason: &str,
    ) {
        let mut attempt = 0;
        loop {
            let result = match &self.mode {
                Mode::InTable(sql) => self.client.execute(sql.as_str(), &[&id, &reason]).await,
                Mode::DeadLetter(sql) => {
                    let envelope = envelope.map(String::from_utf8_lossy);
                    self.client
                        .execute(
                            sql.as_str(),
                            &[
                                &id,
                                &reason,
                                &event.map(|e| e.event_type.as_str()),
                                &event.map(|e| e.aggregate_type.as_str()),
                                &event.map(|e| e.aggregate_id.as_str()),
                                &envelope.as_deref(),
                            ],
                        )
                        .await
                }
                Mode::Nowhere => return,
            };
            match result {
                Ok(_) => return,
                Err(e) => {
                    let delay = self.backoff.delay(attempt);
                    attempt += 1;
                    tracing::warn!(id = %id, attempt, error = %e, "cannot record a rejected event yet, retrying");
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }
}
