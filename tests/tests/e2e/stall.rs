//! Stalls name their cause (DESIGN invariant 12): when the slot's server
//! process waits, or a prepared transaction is left open, the relay asks the
//! server why and says so in its log, `/readyz`, `outbox_relay_stall_seconds`
//! and `status`, with the fix; once the fix is made everything arrives.
//!
//! Each test runs on a private cluster: `synchronized_standby_slots` is
//! cluster-wide, and an open or prepared transaction would hold every other
//! test's slot creation on the shared one.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use harness::{wait_until, Cluster, RelayProcess};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::outbox::{envelope_ids, Outbox};

const QUICK_RETRY: &str = "[retry]\ninitial = \"100ms\"\nmax = \"1s\"\n";

/// `GET path` from the relay's listener: (status code, body).
pub(crate) async fn get(addr: &str, path: &str) -> (u16, String) {
    let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await else {
        return (0, String::new());
    };
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).await.is_err() {
        return (0, String::new());
    }
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response).await;
    let status = response
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// Wait until `outbox_relay_stall_seconds{cause="…"}` is over 0 and at
/// least `at_least` (it counts from the look that found the stall where
/// the server gives no start).
async fn wait_stall_seconds(addr: &str, cause: &str, at_least: f64) {
    let series = format!("outbox_relay_stall_seconds{{cause=\"{cause}\"}} ");
    wait_until(
        Duration::from_secs(30),
        "the metric counts the stall",
        || async {
            let (_, scrape) = get(addr, "/metrics").await;
            let seconds: Option<f64> = scrape
                .lines()
                .find_map(|l| l.strip_prefix(&series))
                .and_then(|v| v.trim().parse().ok());
            match seconds {
                Some(s) if s >= at_least && s > 0.0 => Ok(()),
                other => Err(format!("{series}{other:?}")),
            }
        },
    )
    .await;
}

pub(crate) fn free_addr() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("127.0.0.1:{port}")
}

async fn private_cluster() -> Arc<Cluster> {
    Arc::new(tokio::task::spawn_blocking(Cluster::start).await.unwrap())
}

fn server_version(cluster: &Cluster) -> i32 {
    cluster
        .psql("SHOW server_version_num")
        .parse()
        .expect("server_version_num")
}

/// Wait until `/readyz` fails with a body that says all of `says`, and the
/// relay's log has a `stalled:` line that does too; the body.
pub(crate) async fn wait_stall_reported(relay: &RelayProcess, addr: &str, says: &[&str]) -> String {
    wait_until(
        Duration::from_secs(60),
        "/readyz fails naming the stall and the log says it",
        || async {
            let (status, body) = get(addr, "/readyz").await;
            let log = relay.stderr_text();
            let logged = log
                .lines()
                .any(|l| l.contains("stalled:") && says.iter().all(|s| l.contains(s)));
            if status == 503 && says.iter().all(|s| body.contains(s)) && logged {
                Ok(body)
            } else {
                Err(format!("/readyz {status}: {body}"))
            }
        },
    )
    .await
}

/// Wait until `/readyz` answers 200 again.
pub(crate) async fn wait_ready(addr: &str) {
    wait_until(Duration::from_secs(60), "/readyz recovers", || async {
        let (status, body) = get(addr, "/readyz").await;
        if status == 200 {
            Ok(())
        } else {
            Err(format!("{status}: {body}"))
        }
    })
    .await;
}

/// Wait until every id of `expected` is in the relay's output.
pub(crate) async fn wait_delivered(relay: &RelayProcess, expected: &[String]) {
    let expected: HashSet<&String> = expected.iter().collect();
    wait_until(
        Duration::from_secs(60),
        "every event arrives at the sink",
        || async {
            let got: HashSet<String> = envelope_ids(&relay.stdout_lines()).into_iter().collect();
            let missing = expected.iter().filter(|id| !got.contains(**id)).count();
            if missing == 0 {
                Ok(())
            } else {
                Err(format!("{missing} of {} missing", expected.len()))
            }
        },
    )
    .await;
}

