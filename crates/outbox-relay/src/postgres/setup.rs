//! `outbox-relay setup`: the SQL the project ships, rendered for the configured names.
//!
//! The files in `sql/` are compiled in. In them `{{name}}` stands for a quoted
//! identifier, `{{'name'}}` for a string literal and `{{=name}}` for SQL the
//! relay builds (the derived state's expression, [`derived`], so the view and
//! the relay read rows by one rule); [`render`] fills them from the
//! configuration, so what is printed is exactly what `--apply` runs. Each
//! file is applied in its own transaction, in order, and each is idempotent
//! (`IF NOT EXISTS`, or a test of the catalog first), so `--apply` can be run
//! again safely.
//!
//! A file that ends in `\gexec` ([`GEXEC`]) is a query returning statements
//! that may not run in a transaction (`CREATE INDEX CONCURRENTLY`): [`apply`]
//! runs each returned statement on its own, as psql's `\gexec` does. That is
//! how a table from before the derived lifecycle is migrated online
//! (`007_derived_column.sql`, `008_derived_indexes.sql`; docs/operations.md).
//!
//! On a managed service the admin role is no superuser, and the role file
//! differs ([`render_for`], [`crate::postgres::platform`]); the other files are the same
//! everywhere.

use crate::config::Config;
use crate::postgres::outbox::derived;
use crate::postgres::outbox::table::dead_letter_table;
use crate::postgres::platform::Platform;
use crate::postgres::sql::{qualified, quote_ident, quote_literal};

/// The shipped files, in order.
pub const FILES: &[(&str, &str)] = &[
    (
        "001_outbox_table.sql",
        include_str!("../../../../sql/001_outbox_table.sql"),
    ),
    (
        "002_publication.sql",
        include_str!("../../../../sql/002_publication.sql"),
    ),
    ("003_slot.sql", include_str!("../../../../sql/003_slot.sql")),
    ("004_role.sql", include_str!("../../../../sql/004_role.sql")),
    (
        "005_dead_letter.sql",
        include_str!("../../../../sql/005_dead_letter.sql"),
    ),
    (
        "006_position.sql",
        include_str!("../../../../sql/006_position.sql"),
    ),
    (
        "007_derived_column.sql",
        include_str!("../../../../sql/007_derived_column.sql"),
    ),
    (
        "008_derived_indexes.sql",
        include_str!("../../../../sql/008_derived_indexes.sql"),
    ),
    (
        "009_state_view.sql",
        include_str!("../../../../sql/009_state_view.sql"),
    ),
];

/// The application role's privileges (`setup --producer-role NAME`), after
/// the others.
pub const PRODUCER: (&str, &str) = (
    "010_producer.sql",
    include_str!("../../../../sql/010_producer.sql"),
);

/// How a file that returns the statements to run ends (psql's meta-command
/// that runs them).
pub const GEXEC: &str = "\\gexec";

/// How long a migration statement waits for a lock that would queue writes
/// behind it (`lock_timeout`): its lock is held a moment, but the wait for it
/// behind a long transaction would hold every insert.
pub const MIGRATION_LOCK_TIMEOUT: &str = "2s";

/// The table file for a partitioned outbox (`setup --partitioned`).
pub const PARTITIONED_TABLE: (&str, &str) = (
    "001_outbox_table_partitioned.sql",
    include_str!("../../../../sql/001_outbox_table_partitioned.sql"),
);

/// The slot file with `postgres.failover_slot` (PostgreSQL 17+).
pub const FAILOVER_SLOT: (&str, &str) = (
    "003_slot.sql",
    include_str!("../../../../sql/003_slot_failover.sql"),
);

/// Default name of the least-privilege role.
pub const DEFAULT_ROLE: &str = "outbox_relay";

/// A template asked for a name the configuration does not provide.
#[derive(Debug, thiserror::Error)]
#[error("{file}: unknown placeholder {{{{{name}}}}}")]
pub struct UnknownPlaceholder {
    file: &'static str,
    name: String,
}

/// The name of the view of rows with their state, for outbox table `table`.
pub fn state_view(table: &str) -> String {
    format!("{table}_state")
}

/// The name of the trigger that clears the id of a row set back to
/// `PENDING` (sql/009_state_view.sql), for outbox table `table`: cut as
/// PostgreSQL cuts it, since `check` looks it up by value.
pub(crate) fn requeue_trigger(table: &str) -> String {
    crate::config::pg_name(&format!("{table}_requeue")).to_owned()
}

