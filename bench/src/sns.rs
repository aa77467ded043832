//! A fast SNS-compatible endpoint: answers `Publish` and `PublishBatch` the way
//! SNS does (and webhook POSTs with 204: [`respond_webhook`]; and SQS's
//! `SendMessageBatch`, EventBridge's `PutEvents` and Kinesis's `PutRecords`,
//! AWS JSON calls told apart by `X-Amz-Target`: [`respond_json`]);
//! the rest of this text is about SNS. It answers them the way
//! SNS does (Query protocol in, XML out), accepting every entry, and counts
//! the messages. moto manages a few hundred calls per second and would
//! measure itself; this one costs microseconds per call.
//!
//! It answers `GetTopicAttributes` too, as SNS does, with the topic's
//! `MaximumMessageSize` ([`Model::max_message_size`]): the relay asks once per
//! topic and sizes its batches, and refuses larger messages, by it. The
//! endpoint itself does not check the sizes of what it is sent.
//!
//! It models the network and SNS's quota ([`Model`]): every answer leaves
//! after the latency (± its jitter), and above the quota a call is refused
//! whole as SNS refuses it: HTTP 400 with the Query protocol's
//! `<Code>Throttling</Code>` "Rate exceeded". The quota is a token bucket of
//! messages refilled at the quota's rate, holding [`Model::burst`] of it
//! (AWS does not publish its buckets' sizes), full at the start as an
//! account's is after a quiet spell. The quota may be raised or lifted while
//! the endpoint runs ([`Endpoint::set_quota`]).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use tokio::net::TcpListener;

/// What the endpoint has seen.
#[derive(Debug, Default)]
pub struct Counts {
    /// Messages accepted.
    pub messages: AtomicU64,
    /// Calls answered.
    pub calls: AtomicU64,
    /// Calls refused with `Throttling` (or the service's kin), and Kinesis
    /// calls with a throttled record.
    pub throttled: AtomicU64,
    /// `GetTopicAttributes`, `GetQueueAttributes` and `DescribeEventBus` calls answered (not among `calls`).
    pub attribute_calls: AtomicU64,
    /// Bytes of request bodies received, in every call.
    pub bytes: AtomicU64,
    /// The largest request body received, in bytes.
    pub largest: AtomicU64,
}

impl Counts {
    /// (messages, calls, throttled calls) so far.
    pub fn snapshot(&self) -> (u64, u64, u64) {
        (
            self.messages.load(Ordering::Relaxed),
            self.calls.load(Ordering::Relaxed),
            self.throttled.load(Ordering::Relaxed),
        )
    }
}

/// What the endpoint stands in for: a distance and a quota.
#[derive(Debug, Clone, Copy)]
pub struct Model {
    /// Time from receiving a call to answering it.
    pub latency: Duration,
    /// Each answer's latency is drawn uniformly within ± this fraction of it.
    pub jitter: f64,
    /// Messages per second accepted; calls above it are throttled.
    pub quota: Option<f64>,
    /// How much of the quota the bucket holds (a burst taken at any speed):
    /// this long of it, and at least one batch of ten.
    pub burst: Duration,
    /// The topics' `MaximumMessageSize` attribute, in bytes (SNS: 1,024 to
    /// 1,048,576; 262,144 unless set).
    pub max_message_size: usize,
}

impl Model {
    /// Answers at once, no quota.
    pub const LOCAL: Model = Model {
        latency: Duration::ZERO,
        jitter: 0.0,
        quota: None,
        burst: DEFAULT_BURST,
        max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
    };
}

/// The bucket's size unless said: a tenth of a second of the quota.
pub const DEFAULT_BURST: Duration = Duration::from_millis(100);

/// SNS's `MaximumMessageSize` of a topic that does not set it.
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = 256 * 1024;

/// Messages that may be accepted now.
struct Bucket {
    rate: f64,
    capacity: f64,
    tokens: f64,
    at: Instant,
    /// The quota was lifted: everything goes.
    lifted: bool,
}

impl Bucket {
    /// A full bucket holding `burst` of `rate` (at least a batch of ten).
    fn new(rate: f64, burst: Duration) -> Self {
        let capacity = Self::capacity(rate, burst);
        Self {
            rate,
            capacity,
            tokens: capacity,
            at: Instant::now(),
            lifted: false,
        }
    }

    fn capacity(rate: f64, burst: Duration) -> f64 {
        (rate * burst.as_secs_f64()).max(10.0)
    }

