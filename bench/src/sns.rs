//! A fast SNS-compatible endpoint: answers `Publish` and `PublishBatch` the way
//! SNS does (and webhook POSTs with 204: [`respond_webhook`]);
//! the rest of this text is about SNS. It answers them the way
//! SNS does (Query protocol in, XML out), accepting every entry, and counts
//! the messages. moto manages a few hundred calls per second and would
//! measure itself; this one costs microseconds per call.
//!
//! It answers `GetTopicAttributes` too, as SNS does, with the topic's
//! `MaximumMessageSize` ([`Model::max_message_size`]): the relay asks once per
//! topic and sizes its batches, and refuses larger messages, by it. The
//! endpoint itself does not check the sizes of what it is sent.
//!
//! It models the network and SNS's quota ([`Model`]): every answer leaves
//! after the latency (± its jitter), and above the quota a call is refused
//! whole as SNS refuses it: HTTP 400 with the Query protocol's
//! `<Code>Throttling</Code>` "Rate exceeded". The quota is a token bucket of
//! messages refilled at the quota's rate, holding a tenth of a second's worth.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use tokio::net::TcpListener;

/// What the endpoint has seen.
#[derive(Debug, Default)]
pub struct Counts {
    /// Messages accepted.
    pub messages: AtomicU64,
    /// Calls answered.
    pub calls: AtomicU64,
    /// Calls refused with `Throttling`.
    pub throttled: AtomicU64,
    /// `GetTopicAttributes` calls answered (not among `calls`).
    pub attribute_calls: AtomicU64,
    /// Bytes of request bodies received, in every call.
    pub bytes: AtomicU64,
    /// The largest request body received, in bytes.
    pub largest: AtomicU64,
}

impl Counts {
    /// (messages, calls, throttled calls) so far.
    pub fn snapshot(&self) -> (u64, u64, u64) {
        (
            self.messages.load(Ordering::Relaxed),
            self.calls.load(Ordering::Relaxed),
            self.throttled.load(Ordering::Relaxed),
        )
    }
}

/// What the endpoint stands in for: a distance and a quota.
#[derive(Debug, Clone, Copy)]
pub struct Model {
    /// Time from receiving a call to answering it.
    pub latency: Duration,
    /// Each answer's latency is drawn uniformly within ± this fraction of it.
    pub jitter: f64,
    /// Messages per second accepted; calls above it are throttled.
    pub quota: Option<f64>,
    /// The topics' `MaximumMessageSize` attribute, in bytes (SNS: 1,024 to
    /// 1,048,576; 262,144 unless set).
    pub max_message_size: usize,
}

impl Model {
    /// Answers at once, no quota.
    pub const LOCAL: Model = Model {
        latency: Duration::ZERO,
        jitter: 0.0,
        quota: None,
        max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
    };
}

/// SNS's `MaximumMessageSize` of a topic that does not set it.
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = 256 * 1024;

/// Messages that may be accepted now.
struct Bucket {
    rate: f64,
    capacity: f64,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn new(rate: f64) -> Self {
        let capacity = (rate / 10.0).max(10.0);
        Self {
            rate,
            capacity,
            tokens: capacity,
            at: Instant::now(),
        }
    }

    /// Whether `n` messages may go now (taken if so).
    fn take(&mut self, n: f64) -> bool {
        let now = Instant::now();
        let refill = now.duration_since(self.at).as_secs_f64() * self.rate;
        self.tokens = (self.tokens + refill).min(self.capacity);
        self.at = now;
        if self.tokens >= n {
            self.tokens -= n;
            true
        } else {
            false
        }
    }
}

struct State {
    counts: Arc<Counts>,
    model: Model,
    bucket: Option<Mutex<Bucket>>,
}

/// A running endpoint.
pub struct Endpoint {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// Its counters.
    pub counts: Arc<Counts>,
}

