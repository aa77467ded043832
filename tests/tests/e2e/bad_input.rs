//! The bad-input catalogue's entries that change the table under a running
//! relay (docs/bad-input.md lists every entry and its test): each ends with a
//! clear error or a stream that moves on, and nothing lost.

use std::time::Duration;

use harness::{server_version_num, wait_until};
use outbox_relay::ErrorClass;

use crate::outbox::{Collect, Outbox, Running};

/// The relay's result, once it stopped by itself.
async fn stopped(relay: Running) -> Result<outbox_relay::Summary, outbox_relay::RelayError> {
    tokio::time::timeout(Duration::from_secs(20), relay.task)
        .await
        .expect("the relay stops by itself")
        .expect("the relay task does not panic")
}

async fn delivered(sink: &Collect, ids: &[String]) {
    wait_until(
        Duration::from_secs(20),
        "the events are delivered",
        || async {
            let got = sink.ids();
            ids.iter().all(|id| got.contains(id))
        },
    )
    .await;
}

/// Wait until the slot is confirmed past the last commit.
async fn acknowledged(outbox: &Outbox) {
    let last = outbox.commits().await.last().unwrap().end_lsn;
    wait_until(Duration::from_secs(20), "the slot moves on", || async {
        outbox.confirmed_flush().await >= last
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn columns_added_and_an_optional_one_dropped_mid_stream_change_nothing() {
    let outbox = Outbox::new().await;
    let (sink, relay) = outbox.streaming("").await;
    let mut ids = outbox.insert_tx(&[("a".into(), "Before".into())]).await;
    outbox
        .sql
        .batch_execute("ALTER TABLE outbox ADD COLUMN note text DEFAULT 'n'")
        .await
        .unwrap();
    ids.extend(outbox.insert_tx(&[("a".into(), "Added".into())]).await);
    outbox
        .sql
        .batch_execute("DROP VIEW outbox_state; ALTER TABLE outbox DROP COLUMN headers")
        .await
        .unwrap();
    ids.extend(outbox.insert_tx(&[("a".into(), "Dropped".into())]).await);
    delivered(&sink, &ids).await;
    assert_eq!(sink.ids(), ids, "in commit order, each once");
    acknowledged(&outbox).await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_required_column_dropped_mid_stream_stops_the_relay_naming_the_key() {
    let outbox = Outbox::new().await;
    let (sink, relay) = outbox.streaming("").await;
    let ids = outbox.insert_tx(&[("a".into(), "Before".into())]).await;
    delivered(&sink, &ids).await;
    outbox
        .sql
        .batch_execute(
            "DROP VIEW outbox_state; ALTER TABLE outbox DROP COLUMN event_type;
             INSERT INTO outbox (aggregate_type, aggregate_id, payload) VALUES ('o', 'a', '{}');",
        )
        .await
        .unwrap();
    let error = stopped(relay).await.expect_err("a fatal error");
    assert_eq!(error.class(), ErrorClass::Fatal);
    let text = error.to_string();
    assert!(text.contains("columns.event_type"), "{text}");
    let after = outbox.commits().await.last().unwrap().end_lsn;
    let now = outbox.confirmed_flush().await;
    assert!(
        now < after,
        "nothing after the drop is acknowledged ({now} < {after})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncate_mid_stream_is_not_an_event_and_the_stream_moves_on() {
    let outbox = Outbox::new().await;
    let (sink, relay) = outbox.streaming("").await;
    let mut ids = outbox.insert_tx(&[("a".into(), "Before".into())]).await;
    delivered(&sink, &ids).await;
    outbox.sql.batch_execute("TRUNCATE outbox").await.unwrap();
    ids.extend(outbox.insert_tx(&[("a".into(), "After".into())]).await);
    delivered(&sink, &ids).await;
    assert_eq!(sink.ids(), ids);
    acknowledged(&outbox).await;
    let summary = relay.stop().await;
    assert_eq!((summary.delivered, summary.rejected), (2, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_renamed_mid_stream_loses_nothing_and_the_old_name_is_refused_at_start() {
    let outbox = Outbox::new().await;
    let (sink, relay) = outbox.streaming("[poller]\nenabled = false").await;
    // An event before the rename, one after it.
    let mut ids = outbox.insert_tx(&[("a".into(), "Before".into())]).await;
    outbox
        .sql
        .batch_execute("ALTER TABLE outbox RENAME TO outbox_renamed")
        .await
        .unwrap();
    let insert = |event: &'static str| {
        let sql = &outbox.sql;
        async move {
            sql.query_one(
                "INSERT INTO outbox_renamed (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('o', 'a', $1, '{}') RETURNING id::text",
                &[&event],
            )
            .await
            .unwrap()
            .get::<_, String>(0)
        }
    };
    ids.push(insert("Renamed").await);
    // The slot carries the table by oid, so the running session publishes the
    // row written under the new name. A session that starts after the rename
    // (a reconnect) stops instead, naming the table: either way nothing is lost.
    for _ in 0..200 {
        if relay.task.is_finished() || ids.iter().all(|id| sink.ids().contains(id)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let published = !relay.task.is_finished();
    if published {
        assert_eq!(sink.ids(), ids, "in order, each once");
        relay.stop().await;
    } else {
        let error = stopped(relay).await.expect_err("a fatal error");
        assert!(error.to_string().contains("public.outbox"), "{error}");
    }

    // Started with the old name, the relay says what to do.
    let error = stopped(Running::start(outbox.config(""), Collect::default()))
        .await
        .expect_err("a fatal error");
    assert_eq!(error.class(), ErrorClass::Fatal);
    assert!(error.to_string().contains("public.outbox"), "{error}");
    // With the new name it starts, and every event arrives.
    let sink = Collect::default();
    let relay = Running::start(
        outbox.config("table = \"public.outbox_renamed\"\n[poller]\nenabled = false"),
        sink.clone(),
    );
    ids.push(insert("After").await);
    // What the first relay did not publish comes from the slot now, old name or new.
    let expected = if published { &ids[2..] } else { &ids[..] };
    delivered(&sink, expected).await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_while_marking_rows_loses_no_event_and_marking_resumes() {
    let outbox = Outbox::new().await;
    let (sink, relay) = outbox.streaming("[poller]\nenabled = false").await;
    outbox
        .sql
        .batch_execute(&format!("REVOKE UPDATE ON outbox FROM {}", outbox.role))
        .await
        .unwrap();
    let unmarked = outbox.insert_tx(&[("a".into(), "Unmarked".into())]).await;
    delivered(&sink, &unmarked).await;
    acknowledged(&outbox).await;
    let state = |id: String| {
        let sql = &outbox.sql;
        async move {
            sql.query_one(
                "SELECT state FROM outbox_state WHERE id = $1::text::uuid",
                &[&id],
            )
            .await
            .unwrap()
            .get::<_, String>(0)
        }
    };
    // Delivered, acknowledged, and left PENDING: the poller may send it once more later.
    assert_eq!(state(unmarked[0].clone()).await, "PENDING");

    outbox
        .sql
        .batch_execute(&format!("GRANT UPDATE ON outbox TO {}", outbox.role))
        .await
        .unwrap();
    let marked = outbox.insert_tx(&[("a".into(), "Marked".into())]).await;
    delivered(&sink, &marked).await;
    wait_until(Duration::from_secs(30), "marking resumes", || async {
        state(marked[0].clone()).await == "PUBLISHED"
    })
    .await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_stops_the_relay_with_the_servers_reason() {
    let outbox = Outbox::new().await;
    let mut config = outbox.config("");
    let url = outbox
        .relay_url()
        .replacen(crate::outbox::ROLE_PASSWORD, "not-the-password", 1);
    config.postgres.url = Some(outbox_relay::Secret::new(url));
    let relay = Running::start(config, Collect::default());
    let error = stopped(relay).await.expect_err("a fatal error");
    assert_eq!(error.class(), ErrorClass::Fatal);
    let text = error.to_string();
    assert!(
        text.contains("password authentication failed") && !text.contains("not-the-password"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_or_wrong_publication_stops_the_relay_with_the_fix() {
    let outbox = Outbox::new().await;
    let ids = outbox.insert_tx(&[("a".into(), "Waiting".into())]).await;
    let before = outbox.confirmed_flush().await;
    // Row filters came with PostgreSQL 15: on 14 a publication cannot have one.
    let row_filters = server_version_num(&outbox.sql).await >= 150_000;
    for (change, expected) in [
        (
            "ALTER PUBLICATION outbox_relay SET TABLE outbox WHERE (aggregate_id <> 'x')",
            "has a row filter",
        ),
        (
            "ALTER PUBLICATION outbox_relay SET TABLE outbox;
             ALTER PUBLICATION outbox_relay SET (publish = 'update')",
            "ALTER PUBLICATION outbox_relay SET (publish = 'insert')",
        ),
        ("DROP PUBLICATION outbox_relay", "does not exist"),
    ] {
        if change.contains(" WHERE ") && !row_filters {
            continue;
        }
        outbox.sql.batch_execute(change).await.unwrap();
        let relay = Running::start(outbox.config(""), Collect::default());
        let error = stopped(relay).await.expect_err("a fatal error");
        assert_eq!(error.class(), ErrorClass::Fatal);
        let text = error.to_string();
        assert!(text.contains(expected), "{change}: {text}");
    }
    assert_eq!(
        outbox.confirmed_flush().await,
        before,
        "nothing acknowledged"
    );
    // Put right, the waiting event arrives.
    outbox
        .sql
        .batch_execute(
            "CREATE PUBLICATION outbox_relay FOR TABLE outbox WITH (publish = 'insert', publish_via_partition_root = true)",
        )
        .await
        .unwrap();
    let sink = Collect::default();
    let relay = Running::start(outbox.config(""), sink.clone());
    delivered(&sink, &ids).await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_that_is_not_utf8_stops_the_relay_with_the_fix_and_after_it_nothing_is_lost() {
    let outbox = Outbox::sql_ascii().await;
    let (sink, relay) = outbox.streaming("").await;
    let before = outbox.insert_tx(&[("a".into(), "Before".into())]).await;
    wait_until(Duration::from_secs(15), "the first event", || async {
        sink.ids() == before
    })
    .await;
    // And confirmed: otherwise the restart below may rightly send it again
    // (seen once on PostgreSQL 14, when the walsender hit the bad row before
    // it read the relay's status update).
    acknowledged(&outbox).await;
    // A SQL_ASCII database stores the bytes 0xe9 and 0xff as they are; the
    // walsender cannot turn them into the UTF-8 the relay's session asks for.
    let bad: String = outbox
        .sql
        .query_one(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('order', E'caf\\xe9-\\xff', 'Bad', '{}') RETURNING id::text",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let after = outbox.insert_tx(&[("a".into(), "After".into())]).await;
    let error = stopped(relay).await.expect_err("a fatal error");
    assert_eq!(error.class(), ErrorClass::Fatal);
    let text = error.to_string();
    for needle in [
        "not valid UTF-8",
        "SQLSTATE 22021",
        "recreate_slot",
        "docs/recovery.md",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from: {text}");
    }
    assert_eq!(sink.ids(), before, "nothing past the bad row was published");
    // The slot did not move past it: a restart stops at the same change.
    // (The witness slot cannot show it either: peeking converts to UTF-8 too.)
    let again = Collect::default();
    let relay = Running::start(outbox.config(""), again.clone());
    let error = stopped(relay).await.expect_err("the same fatal error");
    assert!(error.to_string().contains("SQLSTATE 22021"), "{error}");
    assert!(again.ids().is_empty(), "nothing published after a restart");

    // The fix the error gives: correct the text, recreate the slot; the
    // poller publishes what the old slot held.
    outbox
        .sql
        .execute(
            "UPDATE outbox SET aggregate_id = 'cafe' WHERE id::text = $1",
            &[&bad],
        )
        .await
        .unwrap();
    outbox.drop_slot().await;
    let (sink, relay) = outbox
        .streaming("[lifecycle]\nrecreate_slot = true\n[poller]\ninterval = \"200ms\"")
        .await;
    let mut expected = vec![bad.clone()];
    expected.extend(after.iter().cloned());
    // The fixed row and the one after it.
    delivered(&sink, &expected).await;
    relay.stop().await;
    let states = outbox
        .sql
        .query("SELECT DISTINCT state FROM outbox_state", &[])
        .await
        .unwrap();
    let states: Vec<String> = states.iter().map(|r| r.get(0)).collect();
    assert_eq!(states, ["PUBLISHED"], "every row ends PUBLISHED");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_dropped_mid_stream_still_delivers_what_was_committed_and_the_next_start_says_so() {
    let outbox = Outbox::new().await;
    let (sink, relay) = outbox.streaming("").await;
    let mut ids = outbox.insert_tx(&[("a".into(), "First".into())]).await;
    delivered(&sink, &ids).await;
    // Committed just before the drop: the WAL still holds them, and the
    // walsender decodes them with the catalog of their time.
    ids.extend(
        outbox
            .insert_tx(&[("a".into(), "Last".into()), ("b".into(), "Last".into())])
            .await,
    );
    outbox
        .sql
        .batch_execute("DROP TABLE outbox CASCADE")
        .await
        .unwrap();
    delivered(&sink, &ids).await;
    relay.stop().await;
    assert_eq!(
        sink.ids(),
        ids,
        "every event committed before the drop, once, in order"
    );

    let relay = Running::start(outbox.config(""), Collect::default());
    let error = stopped(relay).await.expect_err("a fatal error");
    assert_eq!(error.class(), ErrorClass::Fatal);
    let text = error.to_string();
    assert!(
        text.contains("public.outbox") && text.contains("setup"),
        "the error names the table and the fix: {text}"
    );
}

/// A rejected event whose row the application deleted in the same
/// transaction (the Debezium pattern) can only be recorded in the dead-letter
/// table. Without one the relay stops before acknowledging it; once the table
/// exists, the restarted relay records it there and moves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_event_whose_row_is_gone_is_never_acknowledged_unrecorded() {
    let outbox = Outbox::new().await;
    outbox
        .sql
        .batch_execute(
            "DROP TABLE outbox_dead_letter; ALTER TABLE outbox ALTER COLUMN aggregate_id DROP NOT NULL",
        )
        .await
        .unwrap();
    let (sink, relay) = outbox.streaming("").await;
    let first = outbox.insert_tx(&[("a".into(), "First".into())]).await;
    delivered(&sink, &first).await;
    let bad: String = {
        let tx_sql = "BEGIN; \
             WITH r AS (INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
               VALUES ('order', NULL, 'NoAggregate', '{}') RETURNING id) \
             INSERT INTO outbox_seen SELECT id FROM r; \
             DELETE FROM outbox WHERE id IN (SELECT id FROM outbox_seen); \
             COMMIT;";
        outbox
            .sql
            .batch_execute(&format!(
                "CREATE TEMP TABLE outbox_seen (id uuid); {tx_sql}"
            ))
            .await
            .unwrap();
        outbox
            .sql
            .query_one("SELECT id::text FROM outbox_seen", &[])
            .await
            .unwrap()
            .get(0)
    };
    let after = outbox.insert_tx(&[("b".into(), "After".into())]).await;
    let error = stopped(relay).await.expect_err("the relay stops");
    assert_eq!(error.class(), ErrorClass::Fatal, "{error}");
    let text = error.to_string();
    assert!(
        text.contains(&bad) && text.contains("outbox_dead_letter") && text.contains("setup"),
        "the error names the event, the missing table and the fix: {text}"
    );
    let commits = outbox.commits().await;
    let rejected_commit = commits.iter().find(|c| c.ids.contains(&bad)).unwrap();
    assert!(
        outbox.confirmed_flush().await < rejected_commit.end_lsn,
        "the slot is not confirmed past the unrecorded rejection"
    );

    // The fix the message names: the dead-letter table, then a restart.
    let config = outbox.config("");
    let files = outbox_relay::setup::render(&config, &outbox.role, false).unwrap();
    let dead_letter: Vec<_> = files
        .into_iter()
        .filter(|(name, _)| name.starts_with("005"))
        .collect();
    outbox_relay::setup::apply(&outbox.sql, &dead_letter)
        .await
        .unwrap_or_else(|(file, e)| panic!("{file}: {e:?}"));
    let (sink, relay) = outbox.streaming("").await;
    delivered(&sink, &after).await;
    acknowledged(&outbox).await;
    relay.stop().await;
    let recorded: Vec<(String, String)> = outbox
        .sql
        .query("SELECT event_id, reason FROM outbox_dead_letter", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(recorded.len(), 1, "{recorded:?}");
    assert_eq!(recorded[0].0, bad);
    assert!(recorded[0].1.contains("aggregate_id"), "{recorded:?}");
}

/// Under a publication FOR ALL TABLES, a dropped outbox table created again
/// comes back with a new oid: its rows are still the outbox's, delivered, and
/// the relay started afterwards streams them too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_table_created_again_under_a_publication_for_all_tables_loses_nothing() {
    let outbox = Outbox::new().await;
    outbox
        .sql
        .batch_execute(
            "DROP PUBLICATION outbox_relay; \
             CREATE PUBLICATION outbox_relay FOR ALL TABLES WITH (publish = 'insert')",
        )
        .await
        .unwrap();
    let none = "[lifecycle]\non_published = \"none\"";
    let (sink, relay) = outbox.streaming(none).await;
    let mut ids = outbox.insert_tx(&[("a".into(), "Before".into())]).await;
    delivered(&sink, &ids).await;

    outbox
        .sql
        .batch_execute("DROP TABLE outbox CASCADE")
        .await
        .unwrap();
    let config = outbox.config(none);
    let files: Vec<_> = outbox_relay::setup::render(&config, &outbox.role, false)
        .unwrap()
        .into_iter()
        .filter(|(name, _)| name.starts_with("001") || name.starts_with("004"))
        .collect();
    outbox_relay::setup::apply(&outbox.sql, &files)
        .await
        .unwrap_or_else(|(file, e)| panic!("{file}: {e:?}"));
    ids.extend(
        outbox
            .insert_tx(&[("a".into(), "Again".into()), ("b".into(), "Again".into())])
            .await,
    );
    delivered(&sink, &ids).await;
    acknowledged(&outbox).await;
    relay.stop().await;
    assert_eq!(sink.ids(), ids, "every event once, in commit order");

    let (sink, relay) = outbox.streaming(none).await;
    let after = outbox.insert_tx(&[("c".into(), "Restarted".into())]).await;
    delivered(&sink, &after).await;
    relay.stop().await;
    assert_eq!(sink.ids(), after, "nothing repeated after a clean restart");
}
