//! What the configuration says about TLS to Postgres, by libpq's rules; the
//! connector that acts on it is [`crate::postgres::tls`].
//!
//! The settings come from libpq's URL parameters (`sslmode`, `sslrootcert`,
//! `sslcert`, `sslkey`, `sslnegotiation`, `channel_binding`) or from
//! `[postgres] ssl_mode`, `ssl_root_cert`, `ssl_cert`, `ssl_key`,
//! `ssl_negotiation`, `channel_binding`; a value given both ways must agree.
//! The modes mean what they mean to libpq:
//!
//! | mode | encrypted | chain checked | host name checked |
//! |------|-----------|---------------|-------------------|
//! | `disable` | no | – | – |
//! | `prefer` (default) | if the server offers it | no | no |
//! | `require` | yes | no | no |
//! | `verify-ca` | yes | yes | no |
//! | `verify-full` | yes | yes | yes |
//!
//! As in libpq, `require` with `ssl_root_cert` set is `verify-ca`. TLS does not
//! apply to unix sockets. `verify-ca` and `verify-full` need `ssl_root_cert`: a
//! PEM file with the CA that signed the server's certificate, or `system` for
//! the operating system's trust store
//! ([`crate::postgres::tls::SystemRoots`]). Unlike libpq there is no implicit
//! `~/.postgresql/root.crt`: a verifying mode without a CA is refused at
//! start-up rather than quietly trusting something.
//!
//! # `system` means verify-full
//!
//! Any public CA will sign a certificate for any domain its owner controls, so
//! checking the chain against public roots without the host name (`verify-ca`)
//! would accept anybody's certificate. As libpq 16 does, `ssl_root_cert =
//! "system"` makes `verify-full` the default and refuses a weaker mode given
//! explicitly, in libpq's words: `weak sslmode "require" may not be used with
//! sslrootcert=system (use "verify-full")`.
//!
//! # Channel binding
//!
//! `channel_binding` (`disable`, `prefer` (default), `require`) binds SCRAM
//! authentication to the TLS session with `tls-server-end-point` (RFC 5929):
//! the client sends a hash of the certificate the server presented, and the
//! server compares it with the hash of its own. A man in the middle who holds
//! a certificate the relay trusts still cannot log in on its behalf. Both
//! connections pick `SCRAM-SHA-256-PLUS` when the server offers it and TLS
//! gives a binding ([`crate::postgres::tls::tls_server_end_point`]);
//! `require` refuses every other way of logging in (md5, password, trust,
//! SCRAM without binding) with libpq's words
//! ([`crate::report::CHANNEL_BINDING_NOT_OFFERED`]), and needs TLS, so it is
//! refused at start-up with `sslmode=disable` or a unix socket.
//!
//! # Direct TLS
//!
//! `sslnegotiation = "direct"` (PostgreSQL 17 and later) starts TLS at once,
//! without the SSLRequest round trip, and needs ALPN `postgresql`, which the
//! connector always offers (as libpq 17 does; older servers ignore it). As in
//! libpq it needs `sslmode` `require` or stronger.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SslMode {
    /// Plain text only.
    Disable,
    /// TLS when the server offers it, unverified.
    #[default]
    Prefer,
    /// TLS, unverified.
    Require,
    /// TLS, the chain checked against `ssl_root_cert`.
    VerifyCa,
    /// TLS, the chain and the host name checked.
    VerifyFull,
}

impl SslMode {
    /// Whether the server's certificate chain is checked.
    pub fn verifies(self) -> bool {
        matches!(self, SslMode::VerifyCa | SslMode::VerifyFull)
    }

    fn name(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SslMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            "allow" => {
                return Err(
                    "sslmode \"allow\" is not supported; use prefer (TLS when offered) or require"
                        .into(),
                )
            }
            other => {
                return Err(format!(
                "sslmode {other:?} is not one of disable, prefer, require, verify-ca, verify-full"
            ))
            }
        })
    }
}

/// libpq's `channel_binding`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ChannelBindingMode {
    /// Never bind, even when the server offers `SCRAM-SHA-256-PLUS`.
    Disable,
    /// Bind when the server offers it over TLS.
    #[default]
    Prefer,
    /// Log in only with a bound SCRAM exchange; anything else is refused.
    Require,
}

