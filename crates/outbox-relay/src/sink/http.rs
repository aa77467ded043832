//! The relay's plain-HTTP egress: how its requests reach a destination's
//! endpoint (an AWS service, a webhook receiver) over TCP, an optional
//! proxy and TLS, on a pooled HTTP/1.1 client. Not to be confused with
//! [`crate::http`], the relay's own `/metrics` and `/readyz` server.
//!
//! Built from maintained parts: hyper-util's `HttpConnector` (every address
//! of the host tried within the connect timeout, shared between them;
//! `TCP_NODELAY`), its CONNECT [`Tunnel`] and proxy [`Matcher`], its pooled
//! client, and hyper-rustls for TLS, on the `ring` provider the relay's
//! Postgres connections use too. What is the relay's own is small: which
//! variable names the proxy (for messages), the proxy URLs refused at
//! start-up, the `NO_PROXY` forms curl also takes, the roots TLS trusts, and
//! an error's sources said once.
//!
//! # Proxies
//!
//! From the standard variables the AWS SDK (behavior version 2025-08-07 and
//! later), curl and most tools read:
//!
//! * `HTTPS_PROXY` / `https_proxy` for an `https` endpoint: a `CONNECT`
//!   tunnel through the proxy, TLS to the endpoint inside it (the proxy sees
//!   only the host name);
//! * `HTTP_PROXY` / `http_proxy` for an `http` endpoint: requests in
//!   absolute form to the proxy;
//! * else `ALL_PROXY` / `all_proxy`, for either;
//! * `NO_PROXY` / `no_proxy`: comma-separated hosts, domains (`.example.com`,
//!   `*.example.com` and `example.com` all cover subdomains; a `:port` is
//!   ignored), IP addresses or ranges (`10.0.0.0/8`, `fd00::/8`), or `*`
//!   for everything, reached directly.
//!
//! The proxy URL is `http://[user:password@]host[:port]` (port 80 by
//! default; the scheme may be left out). User and password go in a
//! `Proxy-Authorization: Basic` header. A proxy reached over TLS or SOCKS
//! is refused at start-up, naming the variable.

use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::header::HeaderValue;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper::Uri;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::proxy::Tunnel;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::client::proxy::matcher::Matcher;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

type BoxError = Box<dyn StdError + Send + Sync>;

/// How long an idle connection is kept for the next request.
pub(super) const IDLE: Duration = Duration::from_secs(20);

/// The `User-Agent` of the relay's HTTP requests.
pub(super) const AGENT: &str = concat!("outbox-relay/", env!("CARGO_PKG_VERSION"));

/// What the pooled client connects with.
pub(super) type Connector = HttpsConnector<Route>;

/// hyper-util's pooled HTTP/1.1 client over a [`Connector`].
pub(super) type Pooled =
    hyper_util::client::legacy::Client<Connector, http_body_util::Full<bytes::Bytes>>;

/// A pooled client over `connector`, keeping idle connections for
/// [`IDLE`], at most `max_idle` (at least one) per host.
pub(super) fn pooled(connector: Connector, max_idle: usize) -> Pooled {
    use hyper_util::rt::{TokioExecutor, TokioTimer};
    hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .pool_idle_timeout(IDLE)
        .pool_max_idle_per_host(max_idle.max(1))
        .pool_timer(TokioTimer::new())
        .timer(TokioTimer::new())
        .build(connector)
}

/// A proxy to go through.
#[derive(Debug, Clone)]
pub(super) struct Proxy {
    /// `http://host:port/`.
    pub uri: Uri,
    /// `Basic …` when the URL has a user.
    pub authorization: Option<HeaderValue>,
    /// The variable it came from, for messages.
    pub variable: &'static str,
}

