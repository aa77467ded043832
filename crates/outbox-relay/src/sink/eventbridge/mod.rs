//! The `eventbridge` sink: `PutEvents` to Amazon EventBridge buses (AWS
//! JSON 1.1).
//!
//! Each event becomes one entry: `Source` and `DetailType` from
//! `eventbridge.source` and `eventbridge.detail_type` (templates with
//! `{aggregate_type}` and `{event_type}`), `Detail` = the envelope, which
//! must be a JSON object (the CloudEvents envelope is; a raw payload that is
//! not an object is recorded FAILED without a call), `EventBusName` = the
//! bus. Rules then match on `source`, `detail-type` or anything in `detail`.
//!
//! Limits, as EventBridge documents them today: at most 10 entries a call,
//! an entry (Source, DetailType and Detail in UTF-8 bytes) and a whole call
//! at most 1 MiB (raised from 256 KiB in January 2026). "Delivered" means
//! PutEvents gave the entry an `EventId`. An entry's `ErrorCode` is
//! classified as every AWS error is ([`crate::sink::aws::errors`]): `InternalFailure`
//! and `ThrottlingException` are retried, `MalformedDetail` and
//! `InvalidArgument` recorded.
//!
//! # A bus that does not exist
//!
//! `PutEvents` takes events for a custom bus that does not exist, gives them
//! an `EventId` and drops them (aws/aws-cli#9186; LocalStack does the same on
//! purpose). So before the first batch to a bus, and again after
//! [`KNOWN_FOR`](crate::sink::aws::known::KNOWN_FOR), the sink asks
//! `DescribeEventBus`: a bus that does not exist has its events recorded
//! FAILED, naming it, as a missing SNS topic or SQS queue does. Nothing is
//! sent to a bus that could not be verified: while `DescribeEventBus` goes
//! unanswered the events are retried as in an outage (the slot waits); a role
//! that may not describe the configured bus (no `events:DescribeEventBus`; for
//! the `default` bus it is asked about too) stops the relay at start-up naming
//! the permission, and a bus a row names that the role may not describe has its
//! events recorded FAILED naming the permission (replayable once it is
//! granted), so no row can hold the slot. A name that is no bus name (over 256
//! characters, other characters) is recorded without a call.
//! `eventbridge.verify_bus = false` opts out: the events of a bus that cannot
//! be verified are then sent unchecked, at the risk above. A bus known to exist
//! is asked about again after
//! [`KNOWN_FOR`](crate::sink::aws::known::KNOWN_FOR): one deleted meanwhile
//! takes events for that long.
//!
//! EventBridge does not promise the order in which targets receive events;
//! the relay still sends each ordering group in commit order.

use serde::{Deserialize, Serialize};

use std::sync::Arc;

use crate::pipeline::sink::{Cause, Message, Outcome};
use crate::sink::aws::batch::{
    missing, positional, Answer, BatchSink, Batches, Gate, Positional, Protocol, Question,
};
use crate::sink::aws::known::{Known, KNOWN_FOR, UNANSWERED_FOR};
use crate::sink::aws::{self, json, SetupError};

pub(crate) mod config;

pub(crate) use config::EventBridgeConfig;

/// EventBridge's limit of an entry and of a call, in bytes.
pub(crate) const MAX_EVENT_SIZE: usize = 1_048_576;

/// Publishes to EventBridge.
pub(crate) type EventBridgeSink = BatchSink<PutEvents, Buses>;

