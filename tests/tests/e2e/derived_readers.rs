//! The readers of a derived table (`on_published = "derive"`): the poller,
//! retention and `purge`, `status`, the metrics and `replay --state` read a
//! row's state by the derived rule, against a position row written here by
//! hand (a known vouched snapshot and known holes), on real PostgreSQL.

use std::collections::HashSet;
use std::time::Duration;

use harness::{wait_until, RelayProcess};

use crate::outbox::{metric, Collect, Outbox, Running};

/// A quick poller, alone (no stream): every PENDING row past its grace is
/// the poller's unless the derived rule says it is published.
const POLLER_ONLY: &str = "[stream]\nenabled = false\n[poller]\ninterval = \"200ms\"\ngrace = \"1s\"\nbackoff_initial = \"100ms\"\nbackoff_max = \"200ms\"\n";

/// `pg_current_snapshot()`, as text.
async fn snapshot(outbox: &Outbox) -> String {
    outbox
        .sql
        .query_one("SELECT pg_current_snapshot()::text", &[])
        .await
        .unwrap()
        .get(0)
}

/// Write the slot's position row as the keeper would: `vouched` the stored
/// S, `holes` (from, to) pairs; the confirmed position is the slot's, so the
/// stream starts where it would anyway.
async fn position(outbox: &Outbox, vouched: &str, holes: &[(&str, &str)]) {
    let from: Vec<&str> = holes.iter().map(|(f, _)| *f).collect();
    let to: Vec<&str> = holes.iter().map(|(_, t)| *t).collect();
    outbox
        .sql
        .execute(
            "INSERT INTO outbox_position AS p (slot_name, system_identifier, timeline, database_oid, confirmed_lsn,
                                               snapshot, snapshot_lsn, snapshot_at, hole_from, hole_to)
             SELECT $1::text, (SELECT system_identifier::text FROM pg_control_system()),
                    (SELECT timeline_id FROM pg_control_checkpoint()),
                    (SELECT oid FROM pg_database WHERE datname = current_database()),
                    coalesce((SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name::text = $1::text), pg_current_wal_lsn()),
                    $2::text::pg_snapshot, pg_current_wal_insert_lsn(), now(),
                    $3::text[]::pg_snapshot[], $4::text[]::pg_snapshot[]
             ON CONFLICT (slot_name) DO UPDATE SET snapshot = excluded.snapshot, snapshot_lsn = excluded.snapshot_lsn,
                    snapshot_at = excluded.snapshot_at, hole_from = excluded.hole_from, hole_to = excluded.hole_to",
            &[&outbox.slot, &vouched, &from, &to],
        )
        .await
        .unwrap();
}

