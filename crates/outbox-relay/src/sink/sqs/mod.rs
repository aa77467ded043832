//! The `sqs` sink: `SendMessageBatch` to Amazon SQS queues (AWS JSON 1.0).
//!
//! "Delivered" means SQS listed the entry as successful. Each batch goes to
//! one queue (the publisher groups by destination) and is split into
//! requests of at most 10 entries and 1 MiB, counted as SQS counts: the
//! body and the attributes (names, types and values, in bytes). A message
//! over the queue's `MaximumMessageSize` (read with `GetQueueAttributes` on
//! the first batch to the queue, or `sqs.max_message_size`) is rejected
//! before anything is sent.
//!
//! On FIFO queues (URL ending in `.fifo`) every entry carries
//! `MessageGroupId` = the event's ordering group and `MessageDeduplicationId`
//! = the event id (hashed when SQS would refuse them,
//! [`fifo_id`](crate::sink::aws::batch::fifo_id)), so the queue keeps each
//! group in order and drops repeats within its five-minute window. Standard
//! queues do not keep order; the relay still sends each group in order.
//!
//! Message attributes: `event_id`, `event_type`, `aggregate_type`,
//! `aggregate_id` and the headers named in `sqs.attributes`, as `String`.
//!
//! Failures are classified once for every AWS destination
//! ([`crate::sink::aws::errors`], [`crate::sink::aws::batch`]): `QueueDoesNotExist`
//! rejects the entries, an entry failure with `SenderFault` or an invalid
//! request is recorded (a request refused as a whole is narrowed down to the
//! culprit), throttling, 5xx, timeouts and credential errors are retried.

use std::collections::HashMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::event::OutboxEvent;
use crate::pipeline::sink::{Message, Outcome};
use crate::sink::aws::batch::{fifo_id, Answer, BatchSink, Batches, Gate, Protocol, Question};
use crate::sink::aws::known::{warn_unreadable_limit, Known, KNOWN_FOR, UNANSWERED_FOR};
use crate::sink::aws::{self, json, SetupError};

pub(crate) mod config;

pub(crate) use config::SqsConfig;
use config::SQS_MAX_MESSAGE_SIZE;

/// Publishes to SQS.
pub(crate) type SqsSink = BatchSink<Sqs, QueueLimits>;

impl SqsSink {
    /// A sink for `config` (validated): the standard AWS settings, explicit
    /// timeouts, no retries but the publisher's.
    pub async fn new(config: &SqsConfig) -> Result<Self, SetupError> {
        let client = aws::client(
            aws::SQS,
            "sqs",
            aws::Calls {
                region: config.region_or_url(),
                region_key: "sqs.region",
                endpoint_url: &config.endpoint_url,
                endpoint_key: "sqs.endpoint_url",
                max_in_flight: config.max_in_flight_batches,
                operation_timeout: config.operation_timeout,
                attempt_timeout: config.attempt_timeout,
            },
        )
        .await?;
        let protocol = Sqs {
            attributes: config.attributes.clone(),
        };
        Ok(BatchSink::assemble(
            "sqs",
            Batches::new(
                client,
                protocol,
                config.operation_timeout,
                config.retry_unknown_errors_for,
            ),
            (config.concurrency(), config.linger),
            QueueLimits {
                configured: (config.max_message_size > 0).then_some(config.max_message_size),
                known: Known::default(),
            },
            // Batches of distinct groups when the queue the sink names is
            // FIFO; a row routed to another FIFO queue is still sent one
            // entry a group a call (`Sqs::one_per_group`).
            if is_fifo(&config.queue_url) || is_fifo(&config.queue_template) {
                1
            } else {
                usize::MAX
            },
        ))
    }
}

/// Each queue's message size limit: configured (`sqs.max_message_size`), or
/// its `MaximumMessageSize`, read with `GetQueueAttributes` and kept for
/// [`KNOWN_FOR`]. While it cannot be learned (SQS unreachable), SQS's own
/// ceiling is used for [`UNANSWERED_FOR`] (SQS then refuses what is over the
/// queue's, and the refusal is recorded); when it may not be read
/// (permissions), the ceiling is used, said when that starts.
pub struct QueueLimits {
    configured: Option<usize>,
    known: Known<Limit>,
}

/// A queue's limit in bytes, and whether it stands in for one the role may
/// not read (said when that starts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Limit {
    bytes: usize,
    unreadable: bool,
}