impl EventBridgeSink {
    /// A sink for `config` (validated).
    pub async fn new(config: &EventBridgeConfig) -> Result<Self, SetupError> {
        let client = aws::client(
            aws::EVENTBRIDGE,
            "events",
            aws::Calls {
                region: config.region_or_arn(),
                region_key: "eventbridge.region",
                endpoint_url: &config.endpoint_url,
                endpoint_key: "eventbridge.endpoint_url",
                max_in_flight: config.max_in_flight_batches,
                operation_timeout: config.operation_timeout,
                attempt_timeout: config.attempt_timeout,
            },
        )
        .await?;
        let protocol = PutEvents {
            source: config.source.clone(),
            detail_type: config.detail_type.clone(),
        };
        let batches = Batches::new(
            client,
            protocol,
            config.operation_timeout,
            config.retry_unknown_errors_for,
        );
        let buses = Buses::new(config.verify_bus, &config.bus);
        if config.verify_bus {
            // A role that may not verify the configured bus would hold every
            // event: say so now, naming the permission (of the default bus,
            // which is not asked about later, too: rows may name others). An
            // unanswered question is asked again when events come.
            let body = serde_json::json!({ "Name": &config.bus })
                .to_string()
                .into_bytes();
            if let Err(Question::Refused(reason)) =
                batches.ask("AWSEvents.DescribeEventBus", body).await
            {
                return Err(SetupError {
                    key: "eventbridge.verify_bus",
                    message: format!(
                        "the role may not call events:DescribeEventBus on {} ({reason}); PutEvents takes events \
                         for a bus that does not exist and drops them, so the relay sends only to verified buses: \
                         allow events:DescribeEventBus, or set eventbridge.verify_bus = false to send unverified",
                        config.bus
                    ),
                });
            }
        }
        Ok(BatchSink::assemble(
            "eventbridge",
            batches,
            (config.concurrency(), config.linger),
            buses,
            usize::MAX,
        ))
    }
}

/// Whether each bus exists, as `DescribeEventBus` says, kept for
/// [`KNOWN_FOR`] (see the module's docs).
pub struct Buses {
    known: Known<Bus>,
    /// `eventbridge.verify_bus`: send nothing to a bus not known to exist.
    verify: bool,
    /// `eventbridge.bus`: a refusal to describe it is the operator's to fix
    /// (retried); any other bus is a row's choice (recorded).
    configured: Arc<str>,
}

impl Buses {
    /// Buses checked as `verify` (`eventbridge.verify_bus`) says, the
    /// configured one being `configured`.
    pub fn new(verify: bool, configured: &str) -> Self {
        Self {
            known: Known::default(),
            verify,
            configured: Arc::from(configured),
        }
    }
}

/// What `DescribeEventBus` said of a bus.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Bus {
    /// It exists.
    Exists,
    /// It does not: the service's reason.
    Missing(String),
    /// The role may not ask (said when it starts): the reason.
    Unchecked(String),
    /// No answer now, for [`UNANSWERED_FOR`]: the reason.
    Unknown(String),
}

impl Buses {
    /// What EventBridge says of `bus` (a name or an ARN).
    async fn bus(&self, batches: &Batches<PutEvents>, bus: &Arc<str>) -> Bus {
        if bus.is_empty() || &**bus == "default" || bus.ends_with(":event-bus/default") {
            return Bus::Exists;
        }
        self.known
            .get(bus, |before| async move {
                let body = serde_json::json!({ "Name": &**bus }).to_string().into_bytes();
                match batches.ask("AWSEvents.DescribeEventBus", body).await {
                    Ok(_) => (Bus::Exists, KNOWN_FOR),
                    Err(Question::Missing(reason)) => {
                        tracing::debug!(bus = %bus, error = %reason, "the event bus does not exist");
                        (Bus::Missing(reason), KNOWN_FOR)
                    }
                    Err(Question::Refused(reason)) => {
                        if !matches!(before, Some(Bus::Unchecked(_))) {
                            tracing::warn!(
                                bus = %bus,
                                error = %reason,
                                "cannot check that the event bus exists (allow events:DescribeEventBus); \
                                 PutEvents takes events for a bus that does not exist and drops them"
                            );
                        }
                        (Bus::Unchecked(reason), KNOWN_FOR)
                    }
                    Err(Question::Unanswered(reason)) => {
                        tracing::debug!(bus = %bus, error = %reason, "cannot check that the event bus exists now");
                        (Bus::Unknown(reason), UNANSWERED_FOR)
                    }
                }
            })
            .await
    }
}

