//! The SNS/SQS side of the harness works: moto answers SNS and SQS, a FIFO
//! topic delivers to its FIFO queue with group and deduplication ids, and the
//! fault proxy injects the errors the relay must survive. These tests also pin
//! down the moto behaviour the relay tests rely on (see `harness::sns`).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use aws_sdk_sns::error::{ProvideErrorMetadata as _, SdkError};
use aws_sdk_sns::types::{MessageAttributeValue, PublishBatchRequestEntry};
use harness::{
    moto_endpoint, queue_depth, receive_all, sdk_config, sns_client, sqs_client, topic_with_queue,
    unique_name, FaultProxy, Mode,
};

const RECEIVE_TIMEOUT: Duration = Duration::from_secs(15);

fn string_attr(value: &str) -> MessageAttributeValue {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .unwrap()
}

/// An SNS client without SDK retries: one request per call.
async fn sns_client_without_retries(endpoint: &str) -> aws_sdk_sns::Client {
    let config = aws_sdk_sns::config::Builder::from(&sdk_config(endpoint).await)
        .retry_config(aws_sdk_sns::config::retry::RetryConfig::disabled())
        .build();
    aws_sdk_sns::Client::from_conf(config)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_published_to_a_fifo_topic_arrives_in_its_fifo_queue_with_its_group() {
    let moto = moto_endpoint().await;
    let topic = topic_with_queue(&moto, &unique_name("t_"), true, false).await;
    assert!(topic.arn.ends_with(".fifo"), "{}", topic.arn);
    assert!(
        topic.arn.starts_with("arn:aws:sns:us-east-1:123456789012:"),
        "{}",
        topic.arn
    );
    let sns = sns_client(&moto).await;
    let sqs = sqs_client(&moto).await;

    // Two groups, interleaved; each message with attributes.
    let mut message_ids = HashMap::new();
    for i in 0..6 {
        let group = format!("agg-{}", i % 2);
        let out = sns
            .publish()
            .topic_arn(&topic.arn)
            .message(format!(r#"{{"n":{i}}}"#))
            .message_group_id(&group)
            .message_deduplication_id(format!("ev-{i}"))
            .message_attributes("event_type", string_attr("order.created"))
            .message_attributes(
                "n",
                MessageAttributeValue::builder()
                    .data_type("Number")
                    .string_value(i.to_string())
                    .build()
                    .unwrap(),
            )
            .send()
            .await
            .unwrap();
        message_ids.insert(format!("ev-{i}"), out.message_id.unwrap());
    }
    // Same deduplication id again: SNS accepts it, the FIFO queue drops it.
    let dup = sns
        .publish()
        .topic_arn(&topic.arn)
        .message("duplicate")
        .message_group_id("agg-0")
        .message_deduplication_id("ev-0")
        .send()
        .await
        .unwrap();
    assert!(dup.message_id.is_some());

    let got = receive_all(&sqs, &topic.queue_url, 6, RECEIVE_TIMEOUT).await;
    assert_eq!(got.len(), 6, "{got:#?}");
    for group in ["agg-0", "agg-1"] {
        let bodies: Vec<&str> = got
            .iter()
            .filter(|r| r.group_id.as_deref() == Some(group))
            .map(|r| r.body.as_str())
            .collect();
        let expected: Vec<String> = (0..6)
            .filter(|i| format!("agg-{}", i % 2) == group)
            .map(|i| format!(r#"{{"n":{i}}}"#))
            .collect();
        assert_eq!(bodies, expected, "order within {group}");
    }
    for r in &got {
        let dedup = r.dedup_id.as_deref().expect("a deduplication id");
        assert_eq!(r.message_id.as_ref(), Some(&message_ids[dedup]), "{r:?}");
        assert_eq!(r.attributes["event_type"], "order.created", "{r:?}");
        assert_eq!(r.body, format!(r#"{{"n":{}}}"#, r.attributes["n"]), "{r:?}");
        assert!(r.sequence.is_some(), "{r:?}");
    }
    // Nothing else arrives (the duplicate was dropped).
    assert!(
        receive_all(&sqs, &topic.queue_url, 0, Duration::from_secs(2))
            .await
            .is_empty()
    );
    assert_eq!(queue_depth(&sqs, &topic.queue_url).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_batch_to_a_fifo_topic_fails_only_the_oversized_entry() {
    let moto = moto_endpoint().await;
    let topic = topic_with_queue(&moto, &unique_name("t_"), true, true).await;
    let sns = sns_client(&moto).await;
    let sqs = sqs_client(&moto).await;

    let entry = |id: &str, group: &str, message: String| {
        PublishBatchRequestEntry::builder()
            .id(id)
            .message(message)
            .message_group_id(group)
            .message_deduplication_id(format!("dedup-{id}"))
            .message_attributes("event_type", string_attr(&format!("type-{id}")))
            .build()
            .unwrap()
    };
    // 256 KiB exactly passes, one character more fails (moto counts
    // characters and ignores attributes).
    let out = sns
        .publish_batch()
        .topic_arn(&topic.arn)
        .publish_batch_request_entries(entry("a", "g1", "first".into()))
        .publish_batch_request_entries(entry("big", "g1", "x".repeat(256 * 1024 + 1)))
        .publish_batch_request_entries(entry("b", "g2", "y".repeat(256 * 1024)))
        .publish_batch_request_entries(entry("c", "g1", "third".into()))
        .send()
        .await
        .unwrap();
    let ok: Vec<&str> = out.successful().iter().filter_map(|s| s.id()).collect();
    assert_eq!(ok, ["a", "b", "c"]);
    assert!(out.successful().iter().all(|s| s.message_id().is_some()));
    let failed = out.failed();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0].id(), "big");
    assert_eq!(failed[0].code(), "InvalidParameter");
    assert!(failed[0].sender_fault());

    // Raw delivery: the body is the message, the attributes are SQS message
    // attributes; group and deduplication ids are the entry's.
    let got = receive_all(&sqs, &topic.queue_url, 3, RECEIVE_TIMEOUT).await;
    let mut seen: Vec<(String, String, String, usize)> = got
        .iter()
        .map(|r| {
            (
                r.dedup_id.clone().unwrap(),
                r.group_id.clone().unwrap(),
                r.attributes["event_type"].clone(),
                r.body.len(),
            )
        })
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        [
            ("dedup-a".into(), "g1".into(), "type-a".into(), 5),
            ("dedup-b".into(), "g2".into(), "type-b".into(), 256 * 1024),
            ("dedup-c".into(), "g1".into(), "type-c".into(), 5),
        ]
    );
    assert!(
        got.iter().all(|r| r.message_id.is_none()),
        "raw delivery has no SNS MessageId"
    );

    // More than 10 entries: the whole call fails.
    let mut eleven = sns.publish_batch().topic_arn(&topic.arn);
    for i in 0..11 {
        eleven = eleven.publish_batch_request_entries(entry(&i.to_string(), "g", "m".into()));
    }
    let err = eleven.send().await.unwrap_err();
    assert_eq!(err.code(), Some("TooManyEntriesInBatchRequest"), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishing_to_a_missing_topic_fails_with_not_found() {
    let moto = moto_endpoint().await;
    let sns = sns_client(&moto).await;
    let arn = format!(
        "arn:aws:sns:us-east-1:123456789012:{}.fifo",
        unique_name("missing_")
    );
    let err = sns
        .publish()
        .topic_arn(&arn)
        .message("m")
        .message_group_id("g")
        .message_deduplication_id("d")
        .send()
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("NotFound"), "{err:?}");
    assert!(matches!(err, SdkError::ServiceError(_)), "{err:?}");
    assert!(
        err.as_service_error().unwrap().is_not_found_exception(),
        "{err:?}"
    );

    let err = sns
        .publish_batch()
        .topic_arn(&arn)
        .publish_batch_request_entries(
            PublishBatchRequestEntry::builder()
                .id("1")
                .message("m")
                .message_group_id("g")
                .message_deduplication_id("d")
                .build()
                .unwrap(),
        )
        .send()
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("NotFound"), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttling_proxy_yields_a_throttling_error_code() {
    let moto = moto_endpoint().await;
    let topic = topic_with_queue(&moto, &unique_name("t_"), false, false).await;
    let proxy = FaultProxy::start(&moto);
    let sns = sns_client(&proxy.endpoint()).await;

    proxy.set_mode(Mode::Throttle);
    let started = Instant::now();
    let err = sns
        .publish()
        .topic_arn(&topic.arn)
        .message("m")
        .send()
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("Throttling"), "{err:?}");
    assert_eq!(err.message(), Some("Rate exceeded"), "{err:?}");
    assert_eq!(err.raw_response().map(|r| r.status().as_u16()), Some(400));
    // The SDK's standard retry mode retried the throttled call (3 attempts).
    assert_eq!(proxy.requests_seen(), 3, "elapsed {:?}", started.elapsed());
    assert_eq!(proxy.faults_injected(), 3);
    assert_eq!(proxy.actions(), ["Publish", "Publish", "Publish"]);

    proxy.set_mode(Mode::ServerError);
    let sns_once = sns_client_without_retries(&proxy.endpoint()).await;
    let err = sns_once
        .publish()
        .topic_arn(&topic.arn)
        .message("m")
        .send()
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("InternalError"), "{err:?}");
    assert_eq!(err.raw_response().map(|r| r.status().as_u16()), Some(500));

    // SQS (AWS JSON protocol) gets its error code through the proxy too.
    proxy.set_mode(Mode::Throttle);
    let sqs = aws_sdk_sqs::Client::from_conf(
        aws_sdk_sqs::config::Builder::from(&sdk_config(&proxy.endpoint()).await)
            .retry_config(aws_sdk_sqs::config::retry::RetryConfig::disabled())
            .build(),
    );
    let err = sqs
        .get_queue_url()
        .queue_name("anything")
        .send()
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("Throttling"), "{err:?}");

    proxy.set_mode(Mode::Pass);
    sns.publish()
        .topic_arn(&topic.arn)
        .message("through")
        .send()
        .await
        .unwrap();
    let got = receive_all(
        &sqs_client(&moto).await,
        &topic.queue_url,
        1,
        RECEIVE_TIMEOUT,
    )
    .await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].body, "through");
    assert!(
        got[0].group_id.is_none() && got[0].sequence.is_none(),
        "{:?}",
        got[0]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_proxy_yields_a_dispatch_error_and_recovers_in_pass_mode() {
    let moto = moto_endpoint().await;
    let topic = topic_with_queue(&moto, &unique_name("t_"), true, false).await;
    let proxy = FaultProxy::start(&moto);
    let sns = sns_client_without_retries(&proxy.endpoint()).await;
    let publish = |n: u32| {
        sns.publish()
            .topic_arn(&topic.arn)
            .message(format!("m{n}"))
            .message_group_id("g")
            .message_deduplication_id(format!("d{n}"))
            .send()
    };

    // A kept-alive connection exists, then the endpoint goes away.
    publish(1).await.unwrap();
    proxy.set_mode(Mode::Cut);
    let started = Instant::now();
    let err = publish(2).await.unwrap_err();
    assert!(matches!(err, SdkError::DispatchFailure(_)), "{err:?}");
    assert!(err.code().is_none(), "{err:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert!(proxy.faults_injected() >= 1);

    proxy.set_mode(Mode::Pass);
    publish(3).await.unwrap();
    let got = receive_all(
        &sqs_client(&moto).await,
        &topic.queue_url,
        2,
        RECEIVE_TIMEOUT,
    )
    .await;
    let bodies: Vec<&str> = got.iter().map(|r| r.body.as_str()).collect();
    assert_eq!(bodies, ["m1", "m3"]);
}
