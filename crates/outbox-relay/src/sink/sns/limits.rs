//! Each topic's message size limit: its `MaximumMessageSize` attribute
//! (1,024 to 1,048,576 bytes; 262,144 unless set), learned with
//! `GetTopicAttributes` on the first publish to the topic and kept as an
//! [`aws::known`](crate::sink::aws::known) fact (batches that start while it
//! is asked wait for that answer: one call a topic).
//!
//! SNS applies it to the message body and attributes together (names, types
//! and values, in bytes), and to the sum of them in a `PublishBatch`. The
//! relay applies it the same way before it sends, so an envelope over it is
//! recorded at once (or stored in S3, with `sns.large_payload_bucket`).
//!
//! * `sns.max_message_size` overrides it: nothing is asked.
//! * When the role may not read the topic's attributes (`AuthorizationError`,
//!   `AccessDenied`; or an SNS-compatible endpoint does not answer the call),
//!   262,144 bytes is used (logged once): the limit every topic had before
//!   the attribute.
//! * While it cannot be learned for another reason (SNS unreachable,
//!   credentials refused), for [`UNANSWERED_FOR`], batches within 262,144
//!   bytes are published as usual and a batch holding a larger message waits:
//!   the call never holds ordinary traffic.
//! * A topic that does not exist is asked about again at its next batch
//!   (whose publish says it does not exist).
//! * A learned limit is kept until SNS refuses a message over 262,144 bytes
//!   that it let through: the limit may have been lowered since, so it is
//!   learned again (at most once a minute per topic) and the message retried
//!   under it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::protocol;
use crate::sink::aws::batch::{Batches, Protocol, Question};
use crate::sink::aws::errors::Class;
use crate::sink::aws::known::{warn_unreadable_limit, Known, UNANSWERED_FOR, UNTIL_FORGOTTEN};

/// SNS's limit of a topic without `MaximumMessageSize`, and of every topic
/// before the attribute existed.
pub(crate) const DEFAULT_LIMIT: usize = 256 * 1024;
/// The most `MaximumMessageSize` can be.
pub(crate) const MAX_LIMIT: usize = 1024 * 1024;
/// A learned limit is not learned again sooner than this.
const RELEARN_AFTER: Duration = Duration::from_secs(60);

/// The limits learned so far.
pub(crate) struct TopicLimits {
    configured: Option<usize>,
    known: Known<Limit>,
    denied_logged: AtomicBool,
}

/// What is known of a topic's limit.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Limit {
    /// `bytes`, learned (or assumed where it may not be read) at `at`.
    Learned { bytes: usize, at: Instant },
    /// Not learned now: the class and reason of the failed ask.
    Unknown(Class, String),
}

impl TopicLimits {
    /// `configured`: `sns.max_message_size`, 0 to learn each topic's.
    pub(crate) fn new(configured: usize) -> Self {
        Self {
            configured: (configured > 0).then_some(configured),
            known: Known::default(),
            denied_logged: AtomicBool::new(false),
        }
    }

    /// The limit of `topic`: configured, known, or asked of SNS through
    /// `batches` now. An error (its class and reason) means it cannot be
    /// learned now.
    pub(crate) async fn get<P: Protocol>(
        &self,
        batches: &Batches<P>,
        topic: &Arc<str>,
    ) -> Result<usize, (Class, String)> {
        if let Some(limit) = self.configured {
            return Ok(limit);
        }
        let ask = |_| self.ask(batches, topic);
        match self.known.get(topic, ask).await {
            Limit::Learned { bytes, .. } => Ok(bytes),
            Limit::Unknown(class, reason) => Err((class, reason)),
        }
    }

    /// `GetTopicAttributes MaximumMessageSize`, and how long the answer holds.
    async fn ask<P: Protocol>(&self, batches: &Batches<P>, topic: &Arc<str>) -> (Limit, Duration) {
        let body = protocol::get_topic_attributes_body(topic);
        let answer = match batches.question("GetTopicAttributes", body).await {
            Ok(answer) => answer,
            Err((_, Question::Refused(reason))) => return self.denied(topic, &reason),
            // The publish says so (and the topic is recorded missing); its
            // limit is learned once it exists.
            Err((_, Question::Missing(_))) => return (learned(DEFAULT_LIMIT), Duration::ZERO),
            Err((class, Question::Unanswered(reason))) => {
                return (Limit::Unknown(class, reason), UNANSWERED_FOR)
            }
        };
        match protocol::parse_topic_attribute(&answer, "MaximumMessageSize") {
            Ok(value) => {
                let limit = value.and_then(|v| v.trim().parse::<usize>().ok());
                let limit = limit.unwrap_or(DEFAULT_LIMIT).clamp(1, MAX_LIMIT);
                tracing::debug!(topic = %topic, limit, "learned the topic's MaximumMessageSize");
                (learned(limit), UNTIL_FORGOTTEN)
            }
            // An SNS-compatible endpoint that does not know the call.
            Err(error) => self.denied(
                topic,
                &format!("unreadable GetTopicAttributes answer: {error}"),
            ),
        }
    }

