//! Raw AWS JSON-protocol calls (SQS, EventBridge, Kinesis) to a local moto
//! server, without an SDK per service: an EventBridge bus whose rule forwards
//! to an SQS queue ([`bus_to_queue`]), Kinesis streams ([`create_stream`])
//! and reading them back from every shard ([`read_stream`], [`StreamReader`]).
//!
//! ```no_run
//! use harness::aws_json::{self, bus_to_queue, create_stream, read_stream};
//! use harness::{moto_endpoint, unique_name};
//!
//! # async fn example() {
//! let moto = moto_endpoint().await; // keep it alive while it is used
//! let stream = unique_name("s_");
//! create_stream(&moto, &stream, 2).await;
//! aws_json::call(
//!     &moto,
//!     aws_json::KINESIS,
//!     "Kinesis_20131202.PutRecords",
//!     &serde_json::json!({"StreamName": stream, "Records": [{"Data": "aGk=", "PartitionKey": "a"}]}),
//! )
//! .await
//! .unwrap();
//! let records = read_stream(&moto, &stream).await;
//! assert_eq!(records[0].data, b"hi");
//! let bus = bus_to_queue(&moto, &unique_name("b_"), "outbox-relay").await;
//! // … PutEvents with Source "outbox-relay" to bus.bus: the events land in bus.queue_url …
//! # }
//! ```
//!
//! # How moto 5.2.1 takes these calls
//!
//! - It picks the service, and the region, from the credential scope of the
//!   `Authorization` header only (`Credential=test/<date>/<region>/<service>/aws4_request`);
//!   the signature is not checked. Without that header a call falls through
//!   to S3. [`call`] sends a dummy SigV4 header for [`TEST_REGION`].
//! - The operation comes from `X-Amz-Target` (`AmazonSQS.*`, `AWSEvents.*`,
//!   `Kinesis_20131202.*`). Successful EventBridge answers are labelled
//!   `text/html` (the body is JSON all the same); errors carry
//!   `X-Amzn-ErrorType` and a `__type` in the JSON body.
//! - EventBridge delivers to a rule's SQS target inside `PutEvents`, in
//!   `PutEvents` order; the queue's body is the event: `{"id", "time",
//!   "version", "detail-type", "source", "region", "resources", "detail"}`
//!   with `detail` as JSON (no `account` field, unlike AWS). Each event a
//!   rule matches costs moto ~130 ms (~4 ms with `tests/data/moto_server.py`). A `Detail` that
//!   is JSON but not an object, a `"` in `Source` or `DetailType`, or a
//!   `Time` given as text crash the call (HTTP 500) when a rule matches.
//! - Kinesis streams are `ACTIVE` as soon as created; sequence numbers are
//!   per-shard integers from 1 (AWS: ~56 digits): compare them as numbers
//!   ([`SequenceNumber`]), never as text.

use std::cmp::Ordering;
use std::fmt;
use std::time::{Duration, Instant};

use base64::Engine as _;
use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};

use crate::sns::{MOTO_ACCOUNT_ID, TEST_REGION};

/// An AWS service as [`call`] addresses it: the credential scope's service
/// name (what moto routes by) and the JSON protocol version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Service {
    /// The service in the credential scope: `sqs`, `events`, `kinesis`.
    pub scope: &'static str,
    /// `Content-Type` of the request.
    pub content_type: &'static str,
}

/// Amazon SQS (AWS JSON 1.0, `AmazonSQS.<Operation>`).
pub const SQS: Service = Service {
    scope: "sqs",
    content_type: "application/x-amz-json-1.0",
};
/// Amazon EventBridge (AWS JSON 1.1, `AWSEvents.<Operation>`).
pub const EVENTS: Service = Service {
    scope: "events",
    content_type: "application/x-amz-json-1.1",
};
/// Amazon Kinesis Data Streams (AWS JSON 1.1, `Kinesis_20131202.<Operation>`).
pub const KINESIS: Service = Service {
    scope: "kinesis",
    content_type: "application/x-amz-json-1.1",
};

