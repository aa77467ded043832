//! A TCP proxy that can freeze the connections going through it: what a NAT
//! or load balancer that dropped a flow, or a frozen host, looks like to the
//! relay. A frozen connection stays open (no FIN, no RST) and nothing moves
//! through it in either direction; the proxy stops reading it too, so the
//! relay's writes only fill socket buffers. Connections opened after a
//! freeze pass as usual.
//!
//! ```no_run
//! use harness::FreezingProxy;
//!
//! let proxy = FreezingProxy::start("127.0.0.1:5432");
//! // point the relay at proxy.port() …
//! proxy.freeze(); // every connection open now goes silent, forever
//! ```

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// How often a pump looks whether it was frozen or stopped.
const TICK: Duration = Duration::from_millis(20);

/// The proxy on `127.0.0.1:<free port>`; dropping it closes every connection.
pub struct FreezingProxy {
    addr: SocketAddr,
    stopped: Arc<AtomicBool>,
    connections: Arc<Mutex<Vec<Arc<AtomicBool>>>>,
    accepted: Arc<AtomicU64>,
}

impl FreezingProxy {
    /// Forward every connection to `upstream` (`host:port`).
    pub fn start(upstream: &str) -> FreezingProxy {
        let upstream: SocketAddr = upstream.parse().expect("upstream is ip:port");
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        listener.set_nonblocking(true).expect("non-blocking accept");
        let addr = listener.local_addr().unwrap();
        let stopped = Arc::new(AtomicBool::new(false));
        let connections: Arc<Mutex<Vec<Arc<AtomicBool>>>> = Arc::default();
        let accepted = Arc::new(AtomicU64::new(0));
        std::thread::spawn({
            let (stopped, connections, accepted) = (
                Arc::clone(&stopped),
                Arc::clone(&connections),
                Arc::clone(&accepted),
            );
            move || {
                while !stopped.load(Ordering::SeqCst) {
                    let client = match listener.accept() {
                        Ok((client, _)) => client,
                        Err(e) if e.kind() == ErrorKind::WouldBlock => {
                            std::thread::sleep(TICK);
                            continue;
                        }
                        Err(_) => continue,
                    };
                    let Ok(server) = TcpStream::connect_timeout(&upstream, Duration::from_secs(5))
                    else {
                        let _ = client.shutdown(Shutdown::Both);
                        continue;
                    };
                    accepted.fetch_add(1, Ordering::SeqCst);
                    let frozen = Arc::new(AtomicBool::new(false));
                    connections
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(Arc::clone(&frozen));
                    for (from, to) in [
                        (client.try_clone().unwrap(), server.try_clone().unwrap()),
                        (server, client),
                    ] {
                        let (stopped, frozen) = (Arc::clone(&stopped), Arc::clone(&frozen));
                        std::thread::spawn(move || pump(from, to, &frozen, &stopped));
                    }
                }
            }
        });
        FreezingProxy {
            addr,
            stopped,
            connections,
            accepted,
        }
    }

    /// The port to connect to (on 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Freeze every connection open now; later ones pass.
    pub fn freeze(&self) {
        for frozen in self
            .connections
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
        {
            frozen.store(true, Ordering::SeqCst);
        }
    }

    /// Connections forwarded so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for FreezingProxy {
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::SeqCst);
    }
}

/// Copy `from` to `to` until either closes, the proxy stops, or forever
/// nothing once frozen (the sockets stay open and unread).
fn pump(mut from: TcpStream, mut to: TcpStream, frozen: &AtomicBool, stopped: &AtomicBool) {
    from.set_read_timeout(Some(TICK)).unwrap();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if stopped.load(Ordering::SeqCst) {
            break;
        }
        if frozen.load(Ordering::SeqCst) {
            std::thread::sleep(TICK);
            continue;
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            // Read while the freeze began: lost, as a dropped flow loses it.
            Ok(_) if frozen.load(Ordering::SeqCst) => {}
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => break,
        }
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}