/// The acceptance test of issue 28's stall: a server whose
/// `synchronized_standby_slots` names a slot it does not have (as a promoted
/// standby that kept its old primary's setting does) makes the walsender of
/// the relay's failover slot wait forever. On PostgreSQL 17+ that is
/// reproduced as it happens: the relay streams, the setting goes stale, and
/// `/readyz` and the log must name the slot within 60 s; after the
/// operator's fix every event arrives and `/readyz` recovers. Before 17
/// there is no such setting (nor failover slots): there the test exercises
/// the wait those majors have, the slot's process waiting for an open
/// transaction, through the same path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_synchronized_standby_slots_is_named_in_readyz_and_the_log_and_the_fix_delivers_everything(
) {
    let cluster = private_cluster().await;
    let version = server_version(&cluster);
    if version < 170_000 {
        eprintln!(
            "synchronized_standby_slots came with PostgreSQL 17 (this is {version}): exercising \
             a slot waiting for an open transaction instead"
        );
        an_open_transaction_holding_the_slot(&cluster).await;
        return;
    }
    let outbox = Outbox::on(&cluster).await;
    // The relay's slot as `setup` creates it with postgres.failover_slot:
    // the walsender of a failover slot waits for synchronized_standby_slots.
    outbox.recreate_slot("false, false, true").await;
    let addr = free_addr();
    let file = outbox.config_file(&format!(
        "failover_slot = true\n{QUICK_RETRY}[http]\nlisten = \"{addr}\""
    ));
    let mut relay = RelayProcess::spawn(&["run", "--config", file.to_str().unwrap()], &[]);
    outbox.wait_slot_active(true).await;
    let before = outbox.insert_many(3, 2, 3).await;
    wait_delivered(&relay, &before).await;
    wait_ready(&addr).await;

    // The setting goes stale under the running relay.
    cluster.psql("ALTER SYSTEM SET synchronized_standby_slots = 'standby1'");
    cluster.psql("SELECT pg_reload_conf()");
    let during = outbox.insert_many(10, 3, 4).await;
    let body =
        wait_stall_reported(&relay, &addr, &["standby1", "synchronized_standby_slots"]).await;
    assert!(
        body.contains("WaitForStandbyConfirmation") && body.contains("pg_reload_conf()"),
        "/readyz says what waits and the fix: {body}"
    );
    wait_stall_seconds(&addr, "standby_slot", 0.0).await;
    // The stall is real: nothing committed since came out.
    let got: HashSet<String> = envelope_ids(&relay.stdout_lines()).into_iter().collect();
    assert!(
        during.iter().all(|id| !got.contains(id)),
        "nothing passes a walsender that waits for standby1"
    );
    // `status`, a separate process, finds it from the server alone.
    let status = status_json(&file).await;
    assert_eq!(status["stalls"][0]["cause"], "standby_slot", "{status:#}");
    assert_eq!(status["stalls"][0]["subject"], "standby1", "{status:#}");

    // The operator's fix.
    cluster.psql("ALTER SYSTEM RESET synchronized_standby_slots");
    cluster.psql("SELECT pg_reload_conf()");
    wait_delivered(&relay, &during).await;
    wait_ready(&addr).await;
    let log = relay.stderr_text();
    assert_eq!(
        log.lines()
            .filter(|l| l.contains("stalled:") && l.contains("standby1"))
            .count(),
        1,
        "the stall is logged once:\n{log}"
    );
    assert!(log.contains("stall over"), "{log}");
    relay.stop_gracefully().await;
}

/// On PostgreSQL 17+ the first test exercises the standby slot; the open
/// transaction is exercised here (before 17 the first test does it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_waiting_for_an_open_transaction_names_its_backend_and_streams_once_it_ends() {
    let cluster = private_cluster().await;
    let version = server_version(&cluster);
    if version < 170_000 {
        eprintln!(
            "on {version} a_stale_synchronized_standby_slots_… runs this scenario: nothing more here"
        );
        return;
    }
    an_open_transaction_holding_the_slot(&cluster).await;
}

/// The relay recreates its lost slot (`lifecycle.recreate_slot`) while an
/// application's transaction stays open: creating a logical slot waits for
/// it. `/readyz` and the log name the backend that holds it; once it ends,
/// the slot is created, and every event written meanwhile arrives (the
/// poller sweeps what the new slot does not carry).
async fn an_open_transaction_holding_the_slot(cluster: &Arc<Cluster>) {
    let outbox = Outbox::on(cluster).await;
    outbox
        .sql
        .batch_execute("CREATE TABLE ledger (n int)")
        .await
        .unwrap();
    // An application session left idle in a transaction that wrote.
    let app = outbox.db.client().await;
    app.batch_execute("SET application_name = 'billing'; BEGIN; INSERT INTO ledger VALUES (1)")
        .await
        .unwrap();
    let pid: i32 = app
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    outbox.drop_slot().await;
    let addr = free_addr();
    let file = outbox.config_file(&format!(
        "{QUICK_RETRY}[lifecycle]\nrecreate_slot = true\n[poller]\ninterval = \"1s\"\n\
         [http]\nlisten = \"{addr}\""
    ));
    let mut relay = RelayProcess::spawn(&["run", "--config", file.to_str().unwrap()], &[]);
    let during = outbox.insert_many(5, 2, 3).await;
    let holder = format!("PID {pid}");
    let body = wait_stall_reported(&relay, &addr, &[&holder, "a transaction to end"]).await;
    assert!(
        body.contains(&format!("pg_terminate_backend({pid})")),
        "/readyz gives the fix: {body}"
    );
    wait_stall_seconds(&addr, "open_transaction", 10.0).await;

    // The application's transaction ends.
    app.batch_execute("COMMIT").await.unwrap();
    let after = outbox.insert_many(3, 2, 3).await;
    wait_delivered(&relay, &during).await;
    wait_delivered(&relay, &after).await;
    wait_ready(&addr).await;
    relay.stop_gracefully().await;
}