/// How long one [`call`] may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// An AWS error answer (or no answer) to a [`call`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AwsError {
    /// The HTTP status; 0 when no answer came.
    pub status: u16,
    /// The error code (`__type` without its `namespace#`, or
    /// `X-Amzn-ErrorType`); empty when the answer had none.
    pub code: String,
    /// The error message, or the raw answer when it had none.
    pub message: String,
}

impl fmt::Display for AwsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HTTP {} {}: {}", self.status, self.code, self.message)
    }
}

impl std::error::Error for AwsError {}

/// Calls `target` (e.g. `AWSEvents.PutEvents`) of `service` at `endpoint`
/// (`http://127.0.0.1:PORT`) with the JSON `body`: the answer's JSON on a 2xx
/// (`{}` when its body is empty), else the error. Signed with a dummy SigV4
/// `Authorization` header of [`TEST_REGION`] (moto routes by it and checks no
/// signature), so only for servers that do not check signatures.
pub async fn call(
    endpoint: &str,
    service: Service,
    target: &str,
    body: &Value,
) -> Result<Value, AwsError> {
    let no_answer = |message: String| AwsError {
        status: 0,
        code: String::new(),
        message,
    };
    let uri = format!("{}/", endpoint.trim_end_matches('/'));
    let authorization = format!(
        "AWS4-HMAC-SHA256 Credential=test/20260101/{TEST_REGION}/{}/aws4_request, \
         SignedHeaders=host;x-amz-date;x-amz-target, Signature=0",
        service.scope
    );
    let request = hyper::Request::post(&uri)
        .header(hyper::header::CONTENT_TYPE, service.content_type)
        .header("X-Amz-Target", target)
        .header("X-Amz-Date", "20260101T000000Z")
        .header(hyper::header::AUTHORIZATION, authorization)
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| no_answer(format!("{target} to {uri}: {e}")))?;
    // A client per call: tests run on runtimes of their own, and pooled
    // connections must not outlive the runtime that opened them.
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let exchange = async {
        let answer = client
            .request(request)
            .await
            .map_err(|e| no_answer(format!("{target} to {uri}: {e}")))?;
        let status = answer.status().as_u16();
        let header_code = answer
            .headers()
            .get("x-amzn-errortype")
            .and_then(|v| v.to_str().ok())
            .map(|v| v.split(':').next().unwrap_or(v).to_owned());
        let bytes = answer
            .into_body()
            .collect()
            .await
            .map_err(|e| no_answer(format!("{target} to {uri}: reading the answer: {e}")))?
            .to_bytes();
        Ok::<_, AwsError>((status, header_code, bytes))
    };
    let (status, header_code, bytes) = tokio::time::timeout(CALL_TIMEOUT, exchange)
        .await
        .map_err(|_| no_answer(format!("{target} to {uri}: no answer in {CALL_TIMEOUT:?}")))??;
    let text = String::from_utf8_lossy(&bytes);
    let parsed: Option<Value> = if text.trim().is_empty() {
        Some(json!({}))
    } else {
        serde_json::from_str(&text).ok()
    };
    if (200..300).contains(&status) {
        return parsed.ok_or_else(|| AwsError {
            status,
            code: String::new(),
            message: format!("{target}: not JSON: {text}"),
        });
    }
    let field = |name: &str| {
        parsed
            .as_ref()
            .and_then(|v| v.get(name))
            .and_then(Value::as_str)
            .map(str::to_owned)
    };
    let code = field("__type")
        .map(|t| t.rsplit('#').next().unwrap_or(&t).to_owned())
        .or(header_code)
        .unwrap_or_default();
    let message = field("message")
        .or_else(|| field("Message"))
        .unwrap_or_else(|| text.into_owned());
    Err(AwsError {
        status,
        code,
        message,
    })
}

