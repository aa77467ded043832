//! `outbox-relay purge`: published rows older than an age deleted now, as
//! retention does on its timer ([`crate::postgres::outbox::retention`]); the table needs the
//! relay-managed columns to tell published rows (and, on a table whose state
//! is derived, `created_at`: rows derived published carry no `published_at`).

use std::process::ExitCode;

use super::{connect, table_of, EXIT_FAILURE};
use crate::config::Config;

/// Delete published rows older than `older_than`; the exit code.
pub(super) async fn run(config: &Config, older_than: std::time::Duration) -> ExitCode {
    let client = match connect(config).await {
        Ok(c) => c,
        Err(code) => return code,
    };
    let table = match table_of(config, &client).await {
        Ok(t) => t,
        Err(code) => return code,
    };
    if !table.managed {
        eprintln!(
            "error: table {} has no publish_state/published_at columns: nothing to purge",
            config.table()
        );
        return ExitCode::from(EXIT_FAILURE);
    }
    let reader =
        match crate::postgres::outbox::derived::Reader::of(&client, config, table.derived).await {
            Ok(reader) => reader,
            Err(e) => {
                eprintln!(
                    "error: cannot read the position table: {}",
                    crate::report::Chain(&e)
                );
                return ExitCode::from(EXIT_FAILURE);
            }
        };
    let r = &config.retention;
    match crate::postgres::outbox::retention::purge(
        &client,
        &table,
        reader.as_ref(),
        older_than,
        r.batch_size,
        r.drop_partitions,
    )
    .await
    {
        Ok(p) => {
            eprintln!(
                "deleted {} published rows in {} batches; dropped {} partitions",
                p.rows,
                p.batches,
                p.partitions.len()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: purge failed: {}", crate::report::Chain(&e));
            ExitCode::from(EXIT_FAILURE)
        }
    }
}