/// `status --json` (exit code not asserted: a stall makes it 1).
async fn status_json(file: &std::path::Path) -> serde_json::Value {
    let mut status = RelayProcess::spawn(
        &["status", "--json", "--config", file.to_str().unwrap()],
        &[],
    );
    status.wait_exit_async(Duration::from_secs(30)).await;
    serde_json::from_str(&status.stdout_text())
        .unwrap_or_else(|e| panic!("status --json: {e}\n{}", status.stdout_text()))
}

/// The acceptance test of issue 28's prepared transaction: one left open is
/// named by its gid in `status` (table and JSON), `/readyz`, the metric and
/// the log once older than `stream.prepared_transaction_max_age`; once
/// committed its event arrives and the relay is ready again. From
/// PostgreSQL 15 the slot is `two_phase`, as a relay that publishes prepared
/// transactions runs it: the prepared transaction then holds the confirmed
/// position.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepared_transaction_left_open_is_named_in_status_readyz_and_the_metric() {
    let cluster = private_cluster().await;
    let version = server_version(&cluster);
    let outbox = Outbox::on(&cluster).await;
    if version >= 150_000 {
        outbox.recreate_slot("false, true").await; // temporary = false, two_phase = true
    }
    let addr = free_addr();
    let extra = format!(
        "{QUICK_RETRY}[stream]\nprepared_transaction_max_age = \"3s\"\n[http]\nlisten = \"{addr}\""
    );
    let file = outbox.config_file(&extra);
    let mut relay = RelayProcess::spawn(&["run", "--config", file.to_str().unwrap()], &[]);
    outbox.wait_slot_active(true).await;
    let first = outbox.insert_many(2, 2, 2).await;
    wait_delivered(&relay, &first).await;

    // A prepared transaction with an event, then forgotten.
    let gid = format!("{}-forgotten", outbox.db.name());
    let app = outbox.db.client().await;
    let prepared: String = {
        app.batch_execute("BEGIN").await.unwrap();
        let row = app
            .query_one(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ('order', 'p-1', 'Prepared', '{}') RETURNING id::text",
                &[],
            )
            .await
            .unwrap();
        app.batch_execute(&format!("PREPARE TRANSACTION '{gid}'"))
            .await
            .unwrap();
        row.get(0)
    };
    let later = outbox.insert_many(2, 2, 2).await;
    let body = wait_stall_reported(&relay, &addr, &[&gid, "COMMIT PREPARED"]).await;
    assert!(body.contains("prepared_transaction_max_age"), "{body}");
    wait_stall_seconds(&addr, "prepared_transaction", 3.0).await;

    // `status` names it, from the server alone.
    let status = status_json(&file).await;
    assert_eq!(status["healthy"], false, "{status:#}");
    assert_eq!(status["oldest_prepared_transaction"]["gid"], gid.as_str());
    let stall = &status["stalls"][0];
    assert_eq!(stall["cause"], "prepared_transaction", "{status:#}");
    assert_eq!(stall["subject"], gid.as_str(), "{status:#}");
    assert!(stall["fix"]
        .as_str()
        .unwrap()
        .contains(&format!("ROLLBACK PREPARED '{gid}'")));
    let mut table = RelayProcess::spawn(&["status", "--config", file.to_str().unwrap()], &[]);
    let exit = table.wait_exit_async(Duration::from_secs(30)).await;
    assert_eq!(
        exit.and_then(|s| s.code()),
        Some(1),
        "status exits 1 on a stall"
    );
    let text = table.stdout_text();
    assert!(
        text.lines()
            .any(|l| l.starts_with("oldest prepared tx") && l.contains(&gid)),
        "{text}"
    );
    assert!(
        text.lines().any(|l| l.starts_with("problem")
            && l.contains("stalled (prepared_transaction)")
            && l.contains(&gid)),
        "{text}"
    );

    // Finished, it comes out, and nothing stalls any more.
    app.batch_execute(&format!("COMMIT PREPARED '{gid}'"))
        .await
        .unwrap();
    wait_delivered(&relay, &[later, vec![prepared]].concat()).await;
    wait_ready(&addr).await;
    let status = status_json(&file).await;
    assert_eq!(status["stalls"], serde_json::json!([]), "{status:#}");
    relay.stop_gracefully().await;
}
