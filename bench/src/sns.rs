//! A fast SNS-compatible endpoint: answers `Publish` and `PublishBatch` the way
//! SNS does (Query protocol in, XML out), accepting every entry, and counts
//! the messages. moto manages a few hundred calls per second and would
//! measure itself; this one costs microseconds per call.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

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
}

/// A running endpoint.
pub struct Endpoint {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// Its counters.
    pub counts: Arc<Counts>,
}

impl Endpoint {
    /// Listen on a free port of 127.0.0.1.
    pub async fn start() -> anyhow::Result<Endpoint> {
        let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        let url = format!("http://{}", listener.local_addr()?);
        let counts = Arc::new(Counts::default());
        let served = Arc::clone(&counts);
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let counts = Arc::clone(&served);
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let counts = Arc::clone(&counts);
                        async move { Ok::<_, hyper::Error>(answer(req, &counts).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(Endpoint { url, counts })
    }

    /// Messages accepted so far.
    pub fn messages(&self) -> u64 {
        self.counts.messages.load(Ordering::Relaxed)
    }
}

async fn answer(req: Request<Incoming>, counts: &Counts) -> Response<Full<Bytes>> {
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => Bytes::new(),
    };
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
    let batch = memchr::memmem::find(&body, b"Action=PublishBatch&").is_some()
        || body.ends_with(b"Action=PublishBatch");
    let xml = if batch {
        let ids: Vec<String> = memchr::memmem::find_iter(&body, b".Id=")
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
