//! TLS to Postgres, the same on both connections.
//!
//! The settings come from libpq's URL parameters (`sslmode`, `sslrootcert`,
//! `sslcert`, `sslkey`) or from `[postgres] ssl_mode`, `ssl_root_cert`,
//! `ssl_cert`, `ssl_key`; a value given both ways must agree. The modes mean
//! what they mean to libpq:
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
//! apply to unix sockets. `verify-ca` and `verify-full` need `ssl_root_cert`: a PEM file with the CA
//! that signed the server's certificate, or `system` for the public web PKI
//! roots (Mozilla's list, compiled in). Unlike libpq there is no implicit
//! `~/.postgresql/root.crt`: a verifying mode without a CA is refused at
//! start-up rather than quietly trusting something.
//!
//! The ordinary connection is tokio-postgres with the [`MakeRustls`]
//! connector below; the replication connection ([`crate::walstream`])
//! negotiates TLS with the same connector ([`negotiate`]). Both use rustls
//! with the `ring` provider.
//!
//! Certificate problems are fatal and explained ([`explain`]): a wrong CA, a
//! name mismatch or an expired certificate does not heal by retrying.

use std::fmt;
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};

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

/// Where the trusted CAs come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Roots {
    /// The public web PKI roots (`ssl_root_cert = "system"`).
    Public,
    /// A PEM file.
    File(PathBuf),
}

impl Roots {
    fn parse(value: &str) -> Roots {
        if value == "system" {
            Roots::Public
        } else {
            Roots::File(PathBuf::from(value))
        }
    }

