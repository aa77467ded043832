//! The destinations of the conformance suite, each behind a front that injects
//! faults in its own protocol and read back by a consumer that sees what the
//! destination's consumers see, after the destination's own deduplication:
//!
//! | destination | front | consumer (deduplication) |
//! |---|---|---|
//! | SNS standard | fault proxy (Query protocol) | a subscribed standard SQS queue, raw delivery (none) |
//! | SNS FIFO | fault proxy (Query protocol) | a subscribed FIFO queue (by `MessageDeduplicationId`, 5 minutes) |
//! | SQS standard | fault proxy (JSON protocol) | the queue (none) |
//! | SQS FIFO | fault proxy (JSON protocol) | the queue (by `MessageDeduplicationId`, 5 minutes) |
//! | EventBridge | fault proxy (JSON protocol) | a rule's standard SQS queue (none) |
//! | Kinesis | fault proxy (JSON protocol) | every shard from `TRIM_HORIZON` (none) |
//! | webhook, single and batch | the receiver itself | the receiver (by `webhook-id`, as Standard Webhooks says) |
//!
//! moto deduplicates where AWS does for these: at the SQS FIFO queue (an SNS
//! FIFO topic's deduplication is seen there too).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use harness::aws_json;
use harness::proxy::{Call, Fault, FaultProxy, Refusal};
use harness::sns::{self, SharedEndpoint};
use harness::RelayProcess;
use serde_json::{json, Value};
use tokio::task::JoinHandle;

use super::receiver::{Receiver, SECRET};
use crate::outbox::Outbox;

/// How a destination's consumer finds the envelope (and its id) in what it read.
type BodyOf = fn(&str) -> Option<(String, String)>;

/// The `source` of the relay's EventBridge events, which the bus's rule matches.
const SOURCE: &str = "com.example.conformance";

/// How long one attempt may take before the relay gives up on it.
pub(crate) const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(1);

/// A destination of the suite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    SnsStandard,
    SnsFifo,
    SqsStandard,
    SqsFifo,
    EventBridge,
    Kinesis,
    Webhook,
    WebhookBatch,
}

/// An error answer of a destination's table.
#[derive(Debug, Clone)]
pub(crate) enum Answer {
    /// An AWS error answer (status, code in the request's protocol).
    Aws(Refusal),
    /// An HTTP status (webhooks).
    Http(u16),
}

impl Answer {
    fn aws(status: u16, code: &str) -> Answer {
        Answer::Aws(Refusal::new(status, code))
    }

    fn bare(status: u16) -> Answer {
        Answer::Aws(Refusal::bare(status))
    }

    /// What a row's `last_error` names it by: the code, or the status.
    pub(crate) fn named_by(&self) -> String {
        match self {
            Answer::Aws(Refusal {
                code: Some(code), ..
            }) => code.clone(),
            Answer::Aws(Refusal { status, .. }) | Answer::Http(status) => status.to_string(),
        }
    }
}

