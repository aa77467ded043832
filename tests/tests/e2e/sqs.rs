//! The SQS sink, run as users run it (the binary, AWS settings from the
//! standard environment), against moto: a standard and a FIFO queue read back
//! with the SQS SDK.
//!
//! The helpers at the end (the relay's environment, reading a queue while
//! the relay publishes, the slot, the rows' states) serve `eventbridge.rs`
//! and `kinesis.rs` too.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use harness::aws_json;
use harness::proxy::{FaultProxy, Mode};
use harness::sns::{self, Received};
use harness::{wait_until, RelayProcess};

use crate::outbox::Outbox;
use crate::sns::{assert_per_aggregate_order, insert};

fn sqs_toml(queue_url: &str, extra: &str) -> String {
    format!(
        "[sink]\nkind = \"sqs\"\n[sqs]\nqueue_url = \"{queue_url}\"\n{extra}\n[retry]\nmax = \"1s\"\n"
    )
}

/// The event id of an SQS message the relay sent (its envelope's `id`).
fn envelope_id(r: &Received) -> String {
    envelopes([r.body.as_bytes()]).remove(0).0
}

/// `(id, aggregate)` of each message, in receive order; checks that each
/// carries the four fixed attributes.
fn messages(received: &[Received]) -> Vec<(String, String)> {
    let got = envelopes(received.iter().map(|r| r.body.as_bytes()));
    for (r, (id, aggregate)) in received.iter().zip(&got) {
        let attribute = |name: &str| r.attributes.get(name).map(String::as_str);
        assert_eq!(attribute("event_id"), Some(id.as_str()), "{r:?}");
        assert_eq!(attribute("aggregate_id"), Some(aggregate.as_str()), "{r:?}");
        assert_eq!(attribute("aggregate_type"), Some("order"), "{r:?}");
        assert!(attribute("event_type").is_some(), "{r:?}");
    }
    got
}

/// 2,000 events over 20 aggregates to a standard queue, the endpoint given
/// as `AWS_ENDPOINT_URL_SQS`: every one arrives with its attributes, each
/// aggregate's in commit order (moto keeps a standard queue's order; AWS
/// does not promise it); the slot then passes the last commit and every row
/// is PUBLISHED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_events_of_twenty_aggregates_reach_a_standard_queue_each_aggregate_in_commit_order(
) {
    let moto = sns::moto_endpoint().await;
    let outbox = Outbox::new().await;
    let queue_url = aws_json::create_queue(&moto, outbox.db.name()).await;
    let sqs = sns::sqs_client(&moto).await;
    let config = outbox.config_file(&sqs_toml(&queue_url, ""));
    let mut relay = spawn_relay(&config, Some(("AWS_ENDPOINT_URL_SQS", &moto)));
    outbox.wait_slot_active(true).await;
    let started = Instant::now();
    let reader = QueueReader::start(&sqs, &queue_url, 2_000, envelope_id);
    let expected = insert_paced(&outbox, 200, 10, 20, &reader).await;
    let received = reader.finish().await;
    eprintln!("received {} in {:?}", received.len(), started.elapsed());
    assert_all_arrived_in_order(&expected, &messages(&received), &relay);
    assert!(
        received.iter().all(|r| r.group_id.is_none()),
        "no MessageGroupId on a standard queue"
    );
    settled(&outbox, expected.len()).await;
    relay.stop_gracefully().await;
}

