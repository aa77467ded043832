//! TLS to Postgres, the same on both connections: the connector that acts on
//! the settings ([`crate::config::tls`], libpq's rules: modes, roots, channel
//! binding, direct TLS).
//!
//! The ordinary connection is tokio-postgres with the [`MakeRustls`]
//! connector below; the replication connection ([`crate::postgres::walstream`])
//! negotiates TLS with the same connector ([`negotiate`]). Both use rustls
//! with the `ring` provider.
//!
//! Certificate problems are fatal and explained ([`explain`]): a wrong CA, a
//! name mismatch or an expired certificate does not heal by retrying.

use std::fmt;
use std::future::Future;
use std::io;
use std::path::Path;
use std::pin::Pin;
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

/// The settings the connector acts on; both connections name them from here.
pub(crate) use crate::config::tls::{
    ChannelBindingMode, Roots, SslMode, SslNegotiation, TlsSettings,
};

/// Both connections refuse a login without channel binding in the same
/// words, which [`crate::report::Chain`] also uses: they live with it.
pub(crate) use crate::report::channel_binding_refused;

/// Where `ssl_root_cert = "system"` found its CAs, as libpq's `system` does:
/// the operating system's trust store, read by `rustls-native-certs` (on
/// Linux the distribution's bundle, e.g. `/etc/ssl/certs/ca-certificates.crt`;
/// `SSL_CERT_FILE` and `SSL_CERT_DIR` replace it, as they do for OpenSSL).
/// Only a machine whose store is empty or unreadable (a `scratch` or
/// distroless image without CA certificates) falls back to the Mozilla list
/// compiled into the relay (`webpki-roots`). Which one was used is logged
/// once at start-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SystemRoots {
    /// CA certificates the operating system's store gave.
    OperatingSystem {
        /// How many were usable.
        certificates: usize,
    },
    /// The store had none: the bundled Mozilla list.
    Bundled {
        /// How many.
        certificates: usize,
    },
}

impl SystemRoots {
    /// Read the operating system's store once per process (it does not change
    /// under a running relay, and reading it parses a hundred-odd certificates).
    fn load() -> (Arc<RootCertStore>, SystemRoots) {
        static LOADED: std::sync::OnceLock<(Arc<RootCertStore>, SystemRoots)> =
            std::sync::OnceLock::new();
        LOADED
            .get_or_init(|| {
                let found = rustls_native_certs::load_native_certs();
                let errors: Vec<String> = found.errors.iter().map(ToString::to_string).collect();
                let (roots, source) = SystemRoots::choose(found.certs);
                match source {
                    SystemRoots::OperatingSystem { certificates } => tracing::info!(
                        certificates,
                        "postgres TLS: ssl_root_cert = \"system\" trusts the operating system's CA certificates"
                    ),
                    SystemRoots::Bundled { certificates } => tracing::warn!(
                        certificates,
                        errors = ?errors,
                        "postgres TLS: ssl_root_cert = \"system\" found no CA certificates in the operating \
                         system's trust store; trusting the Mozilla list compiled into the relay"
                    ),
                }
                (Arc::new(roots), source)
            })
            .clone()
    }

    /// The trust store from what the operating system gave, or the bundled
    /// list when it gave nothing usable.
    fn choose(native: Vec<CertificateDer<'static>>) -> (RootCertStore, SystemRoots) {
        let mut roots = RootCertStore::empty();
        let (certificates, _) = roots.add_parsable_certificates(native);
        if certificates > 0 {
            return (roots, SystemRoots::OperatingSystem { certificates });
        }
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        let certificates = roots.len();
        (roots, SystemRoots::Bundled { certificates })
    }
}

impl TlsSettings {
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
            Some(Roots::System) => {}
            // Not verifying: the store only has to be non-empty for the
            // verifier's builder, and reading the system's would be wasted.
            None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
        }
        let roots = match &self.roots {
            Some(Roots::System) => SystemRoots::load().0,
            _ => Arc::new(roots),
        };
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
        // Always offered, as libpq 17 does: direct TLS needs it, and servers
        // before 17 ignore an ALPN they do not know.
        config.alpn_protocols = vec![ALPN_POSTGRESQL.to_vec()];
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

