//! Publishing to SNS (moto), read back through an SQS subscription.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use harness::proxy::{FaultProxy, Mode};
use harness::sns::{self, Received, Topic};
use harness::{wait_until, RelayProcess};
use outbox_relay::SnsSink;

use crate::outbox::{Outbox, Running};

/// Static test credentials for the in-process SNS client (the standard chain
/// reads them from the environment, as in production).
pub fn test_credentials() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        for (k, v) in [
            ("AWS_ACCESS_KEY_ID", "test"),
            ("AWS_SECRET_ACCESS_KEY", "test"),
            ("AWS_EC2_METADATA_DISABLED", "true"),
        ] {
            std::env::set_var(k, v);
        }
    });
}

fn sns_toml(endpoint: &str, topic_arn: &str, extra: &str) -> String {
    format!(
        "[sink]\nkind = \"sns\"\n[sns]\nregion = \"us-east-1\"\nendpoint_url = \"{endpoint}\"\n\
         topic_arn = \"{topic_arn}\"\n{extra}\n[retry]\nmax = \"1s\"\n"
    )
}

async fn start(outbox: &Outbox, toml: &str) -> Running {
    test_credentials();
    let config = outbox.config(toml);
    let sink = SnsSink::new(&config.destinations.sns)
        .await
        .expect("sns sink");
    let running = Running::start(config, sink);
    outbox.wait_slot_active(true).await;
    running
}

