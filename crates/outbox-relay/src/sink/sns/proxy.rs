//! Outbound HTTP proxies for the SNS client, from the standard variables
//! the AWS SDK (behavior version 2025-08-07 and later), curl and most tools
//! read:
//!
//! * `HTTPS_PROXY` / `https_proxy` for an `https` endpoint: a `CONNECT`
//!   tunnel through the proxy, TLS to the endpoint inside it (the proxy sees
//!   only the host name);
//! * `HTTP_PROXY` / `http_proxy` for an `http` endpoint: requests in absolute
//!   form to the proxy;
//! * else `ALL_PROXY` / `all_proxy`, for either;
//! * `NO_PROXY` / `no_proxy`: comma-separated hosts, domains (`.example.com`
//!   and `example.com` both cover subdomains), IP addresses or ranges
//!   (`10.0.0.0/8`, `fd00::/8`), or `*` for everything, reached directly.
//!
//! The proxy URL is `http://[user:password@]host[:port]` (port 80 by
//! default; the scheme may be left out). User and password go in a
//! `Proxy-Authorization: Basic` header. A proxy reached over TLS
//! (`https://` proxy URL) is refused at start-up, naming the variable.

use base64::Engine as _;
use hyper::header::HeaderValue;
use hyper::Uri;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// The largest `CONNECT` answer head read.
const MAX_HEAD: usize = 16 * 1024;

/// A proxy to go through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proxy {
    /// Host and port to connect to.
    pub address: (String, u16),
    /// `Basic …` when the URL has a user.
    pub authorization: Option<HeaderValue>,
    /// The variable it came from, for messages.
    pub variable: &'static str,
}