/// [`call`], panicking on an error with the operation and what was sent.
pub async fn must(endpoint: &str, service: Service, target: &str, body: &Value) -> Value {
    call(endpoint, service, target, body)
        .await
        .unwrap_or_else(|e| panic!("{target} {body}: {e}"))
}

// ---------------------------------------------------------------------------
// SQS

/// Creates SQS queue `name` (FIFO when it ends in `.fifo`, with
/// `ContentBasedDeduplication=false`: every message needs its own
/// deduplication id); its URL (`http://127.0.0.1:PORT/123456789012/NAME`).
pub async fn create_queue(endpoint: &str, name: &str) -> String {
    let mut body = json!({"QueueName": name});
    if name.ends_with(".fifo") {
        body["Attributes"] = json!({"FifoQueue": "true", "ContentBasedDeduplication": "false"});
    }
    let answer = must(endpoint, SQS, "AmazonSQS.CreateQueue", &body).await;
    answer["QueueUrl"]
        .as_str()
        .unwrap_or_else(|| panic!("CreateQueue {name}: no QueueUrl in {answer}"))
        .to_owned()
}

/// The ARN of SQS queue `name` (moto's account, [`TEST_REGION`]).
pub fn queue_arn(name: &str) -> String {
    format!("arn:aws:sqs:{TEST_REGION}:{MOTO_ACCOUNT_ID}:{name}")
}

// ---------------------------------------------------------------------------
// EventBridge

/// Creates EventBridge bus `name`; its ARN.
pub async fn create_event_bus(endpoint: &str, name: &str) -> String {
    let answer = must(
        endpoint,
        EVENTS,
        "AWSEvents.CreateEventBus",
        &json!({"Name": name}),
    )
    .await;
    answer["EventBusArn"]
        .as_str()
        .unwrap_or_else(|| panic!("CreateEventBus {name}: no EventBusArn in {answer}"))
        .to_owned()
}

/// An EventBridge bus with a rule that forwards its events of one source to
/// an SQS queue.
#[derive(Debug, Clone)]
pub struct BusQueue {
    /// The bus name.
    pub bus: String,
    /// `arn:aws:events:us-east-1:123456789012:event-bus/NAME`
    pub bus_arn: String,
    /// The rule's name (the bus name).
    pub rule: String,
    /// The queue (standard) the rule's target is: `http://127.0.0.1:PORT/123456789012/NAME`.
    pub queue_url: String,
    /// `arn:aws:sqs:us-east-1:123456789012:NAME`
    pub queue_arn: String,
}

/// Creates bus `name`, a standard SQS queue `name`, and a rule on the bus
/// matching the events whose `source` is `source` with the queue as its
/// target. `name`: unique on the server, at most 64 letters, digits, `_`, `-`.
/// What the bus delivers then waits in the queue as EventBridge event JSON
/// (read it with [`crate::receive_all`]; [`eventbridge_event`] parses it).
pub async fn bus_to_queue(endpoint: &str, name: &str, source: &str) -> BusQueue {
    let bus_arn = create_event_bus(endpoint, name).await;
    let queue_url = create_queue(endpoint, name).await;
    let queue_arn = queue_arn(name);
    let pattern = json!({"source": [source]}).to_string();
    must(
        endpoint,
        EVENTS,
        "AWSEvents.PutRule",
        &json!({"Name": name, "EventBusName": name, "EventPattern": pattern, "State": "ENABLED"}),
    )
    .await;
    let answer = must(
        endpoint,
        EVENTS,
        "AWSEvents.PutTargets",
        &json!({"Rule": name, "EventBusName": name, "Targets": [{"Id": "queue", "Arn": queue_arn}]}),
    )
    .await;
    assert_eq!(
        answer["FailedEntryCount"].as_u64(),
        Some(0),
        "PutTargets {name}: {answer}"
    );
    BusQueue {
        bus: name.to_owned(),
        bus_arn,
        rule: name.to_owned(),
        queue_url,
        queue_arn,
    }
}

