//! Two-phase transactions on a slot created with `two_phase`: what a
//! prepared transaction holds, when its events come out, and where the slot
//! is confirmed meanwhile, across restarts.
//!
//! From PostgreSQL 15 the walsender sends a prepared transaction at PREPARE
//! TRANSACTION and its outcome later; 14's pgoutput sends it at COMMIT
//! PREPARED as an ordinary transaction. Both must deliver the same events in
//! the same order; the position held while a transaction is prepared is
//! checked where the server decodes at PREPARE.

use std::collections::HashSet;
use std::time::Duration;

use harness::{wait_until, RelayProcess};
use tokio_postgres::Client;

use crate::outbox::{envelope_ids, Collect, Outbox, Running};

/// An outbox whose relay slot was created with `two_phase`.
async fn two_phase_outbox() -> Outbox {
    let outbox = Outbox::new().await;
    outbox.recreate_slot("false, true").await; // temporary = false, two_phase = true
    outbox
}

/// A gid of this test's own: they are unique in the cluster, which tests share.
fn gid(outbox: &Outbox, label: &str) -> String {
    format!("{}-{label}", outbox.db.name())
}

/// Whether the server decodes prepared transactions at PREPARE (15+).
async fn decodes_at_prepare(sql: &Client) -> bool {
    harness::server_version_num(sql).await >= 150_000
}

/// Prepare a transaction `gid` inserting one event for each aggregate
/// (as `Outbox::insert_tx` does): its ids, and an LSN after its rows and
/// before its PREPARE record.
async fn prepare(sql: &Client, gid: &str, aggregates: &[&str]) -> (Vec<String>, u64) {
    let written = write_uncommitted(sql, aggregates).await;
    prepare_transaction(sql, gid).await;
    written
}

/// Begin a transaction and insert one event for each aggregate: their ids,
/// and the LSN after them.
async fn write_uncommitted(sql: &Client, aggregates: &[&str]) -> (Vec<String>, u64) {
    sql.batch_execute("BEGIN").await.expect("begin");
    let rows = sql
        .query(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
             SELECT 'order', a, 'Prepared', jsonb_build_object('n', n) \
             FROM unnest($1::text[]) WITH ORDINALITY AS u(a, n) ORDER BY n RETURNING id::text",
            &[&aggregates],
        )
        .await
        .expect("insert outbox rows");
    let before: String = sql
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await
        .expect("lsn")
        .get(0);
    let ids = rows.iter().map(|r| r.get(0)).collect();
    (ids, crate::outbox::parse_lsn(&before))
}

async fn prepare_transaction(sql: &Client, gid: &str) {
    sql.batch_execute(&format!("PREPARE TRANSACTION '{gid}'"))
        .await
        .expect("prepare transaction");
}

/// Where the PREPARE record of the prepared transaction `gid` starts, found
/// with pg_walinspect (15+) from `from` on. The slot may be confirmed up to
/// there and not past it: a walsender that starts at or before it sends the
/// prepared transaction again. (An LSN read before the PREPARE in its own
/// session is no bound: other sessions and databases write WAL in between,
/// which an idle relay rightly confirms on keepalives.)
async fn prepare_record_start(sql: &Client, gid: &str, from: u64) -> u64 {
    sql.batch_execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        .await
        .expect("pg_walinspect");
    let from = format!("{:X}/{:X}", from >> 32, from & 0xFFFF_FFFF);
    let rows = sql
        .query(
            "SELECT start_lsn::text FROM pg_get_wal_records_info($1::text::pg_lsn, pg_current_wal_flush_lsn()) \
             WHERE resource_manager = 'Transaction' AND record_type = 'PREPARE' \
             AND xid = (SELECT transaction FROM pg_prepared_xacts WHERE gid = $2)",
            &[&from, &gid],
        )
        .await
        .expect("read the PREPARE record");
    assert_eq!(rows.len(), 1, "one PREPARE record of {gid} after {from}");
    crate::outbox::parse_lsn(rows[0].get(0))
}

async fn finish_prepared(sql: &Client, verb: &str, gid: &str) {
    sql.batch_execute(&format!("{verb} PREPARED '{gid}'"))
        .await
        .unwrap_or_else(|e| panic!("{verb} PREPARED: {e}"));
}