impl FromStr for ChannelBindingMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "disable" => Ok(ChannelBindingMode::Disable),
            "prefer" => Ok(ChannelBindingMode::Prefer),
            "require" => Ok(ChannelBindingMode::Require),
            other => Err(format!(
                "channel_binding {other:?} is not one of disable, prefer, require"
            )),
        }
    }
}

/// libpq's `sslnegotiation`: how TLS starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SslNegotiation {
    /// Ask with an SSLRequest first (every PostgreSQL version).
    #[default]
    Postgres,
    /// TLS at once, ALPN `postgresql` (PostgreSQL 17 and later).
    Direct,
}

impl FromStr for SslNegotiation {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "postgres" => Ok(SslNegotiation::Postgres),
            "direct" => Ok(SslNegotiation::Direct),
            other => Err(format!(
                "sslnegotiation {other:?} is not one of postgres, direct"
            )),
        }
    }
}

/// Where the trusted CAs come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Roots {
    /// The operating system's trust store (`ssl_root_cert = "system"`), see
    /// [`crate::postgres::tls::SystemRoots`].
    System,
    /// A PEM file.
    File(PathBuf),
}

impl Roots {
    fn parse(value: &str) -> Roots {
        if value == "system" {
            Roots::System
        } else {
            Roots::File(PathBuf::from(value))
        }
    }

    /// Where the CAs come from, in the words of an explanation.
    pub(crate) fn describe(&self) -> String {
        match self {
            Roots::System => {
                "the operating system's trust store (ssl_root_cert = \"system\")".into()
            }
            Roots::File(path) => format!("{} (postgres.ssl_root_cert)", path.display()),
        }
    }
}

/// The resolved TLS settings of both connections.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TlsSettings {
    /// The mode.
    pub mode: SslMode,
    /// Trusted CAs; required by the verifying modes.
    pub roots: Option<Roots>,
    /// Client certificate (PEM), sent when the server asks for one.
    pub cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    pub key: Option<PathBuf>,
    /// How TLS starts.
    pub negotiation: SslNegotiation,
    /// Whether SCRAM is bound to the TLS session.
    pub channel_binding: ChannelBindingMode,
}

/// The TLS parameters of a Postgres URL, which the relay handles itself
/// (tokio-postgres knows some of them, but not their checks here).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UrlTls {
    /// `sslmode`.
    pub sslmode: Option<String>,
    /// `sslrootcert`.
    pub sslrootcert: Option<String>,
    /// `sslcert`.
    pub sslcert: Option<String>,
    /// `sslkey`.
    pub sslkey: Option<String>,
    /// `sslnegotiation`.
    pub sslnegotiation: Option<String>,
    /// `channel_binding`.
    pub channel_binding: Option<String>,
}

/// Take the TLS parameters out of `url`: the URL without them, and them.
pub(crate) fn split_url(url: &str) -> (String, UrlTls) {
    let mut tls = UrlTls::default();
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_owned(), tls);
    };
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let slot = match percent_decode(key).as_str() {
            "sslmode" => &mut tls.sslmode,
            "sslrootcert" => &mut tls.sslrootcert,
            "sslcert" => &mut tls.sslcert,
            "sslkey" => &mut tls.sslkey,
            "sslnegotiation" => &mut tls.sslnegotiation,
            "channel_binding" => &mut tls.channel_binding,
            _ => {
                kept.push(pair);
                continue;
            }
        };
        *slot = Some(percent_decode(value));
    }
    let rest = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    (rest, tls)
}

/// Decode `%XX` escapes (a URL's query; `+` stays `+`, as libpq reads it).
pub fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push((h * 16 + l) as u8);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The `[postgres]` TLS keys, as configured.
#[derive(Debug, Clone, Copy, Default)]
pub struct KeyValues<'a> {
    /// `postgres.ssl_mode`.
    pub ssl_mode: Option<&'a str>,
    /// `postgres.ssl_root_cert`.
    pub ssl_root_cert: Option<&'a str>,
    /// `postgres.ssl_cert`.
    pub ssl_cert: Option<&'a Path>,
    /// `postgres.ssl_key`.
    pub ssl_key: Option<&'a Path>,
    /// `postgres.ssl_negotiation`.
    pub ssl_negotiation: Option<&'a str>,
    /// `postgres.channel_binding`.
    pub channel_binding: Option<&'a str>,
    /// The URL names a unix socket, where TLS does not apply.
    pub unix_socket: bool,
}