/// The ALPN protocol of PostgreSQL's TLS (PostgreSQL 17 and later).
const ALPN_POSTGRESQL: &[u8] = b"postgresql";

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

/// What a TLS failure is, read from rustls's typed error, never its text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TlsFailure {
    /// The server's certificate does not chain to a trusted CA.
    UnknownIssuer,
    /// The server's certificate is not valid for the host name.
    WrongName,
    /// The server's certificate is expired or not yet valid.
    OutsideValidity,
    /// Another problem with the server's certificate.
    BadServerCertificate,
    /// The server asked for a client certificate and none was sent.
    ClientCertificateRequired,
    /// The server refused the client certificate (its alert).
    ClientCertificateRefused,
    /// The server declined TLS (answered 'N' to the request).
    NotOffered,
    /// The connection broke or the peer spoke something else: a retry may work.
    Broken,
}

impl TlsFailure {
    /// What `error` (or an error behind it, an I/O error's inner one
    /// included) says in rustls's types.
    pub(crate) fn of(error: &(dyn std::error::Error + 'static)) -> TlsFailure {
        let mut next = Some(error);
        while let Some(e) = next {
            if let Some(tls) = e.downcast_ref::<rustls::Error>() {
                return Self::from_rustls(tls);
            }
            if let Some(inner) = e
                .downcast_ref::<io::Error>()
                .and_then(io::Error::get_ref)
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
            {
                return Self::from_rustls(inner);
            }
            next = e.source();
        }
        TlsFailure::Broken
    }

    fn from_rustls(error: &rustls::Error) -> TlsFailure {
        use rustls::AlertDescription as A;
        match error {
            rustls::Error::InvalidCertificate(cert) => match cert {
                CertificateError::UnknownIssuer | CertificateError::BadSignature => {
                    TlsFailure::UnknownIssuer
                }
                CertificateError::NotValidForName
                | CertificateError::NotValidForNameContext { .. } => TlsFailure::WrongName,
                CertificateError::Expired
                | CertificateError::ExpiredContext { .. }
                | CertificateError::NotValidYet
                | CertificateError::NotValidYetContext { .. } => TlsFailure::OutsideValidity,
                _ => TlsFailure::BadServerCertificate,
            },
            rustls::Error::AlertReceived(A::CertificateRequired) => {
                TlsFailure::ClientCertificateRequired
            }
            rustls::Error::AlertReceived(
                A::UnknownCA
                | A::BadCertificate
                | A::CertificateUnknown
                | A::CertificateExpired
                | A::CertificateRevoked
                | A::UnsupportedCertificate
                | A::AccessDenied,
            ) => TlsFailure::ClientCertificateRefused,
            _ => TlsFailure::Broken,
        }
    }

    /// Whether a person must change something (a retry will not help).
    pub(crate) fn needs_a_person(self) -> bool {
        self != TlsFailure::Broken
    }
}

/// Why a TLS connection failed, in words that say what to do.
///
/// `failure` says what it is; `detail` is the TLS library's own text, shown
/// in parentheses. The same words come out for both connections.
pub(crate) fn explain(
    failure: TlsFailure,
    detail: &str,
    settings: &TlsSettings,
    host: &str,
) -> String {
    let roots = settings
        .roots
        .as_ref()
        .map_or_else(|| "the trusted roots".to_owned(), Roots::describe);
    let what = match failure {
        TlsFailure::UnknownIssuer => format!(
            "the server's certificate is not signed by a CA in {roots}; \
             point postgres.ssl_root_cert at the CA that signed the server's certificate"
        ),
        TlsFailure::WrongName => {
            let or = if settings.roots == Some(Roots::System) {
                // verify-ca is refused with public roots: do not suggest it.
                ""
            } else {
                ", or use sslmode verify-ca"
            };
            format!(
                "the server's certificate is not valid for the host name {host:?} (sslmode verify-full); \
                 connect by a name the certificate holds{or}"
            )
        }
        TlsFailure::OutsideValidity => {
            "the server's certificate is outside its validity period (or this machine's clock is wrong)"
                .to_owned()
        }
        TlsFailure::BadServerCertificate => {
            "the server's certificate cannot be used".to_owned()
        }
        TlsFailure::Broken if settings.negotiation == SslNegotiation::Direct => {
            "the server ended the connection at the first TLS message: with sslnegotiation direct \
             that is what PostgreSQL 16 and older do; use postgres.ssl_negotiation = \"postgres\" for them"
                .to_owned()
        }
        TlsFailure::NotOffered => format!(
            "the server does not accept TLS (is ssl = on?); sslmode {} needs it",
            settings.mode
        ),
        TlsFailure::ClientCertificateRequired => {
            "the server wants a client certificate: set postgres.ssl_cert and postgres.ssl_key"
                .to_owned()
        }
        TlsFailure::ClientCertificateRefused => {
            "the server did not accept the client certificate (postgres.ssl_cert): \
             is it signed by a CA in the server's ssl_ca_file?"
                .to_owned()
        }
        TlsFailure::Broken => "the TLS handshake failed".to_owned(),
    };
    format!("TLS (sslmode {}): {what} ({detail})", settings.mode)
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

/// A TLS handshake has succeeded in this process.
static HANDSHAKE_WORKED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

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
            let tls = tokio_rustls::TlsConnector::from(self.config)
                .connect(self.name, stream)
                .await
                .map_err(|e| {
                    let failure = TlsFailure::of(&e);
                    // With direct TLS, a server that hangs up at the first
                    // message before any handshake of this process has worked
                    // is PostgreSQL 16 or older: a setting to change, not a
                    // network blip (after one success, it is a blip).
                    let too_old = failure == TlsFailure::Broken
                        && self.settings.negotiation == SslNegotiation::Direct
                        && !HANDSHAKE_WORKED.load(std::sync::atomic::Ordering::Relaxed);
                    TlsError {
                        fatal: failure.needs_a_person() || too_old,
                        message: explain(failure, &e.to_string(), &self.settings, &self.host),
                    }
                })?;
            HANDSHAKE_WORKED.store(true, std::sync::atomic::Ordering::Relaxed);
            // As libpq 17: with direct TLS the server must have agreed to
            // speak PostgreSQL over it, or something else answered.
            if self.settings.negotiation == SslNegotiation::Direct
                && tls.get_ref().1.alpn_protocol() != Some(ALPN_POSTGRESQL)
            {
                return Err(TlsError {
                    message: format!(
                        "TLS (sslnegotiation direct): {} accepted TLS without agreeing to ALPN \"postgresql\"; \
                         it is not PostgreSQL 17 or later: set postgres.ssl_negotiation = \"postgres\"",
                        self.host
                    ),
                    fatal: true,
                });
            }
            Ok(RustlsStream(Box::new(tls)))
        })
    }
}