    fn describe(&self) -> String {
        match self {
            Roots::Public => "the public web PKI roots (ssl_root_cert = \"system\")".into(),
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
}

/// The TLS parameters of a Postgres URL, which tokio-postgres does not know.
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
}

/// Take the TLS parameters out of `url`: the URL without them, and them.
pub fn split_url(url: &str) -> (String, UrlTls) {
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
}

impl TlsSettings {
    /// Merge the URL's parameters with the `[postgres]` keys. Errors name the key.
    pub fn resolve(
        url: &UrlTls,
        keys: KeyValues<'_>,
    ) -> Result<TlsSettings, Vec<(String, String)>> {
        let mut problems = Vec::new();
        let mut pick = |key: &str, param: &str, from_url: Option<&str>, from_key: Option<&str>| {
            match (from_url, from_key) {
                (Some(u), Some(k)) if u != k => {
                    problems.push((
                        format!("postgres.{key}"),
                        format!(
                            "{k:?} disagrees with {param}={u:?} in postgres.url; set it in one place"
                        ),
                    ));
                    None
                }
                (u, k) => k.or(u).map(str::to_owned),
            }
        };
        let mode = pick("ssl_mode", "sslmode", url.sslmode.as_deref(), keys.ssl_mode);
        let roots = pick(
            "ssl_root_cert",
            "sslrootcert",
            url.sslrootcert.as_deref(),
            keys.ssl_root_cert,
        );
        let cert = pick(
            "ssl_cert",
            "sslcert",
            url.sslcert.as_deref(),
            keys.ssl_cert.and_then(Path::to_str),
        );
        let key = pick(
            "ssl_key",
            "sslkey",
            url.sslkey.as_deref(),
            keys.ssl_key.and_then(Path::to_str),
        );
        let mode_key = if keys.ssl_mode.is_some() {
            "postgres.ssl_mode"
        } else {
            "postgres.url"
        };
        let mode = match mode.as_deref().map(SslMode::from_str) {
            None => SslMode::default(),
            Some(Ok(mode)) => mode,
            Some(Err(message)) => {
                problems.push((mode_key.into(), message));
                SslMode::default()
            }
        };
        // As libpq: `require` with a root certificate checks the chain (verify-ca).
        let mode = if mode == SslMode::Require && roots.is_some() {
            SslMode::VerifyCa
        } else {
            mode
        };
        let settings = TlsSettings {
            mode,
            roots: roots.as_deref().map(Roots::parse),
            cert: cert.map(PathBuf::from),
            key: key.map(PathBuf::from),
        };
        if mode.verifies() && settings.roots.is_none() {
            problems.push((
                "postgres.ssl_root_cert".into(),
                format!(
                    "sslmode {mode} checks the server's certificate and needs the CA that signed it: \
                     set postgres.ssl_root_cert to its PEM file (or \"system\" for the public web PKI roots)"
                ),
            ));
        }
        match (&settings.cert, &settings.key) {
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
        if mode == SslMode::Disable && (settings.cert.is_some() || settings.roots.is_some()) {
            problems.push((
                "postgres.ssl_mode".into(),
                "sslmode disable sends no certificate and checks none: remove ssl_root_cert/ssl_cert, \
                 or choose a mode that uses TLS"
                    .into(),
            ));
        }
        if problems.is_empty() {
            Ok(settings)
        } else {
            Err(problems)
        }
    }

    /// The connector of both connections; `None` for `disable`.
    /// Reads the PEM files now, so a bad one fails at start-up naming its key.
    pub fn connector(&self) -> Result<Option<MakeRustls>, (String, String)> {
        if self.mode == SslMode::Disable {
            return Ok(None);
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = RootCertStore::empty();
        match &self.roots {
            Some(Roots::File(path)) => {
                let certs = read_certs(path).map_err(|m| ("postgres.ssl_root_cert".into(), m))?;
                let (added, _) = roots.add_parsable_certificates(certs);
                if added == 0 {
                    return Err((
                        "postgres.ssl_root_cert".into(),
                        format!("{}: no usable CA certificate in it", path.display()),
                    ));
                }
            }
            Some(Roots::Public) | None => {
                roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
            }
        }
        let roots = Arc::new(roots);
        let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|e| ("postgres.ssl_mode".into(), format!("TLS set-up: {e}")))?
            .with_root_certificates(Arc::clone(&roots));
        let mut config = match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                let chain = read_certs(cert).map_err(|m| ("postgres.ssl_cert".into(), m))?;
                if chain.is_empty() {
                    return Err((
                        "postgres.ssl_cert".into(),
                        format!("{}: no certificate in it", cert.display()),
                    ));
                }
                let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| {
                    (
                        "postgres.ssl_key".into(),
                        format!("{}: not a readable PEM private key: {e}", key.display()),
                    )
                })?;
                builder.with_client_auth_cert(chain, key_der).map_err(|e| {
                    (
                        "postgres.ssl_key".into(),
                        format!("does not fit postgres.ssl_cert: {e}"),
                    )
                })?
            }
            _ => builder.with_no_client_auth(),
        };
        if !self.mode.verifies() || self.mode == SslMode::VerifyCa {
            let inner = WebPkiServerVerifier::builder_with_provider(roots, provider)
                .build()
                .map_err(|e| ("postgres.ssl_root_cert".into(), format!("TLS set-up: {e}")))?;
            config
                .dangerous()
                .set_certificate_verifier(Arc::new(Lenient {
                    inner,
                    check_chain: self.mode.verifies(),
                }));
        }
        Ok(Some(MakeRustls {
            config: Arc::new(config),
            settings: Arc::new(self.clone()),
        }))
    }
}

/// The certificates of a PEM file.
pub(crate) fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| {
            format!(
                "{}: not a readable PEM certificate file: {e}",
                path.display()
            )
        })
}