/// The proxy for `endpoint` as `env` (a variable lookup) says;
/// `Err((variable, message))` for a proxy URL that cannot be used.
pub(super) fn proxy_for(
    endpoint: &Uri,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<Proxy>, (&'static str, String)> {
    let names: [&'static str; 4] = if endpoint.scheme_str() == Some("https") {
        ["HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"]
    } else {
        ["HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"]
    };
    let Some((variable, url)) = names.iter().find_map(|name| {
        env(name)
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
            .map(|v| (*name, v))
    }) else {
        return Ok(None);
    };
    let url = usable(&url).map_err(|message| (variable, message))?;
    let no_proxy = env("NO_PROXY")
        .or_else(|| env("no_proxy"))
        .unwrap_or_default();
    let matcher = Matcher::builder()
        .http(url.clone())
        .https(url)
        .no(no_proxy_as_hyper_reads_it(&no_proxy))
        .build();
    Ok(matcher.intercept(endpoint).map(|intercept| Proxy {
        uri: intercept.uri().clone(),
        authorization: intercept.basic_auth().cloned().map(|mut value| {
            value.set_sensitive(true);
            value
        }),
        variable,
    }))
}

/// `url` with its scheme, when it names a proxy the relay can use: the
/// matcher silently ignores what it cannot parse, and this refuses it.
fn usable(url: &str) -> Result<String, String> {
    let with_scheme = if url.contains("://") {
        url.to_owned()
    } else {
        format!("http://{url}")
    };
    let uri: Uri = with_scheme
        .parse()
        .map_err(|e| format!("{url:?} is not a proxy URL: {e}"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some(other) => {
            return Err(format!(
                "{url:?}: proxies reached over {other} are not supported; use an http:// proxy URL"
            ))
        }
        None => return Err(format!("{url:?} is not a proxy URL")),
    }
    let authority = uri
        .authority()
        .ok_or_else(|| format!("{url:?} has no host"))?;
    let host_port = authority
        .as_str()
        .rsplit_once('@')
        .map_or(authority.as_str(), |(_, host_port)| host_port);
    let host_port: hyper::http::uri::Authority =
        host_port.parse().map_err(|e| format!("{url:?}: {e}"))?;
    if host_port.host().is_empty() {
        return Err(format!("{url:?} has no host"));
    }
    Ok(with_scheme)
}

/// A `NO_PROXY` list in the forms hyper-util's matcher reads: entries with
/// a port (`example.com:443`, `[::1]:443`) by their host, `[::1]` without
/// brackets, `*.example.com` as `.example.com` (curl takes all of these).
fn no_proxy_as_hyper_reads_it(list: &str) -> String {
    let entries = list.split(',').map(str::trim).map(|entry| {
        let entry = match entry.rsplit_once(':') {
            Some((name, port))
                if port.parse::<u16>().is_ok() && (!name.contains(':') || name.ends_with(']')) =>
            {
                name
            }
            _ => entry,
        };
        let entry = entry.trim_start_matches('[').trim_end_matches(']');
        match entry.strip_prefix("*.") {
            Some(domain) => format!(".{domain}"),
            None => entry.to_owned(),
        }
    });
    entries.collect::<Vec<_>>().join(",")
}

/// How a connection reaches the endpoint.
#[derive(Clone)]
pub(crate) enum Route {
    /// Straight there.
    Direct(HttpConnector),
    /// Through a `CONNECT` tunnel (an `https` endpoint behind a proxy).
    Tunnel(Tunnel<HttpConnector>, &'static str),
    /// To the proxy, which forwards requests in absolute form (an `http`
    /// endpoint behind a proxy).
    Forward(HttpConnector, Uri),
}

/// The connector for `endpoint`, through `proxy` if any: TCP within
/// `connect_timeout` (shared by the host's addresses), then TLS for an
/// `https` endpoint. `user_timeout` bounds how long sent data may stay
/// unacknowledged (`TCP_USER_TIMEOUT`, Linux), so a connection into a
/// silent network fails instead of waiting on the kernel's retransmissions.
pub(super) fn connector(
    proxy: Option<&Proxy>,
    https: bool,
    connect_timeout: Duration,
    user_timeout: Duration,
) -> Result<Connector, String> {
    let mut tcp = HttpConnector::new();
    tcp.enforce_http(false);
    tcp.set_nodelay(true);
    tcp.set_connect_timeout(Some(connect_timeout));
    #[cfg(target_os = "linux")]
    tcp.set_tcp_user_timeout(Some(user_timeout));
    #[cfg(not(target_os = "linux"))]
    let _ = user_timeout;
    let route = match proxy {
        None => Route::Direct(tcp),
        Some(proxy) if https => {
            let mut tunnel = Tunnel::new(proxy.uri.clone(), tcp);
            if let Some(authorization) = &proxy.authorization {
                tunnel = tunnel.with_auth(authorization.clone());
            }
            Route::Tunnel(tunnel, proxy.variable)
        }
        Some(proxy) => Route::Forward(tcp, proxy.uri.clone()),
    };
    let tls = tls_config()?;
    Ok(hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(route))
}

impl tower_service::Service<Uri> for Route {
    type Response = Conn;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Conn, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // `HttpConnector` (alone or under the tunnel) is always ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        match self {
            Self::Direct(tcp) => {
                let connecting = tcp.call(dst);
                Box::pin(async move {
                    Ok(Conn {
                        io: connecting.await?,
                        forwarded: false,
                    })
                })
            }
            Self::Tunnel(tunnel, variable) => {
                let connecting = tunnel.call(dst);
                let variable = *variable;
                Box::pin(async move {
                    let io = connecting.await.map_err(|error| {
                        format!("through the proxy ({variable}): {}", with_sources(&error))
                    })?;
                    Ok(Conn {
                        io,
                        forwarded: false,
                    })
                })
            }
            Self::Forward(tcp, proxy) => {
                let connecting = tcp.call(proxy.clone());
                Box::pin(async move {
                    Ok(Conn {
                        io: connecting.await?,
                        forwarded: true,
                    })
                })
            }
        }
    }
}

/// A TCP connection, marked as a proxy's when the proxy forwards requests:
/// the pooled client then sends them in absolute form.
pub(crate) struct Conn {
    io: TokioIo<TcpStream>,
    forwarded: bool,
}

impl Connection for Conn {
    fn connected(&self) -> Connected {
        self.io.connected().proxy(self.forwarded)
    }
}

impl Read for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl Write for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
}

