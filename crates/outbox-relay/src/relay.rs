//! The relay: the workers one instance runs, side by side.
//!
//! * the **stream** (`[stream] enabled`): replication → sink, see [`crate::pipeline::stream`];
//! * the **poller** (`[poller] enabled`, in mark and delete modes): publishes
//!   what the log cannot give back, see [`crate::pipeline::poller`];
//! * **retention** (`[retention] enabled`, in mark mode): deletes old
//!   published rows, see [`crate::postgres::outbox::retention`];
//! * the **monitor** and the **HTTP listener** (`[http] listen`): slot lag,
//!   `/metrics`, `/healthz`, `/readyz`, see [`crate::postgres::monitor`], [`crate::http`].
//!
//! Each can be switched off per instance, so a fleet can run retention on one
//! node only. When the stream recreates a lost slot it tells this instance's
//! poller to sweep the rows the old slot held.

use std::sync::Arc;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, OnPublished};
use crate::pipeline::poller::Poller;
use crate::pipeline::sink::Sink;
use crate::pipeline::stream::{self, RelayError, Summary};

/// Run every enabled worker until `stop` (graceful) or a fatal stream error.
pub async fn run<S: Sink>(
    config: &Config,
    sink: Arc<S>,
    stop: CancellationToken,
) -> Result<Summary, RelayError> {
    let workers = stop.child_token();
    let (sweep_tx, sweep_rx) = watch::channel(None);
    let mode = config.lifecycle.on_published;
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
    tasks.push(tokio::spawn(crate::postgres::monitor::run(
        config.clone(),
        workers.clone(),
    )));
    if config.poller.enabled && mode != OnPublished::None {
        let poller = Poller::new(config, Arc::clone(&sink), sweep_rx)?;
        tasks.push(tokio::spawn(poller.run(workers.clone())));
    }
    if config.retention.enabled && mode == OnPublished::Mark {
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
