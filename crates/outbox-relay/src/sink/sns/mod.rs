//! The `sns` sink: `PublishBatch` to AWS SNS.
//!
//! "Delivered" means SNS listed the entry as successful. Each batch goes to one topic (the publisher groups by destination) and
//! is split into requests of at most 10 entries and the topic's size limit
//! ([`limits`](crate::sink::sns::limits): its `MaximumMessageSize`, 256 KiB
//! unless set, up to 1 MiB),
//! counted in bytes over message bodies and attributes (names, types and
//! values), as SNS counts; a message over the limit alone is rejected, or
//! with `sns.large_payload_bucket` stored in S3 and replaced by a pointer
//! ([`claim_check`](mod@crate::sink::sns::claim_check)).
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
//! By the error's typed parts, never its text ([`crate::sink::aws::errors`], one table):
//!
//! | what SNS says | outcome |
//! |---|---|
//! | throttling, 5xx, timeouts, connection errors | retryable: backoff, forever, no acknowledgement |
//! | authorization, credential or KMS errors | retryable, logged at error level on every attempt: never dropped |
//! | `InvalidParameter`, `ValidationException` and kin, an entry failure with `SenderFault=true`, any other 4xx code, too large | rejected: recorded as failed, the stream moves on |
//! | topic `NotFound` | rejected, every entry |
//! | anything else (an entry failure of an unknown code, not the sender's fault) | retried for `sns.retry_unknown_errors_for`, then rejected |
//!
//! A retry carries its [`Cause`](crate::pipeline::sink::Cause)
//! ([`Class::cause`](crate::sink::aws::errors::Class::cause)): throttling is
//! [`Cause::Throttled`](crate::pipeline::sink::Cause::Throttled), a timeout
//! [`Cause::TimedOut`](crate::pipeline::sink::Cause::TimedOut), a 5xx or a
//! connection failure
//! [`Cause::Unavailable`](crate::pipeline::sink::Cause::Unavailable): the
//! load signals on which the publisher's concurrency limit shrinks.
//! Credential, signing and unknown client errors are
//! [`Cause::Other`](crate::pipeline::sink::Cause::Other): sending less would
//! not help them.
//!
//! A request of several entries refused for a reason one entry could cause
//! (an invalid or unknown one) does not condemn them all: the entries are sent
//! again one by one so only the culprit is rejected. Nothing that may have
//! reached SNS is sent again below the publisher (it retries with the
//! configured policy); operation and attempt timeouts are explicit so no call
//! hangs. FIFO ids SNS would refuse (over 128 characters, not printable
//! ASCII) are replaced by their SHA-256
//! ([`fifo_id`](crate::sink::aws::batch::fifo_id)).
//!
//! All of that is the batch loop every AWS destination shares
//! ([`crate::sink::aws::batch`]), over the AWS layer ([`crate::sink::aws`]:
//! endpoint settings, credentials, signing, pooled connections, proxies) and
//! its Query protocol ([`crate::sink::aws::query`]). This folder adds SNS's
//! `PublishBatch` ([`PublishBatch`](crate::sink::sns::PublishBatch): entries
//! and answers, `protocol.rs`, one buffer per request) and what SNS learns or
//! keeps of each topic ([`Topics`](crate::sink::sns::Topics): its size limit,
//! [`limits`](crate::sink::sns::limits); large payloads,
//! [`claim_check`](mod@crate::sink::sns::claim_check)). SNS's own endpoint
//! rules (every partition, FIPS, dual-stack) come from the SNS SDK's resolver
//! when no endpoint is configured (`rules`).

use std::borrow::Cow;
use std::sync::Arc;

use aws_config::SdkConfig;

use crate::pipeline::sink::{Message, Outcome, Source};
use crate::sink::aws::batch::{
    fifo_id, Admission, Alarm, Answer, BatchSink, Batches, Entry, Gate, Protocol, Wire,
};
use crate::sink::aws::errors::Class;
use crate::sink::aws::{self, Client, SetupError};

