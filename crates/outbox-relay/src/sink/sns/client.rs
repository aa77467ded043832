//! The HTTP side of the SNS sink: one signed POST per call, on kept-alive
//! HTTP/1.1 connections.
//!
//! Built from AWS's own parts where they matter: the region, the endpoint
//! settings and the credentials come from `aws-config`'s standard chain
//! (environment, profiles, web identity, container and instance roles), and
//! requests are signed by `aws-sigv4`, the SigV4 implementation the AWS SDK
//! uses. What the SDK adds around a call (an orchestrator with interceptors,
//! endpoint rules, a request tree serialised field by field) cost more CPU
//! per message than everything else the relay does; see docs/benchmarks.md.
//!
//! # Invariants
//!
//! * Credentials are fetched once and kept until five minutes before they
//!   expire; a failure to get them is an [`CallError::Credentials`], which the
//!   sink treats as an authorization problem (retried, logged as an error).
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
use aws_sigv4::http_request::{sign, SignableBody, SignableRequest, SigningSettings};
use aws_sigv4::sign::v4;
use aws_smithy_runtime_api::client::identity::Identity;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::client::conn::http1::SendRequest;
use hyper::header::{HeaderValue, CONTENT_TYPE, HOST, USER_AGENT};
use hyper::{Request, StatusCode, Uri};
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
    endpoint: Endpoint,
    /// The proxy requests go through, if any.
    proxy: Option<proxy::Proxy>,
    /// For `https`: the connector and the name the certificate must have.
    tls: Option<(
        tokio_rustls::TlsConnector,
        rustls::pki_types::ServerName<'static>,
    )>,
    region: String,
    credentials: Credentials,
    pool: Mutex<Vec<(SendRequest<Full<Bytes>>, Instant)>>,
    max_idle: usize,
    attempt_timeout: Duration,
    connect_timeout: Duration,
}

