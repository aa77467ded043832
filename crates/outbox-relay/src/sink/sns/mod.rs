//! The `sns` sink: `PublishBatch` to AWS SNS.
//!
//! "Delivered" means SNS listed the entry as successful. Each batch goes to one topic (the publisher groups by destination) and
//! is split into requests of at most 10 entries and the topic's size limit
//! ([`limits`]: its `MaximumMessageSize`, 256 KiB unless set, up to 1 MiB),
//! counted in bytes over message bodies and attributes (names, types and
//! values), as SNS counts; a message over the limit alone is rejected, or
//! with `sns.large_payload_bucket` stored in S3 and replaced by a pointer
//! ([`claim_check`]).
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
//! By the error's typed parts, never its text ([`errors`], one table):
//!
//! | what SNS says | outcome |
//! |---|---|
//! | throttling, 5xx, timeouts, connection errors | retryable: backoff, forever, no acknowledgement |
//! | authorization, credential or KMS errors | retryable, logged at error level on every attempt: never dropped |
//! | `InvalidParameter`, `ValidationException` and kin, an entry failure with `SenderFault=true`, any other 4xx code, too large | rejected: recorded as failed, the stream moves on |
//! | topic `NotFound` | rejected, every entry |
//! | anything else (an entry failure of an unknown code, not the sender's fault) | retried for `sns.retry_unknown_errors_for`, then rejected |
//!
//! A retry carries its [`Cause`] ([`errors::Class::cause`]): throttling is
//! [`Cause::Throttled`], a timeout [`Cause::TimedOut`], a 5xx or a connection
//! failure [`Cause::Unavailable`]: the load signals on which the publisher's
//! concurrency limit shrinks. Credential, signing and unknown client errors
//! are [`Cause::Other`]: sending less would not help them.
//!
//! A request of several entries refused for a reason one entry could cause
//! (an invalid or unknown one) does not condemn them all: the entries are sent
//! again one by one so only the culprit is rejected. Nothing that may have
//! reached SNS is sent again below the publisher (it retries with the
//! configured policy); operation and attempt timeouts are explicit so no call
//! hangs. FIFO ids SNS would refuse (over 128 characters, not printable
//! ASCII) are replaced by their SHA-256 ([`fifo_id`]).
//!
//! The calls go through the AWS layer ([`crate::sink::aws`]: endpoint settings,
//! credentials, signing, pooled connections, proxies); this folder adds the
//! Query protocol's request bodies and answers (`protocol.rs`, one buffer
//! per request), SNS's error classes ([`errors`]) and limits ([`limits`]).
//! SNS's own endpoint rules (every partition, FIPS, dual-stack) come from the
//! SNS SDK's resolver when no endpoint is configured ([`rules`]).

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use aws_config::SdkConfig;

use self::protocol::{Entry, EntryResult};
use crate::pipeline::sink::{Concurrency, Message, Outcome, Sink};
use crate::sink::aws::batch::{self, fifo_id, retrying, Verdict};
use crate::sink::aws::errors::{self, Class};
use crate::sink::aws::{self, query, CallError, Client, SetupError};

pub mod claim_check;
pub mod config;

pub mod limits;
mod protocol;

pub use config::SnsConfig;

/// SNS's endpoint for `region` by its rules (the SNS SDK's resolver: every
/// partition, GovCloud, China, ISO; the FIPS and dual-stack settings of
/// `sdk`), when no endpoint is configured.
async fn rules(sdk: &SdkConfig, region: &str) -> Result<String, SetupError> {
    use aws_sdk_sns::config::endpoint::{DefaultResolver, Params, ResolveEndpoint as _};
    let unusable = |e: &dyn std::fmt::Display| SetupError {
        key: "sns.region",
        message: format!("no SNS endpoint for region {region:?}: {e}"),
    };
    let params = Params::builder()
        .region(region)
        .use_fips(sdk.use_fips().unwrap_or(false))
        .use_dual_stack(sdk.use_dual_stack().unwrap_or(false))
        .build()
        .map_err(|e| unusable(&e))?;
    let endpoint = DefaultResolver::new()
        .resolve_endpoint(&params)
        .await
        .map_err(|e| unusable(&e))?;
    Ok(endpoint.url().to_owned())
}

