//! The command line: `run`, `setup`, `check`, `replay`, `status`, `purge`, `config`.
//!
//! Exit codes: 0 success; 1 the relay or a command failed at run time;
//! 2 bad usage or configuration; 3 `check` found problems.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use crate::check::{self, Severity};
use crate::config::{Config, LogFormat};
use crate::platform::{self, Choice, Platform};
use crate::postgres::ConnInfo;
use crate::replication::ErrorClass;
use crate::setup;
use crate::signals::StopSignals;
use crate::sink::{Configured, Sink};

/// Exit code for run-time failures.
pub const EXIT_FAILURE: u8 = 1;
/// Exit code for bad usage or configuration.
pub const EXIT_CONFIG: u8 = 2;
/// Exit code for `check` finding problems.
pub const EXIT_CHECK: u8 = 3;

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
        #[arg(long, default_value = setup::DEFAULT_ROLE)]
        role: String,
        /// Create the outbox table partitioned by range of created_at.
        #[arg(long)]
        partitioned: bool,
        /// Render the role for this service's admin role: auto (connect and tell it from
        /// the server's roles), self-managed, rds, aurora, cloud-sql, azure, supabase or
        /// neon. Default: auto with --apply, self-managed when only printing.
        #[arg(long, value_name = "PLATFORM")]
        platform: Option<Choice>,
    },
    /// Verify wal_level, slot, publication, table and columns; exit 3 naming what is wrong.
    Check,
    /// Publish selected rows again (by time range, ids, aggregate, event type or state).
    Replay {
        /// Which rows.
        #[command(flatten)]
        selection: crate::replay::Selection,
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
            Command::Run => run(config, signals).await,
            Command::Setup {
                apply,
                role,
                partitioned,
                platform,
            } => setup_cmd(&config, apply, &role, partitioned, platform).await,
            Command::Check => check_cmd(&config).await,
            Command::Replay {
                selection,
                rate,
                dry_run,
            } => replay_cmd(&config, &selection, rate, dry_run).await,
            Command::Purge { older_than } => purge_cmd(&config, older_than).await,
            Command::Status { json } => status_cmd(&config, json).await,
            Command::Config => unreachable!("handled before loading a configuration"),
        }
    })
}

fn init_logging(config: &Config) {
    let filter = tracing_subscriber::EnvFilter::builder().parse_lossy(&config.log.level);
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match config.log.format {
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
        LogFormat::Pretty => builder.with_ansi(false).try_init(),
    };
}

async fn run(config: Config, signals: Option<StopSignals>) -> ExitCode {
    let stop = CancellationToken::new();
    if let Some(signals) = signals {
        tokio::spawn(signals.watch(stop.clone()));
    }
    match Configured::new(&config).await {
        Ok(sink) => relay(&config, sink, stop).await,
        Err(e) => {
            tracing::error!(error = %crate::postgres::Chain(&e), "cannot set up the sink");
            ExitCode::from(EXIT_CONFIG)
        }
    }
}

async fn relay<S: Sink>(config: &Config, sink: S, stop: CancellationToken) -> ExitCode {
    match crate::relay::run(config, Arc::new(sink), stop).await {
        Ok(summary) => {
            tracing::info!(
                delivered = summary.delivered,
                rejected = summary.rejected,
                "stopped"
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            tracing::error!(error = %crate::postgres::Chain(&e), "relay stopped");
            match e.class() {
                ErrorClass::Fatal | ErrorClass::Transient => ExitCode::from(EXIT_FAILURE),
            }
        }
    }
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
            crate::postgres::Chain(&e)
        );
        ExitCode::from(EXIT_FAILURE)
    })
}