/// The proxy for an endpoint on `host` (`https` or not), as `env` (a
/// variable lookup) says; `Err((variable, message))` for a proxy URL that
/// cannot be used.
pub fn from_env(
    https: bool,
    host: &str,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<Proxy>, (&'static str, String)> {
    let names: [&'static str; 4] = if https {
        ["HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"]
    } else {
        ["HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"]
    };
    let Some((variable, url)) = names.iter().find_map(|name| {
        env(name)
            .filter(|v| !v.trim().is_empty())
            .map(|v| (*name, v))
    }) else {
        return Ok(None);
    };
    let no_proxy = env("NO_PROXY")
        .or_else(|| env("no_proxy"))
        .unwrap_or_default();
    if bypassed(host, &no_proxy) {
        return Ok(None);
    }
    parse(url.trim())
        .map(|(address, authorization)| {
            Some(Proxy {
                address,
                authorization,
                variable,
            })
        })
        .map_err(|message| (variable, message))
}

fn parse(url: &str) -> Result<((String, u16), Option<HeaderValue>), String> {
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
    let (credentials, host_port) = match authority.as_str().rsplit_once('@') {
        Some((credentials, host_port)) => (Some(credentials), host_port),
        None => (None, authority.as_str()),
    };
    let host_port: hyper::http::uri::Authority =
        host_port.parse().map_err(|e| format!("{url:?}: {e}"))?;
    let host = host_port
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let port = host_port.port_u16().unwrap_or(80);
    let authorization = credentials
        .map(|credentials| {
            let (user, password) = credentials.split_once(':').unwrap_or((credentials, ""));
            let pair = format!(
                "{}:{}",
                crate::tls::percent_decode(user),
                crate::tls::percent_decode(password)
            );
            let encoded = base64::engine::general_purpose::STANDARD.encode(pair);
            HeaderValue::from_str(&format!("Basic {encoded}"))
                .map(|mut value| {
                    value.set_sensitive(true);
                    value
                })
                .map_err(|e| format!("the proxy credentials: {e}"))
        })
        .transpose()?;
    Ok(((host, port), authorization))
}

/// Whether `host` is reached directly per a `NO_PROXY` list.
fn bypassed(host: &str, no_proxy: &str) -> bool {
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_ascii_lowercase();
    let ip = host.parse::<std::net::IpAddr>().ok();
    no_proxy.split(',').map(str::trim).any(|entry| {
        if entry == "*" {
            return true;
        }
        if let (Some(ip), Some((net, bits))) = (ip, entry.split_once('/')) {
            return in_range(ip, net, bits);
        }
        // An entry may carry a port (`host:443`, `[::1]:443`); bypassing is by host.
        let entry = match entry.rsplit_once(':') {
            Some((name, port))
                if port.parse::<u16>().is_ok() && (!name.contains(':') || name.ends_with(']')) =>
            {
                name
            }
            _ => entry,
        };
        let domain = entry
            .trim_start_matches("*.")
            .trim_start_matches('.')
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_ascii_lowercase();
        !domain.is_empty() && (host == domain || host.ends_with(&format!(".{domain}")))
    })
}

/// Whether `ip` is in the range `net`/`bits`.
fn in_range(ip: std::net::IpAddr, net: &str, bits: &str) -> bool {
    use std::net::IpAddr;
    let Ok(bits) = bits.parse::<u32>() else {
        return false;
    };
    match (
        ip,
        net.trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>(),
    ) {
        (IpAddr::V4(ip), Ok(IpAddr::V4(net))) if bits <= 32 => {
            let mask = u32::MAX.checked_shl(32 - bits).unwrap_or(0);
            u32::from(ip) & mask == u32::from(net) & mask
        }
        (IpAddr::V6(ip), Ok(IpAddr::V6(net))) if bits <= 128 => {
            let mask = u128::MAX.checked_shl(128 - bits).unwrap_or(0);
            u128::from(ip) & mask == u128::from(net) & mask
        }
        _ => false,
    }
}

/// Ask the proxy on `tcp` for a tunnel to `target` (`host:port`); `Ok` once
/// it answered 200, with the stream then carrying the tunnel.
pub async fn tunnel(
    tcp: &mut TcpStream,
    target: &str,
    authorization: Option<&HeaderValue>,
) -> Result<(), String> {
    let mut head = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n").into_bytes();
    if let Some(value) = authorization {
        head.extend_from_slice(b"Proxy-Authorization: ");
        head.extend_from_slice(value.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    head.extend_from_slice(b"\r\n");
    tcp.write_all(&head)
        .await
        .map_err(|e| format!("sending CONNECT: {e}"))?;
    // Read exactly the answer's head: the tunnel's bytes come after it, and
    // the endpoint speaks only once the TLS handshake starts.
    let mut answer = Vec::with_capacity(256);
    while !answer.ends_with(b"\r\n\r\n") {
        if answer.len() >= MAX_HEAD {
            return Err("the proxy's answer to CONNECT has no end".into());
        }
        let byte = tcp
            .read_u8()
            .await
            .map_err(|e| format!("reading the answer to CONNECT: {e}"))?;
        answer.push(byte);
    }
    let status_line = String::from_utf8_lossy(&answer);
    let status_line = status_line.lines().next().unwrap_or_default();
    let status = status_line.split_whitespace().nth(1).unwrap_or_default();
    if status.len() == 3 && status.starts_with('2') {
        Ok(())
    } else {
        Err(format!(
            "the proxy refused the tunnel to {target}: {status_line}"
        ))
    }
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

    #[test]
    fn the_variable_of_the_endpoint_scheme_names_the_proxy() {
        let vars = [
            ("HTTPS_PROXY", "http://proxy.corp:3128"),
            ("http_proxy", "plain.corp"),
        ];
        let https = from_env(true, "sns.eu-west-1.amazonaws.com", env(&vars))
            .unwrap()
            .unwrap();
        assert_eq!(https.address, ("proxy.corp".into(), 3128));
        assert_eq!(https.variable, "HTTPS_PROXY");
        assert_eq!(https.authorization, None);
        let http = from_env(false, "localhost", env(&vars)).unwrap().unwrap();
        assert_eq!(http.address, ("plain.corp".into(), 80));
        assert_eq!(http.variable, "http_proxy");
        assert_eq!(from_env(true, "x", env(&[])).unwrap(), None);
        let all = from_env(true, "x", env(&[("ALL_PROXY", "all.corp:8080")]))
            .unwrap()
            .unwrap();
        assert_eq!((all.address.1, all.variable), (8080, "ALL_PROXY"));
        assert_eq!(
            from_env(true, "x", env(&[("HTTPS_PROXY", " ")])).unwrap(),
            None
        );
    }

    #[test]
    fn proxy_credentials_become_a_basic_authorization() {
        let vars = [("HTTPS_PROXY", "http://relay:p%40ss@10.0.0.1:8080")];
        let proxy = from_env(true, "sns.example", env(&vars)).unwrap().unwrap();
        assert_eq!(proxy.address, ("10.0.0.1".into(), 8080));
        let expected = base64::engine::general_purpose::STANDARD.encode("relay:p@ss");
        assert_eq!(
            proxy.authorization.unwrap().to_str().unwrap(),
            format!("Basic {expected}")
        );
    }

    #[test]
    fn no_proxy_names_hosts_and_domains_reached_directly() {
        let list = "localhost, .internal.corp,example.com:443,[::1],10.1.2.3,192.168.0.0/16,fd00::/8,[::2]:443";
        assert!(bypassed("localhost", list));
        assert!(bypassed("a.internal.corp", list));
        assert!(bypassed("internal.corp", list));
        assert!(bypassed("sns.example.com", list));
        assert!(bypassed("example.com", list));
        assert!(bypassed("[::1]", list));
        assert!(bypassed("10.1.2.3", list));
        assert!(bypassed("192.168.7.9", list));
        assert!(!bypassed("192.169.0.1", list));
        assert!(bypassed("[fd12::1]", list));
        assert!(bypassed("[::2]", list));
        assert!(!bypassed("[fe80::1]", list));
        assert!(!bypassed("notexample.com", list));
        assert!(!bypassed("sns.eu-west-1.amazonaws.com", list));
        assert!(bypassed("anything", "*"));
        assert!(!bypassed("anything", ""));
        let vars = [("HTTPS_PROXY", "proxy:1"), ("no_proxy", ".amazonaws.com")];
        assert_eq!(
            from_env(true, "sns.eu-west-1.amazonaws.com", env(&vars)).unwrap(),
            None
        );
    }

    #[test]
    fn a_proxy_url_that_cannot_be_used_names_its_variable() {
        let (variable, message) =
            from_env(true, "x", env(&[("https_proxy", "https://proxy:443")])).unwrap_err();
        assert_eq!(variable, "https_proxy");
        assert!(message.contains("http:// proxy URL"), "{message}");
        assert!(from_env(true, "x", env(&[("HTTPS_PROXY", "http://")])).is_err());
    }
}