/// The values of the placeholders (`{{=name}}`: SQL, inserted as it is).
pub fn names(config: &Config, role: &str) -> Vec<(String, String)> {
    let table = config.table();
    let dead_letter = dead_letter_table(&table.name);
    let position = crate::postgres::position::table_name(&table.name);
    let view = state_view(&table.name);
    let mut names = vec![
        ("schema".to_owned(), table.schema.clone()),
        ("table".to_owned(), table.name.clone()),
        (
            "table_regclass".to_owned(),
            qualified(&table.schema, &table.name),
        ),
        (
            "table_txid_index".to_owned(),
            format!("{}_txid_idx", table.name),
        ),
        (
            "table_explicit_index".to_owned(),
            format!("{}_explicit_idx", table.name),
        ),
        // The poller's index before the derived lifecycle: dropped once
        // table_explicit_index replaces it.
        (
            "table_due_index".to_owned(),
            format!("{}_due_idx", table.name),
        ),
        (
            "table_published_index".to_owned(),
            format!("{}_published_idx", table.name),
        ),
        (
            "publication".to_owned(),
            config.postgres.publication.clone(),
        ),
        ("slot".to_owned(), config.postgres.slot.clone()),
        ("role".to_owned(), role.to_owned()),
        (
            "table_default_partition".to_owned(),
            format!("{}_default", table.name),
        ),
        (
            "table_id_index".to_owned(),
            format!("{}_id_idx", table.name),
        ),
        ("dead_letter".to_owned(), dead_letter.clone()),
        (
            "position_regclass".to_owned(),
            qualified(&table.schema, &position),
        ),
        (
            "=position_join".to_owned(),
            derived::join(
                &qualified(&table.schema, &position),
                &quote_literal(&config.postgres.slot),
                "p",
            ),
        ),
        ("position".to_owned(), position),
        (
            "dead_letter_index".to_owned(),
            format!("{dead_letter}_failed_idx"),
        ),
        (
            "state_view_regclass".to_owned(),
            qualified(&table.schema, &view),
        ),
        ("state_view".to_owned(), view),
        ("requeue".to_owned(), requeue_trigger(&table.name)),
        ("=state".to_owned(), derived::state("o", "p")),
        ("lock_timeout".to_owned(), MIGRATION_LOCK_TIMEOUT.to_owned()),
    ];
    let c = &config.columns;
    for (key, column) in c.required().into_iter().chain(c.optional()) {
        // A switched-off optional column keeps its default name in the table.
        let column = if column.is_empty() { key } else { column };
        names.push((format!("col_{key}"), column.to_owned()));
    }
    names
}

/// Render every file: `(file name, SQL)`; with `partitioned`, the table is
/// partitioned by range of created_at. The role file is the self-managed
/// one, for a superuser.
pub fn render(
    config: &Config,
    role: &str,
    partitioned: bool,
) -> Result<Vec<(&'static str, String)>, UnknownPlaceholder> {
    render_for(config, role, partitioned, Platform::SelfManaged, None)
}

/// [`render`], with the role file that `platform`'s admin role can run, and
/// with `producer`, the application role's column privileges ([`PRODUCER`]).
pub fn render_for(
    config: &Config,
    role: &str,
    partitioned: bool,
    platform: Platform,
    producer: Option<&str>,
) -> Result<Vec<(&'static str, String)>, UnknownPlaceholder> {
    let mut names = names(config, role);
    if let Some(producer) = producer {
        names.push(("producer".to_owned(), producer.to_owned()));
    }
    FILES
        .iter()
        .chain(producer.map(|_| &PRODUCER))
        .map(|&(file, text)| {
            let (file, text) = if partitioned && file.starts_with("001") {
                PARTITIONED_TABLE
            } else if config.postgres.failover_slot && file.starts_with("003") {
                FAILOVER_SLOT
            } else if file.starts_with("004") {
                platform.role_file().unwrap_or((file, text))
            } else {
                (file, text)
            };
            Ok((file, render_one(file, text, &names)?))
        })
        .collect()
}

