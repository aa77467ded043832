//! The EventBridge sink, run as users run it (the binary, AWS settings from
//! the standard environment), against moto: a bus with a rule that forwards
//! the relay's events (matched on `source`) to an SQS queue, where each
//! arrives as the EventBridge event whose `detail` is the envelope.
//!
//! Each test has a moto server of its own ([`Moto`], running
//! `tests/data/moto_server.py`): a rule costs moto ~4 ms an event, which
//! 2,000 events would take from the shared server's other tests.

use std::time::Duration;

use harness::aws_json::{self, BusQueue};
use harness::proxy::{FaultProxy, Mode};
use harness::sns::{self, Received};
use harness::Moto;

use crate::outbox::Outbox;
use crate::sns::insert;
use crate::sqs::{
    all_rows, assert_all_arrived_in_order, insert_paced, insert_routed, outage_holds_the_slot,
    publish_states, recorded, settled, slot_passes_last_commit, spawn_relay, QueueReader,
};

/// The `source` of the relay's events here, which the bus's rule matches.
const SOURCE: &str = "com.example.orders";

fn eventbridge_toml(bus: &str, extra: &str) -> String {
    format!(
        "[sink]\nkind = \"eventbridge\"\n[eventbridge]\nbus = \"{bus}\"\nsource = \"{SOURCE}\"\n\
         {extra}\n[retry]\nmax = \"1s\"\n"
    )
}

/// A moto server of the test's own, and a bus on it named after the test's
/// database whose rule sends [`SOURCE`]'s events to a queue.
async fn bus(outbox: &Outbox) -> (Moto, BusQueue) {
    let moto = tokio::task::spawn_blocking(Moto::start)
        .await
        .expect("start moto");
    let bus = aws_json::bus_to_queue(&moto.endpoint(), outbox.db.name(), SOURCE).await;
    (moto, bus)
}

/// The event id of a message the bus delivered (its detail's `id`).
fn detail_id(r: &Received) -> String {
    aws_json::eventbridge_event(&r.body).detail["id"]
        .as_str()
        .expect("the envelope's id")
        .to_owned()
}

/// `(id, subject)` of the envelope in each delivered event's `detail`;
/// checks `source` and `detail-type` on the way.
fn delivered(received: &[Received], detail_type: &str) -> Vec<(String, String)> {
    received
        .iter()
        .map(|r| {
            let event = aws_json::eventbridge_event(&r.body);
            assert_eq!(event.source, SOURCE, "{event:?}");
            assert_eq!(event.detail_type, detail_type, "{event:?}");
            let detail = &event.detail;
            assert!(
                detail.is_object(),
                "detail is the envelope object: {event:?}"
            );
            (
                detail["id"].as_str().expect("the envelope's id").to_owned(),
                detail["subject"]
                    .as_str()
                    .expect("the envelope's subject")
                    .to_owned(),
            )
        })
        .collect()
}

/// 400 events over 20 aggregates (40 transactions of ten, so batches fill and
/// interleave aggregates), the endpoint given as
/// `AWS_ENDPOINT_URL_EVENTBRIDGE` and `DetailType` as a template: each
/// reaches the rule's queue, with the configured source and detail type and
/// the CloudEvents envelope as its detail, each aggregate's in commit order
/// (moto delivers in `PutEvents` order; EventBridge does not promise an
/// order); the slot then passes the last commit and every row is PUBLISHED.
/// Sized to show order over many batches in seconds: a rule costs moto ~4 ms
/// an event (2,000 took 42 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_hundred_events_of_twenty_aggregates_reach_the_rules_queue_each_aggregate_in_commit_order(
) {
    let outbox = Outbox::new().await;
    let (moto, bus) = bus(&outbox).await;
    let config = outbox.config_file(&eventbridge_toml(
        &bus.bus,
        "detail_type = \"{aggregate_type}.{event_type}\"",
    ));
    let mut relay = spawn_relay(
        &config,
        Some(("AWS_ENDPOINT_URL_EVENTBRIDGE", &moto.endpoint())),
    );
    outbox.wait_slot_active(true).await;
    let sqs = sns::sqs_client(&moto.endpoint()).await;
    let started = std::time::Instant::now();
    let reader = QueueReader::start(&sqs, &bus.queue_url, 400, detail_id);
    let expected = insert_paced(&outbox, 40, 10, 20, &reader).await;
    let received = reader.finish().await;
    eprintln!("received {} in {:?}", received.len(), started.elapsed());
    assert_all_arrived_in_order(&expected, &delivered(&received, "order.E"), &relay);
    settled(&outbox, expected.len()).await;
    relay.stop_gracefully().await;
}

