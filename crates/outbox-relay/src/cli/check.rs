//! `outbox-relay check`: the findings of [`crate::check`], one a line;
//! exit 3 when any of them is an error.

use std::process::ExitCode;

use super::{connect, EXIT_CHECK, EXIT_FAILURE};
use crate::check::Severity;
use crate::config::Config;

/// Print the findings; the exit code.
pub(super) async fn run(config: &Config) -> ExitCode {
    let client = match connect(config).await {
        Ok(c) => c,
        Err(code) => return code,
    };
    match crate::check::run(config, &client).await {
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
            eprintln!("error: check failed: {}", crate::report::Chain(&e));
            ExitCode::from(EXIT_FAILURE)
        }
    }
}
