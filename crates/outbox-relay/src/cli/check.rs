//! `outbox-relay check`: the findings of [`crate::postgres::check`], one a line;
//! exit 3 when any of them is an error.

use std::process::ExitCode;

use super::{connect, EXIT_CHECK, EXIT_FAILURE};
use crate::config::Config;
use crate::postgres::check::{Finding, Severity};
use crate::sink::Kind;

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
    let allowed = config.destination().routes().allowed.describe();
    let key = match config.sink.kind {
        Kind::Webhook => "webhook.allowed_origins",
        Kind::Sns => "sns.allowed_destinations",
        Kind::Sqs => "sqs.allowed_destinations",
        Kind::EventBridge => "eventbridge.allowed_destinations",
        Kind::Kinesis => "kinesis.allowed_destinations",
        Kind::Stdout => "",
    };
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