/// Ask the server for TLS on `tcp` (SSLRequest; with `sslnegotiation =
/// direct`, TLS at once) and negotiate it with the ordinary connection's
/// settings: the replication connection is encrypted and checked exactly as
/// the ordinary one, and its failures explained in the same words. A server
/// that declines gives the plain stream back, unless TLS is `required` (every
/// mode but `prefer`).
pub(crate) async fn negotiate(
    connector: &MakeRustls,
    mut tcp: tokio::net::TcpStream,
    host: &str,
    required: bool,
) -> Result<Result<RustlsStream<tokio::net::TcpStream>, tokio::net::TcpStream>, TlsError> {
    if !ask_for_tls(connector, &mut tcp, host, required).await? {
        return Ok(Err(tcp));
    }
    let tls =
        MakeTlsConnect::<tokio::net::TcpStream>::make_tls_connect(&mut connector.clone(), host)?;
    TlsConnect::connect(tls, tcp).await.map(Ok)
}

/// The first step of [`negotiate`], for both connections: ask for TLS
/// (SSLRequest; nothing with `sslnegotiation = direct`). Whether the TLS
/// handshake comes next (`false`: the server declined and TLS is not
/// `required`). A server that declines a required TLS is a [`TlsError`]
/// ([`TlsFailure::NotOffered`]) in the same words on both connections.
pub(crate) async fn ask_for_tls<S: AsyncRead + AsyncWrite + Unpin>(
    connector: &MakeRustls,
    stream: &mut S,
    host: &str,
    required: bool,
) -> Result<bool, TlsError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    if connector.settings.negotiation == SslNegotiation::Direct {
        return Ok(true);
    }
    let broken = |e: io::Error| TlsError {
        message: format!("TLS negotiation with {host}: {e}"),
        fatal: false,
    };
    // SSLRequest: length 8, code 80877103.
    stream
        .write_all(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f])
        .await
        .map_err(broken)?;
    let mut answer = [0u8];
    stream.read_exact(&mut answer).await.map_err(broken)?;
    match answer[0] {
        b'S' => Ok(true),
        b'N' if !required => Ok(false),
        b'N' => Err(TlsError {
            message: explain(
                TlsFailure::NotOffered,
                "the server answered N to the TLS request",
                &connector.settings,
                host,
            ),
            fatal: true,
        }),
        other => Err(TlsError {
            message: format!(
                "TLS negotiation with {host}: the server answered {:?} to the TLS request",
                other as char
            ),
            fatal: false,
        }),
    }
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

