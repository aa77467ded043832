//! `outbox-relay run`: the relay, streaming until SIGINT or SIGTERM.
//!
//! A sink that cannot be set up is a configuration error (exit 2); the relay
//! stopping on an error is a run-time failure (exit 1), transient or fatal.

use std::process::ExitCode;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::{EXIT_CONFIG, EXIT_FAILURE};
use crate::config::Config;
use crate::pipeline::sink::Sink;
use crate::pipeline::stream::ErrorClass;
use crate::signals::StopSignals;
use crate::sink::Configured;

/// Run the relay until a stop signal or an error; the exit code.
pub(super) async fn run(config: Config, signals: Option<StopSignals>) -> ExitCode {
    let stop = CancellationToken::new();
    if let Some(signals) = signals {
        tokio::spawn(signals.watch(stop.clone()));
    }
    match Configured::new(config.sink.kind, &config.destinations).await {
        Ok(sink) => relay(&config, sink, stop).await,
        Err(e) => {
            tracing::error!(error = %crate::report::Chain(&e), "cannot set up the sink");
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
            tracing::error!(error = %crate::report::Chain(&e), "relay stopped");
            match e.class() {
                ErrorClass::Fatal | ErrorClass::Transient => ExitCode::from(EXIT_FAILURE),
            }
        }
    }
}
