//! The table lifecycle: marking, the fallback poller, slot loss, replay,
//! retention, exclusion, partitions, Debezium-style tables.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use harness::{wait_until, RelayProcess};
use outbox_relay::{Message, Outcome, Sink};

use crate::outbox::{envelope_ids, metric, Collect, Outbox, Running};

/// A quick poller for tests.
const FAST_POLLER: &str = "[poller]\ninterval = \"200ms\"\ngrace = \"1s\"\nbackoff_initial = \"100ms\"\nbackoff_max = \"200ms\"\n";

/// The lifecycle that writes each published row (`derive`, the default,
/// writes none: tests/e2e/derived.rs): for the tests that read the marks.
const MARK: &str = "[lifecycle]\non_published = \"mark\"\n";

async fn states(outbox: &Outbox) -> HashMap<String, (String, i32)> {
    outbox
        .sql
        .query("SELECT id::text, publish_state, attempts FROM outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2))))
        .collect()
}

/// Run `outbox-relay purge --older-than AGE` with `config`; it must succeed. Its stderr.
async fn purge(config: &std::path::Path, age: &str) -> String {
    let mut purge = RelayProcess::spawn(
        &[
            "purge",
            "--older-than",
            age,
            "--config",
            config.to_str().unwrap(),
        ],
        &[],
    );
    let status = purge
        .wait_exit_async(Duration::from_secs(30))
        .await
        .unwrap();
    assert!(status.success(), "{}", purge.stderr_text());
    purge.stderr_text()
}

async fn count_in_state(outbox: &Outbox, state: &str) -> i64 {
    outbox
        .sql
        .query_one(
            "SELECT count(*) FROM outbox WHERE publish_state = $1",
            &[&state],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_rows_are_marked_and_excluded_ones_skipped() {
    let outbox = Outbox::new().await;
    let sink = Collect::default();
    let relay = Running::start(
        outbox.config(&format!(
            "{MARK}[filter]\nexclude_event_types = [\"Internal\"]"
        )),
        sink.clone(),
    );
    outbox.wait_slot_active(true).await;
    outbox
        .insert_tx(&[
            ("a".into(), "Public".into()),
            ("a".into(), "Internal".into()),
            ("b".into(), "Public".into()),
        ])
        .await;
    wait_until(Duration::from_secs(10), "rows are marked", || async {
        count_in_state(&outbox, "PUBLISHED").await == 2
            && count_in_state(&outbox, "SKIPPED").await == 1
    })
    .await;
    assert_eq!(sink.ids().len(), 2, "the excluded event was not published");
    let last = outbox.commits().await.last().unwrap().end_lsn;
    wait_until(
        Duration::from_secs(10),
        "the slot moves past the excluded event",
        || async { outbox.confirmed_flush().await >= last },
    )
    .await;
    let published_at_set: bool = outbox
        .sql
        .query_one("SELECT bool_and(published_at IS NOT NULL) FROM outbox WHERE publish_state = 'PUBLISHED'", &[])
        .await
        .unwrap()
        .get(0);
    assert!(published_at_set);
    let summary = relay.stop().await;
    assert_eq!((summary.delivered, summary.skipped), (2, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_mode_removes_published_rows() {
    let outbox = Outbox::new().await;
    let sink = Collect::default();
    let relay = Running::start(
        outbox.config("[lifecycle]\non_published = \"delete\""),
        sink.clone(),
    );
    outbox.wait_slot_active(true).await;
    outbox.insert_many(5, 4, 3).await;
    wait_until(
        Duration::from_secs(10),
        "published rows are deleted",
        || async { sink.ids().len() == 20 && states(&outbox).await.is_empty() },
    )
    .await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_slot_is_recreated_and_the_poller_publishes_what_it_missed() {
    let outbox = Outbox::new().await;
    // The relay is down and its slot is dropped; the application keeps writing.
    outbox.drop_slot().await;
    let expected = outbox.insert_many(100, 10, 25).await;
    assert_eq!(expected.len(), 1_000);

    let sink = Collect::default();
    let relay = Running::start(
        // The grace period is long: only the sweep after the recreation can find these rows.
        outbox.config("[lifecycle]\non_published = \"mark\"\nrecreate_slot = true\n[poller]\ninterval = \"200ms\"\ngrace = \"10m\"\nbatch_size = 200\n"),
        sink.clone(),
    );
    outbox.wait_slot_active(true).await;
    // Written after the slot came back: the stream has these.
    let after = outbox.insert_many(10, 5, 5).await;
    wait_until(
        Duration::from_secs(60),
        "every event is published",
        || async {
            let got: HashSet<String> = sink.ids().into_iter().collect();
            expected.iter().chain(&after).all(|id| got.contains(id))
        },
    )
    .await;
    wait_until(Duration::from_secs(10), "every row is marked", || async {
        count_in_state(&outbox, "PUBLISHED").await == 1_050
    })
    .await;
    relay.stop().await;
}

/// Rejects `Flaky` events the first 3 times, `Doomed` ones always.
#[derive(Clone, Default)]
struct Picky {
    inner: Collect,
    tries: Arc<Mutex<HashMap<String, u32>>>,
}

impl Sink for Picky {
    fn name(&self) -> &'static str {
        "picky"
    }
    fn max_batch(&self) -> usize {
        10
    }
    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        let mut out = Vec::new();
        for m in batch {
            let id = m.event.id().to_string();
            let tries = {
                let mut t = self.tries.lock().unwrap();
                let n = t.entry(id).or_insert(0);
                *n += 1;
                *n
            };
            let outcome = match m.event.event_type() {
                "Flaky" if tries <= 3 => Outcome::Rejected(format!("injected failure {tries}")),
                "Doomed" => Outcome::Rejected("injected: never".into()),
                _ => Outcome::Delivered,
            };
            if outcome == Outcome::Delivered {
                self.inner.publish(std::slice::from_ref(m)).await;
            }
            out.push(outcome);
        }
        out
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_failing_three_times_ends_published_and_one_failing_always_ends_dead() {
    let outbox = Outbox::new().await;
    let sink = Picky::default();
    let relay = Running::start(
        outbox.config(&format!("{MARK}{FAST_POLLER}max_attempts = 5\n")),
        sink.clone(),
    );
    outbox.wait_slot_active(true).await;
    let ids = outbox
        .insert_tx(&[
            ("a".into(), "Flaky".into()),
            ("b".into(), "Doomed".into()),
            ("c".into(), "Fine".into()),
        ])
        .await;
    wait_until(
        Duration::from_secs(30),
        "the flaky row is published and the doomed one is dead",
        || async {
            let s = states(&outbox).await;
            s[&ids[0]].0 == "PUBLISHED" && s[&ids[1]].0 == "DEAD"
        },
    )
    .await;
    let s = states(&outbox).await;
    assert_eq!(
        s[&ids[0]],
        ("PUBLISHED".to_owned(), 3),
        "published after 3 failures"
    );
    assert_eq!(
        s[&ids[1]],
        ("DEAD".to_owned(), 5),
        "dead after max_attempts, still in the table"
    );
    assert_eq!(s[&ids[2]], ("PUBLISHED".to_owned(), 0));
    let last_error: String = outbox
        .sql
        .query_one(
            "SELECT last_error FROM outbox WHERE id = $1::text::uuid",
            &[&ids[1]],
        )
        .await
        .unwrap()
        .get(0);
    assert!(last_error.contains("injected: never"));
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_poller_leaves_rows_the_stream_has_not_reached_and_takes_up_rows_it_passed_unmarked() {
    let outbox = Outbox::new().await;
    // The sink holds these: the slot stays active and stands still before them.
    let sink = Collect::holding(|m| m.event.event_type() == "Held");
    let relay = Running::start(outbox.config(&format!("{MARK}{FAST_POLLER}")), sink.clone());
    outbox.wait_slot_active(true).await;
    let held = outbox
        .insert_tx(&[("a".into(), "Held".into()), ("b".into(), "Held".into())])
        .await;
    wait_until(
        Duration::from_secs(15),
        "the stream hands the held events to the sink",
        || async { !sink.waiting.lock().unwrap().is_empty() },
    )
    .await;
    // Four grace periods, twenty poller rounds: the rows are PENDING and past
    // their grace, but the stream has not passed them, so they are its own.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let waiting = sink.waiting.lock().unwrap().clone();
    // (A batch waits at its first held message.)
    assert_eq!(
        waiting,
        held[..1],
        "only the stream took the held rows; the poller left them"
    );
    assert_eq!(count_in_state(&outbox, "PENDING").await, 2);

    sink.release();
    wait_until(
        Duration::from_secs(15),
        "both rows published and marked",
        || async { count_in_state(&outbox, "PUBLISHED").await == 2 },
    )
    .await;
    let delivered = |id: &String| sink.ids().iter().filter(|d| *d == id).count();
    assert!(held.iter().all(|id| delivered(id) >= 1));

    // A crash between publish and marking leaves a row the stream passed
    // PENDING: once past its grace, that one is the poller's to publish again.
    let before = delivered(&held[0]);
    outbox
        .sql
        .execute(
            "UPDATE outbox SET publish_state = 'PENDING', published_at = NULL WHERE id::text = $1",
            &[&held[0]],
        )
        .await
        .unwrap();
    wait_until(
        Duration::from_secs(20),
        "the poller publishes the unmarked row again and marks it",
        || async {
            delivered(&held[0]) > before && count_in_state(&outbox, "PUBLISHED").await == 2
        },
    )
    .await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_polling_one_table_publish_each_due_row_once() {
    let outbox = Outbox::new().await;
    // Rows the stream never saw (e.g. written while the slot was gone), well past the grace period.
    outbox
        .sql
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at)
             SELECT 'order', 'agg-' || (g % 17), 'E', jsonb_build_object('g', g), now() - interval '1 hour' + g * interval '1 ms'
             FROM generate_series(1, 600) g",
        )
        .await
        .unwrap();
    // Poller-only instances (the stream is switched off on both).
    let config = || {
        outbox.config(&format!(
            "[stream]\nenabled = false\n{FAST_POLLER}batch_size = 50\n"
        ))
    };
    let (a, b) = (Collect::default(), Collect::default());
    let relay_a = Running::start(config(), a.clone());
    let relay_b = Running::start(config(), b.clone());
    wait_until(
        Duration::from_secs(60),
        "every due row is published and marked",
        || async { count_in_state(&outbox, "PUBLISHED").await == 600 },
    )
    .await;
    relay_a.stop().await;
    relay_b.stop().await;
    let (a, b) = (a.ids(), b.ids());
    let (sa, sb): (HashSet<&String>, HashSet<&String>) = (a.iter().collect(), b.iter().collect());
    assert_eq!(sa.len() + sb.len(), 600, "no row claimed twice");
    assert_eq!(a.len() + b.len(), 600, "no row published twice");
    assert!(sa.is_disjoint(&sb));
    eprintln!("relay A published {}, relay B {}", a.len(), b.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_by_time_range_redelivers_exactly_the_selected_rows_and_dry_run_publishes_nothing() {
    let outbox = Outbox::new().await;
    let rows = outbox
        .sql
        .query(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at, publish_state, published_at)
             SELECT 'order', 'o-' || g, 'E', '{}', timestamptz '2026-01-01 00:00:00+00' + g * interval '1 hour', 'PUBLISHED', now()
             FROM generate_series(0, 9) g RETURNING id::text, created_at",
            &[],
        )
        .await
        .unwrap();
    // Hours 3, 4 and 5 are in range.
    let selected: HashSet<String> = rows.iter().skip(3).take(3).map(|r| r.get(0)).collect();
    let config = outbox.config_file("");
    let range = [
        "--from",
        "2026-01-01T03:00:00Z",
        "--to",
        "2026-01-01T06:00:00Z",
    ];
    let replay = |extra: &[&str]| {
        let mut args = vec!["replay", "--config", config.to_str().unwrap()];
        args.extend(range);
        args.extend(extra);
        RelayProcess::spawn(&args, &[])
    };
    let mut dry = replay(&["--dry-run"]);
    assert!(dry
        .wait_exit_async(Duration::from_secs(20))
        .await
        .unwrap()
        .success());
    let out = dry.stdout_text();
    assert!(out.starts_with("3 rows would be replayed"), "{out}");
    assert!(
        envelope_ids(&dry.stdout_lines()).is_empty(),
        "dry run published nothing"
    );

    let mut run = replay(&["--rate", "100"]);
    let status = run.wait_exit_async(Duration::from_secs(30)).await.unwrap();
    assert!(status.success(), "{}", run.stderr_text());
    let got: Vec<String> = envelope_ids(&run.stdout_lines());
    assert_eq!(got.len(), 3, "exactly the selected rows, once each");
    assert_eq!(got.into_iter().collect::<HashSet<_>>(), selected);
    assert!(run.stderr_text().contains("replayed 3 of 3 selected rows"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_removes_only_old_published_rows_in_bounded_batches_under_concurrent_inserts() {
    let outbox = Outbox::new().await;
    outbox
        .sql
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, publish_state, published_at)
               SELECT 'o', 'a', 'E', '{}', 'PUBLISHED', now() - interval '2 days' FROM generate_series(1, 2500);
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, publish_state, published_at)
               SELECT 'o', 'a', 'E', '{}', 'PUBLISHED', now() - interval '1 hour' FROM generate_series(1, 40);
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, publish_state, created_at)
               SELECT 'o', 'a', 'E', '{}', s, now() - interval '30 days'
               FROM unnest(ARRAY['PENDING', 'FAILED', 'DEAD']) s, generate_series(1, 10);",
        )
        .await
        .unwrap();
    // The application keeps inserting meanwhile.
    let url = outbox.db.url().to_owned();
    let producer = tokio::spawn(async move {
        let client = harness::connect(&url).await;
        for _ in 0..50 {
            client
                .execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('o', 'b', 'E', '{}')", &[])
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    let stderr = purge(
        &outbox.config_file("[retention]\nbatch_size = 1000\n"),
        "1d",
    )
    .await;
    producer.await.unwrap();
    assert!(
        stderr.contains("deleted 2500 published rows in 3 batches"),
        "{stderr}"
    );
    for (state, n) in [("PUBLISHED", 40), ("FAILED", 10), ("DEAD", 10)] {
        assert_eq!(count_in_state(&outbox, state).await, n, "{state}");
    }
    assert_eq!(
        count_in_state(&outbox, "PENDING").await,
        60,
        "old PENDING rows and the concurrent inserts stay"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_outbox_streams_like_a_plain_one_and_retention_drops_an_expired_partition() {
    let outbox = Outbox::with_schema(Some(
        "CREATE TABLE outbox (id uuid NOT NULL DEFAULT gen_random_uuid(), aggregate_type text NOT NULL,
            aggregate_id text NOT NULL, event_type text NOT NULL, payload jsonb NOT NULL, headers jsonb, topic text,
            created_at timestamptz NOT NULL DEFAULT now(),
            publish_state text NOT NULL DEFAULT 'PENDING', attempts integer NOT NULL DEFAULT 0, last_error text,
            next_attempt_at timestamptz, published_at timestamptz, PRIMARY KEY (id, created_at))
         PARTITION BY RANGE (created_at);
         CREATE TABLE outbox_2020 PARTITION OF outbox FOR VALUES FROM ('2020-01-01') TO ('2021-01-01');
         CREATE TABLE outbox_default PARTITION OF outbox DEFAULT;",
    ))
    .await;
    let (sink, relay) = outbox.streaming(MARK).await;
    outbox
        .sql
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at)
               SELECT 'o', 'old-' || g, 'E', '{}', timestamptz '2020-06-01' + g * interval '1 s' FROM generate_series(1, 5) g;",
        )
        .await
        .unwrap();
    let current = outbox.insert_many(3, 2, 2).await;
    wait_until(
        Duration::from_secs(10),
        "all 11 events are published and marked",
        || async { sink.ids().len() == 11 && count_in_state(&outbox, "PUBLISHED").await == 11 },
    )
    .await;
    assert!(current.iter().all(|id| sink.ids().contains(id)));
    relay.stop().await;

    // The old partition's rows were published long ago; one current row is still pending.
    outbox
        .sql
        .batch_execute(
            "UPDATE outbox SET published_at = now() - interval '30 days' WHERE created_at < '2021-01-01';
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('o', 'x', 'E', '{}');",
        )
        .await
        .unwrap();
    // The least-privilege role may not drop partitions: it says so and deletes the rows.
    let stderr = purge(
        &outbox.config_file("[retention]\ndrop_partitions = true\n"),
        "7d",
    )
    .await;
    assert!(
        stderr.contains("must be owner of table")
            && stderr.contains("needs the table's owner")
            && stderr.contains("deleted 5 published rows")
            && stderr.contains("dropped 0 partitions"),
        "{stderr}"
    );
    // The owner may.
    let stderr = purge(
        &outbox.owner_config_file("[retention]\ndrop_partitions = true\n"),
        "7d",
    )
    .await;
    assert!(stderr.contains("dropped 1 partitions"), "{stderr}");
    let partitions: Vec<String> = outbox
        .sql
        .query("SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'outbox'::regclass", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(partitions, vec!["outbox_default".to_owned()]);
    assert_eq!(count_in_state(&outbox, "PENDING").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_debezium_style_table_streams_through_column_mapping_alone() {
    let outbox = Outbox::with_schema(Some(
        "CREATE TABLE outbox (id uuid PRIMARY KEY DEFAULT gen_random_uuid(), aggregatetype varchar(255) NOT NULL,
            aggregateid varchar(255) NOT NULL, type varchar(255) NOT NULL, payload jsonb)",
    ))
    .await;
    let sink = Collect::default();
    let relay = Running::start(
        outbox.config(
            "[columns]\naggregate_type = \"aggregatetype\"\naggregate_id = \"aggregateid\"\nevent_type = \"type\"\n\
             headers = \"\"\ntopic = \"\"\ncreated_at = \"\"\n[lifecycle]\non_published = \"none\"",
        ),
        sink.clone(),
    );
    outbox.wait_slot_active(true).await;
    outbox
        .sql
        .batch_execute(
            "INSERT INTO outbox (aggregatetype, aggregateid, type, payload) VALUES ('Order', '42', 'OrderCreated', '{\"total\": 1}');",
        )
        .await
        .unwrap();
    wait_until(
        Duration::from_secs(10),
        "the event is published",
        || async { sink.ids().len() == 1 },
    )
    .await;
    let message = sink.delivered.lock().unwrap()[0].clone();
    let envelope: serde_json::Value = serde_json::from_slice(&message.body).unwrap();
    assert_eq!(envelope["type"], "OrderCreated");
    assert_eq!(envelope["subject"], "42");
    assert_eq!(envelope["aggregatetype"], "Order");
    assert_eq!(envelope["data"]["total"], 1);
    let rows: i64 = outbox
        .sql
        .query_one("SELECT count(*) FROM outbox", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 1, "the table is left alone");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn marking_that_cannot_keep_up_stops_the_stream_at_its_ceiling_and_every_row_ends_published()
{
    const CEILING: usize = 500;
    const IN_FLIGHT: usize = 100;
    let outbox = Outbox::new().await;
    let ids = outbox.insert_many(30, 100, 50).await;
    // Marking waits behind this lock; reading the stream does not.
    let mut blocker = outbox.db.client().await;
    let lock = blocker.transaction().await.unwrap();
    lock.batch_execute("LOCK TABLE outbox IN SHARE MODE")
        .await
        .unwrap();
    let sink = Collect::default();
    let relay = Running::start(
        outbox.config(&format!(
            "{MARK}max_unmarked = {CEILING}\n[stream]\nmax_in_flight = {IN_FLIGHT}\n[poller]\nenabled = false"
        )),
        sink.clone(),
    );
    wait_until(
        Duration::from_secs(20),
        "the ceiling of unmarked rows is reached",
        || async { sink.ids().len() >= CEILING },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // Events in flight when the ceiling was reached still finish; no more are read.
    let bound = CEILING + IN_FLIGHT;
    let delivered = sink.ids().len();
    assert!(
        delivered <= bound,
        "{delivered} delivered while marking was blocked, at most {bound}"
    );
    let unmarked = metric("outbox_relay_unmarked_rows");
    assert!(
        unmarked >= CEILING as f64 && unmarked <= bound as f64,
        "{unmarked} rows unmarked"
    );
    assert_eq!(count_in_state(&outbox, "PENDING").await, 3000);

    lock.rollback().await.unwrap();
    wait_until(
        Duration::from_secs(60),
        "every row ends PUBLISHED",
        || async { count_in_state(&outbox, "PUBLISHED").await == 3000 },
    )
    .await;
    let delivered: HashSet<String> = sink.ids().into_iter().collect();
    assert_eq!(delivered, ids.into_iter().collect::<HashSet<_>>());
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_rows_ends_with_every_row_published() {
    let outbox = Outbox::new().await;
    let sink = Collect::default();
    let relay = Running::start(
        outbox.config(&format!("{MARK}[poller]\nenabled = false")),
        sink.clone(),
    );
    outbox.wait_slot_active(true).await;
    // 60,000 rows in 12 transactions, as fast as the server takes them.
    for _ in 0..12 {
        outbox
            .sql
            .execute(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
                 SELECT 'order', 'o-' || (n % 100), 'Burst', jsonb_build_object('n', n) \
                 FROM generate_series(1, 5000) n",
                &[],
            )
            .await
            .unwrap();
    }
    wait_until(
        Duration::from_secs(120),
        "every row ends PUBLISHED",
        || async { count_in_state(&outbox, "PUBLISHED").await == 60_000 },
    )
    .await;
    assert_eq!(sink.ids().len(), 60_000);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_written_while_the_relay_was_stopped_longer_than_the_grace_are_sent_once() {
    let outbox = Outbox::new().await;
    let config = outbox.config_file(&format!("{MARK}{FAST_POLLER}"));
    let run = || RelayProcess::spawn(&["run", "--config", config.to_str().unwrap()], &[]);
    let mut first = run();
    outbox.wait_slot_active(true).await;
    let before = outbox.insert_many(3, 10, 3).await;
    wait_until(
        Duration::from_secs(30),
        "the first rows are marked",
        || async { count_in_state(&outbox, "PUBLISHED").await == 30 },
    )
    .await;
    first.stop_gracefully().await;
    // Written while no relay runs, and older than the grace when the next
    // starts: its stream sends them; its poller, which polls before the
    // stream is up, must not too.
    let during = outbox.insert_many(20, 25, 5).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut second = run();
    wait_until(Duration::from_secs(30), "every row is marked", || async {
        count_in_state(&outbox, "PUBLISHED").await == 530
    })
    .await;
    // Poller rounds past the grace of every row.
    tokio::time::sleep(Duration::from_secs(2)).await;
    second.stop_gracefully().await;
    let mut counts: HashMap<String, usize> = HashMap::new();
    for id in envelope_ids(&first.stdout_lines())
        .into_iter()
        .chain(envelope_ids(&second.stdout_lines()))
    {
        *counts.entry(id).or_default() += 1;
    }
    let repeated: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        repeated.is_empty(),
        "{} rows sent twice: {:?}\n{}",
        repeated.len(),
        &repeated[..repeated.len().min(5)],
        second.stderr_text()
    );
    assert!(before
        .iter()
        .chain(&during)
        .all(|id| counts.get(id) == Some(&1)));
}
