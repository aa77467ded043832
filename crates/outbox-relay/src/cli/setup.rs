//! `outbox-relay setup`: the SQL of [`crate::postgres::setup`] for the configured
//! names, printed or applied, with the role file for the platform given,
//! detected or assumed (self-managed). Printing needs no server unless asked
//! to tell the platform from it.

use std::process::ExitCode;

use super::{connect, EXIT_FAILURE};
use crate::config::Config;
use crate::postgres::platform::{self, Choice, Platform};

/// Print or apply the setup SQL; the exit code.
pub(super) async fn run(
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
    let files = match crate::postgres::setup::render_for(config, role, partitioned, platform) {
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
            if let Some(hint) = e.code().and_then(|code| platform.setup_hint(file, code)) {
                eprintln!("hint: {hint}");
            }
            ExitCode::from(EXIT_FAILURE)
        }
    }
}
