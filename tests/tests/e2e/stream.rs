//! The replication stream, in process: what comes out, in which order, and
//! where the slot is confirmed.

use std::time::Duration;

use harness::wait_until;
use outbox_relay::ErrorClass;
use outbox_relay::Sink;

use crate::outbox::{metric, Collect, Outbox, Running};

fn start<S: Sink>(outbox: &Outbox, extra: &str, sink: S) -> Running {
    Running::start(outbox.config(extra), sink)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_comes_out_once_in_commit_order() {
    let outbox = Outbox::new().await;
    outbox
        .sql
        .batch_execute(
            "CREATE TABLE noise (id bigserial PRIMARY KEY, body text);
             CREATE TABLE audit (id bigserial PRIMARY KEY, note text);
             ALTER PUBLICATION outbox_relay ADD TABLE audit;",
        )
        .await
        .unwrap();
    let sink = Collect::default();
    let relay = start(&outbox, "", sink.clone());
    outbox.wait_slot_active(true).await;

    let mut expected = Vec::new();
    for round in 0..10 {
        expected.extend(outbox.insert_many(50, 10, 50).await);
        // In between: a table outside the publication, and one inside it that
        // is not the outbox. Neither may produce anything.
        outbox
            .sql
            .batch_execute(&format!(
                "INSERT INTO noise (body) SELECT repeat('n', 200) FROM generate_series(1, 100);
                 INSERT INTO audit (note) VALUES ('round {round}');"
            ))
            .await
            .unwrap();
    }
    assert_eq!(expected.len(), 5_000);
    wait_until(
        Duration::from_secs(60),
        "5,000 events are delivered",
        || async { sink.ids().len() >= expected.len() },
    )
    .await;

    let commits = outbox.commits().await;
    let witness: Vec<String> = commits.iter().flat_map(|c| c.ids.clone()).collect();
    assert_eq!(
        witness, expected,
        "the witness saw the inserts in commit order"
    );
    let got = sink.ids();
    assert_eq!(got.len(), expected.len(), "exactly once each");
    assert!(got == expected, "delivered in commit order");

    // Per aggregate, too (implied by the above; stated for the reader).
    let last_commit = commits.last().unwrap().end_lsn;
    wait_until(
        Duration::from_secs(10),
        "the slot is confirmed past the last commit",
        || async { outbox.confirmed_flush().await >= last_commit },
    )
    .await;
    let summary = relay.stop().await;
    assert_eq!(summary.delivered, 5_000);
    assert_eq!(summary.rejected, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slot_is_never_confirmed_past_an_event_the_sink_has_not_finished() {
    let outbox = Outbox::new().await;
    let sink = Collect::holding(|m| m.event.aggregate_id() == "held");
    let relay = start(&outbox, "", sink.clone());
    outbox.wait_slot_active(true).await;

    // The first event alone (were it in the held event's batch, it would wait with it).
    outbox.insert_tx(&[("a".into(), "First".into())]).await;
    let first = outbox.commits().await[0].end_lsn;
    wait_until(
        Duration::from_secs(10),
        "the first commit is confirmed",
        || async { outbox.confirmed_flush().await >= first },
    )
    .await;
    let held = outbox.insert_tx(&[("held".into(), "Second".into())]).await;
    outbox.insert_tx(&[("c".into(), "Third".into())]).await;
    let commits = outbox.commits().await;
    assert_eq!(commits.len(), 3);
    let (second, third) = (commits[1].end_lsn, commits[2].end_lsn);

    wait_until(
        Duration::from_secs(10),
        "the sink holds the second event",
        || async { sink.waiting.lock().unwrap().contains(&held[0]) },
    )
    .await;
    // Time passes, status updates and keepalives go back and forth, other
    // WAL is written: the slot must stay behind the held transaction.
    outbox
        .sql
        .batch_execute("CREATE TABLE noise AS SELECT g FROM generate_series(1, 10000) g")
        .await
        .unwrap();
    for _ in 0..30 {
        let confirmed = outbox.confirmed_flush().await;
        assert!(
            confirmed < second,
            "confirmed {confirmed:X} passed the held commit ending at {second:X}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    sink.release();
    wait_until(
        Duration::from_secs(10),
        "the slot moves past the third commit",
        || async { outbox.confirmed_flush().await >= third },
    )
    .await;
    assert_eq!(sink.ids().len(), 3);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_outbox_does_not_hold_wal_while_other_tables_are_written() {
    let outbox = Outbox::new().await;
    let relay = start(&outbox, "", Collect::default());
    outbox.wait_slot_active(true).await;
    outbox
        .sql
        .batch_execute("CREATE TABLE busy (id bigserial PRIMARY KEY, body text)")
        .await
        .unwrap();
    let before = outbox.current_lsn().await;
    for _ in 0..10 {
        outbox
            .sql
            .batch_execute("INSERT INTO busy (body) SELECT repeat(md5(g::text), 32) FROM generate_series(1, 5000) g")
            .await
            .unwrap();
    }
    let after = outbox.current_lsn().await;
    assert!(
        after - before >= 50 << 20,
        "wrote {} MB of WAL",
        (after - before) >> 20
    );
    let lag = wait_until(
        Duration::from_secs(10),
        "slot lag falls under 1 MB",
        || async {
            let lag = after.saturating_sub(outbox.confirmed_flush().await);
            (lag < 1 << 20).then_some(lag)
        },
    )
    .await;
    eprintln!("lag after 50 MB of other writes: {lag} bytes");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_that_cannot_become_an_event_is_skipped_and_the_stream_moves_on() {
    // An application-managed table where aggregate_id may be NULL.
    let outbox = Outbox::with_schema(Some(
        "CREATE TABLE outbox (id uuid PRIMARY KEY DEFAULT gen_random_uuid(), aggregate_type text,
            aggregate_id text, event_type text, payload jsonb)",
    ))
    .await;
    let sink = Collect::default();
    let relay = start(
        &outbox,
        "[columns]\nheaders = \"\"\ntopic = \"\"\ncreated_at = \"\"\n[lifecycle]\non_published = \"none\"",
        sink.clone(),
    );
    outbox.wait_slot_active(true).await;
    for aggregate in [None, Some("o-1")] {
        outbox
            .sql
            .execute(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', $1, 'E', '{}')",
                &[&aggregate],
            )
            .await
            .unwrap();
    }
    let commits = outbox.commits().await;
    wait_until(
        Duration::from_secs(10),
        "the good event is delivered",
        || async { sink.ids().len() == 1 },
    )
    .await;
    assert_eq!(sink.ids(), commits[1].ids);
    wait_until(
        Duration::from_secs(10),
        "the slot moves past both",
        || async { outbox.confirmed_flush().await >= commits[1].end_lsn },
    )
    .await;
    let summary = relay.stop().await;
    assert_eq!((summary.delivered, summary.rejected), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_that_does_not_fit_the_mapping_stops_the_relay_at_start_naming_the_key() {
    let outbox = Outbox::new().await;
    outbox.insert_tx(&[("a".into(), "E".into())]).await;
    let before = outbox.confirmed_flush().await;
    // Refused before it streams (a required column dropped mid-stream is
    // bad_input's case).
    let relay = start(
        &outbox,
        "[columns]\nevent_type = \"kind\"",
        Collect::default(),
    );
    let result = tokio::time::timeout(Duration::from_secs(20), relay.task)
        .await
        .expect("the relay stops by itself")
        .unwrap();
    let error = result.expect_err("a fatal error");
    assert_eq!(error.class(), ErrorClass::Fatal);
    let text = error.to_string();
    assert!(
        text.contains("columns.event_type") && text.contains("\"kind\""),
        "{text}"
    );
    assert_eq!(
        outbox.confirmed_flush().await,
        before,
        "nothing acknowledged"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_rows_stop_the_stream_at_the_byte_budget_until_the_sink_takes_them() {
    const BUDGET: usize = 1 << 20;
    const ROW: usize = 64 << 10;
    let outbox = Outbox::new().await;
    let sink = Collect::holding(|_| true);
    let relay = start(
        &outbox,
        &format!("[stream]\nmax_in_flight_bytes = {BUDGET}"),
        sink.clone(),
    );
    outbox.wait_slot_active(true).await;
    // 40 rows of 64 KiB in one transaction: 5 MiB of rows, 10 MiB with their
    // envelopes, against a 1 MiB budget (a transaction larger than the
    // budget flows event by event).
    outbox
        .sql
        .execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
             SELECT 'order', 'o-' || n, 'Big', jsonb_build_object('blob', repeat(md5(n::text), $1::int / 32)) \
             FROM generate_series(1, 40) n",
            &[&(ROW as i32)],
        )
        .await
        .unwrap();
    let commit = outbox.commits().await[0].end_lsn;
    wait_until(
        Duration::from_secs(10),
        "the sink holds the first event",
        || async { !sink.waiting.lock().unwrap().is_empty() },
    )
    .await;
    // What the relay has read while the sink holds everything stays at the budget.
    let mut most = 0.0f64;
    for _ in 0..20 {
        most = most.max(metric(
            "outbox_relay_events_received_total{path=\"replication\"",
        ));
        let held = metric("outbox_relay_in_flight_bytes");
        // Under the budget, plus at most one event read at its edge.
        assert!(
            held <= (BUDGET + 3 * ROW + 8192) as f64,
            "{held} bytes held against a budget of {BUDGET}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Each event counts its row and its envelope twice (~192 KiB): about 5 fit.
    let fit = BUDGET / (3 * ROW) + 1;
    assert!(
        (1.0..=fit as f64).contains(&most),
        "{most} events read with the sink holding all, budget for {fit}"
    );
    assert!(outbox.confirmed_flush().await < commit);

    sink.release();
    wait_until(
        Duration::from_secs(30),
        "every large event is delivered",
        || async { sink.ids().len() == 40 },
    )
    .await;
    // One event larger than the whole budget still passes, alone.
    outbox
        .sql
        .execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('order', 'huge', 'Huge', jsonb_build_object('blob', repeat('x', $1::int)))",
            &[&(2 * BUDGET as i32)],
        )
        .await
        .unwrap();
    let last = outbox.commits().await[1].end_lsn;
    wait_until(
        Duration::from_secs(30),
        "the event larger than the budget is delivered and confirmed",
        || async { sink.ids().len() == 41 && outbox.confirmed_flush().await >= last },
    )
    .await;
    assert_eq!(metric("outbox_relay_in_flight_bytes"), 0.0);
    let summary = relay.stop().await;
    assert_eq!(summary.delivered, 41);
}