/// An EventBridge event as a rule's SQS target receives it.
#[derive(Debug, Clone, PartialEq)]
pub struct BusEvent {
    /// The event id EventBridge gave it (`EventId` of `PutEvents`).
    pub id: String,
    /// `source`: the `Source` it was put with.
    pub source: String,
    /// `detail-type`: the `DetailType` it was put with.
    pub detail_type: String,
    /// `detail`: the `Detail` it was put with, as JSON.
    pub detail: Value,
}

/// Parses the body of an SQS message delivered by an EventBridge rule.
/// Panics when it is not such an event.
pub fn eventbridge_event(body: &str) -> BusEvent {
    let v: Value = serde_json::from_str(body)
        .unwrap_or_else(|e| panic!("not an EventBridge event ({e}): {body}"));
    let text = |name: &str| {
        v[name]
            .as_str()
            .unwrap_or_else(|| panic!("no {name} in the EventBridge event {body}"))
            .to_owned()
    };
    BusEvent {
        id: text("id"),
        source: text("source"),
        detail_type: text("detail-type"),
        detail: v
            .get("detail")
            .cloned()
            .unwrap_or_else(|| panic!("no detail in the EventBridge event {body}")),
    }
}

// ---------------------------------------------------------------------------
// Kinesis

/// Creates Kinesis stream `name` with `shards` shards (provisioned; active at
/// once in moto); its ARN.
pub async fn create_stream(endpoint: &str, name: &str, shards: u32) -> String {
    must(
        endpoint,
        KINESIS,
        "Kinesis_20131202.CreateStream",
        &json!({"StreamName": name, "ShardCount": shards}),
    )
    .await;
    format!("arn:aws:kinesis:{TEST_REGION}:{MOTO_ACCOUNT_ID}:stream/{name}")
}

/// The shard ids of stream `name`, in order.
pub async fn list_shards(endpoint: &str, name: &str) -> Vec<String> {
    let answer = must(
        endpoint,
        KINESIS,
        "Kinesis_20131202.ListShards",
        &json!({"StreamName": name}),
    )
    .await;
    answer["Shards"]
        .as_array()
        .unwrap_or_else(|| panic!("ListShards {name}: no Shards in {answer}"))
        .iter()
        .map(|s| {
            s["ShardId"]
                .as_str()
                .unwrap_or_else(|| panic!("ListShards {name}: a shard without ShardId: {answer}"))
                .to_owned()
        })
        .collect()
}

/// A Kinesis sequence number: decimal digits of any length (moto counts from
/// 1, AWS has ~56 digits), ordered as the integer it is.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SequenceNumber(String);

impl SequenceNumber {
    /// `text` as a sequence number; panics unless it is decimal digits.
    pub fn new(text: &str) -> SequenceNumber {
        assert!(
            !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()),
            "not a sequence number: {text:?}"
        );
        let digits = text.trim_start_matches('0');
        SequenceNumber(if digits.is_empty() { "0" } else { digits }.to_owned())
    }

    /// The digits (no leading zeros).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Ord for SequenceNumber {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0
            .len()
            .cmp(&other.0.len())
            .then_with(|| self.0.cmp(&other.0))
    }
}

impl PartialOrd for SequenceNumber {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for SequenceNumber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A record read from a Kinesis stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamRecord {
    /// The partition key it was put with.
    pub partition_key: String,
    /// Its data (decoded).
    pub data: Vec<u8>,
    /// The shard that holds it.
    pub shard: String,
    /// Its sequence number in that shard.
    pub sequence: SequenceNumber,
}

/// Reads a stream from the start (`TRIM_HORIZON`) of every shard, each call
/// of [`StreamReader::poll`] returning what arrived since the last one.
#[derive(Debug)]
pub struct StreamReader {
    endpoint: String,
    stream: String,
    /// `(shard, its next iterator)`.
    shards: Vec<(String, String)>,
}

impl StreamReader {
    /// A reader of every shard of stream `name` at `endpoint`, from the start.
    pub async fn new(endpoint: &str, name: &str) -> StreamReader {
        let mut shards = Vec::new();
        for shard in list_shards(endpoint, name).await {
            let answer = must(
                endpoint,
                KINESIS,
                "Kinesis_20131202.GetShardIterator",
                &json!({"StreamName": name, "ShardId": shard, "ShardIteratorType": "TRIM_HORIZON"}),
            )
            .await;
            let iterator = answer["ShardIterator"]
                .as_str()
                .unwrap_or_else(|| panic!("GetShardIterator {name} {shard}: {answer}"))
                .to_owned();
            shards.push((shard, iterator));
        }
        StreamReader {
            endpoint: endpoint.to_owned(),
            stream: name.to_owned(),
            shards,
        }
    }