impl Gate<PutEvents> for Buses {
    async fn admit(&self, batches: &Batches<PutEvents>, bus: &Arc<str>) -> Result<usize, Outcome> {
        if let Err(reason) = config::bus_name(bus) {
            return Err(Outcome::Rejected(reason));
        }
        match self.bus(batches, bus).await {
            Bus::Exists => Ok(MAX_EVENT_SIZE),
            Bus::Missing(reason) => Err(Outcome::Rejected(missing::<PutEvents>(
                bus,
                &format!("{reason}; PutEvents would take the event and drop it"),
            ))),
            Bus::Unchecked(_) | Bus::Unknown(_) if !self.verify => Ok(MAX_EVENT_SIZE),
            Bus::Unknown(reason) => Err(Outcome::retry(
                Cause::Unavailable,
                format!("cannot verify that event bus {bus} exists ({reason}); nothing is sent to it until it is"),
            )),
            Bus::Unchecked(reason) => {
                let why = format!(
                    "may not verify that event bus {bus} exists ({reason}): allow events:DescribeEventBus on it, \
                     or set eventbridge.verify_bus = false to send unverified"
                );
                if *bus == self.configured {
                    Err(Outcome::retry(Cause::Other, why))
                } else {
                    Err(Outcome::Rejected(why))
                }
            }
        }
    }
}

/// EventBridge's `PutEvents`.
pub struct PutEvents {
    source: String,
    detail_type: String,
}

impl PutEvents {
    /// `template` for `message`'s event.
    fn render(template: &str, message: &Message) -> String {
        template
            .replace("{aggregate_type}", message.event.aggregate_type())
            .replace("{event_type}", message.event.event_type())
    }
}

#[derive(Serialize)]
struct Request<'a> {
    #[serde(rename = "Entries")]
    entries: Vec<Entry<'a>>,
}

#[derive(Serialize)]
#[serde(rename_all = "PascalCase")]
struct Entry<'a> {
    source: String,
    detail_type: String,
    detail: std::borrow::Cow<'a, str>,
    event_bus_name: &'a str,
}

impl Protocol for PutEvents {
    const WHAT: &'static str = "event bus";
    const TARGET: &'static str = "AWSEvents.PutEvents";
    const CONTENT_TYPE: &'static str = json::JSON_11;
    const MAX_ENTRIES: usize = 10;
    const MAX_REQUEST_BYTES: usize = MAX_EVENT_SIZE;

    fn size(&self, message: &Message) -> Result<usize, String> {
        let detail = std::str::from_utf8(&message.body).map_err(|_| {
            "the envelope is not UTF-8 text; EventBridge takes a JSON object as Detail".to_owned()
        })?;
        if !detail.trim_start().starts_with('{') {
            return Err(
                "EventBridge takes only a JSON object as Detail, and this envelope is not one \
                 (a raw payload that is not an object: use [envelope] format = \"cloudevents\")"
                    .into(),
            );
        }
        let source = Self::render(&self.source, message);
        let detail_type = Self::render(&self.detail_type, message);
        if source.is_empty() || detail_type.is_empty() {
            return Err(format!(
                "empty Source ({source:?}) or DetailType ({detail_type:?}): the event's aggregate or event type is empty"
            ));
        }
        Ok(source.len() + detail_type.len() + detail.len())
    }

    fn body(&self, bus: &str, entries: &[&Message]) -> Vec<u8> {
        let entries = entries
            .iter()
            .map(|message| Entry {
                source: Self::render(&self.source, message),
                detail_type: Self::render(&self.detail_type, message),
                detail: String::from_utf8_lossy(&message.body),
                event_bus_name: bus,
            })
            .collect();
        serde_json::to_vec(&Request { entries }).expect("a request of strings serialises")
    }