/// Insert `n` rows in one transaction, created `age` ago (an interval), with
/// `state` and `attempts`; their ids.
async fn rows(outbox: &Outbox, n: i32, age: &str, state: &str, attempts: i32) -> Vec<String> {
    outbox
        .sql
        .query(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at, publish_state, attempts)
             SELECT 'order', 'o-' || g, 'E', jsonb_build_object('g', g), now() - $2::text::interval, $3, $4
             FROM generate_series(1, $1) g RETURNING id::text",
            &[&n, &age, &state, &attempts],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Run the binary with `args` and `config`; its exit success and stdout.
async fn relay_command(args: &[&str], config: &std::path::Path) -> (bool, String, String) {
    let mut all: Vec<&str> = args.to_vec();
    all.extend(["--config", config.to_str().unwrap()]);
    let mut process = RelayProcess::spawn(&all, &[]);
    let status = process
        .wait_exit_async(Duration::from_secs(30))
        .await
        .expect("the command exits");
    (
        status.success(),
        process.stdout_text(),
        process.stderr_text(),
    )
}

fn set(ids: &[&[String]]) -> HashSet<String> {
    ids.iter().flat_map(|s| s.iter().cloned()).collect()
}

/// One table in a known derived state, read by every reader:
///
/// * `before` rows, committed before the slot's boundary (the first hole):
///   the poller's, never derived published;
/// * `vouched` rows (two transactions around a snapshot M), visible in the
///   vouched S: published, so neither polled, counted PENDING, nor selected
///   by `--state PENDING`, and removed by retention once old;
/// * `failed` rows, FAILED explicitly though their ids are visible in S:
///   explicit wins, they are retried; a `dead` row stays DEAD;
/// * `after` rows, written after S (not vouched yet): polled;
/// * `old` rows without an id (from before the migration): explicit PENDING, polled;
/// * then a hole opened from M to S makes the later vouched transaction's rows the poller's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_reader_reads_a_row_as_the_vouched_snapshot_and_the_holes_say() {
    let outbox = Outbox::new().await;
    let before = rows(&outbox, 3, "3 days", "PENDING", 0).await;
    let boundary = snapshot(&outbox).await;
    // A transaction left open while S is taken (S's xmin stays below every
    // row after it): not a reason to keep the rows S vouches for.
    let open = outbox.db.client().await;
    open.batch_execute("BEGIN; SELECT pg_current_xact_id();")
        .await
        .unwrap();
    let vouched_old = rows(&outbox, 4, "4 days", "PENDING", 0).await;
    let m = snapshot(&outbox).await;
    let vouched_new = rows(&outbox, 2, "1 hour", "PENDING", 0).await;
    let failed = rows(&outbox, 2, "1 hour", "FAILED", 1).await;
    let dead = rows(&outbox, 1, "3 days", "DEAD", 5).await;
    let long_published: Vec<String> = outbox
        .sql
        .query(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, publish_state, published_at)
             VALUES ('order', 'p', 'E', '{}', 'PUBLISHED', now() - interval '3 days') RETURNING id::text",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let s = snapshot(&outbox).await;
    let after = rows(&outbox, 3, "1 hour", "PENDING", 0).await;
    // A row from before the migration: no id (as ADD COLUMN leaves old rows).
    let old: Vec<String> = outbox
        .sql
        .query(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at, relay_txid)
             VALUES ('order', 'n', 'E', '{}', now() - interval '1 hour', NULL) RETURNING id::text",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    position(&outbox, &s, &[("1:1:", &boundary)]).await;
    open.batch_execute("COMMIT").await.unwrap();
    let pending_ids = set(&[&before, &after, &old]);
    let vouched = set(&[&vouched_old, &vouched_new]);

    // status: PENDING counts the rows not derived published; the oldest
    // pending row is 3 days old (a `before` row), not the 4-day-old row the
    // snapshot vouched for.
    let config = outbox.config_file(POLLER_ONLY);
    let (_, out, err) = relay_command(&["status", "--json"], &config).await;
    let report: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out} {err}"));
    assert_eq!(report["rows"]["PENDING"], pending_ids.len(), "{report:#}");
    assert_eq!(report["rows"]["FAILED"], 2, "{report:#}");
    assert_eq!(report["rows"]["DEAD"], 1, "{report:#}");
    let oldest = report["oldest_pending_seconds"].as_f64().unwrap();
    assert!(
        (3.0 * 86400.0 - 60.0..3.0 * 86400.0 + 60.0).contains(&oldest),
        "{oldest}"
    );

    // replay --state reads the same states.
    for (state, n) in [
        ("PENDING", pending_ids.len()),
        ("PUBLISHED", vouched.len() + 1),
        ("FAILED", 2),
        ("DEAD", 1),
    ] {
        let (ok, out, err) =
            relay_command(&["replay", "--state", state, "--dry-run"], &config).await;
        assert!(ok, "{err}");
        assert!(
            out.starts_with(&format!("{n} rows would be replayed")),
            "--state {state}: {out}"
        );
    }

    // purge: the vouched rows older than two days go (they carry no
    // published_at: their created_at counts), with the explicit PUBLISHED
    // row; the old rows still pending (in the boundary hole) and the DEAD
    // row stay.
    let (ok, _, err) = relay_command(&["purge", "--older-than", "2d"], &config).await;
    assert!(ok, "{err}");
    assert!(
        err.contains(&format!(
            "deleted {} published rows",
            vouched_old.len() + long_published.len()
        )),
        "{err}"
    );
    assert!(outbox.explicit_states(&vouched_old).await.is_empty());
    assert!(outbox.explicit_states(&long_published).await.is_empty());
    assert_eq!(outbox.explicit_states(&before).await, ["PENDING"; 3]);
    assert_eq!(outbox.explicit_states(&dead).await, ["DEAD"]);

    // The metrics count as `status` does (the monitor's first look).
    let sink = Collect::default();
    let relay = Running::start(
        outbox.config("[stream]\nenabled = false\n[poller]\nenabled = false\n"),
        sink.clone(),
    );
    wait_until(
        Duration::from_secs(20),
        "the monitor counts rows",
        || async {
            outbox_relay::metrics()
                .encode()
                .contains("outbox_relay_rows{state=\"PENDING\"}")
        },
    )
    .await;
    assert_eq!(
        metric("outbox_relay_rows{state=\"PENDING\"}"),
        pending_ids.len() as f64
    );
    assert_eq!(metric("outbox_relay_rows{state=\"FAILED\"}"), 2.0);
    assert_eq!(metric("outbox_relay_rows{state=\"DEAD\"}"), 1.0);
    relay.stop().await;

    // The poller publishes what is pending and retries FAILED rows (explicit
    // wins over the snapshot); nothing the snapshot vouched for.
    let relay = Running::start(outbox.config(POLLER_ONLY), sink.clone());
    let expected = set(&[&before, &after, &old, &failed]);
    wait_until(
        Duration::from_secs(30),
        "the poller publishes the pending and failed rows",
        || async { sink.ids().into_iter().collect::<HashSet<_>>() == expected },
    )
    .await;
    let published = set(&[&before, &after, &old, &failed]);
    let published: Vec<String> = published.into_iter().collect();
    wait_until(Duration::from_secs(10), "marked explicitly", || async {
        outbox.explicit_states(&published).await == vec!["PUBLISHED"; published.len()]
    })
    .await;
    // Ten more rounds: still nothing vouched, each row once.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ids = sink.ids();
    assert_eq!(ids.len(), expected.len(), "each row once: {ids:?}");
    assert!(ids.iter().all(|id| !vouched.contains(id)));
    assert_eq!(outbox.explicit_states(&vouched_new).await, ["PENDING"; 2]);
    assert_eq!(outbox.explicit_states(&dead).await, ["DEAD"]);

    // A hole opened from M to S: the later vouched transaction is in it now,
    // so its rows are the poller's.
    position(&outbox, &s, &[("1:1:", &boundary), (&m, &s)]).await;
    wait_until(
        Duration::from_secs(20),
        "the poller publishes the rows of the new hole",
        || async {
            let ids: HashSet<String> = sink.ids().into_iter().collect();
            vouched_new.iter().all(|id| ids.contains(id))
        },
    )
    .await;
    relay.stop().await;
    assert_eq!(sink.ids().len(), expected.len() + vouched_new.len());
    assert_eq!(outbox.explicit_states(&vouched_new).await, ["PUBLISHED"; 2]);
    let (_, out, _) = relay_command(&["status", "--json"], &config).await;
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["rows"]["PENDING"], 0, "{report:#}");
    assert_eq!(report["oldest_pending_seconds"], serde_json::Value::Null);
}

