//! The webhook sink: envelopes POSTed to an HTTP(S) endpoint, signed as the
//! [Standard Webhooks](https://www.standardwebhooks.com/) specification says.
//!
//! ```text
//! batch ──(webhook.batch = false)──► one POST per event: the envelope
//!       ──(webhook.batch = true)───► one POST per batch: a JSON array of envelopes
//! headers: webhook-id, webhook-timestamp, webhook-signature (v1, HMAC-SHA256)
//! ```
//!
//! * `webhook-id` is the outbox row id (for a batch: the first event's id and
//!   the number of events, `<id>+<n>`), so a receiver drops repeats of an event
//!   as it drops SNS FIFO's; `webhook-timestamp` is the time of the attempt, so
//!   a retried request passes the receiver's tolerance check.
//! * The answer decides, per request (a batch shares it): 2xx delivered;
//!   408, 429 and 5xx, a connection that fails or no answer within
//!   `webhook.timeout` retried with the publisher's backoff (429 and 5xx
//!   lower the concurrency); any other status rejected, recorded FAILED with
//!   the status and the start of the answer. Redirects are not followed (a
//!   3xx is rejected: the URL to configure is the one it names).
//! * Connections: the AWS layer's connector ([`crate::aws::connect`]): proxies
//!   from the standard variables, TLS with the system's roots (or
//!   `AWS_CA_BUNDLE`), `TCP_USER_TIMEOUT`; pooled by hyper-util.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::header::{HeaderValue, CONTENT_TYPE, USER_AGENT};
use hyper::{Method, StatusCode, Uri};

use super::{Cause, Concurrency, Message, Outcome, Sink};
use crate::aws::connect;
use crate::aws::SetupError;

pub mod config;
mod sign;

pub use config::WebhookConfig;

/// Most of an answer read (for the reason of a rejection).
const MAX_ANSWER: usize = 64 << 10;

/// POSTs envelopes to webhook endpoints.
pub struct WebhookSink {
    pooled: connect::Pooled,
    key: ring::hmac::Key,
    batch: bool,
    max_batch: usize,
    concurrency: Concurrency,
    timeout: Duration,
}

impl WebhookSink {
    /// A sink for `config` (validated).
    pub fn new(config: &WebhookConfig) -> Result<Self, SetupError> {
        let key =
            sign::key(config.secret.as_ref().map_or("", |s| s.expose())).map_err(|message| {
                SetupError {
                    key: "webhook.secret",
                    message,
                }
            })?;
        // One proxy decision for the sink, by the default URL (or the
        // template's fixed start): per-event URLs go the same way.
        let base = if config.url.is_empty() {
            config.url_template.split('{').next().unwrap_or_default()
        } else {
            config.url.as_str()
        };
        let https = base.starts_with("https://");
        let probe: Uri = base.parse().unwrap_or_default();
        let proxy = connect::proxy_for(&probe, |name| std::env::var(name).ok())
            .map_err(|(key, message)| SetupError { key, message })?;
        let connector = connect::connector(
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
            pooled: connect::pooled(connector, config.max_in_flight),
            key,
            batch: config.batch,
            max_batch: if config.batch { config.max_batch } else { 1 },
            concurrency: config.concurrency(),
            timeout: config.timeout,
        })
    }

    /// POST `body` to `url` as message `id`; what the answer means for it.
    async fn post(&self, url: &str, id: &str, body: Bytes) -> Outcome {
        let uri: Uri = match url.parse() {
            Ok(uri) => uri,
            Err(e) => return Outcome::Rejected(format!("{url:?} is not a URL: {e}")),
        };
        let timestamp = crate::time::unix_micros_now() / 1_000_000;
        let signature = sign::signature(&self.key, id, timestamp, &body);
        let request = hyper::Request::builder()
            .method(Method::POST)
            .uri(uri)
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
            .header(USER_AGENT, HeaderValue::from_static(crate::aws::AGENT))
            .header("webhook-id", id)
            .header("webhook-timestamp", timestamp)
            .header("webhook-signature", signature)
            .body(Full::new(body));
        let request = match request {
            Ok(request) => request,
            Err(e) => return Outcome::Rejected(format!("cannot form the request: {e}")),
        };
        let exchange = async {
            let answer = self.pooled.request(request).await.map_err(|error| {
                let cause = std::error::Error::source(&error).unwrap_or(&error);
                connect::with_sources(cause)
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
            Err(_) => Outcome::retry(
                Cause::TimedOut,
                format!("no answer from {url} within {:?}", self.timeout),
            ),
            Ok(Err(error)) => Outcome::retry(Cause::Unavailable, format!("{url}: {error}")),
            Ok(Ok((status, body))) => verdict(url, status, &body),
        }
    }
}

/// What an answer's `status` means for the events of its request.
fn verdict(url: &str, status: StatusCode, body: &[u8]) -> Outcome {
    let text = String::from_utf8_lossy(&body[..body.len().min(200)]);
    let reason = format!("{url} answered {status}: {}", text.trim());
    match status.as_u16() {
        200..=299 => Outcome::Delivered,
        429 => Outcome::retry(Cause::Throttled, reason),
        408 => Outcome::retry(Cause::TimedOut, reason),
        500..=599 => Outcome::retry(Cause::Unavailable, reason),
        _ => Outcome::Rejected(reason),
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
                outcomes.push(
                    self.post(&m.destination, m.event.id(), m.body.clone())
                        .await,
                );
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
        let id = format!("{}+{}", first.event.id(), batch.len());
        let outcome = self.post(&first.destination, &id, Bytes::from(body)).await;
        vec![outcome; batch.len()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_decide_delivered_retried_or_rejected() {
        let v = |code: u16| verdict("u", StatusCode::from_u16(code).unwrap(), b"why");
        for code in [200, 201, 202, 204, 299] {
            assert_eq!(v(code), Outcome::Delivered, "{code}");
        }
        for (code, cause) in [
            (429, Cause::Throttled),
            (408, Cause::TimedOut),
            (500, Cause::Unavailable),
            (503, Cause::Unavailable),
        ] {
            assert!(
                matches!(v(code), Outcome::Retryable(r) if r.cause == cause),
                "{code}"
            );
        }
        for code in [301, 400, 401, 403, 404, 410, 413, 422] {
            assert!(
                matches!(v(code), Outcome::Rejected(ref r) if r.contains("why")),
                "{code}"
            );
        }
    }
}
