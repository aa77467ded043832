//! The `kinesis` sink: `PutRecords` to Amazon Kinesis Data Streams (AWS
//! JSON 1.1).
//!
//! Each event becomes one record: `Data` = the envelope, `PartitionKey` =
//! the event's ordering group (the aggregate id unless configured; its
//! SHA-256 when longer than Kinesis's 256 characters), so a group's records
//! go to one shard, where Kinesis keeps them in the order they were written.
//!
//! Per-record failures (`ProvisionedThroughputExceededException` when a
//! shard is over its write limit, `InternalFailure`) are retried by the
//! publisher, with the later records of the group after them. Kinesis has no
//! deduplication, so a later record it took in the same call would stay
//! ahead of the failed one: with `kinesis.strict_order` (the default) a call
//! holds at most one record of each group, and that cannot happen.
//!
//! Limits, as Kinesis documents them today: 500 records a call, a record
//! (data and partition key) up to the stream's `MaxRecordSizeInKiB` (1 MiB
//! unless raised to up to 10 MiB: `kinesis.max_record_size`), a call up to
//! 10 MiB; the relay keeps calls within 5 MiB, the limit before the raise,
//! which every endpoint takes. A stream that does not exist rejects its
//! records ([`crate::sink::aws::errors`]).

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;

use crate::pipeline::sink::Message;
use crate::sink::aws::batch::{
    positional, Answer, BatchSink, Batches, Fixed, Positional, Protocol,
};
use crate::sink::aws::{self, json, SetupError};

pub(crate) mod config;

pub(crate) use config::KinesisConfig;

/// Publishes to Kinesis Data Streams.
pub(crate) type KinesisSink = BatchSink<PutRecords, Fixed>;

impl KinesisSink {
    /// A sink for `config` (validated).
    pub async fn new(config: &KinesisConfig) -> Result<Self, SetupError> {
        let client = aws::client(
            aws::KINESIS,
            "kinesis",
            aws::Calls {
                region: config.region_or_arn(),
                region_key: "kinesis.region",
                endpoint_url: &config.endpoint_url,
                endpoint_key: "kinesis.endpoint_url",
                max_in_flight: config.max_in_flight_batches,
                operation_timeout: config.operation_timeout,
                attempt_timeout: config.attempt_timeout,
            },
        )
        .await?;
        let protocol = PutRecords {
            strict_order: config.strict_order,
        };
        Ok(BatchSink::assemble(
            "kinesis",
            Batches::new(
                client,
                protocol,
                config.operation_timeout,
                config.retry_unknown_errors_for,
            ),
            (config.concurrency(), config.linger),
            Fixed(config.max_record_size),
            if config.strict_order { 1 } else { usize::MAX },
        ))
    }
}

/// Kinesis's `PutRecords`.
pub struct PutRecords {
    strict_order: bool,
}

/// The partition key of `message`: its ordering group, within Kinesis's 1 to
/// 256 characters (longer: its SHA-256 in hex; empty: the event id).
fn partition_key(message: &Message) -> Cow<'_, str> {
    let group = message.event.group();
    let group = if group.is_empty() {
        message.event.id()
    } else {
        group
    };
    if group.chars().count() <= 256 {
        return Cow::Borrowed(group);
    }
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(group.as_bytes());
    Cow::Owned(digest.iter().map(|b| format!("{b:02x}")).collect())
}

#[derive(Serialize)]
struct Request<'a> {
    #[serde(rename = "StreamName", skip_serializing_if = "Option::is_none")]
    stream_name: Option<&'a str>,
    #[serde(rename = "StreamARN", skip_serializing_if = "Option::is_none")]
    stream_arn: Option<&'a str>,
    #[serde(rename = "Records")]
    records: Vec<Record<'a>>,
}

#[derive(Serialize)]
struct Record<'a> {
    #[serde(rename = "Data")]
    data: String,
    #[serde(rename = "PartitionKey")]
    partition_key: Cow<'a, str>,
}