/// With the stream running, a row after the vouched snapshot is the
/// poller's only once the stream has passed it (its transaction visible in
/// a passed sample's snapshot) and its grace is over; a row the snapshot
/// vouches for never is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_poller_takes_a_row_after_the_snapshot_only_once_the_stream_passed_it() {
    let outbox = Outbox::new().await;
    // The test sets rows back to PENDING to stand for rows the stream
    // published and left so; an operator's requeue (the trigger clearing
    // their ids) is another case (derived::a_row_set_to_pending_by_hand_is_sent_again).
    outbox
        .sql
        .batch_execute("ALTER TABLE outbox DISABLE TRIGGER outbox_requeue")
        .await
        .unwrap();
    let boundary = snapshot(&outbox).await;
    position(&outbox, &boundary, &[("1:1:", &boundary)]).await;
    let sink = Collect::holding(|m| m.event.event_type() == "Held");
    let relay = Running::start(
        outbox.config(
            "[poller]\ninterval = \"200ms\"\ngrace = \"1s\"\nbackoff_initial = \"100ms\"\nbackoff_max = \"200ms\"\n",
        ),
        sink.clone(),
    );
    outbox.wait_slot_active(true).await;
    // Two transactions: two ids.
    let mut held = outbox.insert_tx(&[("a".into(), "Held".into())]).await;
    held.extend(outbox.insert_tx(&[("b".into(), "Held".into())]).await);
    wait_until(
        Duration::from_secs(15),
        "the stream hands the held events to the sink",
        || async { !sink.waiting.lock().unwrap().is_empty() },
    )
    .await;
    // Twenty rounds past their grace: after the vouched snapshot, so not
    // derived published, but the stream has not passed them.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(sink.waiting.lock().unwrap().clone(), held[..1]);
    assert_eq!(outbox.explicit_states(&held).await, ["PENDING"; 2]);

    sink.release();
    // The keeper vouches for both (the poller, whose grace is short, may
    // have published them first).
    wait_until(
        Duration::from_secs(15),
        "a pair vouches for both rows",
        || async {
            outbox.view_states(&held).await == ["PUBLISHED"; 2]
                && outbox
                    .sql
                    .query_one(
                        "SELECT bool_and(pg_visible_in_snapshot(o.relay_txid, p.snapshot)) \
                         FROM outbox o, outbox_position p \
                         WHERE p.slot_name = $1 AND o.id::text = ANY($2)",
                        &[&outbox.slot, &held],
                    )
                    .await
                    .unwrap()
                    .get::<_, Option<bool>>(0)
                    == Some(true)
        },
    )
    .await;
    // Both marked, and the position stood back to the boundary: no pair
    // vouches for a row set PENDING again, as before the keeper's next
    // store (with nothing left to vouch for, it stores none). A poller
    // round that took them before the pair finishes meanwhile.
    outbox
        .sql
        .execute(
            "UPDATE outbox SET publish_state = 'PUBLISHED' WHERE id::text = ANY($1)",
            &[&held],
        )
        .await
        .unwrap();
    position(&outbox, &boundary, &[("1:1:", &boundary)]).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let delivered = |id: &String| sink.ids().iter().filter(|d| *d == id).count();
    let before = (delivered(&held[0]), delivered(&held[1]));
    // Each arrived; the short grace may have let the poller send one again.
    assert!(
        before.0 >= 1 && before.1 >= 1 && before.0 + before.1 <= 4,
        "{before:?}"
    );
    // Left PENDING, as the derived lifecycle leaves the rows the stream
    // published, and pairs stored since that still do not vouch for it (the
    // position kept standing back to the boundary, stored again and again):
    // once past its grace, the stream having passed it, the poller publishes
    // it. (While no pair is stored after the poller's sample, the row is
    // left to the keeper for a grace:
    // derived::rows_the_keeper_cannot_vouch_for_wait_for_it_a_grace_then_the_poller_takes_them.)
    let reset = |id: String| {
        let sql = &outbox.sql;
        async move {
            sql.execute(
                "UPDATE outbox SET publish_state = 'PENDING', published_at = NULL WHERE id::text = $1",
                &[&id],
            )
            .await
            .unwrap();
        }
    };
    reset(held[0].clone()).await;
    wait_until(
        Duration::from_secs(20),
        "the poller publishes the row the stream passed and marks it",
        || async {
            position(&outbox, &boundary, &[("1:1:", &boundary)]).await;
            delivered(&held[0]) > before.0
                && outbox.explicit_states(&held[..1]).await == ["PUBLISHED"]
        },
    )
    .await;
    // A snapshot vouches for both: the second, left PENDING, is published.
    let s = snapshot(&outbox).await;
    position(&outbox, &s, &[("1:1:", &boundary)]).await;
    reset(held[1].clone()).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        delivered(&held[1]),
        before.1,
        "the row the snapshot vouched for is not published again"
    );
    assert_eq!(outbox.explicit_states(&held[1..]).await, ["PENDING"]);
    relay.stop().await;
}

