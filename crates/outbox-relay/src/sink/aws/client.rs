//! Signed requests to one AWS service endpoint, on hyper-util's pooled
//! HTTP/1.1 client.
//!
//! Built from AWS's own parts where they matter: the region, the endpoint
//! and the credentials come from `aws-config`'s standard chain ([`super::load`],
//! [`super::endpoint`]), and requests are signed by `aws-sigv4`, the SigV4
//! implementation the AWS SDK uses, for the [`Service`]'s signing name (S3's
//! flavour for `s3`). What the SDK adds around a call (an orchestrator with
//! interceptors, a request tree serialised field by field) cost more CPU per
//! message than everything else the relay does; see docs/benchmarks.md.
//!
//! # Invariants
//!
//! * Credentials are cached as [`Credentials`] says; a failure to get any is
//!   a [`CallError::Credentials`], which the sinks retry and log as errors.
//! * Requests are signed with the endpoint's time once an answer's `Date`
//!   shows this host's clock is off by a minute or more ([`Clock`]).
//! * A request goes on an idle pooled connection last used less than
//!   [`http::IDLE`] ago, or a new one. When an idle connection turns out to be
//!   closed *before the request was written to it*, hyper-util's client sends
//!   it on another (`retry_canceled_requests`): nothing was sent, so nothing
//!   can be published twice. Any failure after the request was written is
//!   reported, never retried here.
//! * Every call ends within `attempt_timeout` (connecting within the smaller
//!   of it and 3 s); a call that does not is a [`CallError::Timeout`], and
//!   its connection is closed, never reused.

use std::time::{Duration, SystemTime};

use aws_config::SdkConfig;
use aws_credential_types::provider::{ProvideCredentials, SharedCredentialsProvider};
use aws_sigv4::http_request::{
    sign, PayloadChecksumKind, PercentEncodingMode, SignableBody, SignableRequest, SigningSettings,
    UriPathNormalizationMode,
};
use aws_sigv4::sign::v4;
use aws_smithy_runtime_api::client::identity::Identity;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::header::{HeaderName, HeaderValue, CONTENT_TYPE, HOST, PROXY_AUTHORIZATION, USER_AGENT};
use hyper::{Method, StatusCode};

use super::connect;
use super::endpoint::Endpoint;
use super::{Service, SetupError};
use crate::sink::http::{self, AGENT};
/// Credentials are refreshed this long before they expire.
const REFRESH_BEFORE_EXPIRY: Duration = Duration::from_secs(300);
/// The largest answer read (a 10-entry answer is about 2 KiB).
const MAX_ANSWER: usize = 1 << 20;
const FORM: &str = "application/x-www-form-urlencoded; charset=utf-8";

/// Why a call got no answer.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// No credentials could be had from the chain.
    #[error("no AWS credentials: {0}")]
    Credentials(String),
    /// The request could not be signed.
    #[error("cannot sign the request: {0}")]
    Signing(String),
    /// No connection to the endpoint.
    #[error("cannot connect to {endpoint}: {error}")]
    Connect {
        /// The endpoint.
        endpoint: String,
        /// What went wrong.
        error: String,
    },
    /// The connection failed during the call.
    #[error("the call to {endpoint} failed: {error}")]
    Io {
        /// The endpoint.
        endpoint: String,
        /// What went wrong.
        error: String,
    },
    /// No answer in time.
    #[error("no answer from {endpoint} within {timeout:?}")]
    Timeout {
        /// The endpoint.
        endpoint: String,
        /// The limit.
        timeout: Duration,
    },
}

/// One request: a method, a key under the endpoint's path, a body and the
/// headers a protocol adds (all signed).
#[derive(Debug)]
pub struct Request<'a> {
    /// `POST`, `PUT`, …
    pub method: Method,
    /// Under the endpoint's path; empty for the path itself.
    pub key: &'a str,
    /// `Content-Type`.
    pub content_type: &'static str,
    /// Further headers, e.g. `X-Amz-Target` for the JSON protocols.
    pub headers: &'a [(HeaderName, HeaderValue)],
    /// The body.
    pub body: Vec<u8>,
}