impl Gate<Sqs> for QueueLimits {
    async fn admit(&self, batches: &Batches<Sqs>, queue: &Arc<str>) -> Result<usize, Outcome> {
        if let Some(limit) = self.configured {
            return Ok(limit);
        }
        let limit = self
            .known
            .get(queue, |before| async move {
                let ceiling = |unreadable| Limit {
                    bytes: SQS_MAX_MESSAGE_SIZE,
                    unreadable,
                };
                match ask_limit(batches, queue).await {
                    Ok(bytes) => {
                        tracing::debug!(queue = %queue, limit = bytes, "learned the queue's MaximumMessageSize");
                        (Limit { bytes, unreadable: false }, KNOWN_FOR)
                    }
                    // The publish says it does not exist.
                    Err(Question::Missing(_)) => (ceiling(false), KNOWN_FOR),
                    Err(Question::Refused(reason)) => {
                        if !before.is_some_and(|limit| limit.unreadable) {
                            warn_unreadable_limit!(
                                queue = queue,
                                reason,
                                "queue",
                                "sqs:GetQueueAttributes",
                                "sqs.max_message_size",
                                SQS_MAX_MESSAGE_SIZE
                            );
                        }
                        (ceiling(true), KNOWN_FOR)
                    }
                    Err(Question::Unanswered(reason)) => {
                        tracing::debug!(queue = %queue, error = %reason, "cannot learn the queue's MaximumMessageSize now; assuming SQS's ceiling");
                        (ceiling(false), UNANSWERED_FOR)
                    }
                }
            })
            .await;
        Ok(limit.bytes)
    }
}

/// `GetQueueAttributes MaximumMessageSize`.
async fn ask_limit(batches: &Batches<Sqs>, queue: &str) -> Result<usize, Question> {
    let body = serde_json::json!({
        "QueueUrl": queue,
        "AttributeNames": ["MaximumMessageSize"],
    })
    .to_string()
    .into_bytes();
    let body = batches.ask("AmazonSQS.GetQueueAttributes", body).await?;
    #[derive(Deserialize)]
    struct Answer {
        #[serde(rename = "Attributes", default)]
        attributes: HashMap<String, String>,
    }
    let answer: Answer = serde_json::from_slice(&body)
        .map_err(|e| Question::Refused(format!("unreadable GetQueueAttributes answer: {e}")))?;
    Ok(answer
        .attributes
        .get("MaximumMessageSize")
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(SQS_MAX_MESSAGE_SIZE)
        .clamp(1, SQS_MAX_MESSAGE_SIZE))
}

/// Whether `queue` (a URL or a template) names a FIFO queue.
fn is_fifo(queue: &str) -> bool {
    queue.ends_with(".fifo")
}

/// SQS's `SendMessageBatch`.
pub struct Sqs {
    attributes: Vec<String>,
}

impl Sqs {
    /// The message attributes of `event` (empty values left out: SQS refuses them).
    fn attributes<'a>(&self, event: &'a OutboxEvent) -> Vec<(String, std::borrow::Cow<'a, str>)> {
        use std::borrow::Cow;
        let mut attributes = Vec::with_capacity(4 + self.attributes.len());
        for (name, value) in [
            ("event_id", event.id()),
            ("event_type", event.event_type()),
            ("aggregate_type", event.aggregate_type()),
            ("aggregate_id", event.aggregate_id()),
        ] {
            if !value.is_empty() {
                attributes.push((name.to_owned(), Cow::Borrowed(value)));
            }
        }
        for (name, value) in aws::header_values(event.headers(), &self.attributes) {
            attributes.push((name.to_owned(), Cow::Owned(value)));
        }
        attributes
    }
}

/// Whether SQS takes `text` as a message body: XML's characters only
/// (`#x9 | #xA | #xD | #x20-#xD7FF | #xE000-#xFFFD | #x10000-#x10FFFF`).
fn sqs_text(text: &str) -> Result<(), String> {
    match text
        .chars()
        .find(|&c| (c < ' ' && !matches!(c, '\t' | '\n' | '\r')) || matches!(c, '\u{FFFE}' | '\u{FFFF}'))
    {
        None => Ok(()),
        Some(c) => Err(format!(
            "the message holds the character U+{:04X}, which SQS does not take (XML's characters only)",
            u32::from(c)
        )),
    }
}

#[derive(Serialize)]
struct SendMessageBatch<'a> {
    #[serde(rename = "QueueUrl")]
    queue_url: &'a str,
    #[serde(rename = "Entries")]
    entries: Vec<Entry<'a>>,
}

#[derive(Serialize)]
#[serde(rename_all = "PascalCase")]
struct Entry<'a> {
    id: String,
    message_body: std::borrow::Cow<'a, str>,
    #[serde(skip_serializing_if = "HashMap::is_empty")]
    message_attributes: HashMap<String, Attribute<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    message_group_id: Option<std::borrow::Cow<'a, str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    message_deduplication_id: Option<std::borrow::Cow<'a, str>>,
}

#[derive(Serialize)]
#[serde(rename_all = "PascalCase")]
struct Attribute<'a> {
    data_type: &'static str,
    string_value: std::borrow::Cow<'a, str>,
}

impl Protocol for Sqs {
    const WHAT: &'static str = "queue";
    const TARGET: &'static str = "AmazonSQS.SendMessageBatch";
    const CONTENT_TYPE: &'static str = json::JSON_10;
    const MAX_ENTRIES: usize = 10;
    const MAX_REQUEST_BYTES: usize = SQS_MAX_MESSAGE_SIZE;

