//! `outbox-relay setup`: the SQL the project ships, rendered for the configured names.
//!
//! The files in `sql/` are compiled in. In them `{{name}}` stands for a quoted
//! identifier and `{{'name'}}` for a string literal; [`render`] fills both from
//! the configuration, so what is printed is exactly what `--apply` runs. Each
//! file is applied in its own transaction, in order, and each is idempotent
//! (`IF NOT EXISTS`), so `--apply` can be run again safely.
//!
//! On a managed service the admin role is no superuser, and the role file
//! differs ([`render_for`], [`crate::postgres::platform`]); the other files are the same
//! everywhere.

use crate::config::Config;
use crate::postgres::outbox::table::dead_letter_table;
use crate::postgres::platform::Platform;
use crate::postgres::sql::{quote_ident, quote_literal};

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
];

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

/// The values of the placeholders.
pub fn names(config: &Config, role: &str) -> Vec<(String, String)> {
    let table = config.table();
    let dead_letter = dead_letter_table(&table.name);
    let mut names = vec![
        ("schema".to_owned(), table.schema.clone()),
        ("table".to_owned(), table.name.clone()),
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
            "position".to_owned(),
            crate::postgres::position::table_name(&table.name),
        ),
        (
            "dead_letter_index".to_owned(),
            format!("{dead_letter}_failed_idx"),
        ),
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
    render_for(config, role, partitioned, Platform::SelfManaged)
}

/// [`render`], with the role file that `platform`'s admin role can run.
pub fn render_for(
    config: &Config,
    role: &str,
    partitioned: bool,
    platform: Platform,
) -> Result<Vec<(&'static str, String)>, UnknownPlaceholder> {
    let names = names(config, role);
    FILES
        .iter()
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
        let (name, literal) = match inner.strip_prefix('\'').and_then(|s| s.strip_suffix('\'')) {
            Some(name) => (name, true),
            None => (inner, false),
        };
        let value = names
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
            .ok_or_else(|| UnknownPlaceholder {
                file,
                name: name.to_owned(),
            })?;
        out.push_str(&if literal {
            quote_literal(value)
        } else {
            quote_ident(value)
        });
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Apply the rendered files, each in its own transaction.
pub async fn apply(
    client: &tokio_postgres::Client,
    files: &[(&'static str, String)],
) -> Result<(), (&'static str, tokio_postgres::Error)> {
    for (file, sql) in files {
        client
            .batch_execute(&format!("BEGIN;\n{sql}\nCOMMIT;"))
            .await
            .map_err(|e| (*file, e))?;
        // A failed file leaves the session in an aborted transaction; the
        // error above returns before another file runs on it.
    }
    Ok(())
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

    #[test]
    fn each_platform_gets_a_role_file_its_admin_role_can_run_and_the_rest_alike() {
        let config = Config::default();
        let plain = render(&config, "r", false).unwrap();
        for platform in crate::postgres::platform::ALL {
            let files = render_for(&config, "r", false, platform).unwrap();
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
