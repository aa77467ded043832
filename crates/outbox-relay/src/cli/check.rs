//! `outbox-relay check`: the findings of [`crate::postgres::check`], one a line;
//! exit 3 when any of them is an error.

use std::process::ExitCode;

use super::{connect, EXIT_CHECK, EXIT_FAILURE};
use crate::config::Config;
use crate::postgres::check::{Finding, Severity};

/// Print the findings; the exit code.
pub(super) async fn run(config: &Config) -> ExitCode {
    let client = match connect(config).await {
        Ok(c) => c,
        Err(code) => return code,
    };
    match crate::postgres::check::run(config, &client).await {
        Ok(mut findings) => {
            findings.insert(0, routing(config));
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
            eprintln!("error: check failed: {}", crate::report::Chain(&e));
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

/// What a row's `topic` column or a template may name (`crate::config::allow`).
fn routing(config: &Config) -> Finding {
    let destination = config.destination();
    let allowed = destination.routes().allowed.describe();
    let key = destination.allowed_key().unwrap_or_default();
    let message = if key.is_empty() {
        "routing: one destination, nothing for data to name".to_owned()
    } else if allowed.is_empty() {
        format!("routing: rows and templates may name no destination but the default (widen with {key})")
    } else {
        format!(
            "routing: rows and templates may name only {} (widen with {key})",
            allowed.join(", ")
        )
    };
    Finding {
        severity: Severity::Ok,
        message,
    }
}