impl<S> RustlsStream<S> {
    /// The `tls-server-end-point` binding of this session's server
    /// certificate; `None` when its signature algorithm has none.
    pub fn tls_server_end_point(&self) -> Option<Vec<u8>> {
        let certificate = self.0.get_ref().1.peer_certificates()?.first()?;
        tls_server_end_point(certificate)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> TlsStream for RustlsStream<S> {
    /// tokio-postgres picks `SCRAM-SHA-256-PLUS` with this when the server
    /// offers it, unless `channel_binding` is `disable`.
    fn channel_binding(&self) -> ChannelBinding {
        match self.tls_server_end_point() {
            Some(hash) => ChannelBinding::tls_server_end_point(hash),
            None => ChannelBinding::none(),
        }
    }
}

/// The `tls-server-end-point` channel binding data of a DER certificate
/// (RFC 5929 §4.1): its hash with the hash function of its signature
/// algorithm, SHA-256 where that is MD5 or SHA-1. `None` for Ed25519 (no
/// separate hash: the server cannot compute one either) and for RSA-PSS,
/// whose hash sits in the algorithm's parameters: the server can bind those
/// (OpenSSL's `X509_get_signature_info`); the relay does not read them (that
/// takes parsing `RSASSA-PSS-params`, beyond the walk below), so under
/// `channel_binding = require` it refuses such a server.
///
/// The signature algorithm is read with a walk of three DER headers
/// (`Certificate ::= SEQUENCE { tbsCertificate, signatureAlgorithm
/// AlgorithmIdentifier, … }`) rather than an X.509 crate: that is all it
/// needs, the certificate was already parsed by the handshake, and a parser
/// (x509-parser, or x509-cert with der) would add a dependency tree for a
/// thirty-line lookup. The walk is bounds-checked and fails closed.
pub(crate) fn tls_server_end_point(certificate: &[u8]) -> Option<Vec<u8>> {
    use sha2::Digest as _;
    // The OIDs' DER contents, arc by arc.
    const RSA: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01]; // 1.2.840.113549.1.1
    const ECDSA_SHA1: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x01]; // 1.2.840.10045.4.1
    const ECDSA_SHA2: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03]; // 1.2.840.10045.4.3
    const DSA_SHA1: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x38, 0x04, 0x03]; // 1.2.840.10040.4.3
    const DSA_SHA2: &[u8] = &[0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x03]; // 2.16.840.1.101.3.4.3
    const OIW_SHA1_RSA: &[u8] = &[0x2b, 0x0e, 0x03, 0x02, 0x1d]; // 1.3.14.3.2.29
    enum Hash {
        Sha224,
        Sha256,
        Sha384,
        Sha512,
    }
    let oid = signature_algorithm(certificate)?;
    let last = |prefix: &[u8]| {
        oid.strip_prefix(prefix)
            .and_then(|rest| (rest.len() == 1).then(|| rest[0]))
    };
    let hash = if let Some(arc) = last(RSA) {
        match arc {
            4 | 5 | 11 => Hash::Sha256, // md5, sha1, sha256 WithRSAEncryption
            12 => Hash::Sha384,
            13 => Hash::Sha512,
            14 => Hash::Sha224,
            _ => return None, // 10 is RSASSA-PSS: the hash is in its parameters
        }
    } else if oid == ECDSA_SHA1 || oid == DSA_SHA1 || oid == OIW_SHA1_RSA {
        Hash::Sha256
    } else if let Some(arc) = last(ECDSA_SHA2).or_else(|| last(DSA_SHA2)) {
        match arc {
            1 => Hash::Sha224,
            2 => Hash::Sha256,
            3 => Hash::Sha384,
            4 => Hash::Sha512,
            _ => return None,
        }
    } else {
        return None;
    };
    Some(match hash {
        Hash::Sha224 => sha2::Sha224::digest(certificate).to_vec(),
        Hash::Sha256 => sha2::Sha256::digest(certificate).to_vec(),
        Hash::Sha384 => sha2::Sha384::digest(certificate).to_vec(),
        Hash::Sha512 => sha2::Sha512::digest(certificate).to_vec(),
    })
}