    fn size(&self, message: &Message) -> Result<usize, String> {
        let body = std::str::from_utf8(&message.body)
            .map_err(|_| "the message is not UTF-8 text, which SQS requires".to_owned())?;
        sqs_text(body)?;
        let attributes: usize = self
            .attributes(&message.event)
            .iter()
            .map(|(name, value)| name.len() + "String".len() + value.len())
            .sum();
        Ok(body.len() + attributes)
    }

    fn body(&self, queue: &str, entries: &[&Message]) -> Vec<u8> {
        let fifo = is_fifo(queue);
        let entries = entries
            .iter()
            .enumerate()
            .map(|(i, message)| Entry {
                id: i.to_string(),
                message_body: String::from_utf8_lossy(&message.body),
                message_attributes: self
                    .attributes(&message.event)
                    .into_iter()
                    .map(|(name, value)| {
                        (
                            name,
                            Attribute {
                                data_type: "String",
                                string_value: value,
                            },
                        )
                    })
                    .collect(),
                message_group_id: fifo.then(|| fifo_id(message.event.group())),
                message_deduplication_id: fifo.then(|| fifo_id(message.event.id())),
            })
            .collect();
        serde_json::to_vec(&SendMessageBatch {
            queue_url: queue,
            entries,
        })
        .expect("a request of strings serialises")
    }

    fn answers(&self, body: &[u8], entries: usize) -> Result<Vec<Option<Answer>>, String> {
        #[derive(Deserialize)]
        struct Batch {
            #[serde(rename = "Successful", default)]
            successful: Vec<Successful>,
            #[serde(rename = "Failed", default)]
            failed: Vec<Failed>,
        }
        #[derive(Deserialize)]
        struct Successful {
            #[serde(rename = "Id")]
            id: String,
        }
        #[derive(Deserialize)]
        struct Failed {
            #[serde(rename = "Id")]
            id: String,
            #[serde(rename = "Code")]
            code: String,
            #[serde(rename = "Message")]
            message: Option<String>,
            #[serde(rename = "SenderFault", default)]
            sender_fault: serde_json::Value,
        }
        let batch: Batch = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        let mut answers = vec![None; entries];
        let index = |id: &str| id.parse::<usize>().ok().filter(|&i| i < entries);
        for ok in batch.successful {
            if let Some(i) = index(&ok.id) {
                answers[i] = Some(Answer::Accepted);
            }
        }
        for failed in batch.failed {
            if let Some(i) = index(&failed.id) {
                // A boolean in AWS's answers, a string in some compatible ones.
                let sender_fault = match &failed.sender_fault {
                    serde_json::Value::Bool(b) => Some(*b),
                    serde_json::Value::String(s) => Some(s == "true"),
                    _ => None,
                };
                answers[i] = Some(Answer::Failed {
                    code: failed.code,
                    message: failed.message,
                    sender_fault,
                });
            }
        }
        Ok(answers)
    }

    /// An SQS FIFO queue may take a later entry of a call and fail an earlier
    /// one of its group (SQS documents no rule against it), and its consumers
    /// rely on the group's order: one entry a group a call.
    fn one_per_group(&self, queue: &str) -> bool {
        is_fifo(queue)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fifo_queue_gets_one_entry_of_a_group_a_call() {
        let sqs = Sqs {
            attributes: Vec::new(),
        };
        assert!(sqs.one_per_group("https://sqs.eu-west-1.amazonaws.com/123456789012/orders.fifo"));
        assert!(!sqs.one_per_group("https://sqs.eu-west-1.amazonaws.com/123456789012/orders"));
    }

    #[test]
    fn answers_are_read_by_entry_id_with_either_kind_of_sender_fault() {
        let sqs = Sqs {
            attributes: Vec::new(),
        };
        let answers = sqs
            .answers(
                br#"{"Successful":[{"Id":"0","MessageId":"m"},{"Id":"2","MessageId":"n"}],
                    "Failed":[{"Id":"1","SenderFault":"true","Code":"InvalidParameterValue","Message":"bad"},
                              {"Id":"3","SenderFault":false,"Code":"InternalError"}]}"#,
                5,
            )
            .unwrap();
        assert_eq!(answers[0], Some(Answer::Accepted));
        assert_eq!(
            answers[1],
            Some(Answer::Failed {
                code: "InvalidParameterValue".into(),
                message: Some("bad".into()),
                sender_fault: Some(true)
            })
        );
        assert_eq!(answers[2], Some(Answer::Accepted));
        assert!(matches!(
            &answers[3],
            Some(Answer::Failed {
                sender_fault: Some(false),
                ..
            })
        ));
        assert_eq!(answers[4], None, "not mentioned");
        assert!(sqs.answers(b"<html>", 1).is_err());
    }

    #[test]
    fn bodies_sqs_refuses_are_known_before_sending() {
        assert!(sqs_text("{\"a\":\"tab\there\"}\n").is_ok());
        assert!(sqs_text("emoji \u{1F600} and \u{E000}").is_ok());
        let refused = sqs_text("bell \u{7}").unwrap_err();
        assert!(refused.contains("U+0007"), "{refused}");
        assert!(sqs_text("\u{FFFF}").is_err());
    }
}
