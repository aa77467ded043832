//! A silent peer is noticed: bounds on how long a connection to Postgres may
//! stay quiet while the relay waits on it (`postgres.receive_timeout`, `T`).
//!
//! A half-open connection (a NAT or load balancer that dropped the flow, a
//! frozen host, a proxy that stopped forwarding) sends no FIN and no RST: the
//! socket stays open and reads simply never return. Three bounds end it:
//!
//! * **The replication stream** ([`crate::pipeline::stream`]): when nothing has
//!   arrived for a while, the loop's status updates ask for a reply (a
//!   healthy walsender answers at once with a keepalive); when nothing has
//!   arrived for `T / 2`, `/readyz` fails; for `T`, the session ends and a
//!   new one starts. An
//!   idle walsender that has been told everything is confirmed sends nothing
//!   on its own, so the question is what keeps a quiet stream alive. (The
//!   question is asked from two status intervals of quiet on: a walsender
//!   busy decoding a large transaction of other tables reads its client only
//!   every `wal_sender_timeout / 2`, and its answer must still come within
//!   `T`; so `T` should be at least `wal_sender_timeout`, and the relay warns
//!   when it is not.)
//! * **Lock waits** are silence too: every SQL session of the relay runs with
//!   `lock_timeout = T / 2`, so a statement behind a lock ends with an error
//!   (55P03, retried) before the bound takes its connection for dead.
//! * **SQL connections** ([`Watched`]): a request written and not answered
//!   within `T` fails the connection's next read; tokio-postgres then closes
//!   the connection and every waiting query fails, and the worker (marking,
//!   recording, poller, monitor, retention) opens a new one as after any
//!   lost connection.
//! * **TCP** ([`tune`]): keepalive probes after `T / 4` of idleness, every
//!   `T / 8`; and, on Linux, `TCP_USER_TIMEOUT = T`, so data or probes the
//!   peer does not acknowledge end the connection about `T` after its last
//!   acknowledgement (Linux then ignores the probe count), even while the
//!   relay only writes (a paused stream still sends its status updates).
//!
//! None of them acknowledges anything: what was in flight is sent again by
//! the next session, as after any lost connection.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

/// How long opening a socket to Postgres may take (each host of the URL,
/// on both connections).
pub(crate) const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// Keepalive probes sent before the kernel gives up on a peer.
const KEEPALIVE_PROBES: u32 = 3;

/// Set TCP keepalive and `TCP_USER_TIMEOUT` on `socket` from `timeout`
/// (nothing when it is zero).
pub(crate) fn tune(socket: &tokio::net::TcpStream, timeout: Duration) -> io::Result<()> {
    if timeout.is_zero() {
        return Ok(());
    }
    let socket = socket2::SockRef::from(socket);
    let probe = (timeout / 8).max(Duration::from_secs(1));
    socket.set_tcp_keepalive(
        &socket2::TcpKeepalive::new()
            .with_time((timeout / 4).max(Duration::from_secs(1)))
            .with_interval(probe)
            .with_retries(KEEPALIVE_PROBES),
    )?;
    #[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
    socket.set_tcp_user_timeout(Some(timeout))?;
    Ok(())
}

/// A socket on which a request written and not answered within `timeout`
/// fails the next read with [`io::ErrorKind::TimedOut`].
///
/// For request/response protocols (the SQL connection): any bytes read
/// count as the answer. Idle time with nothing asked is not bounded (TCP
/// keepalive watches that).
pub(crate) struct Watched<S> {
    inner: S,
    timeout: Duration,
    /// When the oldest request not yet answered went out.
    waiting_since: Option<Instant>,
    deadline: Option<Pin<Box<Sleep>>>,
}

impl<S> Watched<S> {
    /// Watch `inner`; a zero `timeout` watches nothing.
    pub(crate) fn new(inner: S, timeout: Duration) -> Watched<S> {
        Watched {
            inner,
            timeout,
            waiting_since: None,
            deadline: None,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                this.waiting_since = None;
                this.deadline = None;
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                let Some(since) = this.waiting_since else {
                    return Poll::Pending;
                };
                let at = since + this.timeout;
                let deadline = this
                    .deadline
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)));
                match deadline.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!(
                            "no answer from the server for {} s (postgres.receive_timeout): \
                             the connection is taken for dead",
                            this.timeout.as_secs()
                        ),
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
            other => other,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.inner).poll_write(cx, buf);
        if matches!(written, Poll::Ready(Ok(n)) if n > 0)
            && this.waiting_since.is_none()
            && !this.timeout.is_zero()
        {
            this.waiting_since = Some(Instant::now());
            // The read may have been polled already in this round, without a
            // deadline: poll again so it sets one.
            cx.waker().wake_by_ref();
        }
        written
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::UnixStream;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_request_left_unanswered_fails_the_read_and_an_answer_clears_it() {
        let (ours, mut peer) = UnixStream::pair().unwrap();
        let mut watched = Watched::new(ours, Duration::from_secs(10));
        let mut byte = [0u8; 1];

        // Nothing asked: silence is not bounded.
        assert!(
            tokio::time::timeout(Duration::from_secs(60), watched.read(&mut byte))
                .await
                .is_err(),
            "an idle connection waits"
        );

        // Asked and answered in time.
        watched.write_all(b"Q").await.unwrap();
        peer.read_exact(&mut byte).await.unwrap();
        tokio::time::sleep(Duration::from_secs(9)).await;
        peer.write_all(b"A").await.unwrap();
        watched.read_exact(&mut byte).await.unwrap();
        assert_eq!(&byte, b"A");

        // Asked, and the answer never comes.
        watched.write_all(b"Q").await.unwrap();
        let started = Instant::now();
        let error = watched.read(&mut byte).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert!(
            error.to_string().contains("postgres.receive_timeout"),
            "{error}"
        );
        assert_eq!(started.elapsed(), Duration::from_secs(10));
    }
}