async fn setup_cmd(
    config: &Config,
    apply: bool,
    role: &str,
    partitioned: bool,
    choice: Option<Choice>,
) -> ExitCode {
    // Printing needs no server unless asked to tell the platform from it.
    let client = match (apply, choice) {
        (true, _) | (false, Some(Choice::Auto)) => match connect(config).await {
            Ok(c) => Some(c),
            Err(code) => return code,
        },
        (false, _) => None,
    };
    let (platform, why) = match (choice, &client) {
        (Some(Choice::Given(platform)), _) => (platform, "--platform".to_owned()),
        (_, Some(client)) => match platform::detect_on(client).await {
            Ok(d) => (d.platform, format!("detected: {}", d.evidence)),
            Err(e) => {
                eprintln!(
                    "warning: cannot tell the platform ({}); --platform names it",
                    crate::postgres::Chain(&e)
                );
                (Platform::SelfManaged, "could not tell".to_owned())
            }
        },
        (_, None) => (
            Platform::SelfManaged,
            "the default; --platform auto tells it from the server".to_owned(),
        ),
    };
    let files = match setup::render_for(config, role, partitioned, platform) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    let role_file = files
        .iter()
        .map(|(file, _)| *file)
        .find(|file| file.starts_with("004"))
        .unwrap_or_default();
    let rendered = format!("for {platform} ({why}): role from {role_file}");
    let Some(client) = client.filter(|_| apply) else {
        println!("-- outbox-relay setup {rendered}");
        for (file, sql) in &files {
            println!("-- ==== {file}\n{sql}");
        }
        return ExitCode::SUCCESS;
    };
    eprintln!("setup {rendered}");
    match setup::apply(&client, &files).await {
        Ok(()) => {
            eprintln!(
                "applied {} files: table {}, publication {}, slot {}, role {role}",
                files.len(),
                config.table(),
                config.postgres.publication,
                config.postgres.slot
            );
            ExitCode::SUCCESS
        }
        Err((file, e)) => {
            let detail = e
                .as_db_error()
                .map(|d| d.message().to_owned())
                .unwrap_or_else(|| e.to_string());
            eprintln!("error: {file} failed: {detail}");
            if let Some(hint) = e.code().and_then(|code| platform.setup_hint(file, code)) {
                eprintln!("hint: {hint}");
            }
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

async fn check_cmd(config: &Config) -> ExitCode {
    let client = match connect(config).await {
        Ok(c) => c,
        Err(code) => return code,
    };
    match check::run(config, &client).await {
        Ok(findings) => {
            for f in &findings {
                println!("{f}");
            }
            if findings.iter().any(|f| f.severity == Severity::Error) {
                ExitCode::from(EXIT_CHECK)
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(e) => {
            eprintln!("error: check failed: {}", crate::postgres::Chain(&e));
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

async fn table_of(
    config: &Config,
    client: &tokio_postgres::Client,
) -> Result<crate::table::Table, ExitCode> {
    match crate::table::Table::inspect(client, config).await {
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
                crate::postgres::Chain(&e)
            );
            Err(ExitCode::from(EXIT_FAILURE))
        }
    }
}

async fn replay_cmd(
    config: &Config,
    selection: &crate::replay::Selection,
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
        return match crate::replay::dry_run(&client, config, &table, selection).await {
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
    let sink = match Configured::new(config).await {
        Ok(sink) => sink,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let result = crate::replay::run(
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

async fn purge_cmd(config: &Config, older_than: std::time::Duration) -> ExitCode {
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
    let r = &config.retention;
    match crate::retention::purge(&client, &table, older_than, r.batch_size, r.drop_partitions)
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
            eprintln!("error: purge failed: {}", crate::postgres::Chain(&e));
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

async fn status_cmd(config: &Config, json: bool) -> ExitCode {
    let client = match connect(config).await {
        Ok(c) => c,
        Err(code) => return code,
    };
    let slot = match crate::monitor::slot_lag(&client, &config.postgres.slot).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!(
                "error: cannot read the slot: {}",
                crate::postgres::Chain(&e)
            );
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    let table = crate::table::Table::inspect(&client, config)
        .await
        .ok()
        .flatten();
    let counts = match &table {
        Some(t) if t.managed => crate::monitor::row_counts(&client, t)
            .await
            .unwrap_or_default(),
        _ => Vec::new(),
    };
    let oldest_pending: Option<f64> = match &table {
        Some(t) if t.managed && t.created_at.is_some() => client
            .query_one(
                &format!(
                    "SELECT extract(epoch FROM now() - min({}))::float8 FROM {} WHERE publish_state = 'PENDING'",
                    t.created_at.as_deref().unwrap_or("created_at"),
                    t.qualified
                ),
                &[],
            )
            .await
            .ok()
            .and_then(|r| r.get(0)),
        _ => None,
    };
    let failover = crate::failover::State::read(&client, &config.postgres.slot)
        .await
        .unwrap_or_default();
    let max_lag = config.http.ready_max_lag_bytes;
    let mut problems = Vec::new();
    match slot.wal_status.as_str() {
        "missing" => problems.push(format!("slot {:?} does not exist", config.postgres.slot)),
        "lost" => problems.push("the slot is invalidated (wal_status = lost)".to_owned()),
        "unreserved" => problems
            .push("the slot is about to be invalidated (wal_status = unreserved)".to_owned()),
        _ => {}
    }
    if slot.wal_status != "missing" && slot.active_pid.is_none() {
        problems.push("no relay is streaming from the slot".to_owned());
    }
    if slot.lag_bytes > max_lag {
        problems.push(format!(
            "lag {} bytes is over http.ready_max_lag_bytes ({max_lag})",
            slot.lag_bytes
        ));
    }
    if json {
        let value = serde_json::json!({
            "slot": config.postgres.slot,
            "wal_status": slot.wal_status,
            "active_pid": slot.active_pid,
            "confirmed_flush_lsn": slot.confirmed_flush_lsn,
            "lag_bytes": slot.lag_bytes,
            "lag_seconds": slot.flush_lag_seconds,
            "retained_wal_bytes": slot.retained_bytes,
            "safe_wal_size_bytes": slot.safe_wal_size,
            "oldest_pending_seconds": oldest_pending,
            "failover": failover.failover,
            "synchronized_standby_slots": failover.standby_slots,
            "rows": counts.iter().map(|(s, n)| (s.clone(), *n)).collect::<std::collections::BTreeMap<_, _>>(),
            "healthy": problems.is_empty(),
            "problems": problems,
        });
        println!("{value:#}");
    } else {
        let opt = |v: Option<String>| v.unwrap_or_else(|| "-".to_owned());
        println!("slot                 {}", config.postgres.slot);
        println!("wal_status           {}", slot.wal_status);
        println!(
            "streaming (pid)      {}",
            opt(slot.active_pid.map(|p| p.to_string()))
        );
        println!(
            "confirmed_flush_lsn  {}",
            opt(slot.confirmed_flush_lsn.clone())
        );
        println!(
            "lag                  {} bytes, {} s",
            slot.lag_bytes,
            opt(slot.flush_lag_seconds.map(|s| format!("{s:.3}")))
        );
        println!("retained WAL         {} bytes", slot.retained_bytes);
        println!(
            "safe_wal_size        {}",
            if slot.safe_wal_size < 0 {
                "unlimited".to_owned()
            } else {
                format!("{} bytes", slot.safe_wal_size)
            }
        );
        println!("failover             {}", failover.describe());
        println!(
            "oldest PENDING row   {}",
            opt(oldest_pending.map(|s| format!("{s:.1} s")))
        );
        for (state, n) in &counts {
            println!("rows {state:<15} {n}");
        }
        for p in &problems {
            println!("problem              {p}");
        }
    }
    if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_FAILURE)
    }
}
