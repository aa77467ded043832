//! The outbox table as the relay sees it: its columns, its id type, and
//! whether it has the relay-managed columns (`publish_state`, `attempts`,
//! `last_error`, `next_attempt_at`, `published_at`).

use crate::config::{Config, OnPublished};
use crate::postgres::outbox::derived;
use crate::postgres::sql::{qualified, quote_ident};

/// Name of the dead-letter table for outbox table `table`.
pub(crate) fn dead_letter_table(table: &str) -> String {
    format!("{table}_dead_letter")
}

/// The relay-managed columns the lifecycle features need.
pub(crate) const MANAGED: [&str; 5] = [
    "publish_state",
    "attempts",
    "last_error",
    "next_attempt_at",
    "published_at",
];

/// What the relay knows about the outbox table.
#[derive(Debug, Clone)]
pub(crate) struct Table {
    /// `"schema"."table"`, quoted.
    pub qualified: String,
    /// The id column, quoted.
    pub id: String,
    /// The id column's type, e.g. `uuid`.
    pub id_type: String,
    /// The created-at column, quoted, when the table has it.
    pub created_at: Option<String>,
    /// Every column: name and type oid, in table order.
    pub columns: Vec<(String, u32)>,
    /// Whether every relay-managed column exists.
    pub managed: bool,
    /// Whether the table has the derived lifecycle's column
    /// ([`derived::COLUMN`], `xid8`): its rows can be derived published.
    pub derived: bool,
    /// Whether the table is partitioned.
    pub partitioned: bool,
    /// The table's oid: what pgoutput's Relation messages identify it by,
    /// whatever the table was called when a row was written.
    pub oid: u32,
}

impl Table {
    /// Read the table's description; `None` when it does not exist.
    pub(crate) async fn inspect(
        client: &tokio_postgres::Client,
        config: &Config,
    ) -> Result<Option<Self>, tokio_postgres::Error> {
        let name = config.table();
        let rows = client
            .query(
                "SELECT a.attname::text, a.atttypid::oid, format_type(a.atttypid, a.atttypmod), c.relkind::text, c.oid \
                 FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid \
                 JOIN pg_namespace n ON n.oid = c.relnamespace \
                 WHERE n.nspname = $1 AND c.relname = $2 AND a.attnum > 0 AND NOT a.attisdropped \
                 ORDER BY a.attnum",
                &[&name.schema, &name.name],
            )
            .await?;
        if rows.is_empty() {
            return Ok(None);
        }
        let columns: Vec<(String, u32)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        let has = |c: &str| columns.iter().any(|(n, _)| n == c);
        let id_type = rows
            .iter()
            .find(|r| r.get::<_, &str>(0) == config.columns.id)
            .map(|r| r.get::<_, String>(2))
            .unwrap_or_else(|| "text".to_owned());
        let created_at = &config.columns.created_at;
        Ok(Some(Self {
            qualified: qualified(&name.schema, &name.name),
            id: quote_ident(&config.columns.id),
            id_type,
            created_at: (!created_at.is_empty() && has(created_at))
                .then(|| quote_ident(created_at)),
            managed: MANAGED.iter().all(|c| has(c)),
            derived: columns
                .iter()
                .any(|(n, t)| n == derived::COLUMN && *t == derived::XID8_OID),
            partitioned: rows[0].get::<_, &str>(3) == "p",
            oid: rows[0].get(4),
            columns,
        }))
    }

    /// `WHERE`-clause test of the id column against a `text[]` parameter `$n`.
    pub(crate) fn id_in(&self, n: usize) -> String {
        format!("{} = ANY(${n}::text[]::{}[])", self.id, self.id_type)
    }

    /// The statement that records rows (ids in `$1`) as published in `mode`:
    /// mark them, or delete them; `None` when the table is left alone.
    pub(crate) fn published_sql(&self, mode: OnPublished) -> Option<String> {
        match mode {
            OnPublished::Derive | OnPublished::Mark => Some(format!(
                "UPDATE {} SET publish_state = 'PUBLISHED', published_at = now() WHERE {}",
                self.qualified,
                self.id_in(1)
            )),
            OnPublished::Delete => Some(self.delete_sql()),
            OnPublished::None => None,
        }
    }

    /// The statement that records rows (ids in `$1`) as filtered out in `mode`.
    pub(crate) fn skipped_sql(&self, mode: OnPublished) -> Option<String> {
        match mode {
            OnPublished::Derive | OnPublished::Mark => Some(format!(
                "UPDATE {} SET publish_state = 'SKIPPED', published_at = now() WHERE {}",
                self.qualified,
                self.id_in(1)
            )),
            OnPublished::Delete => Some(self.delete_sql()),
            OnPublished::None => None,
        }
    }

    fn delete_sql(&self) -> String {
        format!("DELETE FROM {} WHERE {}", self.qualified, self.id_in(1))
    }

    /// `SELECT` list of every column of the table aliased `alias`, as text,
    /// in table order. Qualify `ORDER BY` with the alias too: an unqualified
    /// name would bind to these text output columns and defeat the indexes.
    pub(crate) fn text_columns(&self, alias: &str) -> String {
        self.columns
            .iter()
            .map(|(n, _)| format!("{alias}.{}::text", quote_ident(n)))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The statement that records a failed attempt: `$1` id, `$2` reason,
    /// `$3` too old (bool), `$4` seconds until the next attempt. DEAD once
    /// `max_attempts` is reached or the row is too old; FAILED otherwise.
    pub(crate) fn failure_sql(&self, max_attempts: i32) -> String {
        format!(
            "UPDATE {} SET publish_state = CASE WHEN attempts + 1 >= {max_attempts} OR $3 THEN 'DEAD' ELSE 'FAILED' END, \
             attempts = attempts + 1, last_error = $2, next_attempt_at = now() + make_interval(secs => $4) \
             WHERE {} = $1::text::{}",
            self.qualified, self.id, self.id_type
        )
    }
}

/// `reason` as a PostgreSQL text value can hold it: a NUL character (which
/// a destination's error answer may carry: a webhook receiver's body is
/// quoted in its reason) as U+FFFD. Text refuses NUL (SQLSTATE 22021), and a
/// reason that cannot be recorded would stop the stream at the event for
/// good: every reason written to `last_error` or `<table>_dead_letter` goes
/// through here.
pub(crate) fn storable(reason: &str) -> std::borrow::Cow<'_, str> {
    if reason.contains('\0') {
        std::borrow::Cow::Owned(reason.replace('\0', "\u{FFFD}"))
    } else {
        std::borrow::Cow::Borrowed(reason)
    }
}