/// EventBridge cannot be reached (connections cut; the bus named by its ARN,
/// the endpoint in the file): nothing is confirmed past the first
/// undelivered commit and nothing is marked published; when it can be
/// reached again, everything arrives in order and the slot catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_endpoint_loses_nothing_and_the_slot_waits_for_it() {
    let outbox = Outbox::new().await;
    let (moto, bus) = bus(&outbox).await;
    let proxy = FaultProxy::start(&moto.endpoint());
    let config = outbox.config_file(&eventbridge_toml(
        &bus.bus_arn,
        &format!("endpoint_url = \"{}\"", proxy.endpoint()),
    ));
    let mut relay = spawn_relay(&config, None);
    outbox.wait_slot_active(true).await;
    let sqs = sns::sqs_client(&moto.endpoint()).await;

    let reader = QueueReader::start(&sqs, &bus.queue_url, 50 + 100, detail_id);
    let mut expected = insert(&outbox, 10, 5, 4).await;
    reader.wait_for(expected.len()).await;
    expected.extend(outage_holds_the_slot(&outbox, &proxy, || insert(&outbox, 20, 5, 4)).await);
    assert_eq!(
        reader.count(),
        50,
        "nothing reached the bus during the outage"
    );
    proxy.set_mode(Mode::Pass);
    let received = reader.finish().await;
    assert_all_arrived_in_order(&expected, &delivered(&received, "E"), &relay);
    settled(&outbox, expected.len()).await;
    relay.stop_gracefully().await;
}

/// EventBridge answers nothing but errors (the bus cannot be verified:
/// `DescribeEventBus` fails with 500): no `PutEvents` is even attempted,
/// since a bus that does not exist takes events and drops them, nothing is
/// confirmed or marked; once the bus can be verified every event arrives in
/// order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bus_that_cannot_be_verified_receives_nothing_until_it_is() {
    let outbox = Outbox::new().await;
    let (moto, bus) = bus(&outbox).await;
    let proxy = FaultProxy::start(&moto.endpoint());
    proxy.set_mode(Mode::ServerError);
    let config = outbox.config_file(&eventbridge_toml(
        &bus.bus,
        &format!("endpoint_url = \"{}\"", proxy.endpoint()),
    ));
    let mut relay = spawn_relay(&config, None);
    outbox.wait_slot_active(true).await;
    let mut expected = insert(&outbox, 1, 5, 4).await;
    // The first transaction's commit ends before this.
    let first_end = outbox.current_lsn().await;
    expected.extend(insert(&outbox, 9, 5, 4).await);
    harness::wait_until(Duration::from_secs(60), "the relay asks again", || async {
        let asked = proxy
            .actions()
            .iter()
            .filter(|a| a.as_str() == "DescribeEventBus")
            .count();
        // The start-up check and one asked again while events wait.
        (asked >= 2).then_some(())
    })
    .await;
    assert!(
        !proxy.actions().iter().any(|a| a == "PutEvents"),
        "nothing is sent to a bus not verified: {:?}",
        proxy.actions()
    );
    let confirmed = outbox.confirmed_flush().await;
    assert!(
        confirmed < first_end,
        "the slot is not confirmed past unverified events ({confirmed:X} ≥ {first_end:X})"
    );
    let states = publish_states(&outbox).await;
    assert!(states.keys().all(|s| s == "PENDING"), "{states:?}");
    proxy.set_mode(Mode::Pass);
    let sqs = sns::sqs_client(&moto.endpoint()).await;
    let received = QueueReader::start(&sqs, &bus.queue_url, expected.len(), detail_id)
        .finish()
        .await;
    assert_all_arrived_in_order(&expected, &delivered(&received, "E"), &relay);
    settled(&outbox, expected.len()).await;
    relay.stop_gracefully().await;
}

