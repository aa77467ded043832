//! The relay: the workers one instance runs, side by side.
//!
//! * the **stream** (`[stream] enabled`): replication → sink, see [`crate::pipeline::stream`];
//! * the **poller** (`[poller] enabled`, in derive, mark and delete modes):
//!   publishes what the log cannot give back, see [`crate::pipeline::poller`];
//! * **retention** (`[retention] enabled`, in derive and mark modes): deletes
//!   old published rows, see [`crate::postgres::outbox::retention`];
//! * the **monitor** and the **HTTP listener** (`[http] listen`): slot lag,
//!   `/metrics`, `/healthz`, `/readyz`, see [`crate::postgres::monitor`], [`crate::http`].
//!
//! Each can be switched off per instance, so a fleet can run retention on one
//! node only. When the stream recreates a lost slot it tells this instance's
//! poller to sweep the rows the old slot held.
//!
//! # The lifecycle in force
//!
//! `on_published = "derive"` needs the table's `relay_txid` column (`xid8`)
//! and a position table the relay may write, with the derived lifecycle's
//! columns: the vouched snapshot and the holes live there. Without them the
//! relay runs as `mark` (every worker gets that mode), and says once, at
//! start, what is missing and that `setup --apply` adds it ([`effective`]).
//! Whether they are there is [`readiness`]'s finding, the one `check`
//! reports ([`readiness::Problem::DerivedRunsAsMark`]).

use std::sync::Arc;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, OnPublished};
use crate::pipeline::poller::Poller;
use crate::pipeline::sink::Sink;
use crate::pipeline::stream::{self, RelayError, Summary};
use crate::postgres::readiness;
use crate::postgres::ConnInfo;
use crate::retry::Backoff;

/// The configuration the workers run with: `derive` becomes `mark` when the
/// database lacks what it needs (warned once, with the fix). Retries the
/// connection until it answers; `None` when `stop` came first.
async fn effective(
    config: &Config,
    stop: &CancellationToken,
) -> Result<Option<Config>, RelayError> {
    if config.lifecycle.on_published != OnPublished::Derive {
        return Ok(Some(config.clone()));
    }
    let conn = ConnInfo::new(&config.postgres)?;
    let backoff = Backoff::new(&config.retry);
    let mut attempt = 0;
    let runs_as_mark = loop {
        let looked = async {
            let client = conn.connect().await.map_err(RelayError::from)?;
            readiness::inspect(&client, config)
                .await
                .map_err(|source| RelayError::Sql {
                    context: "choosing the lifecycle",
                    source,
                })
        };
        match looked.await {
            Ok(ready) => break ready.runs_as_mark(),
            // As the stream would: a fatal error (a refused login, TLS) stops the relay.
            Err(error) if error.class() != stream::ErrorClass::Transient => return Err(error),
            Err(error) => {
                let delay = backoff.delay(attempt);
                attempt += 1;
                tracing::warn!(error = %crate::report::Chain(&error), attempt, "cannot look at the outbox table to choose the lifecycle; trying again");
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = stop.cancelled() => return Ok(None),
                }
            }
        }
    };
    let mut effective = config.clone();
    if let Some(problem) = runs_as_mark {
        // `check`'s words; the lifecycle is chosen here only, at start.
        tracing::warn!(problem = %problem, "the relay runs, but check this; restart it after the fix");
        effective.lifecycle.on_published = OnPublished::Mark;
    }
    if let Some(warning) = short_grace(&effective) {
        tracing::warn!("{warning}");
    }
    Ok(Some(effective))
}

/// The least `poller.grace` under which the derived lifecycle's poller
/// leaves delivered rows alone: the keeper takes a candidate a second and
/// stores it once the stream passed it, a few seconds under load.
const DERIVE_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// A warning when the poller's grace is shorter than the derived lifecycle
/// takes to vouch for what the stream delivered: the poller would send such
/// rows again (at least once, nothing lost; docs/guarantees.md's limits).
fn short_grace(config: &Config) -> Option<String> {
    let poller = &config.poller;
    (config.lifecycle.on_published == OnPublished::Derive
        && poller.enabled
        && poller.grace < DERIVE_GRACE)
        .then(|| {
            format!(
                "poller.grace = {:?} is shorter than the derived lifecycle takes to vouch for a \
                 delivered row (a few seconds): the poller will send some rows the stream delivered \
                 again; set poller.grace to {}s or more (the default is 5m)",
                poller.grace,
                DERIVE_GRACE.as_secs()
            )
        })
}

/// Run every enabled worker until `stop` (graceful) or a fatal stream error.
pub async fn run<S: Sink>(
    config: &Config,
    sink: Arc<S>,
    stop: CancellationToken,
) -> Result<Summary, RelayError> {
    let workers = stop.child_token();
    let (sweep_tx, sweep_rx) = watch::channel(None);
    let mut tasks = Vec::new();
    crate::metrics::get()
        .health
        .stream_enabled
        .store(config.stream.enabled, std::sync::atomic::Ordering::Relaxed);
    if !config.http.listen.is_empty() {
        let listener = crate::http::bind(&config.http.listen)
            .await
            .map_err(RelayError::Listen)?;
        tasks.push(tokio::spawn(crate::http::serve(
            listener,
            config.http.ready_max_lag_bytes,
            workers.clone(),
        )));
    }
    let Some(config) = effective(config, &stop).await? else {
        workers.cancel();
        for task in tasks {
            let _ = task.await;
        }
        return Ok(Summary::default());
    };
    let config = &config;
    let mode = config.lifecycle.on_published;
    tasks.push(tokio::spawn(crate::postgres::monitor::run(
        config.clone(),
        workers.clone(),
    )));
    if config.poller.enabled && mode != OnPublished::None {
        let poller = Poller::new(config, Arc::clone(&sink), sweep_rx)?;
        tasks.push(tokio::spawn(poller.run(workers.clone())));
    }
    if config.retention.enabled && mode.tracks_rows() {
        tasks.push(tokio::spawn(crate::postgres::outbox::retention::run(
            config.clone(),
            workers.clone(),
        )));
    }
    let result = if config.stream.enabled {
        stream::run(config, sink, stop.clone(), sweep_tx).await
    } else {
        stop.cancelled().await;
        Ok(Summary::default())
    };
    workers.cancel();
    for task in tasks {
        let _ = task.await;
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grace_shorter_than_the_vouching_is_warned_of_under_derive_only() {
        let mut config = Config::default();
        config.lifecycle.on_published = OnPublished::Derive;
        assert_eq!(short_grace(&config), None); // the default, 5m
        config.poller.grace = std::time::Duration::from_secs(1);
        let warning = short_grace(&config).expect("a warning");
        assert!(warning.contains("poller.grace = 1s") && warning.contains("10s or more"));
        config.lifecycle.on_published = OnPublished::Mark;
        assert_eq!(short_grace(&config), None);
        config.lifecycle.on_published = OnPublished::Derive;
        config.poller.enabled = false;
        assert_eq!(short_grace(&config), None);
    }
}
