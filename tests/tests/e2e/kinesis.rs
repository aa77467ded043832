//! The Kinesis sink, run as users run it (the binary, AWS settings from the
//! standard environment), against moto: streams of two shards, read back
//! from every shard from `TRIM_HORIZON`.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use harness::aws_json::{self, StreamRecord};
use harness::proxy::{FaultProxy, Mode};
use harness::sns;

use crate::outbox::Outbox;
use crate::sns::insert;
use crate::sqs::{
    assert_all_arrived_in_order, envelopes, insert_routed, outage_holds_the_slot, recorded,
    settled, spawn_relay,
};

fn kinesis_toml(stream: &str, extra: &str) -> String {
    format!(
        "[sink]\nkind = \"kinesis\"\n[kinesis]\nstream = \"{stream}\"\n{extra}\n[retry]\nmax = \"1s\"\n"
    )
}

/// A stream of two shards named after the test's database (plus `suffix`).
async fn stream(moto: &str, outbox: &Outbox, suffix: &str) -> (String, String) {
    let name = format!("{}{suffix}", outbox.db.name());
    let arn = aws_json::create_stream(moto, &name, 2).await;
    (name, arn)
}

/// Reads `stream` (every shard, from the start) until records of `n`
/// distinct events are there (30 s at most).
async fn read(moto: &str, stream: &str, n: usize) -> Vec<StreamRecord> {
    let mut reader = aws_json::StreamReader::new(moto, stream).await;
    let mut got = Vec::new();
    let mut ids = HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while ids.len() < n && Instant::now() < deadline {
        let more = reader.poll().await;
        ids.extend(
            envelopes(more.iter().map(|r| r.data.as_slice()))
                .into_iter()
                .map(|(id, _)| id),
        );
        got.extend(more);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Each shard's records in sequence order, shard by shard.
    got.sort_by(|a, b| {
        a.shard
            .cmp(&b.shard)
            .then_with(|| a.sequence.cmp(&b.sequence))
    });
    got
}

/// `(id, subject)` of each record's envelope, in the order read (shard by
/// shard, each in sequence order); checks that the partition key is the
/// subject (the aggregate id).
fn records(records: &[StreamRecord]) -> Vec<(String, String)> {
    let got = envelopes(records.iter().map(|r| r.data.as_slice()));
    for (r, (_, subject)) in records.iter().zip(&got) {
        assert_eq!(
            &r.partition_key, subject,
            "the partition key is the aggregate id"
        );
    }
    got
}

/// 2,000 events over 20 aggregates into a stream of two shards, the endpoint
/// given as `AWS_ENDPOINT_URL_KINESIS`: one record each, the partition key
/// the aggregate id, each aggregate in one shard and there in commit order
/// (by sequence number); both shards are used; the slot then passes the
/// last commit and every row is PUBLISHED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_events_of_twenty_aggregates_reach_two_shards_each_aggregate_in_commit_order()
{
    let moto = sns::moto_endpoint().await;
    let outbox = Outbox::new().await;
    let (name, _) = stream(&moto, &outbox, "").await;
    let config = outbox.config_file(&kinesis_toml(&name, ""));
    let mut relay = spawn_relay(&config, Some(("AWS_ENDPOINT_URL_KINESIS", &moto)));
    outbox.wait_slot_active(true).await;
    let started = std::time::Instant::now();
    let expected = insert(&outbox, 200, 10, 20).await;
    let got = read(&moto, &name, expected.len()).await;
    eprintln!("read {} in {:?}", got.len(), started.elapsed());
    // Shard by shard, each in sequence order: an aggregate's order is its
    // shard's.
    assert_all_arrived_in_order(&expected, &records(&got), &relay);
    let mut shards: HashMap<&str, HashSet<&str>> = HashMap::new();
    for r in &got {
        shards
            .entry(r.partition_key.as_str())
            .or_default()
            .insert(r.shard.as_str());
    }
    assert!(
        shards.values().all(|s| s.len() == 1),
        "each aggregate in one shard: {shards:?}"
    );
    let used: HashSet<&str> = got.iter().map(|r| r.shard.as_str()).collect();
    assert_eq!(used.len(), 2, "20 aggregates spread over both shards");
    settled(&outbox, expected.len()).await;
    relay.stop_gracefully().await;
}

/// Kinesis cannot be reached (connections cut; the stream named by its ARN,
/// the endpoint in the file): nothing is confirmed past the first
/// undelivered commit and nothing is marked published; when it can be
/// reached again, everything arrives in order and the slot catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_endpoint_loses_nothing_and_the_slot_waits_for_it() {
    let moto = sns::moto_endpoint().await;
    let proxy = FaultProxy::start(&moto);
    let outbox = Outbox::new().await;
    let (name, arn) = stream(&moto, &outbox, "").await;
    let config = outbox.config_file(&kinesis_toml(
        &arn,
        &format!("endpoint_url = \"{}\"", proxy.endpoint()),
    ));
    let mut relay = spawn_relay(&config, None);
    outbox.wait_slot_active(true).await;

    let mut expected = insert(&outbox, 10, 5, 4).await;
    read(&moto, &name, expected.len()).await;
    let during = outage_holds_the_slot(&outbox, &proxy, || insert(&outbox, 20, 5, 4)).await;
    let written: HashSet<String> = records(&aws_json::read_stream(&moto, &name).await)
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    assert!(
        during.iter().all(|(id, _)| !written.contains(id)),
        "nothing was written during the outage"
    );
    proxy.set_mode(Mode::Pass);
    expected.extend(during);

    let got = read(&moto, &name, expected.len()).await;
    assert_all_arrived_in_order(&expected, &records(&got), &relay);
    settled(&outbox, expected.len()).await;
    relay.stop_gracefully().await;
}

/// One event routed (row `topic`) to a stream that does not exist is
/// recorded FAILED saying so; one routed to another stream by name arrives
/// there; the events around them, of their aggregates too, reach the
/// default stream, and the slot moves past all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_for_a_stream_that_does_not_exist_is_recorded_failed_and_the_stream_moves_on() {
    let moto = sns::moto_endpoint().await;
    let outbox = Outbox::new().await;
    let (name, _) = stream(&moto, &outbox, "").await;
    let (other, _) = stream(&moto, &outbox, "_other").await;
    let missing = format!("{}_missing", outbox.db.name());
    let config = outbox.config_file(&kinesis_toml(&name, ""));
    let mut relay = spawn_relay(&config, Some(("AWS_ENDPOINT_URL_KINESIS", &moto)));
    outbox.wait_slot_active(true).await;

    let mut expected = insert(&outbox, 2, 5, 2).await;
    let lost = insert_routed(&outbox, "agg-0", "Lost", &missing).await;
    let elsewhere = insert_routed(&outbox, "agg-1", "Elsewhere", &other).await;
    expected.extend(insert(&outbox, 2, 5, 2).await);

    let got = read(&moto, &name, expected.len()).await;
    assert_all_arrived_in_order(&expected, &records(&got), &relay);
    let routed: HashSet<(String, String)> =
        records(&read(&moto, &other, 1).await).into_iter().collect();
    assert_eq!(
        routed,
        HashSet::from([(elsewhere, "agg-1".to_owned())]),
        "the row naming another stream went there"
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
