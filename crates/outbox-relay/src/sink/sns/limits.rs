//! Each topic's message size limit: its `MaximumMessageSize` attribute
//! (1,024 to 1,048,576 bytes; 262,144 unless set), learned with
//! `GetTopicAttributes` on the first publish to the topic and kept (batches
//! that start while it is asked wait for that answer: one call a topic).
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
//!   credentials refused), messages within 262,144 bytes are published as
//!   usual and larger ones wait: the call never holds ordinary traffic.
//! * When SNS refuses a message over 262,144 bytes that the learned limit let
//!   through, the limit may have been lowered since: it is learned again
//!   (at most once a minute per topic) and the message retried under it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// SNS's limit of a topic without `MaximumMessageSize`, and of every topic
/// before the attribute existed.
pub const DEFAULT_LIMIT: usize = 256 * 1024;
/// The most `MaximumMessageSize` can be.
pub const MAX_LIMIT: usize = 1024 * 1024;
/// A learned limit is not learned again sooner than this.
const RELEARN_AFTER: Duration = Duration::from_secs(60);

/// The limits learned so far.
pub struct TopicLimits {
    configured: Option<usize>,
    learned: Mutex<HashMap<Arc<str>, (usize, Instant)>>,
    denied_logged: AtomicBool,
}

impl TopicLimits {
    /// `configured`: `sns.max_message_size`, 0 to learn each topic's.
    pub fn new(configured: usize) -> Self {
        Self {
            configured: (configured > 0).then_some(configured),
            learned: Mutex::new(HashMap::new()),
            denied_logged: AtomicBool::new(false),
        }
    }

    /// The limit of `topic` if it is configured or known.
    pub fn known(&self, topic: &str) -> Option<usize> {
        self.configured.or_else(|| {
            self.learned
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(topic)
                .map(|(limit, _)| *limit)
        })
    }

    /// Keep `limit` for `topic` (from its `MaximumMessageSize`, `None` when
    /// the topic has none).
    pub fn learn(&self, topic: &Arc<str>, limit: Option<usize>) -> usize {
        let limit = limit.unwrap_or(DEFAULT_LIMIT).clamp(1, MAX_LIMIT);
        let mut learned = self.learned.lock().unwrap_or_else(PoisonError::into_inner);
        // Rows may name very many topics: bounded as `aws::known` bounds its
        // facts (each forgotten limit is asked again when next needed).
        if learned.len() >= crate::sink::aws::known::MAX_KNOWN && !learned.contains_key(topic) {
            learned.clear();
        }
        learned.insert(Arc::clone(topic), (limit, Instant::now()));
        limit
    }

    /// The topic's attributes may not be read: use [`DEFAULT_LIMIT`] for it
    /// from now on, and say so once.
    pub fn denied(&self, topic: &Arc<str>, reason: &str) -> usize {
        if !self.denied_logged.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                topic = %topic,
                error = %reason,
                "cannot read the topic's MaximumMessageSize (allow sns:GetTopicAttributes, or set sns.max_message_size); \
                 assuming {DEFAULT_LIMIT} bytes"
            );
        }
        self.learn(topic, None)
    }

    /// SNS refused a message the learned limit of `topic` let through:
    /// forget the limit, unless it was learned within the last minute.
    /// Whether it was forgotten (and the message is worth retrying).
    pub fn refused(&self, topic: &str) -> bool {
        if self.configured.is_some() {
            return false;
        }
        let mut learned = self.learned.lock().unwrap_or_else(PoisonError::into_inner);
        match learned.get(topic) {
            Some((_, at)) if at.elapsed() >= RELEARN_AFTER => {
                learned.remove(topic);
                true
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_configured_limit_wins_and_learned_ones_are_kept_per_topic() {
        let t1: Arc<str> = Arc::from("arn:aws:sns:us-east-1:1:t1");
        let t2: Arc<str> = Arc::from("arn:aws:sns:us-east-1:1:t2");
        let limits = TopicLimits::new(0);
        assert_eq!(limits.known(&t1), None);
        assert_eq!(limits.learn(&t1, Some(1_048_576)), 1_048_576);
        assert_eq!(limits.learn(&t2, None), DEFAULT_LIMIT);
        assert_eq!(limits.known(&t1), Some(1_048_576));
        assert_eq!(limits.known(&t2), Some(DEFAULT_LIMIT));
        assert!(!limits.refused(&t1), "learned just now: not again yet");
        assert_eq!(limits.learn(&t1, Some(10 << 20)), MAX_LIMIT);
        let configured = TopicLimits::new(300_000);
        assert_eq!(configured.known(&t1), Some(300_000));
        assert!(!configured.refused(&t1));
        assert_eq!(limits.denied(&t1, "AuthorizationError"), DEFAULT_LIMIT);
    }
}