/// SNS's limit of entries in one PublishBatch.
pub const MAX_BATCH_ENTRIES: usize = 10;

/// Publishes to SNS.
pub struct SnsSink {
    client: Client,
    attributes: Vec<String>,
    concurrency: Concurrency,
    linger: Duration,
    operation_timeout: Duration,
    unknown: errors::UnknownSince,
    limits: limits::TopicLimits,
    /// Held while a topic's limit is asked of SNS, so batches that start
    /// meanwhile wait for that answer instead of asking again; holds the
    /// last ask's failure, which is theirs too.
    asking: tokio::sync::Mutex<Option<(Arc<str>, Class, String)>>,
    claim_check: Option<claim_check::ClaimCheck>,
    /// Most messages of a group a batch: 1 when the configured topic is FIFO.
    max_run: usize,
}

impl SnsSink {
    /// Build the clients: the standard AWS region, endpoint and credential
    /// settings ([`aws::load`]), explicit timeouts, no retries but the publisher's.
    pub async fn new(config: &SnsConfig) -> Result<Self, SetupError> {
        let (sdk, region) = aws::load(
            config.region_or_arn(),
            "sns.region",
            config.operation_timeout,
            config.attempt_timeout,
        )
        .await?;
        let (key, url) = match aws::endpoint::configured(
            &sdk,
            &aws::SNS,
            ("sns.endpoint_url", &config.endpoint_url),
        ) {
            Some(configured) => configured,
            None => ("sns.region", rules(&sdk, &region).await?),
        };
        let client = Client::new(
            &sdk,
            aws::SNS,
            &region,
            (key, &url),
            config.max_in_flight_batches,
            config.attempt_timeout,
        )?;
        tracing::debug!(endpoint = client.endpoint(), region = %region, "SNS client ready");
        let claim_check = if config.large_payload_bucket.is_empty() {
            None
        } else {
            let (key, url) = aws::endpoint::s3_bucket(
                &sdk,
                &region,
                (
                    "sns.large_payload_endpoint_url",
                    &config.large_payload_endpoint_url,
                ),
                &config.large_payload_bucket,
                "sns.large_payload_bucket",
            );
            let s3 = Client::new(
                &sdk,
                aws::S3,
                &region,
                (key, &url),
                config.max_in_flight_batches,
                config.attempt_timeout,
            )?;
            tracing::debug!(endpoint = s3.endpoint(), "large payloads go to S3");
            Some(claim_check::ClaimCheck::new(
                s3,
                config.large_payload_bucket.clone(),
            ))
        };
        Ok(Self {
            client,
            attributes: config.attributes.clone(),
            concurrency: config.concurrency(),
            linger: config.linger,
            operation_timeout: config.operation_timeout,
            unknown: errors::UnknownSince::new(config.retry_unknown_errors_for),
            limits: limits::TopicLimits::new(config.max_message_size),
            asking: tokio::sync::Mutex::new(None),
            claim_check,
            // Batches of distinct groups when the configured topic is FIFO;
            // a row routed to another FIFO topic is still sent one entry a
            // group a call (`plan`).
            max_run: if config.topic_arn.ends_with(".fifo") || config.topic_template.ends_with(".fifo") {
                1
            } else {
                usize::MAX
            },
        })
    }

    /// The message size limit of `topic` ([`limits`]): configured, known, or
    /// asked of SNS now (one ask at a time: batches that start meanwhile wait
    /// for its answer). An error means the limit is unknown: the caller
    /// sends what fits the default limit and retries the larger entries.
    async fn topic_limit(&self, topic: &Arc<str>) -> Result<usize, (Class, String)> {
        if let Some(limit) = self.limits.known(topic) {
            return Ok(limit);
        }
        let mut asking = match self.asking.try_lock() {
            Ok(asking) => asking,
            Err(_) => {
                // Another batch is asking: its answer, not a second call.
                let failed = self.asking.lock().await;
                return match (self.limits.known(topic), failed.as_ref()) {
                    (Some(limit), _) => Ok(limit),
                    (None, Some((asked, class, reason))) if asked == topic => {
                        Err((*class, reason.clone()))
                    }
                    // It asked for another topic.
                    _ => {
                        drop(failed);
                        Box::pin(self.topic_limit(topic)).await
                    }
                };
            }
        };
        if let Some(limit) = self.limits.known(topic) {
            return Ok(limit);
        }
        let answer = self.ask_topic_limit(topic).await;
        *asking = answer
            .as_ref()
            .err()
            .map(|(class, reason)| (Arc::clone(topic), *class, reason.clone()));
        answer
    }