struct Endpoint {
    /// As the operator wrote it, for messages.
    text: String,
    /// The request URI (scheme, authority, path): what is signed, and the
    /// request target through an `http` proxy.
    uri: Uri,
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
    /// settings in `sdk` name (`AWS_ENDPOINT_URL_SNS`, `AWS_ENDPOINT_URL`, a
    /// profile's `endpoint_url`, FIPS) or else `https://sns.<region>.amazonaws.com`.
    pub fn new(
        sdk: &SdkConfig,
        region: &str,
        endpoint_url: &str,
        max_idle: usize,
        attempt_timeout: Duration,
    ) -> Result<Self, SnsSetupError> {
        let provider = sdk.credentials_provider().ok_or_else(|| SnsSetupError {
            key: "sns",
            message: "no AWS credential provider could be set up".into(),
        })?;
        let (key, url) = endpoint_of(sdk, region, endpoint_url)?;
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
        let tls = match &endpoint.tls_name {
            Some(name) => Some((
                tls_connector().map_err(|message| SnsSetupError {
                    key: "AWS_CA_BUNDLE",
                    message,
                })?,
                name.clone(),
            )),
            None => None,
        };
        Ok(Self {
            endpoint,
            tls,
            proxy,
            region: region.to_owned(),
            credentials: Credentials::new(provider),
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

    /// POST `body` (a query-protocol form), signed; the status and body of the answer.
    pub async fn call(&self, body: Vec<u8>) -> Result<(StatusCode, Bytes), CallError> {
        let identity = self.credentials.get().await?;
        // Absolute form only to an `http` proxy; a tunnel or the endpoint
        // itself gets the path.
        let plain_proxy = self.proxy.as_ref().filter(|_| self.tls.is_none());
        let target = match plain_proxy {
            Some(_) => self.endpoint.uri.clone(),
            None => self.endpoint.path.clone(),
        };
        let mut request = Request::post(target)
            .header(HOST, self.endpoint.host.clone())
            .header(CONTENT_TYPE, HeaderValue::from_static(FORM))
            .body(())
            .expect("a request of valid parts");
        let params = v4::SigningParams::builder()
            .identity(&identity)
            .region(&self.region)
            .name("sns")
            .time(SystemTime::now())
            .settings(SigningSettings::default())
            .build()
            .map_err(|e| CallError::Signing(e.to_string()))?
            .into();
        let uri = self.endpoint.uri.to_string();
        let headers = request
            .headers()
            .iter()
            .filter_map(|(name, value)| Some((name.as_str(), value.to_str().ok()?)));
        let signable = SignableRequest::new("POST", uri, headers, SignableBody::Bytes(&body))
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
        let mut tcp = match tokio::time::timeout(
            self.connect_timeout,
            TcpStream::connect((host.as_str(), *port)),
        )
        .await
        {
            Ok(Ok(tcp)) => tcp,
            Ok(Err(error)) => return Err(failed(error.to_string())),
            Err(_) => {
                return Err(failed(format!(
                    "timed out after {:?}",
                    self.connect_timeout
                )))
            }
        };
        let _ = tcp.set_nodelay(true);
        let handshake = |error: hyper::Error| failed(error.to_string());
        match &self.tls {
            None => {
                let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
                    .await
                    .map_err(handshake)?;
                tokio::spawn(connection);
                Ok(sender)
            }
            Some((connector, name)) => {
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
                let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
                    .await
                    .map_err(handshake)?;
                tokio::spawn(connection);
                Ok(sender)
            }
        }
    }
}

/// The endpoint URL and the configuration key it came from.
fn endpoint_of(
    sdk: &SdkConfig,
    region: &str,
    endpoint_url: &str,
) -> Result<(&'static str, String), SnsSetupError> {
    if !endpoint_url.is_empty() {
        return Ok(("sns.endpoint_url", endpoint_url.to_owned()));
    }
    if let Ok(url) = std::env::var("AWS_ENDPOINT_URL_SNS") {
        if !url.is_empty() {
            return Ok(("AWS_ENDPOINT_URL_SNS", url));
        }
    }
    if let Some(url) = sdk.endpoint_url() {
        return Ok(("AWS_ENDPOINT_URL", url.to_owned()));
    }
    if sdk.use_dual_stack() == Some(true) {
        return Err(SnsSetupError {
            key: "AWS_USE_DUALSTACK_ENDPOINT",
            message:
                "dual-stack SNS endpoints are not supported; unset it, or set sns.endpoint_url"
                    .into(),
        });
    }
    let service = if sdk.use_fips() == Some(true) {
        "sns-fips"
    } else {
        "sns"
    };
    let domain = if region.starts_with("cn-") {
        "amazonaws.com.cn"
    } else {
        "amazonaws.com"
    };
    Ok(("sns.region", format!("https://{service}.{region}.{domain}")))
}

impl Endpoint {
    fn parse(url: &str) -> Result<Self, String> {
        let uri: Uri = url.parse().map_err(|e| format!("{e}"))?;
        let https = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => return Err("it must start with http:// or https://".into()),
        };
        let authority = uri.authority().ok_or("it has no host")?.clone();
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let port = authority.port_u16().unwrap_or(if https { 443 } else { 80 });
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
        let host_port = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        Ok(Self {
            text: url.to_owned(),
            path,
            authority: host_port,
            host: HeaderValue::from_str(authority.as_str()).map_err(|e| e.to_string())?,
            uri: request_uri,
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

/// The credential chain with a cache in front: one fetch at a time, kept
/// until [`REFRESH_BEFORE_EXPIRY`] before the credentials expire.
struct Credentials {
    provider: SharedCredentialsProvider,
    cached: tokio::sync::Mutex<Option<(Identity, Option<SystemTime>)>>,
}

impl Credentials {
    fn new(provider: SharedCredentialsProvider) -> Self {
        Self {
            provider,
            cached: tokio::sync::Mutex::new(None),
        }
    }

    async fn get(&self) -> Result<Identity, CallError> {
        let mut cached = self.cached.lock().await;
        if let Some((identity, expiry)) = &*cached {
            let fresh =
                expiry.is_none_or(|expiry| SystemTime::now() + REFRESH_BEFORE_EXPIRY < expiry);
            if fresh {
                return Ok(identity.clone());
            }
        }
        let credentials = self
            .provider
            .provide_credentials()
            .await
            .map_err(|e| CallError::Credentials(with_sources(&e)))?;
        let expiry = credentials.expiry();
        let identity = Identity::from(credentials);
        *cached = Some((identity.clone(), expiry));
        Ok(identity)
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

    #[test]
    fn endpoints_are_parsed_with_their_host_header_and_address() {
        let e = Endpoint::parse("http://127.0.0.1:5000").unwrap();
        assert_eq!(e.uri.to_string(), "http://127.0.0.1:5000/");
        assert_eq!(e.host, "127.0.0.1:5000");
        assert_eq!(e.address, ("127.0.0.1".into(), 5000));
        assert!(e.tls_name.is_none());
        let e = Endpoint::parse("https://sns.eu-west-1.amazonaws.com").unwrap();
        assert_eq!(e.host, "sns.eu-west-1.amazonaws.com");
        assert_eq!(e.address, ("sns.eu-west-1.amazonaws.com".into(), 443));
        assert!(e.tls_name.is_some());
        let e = Endpoint::parse("http://[::1]:4566/sns").unwrap();
        assert_eq!(e.address, ("::1".into(), 4566));
        assert_eq!(e.uri.path(), "/sns");
        assert_eq!(e.path.to_string(), "/sns");
        assert_eq!(e.authority, "[::1]:4566");
        assert!(Endpoint::parse("localhost:4566").is_err());
        assert!(Endpoint::parse("ftp://x").is_err());
        assert!(Endpoint::parse("http://x/?a=b").is_err());
    }
}
