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
//! classified as every AWS error is ([`crate::aws::errors`]): `InternalFailure`
//! and `ThrottlingException` are retried, `MalformedDetail` and
//! `InvalidArgument` recorded, a bus that does not exist rejects its entries.
//!
//! EventBridge does not promise the order in which targets receive events;
//! the relay still sends each ordering group in commit order.

use serde::{Deserialize, Serialize};

use super::Message;
use crate::aws::batch::{positional, Answer, BatchSink, Batches, Positional, Protocol};
use crate::aws::{self, json, SetupError};

pub mod config;

pub use config::EventBridgeConfig;

/// EventBridge's limit of an entry and of a call, in bytes.
pub const MAX_EVENT_SIZE: usize = 1_048_576;

/// Publishes to EventBridge.
pub type EventBridgeSink = BatchSink<PutEvents>;

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
        Ok(BatchSink::assemble(
            "eventbridge",
            Batches::new(
                client,
                protocol,
                config.operation_timeout,
                config.retry_unknown_errors_for,
            ),
            (config.concurrency(), config.linger),
            MAX_EVENT_SIZE,
            usize::MAX,
        ))
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
        let detail = std::str::from_utf8(&message.body)
            .map_err(|_| "the envelope is not UTF-8 text; EventBridge takes a JSON object as Detail".to_owned())?;
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
            crate::aws::errors::classify(None, Some("MalformedDetail"), None),
            crate::aws::errors::Class::Invalid
        );
        assert_eq!(
            crate::aws::errors::classify(None, Some("InternalFailure"), None),
            crate::aws::errors::Class::Unavailable
        );
    }
}