    /// [`Self::topic_limit`]'s call to SNS.
    async fn ask_topic_limit(&self, topic: &Arc<str>) -> Result<usize, (Class, String)> {
        let identity = self
            .client
            .identity()
            .await
            .map_err(|error| (Class::Access, error.to_string()))?;
        let call = self.client.send(
            &identity,
            aws::Request::form(protocol::get_topic_attributes_body(topic)),
        );
        let (status, body) = match tokio::time::timeout(self.operation_timeout, call).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(error)) => {
                return Err((Class::of(&error), error.to_string()));
            }
            Err(_) => {
                return Err((
                    Class::TimedOut,
                    format!(
                        "no answer from {} within {:?}",
                        self.client.endpoint(),
                        self.operation_timeout
                    ),
                ))
            }
        };
        if status.is_success() {
            return match protocol::parse_topic_attribute(&body, "MaximumMessageSize") {
                Ok(value) => {
                    let limit = value.and_then(|v| v.trim().parse::<usize>().ok());
                    let limit = self.limits.learn(topic, limit);
                    tracing::debug!(topic = %topic, limit, "learned the topic's MaximumMessageSize");
                    Ok(limit)
                }
                // An SNS-compatible endpoint that does not know the call.
                Err(error) => Ok(self.limits.denied(
                    topic,
                    &format!("unreadable GetTopicAttributes answer: {error}"),
                )),
            };
        }
        let error = query::parse_error(&body);
        let code = error.as_ref().map(|(code, _)| code.as_str());
        let reason = match &error {
            Some((code, message)) => format!(
                "GetTopicAttributes: {code}: {}",
                message.as_deref().unwrap_or("no message")
            ),
            None => format!("GetTopicAttributes: HTTP {status}"),
        };
        match errors::classify(Some(status.as_u16()), code, None) {
            // Not allowed, or not known to the endpoint.
            Class::Access if code.is_some_and(errors::permission_denied) => {
                Ok(self.limits.denied(topic, &reason))
            }
            Class::Invalid => Ok(self.limits.denied(topic, &reason)),
            // The publish says so (and the topic is recorded missing); its
            // limit is learned once it exists.
            Class::Missing => Ok(limits::DEFAULT_LIMIT),
            class => Err((class, reason)),
        }
    }

    /// The request entry for `message` (at `index` in its batch) and its
    /// size in bytes as SNS counts it: body and attributes.
    fn entry<'a>(
        &'a self,
        index: usize,
        message: &'a Message,
        fifo: bool,
        limit: usize,
        pointer: Option<&'a str>,
    ) -> Result<(Entry<'a>, usize), String> {
        let event = &message.event;
        let body = pointer.map_or(&message.body[..], str::as_bytes);
        let mut size = body.len();
        let numbers = match pointer {
            Some(_) => {
                let stored = message.body.len().to_string();
                size += claim_check::SIZE_ATTRIBUTE.len() + "Number".len() + stored.len();
                vec![(claim_check::SIZE_ATTRIBUTE, stored)]
            }
            None => Vec::new(),
        };
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
        for (name, value) in aws::header_values(event.headers(), &self.attributes) {
            attribute(name, Cow::Owned(value));
        }
        if size > limit {
            return Err(format!(
                "message too large: {size} bytes with attributes; the topic accepts at most {limit} \
                 (its MaximumMessageSize, or sns.max_message_size)"
            ));
        }
        let fifo = fifo.then(|| (fifo_id(event.group()), fifo_id(event.id())));
        let entry = Entry {
            index,
            message: body,
            attributes,
            fifo,
            numbers,
        };
        Ok((entry, size))
    }

    /// Send one request of `entries`; fill `verdicts` for them (at the
    /// entries' indices).
    async fn send(&self, topic: &str, entries: &[Entry<'_>], verdicts: &mut [Option<Verdict>]) {
        // Outside the call's timeout: a credential fetch is bounded by the
        // providers' own timeouts and must not be cut off halfway.
        let identity = match self.client.identity().await {
            Ok(identity) => identity,
            Err(error) => {
                let reason = error.to_string();
                tracing::error!(topic, error = %reason, "the AWS credential chain gave no credentials; retrying");
                retry_all(entries, verdicts, Class::Access, &reason);
                return;
            }
        };
        let body = protocol::publish_batch_body(topic, entries);
        let call = self.client.send(&identity, aws::Request::form(body));
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
                if let CallError::Signing(_) = error {
                    tracing::error!(topic, error = %reason, "cannot sign SNS requests; retrying");
                }
                let class = Class::of(&error);
                retry_all(entries, verdicts, class, &reason);
                return;
            }
        };
        if status.is_success() {
            self.read_results(topic, &body, entries, verdicts);
            return;
        }
        let (class, code, mut reason) = errors::refusal(
            status,
            self.client.endpoint(),
            &body,
            query::parse_error(&body),
        );
        if code.is_some() {
            if let Some(id) = query::request_id(&body) {
                reason.push_str(&format!(" (request id {id})"));
            }
        }
        match class {
            Class::Missing => {
                let reason = format!(
                    "topic {topic} does not exist ({reason}): create it or fix the routing"
                );
                for entry in entries {
                    verdicts[entry.index] = Some(Verdict::Rejected(reason.clone()));
                }
            }
            _ if class.narrows() && entries.len() > 1 => {
                // Find the culprit: each entry alone, in order; after a
                // failure that is retried the rest wait unsent, so nothing
                // overtakes it.
                for entry in entries {
                    if retrying(verdicts) {
                        break;
                    }
                    Box::pin(self.send(topic, std::slice::from_ref(entry), verdicts)).await;
                }
            }
            Class::Invalid => {
                for entry in entries {
                    verdicts[entry.index] = Some(Verdict::Rejected(reason.clone()));
                }
            }
            Class::Access => {
                tracing::error!(topic, error = %reason, "SNS refused the credentials or permissions; retrying");
                if code.as_deref().is_some_and(errors::stale_credentials) {
                    self.client.forget_credentials().await;
                }
                retry_all(entries, verdicts, class, &reason);
            }
            _ => retry_all(entries, verdicts, class, &reason),
        }
    }

    /// The verdicts a successful `PublishBatch` answer gives `entries`.
    fn read_results(
        &self,
        topic: &str,
        body: &[u8],
        entries: &[Entry<'_>],
        verdicts: &mut [Option<Verdict>],
    ) {
        let results = match protocol::parse_publish_batch(body) {
            Ok(results) => results,
            Err(error) => {
                // As aws::batch: retried for `retry_unknown_errors_for`, then recorded.
                let reason = format!("unreadable answer from {}: {error}", self.client.endpoint());
                retry_all(entries, verdicts, Class::Unknown, &reason);
                return;
            }
        };
        let ours = |id: Option<usize>| id.filter(|i| entries.iter().any(|e| e.index == *i));
        for result in results {
            match result {
                EntryResult::Published { id } => {
                    if let Some(i) = ours(id) {
                        verdicts[i] = Some(Verdict::Delivered);
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
                    let class = errors::classify(None, Some(&code), Some(sender_fault));
                    verdicts[i] = Some(match class {
                        Class::Missing => Verdict::Rejected(format!(
                            "topic {topic} does not exist ({reason}): create it or fix the routing"
                        )),
                        Class::Invalid => Verdict::Rejected(reason),
                        Class::Access => {
                            tracing::error!(topic, error = %reason, "SNS refused the credentials or permissions; retrying");
                            Verdict::Retry(class, reason)
                        }
                        _ => Verdict::Retry(class, reason),
                    });
                }
            }
        }
        for entry in entries {
            if verdicts[entry.index].is_none() {
                verdicts[entry.index] = Some(Verdict::Retry(
                    Class::Unknown,
                    "SNS did not answer for the entry".into(),
                ));
            }
        }
    }
}

/// Every one of `entries` is to be sent again, for `reason`.
fn retry_all(entries: &[Entry<'_>], verdicts: &mut [Option<Verdict>], class: Class, reason: &str) {
    for entry in entries {
        verdicts[entry.index] = Some(Verdict::Retry(class, reason.to_owned()));
    }
}

impl Sink for SnsSink {
    fn name(&self) -> &'static str {
        "sns"
    }

    fn max_batch(&self) -> usize {
        MAX_BATCH_ENTRIES
    }

    fn max_run(&self) -> usize {
        self.max_run
    }

    fn concurrency(&self) -> Concurrency {
        self.concurrency
    }

    fn linger(&self) -> Duration {
        self.linger
    }

    fn source(&self, source: &crate::pipeline::sink::Source) {
        if let Some(claim_check) = &self.claim_check {
            claim_check.source(source);
        }
    }

    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        let Some(first) = batch.first() else {
            return Vec::new();
        };
        let topic = first.destination.clone();
        let fifo = topic.ends_with(".fifo");
        // The learned limit matters only to messages over the default one:
        // while it cannot be learned, the others go as usual (a credential
        // or endpoint problem shows in their publish) and those wait.
        let (limit, unsure) = match self.topic_limit(&topic).await {
            Ok(limit) => (limit, None),
            Err((class, reason)) => {
                let reason = format!("cannot learn the size limit of topic {topic}: {reason}");
                tracing::debug!(topic = %topic, error = %reason, "publishing what fits the default limit");
                (limits::DEFAULT_LIMIT, Some((class, reason)))
            }
        };
        let no_pointers = vec![None; batch.len()];
        let mut plan = self.plan(batch, fifo, limit, &no_pointers);
        // With a bucket, the envelopes over the limit are stored first and
        // their messages point at them; nothing is sent before.
        let mut pointers = vec![None; batch.len()];
        if let Some((class, reason)) = &unsure {
            for &i in &plan.too_large {
                plan.verdicts[i] = Some(Verdict::Retry(*class, reason.clone()));
            }
        } else if let (Some(claim_check), false) = (&self.claim_check, plan.too_large.is_empty()) {
            for &i in &plan.too_large {
                let message = &batch[i];
                match claim_check.store(message.event.id(), &message.body).await {
                    Ok(pointer) => pointers[i] = Some(pointer),
                    Err((class, reason)) => {
                        let verdicts = vec![Some(Verdict::Retry(class, reason)); batch.len()];
                        return batch::settle(&self.unknown, batch, verdicts);
                    }
                }
            }
            plan = self.plan(batch, fifo, limit, &pointers);
        }
        let Plan {
            requests,
            mut verdicts,
            sizes,
            ..
        } = plan;
        for request in requests {
            // An earlier request is to be sent again: later ones wait unsent,
            // so nothing overtakes it.
            if !retrying(&verdicts) {
                self.send(&topic, &request, &mut verdicts).await;
            }
        }
        // A refusal of what only a learned limit above the default let
        // through: the topic's limit may have been lowered; learn it again.
        for (verdict, size) in verdicts.iter_mut().zip(sizes) {
            if let Some(Verdict::Rejected(reason)) = verdict {
                if size > limits::DEFAULT_LIMIT && self.limits.refused(&topic) {
                    let reason = format!("{reason} (the topic's MaximumMessageSize is read again)");
                    *verdict = Some(Verdict::Retry(Class::Unknown, reason));
                }
            }
        }
        batch::settle(&self.unknown, batch, verdicts)
    }
}