/// The same to a FIFO queue (`endpoint_url` in the file): MessageGroupId is
/// the aggregate id and MessageDeduplicationId the event id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_events_of_twenty_aggregates_reach_a_fifo_queue_grouped_by_aggregate_deduplicated_by_event_id(
) {
    let moto = sns::moto_endpoint().await;
    let outbox = Outbox::new().await;
    let queue_url = aws_json::create_queue(&moto, &format!("{}.fifo", outbox.db.name())).await;
    let sqs = sns::sqs_client(&moto).await;
    let config = outbox.config_file(&sqs_toml(
        &queue_url,
        &format!(
            "region = \"us-east-1\"\nendpoint_url = \"{}\"",
            moto.as_str()
        ),
    ));
    let mut relay = spawn_relay(&config, None);
    outbox.wait_slot_active(true).await;
    let started = Instant::now();
    let reader = QueueReader::start(&sqs, &queue_url, 2_000, envelope_id);
    let expected = insert_paced(&outbox, 200, 10, 20, &reader).await;
    let received = reader.finish().await;
    eprintln!("received {} in {:?}", received.len(), started.elapsed());
    let got = messages(&received);
    assert_all_arrived_in_order(&expected, &got, &relay);
    for (r, (id, aggregate)) in received.iter().zip(&got) {
        assert_eq!(
            r.group_id.as_deref(),
            Some(aggregate.as_str()),
            "MessageGroupId is the aggregate id"
        );
        assert_eq!(
            r.dedup_id.as_deref(),
            Some(id.as_str()),
            "MessageDeduplicationId is the event id"
        );
    }
    settled(&outbox, expected.len()).await;
    relay.stop_gracefully().await;
}

/// SQS cannot be reached (connections cut): nothing is confirmed past the
/// first undelivered commit and nothing is marked published; when it can be
/// reached again, everything arrives in order and the slot catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_endpoint_loses_nothing_and_the_slot_waits_for_it() {
    let moto = sns::moto_endpoint().await;
    let proxy = FaultProxy::start(&moto);
    let outbox = Outbox::new().await;
    let queue_url = aws_json::create_queue(&moto, &format!("{}.fifo", outbox.db.name())).await;
    let sqs = sns::sqs_client(&moto).await;
    let config = outbox.config_file(&sqs_toml(&queue_url, ""));
    let mut relay = spawn_relay(&config, Some(("AWS_ENDPOINT_URL_SQS", &proxy.endpoint())));
    outbox.wait_slot_active(true).await;

    let reader = QueueReader::start(&sqs, &queue_url, 50 + 100, envelope_id);
    let mut expected = insert(&outbox, 10, 5, 4).await;
    reader.wait_for(expected.len()).await;
    expected.extend(outage_holds_the_slot(&outbox, &proxy, || insert(&outbox, 20, 5, 4)).await);
    assert_eq!(
        reader.count(),
        50,
        "nothing reached the queue during the outage"
    );
    proxy.set_mode(Mode::Pass);
    let received = reader.finish().await;
    assert_all_arrived_in_order(&expected, &messages(&received), &relay);
    settled(&outbox, expected.len()).await;
    relay.stop_gracefully().await;
}

/// The connections to SQS freeze while calls are in flight (no FIN, no RST,
/// nothing moves; a NAT that dropped the flows): each such call ends at its
/// attempt timeout and goes again on a new connection; every event arrives,
/// each aggregate in commit order (a FIFO queue), and the slot passes the
/// last commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_frozen_in_the_network_are_given_up_and_every_event_arrives() {
    let moto = sns::moto_endpoint().await;
    let proxy = harness::FreezingProxy::start(moto.trim_start_matches("http://"));
    let outbox = Outbox::new().await;
    let queue_url = aws_json::create_queue(&moto, &format!("{}.fifo", outbox.db.name())).await;
    let sqs = sns::sqs_client(&moto).await;
    let config = outbox.config_file(&sqs_toml(
        &queue_url,
        "attempt_timeout = \"1s\"\noperation_timeout = \"2s\"",
    ));
    let endpoint = format!("http://127.0.0.1:{}", proxy.port());
    let mut relay = spawn_relay(&config, Some(("AWS_ENDPOINT_URL_SQS", &endpoint)));
    outbox.wait_slot_active(true).await;

    // A backlog, delivered over many calls; frozen while they go.
    let reader = QueueReader::start(&sqs, &queue_url, 400, envelope_id);
    let expected = insert(&outbox, 80, 5, 20).await;
    reader.wait_for(40).await;
    let before = proxy.accepted();
    proxy.freeze();
    let received = reader.finish().await;
    assert_all_arrived_in_order(&expected, &messages(&received), &relay);
    assert!(
        relay.stderr_text().contains("no answer from"),
        "a call on a frozen connection timed out and was retried"
    );
    assert!(
        proxy.accepted() > before,
        "new connections replaced the frozen ones"
    );
    settled(&outbox, expected.len()).await;
    relay.stop_gracefully().await;
}