pub(crate) mod claim_check;
pub(crate) mod config;

pub(crate) mod limits;
mod protocol;

pub(crate) use config::SnsConfig;

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

/// Publishes to SNS.
pub type SnsSink = BatchSink<PublishBatch, Topics>;

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
        let topics = Topics {
            limits: limits::TopicLimits::new(config.max_message_size),
            claim_check: claim_check(config, &sdk, &region)?,
        };
        let batches = Batches::new(
            client,
            PublishBatch::new(config.attributes.clone()),
            config.operation_timeout,
            config.retry_unknown_errors_for,
        );
        // Batches of distinct groups when the configured topic is FIFO; a
        // row routed to another FIFO topic is still sent one entry a group a
        // call (`PublishBatch::one_per_group`).
        let fifo = config.topic_arn.ends_with(".fifo") || config.topic_template.ends_with(".fifo");
        Ok(BatchSink::assemble(
            "sns",
            batches,
            (config.concurrency(), config.linger),
            topics,
            if fifo { 1 } else { usize::MAX },
        ))
    }
}

/// Where large payloads go, with `sns.large_payload_bucket`.
fn claim_check(
    config: &SnsConfig,
    sdk: &SdkConfig,
    region: &str,
) -> Result<Option<claim_check::ClaimCheck>, SetupError> {
    if config.large_payload_bucket.is_empty() {
        return Ok(None);
    }
    let (key, url) = aws::endpoint::s3_bucket(
        sdk,
        region,
        (
            "sns.large_payload_endpoint_url",
            &config.large_payload_endpoint_url,
        ),
        &config.large_payload_bucket,
        "sns.large_payload_bucket",
    );
    let s3 = Client::new(
        sdk,
        aws::S3,
        region,
        (key, &url),
        config.max_in_flight_batches,
        config.attempt_timeout,
    )?;
    tracing::debug!(endpoint = s3.endpoint(), "large payloads go to S3");
    Ok(Some(claim_check::ClaimCheck::new(
        s3,
        config.large_payload_bucket.clone(),
    )))
}

/// What the sink keeps of each topic: its size limit ([`limits`]), and
/// where payloads over it go ([`claim_check`](mod@claim_check)).
pub struct Topics {
    limits: limits::TopicLimits,
    claim_check: Option<claim_check::ClaimCheck>,
}

impl Gate<PublishBatch> for Topics {
    async fn admit(
        &self,
        batches: &Batches<PublishBatch>,
        topic: &Arc<str>,
    ) -> Result<usize, Outcome> {
        Ok(self.admission(batches, topic).await?.limit)
    }

    /// The learned limit matters only to messages over the default one:
    /// while it cannot be learned, batches without them go as usual (a
    /// credential or endpoint problem shows in their publish) and those wait.
    async fn admission(
        &self,
        batches: &Batches<PublishBatch>,
        topic: &Arc<str>,
    ) -> Result<Admission, Outcome> {
        Ok(match self.limits.get(batches, topic).await {
            Ok(limit) => Admission::sure(limit),
            Err((class, reason)) => {
                let reason = format!("cannot learn the size limit of topic {topic}: {reason}");
                tracing::debug!(topic = %topic, error = %reason, "publishing what fits the default limit");
                Admission {
                    limit: limits::DEFAULT_LIMIT,
                    unsure: Some((class, reason)),
                }
            }
        })
    }

    /// With a bucket, an envelope over the limit is stored first and its
    /// message points at it.
    async fn offload(&self, message: &Message) -> Option<Result<String, (Class, String)>> {
        let claim_check = self.claim_check.as_ref()?;
        Some(claim_check.store(message.event.id(), &message.body).await)
    }

