//! The HTTP side of the SNS sink: one signed POST per call, on kept-alive
//! HTTP/1.1 connections.
//!
//! Built from AWS's own parts where they matter: the region, the endpoint
//! (the SDK's settings and SNS's endpoint rules) and the credentials come
//! from `aws-config`'s standard chain (environment, profiles, web identity,
//! container and instance roles), and requests are signed by `aws-sigv4`,
//! the SigV4 implementation the AWS SDK uses. What the SDK adds around a
//! call (an orchestrator with interceptors, a request tree serialised field
//! by field) cost more CPU per message than everything else the relay does;
//! see docs/benchmarks.md.
//!
//! # Invariants
//!
//! * Credentials are cached as [`Credentials`] says; a failure to get any is
//!   a [`CallError::Credentials`], which the sink retries and logs as an error.
//! * Requests are signed with the endpoint's time once an answer's `Date`
//!   shows this host's clock is off by a minute or more ([`Clock`]).
//! * A request goes on a fresh connection or on an idle one that was last
//!   used less than [`IDLE`] ago. When an idle connection turns out to be
//!   closed *before the request was written to it*, the request goes on a new
//!   connection at once: nothing was sent, so nothing can be published twice.
//!   Any failure after the request was written is reported, never retried here.
//! * Every call ends within `attempt_timeout` (connecting within the smaller
//!   of it and 3 s); a call that does not is a [`CallError::Timeout`].

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

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
use hyper::client::conn::http1::SendRequest;
use hyper::header::{HeaderValue, CONTENT_TYPE, HOST, USER_AGENT};
use hyper::{Method, Request, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::{proxy, SnsSetupError};

/// How long an idle connection is kept for the next request.
pub const IDLE: Duration = Duration::from_secs(20);
/// Credentials are refreshed this long before they expire.
const REFRESH_BEFORE_EXPIRY: Duration = Duration::from_secs(300);
/// The largest answer read (a 10-entry answer is about 2 KiB).
const MAX_ANSWER: usize = 1 << 20;
const FORM: &str = "application/x-www-form-urlencoded; charset=utf-8";
const AGENT: &str = concat!("outbox-relay/", env!("CARGO_PKG_VERSION"));

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

/// A signed-request client for one SNS endpoint.
pub struct Client {
    /// The signing name: `sns`, `s3`.
    service: &'static str,
    endpoint: Endpoint,
    /// The proxy requests go through, if any.
    proxy: Option<proxy::Proxy>,
    /// For `https` (the name to check is the endpoint's `tls_name`).
    tls: Option<tokio_rustls::TlsConnector>,
    region: String,
    credentials: Credentials,
    clock: Clock,
    pool: Mutex<Vec<(SendRequest<Full<Bytes>>, Instant)>>,
    max_idle: usize,
    attempt_timeout: Duration,
    connect_timeout: Duration,
}

struct Endpoint {
    /// As the operator wrote it, for messages.
    text: String,
    /// The request URI (scheme, authority, path) as text: what is signed,
    /// and the request target through an `http` proxy.
    signed_uri: String,
    /// The request target otherwise: the path alone (origin form).
    path: Uri,
    /// `host:port`, for a proxy tunnel.
    authority: String,
    /// `Host` header value.
    host: HeaderValue,
    /// Where to connect.
    address: (String, u16),
    /// For `https`: the name the certificate must have.
    tls_name: Option<rustls::pki_types::ServerName<'static>>,
}

impl Client {
    /// A client for `region`, at `endpoint_url` or else the endpoint the AWS
    /// settings in `sdk` and SNS's endpoint rules give ([`endpoint_of`]).
    pub async fn new(
        sdk: &SdkConfig,
        region: &str,
        endpoint_url: &str,
        max_idle: usize,
        attempt_timeout: Duration,
    ) -> Result<Self, SnsSetupError> {
        let (key, url) = endpoint_of(sdk, region, endpoint_url).await?;
        Self::build(sdk, "sns", region, key, &url, max_idle, attempt_timeout)
    }

    /// A client for S3 requests to `bucket`: at `endpoint_url` (key
    /// `sns.large_payload_endpoint_url`) or the endpoint the AWS settings
    /// give (`AWS_ENDPOINT_URL_S3`, `AWS_ENDPOINT_URL`), path-style
    /// (`<endpoint>/<bucket>/<key>`, as local and compatible endpoints take
    /// it); else AWS's own, virtual-hosted (`https://<bucket>.s3.<region>.amazonaws.com`).
    pub fn s3(
        sdk: &SdkConfig,
        region: &str,
        endpoint_url: &str,
        bucket: &str,
        max_idle: usize,
        attempt_timeout: Duration,
    ) -> Result<Self, SnsSetupError> {
        let s3_key = aws_types::service_config::ServiceConfigKey::builder()
            .service_id("S3")
            .env("AWS_ENDPOINT_URL")
            .profile("endpoint_url")
            .build()
            .expect("every part of the key is set");
        let custom = if !endpoint_url.is_empty() {
            Some(("sns.large_payload_endpoint_url", endpoint_url.to_owned()))
        } else if let Some(url) = sdk.service_config().and_then(|c| c.load_config(s3_key)) {
            Some(("AWS_ENDPOINT_URL_S3", url))
        } else {
            sdk.endpoint_url()
                .map(|url| ("AWS_ENDPOINT_URL", url.to_owned()))
        };
        let (key, url) = match custom {
            Some((key, url)) => (key, format!("{}/{bucket}", url.trim_end_matches('/'))),
            None => {
                let suffix = if region.starts_with("cn-") {
                    "amazonaws.com.cn"
                } else {
                    "amazonaws.com"
                };
                (
                    "sns.large_payload_bucket",
                    format!("https://{bucket}.s3.{region}.{suffix}"),
                )
            }
        };
        Self::build(sdk, "s3", region, key, &url, max_idle, attempt_timeout)
    }

    fn build(
        sdk: &SdkConfig,
        service: &'static str,
        region: &str,
        key: &'static str,
        url: &str,
        max_idle: usize,
        attempt_timeout: Duration,
    ) -> Result<Self, SnsSetupError> {
        let provider = sdk.credentials_provider().ok_or_else(|| SnsSetupError {
            key: "sns",
            message: "no AWS credential provider could be set up".into(),
        })?;
        let url = url.to_owned();
        let endpoint = Endpoint::parse(&url).map_err(|message| SnsSetupError {
            key,
            message: format!("{url:?} is not a usable endpoint: {message}"),
        })?;
        let proxy = proxy::from_env(endpoint.tls_name.is_some(), &endpoint.address.0, |name| {
            std::env::var(name).ok()
        })
        .map_err(|(key, message)| SnsSetupError { key, message })?;
        if let Some(proxy) = &proxy {
            tracing::info!(
                proxy = %format!("{}:{}", proxy.address.0, proxy.address.1),
                variable = proxy.variable,
                "SNS requests go through a proxy"
            );
        }
        let tls = match endpoint.tls_name {
            Some(_) => Some(tls_connector().map_err(|message| SnsSetupError {
                key: "AWS_CA_BUNDLE",
                message,
            })?),
            None => None,
        };
        Ok(Self {
            service,
            endpoint,
            tls,
            proxy,
            region: region.to_owned(),
            credentials: Credentials::new(provider),
            clock: Clock::default(),
            pool: Mutex::new(Vec::new()),
            max_idle: max_idle.max(1),
            attempt_timeout,
            connect_timeout: attempt_timeout.min(Duration::from_secs(3)),
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

    /// Drop the cached credentials: SNS said they are expired or unknown.
    pub async fn forget_credentials(&self) {
        self.credentials.forget().await;
    }

    /// POST `body` (a query-protocol form), signed with `identity`; the
    /// status and body of the answer.
    pub async fn call(
        &self,
        identity: &Identity,
        body: Vec<u8>,
    ) -> Result<(StatusCode, Bytes), CallError> {
        self.request(identity, Method::POST, "", FORM, body).await
    }

    /// PUT `body` as the object `key` (S3 `PutObject`: the endpoint's path
    /// is the bucket's), signed with `identity`; the status and body of the
    /// answer. `key` must be of URI-safe characters.
    pub async fn put_object(
        &self,
        identity: &Identity,
        key: &str,
        content_type: &'static str,
        body: Vec<u8>,
    ) -> Result<(StatusCode, Bytes), CallError> {
        self.request(identity, Method::PUT, key, content_type, body)
            .await
    }

    async fn request(
        &self,
        identity: &Identity,
        method: Method,
        key: &str,
        content_type: &'static str,
        body: Vec<u8>,
    ) -> Result<(StatusCode, Bytes), CallError> {
        // Absolute form only to an `http` proxy; a tunnel or the endpoint
        // itself gets the path.
        let plain_proxy = self.proxy.as_ref().filter(|_| self.tls.is_none());
        let join = |base: &str| {
            if key.is_empty() {
                base.to_owned()
            } else {
                format!("{}/{key}", base.trim_end_matches('/'))
            }
        };
        let signed_uri = join(&self.endpoint.signed_uri);
        let target: Uri = match plain_proxy {
            Some(_) => signed_uri.parse(),
            None => join(&self.endpoint.path.to_string()).parse(),
        }
        .map_err(|e: hyper::http::uri::InvalidUri| CallError::Signing(e.to_string()))?;
        let mut request = Request::builder()
            .method(method.clone())
            .uri(target)
            .header(HOST, self.endpoint.host.clone())
            .header(CONTENT_TYPE, HeaderValue::from_static(content_type))
            .body(())
            .expect("a request of valid parts");
        let mut settings = SigningSettings::default();
        if self.service == "s3" {
            // S3's flavour of SigV4: the path as it is, and the payload's
            // hash in `x-amz-content-sha256`.
            settings.percent_encoding_mode = PercentEncodingMode::Single;
            settings.uri_path_normalization_mode = UriPathNormalizationMode::Disabled;
            settings.payload_checksum_kind = PayloadChecksumKind::XAmzSha256;
        }
        let params = v4::SigningParams::builder()
            .identity(identity)
            .region(&self.region)
            .name(self.service)
            .time(self.clock.now())
            .settings(settings)
            .build()
            .map_err(|e| CallError::Signing(e.to_string()))?
            .into();
        let headers = request
            .headers()
            .iter()
            .filter_map(|(name, value)| Some((name.as_str(), value.to_str().ok()?)));
        let signable = SignableRequest::new(
            method.as_str(),
            &signed_uri,
            headers,
            SignableBody::Bytes(&body),
        )
        .map_err(|e| CallError::Signing(e.to_string()))?;
        let (instructions, _) = sign(signable, &params)
            .map_err(|e| CallError::Signing(e.to_string()))?
            .into_parts();
        instructions.apply_to_request_http1x(&mut request);
        request
            .headers_mut()
            .insert(USER_AGENT, HeaderValue::from_static(AGENT));
        if let Some(authorization) = plain_proxy.and_then(|p| p.authorization.clone()) {
            request
                .headers_mut()
                .insert(hyper::header::PROXY_AUTHORIZATION, authorization);
        }
        let request = request.map(|()| Full::new(Bytes::from(body)));
        match tokio::time::timeout(self.attempt_timeout, self.send(request)).await {
            Ok(answer) => answer,
            Err(_) => Err(CallError::Timeout {
                endpoint: self.endpoint.text.clone(),
                timeout: self.attempt_timeout,
            }),
        }
    }

    async fn send(
        &self,
        mut request: Request<Full<Bytes>>,
    ) -> Result<(StatusCode, Bytes), CallError> {
        loop {
            let (mut connection, reused) = match self.idle() {
                Some(connection) => (connection, true),
                None => (self.connect().await?, false),
            };
            let io = |error: hyper::Error| CallError::Io {
                endpoint: self.endpoint.text.clone(),
                error: error.to_string(),
            };
            if let Err(error) = connection.ready().await {
                if reused {
                    continue; // closed while idle; nothing was sent on it
                }
                return Err(io(error));
            }
            let answer = match connection.try_send_request(request).await {
                Ok(answer) => answer,
                Err(mut error) => match error.take_message() {
                    Some(unsent) if reused => {
                        request = unsent;
                        continue;
                    }
                    _ => return Err(io(error.into_error())),
                },
            };
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
            self.keep(connection);
            return Ok((status, body));
        }
    }

    /// An idle connection that may still be open.
    fn idle(&self) -> Option<SendRequest<Full<Bytes>>> {
        let mut pool = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
        while let Some((connection, since)) = pool.pop() {
            if since.elapsed() < IDLE && !connection.is_closed() {
                return Some(connection);
            }
        }
        None
    }

    fn keep(&self, connection: SendRequest<Full<Bytes>>) {
        if connection.is_closed() {
            return;
        }
        let mut pool = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
        if pool.len() < self.max_idle {
            pool.push((connection, Instant::now()));
        }
    }

    async fn connect(&self) -> Result<SendRequest<Full<Bytes>>, CallError> {
        let failed = |error: String| CallError::Connect {
            endpoint: self.endpoint.text.clone(),
            error,
        };
        let (host, port) = match &self.proxy {
            Some(proxy) => &proxy.address,
            None => &self.endpoint.address,
        };
        let mut tcp = tcp_connect(host, *port, self.connect_timeout)
            .await
            .map_err(failed)?;
        let _ = tcp.set_nodelay(true);
        let handshake = |error: hyper::Error| failed(error.to_string());
        match (&self.tls, &self.endpoint.tls_name) {
            (Some(connector), Some(name)) => {
                if let Some(proxy) = &self.proxy {
                    let tunnel = proxy::tunnel(
                        &mut tcp,
                        &self.endpoint.authority,
                        proxy.authorization.as_ref(),
                    );
                    tokio::time::timeout(self.connect_timeout, tunnel)
                        .await
                        .map_err(|_| {
                            failed(format!(
                                "the proxy ({}) did not answer CONNECT",
                                proxy.variable
                            ))
                        })?
                        .map_err(|error| {
                            failed(format!("through the proxy ({}): {error}", proxy.variable))
                        })?;
                }
                let tls = tokio::time::timeout(
                    self.connect_timeout,
                    connector.connect(name.clone(), tcp),
                )
                .await
                .map_err(|_| failed("TLS handshake timed out".into()))?
                .map_err(|error| failed(format!("TLS: {error} (trusted are the CAs of AWS_CA_BUNDLE when it is set, else the system's)")))?;
                http1(tls).await.map_err(handshake)
            }
            _ => http1(tcp).await.map_err(handshake),
        }
    }
}

/// An HTTP/1.1 connection on `io`, driven by a task of its own.
async fn http1<S>(io: S) -> Result<SendRequest<Full<Bytes>>, hyper::Error>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(connection);
    Ok(sender)
}

/// A TCP connection to `host`:`port` within `limit`. Each resolved
/// address gets its share of what is left of the limit (at least 1 s, the
/// last one all of it), so one address that swallows packets does not use up
/// the whole attempt while another would answer.
async fn tcp_connect(host: &str, port: u16, limit: Duration) -> Result<TcpStream, String> {
    let deadline = tokio::time::Instant::now() + limit;
    let addresses: Vec<_> =
        tokio::time::timeout_at(deadline, tokio::net::lookup_host((host, port)))
            .await
            .map_err(|_| format!("resolving {host} timed out after {limit:?}"))?
            .map_err(|e| format!("cannot resolve {host}: {e}"))?
            .collect();
    let mut last = format!("{host} resolves to no address");
    for (i, address) in addresses.iter().enumerate() {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            break;
        }
        let remaining = u32::try_from(addresses.len() - i).unwrap_or(u32::MAX);
        let share = (left / remaining).max(Duration::from_secs(1)).min(left);
        match tokio::time::timeout(share, TcpStream::connect(address)).await {
            Ok(Ok(tcp)) => return Ok(tcp),
            Ok(Err(error)) => last = format!("{address}: {error}"),
            Err(_) => last = format!("{address}: timed out after {share:?}"),
        }
    }
    Err(last)
}

/// The endpoint URL and the configuration key it came from, by the AWS
/// SDK's own rules: `sns.endpoint_url`; else `AWS_ENDPOINT_URL_SNS` or a
/// profile's `services` section, then `AWS_ENDPOINT_URL` or a profile's
/// `endpoint_url` (all ignored under `AWS_IGNORE_CONFIGURED_ENDPOINT_URLS`);
/// else SNS's endpoint rules for the region, FIPS and dual-stack settings
/// (the SDK's resolver: every partition, GovCloud, China, ISO).
async fn endpoint_of(
    sdk: &SdkConfig,
    region: &str,
    endpoint_url: &str,
) -> Result<(&'static str, String), SnsSetupError> {
    use aws_sdk_sns::config::endpoint::{DefaultResolver, Params, ResolveEndpoint as _};
    if !endpoint_url.is_empty() {
        return Ok(("sns.endpoint_url", endpoint_url.to_owned()));
    }
    let key = aws_types::service_config::ServiceConfigKey::builder()
        .service_id("SNS")
        .env("AWS_ENDPOINT_URL")
        .profile("endpoint_url")
        .build()
        .expect("every part of the key is set");
    if let Some(url) = sdk.service_config().and_then(|c| c.load_config(key)) {
        return Ok(("AWS_ENDPOINT_URL_SNS", url));
    }
    if let Some(url) = sdk.endpoint_url() {
        return Ok(("AWS_ENDPOINT_URL", url.to_owned()));
    }
    let unusable = |e: &dyn std::fmt::Display| SnsSetupError {
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
    Ok(("sns.region", endpoint.url().to_owned()))
}

impl Endpoint {
    fn parse(url: &str) -> Result<Self, String> {
        let uri: Uri = url.parse().map_err(|e| format!("{e}"))?;
        let https = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => return Err("it must start with http:// or https://".into()),
        };
        let given = uri.authority().ok_or("it has no host")?.clone();
        let host = given
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let default_port = if https { 443 } else { 80 };
        let port = given.port_u16().unwrap_or(default_port);
        // `Host` (signed) and the URI without a default port, as the SDK
        // sends them: a proxy that normalises `Host` keeps the signature.
        let bracketed = if host.contains(':') {
            format!("[{host}]")
        } else {
            host.clone()
        };
        let authority = if port == default_port {
            bracketed.clone()
        } else {
            format!("{bracketed}:{port}")
        };
        let path = match uri.path() {
            "" => "/",
            path => path,
        };
        if uri.query().is_some() {
            return Err("it must not have a query".into());
        }
        let request_uri = Uri::builder()
            .scheme(if https { "https" } else { "http" })
            .authority(authority.as_str())
            .path_and_query(path)
            .build()
            .map_err(|e| e.to_string())?;
        let tls_name = if https {
            Some(
                rustls::pki_types::ServerName::try_from(host.clone())
                    .map_err(|e| format!("{host:?} is not a TLS server name: {e}"))?,
            )
        } else {
            None
        };
        let path = Uri::builder()
            .path_and_query(path)
            .build()
            .map_err(|e| e.to_string())?;
        let host_port = format!("{bracketed}:{port}");
        Ok(Self {
            text: url.to_owned(),
            path,
            authority: host_port,
            host: HeaderValue::from_str(authority.as_str()).map_err(|e| e.to_string())?,
            signed_uri: request_uri.to_string(),
            address: (host, port),
            tls_name,
        })
    }
}

/// TLS to the endpoint: the `ring` provider the rest of the relay uses,
/// HTTP/1.1 by ALPN, and the CAs of [`roots`].
fn tls_connector() -> Result<tokio_rustls::TlsConnector, String> {
    let roots = roots()?;
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// The CAs trusted for the endpoint's certificate:
///
/// * the PEM file `AWS_CA_BUNDLE` names, alone, when it is set (as the AWS
///   CLI and botocore do: for TLS-inspecting proxies and private endpoints);
/// * else the system's store (`SSL_CERT_FILE` and `SSL_CERT_DIR` are
///   honoured), as the AWS SDK's own client trusts;
/// * else, when the system has none (a scratch container), Mozilla's list,
///   compiled in.
fn roots() -> Result<rustls::RootCertStore, String> {
    let mut roots = rustls::RootCertStore::empty();
    if let Some(bundle) = std::env::var_os("AWS_CA_BUNDLE").filter(|b| !b.is_empty()) {
        let certs = crate::tls::read_certs(std::path::Path::new(&bundle))?;
        let (added, _) = roots.add_parsable_certificates(certs);
        if added == 0 {
            return Err(format!(
                "no usable CA certificate in {}",
                bundle.to_string_lossy()
            ));
        }
        return Ok(roots);
    }
    let native = rustls_native_certs::load_native_certs();
    roots.add_parsable_certificates(native.certs);
    if roots.is_empty() {
        tracing::debug!(errors = ?native.errors, "no system CA certificates; trusting Mozilla's list");
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    }
    Ok(roots)
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
                let error = with_sources(&error);
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
                "this host's clock is off from the SNS endpoint's; signing with the endpoint's time"
            );
        }
    }
}

