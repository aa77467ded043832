//! Operations: the relay heals itself after a Postgres restart, and a
//! standby takes over when the active relay dies.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness::{wait_until, Cluster, RelayProcess, StopMode};

use crate::outbox::{envelope_ids, Outbox};

/// Quick reconnects for tests.
const QUICK_RETRY: &str = "[retry]\ninitial = \"100ms\"\nmax = \"1s\"\n";

/// Insert small transactions until `stop`, reconnecting through outages.
fn produce(url: String, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<usize> {
    tokio::spawn(async move {
        let mut committed = 0;
        let mut client: Option<tokio_postgres::Client> = None;
        while !stop.load(Ordering::SeqCst) {
            if client.as_ref().is_none_or(|c| c.is_closed()) {
                client = match tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
                    Ok((c, conn)) => {
                        tokio::spawn(conn);
                        Some(c)
                    }
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
            }
            let insert = client.as_ref().unwrap().batch_execute(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
                 SELECT 'order', 'agg-' || (g % 5), 'E', '{}' FROM generate_series(1, 3) g",
            );
            match insert.await {
                Ok(()) => committed += 1,
                Err(_) => client = None,
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        committed
    })
}

async fn all_ids(outbox: &Outbox) -> HashSet<String> {
    outbox
        .sql
        .query("SELECT id::text FROM outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarts_fast_and_immediate_mid_stream_lose_nothing() {
    let cluster = Arc::new(tokio::task::spawn_blocking(Cluster::start).await.unwrap());
    let mut outbox = Outbox::on(&cluster).await;
    let config = outbox.config_file(QUICK_RETRY);
    let mut relay = RelayProcess::spawn(&["run", "--config", config.to_str().unwrap()], &[]);
    outbox.wait_slot_active(true).await;
    let stop = Arc::new(AtomicBool::new(false));
    let producer = produce(outbox.db.url().to_owned(), Arc::clone(&stop));

    for mode in [StopMode::Fast, StopMode::Immediate] {
        tokio::time::sleep(Duration::from_millis(800)).await;
        let cluster = Arc::clone(&cluster);
        tokio::task::spawn_blocking(move || cluster.restart(mode))
            .await
            .unwrap();
        outbox.reconnect().await;
        outbox.wait_slot_active(true).await; // the relay came back by itself
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    let committed = producer.await.unwrap();
    assert!(committed > 0);
    assert!(
        relay.is_running(),
        "the relay survived both restarts:\n{}",
        relay.stderr_text()
    );

    let expected = all_ids(&outbox).await;
    wait_until(
        Duration::from_secs(30),
        "every committed event came out",
        || async {
            let got: HashSet<String> = envelope_ids(&relay.stdout_lines()).into_iter().collect();
            expected.is_subset(&got)
        },
    )
    .await;
    relay.sigterm();
    assert!(relay
        .wait_exit_async(Duration::from_secs(30))
        .await
        .is_some_and(|s| s.success()));
    let log = relay.stderr_text();
    assert!(
        log.matches("streaming").count() >= 3,
        "three sessions:\n{log}"
    );
    eprintln!("{} events across two restarts", expected.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_within_ten_seconds_when_the_active_relay_is_killed() {
    let outbox = Outbox::new().await;
    let config = outbox.config_file(QUICK_RETRY);
    let run = || RelayProcess::spawn(&["run", "--config", config.to_str().unwrap()], &[]);
    let mut active = run();
    outbox.wait_slot_active(true).await;
    let mut standby = run();
    wait_until(
        Duration::from_secs(10),
        "the second relay stands by",
        || async { standby.stderr_text().contains("standing by") },
    )
    .await;
    let stop = Arc::new(AtomicBool::new(false));
    let producer = produce(outbox.db.url().to_owned(), Arc::clone(&stop));
    tokio::time::sleep(Duration::from_millis(700)).await;

    active.kill9();
    let killed = Instant::now();
    wait_until(Duration::from_secs(10), "the standby streams", || async {
        standby.stderr_text().contains("streaming")
    })
    .await;
    let takeover = killed.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    producer.await.unwrap();

    let expected = all_ids(&outbox).await;
    wait_until(
        Duration::from_secs(30),
        "every event came out of one relay or the other",
        || async {
            let got: HashSet<String> = envelope_ids(&active.stdout_lines())
                .into_iter()
                .chain(envelope_ids(&standby.stdout_lines()))
                .collect();
            expected.is_subset(&got)
        },
    )
    .await;
    standby.sigterm();
    standby.wait_exit_async(Duration::from_secs(30)).await;
    assert!(takeover < Duration::from_secs(10));
    eprintln!(
        "standby took over {takeover:?} after kill -9; {} events, none lost",
        expected.len()
    );
}
