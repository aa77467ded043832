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
//!
//! A retry carries its [`Cause`]: throttling (`Throttling` and its kin, HTTP
//! 429) is [`Cause::Throttled`], a timeout [`Cause::TimedOut`], a 5xx or a
//! connection failure [`Cause::Unavailable`]: the load signals on which the
//! publisher's concurrency limit shrinks. Credential, signing and unknown
//! client errors are [`Cause::Other`]: sending less would not help them.
//! | authorization or credential errors | retryable, logged at error level on every attempt: never dropped |
//! | an entry's `InvalidParameter`, too large, topic `NotFound` | rejected: recorded as failed, the stream moves on |
//!
//! A request-level permanent error for a batch of several entries does not
//! condemn them all: the entries are sent again one by one so only the
//! culprit is rejected. Nothing that may have reached SNS is sent again below
//! the publisher (it retries with the configured policy); operation and
//! attempt timeouts are explicit so no call hangs. FIFO ids SNS would refuse
//! (over 128 characters, not printable ASCII) are replaced by their SHA-256
//! ([`fifo_id`]).
//!
//! The calls are made by a small client of the relay's own (`client.rs`):
//! the request body is written once into one buffer (`protocol.rs`), signed
//! by `aws-sigv4`, sent on kept-alive HTTP/1.1 connections; region,
//! endpoint settings and credentials come from `aws-config`'s standard chain
//! and SNS's endpoint rules. This replaced the AWS SDK's SNS client, whose
//! per-call work cost more CPU than the rest of the relay
//! (docs/benchmarks.md).

use std::borrow::Cow;
use std::time::Duration;

use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;
use aws_config::{BehaviorVersion, Region};

use self::client::{CallError, Client};
use self::protocol::{Entry, EntryResult};
use super::{Cause, Concurrency, Message, Outcome, Retry, Sink};
use crate::config::SnsConfig;

mod client;
mod protocol;
mod proxy;

/// SNS's limit for one publish request, bodies and attributes together.
pub const MAX_REQUEST_BYTES: usize = 256 * 1024;
/// SNS's limit of entries in one PublishBatch.
pub const MAX_BATCH_ENTRIES: usize = 10;

/// Publishes to SNS.
pub struct SnsSink {
    client: Client,
    attributes: Vec<String>,
    concurrency: Concurrency,
    linger: Duration,
    operation_timeout: Duration,
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
    /// Build the client: the standard AWS region, endpoint and credential
    /// settings, explicit timeouts, no retries but the publisher's.
    pub async fn new(config: &SnsConfig) -> Result<Self, SnsSetupError> {
        // The timeouts and retries here are those of the credential providers
        // that call out (instance metadata, STS, SSO).
        let timeouts = TimeoutConfig::builder()
            .operation_timeout(config.operation_timeout)
            .operation_attempt_timeout(config.attempt_timeout)
            .connect_timeout(config.attempt_timeout.min(Duration::from_secs(3)))
            .build();
        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .timeout_config(timeouts)
            .retry_config(RetryConfig::standard());
        if let Some(region) = config.region_or_arn() {
            loader = loader.region(Region::new(region.to_owned()));
        }
        let sdk = loader.load().await;
        let Some(region) = sdk.region() else {
            return Err(SnsSetupError {
                key: "sns.region",
                message: "no AWS region: set sns.region, or AWS_REGION".into(),
            });
        };
        let client = Client::new(
            &sdk,
            region.as_ref(),
            &config.endpoint_url,
            config.max_in_flight_batches,
            config.attempt_timeout,
        )
        .await?;
        tracing::debug!(endpoint = client.endpoint(), region = %region, "SNS client ready");
        Ok(Self {
            client,
            attributes: config.attributes.clone(),
            concurrency: config.concurrency(),
            linger: config.linger,
            operation_timeout: config.operation_timeout,
        })
    }