impl TlsSettings {
    /// Merge the URL's parameters with the `[postgres]` keys. Errors name the key.
    pub fn resolve(
        url: &UrlTls,
        keys: KeyValues<'_>,
    ) -> Result<TlsSettings, Vec<(String, String)>> {
        let mut problems = Vec::new();
        let p = &mut problems;
        let mode = pick(
            p,
            "ssl_mode",
            "sslmode",
            url.sslmode.as_deref(),
            keys.ssl_mode,
        );
        let roots = pick(
            p,
            "ssl_root_cert",
            "sslrootcert",
            url.sslrootcert.as_deref(),
            keys.ssl_root_cert,
        );
        let cert = pick(
            p,
            "ssl_cert",
            "sslcert",
            url.sslcert.as_deref(),
            keys.ssl_cert.and_then(Path::to_str),
        );
        let key = pick(
            p,
            "ssl_key",
            "sslkey",
            url.sslkey.as_deref(),
            keys.ssl_key.and_then(Path::to_str),
        );
        let negotiation = pick(
            p,
            "ssl_negotiation",
            "sslnegotiation",
            url.sslnegotiation.as_deref(),
            keys.ssl_negotiation,
        );
        let binding = pick(
            p,
            "channel_binding",
            "channel_binding",
            url.channel_binding.as_deref(),
            keys.channel_binding,
        );
        let mode_key = key_of("ssl_mode", keys.ssl_mode.is_some());
        let given_mode: Option<SslMode> = parsed(mode_key.clone(), mode, p);
        let negotiation_key = key_of("ssl_negotiation", keys.ssl_negotiation.is_some());
        let negotiation = parsed(negotiation_key, negotiation, p).unwrap_or_default();
        let binding_key = key_of("channel_binding", keys.channel_binding.is_some());
        let channel_binding = parsed(binding_key, binding, p).unwrap_or_default();
        let roots = roots.as_deref().map(Roots::parse);
        let settings = TlsSettings {
            mode: effective_mode(given_mode, roots.as_ref(), &mode_key, p),
            roots,
            cert: cert.map(PathBuf::from),
            key: key.map(PathBuf::from),
            negotiation,
            channel_binding,
        };
        settings.check_files(&mode_key, p);
        settings.check_needs_tls(&keys, p);
        if problems.is_empty() {
            Ok(settings)
        } else {
            Err(problems)
        }
    }

    /// What the roots and the client certificate ask of the mode and of
    /// each other.
    fn check_files(&self, mode_key: &str, problems: &mut Vec<(String, String)>) {
        let mode = self.mode;
        if mode.verifies() && self.roots.is_none() {
            problems.push((
                "postgres.ssl_root_cert".into(),
                format!(
                    "sslmode {mode} checks the server's certificate and needs the CA that signed it: \
                     set postgres.ssl_root_cert to its PEM file (or \"system\" for the operating system's trust store)"
                ),
            ));
        }
        match (&self.cert, &self.key) {
            (Some(_), None) => problems.push((
                "postgres.ssl_key".into(),
                "postgres.ssl_cert is set: also set the client certificate's private key".into(),
            )),
            (None, Some(_)) => problems.push((
                "postgres.ssl_cert".into(),
                "postgres.ssl_key is set: also set the client certificate it belongs to".into(),
            )),
            _ => {}
        }
        if mode == SslMode::Disable && (self.cert.is_some() || self.roots.is_some()) {
            problems.push((
                mode_key.to_owned(),
                "sslmode disable sends no certificate and checks none: remove ssl_root_cert/ssl_cert, \
                 or choose a mode that uses TLS"
                    .into(),
            ));
        }
    }