impl Endpoint {
    /// Listen on a free port of 127.0.0.1, answering as `model` says.
    pub async fn start(model: Model) -> anyhow::Result<Endpoint> {
        let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        let url = format!("http://{}", listener.local_addr()?);
        let counts = Arc::new(Counts::default());
        let served = Arc::new(State {
            counts: Arc::clone(&counts),
            model,
            bucket: model.quota.map(|q| Mutex::new(Bucket::new(q))),
        });
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let state = Arc::clone(&served);
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let state = Arc::clone(&state);
                        async move { Ok::<_, hyper::Error>(answer(req, &state).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(Endpoint { url, counts })
    }
}

async fn answer(req: Request<Incoming>, state: &State) -> Response<Full<Bytes>> {
    let webhook = req.headers().contains_key("webhook-id");
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => Bytes::new(),
    };
    let model = state.model;
    let answer = if webhook {
        respond_webhook(&body, state)
    } else {
        respond(&body, state)
    };
    if !model.latency.is_zero() {
        let spread = 1.0 + model.jitter * (2.0 * fastrand::f64() - 1.0);
        tokio::time::sleep(model.latency.mul_f64(spread.max(0.0))).await;
    }
    answer
}

/// A webhook POST: one envelope, or a JSON array of them; 204, or 429 above
/// the quota. The signature is not checked (the tests verify it).
fn respond_webhook(body: &Bytes, state: &State) -> Response<Full<Bytes>> {
    let counts = &state.counts;
    counts.bytes.fetch_add(body.len() as u64, Ordering::Relaxed);
    counts.calls.fetch_add(1, Ordering::Relaxed);
    // Envelopes are CloudEvents objects: each has one `"specversion":`.
    let events = memchr::memmem::find_iter(body, b"\"specversion\":")
        .count()
        .max(1) as u64;
    if let Some(bucket) = &state.bucket {
        let allowed = bucket
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take(events as f64);
        if !allowed {
            counts.throttled.fetch_add(1, Ordering::Relaxed);
            return Response::builder()
                .status(429)
                .body(Full::new(Bytes::new()))
                .expect("a response");
        }
    }
    counts.messages.fetch_add(events, Ordering::Relaxed);
    Response::builder()
        .status(204)
        .body(Full::new(Bytes::new()))
        .expect("a response")
}

const THROTTLED: &str = "<ErrorResponse xmlns=\"http://sns.amazonaws.com/doc/2010-03-31/\">\
    <Error><Type>Sender</Type><Code>Throttling</Code><Message>Rate exceeded</Message></Error>\
    <RequestId>bench</RequestId></ErrorResponse>";

fn respond(body: &Bytes, state: &State) -> Response<Full<Bytes>> {
    let counts = &state.counts;
    counts.bytes.fetch_add(body.len() as u64, Ordering::Relaxed);
    counts
        .largest
        .fetch_max(body.len() as u64, Ordering::Relaxed);
    if body.starts_with(b"Action=GetTopicAttributes&")
        || memchr::memmem::find(body, b"&Action=GetTopicAttributes&").is_some()
        || body.ends_with(b"&Action=GetTopicAttributes")
    {
        counts.attribute_calls.fetch_add(1, Ordering::Relaxed);
        return topic_attributes(body, state.model.max_message_size);
    }
    counts.calls.fetch_add(1, Ordering::Relaxed);
    // It stands in for SNS, which runs elsewhere; here its CPU competes with
    // the relay and the walsender, so it reads only what it answers with:
    // the action and the entry ids, found by substring search rather than by
    // splitting the whole form (the messages are most of it).
    let value = |at: usize| {
        let rest = &body[at..];
        let end = memchr::memchr(b'&', rest).unwrap_or(rest.len());
        String::from_utf8_lossy(&rest[..end]).into_owned()
    };
    let batch = memchr::memmem::find(body, b"Action=PublishBatch&").is_some()
        || body.ends_with(b"Action=PublishBatch");
    let xml = if batch {
        let ids: Vec<String> = memchr::memmem::find_iter(body, b".Id=")
            .filter(|&at| {
                // `PublishBatchRequestEntries.member.N.Id=`: a key, not text
                // inside a value (values have `=` and `&` encoded).
                body[..at]
                    .iter()
                    .rposition(|&b| b == b'&')
                    .is_some_and(|key| {
                        body[key + 1..at].starts_with(b"PublishBatchRequestEntries.member.")
                    })
            })
            .map(|at| outbox_relay::tls::percent_decode(&value(at + 4)))
            .collect();
        if let Some(bucket) = &state.bucket {
            let allowed = bucket
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(ids.len() as f64);
            if !allowed {
                counts.throttled.fetch_add(1, Ordering::Relaxed);
                return Response::builder()
                    .status(400)
                    .header("content-type", "text/xml")
                    .body(Full::new(Bytes::from_static(THROTTLED.as_bytes())))
                    .expect("a response");
            }
        }
        counts
            .messages
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        let mut xml = String::with_capacity(120 + ids.len() * 120);
        xml.push_str(
            "<PublishBatchResponse xmlns=\"http://sns.amazonaws.com/doc/2010-03-31/\">\
             <PublishBatchResult><Successful>",
        );
        for id in &ids {
            xml.push_str("<member><Id>");
            xml.push_str(&escape(id));
            xml.push_str("</Id><MessageId>");
            xml.push_str(&format!("{:032x}", fastrand::u128(..)));
            xml.push_str("</MessageId></member>");
        }
        xml.push_str(
            "</Successful><Failed/></PublishBatchResult>\
             <ResponseMetadata><RequestId>bench</RequestId></ResponseMetadata></PublishBatchResponse>",
        );
        xml
    } else {
        counts.messages.fetch_add(1, Ordering::Relaxed);
        format!(
            "<PublishResponse xmlns=\"http://sns.amazonaws.com/doc/2010-03-31/\"><PublishResult>\
             <MessageId>{:032x}</MessageId></PublishResult>\
             <ResponseMetadata><RequestId>bench</RequestId></ResponseMetadata></PublishResponse>",
            fastrand::u128(..)
        )
    };
    Response::builder()
        .header("content-type", "text/xml")
        .body(Full::new(Bytes::from(xml)))
        .expect("a response")
}

/// The answer to `GetTopicAttributes`, as SNS gives it for a topic with one
/// confirmed subscription: `MaximumMessageSize` among the usual attributes
/// (and `FifoTopic` for a `.fifo` topic).
fn topic_attributes(body: &[u8], max_message_size: usize) -> Response<Full<Bytes>> {
    let form = String::from_utf8_lossy(body);
    let arn = form
        .split('&')
        .find_map(|pair| pair.strip_prefix("TopicArn="))
        .map(outbox_relay::tls::percent_decode)
        .unwrap_or_default();
    let owner = arn.split(':').nth(4).unwrap_or("123456789012").to_owned();
    let mut attributes = vec![
        ("Owner", owner),
        ("TopicArn", arn.clone()),
        ("DisplayName", String::new()),
        ("SubscriptionsPending", "0".into()),
        ("SubscriptionsConfirmed", "1".into()),
        ("SubscriptionsDeleted", "0".into()),
        ("MaximumMessageSize", max_message_size.to_string()),
    ];
    if arn.ends_with(".fifo") {
        attributes.push(("FifoTopic", "true".into()));
        attributes.push(("ContentBasedDeduplication", "false".into()));
    }
    let mut xml = String::from(
        "<GetTopicAttributesResponse xmlns=\"http://sns.amazonaws.com/doc/2010-03-31/\">\
         <GetTopicAttributesResult><Attributes>",
    );
    for (key, value) in attributes {
        xml.push_str("<entry><key>");
        xml.push_str(key);
        xml.push_str("</key><value>");
        xml.push_str(&escape(&value));
        xml.push_str("</value></entry>");
    }
    xml.push_str(
        "</Attributes></GetTopicAttributesResult>\
         <ResponseMetadata><RequestId>bench</RequestId></ResponseMetadata></GetTopicAttributesResponse>",
    );
    Response::builder()
        .header("content-type", "text/xml")
        .body(Full::new(Bytes::from(xml)))
        .expect("a response")
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_attributes_carry_the_maximum_message_size_and_the_topic() {
        let body = b"Action=GetTopicAttributes&Version=2010-03-31&TopicArn=arn%3Aaws%3Asns%3Aus-east-1%3A1%3At.fifo";
        let answer = topic_attributes(body, 1_048_576);
        let xml = body_text(answer);
        assert!(xml.starts_with("<GetTopicAttributesResponse"));
        assert!(xml.contains("<entry><key>MaximumMessageSize</key><value>1048576</value></entry>"));
        assert!(xml.contains(
            "<entry><key>TopicArn</key><value>arn:aws:sns:us-east-1:1:t.fifo</value></entry>"
        ));
        assert!(xml.contains("<entry><key>Owner</key><value>1</value></entry>"));
        assert!(xml.contains("<key>FifoTopic</key><value>true</value>"));
    }

    fn body_text(response: Response<Full<Bytes>>) -> String {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime");
        let bytes = rt
            .block_on(response.into_body().collect())
            .expect("a body")
            .to_bytes();
        String::from_utf8(bytes.to_vec()).expect("UTF-8")
    }
}
