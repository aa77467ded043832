//! A TLS front for a PostgreSQL server: it ends the client's TLS session with
//! a certificate of its own and opens its own to the server (SSLRequest, the
//! server's certificate checked against the [`crate::TestPki`] CA), then
//! relays the bytes both ways.
//!
//! With a certificate other than the server's, it is the man in the middle
//! that SCRAM channel binding exists to catch: a client that checks only the
//! chain (it is signed by the same CA, for `localhost`) logs in through it
//! unless it binds, because the server hashes its own certificate and the
//! client the front's. With the server's own certificate and
//! [`FrontStart::Direct`], it is what PostgreSQL 17 does for
//! `sslnegotiation=direct`: TLS from the first byte, ALPN `postgresql`
//! required, on a server (15) that only knows the SSLRequest.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

/// How the client starts TLS with the front.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrontStart {
    /// An SSLRequest first, answered `S` (every PostgreSQL version).
    SslRequest,
    /// TLS at once; a session without ALPN `postgresql` is closed, as
    /// PostgreSQL 17 closes it.
    Direct,
}

/// A running front; dropping it stops it.
pub struct PgTlsFront {
    port: u16,
    alpn: Arc<Mutex<Vec<Option<String>>>>,
    task: tokio::task::JoinHandle<()>,
}

const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];

impl PgTlsFront {
    /// Listen on `127.0.0.1:<free port>` in front of the server on
    /// `127.0.0.1:server_port`, presenting `cert` and `key` (PEM).
    pub async fn start(
        server_port: u16,
        pki: &crate::TestPki,
        (cert, key): (PathBuf, PathBuf),
        start: FrontStart,
    ) -> PgTlsFront {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let chain = CertificateDer::pem_file_iter(&cert)
            .and_then(|c| c.collect::<Result<Vec<_>, _>>())
            .unwrap_or_else(|e| panic!("{}: {e}", cert.display()));
        let key =
            PrivateKeyDer::from_pem_file(&key).unwrap_or_else(|e| panic!("{}: {e}", key.display()));
        let mut server = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .expect("the front's certificate");
        server.alpn_protocols = vec![b"postgresql".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));

        let mut roots = rustls::RootCertStore::empty();
        for ca in CertificateDer::pem_file_iter(pki.ca())
            .expect("the test CA")
            .map(|c| c.expect("the test CA"))
        {
            roots.add(ca).expect("the test CA");
        }
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        let connector = tokio_rustls::TlsConnector::from(Arc::new(client));

        let listener = TcpListener::bind("127.0.0.1:0").await.expect("listen");
        let port = listener.local_addr().expect("local address").port();
        let alpn = Arc::new(Mutex::new(Vec::new()));
        let task = tokio::spawn({
            let alpn = Arc::clone(&alpn);
            async move {
                while let Ok((mut client, _)) = listener.accept().await {
                    let (acceptor, connector, alpn) =
                        (acceptor.clone(), connector.clone(), Arc::clone(&alpn));
                    tokio::spawn(async move {
                        if start == FrontStart::SslRequest {
                            let mut request = [0u8; 8];
                            if client.read_exact(&mut request).await.is_err()
                                || request != SSL_REQUEST
                                || client.write_all(b"S").await.is_err()
                            {
                                return;
                            }
                        }
                        // A client that does not trust the front, or (direct)
                        // sent an SSLRequest first, ends here.
                        let Ok(mut tls) = acceptor.accept(client).await else {
                            return;
                        };
                        let agreed = tls
                            .get_ref()
                            .1
                            .alpn_protocol()
                            .map(|p| String::from_utf8_lossy(p).into_owned());
                        let missing = agreed.is_none();
                        alpn.lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .push(agreed);
                        if start == FrontStart::Direct && missing {
                            return;
                        }
                        let Ok(mut server) = TcpStream::connect(("127.0.0.1", server_port)).await
                        else {
                            return;
                        };
                        let mut answer = [0u8; 1];
                        if server.write_all(&SSL_REQUEST).await.is_err()
                            || server.read_exact(&mut answer).await.is_err()
                            || answer != *b"S"
                        {
                            return;
                        }
                        let name = ServerName::try_from("localhost").expect("a name");
                        let Ok(mut server) = connector.connect(name, server).await else {
                            return;
                        };
                        let _ = tokio::io::copy_bidirectional(&mut tls, &mut server).await;
                    });
                }
            }
        });
        PgTlsFront { port, alpn, task }
    }

    /// The port on `127.0.0.1`; the certificate names `localhost`.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The ALPN protocol agreed with each client whose TLS session the front
    /// accepted (`None`: the client offered none), in order.
    pub fn alpn(&self) -> Vec<Option<String>> {
        self.alpn
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Drop for PgTlsFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}
