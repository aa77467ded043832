//! The `sns` sink: `PublishBatch` to AWS SNS.
//!
//! "Delivered" means SNS listed the entry as successful. Each batch goes to one topic (the publisher groups by destination) and
//! is split into requests of at most 10 entries and 256 KiB, counted in bytes
//! over message bodies and attributes (names, types and values).
//!
//! On FIFO topics (ARN ending in `.fifo`) every entry carries
//! `MessageGroupId` = the event's ordering group and `MessageDeduplicationId`
//! = the event id, so SNS FIFO drops repeats within its deduplication window.
//!
//! Message attributes, for subscription filter policies and deduplication:
//! `event_id`, `event_type`, `aggregate_type`, `aggregate_id`, and the headers named in
//! `sns.attributes` (W3C `traceparent` by default), all as `String`; never
//! more than 10 (checked at start-up: raw SQS delivery drops such messages).
//!
//! # Failure classes
//!
//! | what SNS says | outcome |
//! |---|---|
//! | throttling, 5xx, timeouts, connection errors, anything unknown | retryable: backoff, forever, no acknowledgement |
//! | authorization or credential errors | retryable, logged at error level on every attempt: never dropped |
//! | an entry's `InvalidParameter`, too large, topic `NotFound` | rejected: recorded as failed, the stream moves on |
//!
//! A request-level permanent error for a batch of several entries does not
//! condemn them all: the entries are sent again one by one so only the
//! culprit is rejected. The SDK's own retries are off (the publisher retries
//! with the configured policy); operation and attempt timeouts are explicit so
//! no call hangs. FIFO ids SNS would refuse (over 128 characters, not
//! printable ASCII) are replaced by their SHA-256 ([`fifo_id`]).

use std::time::Duration;

use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;
use aws_config::{BehaviorVersion, Region};
use aws_sdk_sns::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_sns::types::{MessageAttributeValue, PublishBatchRequestEntry};
use aws_sdk_sns::Client;

use super::{Message, Outcome, Sink};
use crate::config::SnsConfig;

/// SNS's limit for one publish request, bodies and attributes together.
pub const MAX_REQUEST_BYTES: usize = 256 * 1024;
/// SNS's limit of entries in one PublishBatch.
pub const MAX_BATCH_ENTRIES: usize = 10;

/// Publishes to SNS.
pub struct SnsSink {
    client: Client,
    attributes: Vec<String>,
    in_flight: usize,
    linger: Duration,
}

/// The SNS client cannot be built from the configuration.
#[derive(Debug, thiserror::Error)]
#[error("{key}: {message}")]
pub struct SnsSetupError {
    /// The configuration key.
    pub key: &'static str,
    /// What to do.
    pub message: String,
}

impl SnsSink {
    /// Build the client: standard AWS credential chain, explicit timeouts, no SDK retries.
    pub async fn new(config: &SnsConfig) -> Result<Self, SnsSetupError> {
        let timeouts = TimeoutConfig::builder()
            .operation_timeout(config.operation_timeout)
            .operation_attempt_timeout(config.attempt_timeout)
            .connect_timeout(config.attempt_timeout.min(Duration::from_secs(3)))
            .build();
        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .timeout_config(timeouts)
            .retry_config(RetryConfig::disabled());
        if let Some(region) = config.region_or_arn() {
            loader = loader.region(Region::new(region.to_owned()));
        }
        if !config.endpoint_url.is_empty() {
            loader = loader.endpoint_url(&config.endpoint_url);
        }
        let sdk = loader.load().await;
        if sdk.region().is_none() {
            return Err(SnsSetupError {
                key: "sns.region",
                message: "no AWS region: set sns.region, or AWS_REGION".into(),
            });
        }
        Ok(Self {
            client: Client::new(&sdk),
            attributes: config.attributes.clone(),
            in_flight: config.max_in_flight_batches,
            linger: config.linger,
        })
    }

    /// The request entry for `message` and its size in bytes.
    fn entry(
        &self,
        index: usize,
        message: &Message,
        fifo: bool,
    ) -> Result<(PublishBatchRequestEntry, usize), String> {
        let event = &message.event;
        let body = std::str::from_utf8(&message.body)
            .map_err(|_| "the envelope is not UTF-8 text".to_owned())?;
        let mut size = body.len();
        let mut entry = PublishBatchRequestEntry::builder()
            .id(index.to_string())
            .message(body);
        let mut attribute = |name: &str, value: &str| {
            if value.is_empty() {
                return; // SNS refuses empty attribute values
            }
            size += name.len() + "String".len() + value.len();
            let value = MessageAttributeValue::builder()
                .data_type("String")
                .string_value(value)
                .build()
                .expect("data_type is set");
            entry = std::mem::take(&mut entry).message_attributes(name, value);
        };
        attribute("event_id", event.id.as_str());
        attribute("event_type", event.event_type.as_str());
        attribute("aggregate_type", event.aggregate_type.as_str());
        attribute("aggregate_id", event.aggregate_id.as_str());
        if !self.attributes.is_empty() {
            if let Some(headers) = &event.headers {
                if let Ok(map) = serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(
                    headers.as_str(),
                ) {
                    for name in &self.attributes {
                        if let Some(serde_json::Value::String(value)) = map.get(name) {
                            attribute(name, value);
                        }
                    }
                }
            }
        }
        if fifo {
            entry = entry
                .message_group_id(fifo_id(event.group.as_str()))
                .message_deduplication_id(fifo_id(event.id.as_str()));
        }
        if size > MAX_REQUEST_BYTES {
            return Err(format!(
                "message too large: {size} bytes with attributes; SNS accepts at most {MAX_REQUEST_BYTES}"
            ));
        }
        let entry = entry
            .build()
            .map_err(|e| format!("cannot build the publish entry: {e}"))?;
        Ok((entry, size))
    }