    /// The request entry for `message` (at `index` in its batch) and its
    /// size in bytes as SNS counts it: body and attributes.
    fn entry<'a>(
        &'a self,
        index: usize,
        message: &'a Message,
        fifo: bool,
    ) -> Result<(Entry<'a>, usize), String> {
        let event = &message.event;
        let body = &message.body[..];
        let mut size = body.len();
        let mut attributes = Vec::with_capacity(4 + self.attributes.len());
        let mut attribute = |name: &'a str, value: Cow<'a, str>| {
            if value.is_empty() {
                return; // SNS refuses empty attribute values
            }
            size += name.len() + "String".len() + value.len();
            attributes.push((name, value));
        };
        attribute("event_id", Cow::Borrowed(event.id()));
        attribute("event_type", Cow::Borrowed(event.event_type()));
        attribute("aggregate_type", Cow::Borrowed(event.aggregate_type()));
        attribute("aggregate_id", Cow::Borrowed(event.aggregate_id()));
        if !self.attributes.is_empty() {
            if let Some(headers) = event.headers() {
                if let Ok(mut map) =
                    serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(headers)
                {
                    for name in &self.attributes {
                        if let Some(serde_json::Value::String(value)) = map.remove(name) {
                            attribute(name, Cow::Owned(value));
                        }
                    }
                }
            }
        }
        if size > MAX_REQUEST_BYTES {
            return Err(format!(
                "message too large: {size} bytes with attributes; SNS accepts at most {MAX_REQUEST_BYTES}"
            ));
        }
        let fifo = fifo.then(|| (fifo_id(event.group()), fifo_id(event.id())));
        let entry = Entry {
            index,
            message: body,
            attributes,
            fifo,
        };
        Ok((entry, size))
    }

    /// Send one request of `entries`; fill `outcomes` for them (at the
    /// entries' indices).
    async fn send(&self, topic: &str, entries: &[Entry<'_>], outcomes: &mut [Option<Outcome>]) {
        // Outside the call's timeout: a credential fetch is bounded by the
        // providers' own timeouts and must not be cut off halfway.
        let identity = match self.client.identity().await {
            Ok(identity) => identity,
            Err(error) => {
                let reason = error.to_string();
                tracing::error!(topic, error = %reason, "the AWS credential chain gave no credentials; retrying");
                retry_all(entries, outcomes, Cause::Other, &reason);
                return;
            }
        };
        let body = protocol::publish_batch_body(topic, entries);
        let call = self.client.call(&identity, body);
        let answer = match tokio::time::timeout(self.operation_timeout, call).await {
            Ok(answer) => answer,
            Err(_) => Err(CallError::Timeout {
                endpoint: self.client.endpoint().to_owned(),
                timeout: self.operation_timeout,
            }),
        };
        let (status, body) = match answer {
            Ok(answer) => answer,
            Err(error) => {
                let reason = error.to_string();
                if matches!(error, CallError::Signing(_)) {
                    tracing::error!(topic, error = %reason, "cannot sign SNS requests; retrying");
                }
                let cause = match error {
                    CallError::Timeout { .. } => Cause::TimedOut,
                    CallError::Connect { .. } | CallError::Io { .. } => Cause::Unavailable,
                    CallError::Credentials(_) | CallError::Signing(_) => Cause::Other,
                };
                retry_all(entries, outcomes, cause, &reason);
                return;
            }
        };
        if status.is_success() {
            self.read_results(topic, &body, entries, outcomes);
            return;
        }
        let (code, reason) = match protocol::parse_error(&body) {
            Some((code, message)) => {
                let mut reason = format!("{code}: {}", message.as_deref().unwrap_or("no message"));
                if let Some(id) = protocol::request_id(&body) {
                    reason.push_str(&format!(" (request id {id})"));
                }
                (Some(code), reason)
            }
            None => (
                None,
                format!(
                    "HTTP {status} from {}: {}",
                    self.client.endpoint(),
                    String::from_utf8_lossy(&body[..body.len().min(200)]).trim()
                ),
            ),
        };
        let cause = match &code {
            _ if status == hyper::StatusCode::TOO_MANY_REQUESTS => Cause::Throttled,
            Some(code) if throttling(code) => Cause::Throttled,
            _ if status.is_server_error() => Cause::Unavailable,
            _ => Cause::Other,
        };
        let class = match &code {
            _ if status.is_server_error() => Class::Transient,
            Some(code) => class_of(code),
            None => Class::Transient,
        };
        match class {
            Class::Permanent if code.as_deref() == Some("NotFound") => {
                let reason = format!(
                    "topic {topic} does not exist ({reason}): create it or fix the routing"
                );
                for entry in entries {
                    outcomes[entry.index] = Some(Outcome::Rejected(reason.clone()));
                }
            }
            Class::Permanent if entries.len() == 1 => {
                outcomes[entries[0].index] = Some(Outcome::Rejected(reason));
            }
            Class::Permanent => {
                // Find the culprit: each entry alone, in order; after a
                // transient failure the rest wait, so nothing overtakes it.
                let mut pending: Option<Retry> = None;
                for entry in entries {
                    if let Some(retry) = &pending {
                        outcomes[entry.index] = Some(Outcome::Retryable(retry.clone()));
                        continue;
                    }
                    Box::pin(self.send(topic, std::slice::from_ref(entry), outcomes)).await;
                    if let Some(Outcome::Retryable(retry)) = &outcomes[entry.index] {
                        pending = Some(retry.clone());
                    }
                }
            }
            Class::Auth => {
                tracing::error!(topic, error = %reason, "SNS refused the credentials or permissions; retrying");
                if code.as_deref().is_some_and(stale_credentials) {
                    self.client.forget_credentials().await;
                }
                retry_all(entries, outcomes, cause, &reason);
            }
            Class::Transient => retry_all(entries, outcomes, cause, &reason),
        }
    }

    /// The outcomes a successful `PublishBatch` answer gives `entries`.
    fn read_results(
        &self,
        topic: &str,
        body: &[u8],
        entries: &[Entry<'_>],
        outcomes: &mut [Option<Outcome>],
    ) {
        let results = match protocol::parse_publish_batch(body) {
            Ok(results) => results,
            Err(error) => {
                let reason = format!("unreadable answer from {}: {error}", self.client.endpoint());
                retry_all(entries, outcomes, Cause::Other, &reason);
                return;
            }
        };
        let ours = |id: Option<usize>| id.filter(|i| entries.iter().any(|e| e.index == *i));
        for result in results {
            match result {
                EntryResult::Published { id } => {
                    if let Some(i) = ours(id) {
                        outcomes[i] = Some(Outcome::Delivered);
                    }
                }
                EntryResult::Failed {
                    id,
                    code,
                    message,
                    sender_fault,
                } => {
                    let Some(i) = ours(id) else { continue };
                    let reason = format!("{code}: {}", message.as_deref().unwrap_or("no message"));
                    outcomes[i] = Some(match class_of(&code) {
                        Class::Permanent if sender_fault => Outcome::Rejected(reason),
                        Class::Auth => {
                            tracing::error!(topic, error = %reason, "SNS refused the credentials or permissions; retrying");
                            Outcome::retry(Cause::Other, reason)
                        }
                        _ if throttling(&code) => Outcome::retry(Cause::Throttled, reason),
                        _ if !sender_fault => Outcome::retry(Cause::Unavailable, reason),
                        _ => Outcome::retry(Cause::Other, reason),
                    });
                }
            }
        }
        for entry in entries {
            if outcomes[entry.index].is_none() {
                outcomes[entry.index] = Some(Outcome::retry(
                    Cause::Other,
                    "SNS did not answer for the entry",
                ));
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

/// Every one of `entries` is to be sent again, for `reason` of kind `cause`.
fn retry_all(entries: &[Entry<'_>], outcomes: &mut [Option<Outcome>], cause: Cause, reason: &str) {
    for entry in entries {
        outcomes[entry.index] = Some(Outcome::retry(cause, reason));
    }
}

/// Whether SNS's error `code` asks the caller to slow down.
fn throttling(code: &str) -> bool {
    matches!(
        code,
        "Throttling"
            | "ThrottlingException"
            | "ThrottledException"
            | "Throttled"
            | "TooManyRequestsException"
            | "RequestLimitExceeded"
            | "RequestThrottled"
            | "RequestThrottledException"
            | "SlowDown"
    )
}

/// Whether SNS's error `code` says the credentials themselves are expired
/// or unknown (so the cached ones are dropped and the chain asked again).
fn stale_credentials(code: &str) -> bool {
    matches!(
        code,
        "ExpiredToken"
            | "ExpiredTokenException"
            | "InvalidClientTokenId"
            | "UnrecognizedClientException"
            | "InvalidAccessKeyId"
    )
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
        | "RequestExpired"
        | "RequestTimeTooSkewed"
        | "InvalidSignatureException"
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

    fn concurrency(&self) -> Concurrency {
        self.concurrency
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
                    request.push(entry);
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
                Some(retry) => retry_all(&request, &mut outcomes, retry.cause, &retry.reason),
                None => self.send(&topic, &request, &mut outcomes).await,
            }
        }
        outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Outcome::retry(Cause::Other, "not sent")))
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
        assert!(throttling("Throttling"));
        assert!(!throttling("InternalError"));
    }
}