    /// The records put since the last poll: shard by shard (in
    /// [`list_shards`] order), each shard's in its order. Panics on errors and
    /// when a shard's sequence numbers do not increase.
    pub async fn poll(&mut self) -> Vec<StreamRecord> {
        let mut out = Vec::new();
        for (shard, iterator) in &mut self.shards {
            loop {
                let answer = must(
                    &self.endpoint,
                    KINESIS,
                    "Kinesis_20131202.GetRecords",
                    &json!({"ShardIterator": iterator, "Limit": 10_000}),
                )
                .await;
                if let Some(next) = answer["NextShardIterator"].as_str() {
                    next.clone_into(iterator);
                }
                let records = answer["Records"].as_array().cloned().unwrap_or_default();
                if records.is_empty() {
                    break;
                }
                for r in &records {
                    let field = |name: &str| {
                        r[name].as_str().unwrap_or_else(|| {
                            panic!("GetRecords {} {shard}: no {name} in {r}", self.stream)
                        })
                    };
                    let data = base64::engine::general_purpose::STANDARD
                        .decode(field("Data"))
                        .unwrap_or_else(|e| {
                            panic!("GetRecords {} {shard}: Data not base64: {e}", self.stream)
                        });
                    out.push(StreamRecord {
                        partition_key: field("PartitionKey").to_owned(),
                        data,
                        shard: shard.clone(),
                        sequence: SequenceNumber::new(field("SequenceNumber")),
                    });
                }
            }
        }
        for pair in out.windows(2) {
            if pair[0].shard == pair[1].shard {
                assert!(
                    pair[0].sequence < pair[1].sequence,
                    "shard {} of {}: sequence {} before {}",
                    pair[0].shard,
                    self.stream,
                    pair[0].sequence,
                    pair[1].sequence
                );
            }
        }
        out
    }
}

/// Every record of stream `name` now: shard by shard (in [`list_shards`]
/// order), each shard's from `TRIM_HORIZON` in sequence order.
pub async fn read_stream(endpoint: &str, name: &str) -> Vec<StreamRecord> {
    StreamReader::new(endpoint, name).await.poll().await
}

/// Reads stream `name` until at least `expected` records arrived or
/// `timeout` passed (then returns what there is; the caller asserts). With
/// `expected == 0` it reads for the whole `timeout`.
pub async fn read_stream_until(
    endpoint: &str,
    name: &str,
    expected: usize,
    timeout: Duration,
) -> Vec<StreamRecord> {
    let deadline = Instant::now() + timeout;
    let mut reader = StreamReader::new(endpoint, name).await;
    let mut got = Vec::new();
    loop {
        got.extend(reader.poll().await);
        if (expected > 0 && got.len() >= expected) || Instant::now() >= deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::SequenceNumber;

    #[test]
    fn sequence_numbers_compare_as_integers() {
        let s = SequenceNumber::new;
        assert!(s("9") < s("10"));
        assert!(s("010") == s("10"));
        assert!(s("0") < s("1"));
        assert!(
            s("49590338271490256608559692538361571095921575989136588898")
                > s("49590338271490256608559692538361571095921575989136588897")
        );
        assert!(s("99") < s("49590338271490256608559692538361571095921575989136588898"));
    }
}