impl std::fmt::Display for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Answer::Aws(Refusal {
                status,
                code: Some(code),
            }) => write!(f, "{status} {code}"),
            Answer::Aws(Refusal { status, code: None }) => write!(f, "{status} (no AWS error)"),
            Answer::Http(status) => write!(f, "{status}"),
        }
    }
}

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::SnsStandard => "SNS standard",
            Kind::SnsFifo => "SNS FIFO",
            Kind::SqsStandard => "SQS standard",
            Kind::SqsFifo => "SQS FIFO",
            Kind::EventBridge => "EventBridge",
            Kind::Kinesis => "Kinesis",
            Kind::Webhook => "webhook",
            Kind::WebhookBatch => "webhook batch",
        }
    }

    /// Whether the destination promises its consumers each group's order
    /// (FIFO topics and queues, a Kinesis partition key's shard, a webhook
    /// receiver that the relay sends one request of a group at a time).
    /// AWS promises no order for standard topics, queues or EventBridge:
    /// there the suite reports the order seen.
    pub(crate) fn promises_order(self) -> bool {
        !matches!(
            self,
            Kind::SnsStandard | Kind::SqsStandard | Kind::EventBridge
        )
    }

    pub(crate) fn is_webhook(self) -> bool {
        matches!(self, Kind::Webhook | Kind::WebhookBatch)
    }

    /// Answers of the destination's error table that mean "try again":
    /// access, throttling, the service's own failures, and answers that say
    /// nothing (retried for `retry_unknown_errors_for`, ten minutes).
    pub(crate) fn transient_answers(self) -> Vec<Answer> {
        match self {
            Kind::SnsStandard | Kind::SnsFifo => vec![
                Answer::aws(403, "AuthorizationError"),
                Answer::aws(400, "Throttling"),
                Answer::aws(500, "InternalError"),
                Answer::aws(400, "KMSThrottling"),
                Answer::bare(503),
                Answer::bare(400),
            ],
            Kind::SqsStandard | Kind::SqsFifo => vec![
                Answer::aws(400, "AccessDenied"),
                Answer::aws(400, "ThrottlingException"),
                // SendMessageBatch's own throttling code (SQS API reference).
                Answer::aws(400, "RequestThrottled"),
                Answer::aws(500, "InternalError"),
                Answer::bare(503),
                Answer::bare(400),
            ],
            Kind::EventBridge => vec![
                Answer::aws(400, "AccessDeniedException"),
                Answer::aws(400, "ThrottlingException"),
                Answer::aws(500, "InternalException"),
                Answer::bare(503),
                Answer::bare(400),
            ],
            Kind::Kinesis => vec![
                Answer::aws(400, "AccessDeniedException"),
                Answer::aws(400, "ProvisionedThroughputExceededException"),
                Answer::aws(400, "LimitExceededException"),
                Answer::aws(400, "KMSThrottlingException"),
                Answer::aws(500, "InternalFailure"),
                Answer::bare(503),
                Answer::bare(400),
            ],
            // 401/403: access errors, retried as the AWS sinks retry theirs;
            // 404/409/425: retried (for `retry_unknown_errors_for`).
            Kind::Webhook | Kind::WebhookBatch => {
                [408, 429, 500, 502, 503, 504, 401, 403, 404, 409, 425]
                    .into_iter()
                    .map(Answer::Http)
                    .collect()
            }
        }
    }

    /// Answers of the destination's error table that condemn what they
    /// answer: an invalid request (narrowed to the entry at fault), a
    /// destination that does not exist (every entry of the call), a webhook
    /// receiver's 400, 410, 413, 422 (the whole request).
    pub(crate) fn permanent_answers(self) -> Vec<Answer> {
        match self {
            Kind::SnsStandard | Kind::SnsFifo => vec![
                Answer::aws(400, "InvalidParameter"),
                Answer::aws(404, "NotFound"),
            ],
            Kind::SqsStandard | Kind::SqsFifo => vec![
                Answer::aws(400, "InvalidParameterValue"),
                Answer::aws(400, "QueueDoesNotExist"),
            ],
            Kind::EventBridge => vec![
                Answer::aws(400, "ValidationException"),
                Answer::aws(400, "ResourceNotFoundException"),
            ],
            Kind::Kinesis => vec![
                Answer::aws(400, "InvalidArgumentException"),
                Answer::aws(400, "ResourceNotFoundException"),
            ],
            Kind::Webhook | Kind::WebhookBatch => {
                [400, 410, 413, 422].into_iter().map(Answer::Http).collect()
            }
        }
    }
}

/// A fault in the destination's protocol.
#[derive(Debug, Clone)]
pub(crate) enum Injected {
    /// Processed, then the connection is reset without the answer.
    LoseAnswer,
    /// Processed at once, answered after this (longer than the attempt timeout).
    AnswerLate(Duration),
    /// Held this long, then processed and answered.
    Slow(Duration),
    /// The entry at this position of a batch fails, the others are processed.
    FailEntry(usize),
    /// Answered with this, not processed.
    Refuse(Answer),
}

/// One call (AWS) or request (webhook) that carried events, as the front saw it.
#[derive(Debug, Clone)]
pub(crate) struct Seen {
    /// The envelope ids it carried, in order.
    pub ids: Vec<String>,
    /// Whether a fault of the script or a marked refusal was applied.
    pub faulted: bool,
    /// Answered with an error, not processed (a refusal or the quota).
    pub refused: bool,
    /// Refused for the quota.
    pub throttled: bool,
    /// The destination got it.
    pub forwarded: bool,
    /// The position of the entry failed alone ([`Injected::FailEntry`]).
    pub failed_position: Option<usize>,
}