/// One event routed (row `topic`) to a queue that does not exist is recorded
/// FAILED saying so; one routed to another queue by its bare name arrives
/// there; the events around them, of their aggregates too, reach the
/// default queue, and the slot moves past all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_for_a_queue_that_does_not_exist_is_recorded_failed_and_the_stream_moves_on() {
    let moto = sns::moto_endpoint().await;
    let outbox = Outbox::new().await;
    let queue_url = aws_json::create_queue(&moto, outbox.db.name()).await;
    let other = format!("{}_other", outbox.db.name());
    let other_url = aws_json::create_queue(&moto, &other).await;
    let missing = format!("{}_missing", outbox.db.name());
    let config = outbox.config_file(&sqs_toml(&queue_url, ""));
    let mut relay = spawn_relay(&config, Some(("AWS_ENDPOINT_URL_SQS", &moto)));
    outbox.wait_slot_active(true).await;

    let mut expected = insert(&outbox, 2, 5, 2).await;
    let lost = insert_routed(&outbox, "agg-0", "Lost", &missing).await;
    let elsewhere = insert_routed(&outbox, "agg-1", "Elsewhere", &other).await;
    expected.extend(insert(&outbox, 2, 5, 2).await);

    let sqs = sns::sqs_client(&moto).await;
    let reader = QueueReader::start(&sqs, &queue_url, expected.len(), envelope_id);
    let received = reader.finish().await;
    assert_all_arrived_in_order(&expected, &messages(&received), &relay);
    let routed = QueueReader::start(&sqs, &other_url, 1, envelope_id)
        .finish()
        .await;
    let routed: HashSet<(String, String)> = messages(&routed).into_iter().collect();
    assert_eq!(
        routed,
        HashSet::from([(elsewhere, "agg-1".to_owned())]),
        "the row naming another queue went there"
    );

    let (state, attempts, error) = recorded(&outbox, &lost).await;
    assert_eq!((state.as_str(), attempts), ("FAILED", 1), "{error}");
    assert!(
        error.contains(&missing) && error.contains("does not exist"),
        "{error}"
    );
    settled(&outbox, expected.len() + 1).await;
    relay.stop_gracefully().await;
}