    fn refill(&mut self) {
        let now = Instant::now();
        let refill = now.duration_since(self.at).as_secs_f64() * self.rate;
        self.tokens = (self.tokens + refill).min(self.capacity);
        self.at = now;
    }

    /// Whether `n` messages may go now (taken if so).
    fn take(&mut self, n: f64) -> bool {
        if self.lifted {
            return true;
        }
        self.refill();
        if self.tokens >= n {
            self.tokens -= n;
            true
        } else {
            false
        }
    }

    /// How many of `n` messages may go now (taken): all, some or none.
    fn take_up_to(&mut self, n: usize) -> usize {
        if self.lifted {
            return n;
        }
        self.refill();
        let k = (self.tokens.max(0.0).floor() as usize).min(n);
        self.tokens -= k as f64;
        k
    }
}

struct State {
    counts: Arc<Counts>,
    model: Model,
    bucket: Option<Mutex<Bucket>>,
    /// The last sequence number given (SQS FIFO entries, Kinesis records).
    sequence: AtomicU64,
}

impl State {
    /// Whether `n` messages are within the quota now (taken if so).
    fn allowed(&self, n: usize) -> bool {
        self.bucket.as_ref().is_none_or(|bucket| {
            bucket
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(n as f64)
        })
    }
}

/// A running endpoint.
pub struct Endpoint {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// Its counters.
    pub counts: Arc<Counts>,
    state: Arc<State>,
}