impl Protocol for PutRecords {
    const WHAT: &'static str = "stream";
    const TARGET: &'static str = "Kinesis_20131202.PutRecords";
    const CONTENT_TYPE: &'static str = json::JSON_11;
    const MAX_ENTRIES: usize = 500;
    const MAX_REQUEST_BYTES: usize = 5 << 20;

    fn size(&self, message: &Message) -> Result<usize, String> {
        Ok(message.body.len() + partition_key(message).len())
    }

    fn body(&self, stream: &str, entries: &[&Message]) -> Vec<u8> {
        let arn = stream.starts_with("arn:");
        let records = entries
            .iter()
            .map(|message| Record {
                data: base64::engine::general_purpose::STANDARD.encode(&message.body),
                partition_key: partition_key(message),
            })
            .collect();
        serde_json::to_vec(&Request {
            stream_name: (!arn).then_some(stream),
            stream_arn: arn.then_some(stream),
            records,
        })
        .expect("a request of strings serialises")
    }

    fn answers(&self, body: &[u8], entries: usize) -> Result<Vec<Option<Answer>>, String> {
        #[derive(Deserialize)]
        struct Answers {
            #[serde(rename = "Records", default)]
            records: Vec<Positional>,
        }
        let answers: Answers = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        Ok(positional(answers.records, entries))
    }

    fn one_per_group(&self, _stream: &str) -> bool {
        self.strict_order
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::sink::{Cause, Outcome, Retry};
    use crate::sink::aws::errors::{classify, Class};
    use std::time::Duration;

    fn message(id: &str, group: &str) -> Message {
        Message::for_test(id, group, &format!("{{\"id\":\"{id}\"}}"), "s")
    }

    #[tokio::test]
    async fn records_behind_a_failed_one_wait_unsent_and_take_none_of_its_failure() {
        // Every record fails with a code nobody knows: retried for
        // `retry_unknown_errors_for` (zero here), then recorded.
        let (url, seen) = crate::sink::aws::local::endpoint(|_| {
            crate::sink::aws::local::json_ok(
                r#"{"FailedRecordCount":1,"Records":[{"ErrorCode":"NewKindOfFailure","ErrorMessage":"?"}]}"#,
            )
        })
        .await;
        let client = crate::sink::aws::local::client(aws::KINESIS, &url);
        let batches = Batches::new(
            client,
            PutRecords { strict_order: true },
            Duration::from_secs(5),
            Duration::ZERO,
        );
        // Strict order: a-1 alone, then a-2 with b-1 in the next call.
        let batch = [
            message("a-1", "a"),
            message("a-2", "a"),
            message("b-1", "b"),
        ];
        let outcomes = batches.publish(&batch, 1 << 20).await;
        assert_eq!(
            seen.bodies.lock().unwrap().len(),
            1,
            "the second call waits"
        );
        assert!(
            matches!(&outcomes[0], Outcome::Rejected(reason) if reason.contains("NewKindOfFailure")),
            "{:?}",
            outcomes[0]
        );
        for outcome in &outcomes[1..] {
            assert!(
                matches!(outcome, Outcome::Retryable(Retry { cause: Cause::Other, reason }) if reason.starts_with("not sent")),
                "never sent, so never failed: {outcome:?}"
            );
        }
    }

    #[test]
    fn per_record_failures_are_positional_and_classified() {
        let p = PutRecords { strict_order: true };
        let answers = p
            .answers(
                br#"{"FailedRecordCount":1,"Records":[{"SequenceNumber":"1","ShardId":"s"},
                    {"ErrorCode":"ProvisionedThroughputExceededException","ErrorMessage":"Rate exceeded for shard"}]}"#,
                2,
            )
            .unwrap();
        assert_eq!(answers[0], Some(Answer::Accepted));
        let Some(Answer::Failed { code, .. }) = &answers[1] else {
            panic!("{answers:?}")
        };
        assert_eq!(classify(None, Some(code), None), Class::Throttled);
        assert_eq!(
            classify(None, Some("InternalFailure"), None),
            Class::Unavailable
        );
        assert_eq!(
            classify(Some(400), Some("ResourceNotFoundException"), None),
            Class::Missing
        );
    }
}