/// The requests a batch makes.
struct Plan<'a> {
    /// Of at most 10 entries and the topic's limit, in the batch's order.
    requests: Vec<Vec<Entry<'a>>>,
    /// Those of the messages decided already (too large).
    verdicts: Vec<Option<Verdict>>,
    /// Each message's size as sent, 0 for those not sent.
    sizes: Vec<usize>,
    /// The messages over the topic's limit, by index.
    too_large: Vec<usize>,
}

impl SnsSink {
    /// Split `batch` into requests; `pointers` are the bodies that replace
    /// envelopes stored in S3.
    fn plan<'a>(
        &'a self,
        batch: &'a [Message],
        fifo: bool,
        limit: usize,
        pointers: &'a [Option<String>],
    ) -> Plan<'a> {
        let mut plan = Plan {
            requests: Vec::new(),
            verdicts: vec![None; batch.len()],
            sizes: vec![0; batch.len()],
            too_large: Vec::new(),
        };
        let mut request = Vec::new();
        let mut request_bytes = 0;
        // On a FIFO topic at most one entry of a group a call: SNS may fail
        // an entry and take a later one of its group in the same call, which
        // the consumer would then get first (the repeat that follows the
        // retried entry is deduplicated away).
        let mut groups = std::collections::HashSet::new();
        for (i, message) in batch.iter().enumerate() {
            debug_assert_eq!(
                *message.destination, *batch[0].destination,
                "one destination per batch"
            );
            match self.entry(i, message, fifo, limit, pointers[i].as_deref()) {
                Ok((entry, size)) => {
                    plan.sizes[i] = size;
                    let repeated = fifo && groups.contains(message.event.group());
                    if request_bytes + size > limit || request.len() == MAX_BATCH_ENTRIES || repeated {
                        plan.requests.push(std::mem::take(&mut request));
                        request_bytes = 0;
                        groups.clear();
                    }
                    if fifo {
                        groups.insert(message.event.group());
                    }
                    request.push(entry);
                    request_bytes += size;
                }
                Err(reason) => {
                    plan.verdicts[i] = Some(Verdict::Rejected(reason));
                    plan.too_large.push(i);
                }
            }
        }
        if !request.is_empty() {
            plan.requests.push(request);
        }
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sink for the local endpoint at `url`, without a claim check.
    fn sink_at(url: &str) -> SnsSink {
        SnsSink {
            client: crate::sink::aws::local::client(aws::SNS, url),
            attributes: Vec::new(),
            concurrency: Concurrency::Fixed(1),
            linger: Duration::ZERO,
            operation_timeout: Duration::from_secs(5),
            unknown: errors::UnknownSince::new(Duration::from_secs(600)),
            limits: limits::TopicLimits::new(0),
            asking: tokio::sync::Mutex::new(None),
            claim_check: None,
            max_run: 1,
        }
    }

    #[test]
    fn a_fifo_call_holds_at_most_one_entry_of_a_group() {
        let sink = sink_at("http://127.0.0.1:9");
        let topic = "arn:aws:sns:us-east-1:123456789012:t.fifo";
        let batch = [
            Message::for_test("a", "g1", "{}", topic),
            Message::for_test("b", "g2", "{}", topic),
            Message::for_test("c", "g1", "{}", topic),
            Message::for_test("d", "g3", "{}", topic),
        ];
        let no_pointers = vec![None; batch.len()];
        let runs = |fifo| {
            sink.plan(&batch, fifo, 262_144, &no_pointers)
                .requests
                .iter()
                .map(Vec::len)
                .collect::<Vec<_>>()
        };
        assert_eq!(runs(true), [2, 2], "g1's second entry starts a call");
        assert_eq!(runs(false), [4]);
    }

    #[tokio::test]
    async fn endpoints_follow_the_sdk_rules_for_every_partition() {
        let resolve = |region: &'static str, fips: bool| async move {
            let sdk = SdkConfig::builder().use_fips(fips).build();
            rules(&sdk, region).await.unwrap()
        };
        assert_eq!(
            resolve("eu-west-1", false).await,
            "https://sns.eu-west-1.amazonaws.com"
        );
        assert_eq!(
            resolve("us-east-1", true).await,
            "https://sns-fips.us-east-1.amazonaws.com"
        );
        assert_eq!(
            resolve("cn-north-1", false).await,
            "https://sns.cn-north-1.amazonaws.com.cn"
        );
        // GovCloud's SNS endpoints are FIPS ones already.
        assert_eq!(
            resolve("us-gov-west-1", true).await,
            "https://sns.us-gov-west-1.amazonaws.com"
        );
        assert_eq!(
            resolve("us-iso-east-1", false).await,
            "https://sns.us-iso-east-1.c2s.ic.gov"
        );
    }

    #[test]
    fn fifo_ids_that_sns_would_refuse_are_hashed_stably() {
        use crate::sink::aws::batch::fifo_id;
        assert_eq!(fifo_id("order-42"), "order-42");
        let spaced = fifo_id("order 42");
        assert_eq!(spaced.len(), 64);
        assert_eq!(spaced, fifo_id("order 42"), "stable");
        assert_ne!(spaced, fifo_id("order 43"));
        assert_eq!(fifo_id(&"x".repeat(129)).len(), 64);
        assert_eq!(fifo_id("commande-é").len(), 64);
        // No id is another's hash: a lookalike is hashed as well.
        let hashed = fifo_id("order 42").into_owned();
        assert_ne!(fifo_id(&hashed), hashed);
    }
}