impl Endpoint {
    /// Listen on a free port of 127.0.0.1, answering as `model` says.
    pub async fn start(model: Model) -> anyhow::Result<Endpoint> {
        let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        let url = format!("http://{}", listener.local_addr()?);
        let counts = Arc::new(Counts::default());
        let state = Arc::new(State {
            counts: Arc::clone(&counts),
            model,
            bucket: model.quota.map(|q| Mutex::new(Bucket::new(q, model.burst))),
            sequence: AtomicU64::new(0),
        });
        let served = Arc::clone(&state);
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let state = Arc::clone(&served);
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let state = Arc::clone(&state);
                        async move { Ok::<_, hyper::Error>(answer(req, &state).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(Endpoint { url, counts, state })
    }

    /// From now on the quota is `quota` messages a second, its bucket
    /// [`Model::burst`] of it, keeping the tokens it holds (up to its new
    /// size); `None` lifts it. The messages the bucket held at the change.
    /// An endpoint started without a quota keeps none.
    pub fn set_quota(&self, quota: Option<f64>) -> f64 {
        let Some(bucket) = &self.state.bucket else {
            return 0.0;
        };
        let mut bucket = bucket.lock().unwrap_or_else(|p| p.into_inner());
        bucket.refill();
        let held = bucket.tokens;
        match quota {
            Some(rate) => {
                bucket.rate = rate;
                bucket.capacity = Bucket::capacity(rate, self.state.model.burst);
                bucket.tokens = bucket.tokens.min(bucket.capacity);
                bucket.lifted = false;
            }
            None => bucket.lifted = true,
        }
        held
    }
}

async fn answer(req: Request<Incoming>, state: &State) -> Response<Full<Bytes>> {
    let webhook = req.headers().contains_key("webhook-id");
    let operation = req
        .headers()
        .get("x-amz-target")
        .map(|target| Operation::of(target.as_bytes()));
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => Bytes::new(),
    };
    let model = state.model;
    let answer = if webhook {
        respond_webhook(&body, state)
    } else if let Some(operation) = operation {
        respond_json(operation, &body, state)
    } else {
        respond(&body, state)
    };
    if !model.latency.is_zero() {
        let spread = 1.0 + model.jitter * (2.0 * fastrand::f64() - 1.0);
        tokio::time::sleep(model.latency.mul_f64(spread.max(0.0))).await;
    }
    answer
}

/// A webhook POST: one envelope, or a JSON array of them; 204, or 429 above
/// the quota. The signature is not checked (the tests verify it).
fn respond_webhook(body: &Bytes, state: &State) -> Response<Full<Bytes>> {
    let counts = &state.counts;
    counts.bytes.fetch_add(body.len() as u64, Ordering::Relaxed);
    counts.calls.fetch_add(1, Ordering::Relaxed);
    // Envelopes are CloudEvents objects: each has one `"specversion":`.
    let events = memchr::memmem::find_iter(body, b"\"specversion\":")
        .count()
        .max(1) as u64;
    if let Some(bucket) = &state.bucket {
        let allowed = bucket
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take(events as f64);
        if !allowed {
            counts.throttled.fetch_add(1, Ordering::Relaxed);
            return Response::builder()
                .status(429)
                .body(Full::new(Bytes::new()))
                .expect("a response");
        }
    }
    counts.messages.fetch_add(events, Ordering::Relaxed);
    Response::builder()
        .status(204)
        .body(Full::new(Bytes::new()))
        .expect("a response")
}

const THROTTLED: &str = "<ErrorResponse xmlns=\"http://sns.amazonaws.com/doc/2010-03-31/\">\
    <Error><Type>Sender</Type><Code>Throttling</Code><Message>Rate exceeded</Message></Error>\
    <RequestId>bench</RequestId></ErrorResponse>";

fn respond(body: &Bytes, state: &State) -> Response<Full<Bytes>> {
    let counts = &state.counts;
    counts.bytes.fetch_add(body.len() as u64, Ordering::Relaxed);
    counts
        .largest
        .fetch_max(body.len() as u64, Ordering::Relaxed);
    if body.starts_with(b"Action=GetTopicAttributes&")
        || memchr::memmem::find(body, b"&Action=GetTopicAttributes&").is_some()
        || body.ends_with(b"&Action=GetTopicAttributes")
    {
        counts.attribute_calls.fetch_add(1, Ordering::Relaxed);
        return topic_attributes(body, state.model.max_message_size);
    }
    counts.calls.fetch_add(1, Ordering::Relaxed);
    // It stands in for SNS, which runs elsewhere; here its CPU competes with
    // the relay and the walsender, so it reads only what it answers with:
    // the action and the entry ids, found by substring search rather than by
    // splitting the whole form (the messages are most of it).
    let value = |at: usize| {
        let rest = &body[at..];
        let end = memchr::memchr(b'&', rest).unwrap_or(rest.len());
        String::from_utf8_lossy(&rest[..end]).into_owned()
    };
    let batch = memchr::memmem::find(body, b"Action=PublishBatch&").is_some()
        || body.ends_with(b"Action=PublishBatch");
    let xml = if batch {
        let ids: Vec<String> = memchr::memmem::find_iter(body, b".Id=")
            .filter(|&at| {
                // `PublishBatchRequestEntries.member.N.Id=`: a key, not text
                // inside a value (values have `=` and `&` encoded).
                body[..at]
                    .iter()
                    .rposition(|&b| b == b'&')
                    .is_some_and(|key| {
                        body[key + 1..at].starts_with(b"PublishBatchRequestEntries.member.")
                    })
            })
            .map(|at| outbox_relay::percent_decode(&value(at + 4)))
            .collect();
        if let Some(bucket) = &state.bucket {
            let allowed = bucket
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(ids.len() as f64);
            if !allowed {
                counts.throttled.fetch_add(1, Ordering::Relaxed);
                return Response::builder()
                    .status(400)
                    .header("content-type", "text/xml")
                    .body(Full::new(Bytes::from_static(THROTTLED.as_bytes())))
                    .expect("a response");
            }
        }
        counts
            .messages
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        let mut xml = String::with_capacity(120 + ids.len() * 120);
        xml.push_str(
            "<PublishBatchResponse xmlns=\"http://sns.amazonaws.com/doc/2010-03-31/\">\
             <PublishBatchResult><Successful>",
        );
        for id in &ids {
            xml.push_str("<member><Id>");
            xml.push_str(&escape(id));
            xml.push_str("</Id><MessageId>");
            xml.push_str(&format!("{:032x}", fastrand::u128(..)));
            xml.push_str("</MessageId></member>");
        }
        xml.push_str(
            "</Successful><Failed/></PublishBatchResult>\
             <ResponseMetadata><RequestId>bench</RequestId></ResponseMetadata></PublishBatchResponse>",
        );
        xml
    } else {
        counts.messages.fetch_add(1, Ordering::Relaxed);
        format!(
            "<PublishResponse xmlns=\"http://sns.amazonaws.com/doc/2010-03-31/\"><PublishResult>\
             <MessageId>{:032x}</MessageId></PublishResult>\
             <ResponseMetadata><RequestId>bench</RequestId></ResponseMetadata></PublishResponse>",
            fastrand::u128(..)
        )
    };
    Response::builder()
        .header("content-type", "text/xml")
        .body(Full::new(Bytes::from(xml)))
        .expect("a response")
}

/// The AWS JSON operations the endpoint answers, by `X-Amz-Target`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Operation {
    /// `AmazonSQS.SendMessageBatch` (JSON 1.0).
    SendMessageBatch,
    /// `AmazonSQS.GetQueueAttributes` (JSON 1.0).
    GetQueueAttributes,
    /// `AWSEvents.PutEvents` (JSON 1.1).
    PutEvents,
    /// `AWSEvents.DescribeEventBus` (JSON 1.1): the bus exists.
    DescribeEventBus,
    /// `Kinesis_20131202.PutRecords` (JSON 1.1).
    PutRecords,
    /// Anything else: refused as AWS refuses it.
    Unknown,
}