/// Rows whose `topic` names a queue on another host (an internal service
/// answering on the queue path) or in another account are recorded FAILED
/// saying why, and no connection is made to the other host; the events
/// around them reach the default queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_naming_a_queue_of_another_host_or_account_is_recorded_failed_and_nothing_is_sent() {
    let moto = sns::moto_endpoint().await;
    let outbox = Outbox::new().await;
    let queue_url = aws_json::create_queue(&moto, outbox.db.name()).await;
    let trap = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    trap.set_nonblocking(true).unwrap();
    let account = queue_url
        .trim_end_matches('/')
        .rsplit('/')
        .nth(1)
        .unwrap()
        .to_owned();
    let config = outbox.config_file(&sqs_toml(&queue_url, ""));
    let mut relay = spawn_relay(&config, Some(("AWS_ENDPOINT_URL_SQS", &moto)));
    outbox.wait_slot_active(true).await;

    let mut expected = insert(&outbox, 2, 5, 2).await;
    let hostile = [
        format!(
            "http://127.0.0.1:{}/{account}/{}",
            trap.local_addr().unwrap().port(),
            outbox.db.name()
        ),
        format!(
            "{}/999999999999/{}",
            moto.trim_end_matches('/'),
            outbox.db.name()
        ),
        format!(
            "{}/{account}/a/../../999999999999/q",
            moto.trim_end_matches('/')
        ),
    ];
    let mut refused = Vec::new();
    for url in &hostile {
        refused.push(insert_routed(&outbox, "agg-0", "Hostile", url).await);
    }
    expected.extend(insert(&outbox, 2, 5, 2).await);

    let sqs = sns::sqs_client(&moto).await;
    let reader = QueueReader::start(&sqs, &queue_url, expected.len(), envelope_id);
    let received = reader.finish().await;
    assert_all_arrived_in_order(&expected, &messages(&received), &relay);
    for (id, url) in refused.iter().zip(&hostile) {
        let (state, _, error) = recorded(&outbox, id).await;
        assert_eq!(state, "FAILED", "{url}: {error}");
        assert!(
            error.contains("not a destination the configuration allows"),
            "{url}: {error}"
        );
    }
    settled(&outbox, expected.len()).await;
    relay.stop_gracefully().await;
    assert!(
        matches!(trap.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "no connection went to the other host"
    );
}

// ---------------------------------------------------------------------------
// Shared with eventbridge.rs and kinesis.rs.

/// The relay binary running `config`, with the standard AWS environment
/// (region us-east-1, static test credentials, no instance metadata) and,
/// when given, one endpoint variable (`AWS_ENDPOINT_URL_SQS`, …).
pub(crate) fn spawn_relay(config: &Path, endpoint: Option<(&str, &str)>) -> RelayProcess {
    let mut env: Vec<(&str, &str)> = vec![
        ("AWS_REGION", sns::TEST_REGION),
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
        ("AWS_EC2_METADATA_DISABLED", "true"),
    ];
    env.extend(endpoint);
    RelayProcess::spawn(&["run", "--config", config.to_str().unwrap()], &env)
}

/// `(id, subject)` of each CloudEvents envelope.
pub(crate) fn envelopes<'a>(bodies: impl IntoIterator<Item = &'a [u8]>) -> Vec<(String, String)> {
    bodies
        .into_iter()
        .map(|body| {
            let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_else(|e| {
                panic!("not a CloudEvent ({e}): {}", String::from_utf8_lossy(body))
            });
            (
                v["id"].as_str().expect("an id").to_owned(),
                v["subject"].as_str().expect("a subject").to_owned(),
            )
        })
        .collect()
}

/// What arrived (`got`: `(id, aggregate)` in arrival order) is what was
/// committed (`expected`), nothing missing and nothing else, each
/// aggregate's in commit order (first arrivals). Delivery is at least once:
/// an event may arrive twice, but only when `relay` had to try a call again
/// (an answer that did not come in time).
pub(crate) fn assert_all_arrived_in_order(
    expected: &[(String, String)],
    got: &[(String, String)],
    relay: &RelayProcess,
) {
    let want: HashSet<&str> = expected.iter().map(|(id, _)| id.as_str()).collect();
    let have: HashSet<&str> = got.iter().map(|(id, _)| id.as_str()).collect();
    let missing = want.difference(&have).count();
    let unknown: Vec<&&str> = have.difference(&want).collect();
    assert_eq!(missing, 0, "{missing} of {} events missing", want.len());
    assert!(unknown.is_empty(), "events that were not sent: {unknown:?}");
    assert_per_aggregate_order(expected, got);
    let repeats = got.len() - have.len();
    if repeats > 0 {
        let log = relay.stderr_text();
        assert!(
            log.contains("retrying"),
            "{repeats} events arrived twice, yet the relay retried nothing:\n{log}"
        );
        eprintln!("{repeats} events arrived twice (the relay retried calls)");
    }
}

/// At most this many events are inserted and not yet read ([`insert_paced`]).
const WINDOW: usize = 20;

