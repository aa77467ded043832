//! The readers' index ranges on a derived table (`on_published = "derive"`)
//! while transactions stay open: they keep the vouched snapshot's xmin back,
//! yet the poller and `status` read only the rows not visible in it (after
//! its xmax, or of the transactions in progress at it), never every row
//! published since the oldest open transaction began; and the rows of those
//! transactions are still found.

use std::time::Duration;

use harness::{wait_until, RelayProcess};
use tokio_postgres::Client;

use crate::outbox::{Collect, Outbox, Running};

/// The rows the stream publishes while the transactions stay open.
const N: i64 = 20_000;

/// A quick poller (its grace over in a second) on a derived table.
const POLLER: &str = "[lifecycle]\non_published = \"derive\"\n[poller]\ninterval = \"200ms\"\ngrace = \"1s\"\nbackoff_initial = \"100ms\"\nbackoff_max = \"200ms\"\n";

/// Index entries read from `outbox_txid_idx` so far, by every session whose
/// statistics reached the server.
async fn txid_index_reads(outbox: &Outbox) -> i64 {
    outbox
        .sql
        .query_one(
            "SELECT idx_tup_read FROM pg_stat_user_indexes WHERE indexrelname = 'outbox_txid_idx'",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// Index entries read from `outbox_txid_idx` while `run` runs (and for the
/// second after, so that the sessions' statistics, sent at most once a
/// second, are in).
async fn reads_while<F: std::future::Future<Output = ()>>(outbox: &Outbox, run: F) -> i64 {
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = txid_index_reads(outbox).await;
    run.await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let read = txid_index_reads(outbox).await - before;
    eprintln!("outbox_txid_idx: {read} index entries read");
    read
}

/// Open a transaction on a connection of its own that inserts `n` rows of
/// event type `event_type`; the connection (to commit it later), its id
/// (`pg_current_xact_id()`) and the rows' ids.
async fn open_transaction(outbox: &Outbox, n: i32, event_type: &str) -> (Client, u64, Vec<String>) {
    let client = outbox.db.client().await;
    client.batch_execute("BEGIN").await.unwrap();
    let ids = client
        .query(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
             SELECT 'order', $2 || '-' || g, $2, '{}' FROM generate_series(1, $1) g RETURNING id::text",
            &[&n, &event_type],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let xid: String = client
        .query_one("SELECT pg_current_xact_id()::text", &[])
        .await
        .unwrap()
        .get(0);
    (client, xid.parse().unwrap(), ids)
}

/// The slot's vouched snapshot: (xmin, xip).
async fn vouched(outbox: &Outbox) -> (u64, Vec<u64>) {
    let row = outbox
        .sql
        .query_one(
            "SELECT pg_snapshot_xmin(snapshot)::text, \
                    ARRAY(SELECT x::text FROM pg_snapshot_xip(snapshot) AS x) \
             FROM outbox_position WHERE slot_name = $1",
            &[&outbox.slot],
        )
        .await
        .unwrap();
    let xip: Vec<String> = row.get(1);
    (
        row.get::<_, String>(0).parse().unwrap(),
        xip.iter().map(|x| x.parse().unwrap()).collect(),
    )
}

/// `outbox-relay status --json`, run as a user would: its report.
async fn status(outbox: &Outbox) -> serde_json::Value {
    let config = outbox.config_file(POLLER);
    let mut process = RelayProcess::spawn(
        &["status", "--json", "--config", config.to_str().unwrap()],
        &[],
    );
    // It fails when no relay streams; the report is there all the same.
    process
        .wait_exit_async(Duration::from_secs(30))
        .await
        .expect("status exits");
    serde_json::from_str(&process.stdout_text())
        .unwrap_or_else(|e| panic!("{e}: {}", process.stderr_text()))
}

/// Two transactions stay open (the first keeps the vouched snapshot's xmin
/// back; each inserts rows) while the stream publishes 20,000 rows and the
/// keeper vouches for them:
///
/// * the poller's rounds and `status` read a few index entries, not the
///   20,000 rows published since the first transaction began;
/// * the first transaction's rows, committed while the sink holds them,
///   read PENDING (in the view and in `status`) until the stream delivers
///   them, which the poller leaves to it;
/// * the second's, committed while only the poller runs, are found and
///   published by the poller after its grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_transaction_costs_the_readers_its_own_rows_not_every_row_since_it_began() {
    let outbox = Outbox::new().await;
    let sink = Collect::holding(|m| m.event.event_type() == "Late");
    let relay = Running::start(outbox.config(POLLER), sink.clone());
    outbox.wait_slot_active(true).await;
    let (late_tx, late_xid, late) = open_transaction(&outbox, 2, "Late").await;
    let (orphan_tx, orphan_xid, orphans) = open_transaction(&outbox, 2, "Orphan").await;

    for _ in 0..100 {
        outbox
            .sql
            .execute(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
                 SELECT 'order', 'bulk-' || g, 'Bulk', '{}' FROM generate_series(1, $1) g",
                &[&((N / 100) as i32)],
            )
            .await
            .unwrap();
    }
    wait_until(
        Duration::from_secs(60),
        "the stream publishes the rows and the keeper vouches for them",
        || async {
            let published: i64 = outbox
                .sql
                .query_one(
                    "SELECT count(*) FROM outbox_state WHERE state = 'PUBLISHED'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            published == N
        },
    )
    .await;
    assert_eq!(sink.ids().len() as i64, N, "each row once, by the stream");
    let (xmin, xip) = vouched(&outbox).await;
    assert!(
        xmin <= late_xid,
        "the open transaction keeps the vouched xmin {xmin} back"
    );
    assert!(
        xip.contains(&late_xid) && xip.contains(&orphan_xid),
        "{xip:?}"
    );

    // Twenty rounds of the poller, each of which, with a range from the
    // vouched xmin, would read every row published since.
    let polled = reads_while(&outbox, tokio::time::sleep(Duration::from_secs(4))).await;
    assert!(
        polled < N / 10,
        "the poller read {polled} index entries in 20 rounds"
    );

    // Committed now, streamed and held by the sink: its rows are the
    // stream's, so the poller leaves them (the stream has not passed
    // them), and they read PENDING until delivered.
    late_tx.batch_execute("COMMIT").await.unwrap();
    wait_until(
        Duration::from_secs(15),
        "the stream hands the first late row to the sink",
        || async { !sink.waiting.lock().unwrap().is_empty() },
    )
    .await;
    // Fifteen rounds past their grace: a claim by the poller would hold a
    // second message in the sink.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let waiting = sink.waiting.lock().unwrap().clone();
    assert!(
        waiting.len() == 1 && late.contains(&waiting[0]),
        "only the stream's message waits: {waiting:?}"
    );
    assert_eq!(outbox.view_states(&late).await, ["PENDING"; 2]);
    let report = status(&outbox).await;
    assert_eq!(report["rows"]["PENDING"], 2, "{report:#}");
    assert!(report["oldest_pending_seconds"].is_number(), "{report:#}");

    sink.release();
    wait_until(
        Duration::from_secs(20),
        "the late rows are delivered and derived published",
        || async { outbox.view_states(&late).await == ["PUBLISHED"; 2] },
    )
    .await;
    let delivered = |ids: &[String]| {
        let got = sink.ids();
        ids.iter()
            .map(|id| got.iter().filter(|d| *d == id).count())
            .collect::<Vec<_>>()
    };
    // At least once: a transaction open longer than the poller's grace may
    // be published twice (by the poller too, once the stream passed it and
    // before a snapshot vouches for it), never missed.
    assert!(
        delivered(&late).iter().all(|n| *n >= 1),
        "{:?}",
        delivered(&late)
    );
    relay.stop().await;

    // `status` counts what is pending through the same ranges as the
    // metrics: a few index entries.
    let mut report = serde_json::Value::Null;
    let counted = reads_while(&outbox, async { report = status(&outbox).await }).await;
    assert_eq!(report["rows"]["PENDING"], 0, "{report:#}");
    assert!(counted < N / 10, "status read {counted} index entries");

    // The second transaction is still open at the vouched snapshot; no
    // stream runs now, so only the poller can publish its rows.
    let (_, xip) = vouched(&outbox).await;
    assert!(xip.contains(&orphan_xid), "{xip:?}");
    let relay = Running::start(
        outbox.config(&format!("{POLLER}[stream]\nenabled = false\n")),
        sink.clone(),
    );
    orphan_tx.batch_execute("COMMIT").await.unwrap();
    wait_until(
        Duration::from_secs(20),
        "the poller publishes the rows the stream did not get",
        || async { outbox.explicit_states(&orphans).await == ["PUBLISHED"; 2] },
    )
    .await;
    assert_eq!(delivered(&orphans), [1, 1]);
    let polled = reads_while(&outbox, tokio::time::sleep(Duration::from_secs(4))).await;
    assert!(
        polled < N / 10,
        "the poller alone read {polled} index entries in 20 rounds"
    );
    relay.stop().await;

    // A pair the rule does not trust (another system's, as a restored
    // cluster's row is until a session starts and discards it) leaves every
    // row with an id pending by the rule: the ranges must hold them all, so
    // `status` counts every one, not only those after the pair's snapshot.
    outbox
        .sql
        .batch_execute("UPDATE outbox_position SET system_identifier = '1'")
        .await
        .unwrap();
    let pending: i64 = outbox
        .sql
        .query_one(
            "SELECT count(*) FROM outbox WHERE publish_state = 'PENDING'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(pending >= N, "{pending}");
    let report = status(&outbox).await;
    assert_eq!(report["rows"]["PENDING"], pending, "{report:#}");
}
