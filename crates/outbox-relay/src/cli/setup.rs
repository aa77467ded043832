//! `outbox-relay setup`: the SQL of [`crate::postgres::setup`] for the configured
//! names, printed or applied, with the role file for the platform given,
//! detected or assumed (self-managed). Printing needs no server unless asked
//! to tell the platform from it.

use std::process::ExitCode;

use super::{connect, EXIT_FAILURE};
use crate::config::Config;
use crate::postgres::platform::{self, Choice, Platform};

/// What `setup` was asked.
pub(super) struct Options<'a> {
    /// Run the SQL instead of printing it.
    pub apply: bool,
    /// The relay's role.
    pub role: &'a str,
    /// Create the table partitioned.
    pub partitioned: bool,
    /// `--platform`.
    pub platform: Option<Choice>,
    /// `--producer-role`: the application's role, given column privileges.
    pub producer: Option<&'a str>,
}

/// Print or apply the setup SQL; the exit code.
pub(super) async fn run(config: &Config, options: Options<'_>) -> ExitCode {
    let Options {
        apply,
        role,
        partitioned,
        platform: choice,
        producer,
    } = options;
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
                    crate::report::Chain(&e)
                );
                (Platform::SelfManaged, "could not tell".to_owned())
            }
        },
        (_, None) => (
            Platform::SelfManaged,
            "the default; --platform auto tells it from the server".to_owned(),
        ),
    };
    let files =
        match crate::postgres::setup::render_for(config, role, partitioned, platform, producer) {
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
    match crate::postgres::setup::apply(&client, &files).await {
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
            if let Some(db) = e.as_db_error() {
                if let Some(more) = db.detail() {
                    eprintln!("detail: {more}");
                }
            }
            let hint = e.code().and_then(|code| {
                platform
                    .setup_hint(file, code)
                    .or_else(|| migration_hint(file, code))
            });
            if let Some(hint) = hint {
                eprintln!("hint: {hint}");
            }
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

/// What to do when a migration file stops: it waited too long for a lock
/// (a long transaction on the table), or a concurrent build failed.
fn migration_hint(file: &str, code: &tokio_postgres::error::SqlState) -> Option<String> {
    use tokio_postgres::error::SqlState;
    let migration = file.starts_with("007") || file.starts_with("008");
    if !migration {
        return None;
    }
    Some(if *code == SqlState::LOCK_NOT_AVAILABLE {
        format!(
            "a transaction held the outbox table longer than lock_timeout ({}) allows (the \
             detail names it): run setup --apply again once it has finished; it goes on from \
             where it stopped (docs/operations.md, migration)",
            crate::postgres::setup::MIGRATION_LOCK_TIMEOUT
        )
    } else {
        "setup --apply can be run again: it builds what is still missing, and drops an index \
         an interrupted build left invalid (docs/operations.md, migration)"
            .to_owned()
    })
}