fn one(aggregate: &str) -> Vec<(String, String)> {
    vec![(aggregate.to_owned(), "Plain".to_owned())]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepared_transaction_comes_out_once_at_commit_prepared_in_commit_order() {
    let outbox = two_phase_outbox().await;
    let (sink, relay) = outbox.streaming("").await;

    let first = outbox.insert_tx(&one("a-1")).await;
    let gid = gid(&outbox, "order-1");
    let (prepared, _) = prepare(&outbox.sql, &gid, &["a-1", "a-2", "a-1"]).await;
    // Committed after the PREPARE, before the COMMIT PREPARED: it goes first,
    // also within the aggregate both write.
    let between = outbox.insert_tx(&one("a-1")).await;
    wait_until(
        Duration::from_secs(20),
        "the transactions around the prepared one are delivered",
        || async { sink.ids().len() >= 2 },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        sink.ids(),
        [first.clone(), between.clone()].concat(),
        "nothing of the prepared transaction before its COMMIT PREPARED"
    );

    finish_prepared(&outbox.sql, "COMMIT", &gid).await;
    let last = outbox.insert_tx(&one("a-2")).await;
    wait_until(
        Duration::from_secs(20),
        "every event is delivered",
        || async { sink.ids().len() >= 6 },
    )
    .await;
    let commits = outbox.commits().await;
    let witness: Vec<String> = commits.iter().flat_map(|c| c.ids.clone()).collect();
    let expected = [first, between, prepared, last].concat();
    assert_eq!(witness, expected, "the witness saw them in commit order");
    wait_until(
        Duration::from_secs(10),
        "the slot is confirmed past the last commit",
        || async { outbox.confirmed_flush().await >= commits.last().unwrap().end_lsn },
    )
    .await;
    assert_eq!(sink.ids(), expected, "once each, in commit order");
    // Every row reads PUBLISHED, the prepared transaction's too: under the
    // derived lifecycle once a pair stored after their commits vouches for
    // them, which can come after the slot's confirmation (a relay stopped
    // before that leaves them to its next start: docs/guarantees.md).
    let every_row: Vec<String> = outbox.all_ids().await.into_iter().collect();
    wait_until(
        Duration::from_secs(10),
        "every row reads PUBLISHED",
        || async {
            let states = outbox.view_states(&every_row).await;
            states.len() == 6 && states.iter().all(|s| s == "PUBLISHED")
        },
    )
    .await;
    let summary = relay.stop().await;
    assert_eq!((summary.delivered, summary.rejected), (6, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_prepared_transaction_is_never_published() {
    let outbox = two_phase_outbox().await;
    let (sink, relay) = outbox.streaming("").await;

    let gid = gid(&outbox, "order-2");
    let (rolled_back, _) = prepare(&outbox.sql, &gid, &["r-1", "r-2"]).await;
    let before = outbox.insert_tx(&one("p-1")).await;
    finish_prepared(&outbox.sql, "ROLLBACK", &gid).await;
    let after = outbox.insert_tx(&one("p-2")).await;
    let commits = outbox.commits().await;
    assert_eq!(commits.len(), 2, "the witness saw no commit of it");
    wait_until(
        Duration::from_secs(20),
        "the slot is confirmed past the commit after the rollback",
        || async { outbox.confirmed_flush().await >= commits[1].end_lsn },
    )
    .await;
    assert_eq!(sink.ids(), [before, after].concat());
    assert!(sink.ids().iter().all(|id| !rolled_back.contains(id)));
    let summary = relay.stop().await;
    assert_eq!((summary.delivered, summary.rejected), (2, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slot_is_not_confirmed_past_a_prepared_transaction_until_it_is_resolved() {
    let outbox = two_phase_outbox().await;
    let at_prepare = decodes_at_prepare(&outbox.sql).await;
    // Another session writes WAL while the transaction is open, as other
    // sessions and databases do on a busy server.
    let other = outbox.db.client().await;
    other
        .batch_execute("CREATE TABLE noise (g int)")
        .await
        .unwrap();
    let (sink, relay) = outbox.streaming("").await;

    let first = outbox.insert_tx(&one("c-1")).await;
    let first_end = outbox.commits().await[0].end_lsn;
    wait_until(
        Duration::from_secs(20),
        "the first commit is confirmed",
        || async { outbox.confirmed_flush().await >= first_end },
    )
    .await;
    let gid = gid(&outbox, "order-3");
    let (prepared, after_rows) = write_uncommitted(&outbox.sql, &["c-2"]).await;
    // Before its PREPARE the transaction holds nothing: the idle relay
    // confirms the other session's commits past its rows (a walsender that
    // starts there still decodes them, from the slot's restart_lsn).
    for n in 0..5 {
        other
            .batch_execute(&format!(
                "INSERT INTO noise SELECT g FROM generate_series(1, {} * 100) g",
                n + 1
            ))
            .await
            .unwrap();
    }
    wait_until(
        Duration::from_secs(20),
        "the slot is confirmed past the open transaction's rows",
        || async { outbox.confirmed_flush().await > after_rows },
    )
    .await;
    prepare_transaction(&outbox.sql, &gid).await;
    let prepare_start = if at_prepare {
        prepare_record_start(&outbox.sql, &gid, after_rows).await
    } else {
        u64::MAX
    };
    let between = outbox.insert_tx(&one("c-3")).await;
    wait_until(
        Duration::from_secs(20),
        "the commit after the PREPARE is delivered",
        || async { sink.ids() == [first.clone(), between.clone()].concat() },
    )
    .await;
    // Time passes, status updates and keepalives go back and forth, other
    // WAL is written: the slot stays at or before the PREPARE record.
    other
        .batch_execute("INSERT INTO noise SELECT g FROM generate_series(1, 10000) g")
        .await
        .unwrap();
    for _ in 0..30 {
        let confirmed = outbox.confirmed_flush().await;
        assert!(
            confirmed <= prepare_start,
            "confirmed {confirmed:X} passed the PREPARE record at {prepare_start:X}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let held: i64 = outbox
        .sql
        .query_one(
            "SELECT count(*) FROM pg_prepared_xacts WHERE gid = $1",
            &[&gid],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(held, 1, "still prepared");

    finish_prepared(&outbox.sql, "COMMIT", &gid).await;
    let commits = outbox.commits().await;
    let last = commits.last().unwrap();
    assert_eq!(last.ids, prepared, "COMMIT PREPARED is the last commit");
    wait_until(
        Duration::from_secs(20),
        "the slot moves past the COMMIT PREPARED",
        || async { outbox.confirmed_flush().await >= last.end_lsn },
    )
    .await;
    assert_eq!(sink.ids(), [first, between, prepared].concat());
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepare_on_another_table_does_not_stop_the_relay() {
    let outbox = two_phase_outbox().await;
    outbox
        .sql
        .batch_execute("CREATE TABLE other (id bigserial PRIMARY KEY, note text)")
        .await
        .unwrap();
    let (sink, relay) = outbox.streaming("").await;

    let gid = gid(&outbox, "other-1");
    outbox
        .sql
        .batch_execute(&format!(
            "BEGIN; INSERT INTO other (note) VALUES ('x'); PREPARE TRANSACTION '{gid}'"
        ))
        .await
        .unwrap();
    let first = outbox.insert_tx(&one("o-1")).await;
    let first_end = outbox.commits().await[0].end_lsn;
    // It holds no outbox event, so it holds nothing back.
    wait_until(
        Duration::from_secs(20),
        "the commit after it is delivered and confirmed while it is still prepared",
        || async { sink.ids() == first && outbox.confirmed_flush().await >= first_end },
    )
    .await;
    finish_prepared(&outbox.sql, "COMMIT", &gid).await;
    let second = outbox.insert_tx(&one("o-2")).await;
    let second_end = outbox.commits().await[1].end_lsn;
    wait_until(
        Duration::from_secs(20),
        "the next commit is delivered and confirmed",
        || async { outbox.confirmed_flush().await >= second_end },
    )
    .await;
    assert!(!relay.task.is_finished(), "the relay runs on");
    assert_eq!(sink.ids(), [first, second].concat());
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepared_transaction_larger_than_the_in_flight_budget_does_not_stop_the_stream() {
    let outbox = two_phase_outbox().await;
    let sink = Collect::default();
    // Its events count against the budget, up to half of it: were they to
    // fill it, the stream would wait for room only its COMMIT PREPARED,
    // further on, can make.
    let relay = Running::start(outbox.config("[stream]\nmax_in_flight = 10"), sink.clone());
    outbox.wait_slot_active(true).await;
    let aggregates: Vec<String> = (0..50).map(|n| format!("big-{n}")).collect();
    let aggregates: Vec<&str> = aggregates.iter().map(String::as_str).collect();
    let gid = gid(&outbox, "order-5");
    let (prepared, _) = prepare(&outbox.sql, &gid, &aggregates).await;
    let mut after = Vec::new();
    for n in 0..30 {
        after.extend(outbox.insert_tx(&one(&format!("flow-{}", n % 3))).await);
    }
    wait_until(
        Duration::from_secs(30),
        "what committed after the PREPARE flows past it",
        || async { sink.ids() == after },
    )
    .await;
    finish_prepared(&outbox.sql, "COMMIT", &gid).await;
    let commits = outbox.commits().await;
    wait_until(
        Duration::from_secs(30),
        "the prepared transaction is delivered and confirmed",
        || async { outbox.confirmed_flush().await >= commits.last().unwrap().end_lsn },
    )
    .await;
    assert_eq!(sink.ids(), [after, prepared].concat());
    relay.stop().await;
}

/// How the first relay process ends.
#[derive(Debug, Clone, Copy)]
enum Stop {
    Graceful,
    Kill9,
}

/// A relay stopped between PREPARE and COMMIT PREPARED: the next one gets
/// the prepared transaction again from the walsender, and its events come
/// out once, after COMMIT PREPARED.
async fn restart_between_prepare_and_commit_prepared(stop: Stop) {
    let outbox = two_phase_outbox().await;
    let at_prepare = decodes_at_prepare(&outbox.sql).await;
    let config = outbox.config_file("");
    let run = || RelayProcess::spawn(&["run", "--config", config.to_str().unwrap()], &[]);
    let mut first = run();
    outbox.wait_slot_active(true).await;
    let before = outbox.insert_tx(&one("k-1")).await;
    let gid = gid(&outbox, "order-4");
    let (prepared, after_rows) = prepare(&outbox.sql, &gid, &["k-1", "k-2"]).await;
    let between = outbox.insert_tx(&one("k-1")).await;
    wait_until(
        Duration::from_secs(30),
        "the first relay has published what committed",
        || async {
            let seen = envelope_ids(&first.stdout_lines());
            before.iter().chain(&between).all(|id| seen.contains(id))
        },
    )
    .await;
    match stop {
        Stop::Graceful => first.stop_gracefully().await,
        Stop::Kill9 => first.kill9(),
    }
    outbox.wait_slot_active(false).await;
    let out_first = envelope_ids(&first.stdout_lines());
    assert!(
        out_first.iter().all(|id| !prepared.contains(id)),
        "nothing of the prepared transaction before COMMIT PREPARED"
    );
    if at_prepare {
        let prepare_start = prepare_record_start(&outbox.sql, &gid, after_rows).await;
        let confirmed = outbox.confirmed_flush().await;
        assert!(
            confirmed <= prepare_start,
            "{stop:?}: confirmed {confirmed:X} passed the PREPARE record at {prepare_start:X}"
        );
    }

    let mut second = run();
    outbox.wait_slot_active(true).await;
    finish_prepared(&outbox.sql, "COMMIT", &gid).await;
    let after = outbox.insert_tx(&one("k-2")).await;
    wait_until(
        Duration::from_secs(30),
        "the second relay has published the prepared transaction and the commit after it",
        || async {
            let seen = envelope_ids(&second.stdout_lines());
            prepared.iter().chain(&after).all(|id| seen.contains(id))
        },
    )
    .await;
    second.stop_gracefully().await;
    let out_second = envelope_ids(&second.stdout_lines());
    let all: Vec<&String> = out_first.iter().chain(&out_second).collect();
    for id in &prepared {
        assert_eq!(
            all.iter().filter(|seen| **seen == id).count(),
            1,
            "{stop:?}: prepared event {id} comes out exactly once"
        );
    }
    // In commit order in the second run: what committed between PREPARE and
    // COMMIT PREPARED (sent again: the position was held before it), then the
    // prepared transaction, then the commit after it.
    let order: Vec<&String> = out_second
        .iter()
        .filter(|id| prepared.contains(id) || after.contains(id) || between.contains(id))
        .collect();
    let position = |id: &String| order.iter().position(|seen| *seen == id).unwrap();
    assert!(position(&prepared[0]) < position(&prepared[1]));
    assert!(position(&prepared[1]) < position(&after[0]));
    if let Some(again) = order.iter().position(|id| between.contains(id)) {
        assert!(again < position(&prepared[0]));
    }
    let unique: HashSet<&String> = all.iter().copied().collect();
    assert!(
        [before, between, prepared, after]
            .concat()
            .iter()
            .all(|id| unique.contains(id)),
        "nothing is lost"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_restart_between_prepare_and_commit_prepared_delivers_the_prepared_events_once()
{
    restart_between_prepare_and_commit_prepared(Stop::Graceful).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_9_between_prepare_and_commit_prepared_delivers_the_prepared_events_once() {
    restart_between_prepare_and_commit_prepared(Stop::Kill9).await;
}