/// `(id, subject)` of each received envelope.
fn envelopes(received: &[Received]) -> Vec<(String, String)> {
    received
        .iter()
        .map(|r| {
            let v: serde_json::Value = serde_json::from_str(&r.body).expect("a CloudEvent");
            (
                v["id"].as_str().unwrap().to_owned(),
                v["subject"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// Per aggregate, the ids in first-arrival order must be the commit order.
pub(crate) fn assert_per_aggregate_order(expected: &[(String, String)], got: &[(String, String)]) {
    let mut want: HashMap<&str, Vec<&str>> = HashMap::new();
    for (id, agg) in expected {
        want.entry(agg).or_default().push(id);
    }
    let mut seen = HashSet::new();
    let mut have: HashMap<&str, Vec<&str>> = HashMap::new();
    for (id, agg) in got {
        if seen.insert(id.as_str()) {
            have.entry(agg).or_default().push(id);
        }
    }
    for (agg, ids) in &want {
        assert_eq!(
            have.get(agg),
            Some(ids),
            "aggregate {agg}: not all there, or out of commit order"
        );
    }
}

/// Inserts transaction `t` of `per_tx` events over `aggregates` aggregates
/// (round robin over all transactions, type `E`); `(id, aggregate)` of each.
pub(crate) async fn insert_tx_of(
    outbox: &Outbox,
    t: usize,
    per_tx: usize,
    aggregates: usize,
) -> Vec<(String, String)> {
    let events: Vec<(String, String)> = (0..per_tx)
        .map(|i| {
            (
                format!("agg-{}", (t * per_tx + i) % aggregates),
                "E".to_owned(),
            )
        })
        .collect();
    let ids = outbox.insert_tx(&events).await;
    ids.into_iter()
        .zip(events.into_iter().map(|(a, _)| a))
        .collect()
}

pub(crate) async fn insert(
    outbox: &Outbox,
    txs: usize,
    per_tx: usize,
    aggregates: usize,
) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for t in 0..txs {
        out.extend(insert_tx_of(outbox, t, per_tx, aggregates).await);
    }
    out
}

async fn fifo(outbox: &Outbox, endpoint: &str) -> Topic {
    sns::topic_with_queue(endpoint, &format!("{}.fifo", outbox.db.name()), true, true).await
}

/// 400 events over 20 aggregates (40 transactions of ten, so batches fill
/// and interleave aggregates): every one reaches the FIFO queue once, each
/// aggregate's in commit order, grouped by aggregate and deduplicated by event
/// id. Sized to show order over many batches in seconds: moto's FIFO queues
/// slow down with their length (2,000 events took over two minutes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_hundred_events_of_twenty_aggregates_reach_a_fifo_queue_each_aggregate_in_commit_order(
) {
    let moto = sns::moto_endpoint().await;
    let outbox = Outbox::new().await;
    let topic = fifo(&outbox, moto.as_str()).await;
    // moto's FIFO queues slow down with their length (about 180 messages/s
    // when drained as they fill, far less once thousands wait): read while
    // the relay publishes, and keep the relay to one batch in flight so it
    // does not outrun the reader. Real SNS needs neither.
    let sqs = sns::sqs_client(moto.as_str()).await;
    let reader = tokio::spawn({
        let queue = topic.queue_url.clone();
        async move { sns::receive_all(&sqs, &queue, 400, Duration::from_secs(120)).await }
    });
    let relay = start(
        &outbox,
        &sns_toml(moto.as_str(), &topic.arn, "max_in_flight_batches = 1"),
    )
    .await;
    let expected = insert(&outbox, 40, 10, 20).await;
    let started = std::time::Instant::now();
    let received = reader.await.unwrap();
    eprintln!("received {} in {:?}", received.len(), started.elapsed());
    let got = envelopes(&received);
    assert_per_aggregate_order(&expected, &got);
    assert!(received
        .iter()
        .all(|r| r.group_id.is_some() && r.dedup_id.is_some()));
    for (r, (id, agg)) in received.iter().zip(&got) {
        assert_eq!(
            r.group_id.as_deref(),
            Some(agg.as_str()),
            "MessageGroupId is the aggregate id"
        );
        assert_eq!(
            r.dedup_id.as_deref(),
            Some(id.as_str()),
            "MessageDeduplicationId is the event id"
        );
        assert_eq!(r.attributes.get("aggregate_id"), Some(agg));
        assert_eq!(
            r.attributes.get("event_type").map(String::as_str),
            Some("E")
        );
    }
    let summary = relay.stop().await;
    assert_eq!(summary.delivered, 400);
}

/// The first batches of a backlog start together; they wait for one answer
/// about the topic's size limit instead of each asking SNS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_asks_sns_for_the_topics_size_limit_once() {
    let moto = sns::moto_endpoint().await;
    let proxy = FaultProxy::start(moto.as_str());
    let outbox = Outbox::new().await;
    let topic = fifo(&outbox, moto.as_str()).await;
    let expected = insert(&outbox, 20, 10, 20).await;
    let relay = start(&outbox, &sns_toml(&proxy.endpoint(), &topic.arn, "")).await;
    let sqs = sns::sqs_client(moto.as_str()).await;
    let got = sns::receive_all(
        &sqs,
        &topic.queue_url,
        expected.len(),
        Duration::from_secs(60),
    )
    .await;
    assert_per_aggregate_order(&expected, &envelopes(&got));
    let actions = proxy.actions();
    let publishes = actions.iter().filter(|a| *a == "PublishBatch").count();
    assert!(publishes >= 20, "a backlog of batches: {actions:?}");
    let asks = actions
        .iter()
        .filter(|a| *a == "GetTopicAttributes")
        .count();
    assert_eq!(asks, 1, "{actions:?}");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_endpoint_loses_nothing_and_the_slot_waits_for_it() {
    let moto = sns::moto_endpoint().await;
    let proxy = FaultProxy::start(moto.as_str());
    let outbox = Outbox::new().await;
    let topic = fifo(&outbox, moto.as_str()).await;
    let relay = start(&outbox, &sns_toml(&proxy.endpoint(), &topic.arn, "")).await;
    let sqs = sns::sqs_client(moto.as_str()).await;

    let mut expected = insert(&outbox, 10, 5, 4).await;
    let before = sns::receive_all(
        &sqs,
        &topic.queue_url,
        expected.len(),
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(before.len(), expected.len());
    let confirmed_before_cut = outbox.confirmed_flush().await;
    let commits_before = outbox.commits().await.len();

    proxy.set_mode(Mode::Cut);
    expected.extend(insert(&outbox, 20, 5, 4).await);
    let first_unpublished = outbox.commits().await[commits_before].end_lsn;
    assert!(confirmed_before_cut < first_unpublished);
    // Ten seconds without SNS: the slot must not pass the first unpublished commit.
    for _ in 0..100 {
        let confirmed = outbox.confirmed_flush().await;
        assert!(
            confirmed < first_unpublished,
            "confirmed {confirmed:X} passed unpublished commit {first_unpublished:X} during the outage"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        proxy.faults_injected() > 0,
        "the relay kept trying during the outage"
    );
    proxy.set_mode(Mode::Pass);

    let after = sns::receive_all(
        &sqs,
        &topic.queue_url,
        expected.len() - before.len(),
        Duration::from_secs(60),
    )
    .await;
    let mut got = envelopes(&before);
    got.extend(envelopes(&after));
    assert_per_aggregate_order(&expected, &got);
    let last = outbox.commits().await.last().unwrap().end_lsn;
    wait_until(
        Duration::from_secs(10),
        "the slot catches up after the outage",
        || async { outbox.confirmed_flush().await >= last },
    )
    .await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttling_answers_are_retried_and_nothing_is_lost() {
    let moto = sns::moto_endpoint().await;
    let proxy = FaultProxy::start(moto.as_str());
    let outbox = Outbox::new().await;
    let topic = fifo(&outbox, moto.as_str()).await;
    let relay = start(&outbox, &sns_toml(&proxy.endpoint(), &topic.arn, "")).await;
    proxy.set_mode(Mode::Throttle);
    let expected = insert(&outbox, 30, 5, 6).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let throttled = proxy.faults_injected();
    assert!(throttled > 0, "SNS answered Throttling");
    proxy.set_mode(Mode::Pass);
    let sqs = sns::sqs_client(moto.as_str()).await;
    let received = sns::receive_all(
        &sqs,
        &topic.queue_url,
        expected.len(),
        Duration::from_secs(60),
    )
    .await;
    assert_per_aggregate_order(&expected, &envelopes(&received));
    let summary = relay.stop().await;
    assert_eq!(summary.rejected, 0, "throttling is never a rejection");
    eprintln!(
        "{throttled} throttled requests, then {} events delivered",
        summary.delivered
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authorization_errors_are_retried_until_fixed_and_never_drop_an_event() {
    let moto = sns::moto_endpoint().await;
    let proxy = FaultProxy::start(moto.as_str());
    let outbox = Outbox::new().await;
    let topic = fifo(&outbox, moto.as_str()).await;
    let relay = start(&outbox, &sns_toml(&proxy.endpoint(), &topic.arn, "")).await;
    proxy.set_mode(Mode::Deny);
    let expected = insert(&outbox, 4, 5, 3).await;
    wait_until(
        Duration::from_secs(10),
        "several denied attempts",
        || async { proxy.faults_injected() >= 3 },
    )
    .await;
    let first = outbox.commits().await[0].end_lsn;
    assert!(
        outbox.confirmed_flush().await < first,
        "nothing acknowledged while denied"
    );
    proxy.set_mode(Mode::Pass); // the operator fixed the policy
    let sqs = sns::sqs_client(moto.as_str()).await;
    let received = sns::receive_all(
        &sqs,
        &topic.queue_url,
        expected.len(),
        Duration::from_secs(30),
    )
    .await;
    assert_per_aggregate_order(&expected, &envelopes(&received));
    let summary = relay.stop().await;
    assert_eq!(
        summary.rejected, 0,
        "an authorization error never drops an event"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_too_large_payload_and_a_missing_topic_end_failed_and_the_stream_moves_on() {
    let moto = sns::moto_endpoint().await;
    let outbox = Outbox::new().await;
    let topic = fifo(&outbox, moto.as_str()).await;
    let relay = start(&outbox, &sns_toml(moto.as_str(), &topic.arn, "")).await;
    outbox
        .sql
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
               VALUES ('order', 'a', 'Huge', jsonb_build_object('blob', repeat('x', 300 * 1024)));
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, topic) \
               VALUES ('order', 'a', 'Lost', '{}', 'no-such-topic.fifo');",
        )
        .await
        .unwrap();
    let after = insert(&outbox, 3, 2, 2).await;
    let sqs = sns::sqs_client(moto.as_str()).await;
    let received =
        sns::receive_all(&sqs, &topic.queue_url, after.len(), Duration::from_secs(30)).await;
    assert_per_aggregate_order(&after, &envelopes(&received));

    // Recorded apart from the others' delivery: each topic's limit is
    // learned first (GetTopicAttributes), and the missing topic's lookup fails.
    wait_until(Duration::from_secs(30), "both are recorded", || async {
        outbox
            .sql
            .query_one(
                "SELECT count(*) = 2 FROM outbox WHERE event_type IN ('Huge', 'Lost') AND last_error IS NOT NULL",
                &[],
            )
            .await
            .ok()?
            .get::<_, bool>(0)
            .then_some(())
    })
    .await;
    let rows = outbox
        .sql
        .query(
            "SELECT event_type, state, attempts, last_error FROM outbox_state WHERE event_type IN ('Huge', 'Lost') ORDER BY event_type",
            &[],
        )
        .await
        .unwrap();
    let rows: Vec<(String, String, i32, String)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    assert_eq!(rows.len(), 2);
    let (huge, lost) = (&rows[0], &rows[1]);
    assert_eq!((huge.1.as_str(), huge.2), ("FAILED", 1));
    assert!(
        huge.3.contains("too large") && huge.3.contains("262144"),
        "{}",
        huge.3
    );
    assert_eq!((lost.1.as_str(), lost.2), ("FAILED", 1));
    assert!(
        lost.3.contains("no-such-topic.fifo") && lost.3.contains("does not exist"),
        "{}",
        lost.3
    );

    let last = outbox.commits().await.last().unwrap().end_lsn;
    wait_until(
        Duration::from_secs(10),
        "the slot moves past the failed rows",
        || async { outbox.confirmed_flush().await >= last },
    )
    .await;
    let summary = relay.stop().await;
    assert_eq!(
        (summary.delivered, summary.rejected),
        (after.len() as u64, 2)
    );
}

/// Inserts one transaction of ten events of ten aggregates, the fifth
/// carrying `marker` in its payload; `(id, aggregate)` of the nine others.
async fn ten_with_one_marked(outbox: &Outbox, marker: &str) -> Vec<(String, String)> {
    let rows = outbox
        .sql
        .query(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
             SELECT 'order', 'agg-' || n, CASE WHEN n = 5 THEN 'Marked' ELSE 'E' END, \
                    jsonb_build_object('n', n, 'mark', CASE WHEN n = 5 THEN $1 ELSE 'none' END) \
             FROM generate_series(1, 10) AS n ORDER BY n RETURNING id::text, aggregate_id, event_type",
            &[&marker],
        )
        .await
        .unwrap();
    rows.iter()
        .filter(|r| r.get::<_, &str>(2) != "Marked")
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// The state, attempts and last error of the `Marked` row.
async fn marked_row(outbox: &Outbox) -> (String, i32, String) {
    let row = outbox
        .sql
        .query_one(
            "SELECT state, attempts, coalesce(last_error, '') FROM outbox_state WHERE event_type = 'Marked'",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2))
}

/// A FIFO topic behind a fault proxy that refuses what carries `POISON`
/// with `code` in `mode`, and a relay publishing to it through the proxy.
async fn refusing_poison(
    code: &str,
    mode: Mode,
) -> (sns::SharedEndpoint, FaultProxy, Outbox, Topic, Running) {
    let moto = sns::moto_endpoint().await;
    let proxy = FaultProxy::start(moto.as_str());
    proxy.set_refusal("POISON", code);
    proxy.set_mode(mode);
    let outbox = Outbox::new().await;
    let topic = fifo(&outbox, moto.as_str()).await;
    let relay = start(
        &outbox,
        &sns_toml(&proxy.endpoint(), &topic.arn, "linger = \"200ms\""),
    )
    .await;
    (moto, proxy, outbox, topic, relay)
}

/// Wait until the slot is confirmed past the last commit (a refused event
/// does not hold it).
async fn slot_moves_past_the_last_commit(outbox: &Outbox) {
    let last = outbox.commits().await.last().unwrap().end_lsn;
    wait_until(
        Duration::from_secs(10),
        "the slot moves past the refused event",
        || async { outbox.confirmed_flush().await >= last },
    )
    .await;
}

/// However the relay batches the ten (one request or several), the entry SNS
/// refuses is recorded after one attempt and the nine others are delivered,
/// each sent once: a refused entry does not make the relay send its
/// neighbours again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_with_one_entry_sns_refuses_publishes_the_other_nine() {
    let (moto, proxy, outbox, topic, relay) =
        refusing_poison("InvalidParameter", Mode::FailMarkedEntries).await;
    let nine = ten_with_one_marked(&outbox, "POISON").await;
    let sqs = sns::sqs_client(moto.as_str()).await;
    let received = next(&sqs, &topic, nine.len()).await;
    assert_per_aggregate_order(&nine, &envelopes(&received));
    slot_moves_past_the_last_commit(&outbox).await;
    // Every entry the relay sent, counted over all its PublishBatch calls.
    let mut sent: HashMap<String, usize> = HashMap::new();
    for call in proxy.calls().iter().filter(|c| c.action == "PublishBatch") {
        for id in &call.ids {
            *sent.entry(id.clone()).or_default() += 1;
        }
    }
    for (id, _) in &nine {
        assert_eq!(sent.get(id), Some(&1), "event {id} was sent once: {sent:?}");
    }
    assert_eq!(sent.len(), 10, "the nine and the refused one: {sent:?}");
    assert_eq!(
        proxy.faults_injected(),
        1,
        "the refused entry was sent once"
    );
    let (state, attempts, error) = marked_row(&outbox).await;
    assert_eq!((state.as_str(), attempts), ("FAILED", 1), "{error}");
    assert!(error.contains("InvalidParameter"), "{error}");
    let summary = relay.stop().await;
    assert_eq!((summary.delivered, summary.rejected), (9, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_validation_exception_does_not_hold_the_slot() {
    let (moto, proxy, outbox, topic, relay) =
        refusing_poison("ValidationException", Mode::RefuseMarkedRequests).await;
    let mut good = ten_with_one_marked(&outbox, "POISON").await;
    good.extend(insert(&outbox, 3, 2, 2).await);
    let sqs = sns::sqs_client(moto.as_str()).await;
    let received = next(&sqs, &topic, good.len()).await;
    assert_per_aggregate_order(&good, &envelopes(&received));
    let (state, attempts, error) = marked_row(&outbox).await;
    assert_eq!((state.as_str(), attempts), ("FAILED", 1), "{error}");
    assert!(error.contains("ValidationException"), "{error}");
    assert!(
        proxy.faults_injected() >= 2,
        "the whole request was refused, then the entry alone"
    );
    slot_moves_past_the_last_commit(&outbox).await;
    let summary = relay.stop().await;
    assert_eq!(
        (summary.delivered, summary.rejected),
        (good.len() as u64, 1)
    );
}

/// moto with SNS's topic-sized limits, and a raw-delivery topic of it with
/// `MaximumMessageSize` = `limit` (moto's own default when `None`).
async fn sized_topic(
    moto: &sns::Moto,
    outbox: &Outbox,
    suffix: &str,
    limit: Option<usize>,
) -> Topic {
    let name = format!("{}_{suffix}", outbox.db.name());
    let topic = sns::topic_with_queue(&moto.endpoint(), &name, false, true).await;
    if let Some(limit) = limit {
        sns::sns_client(&moto.endpoint())
            .await
            .set_topic_attributes()
            .topic_arn(&topic.arn)
            .attribute_name("MaximumMessageSize")
            .attribute_value(limit.to_string())
            .send()
            .await
            .unwrap();
    }
    topic
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_whose_limit_is_one_mib_takes_a_600_kib_event_and_one_at_256_kib_records_it_failed()
{
    let moto = tokio::task::spawn_blocking(sns::Moto::start_sized_topics)
        .await
        .unwrap();
    let outbox = Outbox::new().await;
    let large = sized_topic(&moto, &outbox, "large", Some(1_048_576)).await;
    let small = sized_topic(&moto, &outbox, "small", None).await;
    let relay = start(&outbox, &sns_toml(&moto.endpoint(), &large.arn, "")).await;
    outbox
        .sql
        .execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, topic) \
             VALUES ('order', 'a', 'Large', jsonb_build_object('blob', repeat('x', 600 * 1024)), $1), \
                    ('order', 'b', 'Small', jsonb_build_object('blob', repeat('y', 600 * 1024)), $2)",
            &[&large.arn, &small.arn],
        )
        .await
        .unwrap();
    let after = insert(&outbox, 2, 2, 2).await;
    let sqs = sns::sqs_client(&moto.endpoint()).await;
    let received = sns::receive_all(
        &sqs,
        &large.queue_url,
        1 + after.len(),
        Duration::from_secs(30),
    )
    .await;
    let big = received
        .iter()
        .find(|r| r.attributes.get("event_type").map(String::as_str) == Some("Large"))
        .expect("the 600 KiB event reached the 1 MiB topic's queue");
    let envelope: serde_json::Value = serde_json::from_str(&big.body).unwrap();
    assert_eq!(envelope["data"]["blob"].as_str().unwrap().len(), 600 * 1024);
    let row = outbox
        .sql
        .query_one(
            "SELECT state, last_error FROM outbox_state WHERE event_type = 'Small'",
            &[],
        )
        .await
        .unwrap();
    let (state, error): (String, String) = (row.get(0), row.get(1));
    assert_eq!(state, "FAILED", "{error}");
    assert!(
        error.contains("too large") && error.contains("262144"),
        "{error}"
    );
    let summary = relay.stop().await;
    assert_eq!(
        (summary.delivered, summary.rejected),
        (1 + after.len() as u64, 1)
    );
}

/// Runs `tests/data/extended_client.py` (the official SQS Extended Client)
/// against `endpoint` with `args`.
fn extended_client(endpoint: &str, args: &[&str]) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/data/extended_client.py");
    let output = std::process::Command::new("python3")
        .arg(script)
        .arg(endpoint)
        .args(args)
        .output()
        .expect("python3 runs (scripts/install-deps.sh installs the library)");
    assert!(
        output.status.success(),
        "extended_client.py {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A bucket for claim-checked payloads on `endpoint`, named after `outbox`.
async fn payload_bucket(endpoint: &str, outbox: &Outbox, prefix: &str) -> String {
    let name = outbox.db.name().replace('_', "-");
    let bucket = format!("{prefix}-{}", &name[name.len().saturating_sub(16)..]).to_lowercase();
    tokio::task::spawn_blocking({
        let (endpoint, bucket) = (endpoint.to_owned(), bucket.clone());
        move || extended_client(&endpoint, &["create-bucket", &bucket])
    })
    .await
    .unwrap();
    bucket
}

/// The relay's configuration for `topic_arn` with large payloads in `bucket`,
/// raw envelopes.
fn claim_check_toml(endpoint: &str, topic_arn: &str, bucket: &str) -> String {
    sns_toml(
        endpoint,
        topic_arn,
        &format!(
            "large_payload_bucket = \"{bucket}\"\nlarge_payload_endpoint_url = \"{endpoint}\"\n\
             [envelope]\nformat = \"raw\"\n"
        ),
    )
}

/// `n` messages of `queue`, read with the official Extended Client (which
/// follows the pointers): `{"body": …, "attributes": {…}}` each.
async fn receive_extended(endpoint: &str, queue: &str, n: usize) -> Vec<serde_json::Value> {
    let out = tempfile::NamedTempFile::new().unwrap();
    tokio::task::spawn_blocking({
        let (endpoint, queue, out) = (
            endpoint.to_owned(),
            queue.to_owned(),
            out.path().to_str().unwrap().to_owned(),
        );
        move || extended_client(&endpoint, &["receive", &queue, &n.to_string(), &out])
    })
    .await
    .unwrap();
    serde_json::from_slice(&std::fs::read(out.path()).unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_payload_goes_through_s3_and_the_official_extended_client_reads_it_back_byte_for_byte(
) {
    let moto = sns::moto_endpoint().await;
    let outbox = Outbox::new().await;
    let endpoint = moto.to_string();
    let bucket = payload_bucket(&endpoint, &outbox, "payloads").await;
    let topic = sns::topic_with_queue(&endpoint, outbox.db.name(), false, true).await;
    let relay = start(&outbox, &claim_check_toml(&endpoint, &topic.arn, &bucket)).await;
    // 400 KiB of text SNS must carry as it is: quotes, escapes, non-ASCII.
    let rows = outbox
        .sql
        .query(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('order', 'a', 'Large', jsonb_build_object('blob', repeat('x\"é€ \\ ', 40 * 1024))), \
                    ('order', 'b', 'Small', '{\"small\": true}') \
             RETURNING id::text, payload::text",
            &[],
        )
        .await
        .unwrap();
    let sent: HashMap<String, String> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert!(sent.values().any(|p| p.len() > 400 * 1024));
    let got = receive_extended(&endpoint, &topic.queue_url, 2).await;
    assert_eq!(got.len(), 2, "{got:?}");
    for message in &got {
        let id = message["attributes"]["event_id"].as_str().unwrap();
        assert_eq!(
            message["body"].as_str().unwrap(),
            sent[id],
            "the envelope of {id}, byte for byte"
        );
    }
    let summary = relay.stop().await;
    assert_eq!((summary.delivered, summary.rejected), (2, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_events_of_a_table_without_state_columns_go_to_the_dead_letter_table() {
    let moto = sns::moto_endpoint().await;
    let outbox = Outbox::with_schema(Some(
        "CREATE TABLE outbox (id uuid PRIMARY KEY DEFAULT gen_random_uuid(), aggregatetype text NOT NULL,
            aggregateid text NOT NULL, type text NOT NULL, payload jsonb, topic text)",
    ))
    .await;
    let topic = fifo(&outbox, moto.as_str()).await;
    let columns = "[columns]\naggregate_type = \"aggregatetype\"\naggregate_id = \"aggregateid\"\n\
                   event_type = \"type\"\nheaders = \"\"\ncreated_at = \"\"\n[lifecycle]\non_published = \"none\"";
    let relay = start(
        &outbox,
        &format!("{}\n{columns}", sns_toml(moto.as_str(), &topic.arn, "")),
    )
    .await;
    outbox
        .sql
        .batch_execute(
            "INSERT INTO outbox (aggregatetype, aggregateid, type, payload, topic) VALUES ('order', 'a', 'Lost', '{}', 'nowhere.fifo');
             INSERT INTO outbox (aggregatetype, aggregateid, type, payload) VALUES ('order', 'a', 'Fine', '{\"x\": 1}');",
        )
        .await
        .unwrap();
    let sqs = sns::sqs_client(moto.as_str()).await;
    let received = sns::receive_all(&sqs, &topic.queue_url, 1, Duration::from_secs(30)).await;
    assert_eq!(received.len(), 1);
    let row = outbox
        .sql
        .query_one(
            "SELECT event_type, aggregate_id, reason, envelope IS NOT NULL FROM outbox_dead_letter",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "Lost");
    assert_eq!(row.get::<_, String>(1), "a");
    assert!(row.get::<_, String>(2).contains("does not exist"));
    assert!(row.get::<_, bool>(3));
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_during_a_backlog_loses_nothing_and_repeats_nothing() {
    let moto = sns::moto_endpoint().await;
    let outbox = Outbox::new().await;
    // A standard topic and queue: repeats would show (FIFO would hide them).
    let topic = sns::topic_with_queue(moto.as_str(), outbox.db.name(), false, true).await;
    let expected = insert(&outbox, 50, 10, 10).await;
    let config = outbox.config_file(&sns_toml(moto.as_str(), &topic.arn, ""));
    let env = sns::aws_env(moto.as_str());
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let run = || RelayProcess::spawn(&["run", "--config", config.to_str().unwrap()], &env);

    let mut first = run();
    let sqs = sns::sqs_client(moto.as_str()).await;
    let early = sns::receive_all(&sqs, &topic.queue_url, 30, Duration::from_secs(30)).await;
    assert!(!early.is_empty());
    first.sigterm();
    let status = first.wait_exit_async(Duration::from_secs(30)).await;
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}: {}",
        first.stderr_text()
    );

    let mut second = run();
    let rest = sns::receive_all(
        &sqs,
        &topic.queue_url,
        expected.len() - early.len(),
        Duration::from_secs(120),
    )
    .await;
    // Anything beyond the expected count would be a repeat: give it a moment.
    let extra = sns::receive_all(&sqs, &topic.queue_url, 0, Duration::from_secs(2)).await;
    second.sigterm();
    second.wait_exit_async(Duration::from_secs(30)).await;
    let mut ids: Vec<String> = envelopes(&early).into_iter().map(|(id, _)| id).collect();
    ids.extend(envelopes(&rest).into_iter().map(|(id, _)| id));
    ids.extend(envelopes(&extra).into_iter().map(|(id, _)| id));
    let unique: HashSet<&String> = ids.iter().collect();
    assert_eq!(unique.len(), expected.len(), "nothing lost");
    assert_eq!(
        ids.len(),
        expected.len(),
        "nothing repeated after a graceful stop"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_9_between_publish_and_acknowledgement_republishes_with_the_same_ids() {
    let moto = sns::moto_endpoint().await;
    let proxy = FaultProxy::start(moto.as_str());
    let outbox = Outbox::new().await;
    // A standard queue keeps the repeats visible (a FIFO queue would drop them).
    let topic = sns::topic_with_queue(moto.as_str(), outbox.db.name(), false, true).await;
    let config = outbox.config_file(&sns_toml(&proxy.endpoint(), &topic.arn, ""));
    let env = sns::aws_env(moto.as_str());
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let run = || RelayProcess::spawn(&["run", "--config", config.to_str().unwrap()], &env);

    let mut first = run();
    outbox.wait_slot_active(true).await;
    // SNS takes every publish, but its answers are lost: the relay cannot
    // know, so it must not acknowledge.
    proxy.set_mode(Mode::LoseAnswers);
    let expected = insert(&outbox, 5, 4, 4).await;
    let sqs = sns::sqs_client(moto.as_str()).await;
    // Retries of lost answers publish again: read until every id was seen.
    let mut published: HashSet<String> = HashSet::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while published.len() < expected.len() && std::time::Instant::now() < deadline {
        let got = sns::receive_all(&sqs, &topic.queue_url, 1, Duration::from_secs(2)).await;
        published.extend(envelopes(&got).into_iter().map(|(id, _)| id));
    }
    assert_eq!(
        published.len(),
        expected.len(),
        "every event reached SNS once at least"
    );
    first.kill9();
    outbox.wait_slot_active(false).await;
    let first_commit = outbox.commits().await[0].end_lsn;
    assert!(
        outbox.confirmed_flush().await < first_commit,
        "nothing confirmed: no answer ever came back"
    );

    proxy.set_mode(Mode::Pass);
    let mut second = run();
    // The restart publishes everything again (and answers now come back).
    // Copies sent by the first run's retries may still be in the queue.
    let last = outbox.commits().await.last().unwrap().end_lsn;
    wait_until(
        Duration::from_secs(30),
        "the restarted relay confirms every commit",
        || async { outbox.confirmed_flush().await >= last },
    )
    .await;
    second.sigterm();
    second.wait_exit_async(Duration::from_secs(30)).await;
    let again = sns::receive_all(&sqs, &topic.queue_url, 0, Duration::from_secs(3)).await;
    let again: HashSet<String> = envelopes(&again).into_iter().map(|(id, _)| id).collect();
    let expected_ids: HashSet<String> = expected.iter().map(|(id, _)| id.clone()).collect();
    assert_eq!(
        again, expected_ids,
        "the restart re-published every event, with the same ids"
    );
    let log = second.stderr_text();
    assert!(
        log.contains(&format!("delivered={}", expected.len())),
        "the restarted relay published all {} again:\n{log}",
        expected.len()
    );
    assert!(
        proxy
            .actions()
            .iter()
            .filter(|a| a.as_str() == "PublishBatch")
            .count()
            >= 2,
        "published before the kill and after the restart"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_slot_is_recreated_and_every_event_written_meanwhile_reaches_sqs() {
    let moto = sns::moto_endpoint().await;
    let outbox = Outbox::new().await;
    let topic = sns::topic_with_queue(moto.as_str(), outbox.db.name(), false, true).await;
    outbox.drop_slot().await;
    // 200 events: two poller rounds of 100 at least, in seconds (1,000 took
    // over a minute of moto's time).
    let expected = insert(&outbox, 20, 10, 25).await;
    let sqs = sns::sqs_client(moto.as_str()).await;
    let reader = tokio::spawn({
        let queue = topic.queue_url.clone();
        async move { sns::receive_all(&sqs, &queue, 200, Duration::from_secs(120)).await }
    });
    let relay = start(
        &outbox,
        &sns_toml(
            moto.as_str(),
            &topic.arn,
            "[lifecycle]\nrecreate_slot = true\n[poller]\ninterval = \"200ms\"\nbatch_size = 100",
        ),
    )
    .await;
    let received = reader.await.unwrap();
    let got: HashSet<String> = envelopes(&received).into_iter().map(|(id, _)| id).collect();
    let want: HashSet<String> = expected.iter().map(|(id, _)| id.clone()).collect();
    assert_eq!(
        got, want,
        "every event written while the slot was gone reached SQS"
    );
    relay.stop().await;
}

/// The relay binary publishing as `config` says, signing with `key` (given
/// through the standard AWS variables, as in production).
fn relay_signing_as(
    config: &std::path::Path,
    endpoint: &str,
    key: &sns::AccessKey,
) -> RelayProcess {
    let env = key.env(endpoint);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    RelayProcess::spawn(&["run", "--config", config.to_str().unwrap()], &env)
}

/// `(publish_state, rows)` of the outbox, by state.
async fn publish_states(outbox: &Outbox) -> Vec<(String, i64)> {
    outbox
        .sql
        .query(
            "SELECT state, count(*) FROM outbox_state GROUP BY 1 ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// The next `n` messages of `topic`'s queue (20 s at most).
async fn next(sqs: &aws_sdk_sqs::Client, topic: &Topic, n: usize) -> Vec<Received> {
    sns::receive_all(sqs, &topic.queue_url, n, Duration::from_secs(20)).await
}

/// Waits until all `rows` rows of the outbox are PUBLISHED, then stops
/// `relay` with SIGTERM and checks that it exits cleanly; its log.
async fn all_published_then_stop(outbox: &Outbox, relay: &mut RelayProcess, rows: i64) -> String {
    wait_until(
        Duration::from_secs(10),
        "every row is PUBLISHED",
        || async { publish_states(outbox).await == [("PUBLISHED".to_owned(), rows)] },
    )
    .await;
    relay.sigterm();
    let status = relay.wait_exit_async(Duration::from_secs(20)).await;
    let log = relay.stderr_text();
    assert!(status.is_some_and(|s| s.success()), "{status:?}: {log}");
    log
}

/// Inserts `txs` transactions of `per_tx` events of one aggregate (one FIFO
/// group, so one order for all); `(id, aggregate)` in commit order. The
/// payloads have what a form body must encode: spaces (jsonb prints objects
/// with them), quotes, `+`, `~`, `/` and non-ASCII text.
async fn insert_signed(outbox: &Outbox, txs: usize, per_tx: i32) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for _ in 0..txs {
        let rows = outbox
            .sql
            .query(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
                 SELECT 'order', 'agg-0', 'E', \
                        jsonb_build_object('n', n, 'note', 'a b+c ~ d/e « é »') \
                 FROM generate_series(1, $1) AS n \
                 ORDER BY n RETURNING id::text",
                &[&per_tx],
            )
            .await
            .expect("insert outbox rows");
        out.extend(rows.iter().map(|r| (r.get(0), "agg-0".to_owned())));
    }
    out
}

/// A moto server of the test's own with a FIFO topic and queue for `outbox`:
/// checking signatures on the shared server would fail every other test.
async fn private_moto(outbox: &Outbox) -> (sns::Moto, Topic) {
    let moto = tokio::task::spawn_blocking(sns::Moto::start)
        .await
        .expect("start moto");
    let topic = fifo(outbox, &moto.endpoint()).await;
    (moto, topic)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_signatures_checked_a_wrong_secret_publishes_nothing_and_the_right_one_delivers_everything_in_order(
) {
    let outbox = Outbox::new().await;
    let (moto, topic) = private_moto(&outbox).await;
    let endpoint = moto.endpoint();
    let user = moto.iam_user("outbox-relay").await;
    moto.enforce_signatures().await;
    let sqs = sns::sqs_client_as(&endpoint, &user).await;
    let unsigned = sns::sqs_client(&endpoint)
        .await
        .get_queue_url()
        .queue_name(topic.queue_url.rsplit('/').next().unwrap())
        .send()
        .await;
    assert!(unsigned.is_err(), "moto checks the test credentials now");
    let config = outbox.config_file(&sns_toml(&endpoint, &topic.arn, ""));

    // The right key id with a wrong secret: every publish is refused, retried,
    // logged, and nothing is acknowledged.
    let mut wrong = relay_signing_as(
        &config,
        &endpoint,
        &user.with_secret("wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"),
    );
    outbox.wait_slot_active(true).await;
    let mut expected = insert_signed(&outbox, 3, 2).await;
    wait_until(
        Duration::from_secs(15),
        "the relay logs SignatureDoesNotMatch",
        || async { wrong.stderr_text().contains("SignatureDoesNotMatch") },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        publish_states(&outbox).await,
        [("PENDING".to_owned(), 6)],
        "nothing is published with a wrong secret"
    );
    assert_eq!(sns::queue_depth(&sqs, &topic.queue_url).await, 0);
    let first = outbox.commits().await[0].end_lsn;
    assert!(
        outbox.confirmed_flush().await < first,
        "nothing acknowledged"
    );
    assert!(
        wrong.is_running(),
        "an authorization error is retried, not fatal"
    );
    let log = wrong.stderr_text();
    let refusal = log
        .lines()
        .find(|l| l.contains("SignatureDoesNotMatch"))
        .unwrap();
    assert!(
        refusal.contains("ERROR") && refusal.contains("refused the credentials"),
        "logged as an error: {refusal}"
    );
    wrong.kill9();
    outbox.wait_slot_active(false).await;

    // The right secret: the backlog, then events written while it runs.
    let mut relay = relay_signing_as(&config, &endpoint, &user);
    let mut received = next(&sqs, &topic, expected.len()).await;
    expected.extend(insert_signed(&outbox, 2, 2).await);
    received.extend(next(&sqs, &topic, 4).await);
    assert_eq!(
        envelopes(&received),
        expected,
        "all of them, in commit order"
    );
    let log = all_published_then_stop(&outbox, &mut relay, 10).await;
    assert!(!log.contains("refused"), "no publish was refused: {log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_signatures_checked_sts_credentials_publish_with_their_session_token() {
    let outbox = Outbox::new().await;
    let (moto, topic) = private_moto(&outbox).await;
    let endpoint = moto.endpoint();
    let role = moto.assume_role("outbox-relay").await;
    moto.enforce_signatures().await;
    let sqs = sns::sqs_client_as(&endpoint, &role).await;
    let without_token = sns::AccessKey {
        session_token: None,
        ..role.clone()
    };
    let refused = sns::sqs_client_as(&endpoint, &without_token)
        .await
        .get_queue_url()
        .queue_name(topic.queue_url.rsplit('/').next().unwrap())
        .send()
        .await;
    assert!(refused.is_err(), "STS keys are refused without their token");
    let config = outbox.config_file(&sns_toml(&endpoint, &topic.arn, ""));

    let mut relay = relay_signing_as(&config, &endpoint, &role);
    outbox.wait_slot_active(true).await;
    let expected = insert_signed(&outbox, 3, 2).await;
    let received = next(&sqs, &topic, expected.len()).await;
    assert_eq!(
        envelopes(&received),
        expected,
        "all of them, in commit order"
    );
    let log = all_published_then_stop(&outbox, &mut relay, 6).await;
    assert!(!log.contains("refused"), "no publish was refused: {log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_https_the_endpoint_certificate_is_checked_against_aws_ca_bundle_and_every_event_arrives(
) {
    let moto = sns::moto_endpoint().await;
    let outbox = Outbox::new().await;
    let topic = fifo(&outbox, moto.as_str()).await;
    let pki = harness::TestPki::new();
    let front = harness::HttpsFront::start(moto.as_str(), &pki).await;
    let endpoint = front.endpoint();
    let config = outbox.config_file(&sns_toml(&endpoint, &topic.arn, ""));
    let relay_trusting = |ca: &std::path::Path| {
        let mut env = sns::aws_env(&endpoint);
        env.push(("AWS_CA_BUNDLE", ca.to_str().unwrap().to_owned()));
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        RelayProcess::spawn(&["run", "--config", config.to_str().unwrap()], &env)
    };

    // A CA that did not sign the endpoint's certificate: no connection, so
    // nothing published and nothing acknowledged; the log says why.
    let mut untrusting = relay_trusting(&pki.other_ca());
    outbox.wait_slot_active(true).await;
    let mut expected = insert_signed(&outbox, 2, 3).await;
    wait_until(
        Duration::from_secs(15),
        "the relay logs the certificate problem",
        || async { untrusting.stderr_text().contains("certificate") },
    )
    .await;
    assert_eq!(publish_states(&outbox).await, [("PENDING".to_owned(), 6)]);
    let first = outbox.commits().await[0].end_lsn;
    assert!(
        outbox.confirmed_flush().await < first,
        "nothing acknowledged"
    );
    assert!(untrusting.is_running(), "retried, not fatal");
    untrusting.kill9();
    outbox.wait_slot_active(false).await;

    // The CA that signed it: the backlog, then events written while it runs.
    let mut relay = relay_trusting(&pki.ca());
    let sqs = sns::sqs_client(moto.as_str()).await;
    let mut received = next(&sqs, &topic, expected.len()).await;
    expected.extend(insert_signed(&outbox, 1, 3).await);
    received.extend(next(&sqs, &topic, 3).await);
    assert_eq!(
        envelopes(&received),
        expected,
        "all of them, in commit order"
    );
    all_published_then_stop(&outbox, &mut relay, 9).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_an_https_proxy_every_event_arrives_and_no_proxy_goes_direct() {
    let moto = sns::moto_endpoint().await;
    let outbox = Outbox::new().await;
    let topic = fifo(&outbox, moto.as_str()).await;
    let pki = harness::TestPki::new();
    let front = harness::HttpsFront::start(moto.as_str(), &pki).await;
    let proxy = harness::ConnectProxy::start().await;
    let endpoint = front.endpoint();
    let config = outbox.config_file(&sns_toml(&endpoint, &topic.arn, ""));
    let relay_with = |extra: &[(&'static str, String)]| {
        let mut env = sns::aws_env(&endpoint);
        env.push(("AWS_CA_BUNDLE", pki.ca().to_str().unwrap().to_owned()));
        env.push((
            "HTTPS_PROXY",
            proxy.url().replace("http://", "http://relay:s%3Acret@"),
        ));
        env.extend(extra.iter().cloned());
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        RelayProcess::spawn(&["run", "--config", config.to_str().unwrap()], &env)
    };
    let sqs = sns::sqs_client(moto.as_str()).await;

    // Through the proxy: a tunnel to the endpoint, with the proxy credentials.
    let mut relay = relay_with(&[]);
    outbox.wait_slot_active(true).await;
    let mut expected = insert_signed(&outbox, 2, 3).await;
    let mut received = next(&sqs, &topic, expected.len()).await;
    let tunnels = proxy.tunnels();
    assert!(!tunnels.is_empty(), "the relay went through the proxy");
    let port = endpoint.rsplit(':').next().unwrap();
    for (target, authorization) in &tunnels {
        assert_eq!(target, &format!("localhost:{port}"));
        // base64("relay:s:cret")
        assert_eq!(authorization.as_deref(), Some("Basic cmVsYXk6czpjcmV0"));
    }
    relay.sigterm();
    relay.wait_exit_async(Duration::from_secs(20)).await;

    // NO_PROXY naming the endpoint's host: straight there, no new tunnel.
    let mut direct = relay_with(&[("NO_PROXY", "example.com,localhost".to_owned())]);
    outbox.wait_slot_active(true).await;
    let more = insert_signed(&outbox, 1, 3).await;
    received.extend(next(&sqs, &topic, more.len()).await);
    expected.extend(more);
    assert_eq!(
        envelopes(&received),
        expected,
        "all of them, in commit order"
    );
    assert_eq!(
        proxy.tunnels().len(),
        tunnels.len(),
        "no tunnel with NO_PROXY"
    );
    all_published_then_stop(&outbox, &mut direct, 9).await;
}

/// Two outbox tables (in two databases) share one claim-check bucket, and
/// each has an event with the same id and a large payload of its own: both
/// payloads are kept, and the official Extended Client reads each event's
/// own payload back from its queue, after both were stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tables_sharing_a_payload_bucket_keep_both_payloads_of_one_event_id() {
    let moto = sns::moto_endpoint().await;
    let endpoint = moto.to_string();
    let first = Outbox::new().await;
    let second = Outbox::new().await;
    let bucket = payload_bucket(&endpoint, &first, "shared").await;
    let id = "3b8e6f7a-2d0c-4f5e-9a1b-c0ffee000042";
    let mut queues = Vec::new();
    for (outbox, fill) in [(&first, "first "), (&second, "second ")] {
        let topic = sns::topic_with_queue(&endpoint, outbox.db.name(), false, true).await;
        let relay = start(outbox, &claim_check_toml(&endpoint, &topic.arn, &bucket)).await;
        let payload: String = outbox
            .sql
            .query_one(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ($1::text::uuid, 'order', 'a', 'Large', jsonb_build_object('blob', repeat($2, 60 * 1024))) \
                 RETURNING payload::text",
                &[&id, &fill],
            )
            .await
            .unwrap()
            .get(0);
        let (state, _, error) = crate::sqs::recorded(outbox, id).await;
        assert_eq!(state, "PUBLISHED", "{error}");
        let summary = relay.stop().await;
        assert_eq!((summary.delivered, summary.rejected), (1, 0));
        queues.push((topic.queue_url, payload));
    }
    // Both payloads are stored before either message is read.
    for (queue, payload) in queues {
        let got = receive_extended(&endpoint, &queue, 1).await;
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0]["attributes"]["event_id"].as_str(), Some(id));
        assert!(
            got[0]["body"].as_str().unwrap() == payload,
            "each table's event reads its own payload, not the other's"
        );
    }
}