/// Why a TLS connection failed, in words that say what to do.
///
/// `detail` is the TLS library's error text (rustls names the certificate
/// error, e.g. `UnknownIssuer`); the same words come out for both connections.
pub fn explain(detail: &str, settings: &TlsSettings, host: &str) -> String {
    let roots = settings
        .roots
        .as_ref()
        .map_or_else(|| "the trusted roots".to_owned(), Roots::describe);
    let what = if detail.contains("UnknownIssuer") || detail.contains("BadSignature") {
        format!(
            "the server's certificate is not signed by a CA in {roots}; \
             point postgres.ssl_root_cert at the CA that signed the server's certificate"
        )
    } else if detail.contains("NotValidForName") || detail.contains("not valid for name") {
        format!(
            "the server's certificate is not valid for the host name {host:?} (sslmode verify-full); \
             connect by a name the certificate holds, or use sslmode verify-ca"
        )
    } else if ["Expired", "NotValidYet", "expired", "not valid yet"]
        .iter()
        .any(|s| detail.contains(s))
    {
        "the server's certificate is outside its validity period (or this machine's clock is wrong)"
            .to_owned()
    } else if detail.contains("does not support TLS") || detail.contains("server does not support")
    {
        format!(
            "the server does not accept TLS (is ssl = on?); sslmode {} needs it",
            settings.mode
        )
    } else if detail.contains("CertificateRequired") || detail.contains("certificate required") {
        "the server wants a client certificate: set postgres.ssl_cert and postgres.ssl_key"
            .to_owned()
    } else if [
        "UnknownCA",
        "BadCertificate",
        "CertificateUnknown",
        "AccessDenied",
    ]
    .iter()
    .any(|s| detail.contains(s))
    {
        "the server did not accept the client certificate (postgres.ssl_cert): \
         is it signed by a CA in the server's ssl_ca_file?"
            .to_owned()
    } else {
        "the TLS handshake failed".to_owned()
    };
    format!("TLS (sslmode {}): {what} ({detail})", settings.mode)
}

/// Whether a TLS failure needs a person (a certificate problem), rather than
/// a retry (the connection broke during the handshake).
pub fn is_certificate_problem(detail: &str) -> bool {
    [
        "invalid peer certificate",
        "does not support TLS",
        "server does not support",
        "CertificateRequired",
        "certificate required",
        "UnknownCA",
        "BadCertificate",
        "TLS config error",
        // With TLS 1.3 the server judges the client certificate after the
        // handshake: its alert arrives with the first read.
        "fatal alert: UnknownCA",
        "fatal alert: BadCertificate",
        "fatal alert: CertificateRequired",
        "fatal alert: CertificateUnknown",
        "fatal alert: CertificateExpired",
        "fatal alert: AccessDenied",
    ]
    .iter()
    .any(|s| detail.contains(s))
}

/// Checks the chain only (`verify-ca`) or nothing (`prefer`, `require`).
#[derive(Debug)]
struct Lenient {
    inner: Arc<WebPkiServerVerifier>,
    check_chain: bool,
}

impl ServerCertVerifier for Lenient {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if !self.check_chain {
            return Ok(ServerCertVerified::assertion());
        }
        match self
            .inner
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// tokio-postgres's TLS connector, on rustls; [`negotiate`] uses it for the replication connection.
#[derive(Clone)]
pub struct MakeRustls {
    config: Arc<ClientConfig>,
    settings: Arc<TlsSettings>,
}

impl<S> MakeTlsConnect<S> for MakeRustls
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type TlsConnect = RustlsConnect;
    type Error = TlsError;

    fn make_tls_connect(&mut self, domain: &str) -> Result<RustlsConnect, TlsError> {
        let name = ServerName::try_from(domain.to_owned()).map_err(|_| TlsError {
            message: format!("TLS: {domain:?} is not a valid host name for TLS"),
            fatal: true,
        })?;
        Ok(RustlsConnect {
            config: Arc::clone(&self.config),
            settings: Arc::clone(&self.settings),
            host: domain.to_owned(),
            name,
        })
    }
}

impl fmt::Debug for MakeRustls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MakeRustls")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

/// One connection's TLS handshake.
pub struct RustlsConnect {
    config: Arc<ClientConfig>,
    settings: Arc<TlsSettings>,
    host: String,
    name: ServerName<'static>,
}