fn render_one(
    file: &'static str,
    text: &str,
    names: &[(String, String)],
) -> Result<String, UnknownPlaceholder> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let Some(end) = after.find("}}") else {
            out.push_str(&rest[start..]);
            rest = "";
            break;
        };
        let inner = &after[..end];
        enum Form {
            Ident,
            Literal,
            Sql,
        }
        let (name, form) = match inner.strip_prefix('\'').and_then(|s| s.strip_suffix('\'')) {
            Some(name) => (name, Form::Literal),
            None if inner.starts_with('=') => (inner, Form::Sql),
            None => (inner, Form::Ident),
        };
        let value = names
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
            .ok_or_else(|| UnknownPlaceholder {
                file,
                name: name.to_owned(),
            })?;
        out.push_str(&match form {
            Form::Literal => quote_literal(value),
            Form::Ident => quote_ident(value),
            Form::Sql => value.clone(),
        });
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Apply the rendered files, each in its own transaction; a file ending in
/// [`GEXEC`] is a query whose rows are statements, each run on its own
/// (outside a transaction, as `CREATE INDEX CONCURRENTLY` must).
pub async fn apply(
    client: &tokio_postgres::Client,
    files: &[(&'static str, String)],
) -> Result<(), (&'static str, tokio_postgres::Error)> {
    for (file, sql) in files {
        match sql.trim_end().strip_suffix(GEXEC) {
            Some(query) => {
                for statement in statements(client, query).await.map_err(|e| (*file, e))? {
                    // A failed statement stops here; the next --apply asks
                    // the catalog again and goes on from where this stopped.
                    client
                        .batch_execute(&statement)
                        .await
                        .map_err(|e| (*file, e))?;
                }
            }
            None => client
                .batch_execute(&format!("BEGIN;\n{sql}\nCOMMIT;"))
                .await
                .map_err(|e| (*file, e))?,
        }
        // A failed file leaves the session in an aborted transaction; the
        // error above returns before another file runs on it.
    }
    Ok(())
}

/// The statements a [`GEXEC`] query returns (its first column), in order.
async fn statements(
    client: &tokio_postgres::Client,
    query: &str,
) -> Result<Vec<String>, tokio_postgres::Error> {
    Ok(client
        .simple_query(query)
        .await?
        .into_iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
            _ => None,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_become_quoted_names_and_literals() {
        let names = vec![
            ("table".to_owned(), "Out Box".to_owned()),
            ("slot".to_owned(), "it's".to_owned()),
        ];
        assert_eq!(
            render_one("t", "x {{table}} y {{'slot'}} z", &names).unwrap(),
            "x \"Out Box\" y 'it''s' z"
        );
        assert!(render_one("t", "{{nope}}", &names).is_err());
        let names = vec![("=expr".to_owned(), "a.b = 'x'".to_owned())];
        assert_eq!(
            render_one("t", "({{=expr}})", &names).unwrap(),
            "(a.b = 'x')"
        );
    }

    #[test]
    fn every_shipped_file_renders_with_the_default_names() {
        let mut config = Config::default();
        for failover in [false, true] {
            config.postgres.failover_slot = failover;
            for partitioned in [false, true] {
                for (file, sql) in render(&config, DEFAULT_ROLE, partitioned).unwrap() {
                    assert!(!sql.contains("{{"), "{file} left a placeholder");
                    if file == "003_slot.sql" {
                        assert_eq!(sql.contains("false, false, true"), failover, "{sql}");
                    }
                }
            }
        }
    }

    /// `postgres.table` is refused when PostgreSQL would cut two names of
    /// relations `setup` creates into one, from the list of their suffixes
    /// in config: every name the shipped files make from the table's is in
    /// it (or is the requeue trigger and its function, not relations).
    #[test]
    fn every_name_made_from_the_tables_is_one_the_configuration_checks() {
        let mut config = Config::default();
        config.postgres.table = "public.tbl".into();
        let mut made = std::collections::BTreeSet::new();
        for partitioned in [false, true] {
            for (_, sql) in render(&config, DEFAULT_ROLE, partitioned).unwrap() {
                for (at, _) in sql.match_indices("tbl_") {
                    let word = sql[at + 3..]
                        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                        .next()
                        .unwrap();
                    if at == 0
                        || !sql[..at].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
                    {
                        made.insert(word.to_owned());
                    }
                }
            }
        }
        assert!(made.contains("_dead_letter_failed_idx"), "{made:?}");
        for suffix in made {
            assert!(
                crate::config::RELATION_SUFFIXES.contains(&suffix.as_str()) || suffix == "_requeue",
                "setup names tbl{suffix} after the table; add {suffix} to config's RELATION_SUFFIXES"
            );
        }
    }

    #[test]
    fn the_derived_lifecycle_is_rendered_from_the_relays_own_names_and_sql() {
        let config = Config::default();
        let files = render(&config, "r", false).unwrap();
        let file = |prefix: &str| {
            files
                .iter()
                .find(|(f, _)| f.starts_with(prefix))
                .map(|(_, sql)| sql.as_str())
                .unwrap_or_else(|| panic!("no {prefix}"))
        };
        // The column with its default; the view reads rows by the relay's rule.
        assert!(file("001").contains("relay_txid      xid8        DEFAULT pg_current_xact_id()"));
        assert!(file("009").contains(&derived::state("o", "p")));
        assert!(file("009")
            .contains("LEFT JOIN public.outbox_position p ON p.slot_name = 'outbox_relay'"));
        // Every column the relay keeps its snapshots in, created and added.
        for (column, kind) in derived::POSITION_COLUMNS {
            let position = file("006");
            assert!(
                position.contains(&format!("\n    {column:<17} {kind}")),
                "{column}"
            );
            assert!(
                position.contains(&format!("ADD COLUMN IF NOT EXISTS {column:<12} {kind}")),
                "{column}"
            );
        }
        // Never the one-statement ADD COLUMN ... DEFAULT that stamps old rows.
        let migration = file("007");
        assert!(migration.contains("ADD COLUMN IF NOT EXISTS relay_txid xid8;"));
        assert!(migration.contains("ALTER COLUMN relay_txid SET DEFAULT pg_current_xact_id();"));
        assert!(file("008").trim_end().ends_with(GEXEC));
        // The producer's file only when asked for.
        assert!(!files.iter().any(|(f, _)| *f == PRODUCER.0));
        let with = render_for(&config, "r", false, Platform::SelfManaged, Some("app")).unwrap();
        let (last, producer) = with.last().unwrap();
        assert_eq!(*last, PRODUCER.0);
        assert!(producer.contains("REVOKE INSERT, UPDATE ON public.outbox FROM app;"));
        assert_eq!(with[..with.len() - 1], files[..]);
    }

    #[test]
    fn each_platform_gets_a_role_file_its_admin_role_can_run_and_the_rest_alike() {
        let config = Config::default();
        let plain = render(&config, "r", false).unwrap();
        for platform in crate::postgres::platform::ALL {
            let files = render_for(&config, "r", false, platform, None).unwrap();
            let names: Vec<&str> = files.iter().map(|(f, _)| *f).collect();
            let role = &files[3].1;
            let expected: &[&str] = match platform {
                Platform::SelfManaged => &["CREATE ROLE r WITH LOGIN REPLICATION;"],
                Platform::Rds | Platform::Aurora => {
                    &["CREATE ROLE r WITH LOGIN;", "GRANT rds_replication TO r;"]
                }
                Platform::CloudSql | Platform::Azure | Platform::Supabase | Platform::Neon => &[
                    "CREATE ROLE r WITH LOGIN;",
                    "IF NOT (SELECT rolreplication FROM pg_roles WHERE rolname = 'r') THEN",
                    "ALTER ROLE r WITH REPLICATION;",
                ],
            };
            for line in expected {
                assert!(
                    role.contains(line),
                    "{platform:?} {}: no {line:?}",
                    names[3]
                );
            }
            // Nothing a managed admin role may not do.
            if platform != Platform::SelfManaged {
                assert!(!role.contains("LOGIN REPLICATION"), "{platform:?}");
            }
            // The same grants, and every other file as for a superuser.
            for grant in [
                "GRANT USAGE ON SCHEMA public TO r;",
                "GRANT SELECT, UPDATE, DELETE ON public.outbox TO r;",
            ] {
                assert!(role.contains(grant), "{platform:?}: no {grant}");
            }
            for (i, (file, sql)) in files.iter().enumerate().filter(|(i, _)| *i != 3) {
                assert_eq!((*file, sql), (plain[i].0, &plain[i].1), "{platform:?}");
            }
            assert!(!role.contains("{{"), "{platform:?}");
        }
        assert_eq!(plain[3].0, "004_role.sql");
    }
}
