//! The webhook sink: envelopes POSTed to an HTTP(S) endpoint, signed as the
//! [Standard Webhooks](https://www.standardwebhooks.com/) specification says.
//!
//! ```text
//! batch ──(webhook.batch = false)──► one POST per event: the envelope
//!       ──(webhook.batch = true)───► one POST per batch: a JSON array of envelopes
//! headers: webhook-id, webhook-timestamp, webhook-signature (v1, HMAC-SHA256)
//! ```
//!
//! * `webhook-id` names the content (DESIGN.md invariant 10): one event's is
//!   its outbox row id; a batch's is derived from the ordered ids of the
//!   events it carries ([`batch_id`](crate::sink::webhook::batch_id)). The
//!   specification tells receivers to drop a `webhook-id` they have processed,
//!   and the publisher forms batches anew after a retry, so an id naming a
//!   batch's *first event* would name different content the second time and the
//!   receiver would drop events it never processed. `webhook-timestamp` is the
//!   time of the attempt, so a retried request passes the receiver's tolerance
//!   check.
//! * The answer decides, per request (a batch shares it), in one table
//!   (`verdict`): 2xx delivered; 408, 429, 5xx, a connection that fails or
//!   no answer within `webhook.timeout` retried with the publisher's backoff
//!   (they lower the concurrency); 401 and 403 from the configured `url`
//!   retried as access errors without a bound, as the AWS sinks retry theirs
//!   (a receiver rotating its secret must not reorder or lose a group); 401
//!   and 403 from a URL a row or the template chose, and 404, 409 and 425,
//!   retried for `webhook.retry_unknown_errors_for` (a receiver deploying, a
//!   conflict, too early; a path the receiver protects or that does not
//!   exist must not hold the slot forever), then recorded; 410 and every
//!   other status recorded FAILED with the status and the start of the answer. Redirects are not followed (a 3xx
//!   is recorded: the URL to configure is the one it names).
//! * Where requests go: only URLs whose origin the configuration allows
//!   (`crate::config::allow`); the router has refused any other before a
//!   request is formed.
//! * Connections: the relay's plain-HTTP egress ([`crate::sink::http`]):
//!   proxies from the standard variables, TLS with the system's roots (or
//!   `AWS_CA_BUNDLE`), `TCP_USER_TIMEOUT`; pooled by hyper-util.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::header::{HeaderValue, CONTENT_TYPE, USER_AGENT};
use hyper::{Method, StatusCode, Uri};

use crate::config::settings::SetupError;
use crate::pipeline::sink::{Cause, Concurrency, Message, Outcome, Sink};
use crate::sink::http;
use crate::sink::unknown::UnknownSince;

pub(crate) mod config;
mod sign;

pub(crate) use config::WebhookConfig;

/// Most of an answer read (for the reason of a rejection).
const MAX_ANSWER: usize = 64 << 10;

/// POSTs envelopes to webhook endpoints.
pub(crate) struct WebhookSink {
    pooled: http::Pooled,
    key: ring::hmac::Key,
    batch: bool,
    max_batch: usize,
    concurrency: Concurrency,
    timeout: Duration,
    /// Events answered 404, 409 or 425 (or 401/403 from a URL other than
    /// `url`) since when.
    not_yet: UnknownSince,
    /// `webhook.url`: access errors from it are retried without a bound.
    configured: Option<String>,
}

impl WebhookSink {
    /// A sink for `config` (validated).
    pub(crate) fn new(config: &WebhookConfig) -> Result<Self, SetupError> {
        let key =
            sign::key(config.secret.as_ref().map_or("", |s| s.expose())).map_err(|message| {
                SetupError {
                    key: "webhook.secret",
                    message,
                }
            })?;
        // One proxy decision for the sink, by the default URL (or the
        // template's fixed start): per-event URLs go the same way.
        let base = config.base();
        let https = base.starts_with("https://");
        let probe: Uri = base.parse().unwrap_or_default();
        let proxy = http::proxy_for(&probe, |name| std::env::var(name).ok())
            .map_err(|(key, message)| SetupError { key, message })?;
        let connector = http::connector(
            proxy.as_ref(),
            https,
            config.timeout.min(Duration::from_secs(3)),
            config.timeout,
        )
        .map_err(|message| SetupError {
            key: "AWS_CA_BUNDLE",
            message,
        })?;
        Ok(Self {
            pooled: http::pooled(connector, config.max_in_flight),
            key,
            batch: config.batch,
            max_batch: if config.batch { config.max_batch } else { 1 },
            concurrency: config.concurrency(),
            timeout: config.timeout,
            not_yet: UnknownSince::new(config.retry_unknown_errors_for),
            configured: (!config.url.is_empty()).then(|| config.url.clone()),
        })
    }