    /// The topic's attributes may not be read: [`DEFAULT_LIMIT`] for it from
    /// now on, said once.
    fn denied(&self, topic: &Arc<str>, reason: &str) -> (Limit, Duration) {
        if !self.denied_logged.swap(true, Ordering::Relaxed) {
            warn_unreadable_limit!(
                topic = topic,
                reason,
                "topic",
                "sns:GetTopicAttributes",
                "sns.max_message_size",
                DEFAULT_LIMIT
            );
        }
        (learned(DEFAULT_LIMIT), UNTIL_FORGOTTEN)
    }

    /// SNS refused a message the learned limit of `topic` let through:
    /// forget the limit, unless it was learned within the last minute.
    /// Whether it was forgotten (and the message is worth retrying).
    pub(crate) fn refused(&self, topic: &str) -> bool {
        self.configured.is_none()
            && self.known.forget_if(
                topic,
                |limit| matches!(limit, Limit::Learned { at, .. } if at.elapsed() >= RELEARN_AFTER),
            )
    }
}

/// `bytes`, learned now.
fn learned(bytes: usize) -> Limit {
    Limit::Learned {
        bytes,
        at: Instant::now(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::aws::local;

    /// An SNS endpoint answering `GetTopicAttributes` with each of `answers`
    /// in turn (`Some(value)`: the topic's `MaximumMessageSize`, `None`:
    /// none); then with `AuthorizationError`. What it received, too.
    async fn sns(
        answers: Vec<Option<&'static str>>,
    ) -> (Batches<super::super::PublishBatch>, local::Seen) {
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let (url, seen) = local::endpoint(move |_| {
            let (status, body) = match answers.get(calls.fetch_add(1, Ordering::SeqCst)) {
                Some(value) => ("200 OK", format!(
                    "<GetTopicAttributesResponse><GetTopicAttributesResult><Attributes>{}</Attributes>\
                     </GetTopicAttributesResult></GetTopicAttributesResponse>",
                    value.map(|v| format!("<entry><key>MaximumMessageSize</key><value>{v}</value></entry>")).unwrap_or_default()
                )),
                None => ("403 Forbidden", "<ErrorResponse><Error><Code>AuthorizationError</Code></Error></ErrorResponse>".to_owned()),
            };
            format!("HTTP/1.1 {status}\r\ncontent-type: text/xml\r\ncontent-length: {}\r\n\r\n{body}", body.len())
        })
        .await;
        let batches = Batches::new(
            local::client(crate::sink::aws::SNS, &url),
            super::super::PublishBatch::new(Vec::new()),
            Duration::from_secs(5),
            Duration::from_secs(60),
        );
        (batches, seen)
    }

    #[tokio::test]
    async fn a_configured_limit_wins_and_learned_ones_are_kept_per_topic() {
        let topic =
            |name: &str| -> Arc<str> { Arc::from(format!("arn:aws:sns:us-east-1:1:{name}")) };
        let (t1, t2, t3, t4) = (topic("t1"), topic("t2"), topic("t3"), topic("t4"));
        let (batches, seen) = sns(vec![Some("1048576"), None, Some("10485760")]).await;
        let limits = TopicLimits::new(0);
        assert_eq!(limits.get(&batches, &t1).await, Ok(1_048_576));
        assert_eq!(limits.get(&batches, &t2).await, Ok(DEFAULT_LIMIT));
        assert_eq!(limits.get(&batches, &t1).await, Ok(1_048_576), "kept");
        assert_eq!(seen.bodies.lock().unwrap().len(), 2, "one ask a topic");
        assert!(!limits.refused(&t1), "learned just now: not again yet");
        assert_eq!(limits.get(&batches, &t3).await, Ok(MAX_LIMIT));
        assert_eq!(
            limits.get(&batches, &t4).await,
            Ok(DEFAULT_LIMIT),
            "may not be read"
        );
        let configured = TopicLimits::new(300_000);
        assert_eq!(configured.get(&batches, &t1).await, Ok(300_000));
        assert!(!configured.refused(&t1));
        assert_eq!(
            seen.bodies.lock().unwrap().len(),
            4,
            "nothing asked when configured"
        );
    }
}