/// The plans (`auto_explain`, read back from the server's log) of what the
/// relay's role ran while `run` ran: each entry one statement's text and
/// plan.
async fn plans_of<F: std::future::Future<Output = ()>>(outbox: &Outbox, run: F) -> Vec<String> {
    let sql = &outbox.sql;
    sql.batch_execute(&format!(
        "LOAD 'auto_explain';
         ALTER ROLE {role} IN DATABASE {db} SET session_preload_libraries = 'auto_explain';
         ALTER ROLE {role} IN DATABASE {db} SET auto_explain.log_min_duration = 0;",
        role = outbox.role,
        db = outbox.db.name(),
    ))
    .await
    .unwrap();
    // The cluster's log (scripts/pg-cluster.sh: `-l <dir>/server.log`, data in `<dir>/data`).
    let log: String = sql
        .query_one(
            "SELECT regexp_replace(current_setting('data_directory'), '/data/?$', '') || '/server.log'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let size = |log: String| async move {
        sql.query_one("SELECT (pg_stat_file($1)).size", &[&log])
            .await
            .unwrap_or_else(|e| panic!("the server log {log}: {e}"))
            .get::<_, i64>(0)
    };
    let start = size(log.clone()).await;
    run.await;
    let end = size(log.clone()).await;
    let text: String = sql
        .query_one(
            "SELECT convert_from(pg_read_binary_file($1, $2, $3), 'UTF8')",
            &[&log, &start, &(end - start)],
        )
        .await
        .unwrap()
        .get(0);
    sql.batch_execute(&format!(
        "ALTER ROLE {role} IN DATABASE {db} RESET ALL",
        role = outbox.role,
        db = outbox.db.name()
    ))
    .await
    .unwrap();
    let mut entries: Vec<String> = Vec::new();
    for line in text.lines() {
        match entries.last_mut() {
            Some(entry) if line.starts_with('\t') || line.starts_with(' ') => {
                entry.push('\n');
                entry.push_str(line);
            }
            _ => entries.push(line.to_owned()),
        }
    }
    entries
        .into_iter()
        .filter(|e| e.contains("plan:") && e.contains("Query Text:"))
        .collect()
}