enum Front {
    Proxy(FaultProxy),
    Receiver(Receiver),
}

/// What the consumer processed: `(id, subject)` in processing order.
type Processed = Arc<Mutex<Vec<(String, String)>>>;

/// A destination set up for one test: its resources, its front, its consumer.
pub(crate) struct Destination {
    front: Front,
    processed: Processed,
    reader: Option<JoinHandle<()>>,
    sink_toml: String,
    env: Vec<(&'static str, String)>,
    _moto: Option<SharedEndpoint>,
}

impl Destination {
    /// Creates the destination for `outbox` (named after its database) on
    /// the shared moto server, or starts a webhook receiver.
    pub(crate) async fn new(kind: Kind, outbox: &Outbox) -> Destination {
        let processed: Processed = Arc::default();
        let retry = "[retry]\ninitial = \"50ms\"\nmax = \"500ms\"\n";
        let timeouts = format!(
            "attempt_timeout = \"{}ms\"\noperation_timeout = \"{}ms\"",
            ATTEMPT_TIMEOUT.as_millis(),
            2 * ATTEMPT_TIMEOUT.as_millis()
        );
        if kind.is_webhook() {
            let receiver = Receiver::start().await;
            let sink_toml = format!(
                "[sink]\nkind = \"webhook\"\n[webhook]\nurl = \"{}\"\ntimeout = \"{}ms\"\nbatch = {}\n{retry}",
                receiver.url(),
                ATTEMPT_TIMEOUT.as_millis(),
                kind == Kind::WebhookBatch
            );
            return Destination {
                front: Front::Receiver(receiver),
                processed,
                reader: None,
                sink_toml,
                env: vec![("OUTBOX_RELAY__WEBHOOK__SECRET", SECRET.to_owned())],
                _moto: None,
            };
        }
        let moto = sns::moto_endpoint().await;
        let proxy = FaultProxy::start(moto.as_str());
        let endpoint = proxy.endpoint();
        let name = outbox.db.name().to_owned();
        let common = format!("region = \"us-east-1\"\nendpoint_url = \"{endpoint}\"\n{timeouts}");
        let (section, queue, body): (String, Option<String>, BodyOf) = match kind {
            Kind::SnsStandard | Kind::SnsFifo => {
                let fifo = kind == Kind::SnsFifo;
                let topic_name = if fifo {
                    format!("{name}.fifo")
                } else {
                    name.clone()
                };
                let topic = sns::topic_with_queue(moto.as_str(), &topic_name, fifo, true).await;
                (
                    format!(
                        "[sink]\nkind = \"sns\"\n[sns]\ntopic_arn = \"{}\"\n{common}",
                        topic.arn
                    ),
                    Some(topic.queue_url),
                    envelope,
                )
            }
            Kind::SqsStandard | Kind::SqsFifo => {
                let queue_name = if kind == Kind::SqsFifo {
                    format!("{name}.fifo")
                } else {
                    name.clone()
                };
                let url = aws_json::create_queue(moto.as_str(), &queue_name).await;
                (
                    format!("[sink]\nkind = \"sqs\"\n[sqs]\nqueue_url = \"{url}\"\n{common}"),
                    Some(url),
                    envelope,
                )
            }
            Kind::EventBridge => {
                let bus = aws_json::bus_to_queue(moto.as_str(), &name, SOURCE).await;
                (
                        format!(
                            "[sink]\nkind = \"eventbridge\"\n[eventbridge]\nbus = \"{}\"\nsource = \"{SOURCE}\"\n{common}",
                            bus.bus
                        ),
                        Some(bus.queue_url),
                        detail,
                    )
            }
            Kind::Kinesis => {
                aws_json::create_stream(moto.as_str(), &name, 2).await;
                (
                    format!("[sink]\nkind = \"kinesis\"\n[kinesis]\nstream = \"{name}\"\n{common}"),
                    None,
                    envelope,
                )
            }
            Kind::Webhook | Kind::WebhookBatch => unreachable!(),
        };
        let reader = match queue {
            Some(url) => read_queue(moto.as_str(), url, body, Arc::clone(&processed)).await,
            None => read_stream(moto.as_str(), name, Arc::clone(&processed)).await,
        };
        Destination {
            front: Front::Proxy(proxy),
            processed,
            reader: Some(reader),
            sink_toml: format!("{section}\n{retry}"),
            env: sns::aws_env(&endpoint),
            _moto: Some(moto),
        }
    }