impl Operation {
    fn of(target: &[u8]) -> Self {
        match target {
            b"AmazonSQS.SendMessageBatch" => Self::SendMessageBatch,
            b"AmazonSQS.GetQueueAttributes" => Self::GetQueueAttributes,
            b"AWSEvents.PutEvents" => Self::PutEvents,
            b"AWSEvents.DescribeEventBus" => Self::DescribeEventBus,
            b"Kinesis_20131202.PutRecords" => Self::PutRecords,
            _ => Self::Unknown,
        }
    }

    fn content_type(self) -> &'static str {
        match self {
            Self::SendMessageBatch | Self::GetQueueAttributes => "application/x-amz-json-1.0",
            _ => "application/x-amz-json-1.1",
        }
    }
}

/// SQS's `MaximumMessageSize` of a queue that does not set it (and its
/// ceiling): what `GetQueueAttributes` answers.
pub const SQS_MAX_MESSAGE_SIZE: usize = 1_048_576;

/// A Kinesis stream's shards here: on-demand streams start with 4.
const KINESIS_SHARDS: u64 = 4;

/// An AWS JSON call: SQS `SendMessageBatch` and `GetQueueAttributes`,
/// EventBridge `PutEvents`, Kinesis `PutRecords`, answered in the services'
/// shapes. As in [`respond`], the body is not parsed: entries are counted
/// (and SQS's entry ids read) by substring search for a key with a string
/// value, `"Id":"`. Inside a JSON string every `"` is escaped, so such a key
/// cannot be matched inside a message body, a `Detail` or a `Data`.
///
/// Above the quota each answers as its service does:
/// * SQS: the call refused whole, HTTP 400 `com.amazonaws.sqs#RequestThrottled`
///   (the error `SendMessageBatch` lists for a request rate over the queue's;
///   a FIFO queue's 300 calls/s without high throughput mode, say).
/// * EventBridge: the call refused whole, HTTP 400 `ThrottlingException`
///   "Rate exceeded", as PutEvents is over the account's per-Region quota.
/// * Kinesis: HTTP 200 with the records over the shard's write limit failed
///   one by one, `ProvisionedThroughputExceededException` and
///   `FailedRecordCount`: PutRecords is not refused whole for throughput, it
///   takes what the shards can. The bucket here stands for the whole stream,
///   so the records that fail are the call's last ones.
///
/// What is not checked: sizes, entry counts, the queue, bus or stream
/// named. `MD5OfMessageBody` and `MD5OfMessageAttributes` are random, not
/// digests (the relay does not verify them; digesting every body would cost
/// this endpoint the CPU it must leave to the relay).
fn respond_json(operation: Operation, body: &Bytes, state: &State) -> Response<Full<Bytes>> {
    use std::fmt::Write as _;
    let counts = &state.counts;
    counts.bytes.fetch_add(body.len() as u64, Ordering::Relaxed);
    counts
        .largest
        .fetch_max(body.len() as u64, Ordering::Relaxed);
    let content_type = operation.content_type();
    let reply = |status: u16, json: String| {
        Response::builder()
            .status(status)
            .header("content-type", content_type)
            .body(Full::new(Bytes::from(json)))
            .expect("a response")
    };
    let refuse = |code: &str, message: &str| {
        let mut response = reply(
            400,
            format!("{{\"__type\":\"{code}\",\"message\":\"{message}\"}}"),
        );
        if let Ok(value) = hyper::header::HeaderValue::from_str(code) {
            response.headers_mut().insert("x-amzn-errortype", value);
        }
        response
    };
    match operation {
        Operation::Unknown => refuse(
            "UnknownOperationException",
            "this endpoint answers SendMessageBatch, GetQueueAttributes, PutEvents, DescribeEventBus and PutRecords",
        ),
        Operation::DescribeEventBus => {
            counts.attribute_calls.fetch_add(1, Ordering::Relaxed);
            reply(
                200,
                r#"{"Name":"bench","Arn":"arn:aws:events:us-east-1:123456789012:event-bus/bench"}"#.to_owned(),
            )
        }
        Operation::GetQueueAttributes => {
            counts.attribute_calls.fetch_add(1, Ordering::Relaxed);
            reply(
                200,
                format!("{{\"Attributes\":{{\"MaximumMessageSize\":\"{SQS_MAX_MESSAGE_SIZE}\"}}}}"),
            )
        }
        Operation::SendMessageBatch => {
            counts.calls.fetch_add(1, Ordering::Relaxed);
            let ids: Vec<&[u8]> = string_values(body, b"\"Id\":\"").collect();
            if !state.allowed(ids.len()) {
                counts.throttled.fetch_add(1, Ordering::Relaxed);
                return refuse(
                    "com.amazonaws.sqs#RequestThrottled",
                    "Request is throttled.",
                );
            }
            counts
                .messages
                .fetch_add(ids.len() as u64, Ordering::Relaxed);
            let fifo = string_values(body, b"\"QueueUrl\":\"")
                .next()
                .is_some_and(|url| url.ends_with(b".fifo"));
            let mut json = String::with_capacity(40 + ids.len() * 200);
            json.push_str("{\"Successful\":[");
            for (i, id) in ids.iter().enumerate() {
                if i > 0 {
                    json.push(',');
                }
                // The id as sent: a JSON string's text, still escaped.
                json.push_str("{\"Id\":\"");
                json.push_str(&String::from_utf8_lossy(id));
                json.push_str("\",\"MessageId\":\"");
                uuid(&mut json);
                let _ = write!(
                    json,
                    "\",\"MD5OfMessageBody\":\"{:032x}\",\"MD5OfMessageAttributes\":\"{:032x}\"",
                    fastrand::u128(..),
                    fastrand::u128(..)
                );
                if fifo {
                    // SQS's are 20 digits, increasing within a group.
                    let n = state.sequence.fetch_add(1, Ordering::Relaxed) + 1;
                    let _ = write!(
                        json,
                        ",\"SequenceNumber\":\"{:020}\"",
                        18_000_000_000_000_000_000u128 + u128::from(n)
                    );
                }
                json.push('}');
            }
            json.push_str("],\"Failed\":[]}");
            reply(200, json)
        }
        Operation::PutEvents => {
            counts.calls.fetch_add(1, Ordering::Relaxed);
            // `Source` is required in every entry.
            let entries = memchr::memmem::find_iter(body, b"\"Source\":\"").count();
            if !state.allowed(entries) {
                counts.throttled.fetch_add(1, Ordering::Relaxed);
                return refuse("ThrottlingException", "Rate exceeded");
            }
            counts.messages.fetch_add(entries as u64, Ordering::Relaxed);
            let mut json = String::with_capacity(40 + entries * 52);
            json.push_str("{\"FailedEntryCount\":0,\"Entries\":[");
            for i in 0..entries {
                if i > 0 {
                    json.push(',');
                }
                json.push_str("{\"EventId\":\"");
                uuid(&mut json);
                json.push_str("\"}");
            }
            json.push_str("]}");
            reply(200, json)
        }
        Operation::PutRecords => {
            counts.calls.fetch_add(1, Ordering::Relaxed);
            let keys: Vec<&[u8]> = string_values(body, b"\"PartitionKey\":\"").collect();
            let taken = match &state.bucket {
                None => keys.len(),
                Some(bucket) => bucket
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .take_up_to(keys.len()),
            };
            let failed = keys.len() - taken;
            if failed > 0 {
                counts.throttled.fetch_add(1, Ordering::Relaxed);
            }
            counts.messages.fetch_add(taken as u64, Ordering::Relaxed);
            let first = state.sequence.fetch_add(taken as u64, Ordering::Relaxed) + 1;
            let mut json = String::with_capacity(40 + keys.len() * 110);
            let _ = write!(json, "{{\"FailedRecordCount\":{failed},\"Records\":[");
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    json.push(',');
                }
                let shard = shard(key);
                if i < taken {
                    // Kinesis's are 56 digits, increasing within a shard.
                    let _ = write!(
                        json,
                        "{{\"SequenceNumber\":\"4959{:052}\",\"ShardId\":\"shardId-{shard:012}\"}}",
                        first + i as u64
                    );
                } else {
                    let _ = write!(
                        json,
                        "{{\"ErrorCode\":\"ProvisionedThroughputExceededException\",\
                         \"ErrorMessage\":\"Rate exceeded for shard shardId-{shard:012} in stream bench under account 123456789012.\"}}"
                    );
                }
            }
            json.push_str("]}");
            reply(200, json)
        }
    }
}

