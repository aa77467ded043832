//! Operations: the relay heals itself after a Postgres restart, and a
//! standby takes over when the active relay dies.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness::{wait_until, Cluster, RelayProcess, StopMode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::outbox::{envelope_ids, produce, Collect, Outbox, Running};

/// Quick reconnects for tests.
const QUICK_RETRY: &str = "[retry]\ninitial = \"100ms\"\nmax = \"1s\"\n";

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

    let expected = outbox.all_ids().await;
    wait_until(
        Duration::from_secs(30),
        "every committed event came out",
        || async {
            let got: HashSet<String> = envelope_ids(&relay.stdout_lines()).into_iter().collect();
            expected.is_subset(&got)
        },
    )
    .await;
    relay.stop_gracefully().await;
    let log = relay.stderr_text();
    assert!(
        log.matches("streaming").count() >= 3,
        "three sessions:\n{log}"
    );
    // A fast shutdown ends the relay's SQL session first, or the walsender
    // ends the stream politely (CommandComplete once everything it sent is
    // confirmed): either way an orderly end, never a protocol error.
    assert!(
        !log.contains("unexpected message") && !log.contains("protocol error"),
        "the fast shutdown reads as an orderly end:\n{log}"
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

    let expected = outbox.all_ids().await;
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

/// `GET path` from the relay's listener: (status code, body).
async fn get(addr: &str, path: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to the listener");
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let status = response[9..12].parse().unwrap();
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// The value of an unlabelled metric in a scrape.
fn metric(scrape: &str, name: &str) -> Option<f64> {
    scrape
        .lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scraped_metrics_show_the_lag_rising_while_the_sink_is_blocked_and_falling_after() {
    let outbox = Outbox::new().await;
    let addr = format!("127.0.0.1:{}", free_port());
    let sink = Collect::holding(|_| true);
    let relay = Running::start(
        outbox.config(&format!(
            "[http]\nlisten = \"{addr}\"\nready_max_lag_bytes = 1048576"
        )),
        sink.clone(),
    );
    outbox.wait_slot_active(true).await;
    assert_eq!(get(&addr, "/healthz").await.0, 200);
    wait_until(
        Duration::from_secs(15),
        "ready while streaming with no lag",
        || async { get(&addr, "/readyz").await.0 == 200 },
    )
    .await;

    outbox.insert_tx(&[("a".into(), "Held".into())]).await;
    outbox
        .sql
        .batch_execute("CREATE TABLE busy AS SELECT g, repeat(md5(g::text), 16) AS body FROM generate_series(1, 10000) g")
        .await
        .unwrap();
    let lag = wait_until(
        Duration::from_secs(20),
        "the scraped lag rises over 1 MB",
        || async {
            let (_, scrape) = get(&addr, "/metrics").await;
            metric(&scrape, "outbox_relay_confirmed_flush_lag_bytes").filter(|l| *l > 1_048_576.0)
        },
    )
    .await;
    let (status, body) = get(&addr, "/readyz").await;
    assert_eq!(status, 503, "not ready while lagging: {body}");
    assert!(body.contains("lag"), "{body}");
    let (_, scrape) = get(&addr, "/metrics").await;
    assert_eq!(
        metric(&scrape, "outbox_relay_in_flight_envelopes"),
        Some(1.0)
    );
    assert_eq!(metric(&scrape, "outbox_relay_streaming"), Some(1.0));

    sink.release();
    wait_until(
        Duration::from_secs(20),
        "the scraped lag falls under 1 MB",
        || async {
            let (_, scrape) = get(&addr, "/metrics").await;
            metric(&scrape, "outbox_relay_confirmed_flush_lag_bytes").filter(|l| *l < 1_048_576.0)
        },
    )
    .await;
    wait_until(Duration::from_secs(10), "ready again", || async {
        get(&addr, "/readyz").await.0 == 200
    })
    .await;
    let (_, scrape) = get(&addr, "/metrics").await;
    assert!(
        scrape.contains("outbox_relay_envelopes_published_total{outcome=\"delivered\"} 1"),
        "{scrape}"
    );
    assert!(
        scrape.contains("outbox_relay_end_to_end_latency_seconds_count 1"),
        "{scrape}"
    );
    eprintln!("lag rose to {lag} bytes while the sink was blocked");

    let config = outbox.config_file("");
    let mut status = RelayProcess::spawn(
        &["status", "--json", "--config", config.to_str().unwrap()],
        &[],
    );
    assert!(
        status
            .wait_exit_async(Duration::from_secs(20))
            .await
            .unwrap()
            .success(),
        "{}",
        status.stdout_text()
    );
    let report: serde_json::Value = serde_json::from_str(&status.stdout_text()).unwrap();
    assert_eq!(report["healthy"], true);
    assert_eq!(report["wal_status"], "reserved");
    assert_eq!(report["rows"]["PENDING"], 0);
    relay.stop().await;
}

/// Metric families named in `text`, without the sample suffixes.
fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("outbox_relay_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
            .unwrap_or(tail.len());
        let mut name = tail[..end].trim_end_matches('_');
        for suffix in ["_bucket", "_count", "_sum", "_total"] {
            name = name.strip_suffix(suffix).unwrap_or(name);
        }
        names.insert(name.to_owned());
        rest = &tail[end..];
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alert_rules_dashboard_and_docs_name_only_metrics_the_relay_exports() {
    let outbox = Outbox::new().await;
    let addr = format!("127.0.0.1:{}", free_port());
    let sink = Collect::default();
    let relay = Running::start(
        outbox.config(&format!(
            "[http]\nlisten = \"{addr}\"\n[stream]\nheartbeat_interval = \"1s\""
        )),
        sink.clone(),
    );
    outbox.wait_slot_active(true).await;
    // Labelled families appear with their first sample: publish one event.
    outbox.insert_tx(&[("a".into(), "E".into())]).await;
    // ... and let the slot monitor's first round report (rows, wal_status).
    wait_until(
        Duration::from_secs(45),
        "one event published, the monitor reporting",
        || async {
            let (_, scrape) = get(&addr, "/metrics").await;
            sink.ids().len() == 1
                && scrape.contains("outbox_relay_heartbeat_round_trip_seconds_count")
                && scrape.contains("outbox_relay_slot_wal_status{")
                && scrape.contains("outbox_relay_rows{")
        },
    )
    .await;
    let (_, scrape) = get(&addr, "/metrics").await;
    relay.stop().await;
    let exported: std::collections::BTreeSet<String> = scrape
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .flat_map(metric_names)
        .collect();
    assert!(exported.len() >= 15, "{scrape}");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let read = |path: &str| std::fs::read_to_string(root.join(path)).unwrap();
    for file in [
        "deploy/prometheus/alerts.yml",
        "deploy/grafana/outbox-relay.json",
        "docs/operations.md",
    ] {
        let unknown: Vec<_> = metric_names(&read(file))
            .difference(&exported)
            .cloned()
            .collect();
        assert!(
            unknown.is_empty(),
            "{file} names metrics the relay does not export: {unknown:?}"
        );
    }
    let undocumented: Vec<_> = exported
        .difference(&metric_names(&read("docs/operations.md")))
        .cloned()
        .collect();
    assert!(
        undocumented.is_empty(),
        "docs/operations.md does not explain {undocumented:?}"
    );
    // The dashboard is valid JSON with panels, for Grafana's provisioning.
    let dashboard: serde_json::Value =
        serde_json::from_str(&read("deploy/grafana/outbox-relay.json")).unwrap();
    assert!(dashboard["panels"]
        .as_array()
        .is_some_and(|p| !p.is_empty()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_come_back_through_the_stream_and_one_that_does_not_fails_readiness() {
    let outbox = Outbox::new().await;
    let addr = format!("127.0.0.1:{}", free_port());
    // One event in flight at most: a held event stops the stream from reading on.
    let sink = Collect::holding(|m| m.event.event_type() == "Held");
    let relay = Running::start(
        outbox.config(&format!(
            "[stream]\nmax_in_flight = 1\nheartbeat_interval = \"200ms\"\nheartbeat_timeout = \"1s\"\n\
             [http]\nlisten = \"{addr}\""
        )),
        sink.clone(),
    );
    outbox.wait_slot_active(true).await;
    wait_until(
        Duration::from_secs(15),
        "heartbeats make round trips",
        || async {
            let (_, scrape) = get(&addr, "/metrics").await;
            metric(&scrape, "outbox_relay_heartbeat_round_trip_seconds_count").filter(|n| *n >= 3.0)
        },
    )
    .await;
    assert_eq!(get(&addr, "/readyz").await.0, 200);

    outbox.insert_tx(&[("a".into(), "Held".into())]).await;
    let body = wait_until(
        Duration::from_secs(15),
        "readiness fails on a missing heartbeat",
        || async {
            let (status, body) = get(&addr, "/readyz").await;
            (status == 503).then_some(body)
        },
    )
    .await;
    assert!(body.contains("heartbeat"), "{body}");
    sink.release();
    wait_until(
        Duration::from_secs(15),
        "ready again once heartbeats come back",
        || async { get(&addr, "/readyz").await.0 == 200 },
    )
    .await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_does_its_whole_job_as_the_least_privilege_role() {
    // Every fixture relay runs as the role from sql/004_role.sql; this test
    // has it do every job at once, and checks the role is no more than that.
    let outbox = Outbox::new().await;
    let sink = Collect::default();
    let config = outbox.config(
        "[stream]\nheartbeat_interval = \"200ms\"\n[poller]\ninterval = \"200ms\"\ngrace = \"1s\"\n\
         [retention]\ninterval = \"200ms\"\nkeep = \"1s\"\n[filter]\nexclude_event_types = [\"Internal\"]",
    );
    assert!(config
        .postgres
        .url
        .as_ref()
        .unwrap()
        .expose()
        .contains(&format!("{}:", outbox.role)));
    let relay = Running::start(config, sink.clone());
    outbox.wait_slot_active(true).await;
    // Stream, mark, skip; a row the stream never saw goes through the poller.
    outbox.insert_many(5, 4, 3).await;
    outbox.insert_tx(&[("a".into(), "Internal".into())]).await;
    outbox
        .sql
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at, publish_state)
             VALUES ('o', 'late', 'E', '{}', now() - interval '1 hour', 'PENDING')",
        )
        .await
        .unwrap();
    wait_until(
        Duration::from_secs(30),
        "everything is published and retention ran",
        || async {
            let rows: i64 = outbox
                .sql
                .query_one("SELECT count(*) FROM outbox", &[])
                .await
                .unwrap()
                .get(0);
            sink.ids().len() >= 21 && rows == 0
        },
    )
    .await;
    let summary = relay.stop().await;
    assert_eq!(summary.skipped, 1);
    let privileged: bool = outbox
        .sql
        .query_one(
            "SELECT rolsuper OR rolcreaterole OR rolcreatedb OR rolbypassrls \
             FROM pg_roles WHERE rolname = $1",
            &[&outbox.role],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        !privileged,
        "the relay's role has no privileges beyond sql/004_role.sql"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn marks_cut_off_by_a_postgres_restart_are_written_once_it_is_back() {
    let cluster = Arc::new(tokio::task::spawn_blocking(Cluster::start).await.unwrap());
    let mut outbox = Outbox::on(&cluster).await;
    // A gate on marking: while closed, an UPDATE of the outbox sleeps in a trigger.
    outbox
        .sql
        .batch_execute(
            "CREATE TABLE gate (closed bool NOT NULL);
             INSERT INTO gate VALUES (true);
             CREATE FUNCTION wait_at_gate() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
             BEGIN
                 IF (SELECT closed FROM gate) THEN PERFORM pg_sleep(30); END IF;
                 RETURN NEW;
             END $$;
             CREATE TRIGGER wait_at_gate BEFORE UPDATE ON outbox FOR EACH ROW EXECUTE FUNCTION wait_at_gate();",
        )
        .await
        .unwrap();
    let sink = Collect::default();
    let relay = Running::start(
        outbox.config(&format!(
            "{QUICK_RETRY}[poller]\nenabled = false\n[lifecycle]\non_published = \"mark\"\n"
        )),
        sink.clone(),
    );
    outbox.wait_slot_active(true).await;
    let ids = outbox.insert_tx(&[("a".into(), "E".into())]).await;
    let end = outbox.commits().await.last().unwrap().end_lsn;
    wait_until(
        Duration::from_secs(15),
        "delivered and acknowledged (marking is not part of it)",
        || async { sink.ids() == ids && outbox.confirmed_flush().await >= end },
    )
    .await;
    // Marking waits at the gate. A restart cuts its connection, and the
    // server stays down longer than marking's retries on one connection.
    let stopped = Arc::clone(&cluster);
    tokio::task::spawn_blocking(move || stopped.stop(StopMode::Fast))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let started = Arc::clone(&cluster);
    tokio::task::spawn_blocking(move || started.start_again())
        .await
        .unwrap();
    outbox.reconnect().await;
    outbox
        .sql
        .batch_execute("UPDATE gate SET closed = false")
        .await
        .unwrap();
    wait_until(
        Duration::from_secs(45),
        "marking reconnects and marks the row",
        || async {
            let state: String = outbox
                .sql
                .query_one(
                    "SELECT publish_state FROM outbox WHERE id::text = $1",
                    &[&ids[0]],
                )
                .await
                .unwrap()
                .get(0);
            state == "PUBLISHED"
        },
    )
    .await;
    // The slot had passed the event before the restart: it came out once.
    relay.stop().await;
    assert_eq!(sink.ids(), ids);
}

/// A network device that drops the relay's flows without a FIN or RST (or a
/// frozen host) leaves every connection open and silent. The relay asks the
/// quiet stream for a reply, takes it for dead when none comes, and
/// reconnects; its SQL sessions end the same way; `/readyz` fails meanwhile.
/// Events written after the freeze arrive, once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_frozen_in_the_network_are_noticed_and_nothing_is_lost() {
    let outbox = Outbox::new().await;
    // The walsender whose client fell silent lets the slot go after this.
    outbox
        .sql
        .batch_execute(&format!(
            "ALTER ROLE {} SET wal_sender_timeout = '4s'",
            outbox.role
        ))
        .await
        .unwrap();
    let url = outbox.relay_url();
    let host_port = url
        .split('@')
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .unwrap()
        .to_owned();
    let proxy = harness::FreezingProxy::start(&host_port);
    let addr = format!("127.0.0.1:{}", free_port());
    let mut config = outbox.config(&format!(
        "receive_timeout = \"6s\"\n{QUICK_RETRY}[http]\nlisten = \"{addr}\"\nready_max_lag_bytes = 1073741824"
    ));
    config.postgres.url = Some(outbox_relay::Secret::new(url.replacen(
        &host_port,
        &format!("127.0.0.1:{}", proxy.port()),
        1,
    )));
    let sink = Collect::default();
    let relay = Running::start(config, sink.clone());
    outbox.wait_slot_active(true).await;
    let mut ids = outbox
        .insert_tx(&[("a".into(), "BeforeTheFreeze".into())])
        .await;
    wait_until(Duration::from_secs(20), "the first event", || async {
        sink.ids() == ids
    })
    .await;
    let first = outbox.commits().await.last().unwrap().end_lsn;
    wait_until(
        Duration::from_secs(20),
        "its commit is confirmed",
        || async { outbox.confirmed_flush().await >= first },
    )
    .await;
    wait_until(Duration::from_secs(20), "ready", || async {
        get(&addr, "/readyz").await.0 == 200
    })
    .await;
    let before = proxy.accepted();

    proxy.freeze();
    let frozen_at = Instant::now();
    ids.extend(
        outbox
            .insert_tx(&[
                ("a".into(), "AfterTheFreeze".into()),
                ("b".into(), "AfterTheFreeze".into()),
            ])
            .await,
    );
    let (_, why) = wait_until(Duration::from_secs(60), "/readyz fails", || async {
        let (status, body) = get(&addr, "/readyz").await;
        (status == 503).then_some((status, body))
    })
    .await;
    let not_ready_after = frozen_at.elapsed();
    wait_until(
        Duration::from_secs(180),
        "the events written after the freeze arrive",
        || async { sink.ids().len() >= ids.len() },
    )
    .await;
    let arrived_after = frozen_at.elapsed();
    wait_until(Duration::from_secs(30), "ready again", || async {
        get(&addr, "/readyz").await.0 == 200
    })
    .await;
    relay.stop().await;
    assert_eq!(sink.ids(), ids, "every event once, in commit order");
    assert!(
        proxy.accepted() > before,
        "the relay opened new connections through the proxy"
    );
    eprintln!(
        "not ready {not_ready_after:?} after the freeze ({why}); the events arrived {arrived_after:?} after it"
    );
}