impl Request<'static> {
    /// A Query-protocol call (SNS, SQS's query flavour): a form `POST`.
    pub fn form(body: Vec<u8>) -> Self {
        Self {
            method: Method::POST,
            key: "",
            content_type: FORM,
            headers: &[],
            body,
        }
    }
}

impl<'a> Request<'a> {
    /// S3 `PutObject`: `body` as the object `key` (URI-safe characters) of
    /// the endpoint's bucket.
    pub fn put(key: &'a str, content_type: &'static str, body: Vec<u8>) -> Self {
        Self {
            method: Method::PUT,
            key,
            content_type,
            headers: &[],
            body,
        }
    }
}

/// A signed-request client for one endpoint of one AWS service.
pub struct Client {
    service: Service,
    endpoint: Endpoint,
    region: String,
    credentials: Credentials,
    clock: Clock,
    transport: connect::Transport,
    attempt_timeout: Duration,
}

impl Client {
    /// A client for `service` in `region` at `url` (which the setting `key`
    /// gave; named in errors), keeping up to `max_idle` idle connections.
    pub fn new(
        sdk: &SdkConfig,
        service: Service,
        region: &str,
        (key, url): (&'static str, &str),
        max_idle: usize,
        attempt_timeout: Duration,
    ) -> Result<Self, SetupError> {
        Self::with_env(
            sdk,
            service,
            region,
            (key, url),
            max_idle,
            attempt_timeout,
            |name| std::env::var(name).ok(),
        )
    }

    /// [`Client::new`] with the proxy variables of `env`.
    fn with_env(
        sdk: &SdkConfig,
        service: Service,
        region: &str,
        (key, url): (&'static str, &str),
        max_idle: usize,
        attempt_timeout: Duration,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, SetupError> {
        let provider = sdk.credentials_provider().ok_or_else(|| SetupError {
            key,
            message: "no AWS credential provider could be set up".into(),
        })?;
        let endpoint = Endpoint::parse(url).map_err(|message| SetupError {
            key,
            message: format!("{url:?} is not a usable endpoint: {message}"),
        })?;
        let transport = connect::transport(service, &endpoint, max_idle, attempt_timeout, env)?;
        Ok(Self {
            service,
            endpoint,
            region: region.to_owned(),
            credentials: Credentials::new(provider),
            clock: Clock::default(),
            transport,
            attempt_timeout,
        })
    }

    /// The endpoint requests go to.
    pub fn endpoint(&self) -> &str {
        &self.endpoint.text
    }

    /// Credentials to sign with (see [`Credentials`]).
    pub async fn identity(&self) -> Result<Identity, CallError> {
        self.credentials.get().await
    }

    /// Drop the cached credentials: the service said they are expired or
    /// unknown.
    pub async fn forget_credentials(&self) {
        self.credentials.forget().await;
    }

    /// Send `request`, signed with `identity`; the status and body of the
    /// answer.
    pub async fn send(
        &self,
        identity: &Identity,
        request: Request<'_>,
    ) -> Result<(StatusCode, Bytes), CallError> {
        let uri = self
            .endpoint
            .join(request.key)
            .map_err(CallError::Signing)?;
        let signed_uri = uri.to_string();
        let mut http = hyper::Request::builder()
            .method(request.method.clone())
            .uri(uri)
            .header(HOST, self.endpoint.host.clone())
            .header(CONTENT_TYPE, HeaderValue::from_static(request.content_type))
            .body(())
            .expect("a request of valid parts");
        for (name, value) in request.headers {
            http.headers_mut().insert(name.clone(), value.clone());
        }
        let mut settings = SigningSettings::default();
        if self.service.signing_name == "s3" {
            // S3's flavour of SigV4: the path as it is, and the payload's
            // hash in `x-amz-content-sha256`.
            settings.percent_encoding_mode = PercentEncodingMode::Single;
            settings.uri_path_normalization_mode = UriPathNormalizationMode::Disabled;
            settings.payload_checksum_kind = PayloadChecksumKind::XAmzSha256;
        }
        let params = v4::SigningParams::builder()
            .identity(identity)
            .region(&self.region)
            .name(self.service.signing_name)
            .time(self.clock.now())
            .settings(settings)
            .build()
            .map_err(|e| CallError::Signing(e.to_string()))?
            .into();
        let headers = http
            .headers()
            .iter()
            .filter_map(|(name, value)| Some((name.as_str(), value.to_str().ok()?)));
        let signable = SignableRequest::new(
            request.method.as_str(),
            &signed_uri,
            headers,
            SignableBody::Bytes(&request.body),
        )
        .map_err(|e| CallError::Signing(e.to_string()))?;
        let (instructions, _) = sign(signable, &params)
            .map_err(|e| CallError::Signing(e.to_string()))?
            .into_parts();
        instructions.apply_to_request_http1x(&mut http);
        http.headers_mut()
            .insert(USER_AGENT, HeaderValue::from_static(AGENT));
        if let Some(authorization) = &self.transport.forwarded_authorization {
            http.headers_mut()
                .insert(PROXY_AUTHORIZATION, authorization.clone());
        }
        let http = http.map(|()| Full::new(Bytes::from(request.body)));
        match tokio::time::timeout(self.attempt_timeout, self.exchange(http)).await {
            Ok(answer) => answer,
            Err(_) => Err(CallError::Timeout {
                endpoint: self.endpoint.text.clone(),
                timeout: self.attempt_timeout,
            }),
        }
    }

    async fn exchange(
        &self,
        request: hyper::Request<Full<Bytes>>,
    ) -> Result<(StatusCode, Bytes), CallError> {
        let answer = self
            .transport
            .pooled
            .request(request)
            .await
            .map_err(|error| {
                let text = connect::failure(&error);
                if error.is_connect() {
                    CallError::Connect {
                        endpoint: self.endpoint.text.clone(),
                        error: text,
                    }
                } else {
                    CallError::Io {
                        endpoint: self.endpoint.text.clone(),
                        error: text,
                    }
                }
            })?;
        let status = answer.status();
        if let Some(date) = answer.headers().get(hyper::header::DATE) {
            self.clock.learn(date);
        }
        let body = Limited::new(answer.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map_err(|error| CallError::Io {
                endpoint: self.endpoint.text.clone(),
                error: format!("reading the answer: {error}"),
            })?
            .to_bytes();
        Ok((status, body))
    }
}

/// The credential chain with a cache in front.
///
/// * One fetch at a time; the others wait for it.
/// * Credentials are kept until `min(5 minutes, half their lifetime)` before
///   they expire; credentials without an expiry for 15 minutes (as the AWS
///   SDK's cache does), so a rotated profile or `credential_process` is read
///   again.
/// * A failed fetch while the cached credentials are still valid keeps
///   using them (logged as a warning): a short STS or metadata outage does
///   not stop publishing.
/// * [`Credentials::forget`] drops them when SNS says they are expired or unknown.
///
/// The fetch is bounded by the providers' own timeouts (`aws-config` with the
/// `sns` timeouts), not by the publish call's: a slow fetch is never
/// cancelled halfway and started again.
struct Credentials {
    provider: SharedCredentialsProvider,
    cached: tokio::sync::Mutex<Option<Cached>>,
}

#[derive(Clone)]
struct Cached {
    identity: Identity,
    /// When to fetch again.
    refresh_at: SystemTime,
    /// When they stop working (`None`: not known).
    expiry: Option<SystemTime>,
}

/// How long credentials without an expiry are kept.
const NO_EXPIRY_KEPT: Duration = Duration::from_secs(15 * 60);

impl Credentials {
    fn new(provider: SharedCredentialsProvider) -> Self {
        Self {
            provider,
            cached: tokio::sync::Mutex::new(None),
        }
    }

    async fn get(&self) -> Result<Identity, CallError> {
        let mut cached = self.cached.lock().await;
        let now = SystemTime::now();
        if let Some(c) = cached.as_ref().filter(|c| now < c.refresh_at) {
            return Ok(c.identity.clone());
        }
        match self.provider.provide_credentials().await {
            Ok(credentials) => {
                let fetched = SystemTime::now();
                let expiry = credentials.expiry();
                let refresh_at = match expiry {
                    Some(expiry) => {
                        let lifetime = expiry.duration_since(fetched).unwrap_or_default();
                        expiry - REFRESH_BEFORE_EXPIRY.min(lifetime / 2)
                    }
                    None => fetched + NO_EXPIRY_KEPT,
                };
                let identity = Identity::from(credentials);
                *cached = Some(Cached {
                    identity: identity.clone(),
                    refresh_at,
                    expiry,
                });
                Ok(identity)
            }
            Err(error) => {
                let error = http::with_sources(&error);
                match cached.as_ref() {
                    Some(c) if c.expiry.is_none_or(|expiry| now < expiry) => {
                        tracing::warn!(%error, "cannot refresh the AWS credentials; using the current ones while they last");
                        Ok(c.identity.clone())
                    }
                    _ => Err(CallError::Credentials(error)),
                }
            }
        }
    }

    async fn forget(&self) {
        *self.cached.lock().await = None;
    }
}

/// The offset between this host's clock and the endpoint's, learned from
/// the `Date` header of its answers, as the AWS SDK does: with a clock more
/// than about 15 minutes off, SigV4 signatures are refused (`RequestExpired`,
/// `SignatureDoesNotMatch`) until it is corrected. Offsets under a minute
/// are ignored (the header has one-second resolution).
#[derive(Default)]
struct Clock {
    /// Milliseconds to add to the local time.
    offset_ms: std::sync::atomic::AtomicI64,
}

impl Clock {
    const IGNORED_MS: i64 = 60_000;

    fn now(&self) -> SystemTime {
        let offset = self.offset_ms.load(std::sync::atomic::Ordering::Relaxed);
        let magnitude = Duration::from_millis(offset.unsigned_abs());
        if offset >= 0 {
            SystemTime::now() + magnitude
        } else {
            SystemTime::now() - magnitude
        }
    }

    fn learn(&self, date: &HeaderValue) {
        let Some(server) = date
            .to_str()
            .ok()
            .and_then(|d| httpdate::parse_http_date(d).ok())
        else {
            return;
        };
        let local = SystemTime::now();
        let offset_ms = match server.duration_since(local) {
            Ok(ahead) => i64::try_from(ahead.as_millis()).unwrap_or(i64::MAX),
            Err(behind) => -i64::try_from(behind.duration().as_millis()).unwrap_or(i64::MAX),
        };
        let offset_ms = if offset_ms.abs() < Self::IGNORED_MS {
            0
        } else {
            offset_ms
        };
        let before = self
            .offset_ms
            .swap(offset_ms, std::sync::atomic::Ordering::Relaxed);
        if before != offset_ms && offset_ms != 0 {
            tracing::warn!(
                offset_s = offset_ms / 1000,
                "this host's clock is off from the AWS endpoint's; signing with the endpoint's time"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that answers every request with a `PublishBatch` answer and
    /// a `Date` `ahead` of this host's clock, then closes the connection.
    /// Returns its URL and the heads of the requests it got.
    async fn closing_server(
        ahead: Duration,
    ) -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
        let (url, seen) = crate::sink::aws::local::endpoint(move |_| {
            let xml = "<PublishBatchResponse><PublishBatchResult><Successful>\
                       <member><Id>0</Id></member></Successful><Failed/>\
                       </PublishBatchResult></PublishBatchResponse>";
            let date = httpdate::fmt_http_date(SystemTime::now() + ahead);
            format!(
                "HTTP/1.1 200 OK\r\ndate: {date}\r\ncontent-length: {}\r\n\r\n{xml}",
                xml.len()
            )
        })
        .await;
        (url, seen.heads)
    }

    fn client_for(url: &str) -> Client {
        crate::sink::aws::local::client(super::super::SNS, url)
    }

    fn amz_date(head: &str) -> SystemTime {
        let value = head
            .lines()
            .find_map(|l| l.strip_prefix("x-amz-date: "))
            .expect("signed with a date");
        // 20261122T144000Z
        let n = |a: usize, b: usize| value[a..b].parse::<i64>().unwrap();
        // Days since 1970-01-01 of a civil date (Howard Hinnant's algorithm).
        let (y, m, d) = (n(0, 4), n(4, 6), n(6, 8));
        let y = if m <= 2 { y - 1 } else { y };
        let era = y.div_euclid(400);
        let yoe = y - era * 400;
        let doy = (153 * ((m + 9) % 12) + 2) / 5 + d - 1;
        let days = era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468;
        let secs = days * 86_400 + n(9, 11) * 3600 + n(11, 13) * 60 + n(13, 15);
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs.try_into().unwrap())
    }

    #[tokio::test]
    async fn connections_the_server_closed_are_replaced_and_nothing_is_sent_twice() {
        let (url, heads) = closing_server(Duration::ZERO).await;
        let client = client_for(&url);
        let identity = client.identity().await.unwrap();
        for _ in 0..3 {
            let (status, _) = client
                .send(&identity, Request::form(b"Action=PublishBatch".to_vec()))
                .await
                .unwrap();
            assert_eq!(status, StatusCode::OK);
            // Give the closed connection time to be idle in the pool.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(
            heads.lock().unwrap().len(),
            3,
            "each call reached the server once"
        );
    }

    #[tokio::test]
    async fn requests_are_signed_with_the_endpoint_time_once_an_answer_shows_the_clock_is_off() {
        let ahead = Duration::from_secs(3600);
        let (url, heads) = closing_server(ahead).await;
        let client = client_for(&url);
        let identity = client.identity().await.unwrap();
        for _ in 0..2 {
            client
                .send(&identity, Request::form(b"Action=PublishBatch".to_vec()))
                .await
                .unwrap();
        }
        let heads = heads.lock().unwrap().clone();
        let now = SystemTime::now();
        let off = |t: SystemTime, from: SystemTime| {
            t.duration_since(from)
                .unwrap_or_else(|e| e.duration())
                .as_secs()
        };
        assert!(
            off(amz_date(&heads[0]), now) < 120,
            "the first with this host's clock: {}",
            heads[0]
        );
        assert!(
            off(amz_date(&heads[1]), now + ahead) < 120,
            "the second with the endpoint's: {}",
            heads[1]
        );
    }

    #[tokio::test]
    async fn a_connection_tries_every_address_of_the_host() {
        // `localhost` may resolve to ::1 first; only 127.0.0.1 listens.
        let (url, heads) = closing_server(Duration::ZERO).await;
        let port = url.rsplit(':').next().unwrap();
        let client = client_for(&format!("http://localhost:{port}"));
        let identity = client.identity().await.unwrap();
        let (status, _) = client
            .send(&identity, Request::form(b"Action=PublishBatch".to_vec()))
            .await
            .unwrap();
        assert_eq!(status, StatusCode::OK);
        assert_eq!(heads.lock().unwrap().len(), 1);
        // Nobody listens: a connection error naming the endpoint.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let closed = format!("http://127.0.0.1:{}", listener.local_addr().unwrap().port());
        drop(listener);
        let error = client_for(&closed)
            .send(&identity, Request::form(Vec::new()))
            .await
            .unwrap_err();
        assert!(
            matches!(&error, CallError::Connect { endpoint, .. } if *endpoint == closed),
            "{error}"
        );
    }

    #[tokio::test]
    async fn an_http_proxy_gets_requests_in_absolute_form_with_its_credentials() {
        let (proxy, heads) = closing_server(Duration::ZERO).await;
        let credentials =
            aws_credential_types::Credentials::new("AKIDTEST", "secret", None, None, "test");
        let sdk = SdkConfig::builder()
            .credentials_provider(SharedCredentialsProvider::new(credentials))
            .build();
        let with_user = proxy.replace("http://", "http://relay:s%3Acret@");
        let client = Client::with_env(
            &sdk,
            super::super::SNS,
            "us-east-1",
            ("sns.endpoint_url", "http://sns.internal:4566"),
            4,
            Duration::from_secs(5),
            |name| (name == "HTTP_PROXY").then(|| with_user.clone()),
        )
        .unwrap();
        let identity = client.identity().await.unwrap();
        let (status, _) = client
            .send(&identity, Request::form(b"Action=PublishBatch".to_vec()))
            .await
            .unwrap();
        assert_eq!(status, StatusCode::OK);
        let heads = heads.lock().unwrap().clone();
        assert_eq!(heads.len(), 1);
        assert!(
            heads[0].starts_with("POST http://sns.internal:4566/ HTTP/1.1"),
            "{}",
            heads[0]
        );
        assert!(
            heads[0].contains("proxy-authorization: Basic cmVsYXk6czpjcmV0"),
            "{}",
            heads[0]
        );
        assert!(heads[0].contains("host: sns.internal:4566"), "{}", heads[0]);
    }
}
