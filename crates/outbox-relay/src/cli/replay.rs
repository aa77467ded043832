//! `outbox-relay replay`: selected rows published again through the
//! configured sink ([`crate::pipeline::replay`]), or with `--dry-run` counted and
//! sampled; exit 1 when any was rejected.

use std::process::ExitCode;

use super::{connect, table_of, EXIT_CONFIG, EXIT_FAILURE};
use crate::config::Config;
use crate::postgres::ConnInfo;
use crate::sink::Configured;

/// Replay the selected rows (or count them); the exit code.
pub(super) async fn run(
    config: &Config,
    selection: &crate::pipeline::replay::Selection,
    rate: Option<f64>,
    dry_run: bool,
) -> ExitCode {
    let mut client = match connect(config).await {
        Ok(c) => c,
        Err(code) => return code,
    };
    let table = match table_of(config, &client).await {
        Ok(t) => t,
        Err(code) => return code,
    };
    if dry_run {
        return match crate::pipeline::replay::dry_run(&client, config, &table, selection).await {
            Ok((count, sample)) => {
                println!("{count} rows would be replayed");
                for line in sample {
                    println!("  {line}");
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(EXIT_FAILURE)
            }
        };
    }
    let database = ConnInfo::new(&config.postgres)
        .map(|c| c.dbname)
        .unwrap_or_default();
    let sink = match Configured::new(config.sink.kind, &config.destinations).await {
        Ok(sink) => sink,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let result = crate::pipeline::replay::run(
        &mut client,
        config,
        &table,
        &database,
        selection,
        &sink,
        rate,
    )
    .await;
    match result {
        Ok(done) => {
            eprintln!(
                "replayed {} of {} selected rows ({} rejected, {} filtered out)",
                done.published, done.selected, done.rejected, done.skipped
            );
            if done.rejected > 0 {
                ExitCode::from(EXIT_FAILURE)
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}