    /// Send one request of `entries` (each with its index in `batch`); fill
    /// `outcomes` for them. The entries move into the request: the rare path
    /// that needs them again builds them anew from `batch`.
    async fn send(
        &self,
        topic: &str,
        batch: &[Message],
        entries: Vec<(usize, PublishBatchRequestEntry)>,
        outcomes: &mut [Option<Outcome>],
    ) {
        let (indices, request): (Vec<usize>, Vec<PublishBatchRequestEntry>) =
            entries.into_iter().unzip();
        let result = self
            .client
            .publish_batch()
            .topic_arn(topic)
            .set_publish_batch_request_entries(Some(request))
            .send()
            .await;
        match result {
            Ok(out) => {
                for ok in out.successful() {
                    if let Some(i) = ok.id().and_then(|id| id.parse::<usize>().ok()) {
                        if let Some(slot) = outcomes.get_mut(i) {
                            *slot = Some(Outcome::Delivered);
                        }
                    }
                }
                for failed in out.failed() {
                    let Some(slot) = failed
                        .id()
                        .parse::<usize>()
                        .ok()
                        .and_then(|i| outcomes.get_mut(i))
                    else {
                        continue;
                    };
                    let reason = format!(
                        "{}: {}",
                        failed.code(),
                        failed.message().unwrap_or("no message")
                    );
                    *slot = Some(match class_of(failed.code()) {
                        Class::Permanent if failed.sender_fault() => Outcome::Rejected(reason),
                        Class::Auth => {
                            tracing::error!(topic, error = %reason, "SNS refused the credentials or permissions; retrying");
                            Outcome::Retryable(reason)
                        }
                        _ => Outcome::Retryable(reason),
                    });
                }
                for i in &indices {
                    if outcomes[*i].is_none() {
                        outcomes[*i] = Some(Outcome::Retryable(
                            "SNS did not answer for the entry".into(),
                        ));
                    }
                }
            }
            Err(error) => {
                let code = error.code().map(str::to_owned);
                let reason = match (&code, error.message()) {
                    (Some(code), Some(message)) => format!("{code}: {message}"),
                    _ => DisplayErrorContext(&error).to_string(),
                };
                let class = match &error {
                    SdkError::ServiceError(_) => code.as_deref().map_or(Class::Transient, class_of),
                    SdkError::ConstructionFailure(_) => Class::Auth, // typically: no credentials
                    _ => Class::Transient,
                };
                match class {
                    Class::Permanent if code.as_deref() == Some("NotFound") => {
                        let reason = format!(
                            "topic {topic} does not exist ({reason}): create it or fix the routing"
                        );
                        for i in &indices {
                            outcomes[*i] = Some(Outcome::Rejected(reason.clone()));
                        }
                    }
                    Class::Permanent if indices.len() == 1 => {
                        outcomes[indices[0]] = Some(Outcome::Rejected(reason));
                    }
                    Class::Permanent => {
                        // Find the culprit: each entry alone, in order; after a
                        // transient failure the rest wait, so nothing overtakes it.
                        let mut pending: Option<String> = None;
                        for i in indices {
                            if let Some(reason) = &pending {
                                outcomes[i] = Some(Outcome::Retryable(reason.clone()));
                                continue;
                            }
                            let entry = match self.entry(i, &batch[i], topic.ends_with(".fifo")) {
                                Ok((entry, _)) => entry,
                                Err(reason) => {
                                    outcomes[i] = Some(Outcome::Rejected(reason));
                                    continue;
                                }
                            };
                            Box::pin(self.send(topic, batch, vec![(i, entry)], outcomes)).await;
                            if let Some(Outcome::Retryable(reason)) = &outcomes[i] {
                                pending = Some(reason.clone());
                            }
                        }
                    }
                    Class::Auth => {
                        tracing::error!(topic, error = %reason, "SNS refused the credentials or permissions; retrying");
                        for i in &indices {
                            outcomes[*i] = Some(Outcome::Retryable(reason.clone()));
                        }
                    }
                    Class::Transient => {
                        for i in &indices {
                            outcomes[*i] = Some(Outcome::Retryable(reason.clone()));
                        }
                    }
                }
            }
        }
    }
}