    /// Direct TLS and a required channel binding need TLS, as in libpq.
    fn check_needs_tls(&self, keys: &KeyValues<'_>, problems: &mut Vec<(String, String)>) {
        let mode = self.mode;
        if self.negotiation == SslNegotiation::Direct
            && !keys.unix_socket
            && matches!(mode, SslMode::Disable | SslMode::Prefer)
        {
            problems.push((
                key_of("ssl_negotiation", keys.ssl_negotiation.is_some()),
                format!(
                    "weak sslmode \"{mode}\" may not be used with sslnegotiation=direct \
                     (use \"require\", \"verify-ca\", or \"verify-full\")"
                ),
            ));
        }
        if self.channel_binding != ChannelBindingMode::Require {
            return;
        }
        let without_tls = if keys.unix_socket {
            Some("the URL names a unix socket, where TLS does not apply")
        } else if mode == SslMode::Disable {
            Some("sslmode is disable")
        } else {
            None
        };
        if let Some(why) = without_tls {
            problems.push((
                key_of("channel_binding", keys.channel_binding.is_some()),
                format!(
                    "channel_binding require binds the login to the server's TLS certificate, \
                     and {why}: connect over TCP with sslmode verify-full, or set channel_binding prefer"
                ),
            ));
        }
    }
}

/// The value of one TLS setting, from the URL's `param` or the key
/// `postgres.{key}`; given both ways, they must agree.
fn pick(
    problems: &mut Vec<(String, String)>,
    key: &str,
    param: &str,
    from_url: Option<&str>,
    from_key: Option<&str>,
) -> Option<String> {
    match (from_url, from_key) {
        (Some(u), Some(k)) if u != k => {
            problems.push((
                format!("postgres.{key}"),
                format!("{k:?} disagrees with {param}={u:?} in postgres.url; set it in one place"),
            ));
            None
        }
        (u, k) => k.or(u).map(str::to_owned),
    }
}

/// The key a problem with a value names: the one it was set with.
fn key_of(key: &str, set_as_key: bool) -> String {
    if set_as_key {
        format!("postgres.{key}")
    } else {
        "postgres.url".to_owned()
    }
}

/// `value` parsed; a value that does not parse is a problem of `key`.
fn parsed<T: FromStr<Err = String>>(
    key: String,
    value: Option<String>,
    problems: &mut Vec<(String, String)>,
) -> Option<T> {
    match value.as_deref().map(str::parse) {
        None => None,
        Some(Ok(value)) => Some(value),
        Some(Err(message)) => {
            problems.push((key, message));
            None
        }
    }
}