    /// A refusal of what only a learned limit above the default let through:
    /// the topic's limit may have been lowered; learn it again.
    fn relearn(&self, topic: &str, size: usize, relearning: bool) -> Option<&'static str> {
        (size > limits::DEFAULT_LIMIT && (relearning || self.limits.refused(topic)))
            .then_some("the topic's MaximumMessageSize is read again")
    }

    fn source(&self, source: &Source) {
        if let Some(claim_check) = &self.claim_check {
            claim_check.source(source);
        }
    }
}

/// SNS's `PublishBatch`: each message an entry with its attributes (and, on
/// a FIFO topic, its group and deduplication ids).
pub struct PublishBatch {
    /// The headers sent as attributes (`sns.attributes`).
    attributes: Vec<String>,
}

impl PublishBatch {
    /// Entries carrying the headers named in `attributes`.
    pub fn new(attributes: Vec<String>) -> Self {
        Self { attributes }
    }

    /// The request entry of `entry` with the id `index`, and its size in
    /// bytes as SNS counts it: body (or stand-in) and attributes.
    fn entry<'a>(
        &'a self,
        index: usize,
        entry: Entry<'a>,
        fifo: bool,
    ) -> (protocol::Entry<'a>, usize) {
        let Entry { message, stand_in } = entry;
        let event = &message.event;
        let body = stand_in.map_or(&message.body[..], str::as_bytes);
        let mut size = body.len();
        let numbers = match stand_in {
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
        let fifo = fifo.then(|| (fifo_id(event.group()), fifo_id(event.id())));
        let entry = protocol::Entry {
            index,
            message: body,
            attributes,
            fifo,
            numbers,
        };
        (entry, size)
    }
}

impl Protocol for PublishBatch {
    const WHAT: &'static str = "topic";
    const TARGET: &'static str = "PublishBatch";
    const CONTENT_TYPE: &'static str = "application/x-www-form-urlencoded; charset=utf-8";
    const WIRE: Wire = Wire::Query;
    /// SNS's limit of entries in one `PublishBatch`.
    const MAX_ENTRIES: usize = 10;
    const MAX_REQUEST_BYTES: usize = limits::MAX_LIMIT;
    const UNMENTIONED: &'static str = "SNS did not answer for the entry";

    fn size(&self, message: &Message) -> Result<usize, String> {
        self.entry_size(Entry::plain(message))
    }

    fn body(&self, topic: &str, messages: &[&Message]) -> Vec<u8> {
        let entries: Vec<Entry<'_>> = messages.iter().map(|m| Entry::plain(m)).collect();
        self.entry_body(topic, &entries)
    }

    fn entry_size(&self, entry: Entry<'_>) -> Result<usize, String> {
        Ok(self.entry(0, entry, false).1)
    }