/// TLS to the endpoint: the `ring` provider the rest of the relay uses and
/// the CAs of [`roots`]; HTTP/1.1 (hyper-rustls leaves ALPN out).
fn tls_config() -> Result<rustls::ClientConfig, String> {
    let roots = roots()?;
    Ok(rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth())
}

/// The CAs trusted for the endpoint's certificate, whatever the destination
/// (one trust setting for all the relay's egress):
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
        let certs = crate::postgres::tls::read_certs(std::path::Path::new(&bundle))?;
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

/// An error with its sources, on one line, each said once (hyper and
/// hyper-util repeat a source's text in their own).
pub(super) fn with_sources(error: &dyn StdError) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// Whether a TLS failure is among `error`'s sources: the endpoint's
/// certificate, or the handshake.
pub(super) fn is_tls(error: &(dyn StdError + 'static)) -> bool {
    let mut source = Some(error);
    while let Some(cause) = source {
        if cause.is::<rustls::Error>() {
            return true;
        }
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            if io
                .get_ref()
                .is_some_and(|inner| inner.is::<rustls::Error>())
            {
                return true;
            }
        }
        source = cause.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    fn uri(text: &str) -> Uri {
        text.parse().unwrap()
    }

    #[test]
    fn the_variable_of_the_endpoint_scheme_names_the_proxy() {
        let vars = [
            ("HTTPS_PROXY", "http://proxy.corp:3128"),
            ("http_proxy", "plain.corp"),
        ];
        let https = proxy_for(&uri("https://sns.eu-west-1.amazonaws.com/"), env(&vars))
            .unwrap()
            .unwrap();
        assert_eq!(https.uri, "http://proxy.corp:3128/");
        assert_eq!(https.variable, "HTTPS_PROXY");
        assert_eq!(https.authorization, None);
        let http = proxy_for(&uri("http://localhost:4566/"), env(&vars))
            .unwrap()
            .unwrap();
        assert_eq!(http.uri, "http://plain.corp/");
        assert_eq!(http.variable, "http_proxy");
        assert!(proxy_for(&uri("https://x/"), env(&[])).unwrap().is_none());
        let all = proxy_for(&uri("https://x/"), env(&[("ALL_PROXY", "all.corp:8080")]))
            .unwrap()
            .unwrap();
        assert_eq!(
            (all.uri.port_u16(), all.variable),
            (Some(8080), "ALL_PROXY")
        );
        assert!(proxy_for(&uri("https://x/"), env(&[("HTTPS_PROXY", " ")]))
            .unwrap()
            .is_none());
    }

    #[test]
    fn proxy_credentials_become_a_basic_authorization() {
        use base64::Engine as _;
        let vars = [("HTTPS_PROXY", "http://relay:p%40ss@10.0.0.1:8080")];
        let proxy = proxy_for(&uri("https://sns.example/"), env(&vars))
            .unwrap()
            .unwrap();
        assert_eq!(proxy.uri, "http://10.0.0.1:8080/");
        let expected = base64::engine::general_purpose::STANDARD.encode("relay:p@ss");
        let authorization = proxy.authorization.unwrap();
        assert_eq!(authorization.to_str().unwrap(), format!("Basic {expected}"));
        assert!(authorization.is_sensitive());
    }

    #[test]
    fn no_proxy_names_hosts_and_domains_reached_directly() {
        let list = "localhost, .internal.corp,example.com:443,[::1],10.1.2.3,192.168.0.0/16,fd00::/8,[::2]:443,*.wild.corp";
        let vars = [("HTTPS_PROXY", "proxy:1"), ("no_proxy", list)];
        let direct = |host: &str| {
            proxy_for(&uri(&format!("https://{host}/")), env(&vars))
                .unwrap()
                .is_none()
        };
        assert!(direct("localhost"));
        assert!(direct("a.internal.corp"));
        assert!(direct("internal.corp"));
        assert!(direct("sns.example.com"));
        assert!(direct("example.com"));
        assert!(direct("[::1]"));
        assert!(direct("10.1.2.3"));
        assert!(direct("192.168.7.9"));
        assert!(!direct("192.169.0.1"));
        assert!(direct("[fd12::1]"));
        assert!(direct("[::2]"));
        assert!(!direct("[fe80::1]"));
        assert!(!direct("notexample.com"));
        assert!(direct("a.wild.corp"));
        assert!(!direct("sns.eu-west-1.amazonaws.com"));
        let everything = [("HTTPS_PROXY", "proxy:1"), ("NO_PROXY", "*")];
        assert!(proxy_for(&uri("https://anything/"), env(&everything))
            .unwrap()
            .is_none());
    }

    #[test]
    fn a_proxy_url_that_cannot_be_used_names_its_variable() {
        let (variable, message) = proxy_for(
            &uri("https://x/"),
            env(&[("https_proxy", "https://proxy:443")]),
        )
        .unwrap_err();
        assert_eq!(variable, "https_proxy");
        assert!(message.contains("http:// proxy URL"), "{message}");
        assert!(proxy_for(&uri("https://x/"), env(&[("HTTPS_PROXY", "http://")])).is_err());
        assert!(proxy_for(
            &uri("https://x/"),
            env(&[("HTTPS_PROXY", "socks5://p:1080")])
        )
        .is_err());
    }
}