    fn answers(&self, body: &[u8], entries: usize) -> Result<Vec<Option<Answer>>, String> {
        #[derive(Deserialize)]
        struct Answers {
            #[serde(rename = "Entries", default)]
            entries: Vec<Positional>,
        }
        let answers: Answers = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        Ok(positional(answers.entries, entries))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::sink::{Outcome, Sink};
    use std::time::Duration;

    /// A sink for the local endpoint at `url`.
    fn sink_at(url: &str) -> EventBridgeSink {
        let protocol = PutEvents {
            source: "outbox-relay".into(),
            detail_type: "{event_type}".into(),
        };
        BatchSink::assemble(
            "eventbridge",
            Batches::new(
                crate::sink::aws::local::client(aws::EVENTBRIDGE, url),
                protocol,
                Duration::from_secs(5),
                Duration::from_secs(600),
            ),
            (crate::pipeline::sink::Concurrency::Fixed(1), Duration::ZERO),
            Buses::new(true, "orders"),
            usize::MAX,
        )
    }

    #[tokio::test]
    async fn a_denied_permission_is_kept_as_refused_and_stale_credentials_are_asked_again() {
        let ask = |code: &'static str| async move {
            let (url, _) = crate::sink::aws::local::endpoint(move |_| {
                crate::sink::aws::local::json_refusal(code, "no")
            })
            .await;
            let batches = Batches::new(
                crate::sink::aws::local::client(aws::EVENTBRIDGE, &url),
                PutEvents {
                    source: "outbox-relay".into(),
                    detail_type: "{event_type}".into(),
                },
                Duration::from_secs(5),
                Duration::from_secs(600),
            );
            batches
                .ask("AWSEvents.DescribeEventBus", b"{}".to_vec())
                .await
        };
        for (code, refused) in [
            ("AccessDeniedException", true),
            ("UnknownOperationException", true),
            ("ExpiredTokenException", false),
            ("UnrecognizedClientException", false),
            ("InvalidSignatureException", false),
        ] {
            let answer = ask(code).await;
            match answer {
                Err(Question::Refused(ref reason)) if refused => assert!(reason.contains(code)),
                Err(Question::Unanswered(ref reason)) if !refused => assert!(reason.contains(code)),
                other => panic!("{code}: {other:?}"),
            }
        }
        assert!(matches!(
            ask("ResourceNotFoundException").await,
            Err(Question::Missing(_))
        ));
    }

