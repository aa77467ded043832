//! `outbox-relay check`: is this database ready for the relay, and if not, what to do.
//!
//! Each finding is a [`Finding`] with a severity and a fix. Errors make the
//! command exit non-zero; warnings do not.

use std::fmt;

use crate::config::{Config, OnPublished};
use crate::event::payload_type_supported;
use crate::postgres;

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    /// Fine.
    Ok,
    /// Works, but probably not what was meant.
    Warning,
    /// The relay cannot run like this.
    Error,
}

/// One thing checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// How bad.
    pub severity: Severity,
    /// What was checked and what was found; for problems, how to fix it.
    pub message: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tag = match self.severity {
            Severity::Ok => "ok     ",
            Severity::Warning => "warning",
            Severity::Error => "error  ",
        };
        write!(f, "{tag} {}", self.message)
    }
}

/// Run every check against the database.
pub async fn run(
    config: &Config,
    client: &tokio_postgres::Client,
) -> Result<Vec<Finding>, tokio_postgres::Error> {
    let mut out = Vec::new();
    let mut ok = |m: String| {
        out.push(Finding {
            severity: Severity::Ok,
            message: m,
        })
    };
    let mut findings = Vec::new();
    let mut error = |m: String| {
        findings.push(Finding {
            severity: Severity::Error,
            message: m,
        })
    };

    let wal_level: String = client.query_one("SHOW wal_level", &[]).await?.get(0);
    if wal_level == "logical" {
        ok("wal_level = logical".into());
    } else {
        error(format!(
            "wal_level = {wal_level}; logical replication needs wal_level = logical: \
             ALTER SYSTEM SET wal_level = logical, then restart Postgres"
        ));
    }

    let database: String = client
        .query_one("SELECT current_database()", &[])
        .await?
        .get(0);
    let slot = &config.postgres.slot;
    match postgres::slot_state(client, slot).await? {
        None => error(format!(
            "replication slot {slot:?} does not exist: run `outbox-relay setup --config FILE --apply` \
             or SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')"
        )),
        Some(s) if s.plugin.as_deref() != Some("pgoutput") => error(format!(
            "replication slot {slot:?} uses plugin {:?}, not pgoutput: drop it and recreate it with pgoutput",
            s.plugin.unwrap_or_default()
        )),
        Some(s) if s.database.as_deref() != Some(database.as_str()) => error(format!(
            "replication slot {slot:?} belongs to database {:?}, not {database:?}",
            s.database.unwrap_or_default()
        )),
        Some(s) if s.wal_status.as_deref() == Some("lost") => error(format!(
            "replication slot {slot:?} is invalidated (wal_status = lost): drop and recreate it"
        )),
        Some(s) => ok(format!(
            "replication slot {slot:?} (pgoutput, confirmed at {}, wal_status {})",
            s.confirmed_flush.map(postgres::format_lsn).unwrap_or_default(),
            s.wal_status.unwrap_or_default()
        )),
    }

    let table = config.table();
    let publication = &config.postgres.publication;
    let pubrow = client
        .query_opt(
            "SELECT pubinsert, pubviaroot FROM pg_publication WHERE pubname = $1",
            &[publication],
        )
        .await?;
    match pubrow {
        None => error(format!(
            "publication {publication:?} does not exist: run `outbox-relay setup --config FILE --apply` \
             or CREATE PUBLICATION {publication} FOR TABLE {table} WITH (publish = 'insert')"
        )),
        Some(row) if !row.get::<_, bool>(0) => error(format!(
            "publication {publication:?} does not publish inserts: \
             ALTER PUBLICATION {publication} SET (publish = 'insert')"
        )),
        Some(_) => {
            let included = client
                .query_opt(
                    "SELECT 1 FROM pg_publication_tables WHERE pubname = $1 AND schemaname = $2 AND tablename = $3",
                    &[publication, &table.schema, &table.name],
                )
                .await?
                .is_some();
            if included {
                ok(format!("publication {publication:?} carries inserts into {table}"));
            } else {
                error(format!(
                    "publication {publication:?} does not include {table}: \
                     ALTER PUBLICATION {publication} ADD TABLE {table}"
                ));
            }
        }
    }

    let mut warnings = Vec::new();
    match crate::table::Table::inspect(client, config).await? {
        None => error(format!(
            "table {table} does not exist (postgres.table): create it with `outbox-relay setup --config FILE --apply`"
        )),
        Some(described) => {
            let names = || {
                described
                    .columns
                    .iter()
                    .map(|(n, _)| n.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let mut fine = true;
            for (key, name) in config.columns.required() {
                match described.type_of(name) {
                    None => {
                        fine = false;
                        error(format!(
                            "table {table} has no column {name:?} (columns.{key}); it has: {}",
                            names()
                        ));
                    }
                    Some(t) if key == "payload" && !payload_type_supported(t) => {
                        fine = false;
                        error(format!(
                            "column {table}.{name} (columns.payload) must be jsonb, json, text, varchar or bytea"
                        ));
                    }
                    Some(_) => {}
                }
            }
            for (key, name) in config.columns.optional() {
                if !name.is_empty() && described.type_of(name).is_none() {
                    warnings.push(Finding {
                        severity: Severity::Warning,
                        message: format!(
                            "table {table} has no column {name:?} (columns.{key}); set columns.{key} = \"\" if that is intended"
                        ),
                    });
                }
            }
            if config.lifecycle.on_published == OnPublished::Mark && !described.managed {
                fine = false;
                error(format!(
                    "lifecycle.on_published = \"mark\" needs the columns {} in {table}; add them or set it to \"none\"",
                    crate::table::MANAGED.join(", ")
                ));
            }
            if fine {
                ok(format!("table {table} has the mapped columns"));
            }
        }
    }
    out.extend(warnings);
    out.extend(findings);
    Ok(out)
}