/// Reads a queue in the background (deleting what it read) until messages
/// of `n` distinct events arrived or its patience ran out (30 s, or 40 ms
/// an event when there are more than 750).
pub(crate) struct QueueReader {
    got: Arc<Mutex<(Vec<Received>, HashSet<String>)>>,
    progress: Arc<tokio::sync::Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl QueueReader {
    /// Starts reading `queue_url`; `event_id` tells which event a message is.
    pub(crate) fn start(
        sqs: &aws_sdk_sqs::Client,
        queue_url: &str,
        n: usize,
        event_id: fn(&Received) -> String,
    ) -> QueueReader {
        let got = Arc::new(Mutex::new((Vec::new(), HashSet::new())));
        let progress = Arc::new(tokio::sync::Notify::new());
        let task = tokio::spawn({
            let (sqs, queue_url) = (sqs.clone(), queue_url.to_owned());
            let (got, progress) = (Arc::clone(&got), Arc::clone(&progress));
            async move {
                // 30 s, or 40 ms an event for many.
                let patience = Duration::from_millis(40 * n as u64).max(Duration::from_secs(30));
                let deadline = Instant::now() + patience;
                while got.lock().unwrap().1.len() < n && Instant::now() < deadline {
                    // Returns with the first messages, or empty after ~20 ms.
                    let batch =
                        sns::receive_all(&sqs, &queue_url, 1, Duration::from_millis(20)).await;
                    if !batch.is_empty() {
                        let mut got = got.lock().unwrap();
                        for r in batch {
                            got.1.insert(event_id(&r));
                            got.0.push(r);
                        }
                        progress.notify_waiters();
                    }
                }
            }
        });
        QueueReader {
            got,
            progress,
            task,
        }
    }

    /// How many distinct events were read so far.
    pub(crate) fn count(&self) -> usize {
        self.got.lock().unwrap().1.len()
    }

    /// Waits until at least `n` distinct events were read (or the reader gave up).
    pub(crate) async fn wait_for(&self, n: usize) {
        loop {
            let notified = self.progress.notified();
            if self.count() >= n || self.task.is_finished() {
                return;
            }
            let _ = tokio::time::timeout(Duration::from_millis(200), notified).await;
        }
    }

    /// Waits until the reader is done; what it read, in receive order.
    pub(crate) async fn finish(self) -> Vec<Received> {
        self.task.await.unwrap();
        std::mem::take(&mut self.got.lock().unwrap().0)
    }
}

/// Inserts `txs` transactions of `per_tx` events over `aggregates`
/// aggregates (round robin, as [`insert`]) while `reader` keeps up: at most
/// [`WINDOW`] events are inserted and not yet read; `(id, aggregate)` in
/// commit order. moto's SQS queues slow down with their length (each message
/// received recounts the whole queue: ~10 ms a message at 100 waiting, ~40 ms
/// at 500), so a reader that falls behind hardly catches up; AWS needs no
/// such care.
pub(crate) async fn insert_paced(
    outbox: &Outbox,
    txs: usize,
    per_tx: usize,
    aggregates: usize,
    reader: &QueueReader,
) -> Vec<(String, String)> {
    let mut out = Vec::with_capacity(txs * per_tx);
    for t in 0..txs {
        let waiting_for = (out.len() + per_tx).saturating_sub(WINDOW);
        tokio::time::timeout(Duration::from_secs(60), reader.wait_for(waiting_for))
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "the reader fell behind: {} of {} read after a minute",
                    reader.count(),
                    out.len()
                )
            });
        out.extend(crate::sns::insert_tx_of(outbox, t, per_tx, aggregates).await);
    }
    out
}

/// Inserts one event of `aggregate` with `event_type` and row `topic`; its id.
pub(crate) async fn insert_routed(
    outbox: &Outbox,
    aggregate: &str,
    event_type: &str,
    topic: &str,
) -> String {
    outbox
        .sql
        .query_one(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, topic) \
             VALUES ('order', $1, $2, '{\"routed\": true}', $3) RETURNING id::text",
            &[&aggregate, &event_type, &topic],
        )
        .await
        .unwrap()
        .get(0)
}