/// On a table of 100,000 rows the vouched snapshot covers, the poller's
/// claims and retention's deletes find their rows through
/// `outbox_txid_idx` and `outbox_explicit_idx`, never by a scan of the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_poller_and_retention_read_a_derived_table_through_its_indexes() {
    let outbox = Outbox::new().await;
    let boundary = snapshot(&outbox).await;
    for _ in 0..20 {
        rows(&outbox, 5000, "3 days", "PENDING", 0).await;
    }
    let s = snapshot(&outbox).await;
    let due = rows(&outbox, 5, "1 hour", "PENDING", 0).await;
    position(&outbox, &s, &[("1:1:", &boundary)]).await;
    outbox.sql.batch_execute("ANALYZE outbox").await.unwrap();
    let sink = Collect::default();
    let plans = plans_of(&outbox, async {
        let relay = Running::start(outbox.config(POLLER_ONLY), sink.clone());
        wait_until(
            Duration::from_secs(30),
            "the poller publishes the rows after the snapshot",
            || async { outbox.explicit_states(&due).await == ["PUBLISHED"; 5] },
        )
        .await;
        relay.stop().await;
        let (ok, _, err) =
            relay_command(&["purge", "--older-than", "2d"], &outbox.config_file("")).await;
        assert!(ok, "{err}");
        assert!(err.contains("deleted 100000 published rows"), "{err}");
    })
    .await;
    assert_eq!(sink.ids().len(), 5, "only the rows after the snapshot");
    let claims: Vec<&String> = plans
        .iter()
        .filter(|p| p.contains("FOR UPDATE SKIP LOCKED"))
        .collect();
    let deletes: Vec<&String> = plans
        .iter()
        .filter(|p| p.contains("DELETE FROM") && p.contains("relay_txid"))
        .collect();
    assert!(!claims.is_empty() && !deletes.is_empty(), "{plans:#?}");
    for plan in claims.iter().chain(&deletes) {
        let whole_table = plan
            .lines()
            .any(|l| l.contains("Seq Scan on outbox ") || l.contains("Seq Scan on outbox o"));
        assert!(!whole_table, "a scan of the table:\n{plan}");
    }
    let uses = |plans: &[&String], index: &str| plans.iter().any(|p| p.contains(index));
    assert!(uses(&claims, "using outbox_txid_idx"), "{claims:#?}");
    assert!(uses(&claims, "using outbox_explicit_idx"), "{claims:#?}");
    assert!(uses(&deletes, "using outbox_txid_idx"), "{deletes:#?}");
    // For the record: a claim after the snapshot, and a delete.
    for plan in [
        claims
            .iter()
            .find(|p| p.contains("COALESCE(pg_snapshot_xmin")),
        deletes.first(),
    ]
    .into_iter()
    .flatten()
    {
        eprintln!("{plan}");
    }
}
