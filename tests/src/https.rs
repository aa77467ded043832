//! An HTTPS front for a plain-HTTP endpoint (moto): it terminates TLS with a
//! [`crate::TestPki`] server certificate (for `localhost`) and relays the
//! bytes both ways, so a client can be tested against a real TLS endpoint.
//!
//! ```no_run
//! use harness::{moto_endpoint, HttpsFront, TestPki};
//!
//! # async fn example() {
//! let moto = moto_endpoint().await;
//! let pki = TestPki::new();
//! let front = HttpsFront::start(&moto, &pki).await;
//! // the relay with AWS_ENDPOINT_URL=front.endpoint() and AWS_CA_BUNDLE=pki.ca()
//! # }
//! ```

use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};

/// A running front; dropping it stops it (open connections end with it).
pub struct HttpsFront {
    port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl HttpsFront {
    /// Listen on `127.0.0.1:<free port>` in front of `upstream`
    /// (`http://HOST:PORT`). Panics when the certificate cannot be read or
    /// nothing can listen.
    pub async fn start(upstream: &str, pki: &crate::TestPki) -> HttpsFront {
        let upstream = upstream
            .strip_prefix("http://")
            .unwrap_or_else(|| panic!("{upstream}: not an http:// endpoint"))
            .trim_end_matches('/')
            .to_owned();
        let (cert, key) = pki.server();
        let chain = CertificateDer::pem_file_iter(&cert)
            .and_then(|c| c.collect::<Result<Vec<_>, _>>())
            .unwrap_or_else(|e| panic!("{}: {e}", cert.display()));
        let key =
            PrivateKeyDer::from_pem_file(&key).unwrap_or_else(|e| panic!("{}: {e}", key.display()));
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .expect("the test server certificate");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("listen");
        let port = listener.local_addr().expect("local address").port();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    // A failed handshake (an untrusting client) just ends here.
                    let Ok(mut tls) = acceptor.accept(client).await else {
                        return;
                    };
                    let Ok(mut server) = TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut server).await;
                });
            }
        });
        HttpsFront { port, task }
    }

    /// `https://localhost:PORT`: the name the certificate is for.
    pub fn endpoint(&self) -> String {
        format!("https://localhost:{}", self.port)
    }
}

impl Drop for HttpsFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}