/// The OID (its DER contents) of a certificate's `signatureAlgorithm`.
fn signature_algorithm(certificate: &[u8]) -> Option<&[u8]> {
    const SEQUENCE: u8 = 0x30;
    const OID: u8 = 0x06;
    let (SEQUENCE, certificate, _) = der_element(certificate)? else {
        return None;
    };
    let (SEQUENCE, _tbs_certificate, rest) = der_element(certificate)? else {
        return None;
    };
    let (SEQUENCE, algorithm_identifier, _) = der_element(rest)? else {
        return None;
    };
    match der_element(algorithm_identifier)? {
        (OID, oid, _) => Some(oid),
        _ => None,
    }
}

/// One DER element of `input`: its tag, its contents, and what follows it.
fn der_element(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, mut rest) = rest.split_first()?;
    let length = if first < 0x80 {
        usize::from(first)
    } else {
        // Long form; DER has no indefinite length (0x80), and four octets
        // are more than any certificate needs.
        let octets = usize::from(first & 0x7f);
        if octets == 0 || octets > 4 || rest.len() < octets {
            return None;
        }
        let (length, tail) = rest.split_at(octets);
        rest = tail;
        length
            .iter()
            .fold(0usize, |sum, &octet| (sum << 8) | usize::from(octet))
    };
    if rest.len() < length {
        return None;
    }
    let (contents, tail) = rest.split_at(length);
    Some((tag, contents, tail))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_roots_come_from_the_operating_system_and_else_from_the_bundled_list() {
        let certificate = CertificateDer::from_pem_slice(FIXTURE_SHA256.as_bytes()).unwrap();
        let (roots, source) = SystemRoots::choose(vec![certificate]);
        assert_eq!(source, SystemRoots::OperatingSystem { certificates: 1 });
        assert_eq!(roots.len(), 1, "the bundled list is not added to it");
        let (roots, source) = SystemRoots::choose(Vec::new());
        assert_eq!(
            source,
            SystemRoots::Bundled {
                certificates: webpki_roots::TLS_SERVER_ROOTS.len()
            }
        );
        assert_eq!(roots.len(), webpki_roots::TLS_SERVER_ROOTS.len());
        // A certificate that does not parse does not count as a store.
        let (_, source) = SystemRoots::choose(vec![CertificateDer::from(vec![0x30, 0x00])]);
        assert!(matches!(source, SystemRoots::Bundled { .. }), "{source:?}");
    }

    const FIXTURE_SHA256: &str = include_str!("../../testdata/tls/p256-sha256.pem");
    const FIXTURE_SHA384: &str = include_str!("../../testdata/tls/p256-sha384.pem");
    const FIXTURE_ED25519: &str = include_str!("../../testdata/tls/ed25519.pem");

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The expected hashes are openssl's (testdata/tls/README.md).
    #[test]
    fn tls_server_end_point_hashes_with_the_signature_algorithms_hash() {
        let der = |pem: &str| CertificateDer::from_pem_slice(pem.as_bytes()).unwrap();
        assert_eq!(
            hex(&tls_server_end_point(&der(FIXTURE_SHA256)).unwrap()),
            "7ba4df8e3aaf0444efa8d236af5e059ebbc928ac93039bd72c3bb541fbda193c"
        );
        assert_eq!(
            hex(&tls_server_end_point(&der(FIXTURE_SHA384)).unwrap()),
            "3f570ac37649f16507c5bd2e91258cd14c1fbcf711720495fd912322587bc7822c45720138c3db8d06c9e740c0b7d646"
        );
        // Ed25519 has no separate hash: no binding (the server has none either).
        assert_eq!(tls_server_end_point(&der(FIXTURE_ED25519)), None);
    }

    /// A certificate shaped only as far as the walk reads it.
    fn shaped(oid: &[u8]) -> Vec<u8> {
        let mut algorithm = vec![0x30, oid.len() as u8 + 2, 0x06, oid.len() as u8];
        algorithm.extend_from_slice(oid);
        let mut body = vec![0x30, 0x00]; // an empty tbsCertificate
        body.extend_from_slice(&algorithm);
        body.extend_from_slice(&[0x03, 0x01, 0x00]); // an empty signature
        let mut certificate = vec![0x30, body.len() as u8];
        certificate.extend_from_slice(&body);
        certificate
    }

    #[test]
    fn md5_and_sha1_signatures_bind_with_sha256_and_the_rest_with_their_own_hash() {
        let rsa = |arc: u8| shaped(&[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, arc]);
        let ecdsa = |arc: u8| shaped(&[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03, arc]);
        let length = |certificate: Vec<u8>| tls_server_end_point(&certificate).map(|h| h.len());
        for (certificate, hash) in [
            (rsa(4), Some(32)),  // md5WithRSAEncryption
            (rsa(5), Some(32)),  // sha1WithRSAEncryption
            (rsa(11), Some(32)), // sha256WithRSAEncryption
            (rsa(12), Some(48)),
            (rsa(13), Some(64)),
            (rsa(14), Some(28)),
            (rsa(10), None), // RSASSA-PSS
            (
                shaped(&[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x01]),
                Some(32),
            ), // ecdsa-with-SHA1
            (ecdsa(2), Some(32)),
            (ecdsa(3), Some(48)),
            (ecdsa(4), Some(64)),
            (shaped(&[0x2b, 0x65, 0x70]), None), // Ed25519
        ] {
            assert_eq!(length(certificate.clone()), hash, "{certificate:02x?}");
        }
        let sha256 = tls_server_end_point(&rsa(5)).unwrap();
        use sha2::Digest as _;
        assert_eq!(sha256, sha2::Sha256::digest(rsa(5)).to_vec());
    }

    #[test]
    fn a_malformed_certificate_gives_no_binding_and_never_panics() {
        let good = CertificateDer::from_pem_slice(FIXTURE_SHA384.as_bytes()).unwrap();
        for end in 0..good.len() {
            // Cut anywhere, the outer length no longer fits: nothing.
            assert_eq!(tls_server_end_point(&good[..end]), None, "cut at {end}");
        }
        for bad in [
            &[0x30, 0x80, 0x00, 0x00][..],             // indefinite length
            &[0x30, 0x85, 1, 2, 3, 4, 5][..],          // a five-octet length
            &[0x31, 0x02, 0x30, 0x00][..],             // not a SEQUENCE
            &[0x30, 0x04, 0x30, 0x00, 0x30, 0x00][..], // no OID
        ] {
            assert_eq!(tls_server_end_point(bad), None, "{bad:02x?}");
        }
        let mut flipped = good.to_vec();
        for at in 0..flipped.len().min(64) {
            flipped[at] ^= 0xff;
            let _ = tls_server_end_point(&flipped);
            flipped[at] ^= 0xff;
        }
    }

    #[test]
    fn explanations_say_what_to_do() {
        let settings = TlsSettings {
            mode: SslMode::VerifyFull,
            roots: Some(Roots::File("/etc/ca.pem".into())),
            ..TlsSettings::default()
        };
        let text = explain(TlsFailure::UnknownIssuer, "UnknownIssuer", &settings, "db");
        assert!(text.contains("not signed by a CA in /etc/ca.pem"), "{text}");
        let text = explain(TlsFailure::WrongName, "NotValidForName", &settings, "db");
        assert!(text.contains("verify-ca"), "{text}");
        let system = TlsSettings {
            roots: Some(Roots::System),
            ..settings.clone()
        };
        let text = explain(TlsFailure::WrongName, "NotValidForName", &system, "db");
        assert!(!text.contains("verify-ca"), "{text}");
        let text = explain(TlsFailure::UnknownIssuer, "UnknownIssuer", &system, "db");
        assert!(
            text.contains("the operating system's trust store"),
            "{text}"
        );
    }

    /// Every class of TLS failure from rustls's types, as the handshake and
    /// the first read after it (TLS 1.3's late alerts) hand them over.
    #[test]
    fn tls_failures_are_read_from_rustls_types_not_text() {
        use rustls::AlertDescription as A;
        let cert = |e| rustls::Error::InvalidCertificate(e);
        for (error, failure) in [
            (
                cert(CertificateError::UnknownIssuer),
                TlsFailure::UnknownIssuer,
            ),
            (
                cert(CertificateError::BadSignature),
                TlsFailure::UnknownIssuer,
            ),
            (
                cert(CertificateError::NotValidForName),
                TlsFailure::WrongName,
            ),
            (cert(CertificateError::Expired), TlsFailure::OutsideValidity),
            (
                cert(CertificateError::NotValidYet),
                TlsFailure::OutsideValidity,
            ),
            (
                cert(CertificateError::Revoked),
                TlsFailure::BadServerCertificate,
            ),
            (
                rustls::Error::AlertReceived(A::CertificateRequired),
                TlsFailure::ClientCertificateRequired,
            ),
            (
                rustls::Error::AlertReceived(A::UnknownCA),
                TlsFailure::ClientCertificateRefused,
            ),
            (
                rustls::Error::AlertReceived(A::BadCertificate),
                TlsFailure::ClientCertificateRefused,
            ),
            (
                rustls::Error::AlertReceived(A::HandshakeFailure),
                TlsFailure::Broken,
            ),
            (rustls::Error::DecryptError, TlsFailure::Broken),
        ] {
            let wrapped = io::Error::new(io::ErrorKind::InvalidData, error.clone());
            assert_eq!(TlsFailure::of(&error), failure, "{error:?}");
            assert_eq!(
                TlsFailure::of(&wrapped),
                failure,
                "{error:?} in an io::Error"
            );
            assert_eq!(
                failure.needs_a_person(),
                failure != TlsFailure::Broken,
                "{failure:?}"
            );
        }
        // A message that merely mentions a certificate is not one.
        let text = io::Error::other("peer sent UnknownCA in a log line");
        assert_eq!(TlsFailure::of(&text), TlsFailure::Broken);
        assert_eq!(
            TlsFailure::of(&io::Error::from(io::ErrorKind::ConnectionReset)),
            TlsFailure::Broken
        );
    }
}