    /// POST `body` to `url` as message `id`; what the answer means for it.
    async fn post(&self, url: &str, id: &str, body: Bytes) -> Verdict {
        let uri: Uri = match url.parse() {
            Ok(uri) => uri,
            Err(e) => return Verdict::Now(Outcome::Rejected(format!("{url:?} is not a URL: {e}"))),
        };
        let timestamp = crate::time::unix_micros_now() / 1_000_000;
        let signature = sign::signature(&self.key, id, timestamp, &body);
        let request = hyper::Request::builder()
            .method(Method::POST)
            .uri(uri)
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
            .header(USER_AGENT, HeaderValue::from_static(http::AGENT))
            .header("webhook-id", id)
            .header("webhook-timestamp", timestamp)
            .header("webhook-signature", signature)
            .body(Full::new(body));
        let request = match request {
            Ok(request) => request,
            Err(e) => {
                return Verdict::Now(Outcome::Rejected(format!("cannot form the request: {e}")))
            }
        };
        let exchange = async {
            let answer = self.pooled.request(request).await.map_err(|error| {
                let cause = std::error::Error::source(&error).unwrap_or(&error);
                http::with_sources(cause)
            })?;
            let status = answer.status();
            let body = Limited::new(answer.into_body(), MAX_ANSWER)
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            Ok::<_, String>((status, body))
        };
        match tokio::time::timeout(self.timeout, exchange).await {
            Err(_) => Verdict::Now(Outcome::retry(
                Cause::TimedOut,
                format!("no answer from {url} within {:?}", self.timeout),
            )),
            Ok(Err(error)) => Verdict::Now(Outcome::retry(
                Cause::Unavailable,
                format!("{url}: {error}"),
            )),
            Ok(Ok((status, body))) => {
                verdict(url, status, &body, self.configured.as_deref() == Some(url))
            }
        }
    }
}

/// What an answer's `status` means for the events of its request;
/// `configured`: `url` is `webhook.url` itself, not a URL data chose.
/// [`Verdict::NotYet`] is a retry bounded by `webhook.retry_unknown_errors_for`.
fn verdict(url: &str, status: StatusCode, body: &[u8], configured: bool) -> Verdict {
    let text = String::from_utf8_lossy(&body[..body.len().min(200)]);
    let reason = format!("{url} answered {status}: {}", text.trim());
    let retry = |cause, reason| Verdict::Now(Outcome::retry(cause, reason));
    match status.as_u16() {
        200..=299 => Verdict::Now(Outcome::Delivered),
        429 => retry(Cause::Throttled, reason),
        408 => retry(Cause::TimedOut, reason),
        500..=599 => retry(Cause::Unavailable, reason),
        401 | 403 if configured => retry(
            Cause::Other,
            format!("{reason} (access refused: does the receiver verify with webhook.secret? retried until it does)"),
        ),
        401 | 403 | 404 | 409 | 425 => Verdict::NotYet(reason),
        _ => Verdict::Now(Outcome::Rejected(reason)),
    }
}

/// An answer's meaning before the sink's memory of earlier ones.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Verdict {
    /// This outcome.
    Now(Outcome),
    /// Retried while the events have been answered so for less than
    /// `webhook.retry_unknown_errors_for`, then recorded.
    NotYet(String),
}

/// A batch's `webhook-id`: `batch_` and the hex SHA-256 of its events' ids in
/// order, each prefixed by its length (so no two lists of ids give the same
/// bytes). The same events in the same order always get the same id, and any
/// other list another.
pub(crate) fn batch_id<'a>(ids: impl IntoIterator<Item = &'a str>) -> String {
    use sha2::Digest as _;
    let mut hash = sha2::Sha256::new();
    for id in ids {
        hash.update((id.len() as u64).to_be_bytes());
        hash.update(id.as_bytes());
    }
    let mut out = String::with_capacity(6 + 64);
    out.push_str("batch_");
    for byte in hash.finalize() {
        out.push_str(&format!("{byte:02x}"));
    }
    out
}

impl WebhookSink {
    /// The outcome of `verdict` for each of `events` (the ids its request
    /// carried, in order): a bounded retry gives up only on the events that
    /// have been answered so for the whole window, the others are retried.
    fn settle<'a>(
        &self,
        verdict: Verdict,
        events: impl Iterator<Item = &'a str> + Clone,
    ) -> Vec<Outcome> {
        self.settle_at(std::time::Instant::now(), verdict, events)
    }

    /// [`Self::settle`] at `now`.
    fn settle_at<'a>(
        &self,
        now: std::time::Instant,
        verdict: Verdict,
        events: impl Iterator<Item = &'a str> + Clone,
    ) -> Vec<Outcome> {
        match verdict {
            Verdict::Now(outcome) => {
                self.not_yet.settle(now, [], events.clone());
                events.map(|_| outcome.clone()).collect()
            }
            Verdict::NotYet(reason) => {
                let given_up = self.not_yet.settle(now, events.clone(), []);
                events
                    .map(|id| {
                        if given_up.contains(&id) {
                            Outcome::Rejected(format!(
                                "{reason} (answered so for {:?}: webhook.retry_unknown_errors_for)",
                                self.not_yet.limit()
                            ))
                        } else {
                            Outcome::retry(Cause::Other, reason.clone())
                        }
                    })
                    .collect()
            }
        }
    }
}