    /// The relay binary, publishing to this destination through its front.
    pub(crate) fn spawn(&self, outbox: &Outbox) -> RelayProcess {
        let config = outbox.config_file(&self.sink_toml);
        let env: Vec<(&str, &str)> = self.env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        RelayProcess::spawn(&["run", "--config", config.to_str().unwrap()], &env)
    }

    /// Applies `faults`, one to each of the next calls (requests) that carry events.
    pub(crate) fn script(&self, faults: &[Injected]) {
        match &self.front {
            Front::Proxy(proxy) => proxy.script(faults.iter().map(|f| match f {
                Injected::LoseAnswer => Fault::LoseAnswer,
                Injected::AnswerLate(d) => Fault::AnswerLate(*d),
                Injected::Slow(d) => Fault::Slow(*d),
                Injected::FailEntry(p) => Fault::FailEntry(*p),
                Injected::Refuse(Answer::Aws(r)) => Fault::Refuse(r.clone()),
                Injected::Refuse(Answer::Http(s)) => Fault::Refuse(Refusal::bare(*s)),
            })),
            Front::Receiver(receiver) => {
                let faults: Vec<Value> = faults
                    .iter()
                    .map(|f| match f {
                        Injected::LoseAnswer => json!({"kind": "lose"}),
                        Injected::AnswerLate(d) => {
                            json!({"kind": "late", "delay": d.as_secs_f64()})
                        }
                        Injected::Slow(d) => json!({"kind": "slow", "delay": d.as_secs_f64()}),
                        Injected::FailEntry(_) => {
                            panic!("a webhook answer covers its whole request")
                        }
                        Injected::Refuse(Answer::Http(s)) => json!({"kind": "status", "status": s}),
                        Injected::Refuse(Answer::Aws(r)) => {
                            json!({"kind": "status", "status": r.status})
                        }
                    })
                    .collect();
                receiver.script(&faults);
            }
        }
    }

    /// Scripted faults not applied yet.
    pub(crate) fn faults_pending(&self) -> usize {
        match &self.front {
            Front::Proxy(proxy) => proxy.faults_pending(),
            Front::Receiver(receiver) => receiver.faults_pending(),
        }
    }

    /// Refuses with `answer` every call (request) that carries `marker`.
    pub(crate) fn refuse_marked(&self, marker: &str, answer: &Answer) {
        match (&self.front, answer) {
            (Front::Proxy(proxy), Answer::Aws(r)) => proxy.refuse_marked(marker, r.clone()),
            (Front::Proxy(proxy), Answer::Http(s)) => {
                proxy.refuse_marked(marker, Refusal::bare(*s))
            }
            (Front::Receiver(receiver), answer) => {
                let status = match answer {
                    Answer::Http(s) => *s,
                    Answer::Aws(r) => r.status,
                };
                receiver.refuse_marked(marker, status);
            }
        }
    }

    /// A quota in events (AWS entries, webhook requests) a second.
    pub(crate) fn set_quota(&self, quota: Option<(f64, f64)>) {
        match &self.front {
            Front::Proxy(proxy) => proxy.set_quota(quota),
            Front::Receiver(receiver) => receiver.set_quota(quota),
        }
    }

    /// Every call (request) that carried events so far.
    pub(crate) fn calls(&self) -> Vec<Seen> {
        match &self.front {
            Front::Proxy(proxy) => proxy.calls().into_iter().map(seen_call).collect(),
            Front::Receiver(receiver) => receiver
                .requests()
                .into_iter()
                .map(|r| Seen {
                    ids: r.events.iter().map(|(id, _)| id.clone()).collect(),
                    faulted: r.fault.is_some(),
                    refused: r.status >= 300,
                    throttled: r.fault.as_deref() == Some("quota"),
                    forwarded: r.status < 300,
                    failed_position: None,
                })
                .collect(),
        }
    }

    /// `(id, subject)` of each event the consumer processed (after the
    /// destination's deduplication), in the order processed.
    pub(crate) fn processed(&self) -> Vec<(String, String)> {
        match &self.front {
            Front::Receiver(receiver) => receiver
                .requests()
                .into_iter()
                .filter(|r| r.processed)
                .flat_map(|r| r.events)
                .collect(),
            Front::Proxy(_) => self
                .processed
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        }
    }