/// The values of the string-valued key `key` (`"Id":"`, with its quotes and
/// colon) in a JSON text, as they are written (escapes kept).
fn string_values<'a>(body: &'a [u8], key: &'static [u8]) -> impl Iterator<Item = &'a [u8]> + 'a {
    memchr::memmem::find_iter(body, key).map(move |at| {
        let rest = &body[at + key.len()..];
        let mut end = 0;
        while end < rest.len() {
            match rest[end] {
                b'\\' => end += 2,
                b'"' => break,
                _ => end += 1,
            }
        }
        &rest[..end.min(rest.len())]
    })
}

/// The shard a partition key goes to here (a cheap hash; Kinesis uses MD5).
fn shard(key: &[u8]) -> u64 {
    let hash = key.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    hash % KINESIS_SHARDS
}

/// A random UUID's text, appended to `out`.
fn uuid(out: &mut String) {
    use std::fmt::Write as _;
    let v = fastrand::u128(..);
    let _ = write!(
        out,
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        (v >> 96) as u32,
        (v >> 80) as u16,
        (v >> 64) as u16,
        (v >> 48) as u16,
        v as u64 & 0xffff_ffff_ffff
    );
}

/// The answer to `GetTopicAttributes`, as SNS gives it for a topic with one
/// confirmed subscription: `MaximumMessageSize` among the usual attributes
/// (and `FifoTopic` for a `.fifo` topic).
fn topic_attributes(body: &[u8], max_message_size: usize) -> Response<Full<Bytes>> {
    let form = String::from_utf8_lossy(body);
    let arn = form
        .split('&')
        .find_map(|pair| pair.strip_prefix("TopicArn="))
        .map(outbox_relay::percent_decode)
        .unwrap_or_default();
    let owner = arn.split(':').nth(4).unwrap_or("123456789012").to_owned();
    let mut attributes = vec![
        ("Owner", owner),
        ("TopicArn", arn.clone()),
        ("DisplayName", String::new()),
        ("SubscriptionsPending", "0".into()),
        ("SubscriptionsConfirmed", "1".into()),
        ("SubscriptionsDeleted", "0".into()),
        ("MaximumMessageSize", max_message_size.to_string()),
    ];
    if arn.ends_with(".fifo") {
        attributes.push(("FifoTopic", "true".into()));
        attributes.push(("ContentBasedDeduplication", "false".into()));
    }
    let mut xml = String::from(
        "<GetTopicAttributesResponse xmlns=\"http://sns.amazonaws.com/doc/2010-03-31/\">\
         <GetTopicAttributesResult><Attributes>",
    );
    for (key, value) in attributes {
        xml.push_str("<entry><key>");
        xml.push_str(key);
        xml.push_str("</key><value>");
        xml.push_str(&escape(&value));
        xml.push_str("</value></entry>");
    }
    xml.push_str(
        "</Attributes></GetTopicAttributesResult>\
         <ResponseMetadata><RequestId>bench</RequestId></ResponseMetadata></GetTopicAttributesResponse>",
    );
    Response::builder()
        .header("content-type", "text/xml")
        .body(Full::new(Bytes::from(xml)))
        .expect("a response")
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_attributes_carry_the_maximum_message_size_and_the_topic() {
        let body = b"Action=GetTopicAttributes&Version=2010-03-31&TopicArn=arn%3Aaws%3Asns%3Aus-east-1%3A1%3At.fifo";
        let answer = topic_attributes(body, 1_048_576);
        let xml = body_text(answer);
        assert!(xml.starts_with("<GetTopicAttributesResponse"));
        assert!(xml.contains("<entry><key>MaximumMessageSize</key><value>1048576</value></entry>"));
        assert!(xml.contains(
            "<entry><key>TopicArn</key><value>arn:aws:sns:us-east-1:1:t.fifo</value></entry>"
        ));
        assert!(xml.contains("<entry><key>Owner</key><value>1</value></entry>"));
        assert!(xml.contains("<key>FifoTopic</key><value>true</value>"));
    }

    fn endpoint_state(quota: Option<f64>) -> State {
        State {
            counts: Arc::new(Counts::default()),
            model: Model {
                quota,
                ..Model::LOCAL
            },
            bucket: quota.map(|q| Mutex::new(Bucket::new(q, DEFAULT_BURST))),
            sequence: AtomicU64::new(0),
        }
    }

    /// What the relay makes of a refusal: its code and class.
    fn refusal(response: Response<Full<Bytes>>) -> (u16, String, Class) {
        let status = response.status().as_u16();
        let body = body_text(response);
        let (code, _) =
            outbox_relay::parse_aws_json_error(body.as_bytes()).expect("an AWS JSON error");
        let class = classify(Some(status), Some(&code), None);
        (status, code, class)
    }

    use outbox_relay::{classify_aws_error as classify, AwsErrorClass as Class};

    // As the relay writes them (sink/sqs, sink/eventbridge, sink/kinesis).
    const SQS_BATCH: &[u8] = br#"{"QueueUrl":"http://127.0.0.1:1/123456789012/bench.fifo","Entries":[{"Id":"0","MessageBody":"{\"Id\":\"x\",\"a\":\"\\\"Id\\\":\\\"y\"}","MessageAttributes":{"Id":{"DataType":"String","StringValue":"v"}},"MessageGroupId":"g","MessageDeduplicationId":"d0"},{"Id":"1","MessageBody":"b","MessageGroupId":"g","MessageDeduplicationId":"d1"}]}"#;
    const PUT_EVENTS: &[u8] = br#"{"Entries":[{"Source":"outbox-relay","DetailType":"OrderPlaced","Detail":"{\"Source\":\"x\"}","EventBusName":"bench"},{"Source":"outbox-relay","DetailType":"OrderPlaced","Detail":"{}","EventBusName":"bench"}]}"#;
    const PUT_RECORDS: &[u8] = br#"{"StreamName":"bench","Records":[{"Data":"e30=","PartitionKey":"order-1"},{"Data":"e30=","PartitionKey":"order-2"},{"Data":"e30=","PartitionKey":"order-\"3"}]}"#;

    #[test]
    fn json_calls_are_told_apart_by_their_target() {
        for (target, operation) in [
            ("AmazonSQS.SendMessageBatch", Operation::SendMessageBatch),
            (
                "AmazonSQS.GetQueueAttributes",
                Operation::GetQueueAttributes,
            ),
            ("AWSEvents.PutEvents", Operation::PutEvents),
            ("AWSEvents.DescribeEventBus", Operation::DescribeEventBus),
            ("Kinesis_20131202.PutRecords", Operation::PutRecords),
            ("AmazonSQS.DeleteQueue", Operation::Unknown),
        ] {
            assert_eq!(Operation::of(target.as_bytes()), operation, "{target}");
        }
        let state = endpoint_state(None);
        let (status, code, _) = refusal(respond_json(Operation::Unknown, &Bytes::new(), &state));
        assert_eq!((status, code.as_str()), (400, "UnknownOperationException"));
    }

    #[test]
    fn sqs_answers_each_entry_by_its_id_and_the_queue_size() {
        let state = endpoint_state(None);
        let attributes = respond_json(
            Operation::GetQueueAttributes,
            &Bytes::from_static(
                br#"{"QueueUrl":"http://h/1/q","AttributeNames":["MaximumMessageSize"]}"#,
            ),
            &state,
        );
        assert_eq!(
            attributes.headers()["content-type"],
            "application/x-amz-json-1.0"
        );
        assert_eq!(
            body_text(attributes),
            r#"{"Attributes":{"MaximumMessageSize":"1048576"}}"#
        );
        let answer = respond_json(
            Operation::SendMessageBatch,
            &Bytes::from_static(SQS_BATCH),
            &state,
        );
        assert_eq!(answer.status(), 200);
        let json = body_text(answer);
        assert!(
            json.starts_with(r#"{"Successful":[{"Id":"0","MessageId":""#),
            "{json}"
        );
        assert!(json.contains(r#"},{"Id":"1","MessageId":""#), "{json}");
        assert_eq!(json.matches("\"MD5OfMessageBody\":\"").count(), 2, "{json}");
        assert_eq!(
            json.matches("\"SequenceNumber\":\"").count(),
            2,
            "FIFO: {json}"
        );
        assert!(json.ends_with(r#"}],"Failed":[]}"#), "{json}");
        assert_eq!(state.counts.snapshot(), (2, 1, 0));
        assert_eq!(state.counts.attribute_calls.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn eventbridge_answers_an_event_id_an_entry() {
        let state = endpoint_state(None);
        let answer = respond_json(
            Operation::PutEvents,
            &Bytes::from_static(PUT_EVENTS),
            &state,
        );
        assert_eq!(
            answer.headers()["content-type"],
            "application/x-amz-json-1.1"
        );
        let json = body_text(answer);
        assert!(
            json.starts_with(r#"{"FailedEntryCount":0,"Entries":[{"EventId":""#),
            "{json}"
        );
        assert_eq!(json.matches("EventId").count(), 2, "{json}");
        assert_eq!(state.counts.snapshot(), (2, 1, 0));
    }

    #[test]
    fn kinesis_answers_a_sequence_number_and_shard_a_record() {
        let state = endpoint_state(None);
        let json = body_text(respond_json(
            Operation::PutRecords,
            &Bytes::from_static(PUT_RECORDS),
            &state,
        ));
        assert!(
            json.starts_with(r#"{"FailedRecordCount":0,"Records":[{"SequenceNumber":"4959"#),
            "{json}"
        );
        assert_eq!(
            json.matches("\"ShardId\":\"shardId-00000000000").count(),
            3,
            "{json}"
        );
        assert_eq!(state.counts.snapshot(), (3, 1, 0));
    }

    #[test]
    fn above_the_quota_each_service_throttles_as_it_does() {
        // A bucket of 10 messages (its floor), spent by the first calls.
        let state = endpoint_state(Some(1.0));
        let sqs = Bytes::from_static(SQS_BATCH);
        for _ in 0..5 {
            assert_eq!(
                respond_json(Operation::SendMessageBatch, &sqs, &state).status(),
                200
            );
        }
        assert_eq!(
            refusal(respond_json(Operation::SendMessageBatch, &sqs, &state)),
            (400, "RequestThrottled".to_owned(), Class::Throttled)
        );
        assert_eq!(
            refusal(respond_json(
                Operation::PutEvents,
                &Bytes::from_static(PUT_EVENTS),
                &state
            )),
            (400, "ThrottlingException".to_owned(), Class::Throttled)
        );
        let state = endpoint_state(Some(1.0));
        state.bucket.as_ref().unwrap().lock().unwrap().tokens = 2.0;
        let json = body_text(respond_json(
            Operation::PutRecords,
            &Bytes::from_static(PUT_RECORDS),
            &state,
        ));
        assert!(
            json.starts_with(r#"{"FailedRecordCount":1,"Records":[{"SequenceNumber":"#),
            "{json}"
        );
        assert!(
            json.contains(r#"{"ErrorCode":"ProvisionedThroughputExceededException","ErrorMessage":"Rate exceeded for shard shardId-"#),
            "{json}"
        );
        assert_eq!(
            classify(None, Some("ProvisionedThroughputExceededException"), None),
            Class::Throttled
        );
        assert_eq!(state.counts.snapshot(), (2, 1, 1));
    }

    #[test]
    fn a_bucket_holds_its_burst_and_a_lifted_one_takes_everything() {
        let mut bucket = Bucket::new(100.0, Duration::from_secs(5));
        assert!(bucket.take(500.0), "five seconds of quota at once");
        assert!(!bucket.take(10.0));
        assert_eq!(bucket.take_up_to(10), 0);
        bucket.lifted = true;
        assert!(bucket.take(1e9));
        assert_eq!(bucket.take_up_to(10), 10);
        // At least one batch of ten, however small the quota or the burst.
        assert_eq!(Bucket::capacity(1.0, DEFAULT_BURST), 10.0);
        assert_eq!(Bucket::capacity(3_000.0, DEFAULT_BURST), 300.0);
    }

    fn body_text(response: Response<Full<Bytes>>) -> String {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime");
        let bytes = rt
            .block_on(response.into_body().collect())
            .expect("a body")
            .to_bytes();
        String::from_utf8(bytes.to_vec()).expect("UTF-8")
    }
}