/// An error with its sources, on one line.
fn with_sources(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that answers every request with a `PublishBatch` answer and
    /// a `Date` `ahead` of this host's clock, then closes the connection
    /// (without saying so: the client finds out when it reuses it). Returns
    /// its URL and the heads of the requests it got.
    async fn closing_server(ahead: Duration) -> (String, std::sync::Arc<Mutex<Vec<String>>>) {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let heads = std::sync::Arc::new(Mutex::new(Vec::new()));
        let seen = std::sync::Arc::clone(&heads);
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let mut head = Vec::new();
                while !head.ends_with(b"\r\n\r\n") {
                    let Ok(byte) = socket.read_u8().await else {
                        break;
                    };
                    head.push(byte);
                }
                let head = String::from_utf8_lossy(&head).into_owned();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length: "))
                    .and_then(|n| n.trim().parse().ok())
                    .unwrap_or(0);
                let mut body = vec![0; length];
                let _ = socket.read_exact(&mut body).await;
                seen.lock().unwrap().push(head);
                let xml = "<PublishBatchResponse><PublishBatchResult><Successful>\
                           <member><Id>0</Id></member></Successful><Failed/>\
                           </PublishBatchResult></PublishBatchResponse>";
                let date = httpdate::fmt_http_date(SystemTime::now() + ahead);
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ndate: {date}\r\ncontent-length: {}\r\n\r\n{xml}",
                    xml.len()
                );
                let _ = socket.write_all(answer.as_bytes()).await;
                // Closed here, after the answer.
            }
        });
        (url, heads)
    }

    async fn client_for(url: &str) -> Client {
        let credentials =
            aws_credential_types::Credentials::new("AKIDTEST", "secret", None, None, "test");
        let sdk = SdkConfig::builder()
            .credentials_provider(SharedCredentialsProvider::new(credentials))
            .build();
        Client::new(&sdk, "us-east-1", url, 4, Duration::from_secs(5))
            .await
            .unwrap()
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
        let client = client_for(&url).await;
        let identity = client.identity().await.unwrap();
        for _ in 0..3 {
            let (status, _) = client
                .call(&identity, b"Action=PublishBatch".to_vec())
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
        let client = client_for(&url).await;
        let identity = client.identity().await.unwrap();
        for _ in 0..2 {
            client
                .call(&identity, b"Action=PublishBatch".to_vec())
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
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let tcp = tcp_connect("localhost", port, Duration::from_secs(3))
            .await
            .unwrap();
        assert_eq!(tcp.peer_addr().unwrap().port(), port);
        drop(listener);
        let error = tcp_connect("127.0.0.1", port, Duration::from_secs(3))
            .await
            .unwrap_err();
        assert!(error.contains(&format!("127.0.0.1:{port}")), "{error}");
    }

    #[tokio::test]
    async fn endpoints_follow_the_sdk_rules_for_every_partition() {
        let resolve = |region: &'static str, fips: bool| async move {
            let sdk = SdkConfig::builder().use_fips(fips).build();
            endpoint_of(&sdk, region, "").await.unwrap()
        };
        assert_eq!(
            resolve("eu-west-1", false).await,
            (
                "sns.region",
                "https://sns.eu-west-1.amazonaws.com".to_owned()
            )
        );
        assert_eq!(
            resolve("us-east-1", true).await.1,
            "https://sns-fips.us-east-1.amazonaws.com"
        );
        assert_eq!(
            resolve("cn-north-1", false).await.1,
            "https://sns.cn-north-1.amazonaws.com.cn"
        );
        // GovCloud's SNS endpoints are FIPS ones already.
        assert_eq!(
            resolve("us-gov-west-1", true).await.1,
            "https://sns.us-gov-west-1.amazonaws.com"
        );
        assert_eq!(
            resolve("us-iso-east-1", false).await.1,
            "https://sns.us-iso-east-1.c2s.ic.gov"
        );
        let sdk = SdkConfig::builder()
            .endpoint_url("http://localhost:4566")
            .build();
        assert_eq!(
            endpoint_of(&sdk, "eu-west-1", "http://127.0.0.1:5000")
                .await
                .unwrap(),
            ("sns.endpoint_url", "http://127.0.0.1:5000".to_owned())
        );
        assert_eq!(
            endpoint_of(&sdk, "eu-west-1", "").await.unwrap(),
            ("AWS_ENDPOINT_URL", "http://localhost:4566".to_owned())
        );
    }

    #[test]
    fn endpoints_are_parsed_with_their_host_header_and_address() {
        let e = Endpoint::parse("http://127.0.0.1:5000").unwrap();
        assert_eq!(e.signed_uri, "http://127.0.0.1:5000/");
        assert_eq!(e.host, "127.0.0.1:5000");
        assert_eq!(e.address, ("127.0.0.1".into(), 5000));
        assert!(e.tls_name.is_none());
        let e = Endpoint::parse("https://sns.eu-west-1.amazonaws.com:443").unwrap();
        assert_eq!(e.signed_uri, "https://sns.eu-west-1.amazonaws.com/");
        assert_eq!(e.host, "sns.eu-west-1.amazonaws.com");
        assert_eq!(e.address, ("sns.eu-west-1.amazonaws.com".into(), 443));
        assert!(e.tls_name.is_some());
        let e = Endpoint::parse("http://[::1]:4566/sns").unwrap();
        assert_eq!(e.address, ("::1".into(), 4566));
        assert_eq!(e.signed_uri, "http://[::1]:4566/sns");
        assert_eq!(e.path.to_string(), "/sns");
        assert_eq!(e.authority, "[::1]:4566");
        assert!(Endpoint::parse("localhost:4566").is_err());
        assert!(Endpoint::parse("ftp://x").is_err());
        assert!(Endpoint::parse("http://x/?a=b").is_err());
    }
}
