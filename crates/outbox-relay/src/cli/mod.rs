//! The command line: `run`, `setup`, `check`, `replay`, `status`, `purge`, `config`.
//!
//! Exit codes: 0 success; 1 the relay or a command failed at run time;
//! 2 bad usage or configuration; 3 `check` found problems.
//!
//! Here: the arguments, [`main`] (configuration, logging, runtime) and what
//! several commands share; each command's work is in the module named after
//! it (`config` only prints the defaults).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config::{Config, LogFormat};
use crate::postgres::platform::Choice;
use crate::postgres::ConnInfo;
use crate::signals::StopSignals;

mod check;
mod purge;
mod replay;
mod run;
mod setup;
mod status;

/// Exit code for run-time failures.
pub(crate) const EXIT_FAILURE: u8 = 1;
/// Exit code for bad usage or configuration.
pub(crate) const EXIT_CONFIG: u8 = 2;
/// Exit code for `check` finding problems.
pub(crate) const EXIT_CHECK: u8 = 3;

/// Publishes a Postgres outbox table's inserts, read from the write-ahead log.
#[derive(Debug, Parser)]
#[command(name = "outbox-relay", version, about)]
struct Cli {
    /// The configuration file (TOML); keys can be overridden with OUTBOX_RELAY__SECTION__KEY.
    #[arg(
        long,
        short,
        global = true,
        env = "OUTBOX_RELAY_CONFIG",
        value_name = "FILE"
    )]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Stream the outbox to the sink until SIGINT or SIGTERM.
    Run,
    /// Print the SQL that creates the table, publication, slot and role (or apply it).
    Setup {
        /// Run the SQL against the database instead of printing it (idempotent).
        #[arg(long)]
        apply: bool,
        /// Name of the least-privilege role to create.
        #[arg(long, default_value = crate::postgres::setup::DEFAULT_ROLE)]
        role: String,
        /// Create the outbox table partitioned by range of created_at.
        #[arg(long)]
        partitioned: bool,
        /// Render the role for this service's admin role: auto (connect and tell it from
        /// the server's roles), self-managed, rds, aurora, cloud-sql, azure, supabase or
        /// neon. Default: auto with --apply, self-managed when only printing.
        #[arg(long, value_name = "PLATFORM")]
        platform: Option<Choice>,
        /// The application's role, which inserts outbox rows: grant it INSERT and UPDATE
        /// on its own columns only, not on relay_txid and the relay-managed ones
        /// (sql/010_producer.sql; it must name its columns in INSERT).
        #[arg(long, value_name = "ROLE")]
        producer_role: Option<String>,
    },
    /// Verify wal_level, slot, publication, table and columns; exit 3 naming what is wrong.
    Check,
    /// Publish selected rows again (by time range, ids, aggregate, event type or state).
    Replay {
        /// Which rows.
        #[command(flatten)]
        selection: crate::pipeline::replay::Selection,
        /// At most this many events per second.
        #[arg(long)]
        rate: Option<f64>,
        /// Print the count and a sample; publish nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Slot lag, wal_status, confirmed position, rows by state; exit 1 when unhealthy.
    Status {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Print a full, commented configuration with every key at its default.
    Config,
    /// Delete PUBLISHED rows older than the given age now (retention, once).
    Purge {
        /// Age, e.g. 7d, 12h, 30m.
        #[arg(long, value_parser = parse_age)]
        older_than: std::time::Duration,
    },
}

fn parse_age(text: &str) -> Result<std::time::Duration, String> {
    crate::config::parse_duration(text)
}

/// Parse the command line and run it.
pub fn main() -> ExitCode {
    // First of all: for `run`, a stop requested while starting is a graceful stop.
    let signals = match StopSignals::install() {
        Ok(signals) => signals,
        Err(e) => {
            eprintln!("error: cannot install the SIGTERM/SIGINT handlers: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    let cli = Cli::parse();
    let signals = match cli.command {
        Command::Run => Some(signals),
        _ => {
            signals.default_action();
            None
        }
    };
    if matches!(cli.command, Command::Config) {
        print!("{}", crate::config::DEFAULT_CONFIG);
        return ExitCode::SUCCESS;
    }
    let Some(path) = cli.config.as_deref() else {
        eprintln!("error: --config FILE is required (or set OUTBOX_RELAY_CONFIG)");
        return ExitCode::from(EXIT_CONFIG);
    };
    let config = match Config::load(path) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    init_logging(&config);
    let mut builder = match config.runtime.worker_threads {
        1 => tokio::runtime::Builder::new_current_thread(),
        n => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n);
            b
        }
    };
    let runtime = match builder.enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    runtime.block_on(async move {
        match cli.command {
            // Boxed: the relay's future holds the whole configuration and
            // every worker's state, too large to move around on the stack.
            Command::Run => Box::pin(run::run(config, signals)).await,
            Command::Setup {
                apply,
                role,
                partitioned,
                platform,
                producer_role,
            } => {
                setup::run(
                    &config,
                    setup::Options {
                        apply,
                        role: &role,
                        partitioned,
                        platform,
                        producer: producer_role.as_deref(),
                    },
                )
                .await
            }
            Command::Check => check::run(&config).await,
            Command::Replay {
                selection,
                rate,
                dry_run,
            } => replay::run(&config, &selection, rate, dry_run).await,
            Command::Purge { older_than } => purge::run(&config, older_than).await,
            Command::Status { json } => status::run(&config, json).await,
            Command::Config => unreachable!("handled before loading a configuration"),
        }
    })
}

fn init_logging(config: &Config) {
    let filter =
        tracing_subscriber::EnvFilter::builder().parse_lossy(with_wing_targets(&config.log.level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match config.log.format {
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
        LogFormat::Pretty => builder.with_ansi(false).try_init(),
    };
}

/// A log target is its module's path, and the modules live in wings
/// (`outbox_relay::pipeline::stream`); a `log.level` written for the flat
/// layout before them (`outbox_relay::replication=debug`) would match
/// nothing and say nothing, so its targets are read as the modules' paths
/// now.
fn with_wing_targets(level: &str) -> String {
    const MOVED: &[(&str, &str)] = &[
        ("replication", "pipeline::stream"),
        ("ack", "pipeline::ack"),
        ("concurrency", "pipeline::concurrency"),
        ("envelope", "pipeline::envelope"),
        ("error", "pipeline::error"),
        ("outgoing", "pipeline::outgoing"),
        ("poller", "pipeline::poller"),
        ("publish", "pipeline::publish"),
        ("replay", "pipeline::replay"),
        ("route", "pipeline::route"),
        ("rows", "pipeline::rows"),
        ("walstream", "postgres::walstream"),
        ("tls", "postgres::tls"),
        ("silence", "postgres::silence"),
        ("readiness", "postgres::readiness"),
        ("check", "postgres::check"),
        ("platform", "postgres::platform"),
        ("failover", "postgres::failover"),
        ("position", "postgres::position"),
        ("setup", "postgres::setup"),
        ("monitor", "postgres::monitor"),
        ("stall", "postgres::stall"),
        ("table", "postgres::outbox::table"),
        ("marking", "postgres::outbox::marking"),
        ("record", "postgres::outbox::record"),
        ("retention", "postgres::outbox::retention"),
        ("aws", "sink::aws"),
    ];
    level
        .split(',')
        .map(|directive| {
            let Some(rest) = directive.trim_start().strip_prefix("outbox_relay::") else {
                return directive.to_owned();
            };
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            match MOVED.iter().find(|(old, _)| *old == &rest[..end]) {
                Some((_, new)) => format!("outbox_relay::{new}{}", &rest[end..]),
                None => directive.to_owned(),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// A session for a command: one-off, so without the silence bound (an
/// index built by `setup --apply`, a count over a large table may run for
/// minutes without a word).
async fn connect(config: &Config) -> Result<tokio_postgres::Client, ExitCode> {
    let conn = ConnInfo::new(&config.postgres)
        .map_err(|e| {
            eprintln!("error: {e}");
            ExitCode::from(EXIT_CONFIG)
        })?
        .without_silence_bound();
    conn.connect().await.map_err(|e| {
        eprintln!(
            "error: cannot connect to {}: {}",
            conn.display(),
            crate::report::Chain(&e)
        );
        ExitCode::from(EXIT_FAILURE)
    })
}

/// The outbox table, or the exit code once it is said why there is none.
async fn table_of(
    config: &Config,
    client: &tokio_postgres::Client,
) -> Result<crate::postgres::outbox::table::Table, ExitCode> {
    match crate::postgres::outbox::table::Table::inspect(client, config).await {
        Ok(Some(table)) => Ok(table),
        Ok(None) => {
            eprintln!(
                "error: table {} does not exist (postgres.table)",
                config.table()
            );
            Err(ExitCode::from(EXIT_FAILURE))
        }
        Err(e) => {
            eprintln!(
                "error: cannot inspect table {}: {}",
                config.table(),
                crate::report::Chain(&e)
            );
            Err(ExitCode::from(EXIT_FAILURE))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::with_wing_targets;

    #[test]
    fn a_log_level_written_for_the_flat_layout_selects_the_same_modules_in_their_wings() {
        assert_eq!(
            with_wing_targets(
                "info,outbox_relay::replication=debug,outbox_relay::aws::batch[send]=trace"
            ),
            "info,outbox_relay::pipeline::stream=debug,outbox_relay::sink::aws::batch[send]=trace"
        );
        assert_eq!(
            with_wing_targets("outbox_relay::pipeline::stream=debug,outbox_relay=warn,outbox_relay::sink::sns=debug"),
            "outbox_relay::pipeline::stream=debug,outbox_relay=warn,outbox_relay::sink::sns=debug",
            "today's targets, the crate and unmoved modules stay"
        );
        assert_eq!(
            with_wing_targets("outbox_relay::replicationx=debug"),
            "outbox_relay::replicationx=debug"
        );
    }
}