/// Waits until row `id` is no longer PENDING; its state, attempts and last error.
pub(crate) async fn recorded(outbox: &Outbox, id: &str) -> (String, i32, String) {
    wait_until(Duration::from_secs(30), "the row is recorded", || async {
        let row = outbox
            .sql
            .query_one(
                "SELECT state, attempts, coalesce(last_error, '') FROM outbox_state WHERE id::text = $1",
                &[&id],
            )
            .await
            .ok()?;
        let state: String = row.get(0);
        (state != "PENDING").then(|| (state, row.get(1), row.get(2)))
    })
    .await
}

/// `(publish_state, rows)` of the outbox, by state.
pub(crate) async fn publish_states(outbox: &Outbox) -> HashMap<String, i64> {
    outbox
        .sql
        .query("SELECT state, count(*) FROM outbox_state GROUP BY 1", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// Waits until `n` rows of the outbox are in `state`.
pub(crate) async fn all_rows(outbox: &Outbox, state: &str, n: usize) {
    let n = i64::try_from(n).unwrap();
    wait_until(
        Duration::from_secs(30),
        &format!("{n} rows are {state}"),
        || async {
            let states = publish_states(outbox).await;
            if states.get(state) == Some(&n) {
                Ok(())
            } else {
                Err(format!("{states:?}"))
            }
        },
    )
    .await;
}

/// What every delivery test ends with: the slot is confirmed past the last
/// commit and all `n` rows are PUBLISHED.
pub(crate) async fn settled(outbox: &Outbox, n: usize) {
    slot_passes_last_commit(outbox).await;
    all_rows(outbox, "PUBLISHED", n).await;
}

/// Waits until the slot is confirmed at or past the end of the last commit.
pub(crate) async fn slot_passes_last_commit(outbox: &Outbox) {
    let last = outbox.commits().await.last().unwrap().end_lsn;
    wait_until(
        Duration::from_secs(30),
        "the slot is confirmed past the last commit",
        || async {
            let confirmed = outbox.confirmed_flush().await;
            if confirmed >= last {
                Ok(())
            } else {
                Err(format!("confirmed {confirmed:X} < {last:X}"))
            }
        },
    )
    .await;
}

/// Cuts `proxy`'s connections, inserts with `insert` (its result is
/// returned), and checks for five seconds that the slot is not confirmed past
/// the first commit made during the cut and that none of those rows is
/// marked. The connections stay cut: the caller checks the destination,
/// then sets [`Mode::Pass`].
pub(crate) async fn outage_holds_the_slot<F, Fut>(
    outbox: &Outbox,
    proxy: &FaultProxy,
    insert: F,
) -> Vec<(String, String)>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Vec<(String, String)>>,
{
    let commits_before = outbox.commits().await.len();
    let confirmed_before = outbox.confirmed_flush().await;
    proxy.set_mode(Mode::Cut);
    let during = insert().await;
    let first_undelivered = outbox.commits().await[commits_before].end_lsn;
    assert!(confirmed_before < first_undelivered);
    let ids: Vec<&str> = during.iter().map(|(id, _)| id.as_str()).collect();
    for _ in 0..50 {
        let confirmed = outbox.confirmed_flush().await;
        assert!(
            confirmed < first_undelivered,
            "confirmed {confirmed:X} passed undelivered commit {first_undelivered:X} during the outage"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let marked: i64 = outbox
        .sql
        .query_one(
            "SELECT count(*) FROM outbox_state WHERE id::text = ANY($1) AND state <> 'PENDING'",
            &[&ids],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(marked, 0, "no row written during the outage is marked");
    assert!(
        proxy.faults_injected() > 0,
        "the relay kept trying during the outage"
    );
    during
}
