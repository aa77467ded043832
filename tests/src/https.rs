//! An HTTPS front for a plain-HTTP endpoint (moto): it terminates TLS with a
//! [`crate::TestPki`] server certificate (for `localhost`) and relays the
//! bytes both ways, so a client can be tested against a real TLS endpoint.
//! And [`ConnectProxy`], a forward proxy that only tunnels (`CONNECT`), as
//! corporate proxies in front of AWS do.
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

use std::sync::{Arc, Mutex, PoisonError};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
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

/// A tunnel's target (`host:port`) and `Proxy-Authorization` value.
pub type Tunnel = (String, Option<String>);

/// A forward proxy on `127.0.0.1:<free port>` that answers `CONNECT
/// host:port` with a tunnel (and anything else with 405), recording each
/// tunnel's target and `Proxy-Authorization` header.
pub struct ConnectProxy {
    port: u16,
    tunnels: Arc<Mutex<Vec<Tunnel>>>,
    task: tokio::task::JoinHandle<()>,
}

impl ConnectProxy {
    /// Start it. Panics when nothing can listen.
    pub async fn start() -> ConnectProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("listen");
        let port = listener.local_addr().expect("local address").port();
        let tunnels = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&tunnels);
        let task = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let seen = Arc::clone(&seen);
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    while !head.ends_with(b"\r\n\r\n") && head.len() < 16 * 1024 {
                        let Ok(byte) = client.read_u8().await else {
                            return;
                        };
                        head.push(byte);
                    }
                    let head = String::from_utf8_lossy(&head).into_owned();
                    let mut lines = head.lines();
                    let request = lines.next().unwrap_or_default().to_owned();
                    let authorization = lines
                        .filter_map(|l| l.split_once(':'))
                        .find(|(name, _)| name.eq_ignore_ascii_case("proxy-authorization"))
                        .map(|(_, value)| value.trim().to_owned());
                    let mut words = request.split_whitespace();
                    let (Some("CONNECT"), Some(target)) = (words.next(), words.next()) else {
                        let _ = client
                            .write_all(
                                b"HTTP/1.1 405 Method Not Allowed\r\ncontent-length: 0\r\n\r\n",
                            )
                            .await;
                        return;
                    };
                    seen.lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push((target.to_owned(), authorization));
                    let Ok(mut server) = TcpStream::connect(target).await else {
                        let _ = client.write_all(b"HTTP/1.1 502 Bad Gateway\r\n\r\n").await;
                        return;
                    };
                    if client
                        .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                        .await
                        .is_err()
                    {
                        return;
                    }
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                });
            }
        });
        ConnectProxy {
            port,
            tunnels,
            task,
        }
    }

    /// `http://127.0.0.1:PORT`, for `HTTPS_PROXY`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The tunnels opened so far: target and `Proxy-Authorization` value.
    pub fn tunnels(&self) -> Vec<Tunnel> {
        self.tunnels
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Drop for ConnectProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}
