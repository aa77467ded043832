//! A fast SNS-compatible endpoint: answers `Publish` and `PublishBatch` the way
//! SNS does (Query protocol in, XML out), accepting every entry, and counts
//! the messages. moto manages a few hundred calls per second and would
//! measure itself; this one costs microseconds per call.
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
}

impl Model {
    /// Answers at once, no quota.
    pub const LOCAL: Model = Model {
        latency: Duration::ZERO,
        jitter: 0.0,
        quota: None,
    };
}

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
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => Bytes::new(),
    };
    let model = state.model;
    let answer = respond(&body, state);
    if !model.latency.is_zero() {
        let spread = 1.0 + model.jitter * (2.0 * fastrand::f64() - 1.0);
        tokio::time::sleep(model.latency.mul_f64(spread.max(0.0))).await;
    }
    answer
}

const THROTTLED: &str = "<ErrorResponse xmlns=\"http://sns.amazonaws.com/doc/2010-03-31/\">\
    <Error><Type>Sender</Type><Code>Throttling</Code><Message>Rate exceeded</Message></Error>\
    <RequestId>bench</RequestId></ErrorResponse>";

fn respond(body: &Bytes, state: &State) -> Response<Full<Bytes>> {
    let counts = &state.counts;
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

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