    fn entry_body(&self, topic: &str, entries: &[Entry<'_>]) -> Vec<u8> {
        let fifo = topic.ends_with(".fifo");
        let entries: Vec<protocol::Entry<'_>> = entries
            .iter()
            .enumerate()
            .map(|(i, entry)| self.entry(i, *entry, fifo).0)
            .collect();
        protocol::publish_batch_body(topic, &entries)
    }

    fn answers(&self, body: &[u8], entries: usize) -> Result<Vec<Option<Answer>>, String> {
        let results = protocol::parse_publish_batch(body).map_err(|e| e.to_string())?;
        let mut answers = vec![None; entries];
        for result in results {
            let (id, answer) = match result {
                protocol::EntryResult::Published { id } => (id, Answer::Accepted),
                protocol::EntryResult::Failed {
                    id,
                    code,
                    message,
                    sender_fault,
                } => {
                    let sender_fault = Some(sender_fault);
                    (
                        id,
                        Answer::Failed {
                            code,
                            message,
                            sender_fault,
                        },
                    )
                }
            };
            // Ids that are not ours are left out; of an entry listed twice,
            // the last word counts.
            if let Some(slot) = id.and_then(|i| answers.get_mut(i)) {
                *slot = Some(answer);
            }
        }
        Ok(answers)
    }

    /// On a FIFO topic at most one entry of a group a call: SNS may fail an
    /// entry and take a later one of its group in the same call, which the
    /// consumer would then get first (the repeat that follows the retried
    /// entry is deduplicated away).
    fn one_per_group(&self, topic: &str) -> bool {
        topic.ends_with(".fifo")
    }

    /// SNS holds the sum of a `PublishBatch`'s entries to the topic's limit.
    fn max_request_bytes(&self, limit: usize) -> usize {
        limit
    }

    fn too_large(&self, size: usize, limit: usize) -> String {
        format!(
            "message too large: {size} bytes with attributes; the topic accepts at most {limit} \
             (its MaximumMessageSize, or sns.max_message_size)"
        )
    }

    fn alarm(&self, alarm: Alarm, topic: &str, error: &str) {
        match alarm {
            Alarm::NoCredentials => {
                tracing::error!(topic, error = %error, "the AWS credential chain gave no credentials; retrying")
            }
            Alarm::Signing => {
                tracing::error!(topic, error = %error, "cannot sign SNS requests; retrying")
            }
            Alarm::Refused => {
                tracing::error!(topic, error = %error, "SNS refused the credentials or permissions; retrying")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_fifo_call_holds_at_most_one_entry_of_a_group() {
        // Every entry an answer could name is listed as published.
        let (url, seen) = aws::local::endpoint(|_| {
            let members: String = (0..10)
                .map(|i| format!("<member><Id>{i}</Id><MessageId>m</MessageId></member>"))
                .collect();
            let body = format!(
                "<PublishBatchResponse><PublishBatchResult><Successful>{members}</Successful>\
                 <Failed/></PublishBatchResult></PublishBatchResponse>"
            );
            format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/xml\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            )
        })
        .await;
        let batches = Batches::new(
            aws::local::client(aws::SNS, &url),
            PublishBatch::new(Vec::new()),
            Duration::from_secs(5),
            Duration::from_secs(600),
        );
        let runs = |topic: &'static str| {
            let (batches, seen) = (&batches, &seen);
            async move {
                let batch = [
                    Message::for_test("a", "g1", "{}", topic),
                    Message::for_test("b", "g2", "{}", topic),
                    Message::for_test("c", "g1", "{}", topic),
                    Message::for_test("d", "g3", "{}", topic),
                ];
                let outcomes = batches.publish(&batch, 262_144).await;
                assert!(
                    outcomes.iter().all(|o| *o == Outcome::Delivered),
                    "{outcomes:?}"
                );
                let bodies = std::mem::take(&mut *seen.bodies.lock().unwrap());
                bodies
                    .iter()
                    .map(|body| body.matches(".Message=").count())
                    .collect::<Vec<_>>()
            }
        };
        let fifo = "arn:aws:sns:us-east-1:123456789012:t.fifo";
        assert_eq!(runs(fifo).await, [2, 2], "g1's second entry starts a call");
        assert_eq!(runs("arn:aws:sns:us-east-1:123456789012:t").await, [4]);
    }

    #[test]
    fn a_stand_in_counts_as_sns_counts_it() {
        let sns = PublishBatch::new(Vec::new());
        let message = Message::for_test("e-1", "g", &"x".repeat(300_000), "t");
        let plain = sns.entry_size(Entry::plain(&message)).unwrap();
        let pointer = claim_check::pointer("b", "k");
        let stand_in = Entry {
            message: &message,
            stand_in: Some(&pointer),
        };
        assert_eq!(
            sns.entry_size(stand_in).unwrap(),
            plain - 300_000 + pointer.len() + "ExtendedPayloadSizeNumber300000".len()
        );
        let body = String::from_utf8(sns.entry_body("t", &[stand_in])).unwrap();
        assert!(body.contains("Value.StringValue=300000"), "{body}");
        assert!(!body.contains("xxx"), "the payload stays in S3");
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