impl<S> TlsConnect<S> for RustlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type Error = TlsError;
    type Future = Pin<Box<dyn Future<Output = Result<RustlsStream<S>, TlsError>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        Box::pin(async move {
            tokio_rustls::TlsConnector::from(self.config)
                .connect(self.name, stream)
                .await
                .map(|s| RustlsStream(Box::new(s)))
                .map_err(|e| {
                    let detail = e.to_string();
                    TlsError {
                        fatal: is_certificate_problem(&detail),
                        message: explain(&detail, &self.settings, &self.host),
                    }
                })
        })
    }
}

/// Ask the server for TLS on `tcp` (SSLRequest) and negotiate it with the
/// ordinary connection's settings: the replication connection is encrypted
/// and checked exactly as the ordinary one, and its failures explained in the
/// same words. A server that declines gives the plain stream back, unless
/// TLS is `required` (every mode but `prefer`).
pub async fn negotiate(
    connector: &MakeRustls,
    mut tcp: tokio::net::TcpStream,
    host: &str,
    required: bool,
) -> Result<Result<RustlsStream<tokio::net::TcpStream>, tokio::net::TcpStream>, TlsError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let broken = |e: io::Error| TlsError {
        message: format!("TLS negotiation with {host}: {e}"),
        fatal: false,
    };
    // SSLRequest: length 8, code 80877103.
    tcp.write_all(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f])
        .await
        .map_err(broken)?;
    let mut answer = [0u8; 1];
    tcp.read_exact(&mut answer).await.map_err(broken)?;
    match answer[0] {
        b'S' => {}
        b'N' if !required => return Ok(Err(tcp)),
        b'N' => {
            return Err(TlsError {
                message: explain("server does not support TLS", &connector.settings, host),
                fatal: true,
            })
        }
        other => {
            return Err(TlsError {
                message: format!(
                    "TLS negotiation with {host}: the server answered {:?} to the TLS request",
                    other as char
                ),
                fatal: false,
            })
        }
    }
    let tls =
        MakeTlsConnect::<tokio::net::TcpStream>::make_tls_connect(&mut connector.clone(), host)?;
    TlsConnect::connect(tls, tcp).await.map(Ok)
}

/// A TLS failure of either connection.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct TlsError {
    /// What happened and what to do.
    pub message: String,
    /// A certificate problem (retrying will not help).
    pub fatal: bool,
}

impl TlsError {
    /// The TLS failure behind a tokio-postgres error, if that is what it is.
    pub fn behind(error: &tokio_postgres::Error) -> Option<&TlsError> {
        std::error::Error::source(error).and_then(|s| s.downcast_ref::<TlsError>())
    }
}

/// An encrypted connection, ordinary or replication.
pub struct RustlsStream<S>(Box<tokio_rustls::client::TlsStream<S>>);

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for RustlsStream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for RustlsStream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> TlsStream for RustlsStream<S> {
    fn channel_binding(&self) -> ChannelBinding {
        // SCRAM works without it (channel_binding=prefer); tls-server-end-point
        // would need the certificate's signature hash, which we do not parse.
        ChannelBinding::none()
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
                ssl_mode: Some("verify-ca"),
                ssl_root_cert: Some("system"),
                ..KeyValues::default()
            },
        )
        .unwrap();
        assert_eq!(ok.roots, Some(Roots::Public));

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
    fn explanations_say_what_to_do() {
        let settings = TlsSettings {
            mode: SslMode::VerifyFull,
            roots: Some(Roots::File("/etc/ca.pem".into())),
            ..TlsSettings::default()
        };
        let text = explain("invalid peer certificate: UnknownIssuer", &settings, "db");
        assert!(text.contains("not signed by a CA in /etc/ca.pem"), "{text}");
        assert!(is_certificate_problem(
            "invalid peer certificate: UnknownIssuer"
        ));
        let text = explain("invalid peer certificate: NotValidForName", &settings, "db");
        assert!(text.contains("verify-ca"), "{text}");
        assert!(!is_certificate_problem("connection reset by peer"));
    }
}