/// A FIFO `MessageGroupId` / `MessageDeduplicationId`: SNS takes at most 128
/// characters of ASCII letters, digits and punctuation. A value that does not
/// fit is replaced by the hex SHA-256 of it: stable (the same aggregate keeps
/// its group, a repeat keeps its dedup id) and distinct in practice.
pub fn fifo_id(value: &str) -> std::borrow::Cow<'_, str> {
    use sha2::Digest as _;
    let fits = !value.is_empty()
        && value.len() <= 128
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b.is_ascii_punctuation());
    if fits {
        return std::borrow::Cow::Borrowed(value);
    }
    let digest = sha2::Sha256::digest(value.as_bytes());
    let mut hex = String::with_capacity(64);
    for byte in digest {
        hex.push_str(&format!("{byte:02x}"));
    }
    std::borrow::Cow::Owned(hex)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Permanent,
    Auth,
    Transient,
}

/// What an SNS error code means for the entries it concerns.
fn class_of(code: &str) -> Class {
    match code {
        "InvalidParameter"
        | "InvalidParameterValue"
        | "ParameterValueInvalid"
        | "ValidationError"
        | "NotFound"
        | "BatchRequestTooLong"
        | "InvalidBatchEntryId"
        | "BatchEntryIdsNotDistinct"
        | "EmptyBatchRequest"
        | "TooManyEntriesInBatchRequest" => Class::Permanent,
        "AuthorizationError"
        | "AccessDenied"
        | "AccessDeniedException"
        | "InvalidClientTokenId"
        | "SignatureDoesNotMatch"
        | "ExpiredToken"
        | "ExpiredTokenException"
        | "UnrecognizedClientException"
        | "MissingAuthenticationToken"
        | "IncompleteSignature"
        | "InvalidSecurity"
        | "KMSAccessDenied" => Class::Auth,
        _ => Class::Transient,
    }
}

impl Sink for SnsSink {
    fn name(&self) -> &'static str {
        "sns"
    }

    fn max_batch(&self) -> usize {
        MAX_BATCH_ENTRIES
    }

    fn max_in_flight_batches(&self) -> usize {
        self.in_flight
    }

    fn linger(&self) -> Duration {
        self.linger
    }

    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        let Some(first) = batch.first() else {
            return Vec::new();
        };
        let topic = first.destination.clone();
        let fifo = topic.ends_with(".fifo");
        let mut outcomes: Vec<Option<Outcome>> = vec![None; batch.len()];
        let mut request = Vec::new();
        let mut request_bytes = 0;
        let mut requests = Vec::new();
        for (i, message) in batch.iter().enumerate() {
            debug_assert_eq!(message.destination, topic, "one destination per batch");
            match self.entry(i, message, fifo) {
                Ok((entry, size)) => {
                    if request_bytes + size > MAX_REQUEST_BYTES
                        || request.len() == MAX_BATCH_ENTRIES
                    {
                        requests.push(std::mem::take(&mut request));
                        request_bytes = 0;
                    }
                    request.push((i, entry));
                    request_bytes += size;
                }
                Err(reason) => outcomes[i] = Some(Outcome::Rejected(reason)),
            }
        }
        if !request.is_empty() {
            requests.push(request);
        }
        for request in requests {
            let retry_pending = outcomes.iter().find_map(|o| match o {
                Some(Outcome::Retryable(r)) => Some(r.clone()),
                _ => None,
            });
            match retry_pending {
                // An earlier request failed: later ones wait, so nothing overtakes it.
                Some(reason) => {
                    for (i, _) in request {
                        outcomes[i] = Some(Outcome::Retryable(reason.clone()));
                    }
                }
                None => self.send(&topic, batch, request, &mut outcomes).await,
            }
        }
        outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Outcome::Retryable("not sent".into())))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_ids_that_sns_would_refuse_are_hashed_stably() {
        assert_eq!(fifo_id("order-42"), "order-42");
        let spaced = fifo_id("order 42");
        assert_eq!(spaced.len(), 64);
        assert_eq!(spaced, fifo_id("order 42"), "stable");
        assert_ne!(spaced, fifo_id("order 43"));
        assert_eq!(fifo_id(&"x".repeat(129)).len(), 64);
        assert_eq!(fifo_id("commande-é").len(), 64);
    }

    #[test]
    fn error_codes_are_classified() {
        assert_eq!(class_of("Throttling"), Class::Transient);
        assert_eq!(class_of("InternalError"), Class::Transient);
        assert_eq!(class_of("InvalidParameter"), Class::Permanent);
        assert_eq!(class_of("NotFound"), Class::Permanent);
        assert_eq!(class_of("AuthorizationError"), Class::Auth);
        assert_eq!(class_of("InvalidClientTokenId"), Class::Auth);
    }
}