/// One event routed (row `topic`) to a bus that does not exist is recorded
/// FAILED saying so; the events around it, of its aggregate too, reach the
/// default bus, and the slot moves past all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_for_a_bus_that_does_not_exist_is_recorded_failed_and_the_stream_moves_on() {
    let outbox = Outbox::new().await;
    let (moto, bus) = bus(&outbox).await;
    let missing = format!("{}_missing", outbox.db.name());
    let config = outbox.config_file(&eventbridge_toml(&bus.bus, ""));
    let mut relay = spawn_relay(
        &config,
        Some(("AWS_ENDPOINT_URL_EVENTBRIDGE", &moto.endpoint())),
    );
    outbox.wait_slot_active(true).await;

    let mut expected = insert(&outbox, 2, 5, 2).await;
    let lost = insert_routed(&outbox, "agg-0", "Lost", &missing).await;
    expected.extend(insert(&outbox, 2, 5, 2).await);

    let sqs = sns::sqs_client(&moto.endpoint()).await;
    let received = QueueReader::start(&sqs, &bus.queue_url, expected.len(), detail_id)
        .finish()
        .await;
    assert_all_arrived_in_order(&expected, &delivered(&received, "E"), &relay);
    let (state, attempts, error) = recorded(&outbox, &lost).await;
    assert_eq!((state.as_str(), attempts), ("FAILED", 1), "{error}");
    assert!(
        error.contains(&missing) && error.contains("does not exist"),
        "{error}"
    );
    settled(&outbox, expected.len()).await;
    relay.stop_gracefully().await;
}

/// With `[envelope] format = "raw"` the payload is the detail: an object
/// arrives as it is; a payload that is a JSON array or string cannot be an
/// EventBridge detail and is recorded FAILED saying why, and the events
/// after it, of its aggregate, arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_payload_that_is_not_a_json_object_is_recorded_failed_and_the_stream_moves_on() {
    let outbox = Outbox::new().await;
    let (moto, bus) = bus(&outbox).await;
    let config = outbox.config_file(&eventbridge_toml(&bus.bus, "[envelope]\nformat = \"raw\""));
    let mut relay = spawn_relay(
        &config,
        Some(("AWS_ENDPOINT_URL_EVENTBRIDGE", &moto.endpoint())),
    );
    outbox.wait_slot_active(true).await;

    let rows = outbox
        .sql
        .query(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
             SELECT 'order', 'agg-0', t, p::jsonb \
             FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS u(t, p, n) ORDER BY n \
             RETURNING id::text, event_type",
            &[
                &vec!["Fine", "Array", "Fine", "Text", "Fine"],
                &vec![
                    r#"{"n": 1}"#,
                    r#"[1, 2]"#,
                    r#"{"n": 2, "note": "a \"quoted\" é"}"#,
                    r#""just text""#,
                    r#"{"n": 3}"#,
                ],
            ],
        )
        .await
        .unwrap();
    let not_objects: Vec<String> = rows
        .iter()
        .filter(|r| r.get::<_, &str>(1) != "Fine")
        .map(|r| r.get(0))
        .collect();

    let sqs = sns::sqs_client(&moto.endpoint()).await;
    let received = sns::receive_all(&sqs, &bus.queue_url, 3, Duration::from_secs(30)).await;
    let details: Vec<serde_json::Value> = received
        .iter()
        .map(|r| aws_json::eventbridge_event(&r.body).detail)
        .collect();
    assert_eq!(
        details,
        [
            serde_json::json!({"n": 1}),
            serde_json::json!({"n": 2, "note": "a \"quoted\" é"}),
            serde_json::json!({"n": 3}),
        ],
        "the object payloads, as they are, in commit order"
    );
    for id in &not_objects {
        let (state, attempts, error) = recorded(&outbox, id).await;
        assert_eq!((state.as_str(), attempts), ("FAILED", 1), "{error}");
        assert!(error.contains("JSON object"), "{error}");
    }
    slot_passes_last_commit(&outbox).await;
    // Marking runs behind delivery: wait for it.
    all_rows(&outbox, "PUBLISHED", 3).await;
    let states = publish_states(&outbox).await;
    assert_eq!(states.get("FAILED"), Some(&2), "{states:?}");
    relay.stop_gracefully().await;
}