    #[tokio::test]
    async fn events_for_a_bus_that_does_not_exist_are_rejected_not_sent() {
        // As AWS: PutEvents takes anything; DescribeEventBus knows one bus.
        let (url, seen) = crate::sink::aws::local::endpoint(|head| {
            if head.contains("x-amz-target: AWSEvents.PutEvents") {
                crate::sink::aws::local::json_ok(r#"{"FailedEntryCount":0,"Entries":[{"EventId":"e"}]}"#)
            } else if head.contains("x-amz-target: AWSEvents.DescribeEventBus") {
                crate::sink::aws::local::json_ok(r#"{"Name":"orders","Arn":"arn:aws:events:us-east-1:123456789012:event-bus/orders"}"#)
            } else {
                crate::sink::aws::local::json_refusal("UnknownOperationException", "?")
            }
        })
        .await;
        let sink = sink_at(&url);
        let event = |bus: &str| Message::for_test("e-1", "a", r#"{"id":"e-1"}"#, bus);
        assert_eq!(sink.publish(&[event("orders")]).await, [Outcome::Delivered]);
        assert_eq!(sink.publish(&[event("orders")]).await, [Outcome::Delivered]);
        let describes = |seen: &crate::sink::aws::local::Seen| {
            seen.heads
                .lock()
                .unwrap()
                .iter()
                .filter(|h| h.contains("DescribeEventBus"))
                .count()
        };
        assert_eq!(describes(&seen), 1, "asked once, then known");

        let (url, seen) = crate::sink::aws::local::endpoint(|head| {
            if head.contains("x-amz-target: AWSEvents.PutEvents") {
                crate::sink::aws::local::json_ok(
                    r#"{"FailedEntryCount":0,"Entries":[{"EventId":"e"}]}"#,
                )
            } else {
                crate::sink::aws::local::json_refusal(
                    "ResourceNotFoundException",
                    "Event bus typo does not exist.",
                )
            }
        })
        .await;
        let sink = sink_at(&url);
        let outcomes = sink.publish(&[event("typo"), event("typo")]).await;
        for outcome in &outcomes {
            assert!(
                matches!(outcome, Outcome::Rejected(reason) if reason.contains("event bus typo does not exist")),
                "{outcome:?}"
            );
        }
        assert_eq!(outcomes.len(), 2);
        assert!(
            !seen
                .heads
                .lock()
                .unwrap()
                .iter()
                .any(|h| h.contains("PutEvents")),
            "nothing sent to a bus that does not exist"
        );
        // The default bus always exists: not asked about.
        assert_eq!(
            sink.publish(&[event("default")]).await,
            [Outcome::Delivered]
        );
        assert_eq!(describes(&seen), 1);
    }

    #[tokio::test]
    async fn a_bus_that_cannot_be_verified_gets_nothing_unless_the_operator_opts_out() {
        for (code, cause) in [
            ("AccessDeniedException", Cause::Other),
            ("InternalFailure", Cause::Unavailable),
        ] {
            let (url, seen) = crate::sink::aws::local::endpoint(move |head| {
                if head.contains("x-amz-target: AWSEvents.PutEvents") {
                    crate::sink::aws::local::json_ok(
                        r#"{"FailedEntryCount":0,"Entries":[{"EventId":"e"}]}"#,
                    )
                } else {
                    crate::sink::aws::local::json_refusal(code, "no")
                }
            })
            .await;
            let event = Message::for_test("e-1", "a", r#"{"id":"e-1"}"#, "orders");
            let outcomes = sink_at(&url).publish(std::slice::from_ref(&event)).await;
            assert!(
                matches!(&outcomes[..], [Outcome::Retryable(r)] if r.cause == cause && r.reason.contains(code)),
                "{code}: {outcomes:?}"
            );
            let puts = || {
                seen.heads
                    .lock()
                    .unwrap()
                    .iter()
                    .filter(|h| h.contains("PutEvents"))
                    .count()
            };
            assert_eq!(puts(), 0, "{code}: nothing sent unverified");
            if code == "AccessDeniedException" {
                // A bus a row chose, not the configured one: recorded, so no
                // row can hold the slot.
                let other = Message::for_test("e-2", "a", r#"{"id":"e-2"}"#, "other");
                let outcomes = sink_at(&url).publish(&[other]).await;
                assert!(
                    matches!(&outcomes[..], [Outcome::Rejected(r)] if r.contains("events:DescribeEventBus")),
                    "{outcomes:?}"
                );
                let long = Message::for_test("e-3", "a", r#"{"id":"e-3"}"#, &"b".repeat(300));
                assert!(matches!(
                    &sink_at(&url).publish(&[long]).await[..],
                    [Outcome::Rejected(_)]
                ));
            }
            let mut unverified = sink_at(&url);
            unverified.gate_mut().verify = false;
            assert_eq!(
                unverified.publish(&[event]).await,
                [Outcome::Delivered],
                "{code}"
            );
            assert_eq!(puts(), 1);
        }
    }

    #[test]
    fn answers_are_positional() {
        let p = PutEvents {
            source: "s".into(),
            detail_type: "{event_type}".into(),
        };
        let answers = p
            .answers(
                br#"{"FailedEntryCount":1,"Entries":[{"EventId":"a"},{"ErrorCode":"MalformedDetail","ErrorMessage":"Detail is malformed."}]}"#,
                3,
            )
            .unwrap();
        assert_eq!(answers[0], Some(Answer::Accepted));
        assert_eq!(
            answers[1],
            Some(Answer::Failed {
                code: "MalformedDetail".into(),
                message: Some("Detail is malformed.".into()),
                sender_fault: None
            })
        );
        assert_eq!(answers[2], None);
        assert_eq!(
            crate::sink::aws::errors::classify(None, Some("MalformedDetail"), None),
            crate::sink::aws::errors::Class::Invalid
        );
        assert_eq!(
            crate::sink::aws::errors::classify(None, Some("InternalFailure"), None),
            crate::sink::aws::errors::Class::Unavailable
        );
    }
}