/// The mode libpq would use: `sslrootcert=system` makes it verify-full and
/// refuses anything weaker; `require` with a root certificate checks the
/// chain (verify-ca).
fn effective_mode(
    given: Option<SslMode>,
    roots: Option<&Roots>,
    mode_key: &str,
    problems: &mut Vec<(String, String)>,
) -> SslMode {
    match (given, roots) {
        // The public roots check the host name, or they check nothing worth having.
        (None, Some(Roots::System)) => SslMode::VerifyFull,
        (Some(mode), Some(Roots::System)) if mode != SslMode::VerifyFull => {
            problems.push((
                mode_key.to_owned(),
                format!(
                    "weak sslmode \"{mode}\" may not be used with sslrootcert=system (use \"verify-full\"): \
                     any public CA signs certificates for any name, so only the host name check makes \
                     them mean something"
                ),
            ));
            mode
        }
        (Some(SslMode::Require), Some(Roots::File(_))) => SslMode::VerifyCa,
        (mode, _) => mode.unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(url: &str, keys: KeyValues<'_>) -> Result<TlsSettings, Vec<(String, String)>> {
        TlsSettings::resolve(&split_url(url).1, keys)
    }

    #[test]
    fn the_url_keeps_what_tokio_postgres_knows() {
        let (rest, tls) = split_url(
            "postgres://u@h/db?application_name=x&sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&connect_timeout=3",
        );
        assert_eq!(
            rest,
            "postgres://u@h/db?application_name=x&connect_timeout=3"
        );
        assert_eq!(tls.sslmode.as_deref(), Some("verify-full"));
        assert_eq!(tls.sslrootcert.as_deref(), Some("/etc/ca.pem"));
        let (rest, tls) = split_url("postgres://u@h/db?sslmode=require");
        assert_eq!(rest, "postgres://u@h/db");
        assert_eq!(tls.sslmode.as_deref(), Some("require"));
        assert_eq!(split_url("postgres://u@h/db").0, "postgres://u@h/db");
    }

    #[test]
    fn modes_parse_like_libpq() {
        for (text, mode) in [
            ("disable", SslMode::Disable),
            ("prefer", SslMode::Prefer),
            ("require", SslMode::Require),
            ("verify-ca", SslMode::VerifyCa),
            ("verify-full", SslMode::VerifyFull),
        ] {
            assert_eq!(text.parse::<SslMode>(), Ok(mode));
            assert_eq!(mode.to_string(), text);
        }
        assert!("allow".parse::<SslMode>().unwrap_err().contains("prefer"));
        assert!("verify_full"
            .parse::<SslMode>()
            .unwrap_err()
            .contains("verify-full"));
        assert_eq!(
            resolve("postgres://u@h/db", KeyValues::default())
                .unwrap()
                .mode,
            SslMode::Prefer
        );
    }

    #[test]
    fn verifying_needs_a_ca_and_a_certificate_needs_its_key() {
        let problems = resolve(
            "postgres://u@h/db?sslmode=verify-full",
            KeyValues::default(),
        )
        .unwrap_err();
        assert_eq!(problems[0].0, "postgres.ssl_root_cert");
        assert!(problems[0].1.contains("needs the CA"), "{problems:?}");

        let ok = resolve(
            "postgres://u@h/db",
            KeyValues {
                ssl_mode: Some("verify-full"),
                ssl_root_cert: Some("system"),
                ..KeyValues::default()
            },
        )
        .unwrap();
        assert_eq!(ok.roots, Some(Roots::System));

        let cert = Path::new("/c.pem");
        let problems = resolve(
            "postgres://u@h/db",
            KeyValues {
                ssl_cert: Some(cert),
                ..KeyValues::default()
            },
        )
        .unwrap_err();
        assert_eq!(problems[0].0, "postgres.ssl_key");
    }

    #[test]
    fn the_url_and_the_keys_must_agree() {
        let problems = resolve(
            "postgres://u@h/db?sslmode=require",
            KeyValues {
                ssl_mode: Some("disable"),
                ..KeyValues::default()
            },
        )
        .unwrap_err();
        assert_eq!(problems[0].0, "postgres.ssl_mode");
        assert!(problems[0].1.contains("disagrees"), "{problems:?}");
        // The same value twice is fine; a key alone wins over nothing.
        let same = resolve(
            "postgres://u@h/db?sslmode=require",
            KeyValues {
                ssl_mode: Some("require"),
                ..KeyValues::default()
            },
        )
        .unwrap();
        assert_eq!(same.mode, SslMode::Require);
        let bad = resolve("postgres://u@h/db?sslmode=bogus", KeyValues::default()).unwrap_err();
        assert_eq!(bad[0].0, "postgres.url");
    }

    #[test]
    fn require_with_a_root_certificate_checks_the_chain_as_in_libpq() {
        let settings = resolve(
            "postgres://u@h/db?sslmode=require&sslrootcert=/etc/ca.pem",
            KeyValues::default(),
        )
        .unwrap();
        assert_eq!(settings.mode, SslMode::VerifyCa);
        assert_eq!(percent_decode("/etc/ca+bundle.pem"), "/etc/ca+bundle.pem");
    }

    #[test]
    fn system_roots_mean_verify_full_and_refuse_weaker_modes_naming_the_key() {
        // The default, and `require` promoted (as it is to verify-ca with a file).
        for url in [
            "postgres://u@h/db?sslrootcert=system",
            "postgres://u@h/db?sslrootcert=system&sslmode=verify-full",
        ] {
            let settings = resolve(url, KeyValues::default()).unwrap();
            assert_eq!(settings.mode, SslMode::VerifyFull, "{url}");
            assert_eq!(settings.roots, Some(Roots::System));
        }
        let keys = resolve(
            "postgres://u@h/db",
            KeyValues {
                ssl_root_cert: Some("system"),
                ..KeyValues::default()
            },
        )
        .unwrap();
        assert_eq!(keys.mode, SslMode::VerifyFull);
        for weak in ["disable", "prefer", "require", "verify-ca"] {
            let problems = resolve(
                &format!("postgres://u@h/db?sslmode={weak}&sslrootcert=system"),
                KeyValues::default(),
            )
            .unwrap_err();
            assert_eq!(problems[0].0, "postgres.url", "{weak}: {problems:?}");
            assert!(
                problems[0].1.starts_with(&format!(
                    "weak sslmode \"{weak}\" may not be used with sslrootcert=system (use \"verify-full\")"
                )),
                "{problems:?}"
            );
            let problems = resolve(
                "postgres://u@h/db",
                KeyValues {
                    ssl_mode: Some(weak),
                    ssl_root_cert: Some("system"),
                    ..KeyValues::default()
                },
            )
            .unwrap_err();
            assert_eq!(problems[0].0, "postgres.ssl_mode", "{weak}: {problems:?}");
        }
    }

    #[test]
    fn channel_binding_and_direct_tls_parse_like_libpq_and_need_tls() {
        let settings = resolve(
            "postgres://u@h/db?channel_binding=require&sslnegotiation=direct&sslmode=verify-full&sslrootcert=/ca.pem",
            KeyValues::default(),
        )
        .unwrap();
        assert_eq!(settings.channel_binding, ChannelBindingMode::Require);
        assert_eq!(settings.negotiation, SslNegotiation::Direct);
        let (rest, _) =
            split_url("postgres://u@h/db?channel_binding=require&sslnegotiation=direct");
        assert_eq!(
            rest, "postgres://u@h/db",
            "tokio-postgres gets them from the relay"
        );
        let defaults = resolve("postgres://u@h/db", KeyValues::default()).unwrap();
        assert_eq!(defaults.channel_binding, ChannelBindingMode::Prefer);
        assert_eq!(defaults.negotiation, SslNegotiation::Postgres);

        let problems = resolve(
            "postgres://u@h/db?channel_binding=require",
            KeyValues {
                channel_binding: Some("prefer"),
                ..KeyValues::default()
            },
        )
        .unwrap_err();
        assert_eq!(problems[0].0, "postgres.channel_binding");
        assert!(problems[0].1.contains("disagrees"), "{problems:?}");
        let problems = resolve(
            "postgres://u@h/db",
            KeyValues {
                channel_binding: Some("always"),
                ssl_negotiation: Some("sometimes"),
                ..KeyValues::default()
            },
        )
        .unwrap_err();
        let keys: Vec<&str> = problems.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            keys,
            ["postgres.ssl_negotiation", "postgres.channel_binding"]
        );

        // `require` without TLS: refused at start-up, naming the key.
        let problems = resolve(
            "postgres://u@h/db?sslmode=disable",
            KeyValues {
                channel_binding: Some("require"),
                ..KeyValues::default()
            },
        )
        .unwrap_err();
        assert_eq!(problems[0].0, "postgres.channel_binding");
        assert!(problems[0].1.contains("sslmode is disable"), "{problems:?}");
        let problems = resolve(
            "postgres://u@h/db?channel_binding=require",
            KeyValues {
                unix_socket: true,
                ..KeyValues::default()
            },
        )
        .unwrap_err();
        assert_eq!(problems[0].0, "postgres.url");
        assert!(problems[0].1.contains("unix socket"), "{problems:?}");

        // Direct TLS needs a mode that insists on TLS, as in libpq.
        for weak in ["disable", "prefer"] {
            let problems = resolve(
                &format!("postgres://u@h/db?sslmode={weak}"),
                KeyValues {
                    ssl_negotiation: Some("direct"),
                    ..KeyValues::default()
                },
            )
            .unwrap_err();
            assert_eq!(problems[0].0, "postgres.ssl_negotiation");
            assert!(
                problems[0].1.starts_with(&format!(
                    "weak sslmode \"{weak}\" may not be used with sslnegotiation=direct"
                )),
                "{problems:?}"
            );
        }
        // Over a unix socket there is no TLS to start.
        resolve(
            "postgres://u@h/db?sslnegotiation=direct",
            KeyValues {
                unix_socket: true,
                ..KeyValues::default()
            },
        )
        .unwrap();
    }
}
