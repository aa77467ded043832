//! Connections to an AWS endpoint: the relay's plain-HTTP egress
//! ([`crate::sink::http`]: TCP, proxies from the standard variables, TLS with
//! `AWS_CA_BUNDLE` or the system's roots, pooling) set up for one service's
//! endpoint, and what a failed request says.
//!
//! The AWS layer's own choices: connecting within the smaller of the attempt
//! timeout and 3 s, sent data left unacknowledged for at most the attempt
//! timeout, the proxy logged with the service it serves, and a proxy that
//! forwards requests (an `http` endpoint) given its credentials on each.

use std::time::Duration;

use hyper::header::HeaderValue;

use super::endpoint::Endpoint;
use super::{Service, SetupError};
use crate::sink::http;

/// The pooled connections to one AWS endpoint.
pub(crate) struct Transport {
    /// hyper-util's pooled client.
    pub pooled: http::Pooled,
    /// `Proxy-Authorization` for requests an `http` proxy forwards (a
    /// tunnel's proxy gets it in the `CONNECT` instead).
    pub forwarded_authorization: Option<HeaderValue>,
}

/// The transport to `endpoint` of `service`, through the proxy the
/// variables of `env` name, keeping up to `max_idle` idle connections.
pub(crate) fn transport(
    service: Service,
    endpoint: &Endpoint,
    max_idle: usize,
    attempt_timeout: Duration,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Transport, SetupError> {
    let proxy = http::proxy_for(&endpoint.uri, env)
        .map_err(|(key, message)| SetupError { key, message })?;
    if let Some(proxy) = &proxy {
        tracing::info!(
            proxy = %proxy.uri,
            variable = proxy.variable,
            service = service.signing_name,
            "AWS requests go through a proxy"
        );
    }
    let https = endpoint.is_https();
    let connector = http::connector(
        proxy.as_ref(),
        https,
        attempt_timeout.min(Duration::from_secs(3)),
        attempt_timeout,
    )
    .map_err(|message| SetupError {
        key: "AWS_CA_BUNDLE",
        message,
    })?;
    Ok(Transport {
        pooled: http::pooled(connector, max_idle),
        forwarded_authorization: proxy
            .filter(|_| !https)
            .and_then(|proxy| proxy.authorization),
    })
}

/// What a request that got no answer says: its sources (the client's own
/// words, "client error (Connect)", say less), and for a connection that
/// failed in TLS, which CAs were trusted.
pub(crate) fn failure(error: &hyper_util::client::legacy::Error) -> String {
    let cause = std::error::Error::source(error).unwrap_or(error);
    let text = http::with_sources(cause);
    if error.is_connect() && http::is_tls(error) {
        format!(
            "TLS: {text} (trusted are the CAs of AWS_CA_BUNDLE when it is set, else the system's)"
        )
    } else {
        text
    }
}