    /// Where the front keeps its own record (for a failing test's message).
    /// Every call the destination saw, one a line: the ids it carried (their
    /// last characters), the fault applied and what became of it; for a
    /// failure's message.
    pub(crate) fn describe_calls(&self) -> String {
        let short = |id: &String| id[id.len().saturating_sub(6)..].to_owned();
        let ids =
            |ids: &mut dyn Iterator<Item = &String>| ids.map(short).collect::<Vec<_>>().join(" ");
        let calls: Vec<String> = match &self.front {
            Front::Receiver(receiver) => receiver
                .requests()
                .iter()
                .map(|r| {
                    format!(
                        "[{}] fault {:?}, status {}, processed {}",
                        ids(&mut r.events.iter().map(|(id, _)| id)),
                        r.fault,
                        r.status,
                        r.processed
                    )
                })
                .collect(),
            Front::Proxy(_) => self
                .calls()
                .iter()
                .map(|c| {
                    format!(
                        "[{}] faulted {}, refused {}, forwarded {}",
                        ids(&mut c.ids.iter()),
                        c.faulted,
                        c.refused,
                        c.forwarded
                    )
                })
                .collect(),
        };
        calls
            .iter()
            .enumerate()
            .map(|(n, call)| format!("#{n} {call}"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    pub(crate) fn describe_front(&self) -> String {
        match &self.front {
            Front::Proxy(proxy) => format!("{proxy:?}"),
            Front::Receiver(receiver) => {
                format!("receiver log in {}", receiver.log_dir().display())
            }
        }
    }
}

impl Drop for Destination {
    fn drop(&mut self) {
        if let Some(reader) = self.reader.take() {
            reader.abort();
        }
    }
}

fn seen_call(call: Call) -> Seen {
    Seen {
        faulted: call.fault.is_some(),
        refused: call.throttled || matches!(call.fault, Some(Fault::Refuse(_))),
        throttled: call.throttled,
        forwarded: call.forwarded,
        failed_position: match call.fault {
            Some(Fault::FailEntry(p)) if !call.ids.is_empty() => Some(p % call.ids.len()),
            _ => None,
        },
        ids: call.ids,
    }
}

/// `(id, subject)` of a CloudEvents envelope.
fn envelope(body: &str) -> Option<(String, String)> {
    let v: Value = serde_json::from_str(body).ok()?;
    Some((
        v["id"].as_str()?.to_owned(),
        v["subject"].as_str()?.to_owned(),
    ))
}

/// `(id, subject)` of the envelope in an EventBridge event's `detail`.
fn detail(body: &str) -> Option<(String, String)> {
    let event = aws_json::eventbridge_event(body);
    Some((
        event.detail["id"].as_str()?.to_owned(),
        event.detail["subject"].as_str()?.to_owned(),
    ))
}

/// Reads `queue` until aborted, appending what arrives to `processed`.
async fn read_queue(
    moto: &str,
    queue: String,
    parse: fn(&str) -> Option<(String, String)>,
    processed: Processed,
) -> JoinHandle<()> {
    let sqs = sns::sqs_client(moto).await;
    tokio::spawn(async move {
        loop {
            let got = sns::receive_all(&sqs, &queue, 1, Duration::from_millis(500)).await;
            let events: Vec<(String, String)> = got
                .iter()
                .map(|r| parse(&r.body).unwrap_or_else(|| ("?".to_owned(), r.body.clone())))
                .collect();
            processed
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .extend(events);
        }
    })
}

/// Reads every shard of `stream` from the start until aborted, appending
/// what arrives to `processed` (each shard's records in sequence order).
async fn read_stream(moto: &str, stream: String, processed: Processed) -> JoinHandle<()> {
    let mut reader = aws_json::StreamReader::new(moto, &stream).await;
    tokio::spawn(async move {
        loop {
            let records = reader.poll().await;
            let events: Vec<(String, String)> = records
                .iter()
                .map(|r| {
                    let text = String::from_utf8_lossy(&r.data);
                    envelope(&text).unwrap_or_else(|| ("?".to_owned(), text.into_owned()))
                })
                .collect();
            processed
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .extend(events);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}