impl Sink for WebhookSink {
    fn name(&self) -> &'static str {
        "webhook"
    }

    fn max_batch(&self) -> usize {
        self.max_batch
    }

    fn concurrency(&self) -> Concurrency {
        self.concurrency
    }

    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        let Some(first) = batch.first() else {
            return Vec::new();
        };
        if !self.batch {
            // One event a batch (`max_batch` is 1): events of one group stay
            // one after the other.
            let mut outcomes = Vec::with_capacity(batch.len());
            for m in batch {
                let id = m.event.id();
                let verdict = self.post(&m.destination, id, m.body.clone()).await;
                outcomes.extend(self.settle(verdict, std::iter::once(id)));
            }
            return outcomes;
        }
        let mut body =
            Vec::with_capacity(batch.iter().map(|m| m.body.len() + 1).sum::<usize>() + 1);
        body.push(b'[');
        for (i, message) in batch.iter().enumerate() {
            if i > 0 {
                body.push(b',');
            }
            body.extend_from_slice(&message.body);
        }
        body.push(b']');
        let ids = batch.iter().map(|m| m.event.id());
        let id = batch_id(ids.clone());
        let verdict = self.post(&first.destination, &id, Bytes::from(body)).await;
        self.settle(verdict, ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_decide_delivered_retried_or_recorded() {
        let v = |code: u16| verdict("u", StatusCode::from_u16(code).unwrap(), b"why", true);
        for code in [200, 201, 202, 204, 299] {
            assert_eq!(v(code), Verdict::Now(Outcome::Delivered), "{code}");
        }
        for (code, cause) in [
            (429, Cause::Throttled),
            (408, Cause::TimedOut),
            (500, Cause::Unavailable),
            (503, Cause::Unavailable),
            (401, Cause::Other),
            (403, Cause::Other),
        ] {
            assert!(
                matches!(v(code), Verdict::Now(Outcome::Retryable(r)) if r.cause == cause),
                "{code}"
            );
        }
        for code in [404, 409, 425] {
            assert!(
                matches!(v(code), Verdict::NotYet(ref r) if r.contains("why")),
                "{code}"
            );
        }
        // A URL data chose does not hold the slot forever on 401/403.
        for code in [401, 403] {
            let chosen = verdict("u", StatusCode::from_u16(code).unwrap(), b"why", false);
            assert!(matches!(chosen, Verdict::NotYet(_)), "{code}");
        }
        for code in [301, 400, 405, 410, 413, 415, 422] {
            assert!(
                matches!(v(code), Verdict::Now(Outcome::Rejected(ref r)) if r.contains("why")),
                "{code}"
            );
        }
    }

    #[test]
    fn a_batch_past_the_window_records_only_the_events_that_waited_it_out() {
        let config = WebhookConfig {
            url: "http://127.0.0.1:9/in".into(),
            secret: Some(crate::config::value::Secret::new(
                "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
            )),
            batch: true,
            retry_unknown_errors_for: Duration::from_secs(600),
            ..WebhookConfig::default()
        };
        let sink = WebhookSink::new(&config).unwrap();
        let t0 = std::time::Instant::now();
        let not_yet = || Verdict::NotYet("404".into());
        let first = sink.settle_at(t0, not_yet(), ["a"].into_iter());
        assert!(matches!(&first[..], [Outcome::Retryable(_)]));
        let later = t0 + Duration::from_secs(600);
        let both = sink.settle_at(later, not_yet(), ["a", "b"].into_iter());
        assert!(matches!(&both[0], Outcome::Rejected(r) if r.contains("retry_unknown_errors_for")));
        assert!(
            matches!(&both[1], Outcome::Retryable(_)),
            "b joined late: {both:?}"
        );
        // Delivered: b's clock is cleared.
        let done = sink.settle_at(later, Verdict::Now(Outcome::Delivered), ["b"].into_iter());
        assert_eq!(done, [Outcome::Delivered]);
        let again = sink.settle_at(
            later + Duration::from_secs(600),
            not_yet(),
            ["b"].into_iter(),
        );
        assert!(matches!(&again[..], [Outcome::Retryable(_)]));
    }

    #[test]
    fn a_batch_id_names_its_events_in_order_and_nothing_else() {
        let id = |ids: &[&str]| batch_id(ids.iter().copied());
        assert_eq!(id(&["a", "b"]), id(&["a", "b"]));
        assert_ne!(id(&["a", "b"]), id(&["a", "b", "c"]));
        assert_ne!(id(&["a", "b"]), id(&["b", "a"]));
        assert_ne!(id(&["a", "b"]), id(&["a"]));
        // Length prefixes: no two lists join to the same bytes.
        assert_ne!(id(&["ab", "c"]), id(&["a", "bc"]));
        assert!(id(&["a"]).starts_with("batch_") && id(&["a"]).len() == 70);
    }
}
