//! Stop signals, caught from the first instant.
//!
//! The handlers are the first thing `main` installs, before it parses its
//! command line, reads its configuration, starts its runtime or connects
//! anywhere. For `run`, a SIGTERM
//! that arrives while the relay starts (an orchestrator stopping a container
//! it has just started) is then kept and honoured as a graceful stop once the
//! runtime runs; without the handlers the default action would kill the
//! process, and a supervisor would read that as a crash.
//!
//! Each signal writes one byte into a socket pair (signal-hook's
//! async-signal-safe pipe handler); [`StopSignals::watch`] reads them on the
//! runtime. The first SIGINT or SIGTERM cancels the stop token (graceful stop:
//! the final acknowledgement is sent); a second one exits at once.
//!
//! The other commands keep the default action ([`StopSignals::default_action`]):
//! a signal that came while the command line was parsed ends them then.

use std::io::{self, Read};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::io::AsyncReadExt;
use tokio_util::sync::CancellationToken;

/// Exit status after a second signal (128 + SIGINT, as a shell reports it).
const EXIT_SECOND_SIGNAL: i32 = 130;

/// SIGTERM and SIGINT, caught; read with [`StopSignals::watch`].
#[derive(Debug)]
pub(crate) struct StopSignals {
    term: UnixStream,
    int: UnixStream,
    /// Set: the signals take their default action (they end the process).
    default: Arc<AtomicBool>,
}

impl StopSignals {
    /// Record SIGTERM and SIGINT instead of dying of them, from now on.
    pub(crate) fn install() -> io::Result<StopSignals> {
        use signal_hook::consts::{SIGINT, SIGTERM};
        // signal-hook installs its handler before it publishes the action
        // the handler runs: a signal in between finds none and is lost (a
        // race signal-hook-registry documents; an orchestrator's SIGTERM
        // right at start met it). Blocked meanwhile, such a signal waits
        // and is delivered, to the action, when the mask is restored.
        let _blocked = Blocked::new(&[SIGTERM, SIGINT]);
        let (term, term_tx) = UnixStream::pair()?;
        let (int, int_tx) = UnixStream::pair()?;
        // The pipes first: the first action registered replaces the default,
        // and from then on every signal must leave its byte.
        signal_hook::low_level::pipe::register(SIGTERM, term_tx)?;
        signal_hook::low_level::pipe::register(SIGINT, int_tx)?;
        let default = Arc::new(AtomicBool::new(false));
        for signal in [SIGTERM, SIGINT] {
            signal_hook::flag::register_conditional_default(signal, Arc::clone(&default))?;
        }
        Ok(StopSignals { term, int, default })
    }

    /// Give the signals their default action back (commands other than
    /// `run`); one already received takes it now.
    pub(crate) fn default_action(self) {
        use signal_hook::consts::{SIGINT, SIGTERM};
        self.default.store(true, Ordering::SeqCst);
        for (socket, signal) in [(&self.term, SIGTERM), (&self.int, SIGINT)] {
            let mut byte = [0u8; 1];
            let received =
                socket.set_nonblocking(true).is_ok() && matches!((&*socket).read(&mut byte), Ok(1));
            if received {
                let _ = signal_hook::low_level::emulate_default_handler(signal);
            }
        }
    }

    /// Cancel `stop` on the first signal (also one that arrived before this
    /// was called); exit the process at once on a second one. Runs on a
    /// runtime.
    pub(crate) async fn watch(self, stop: CancellationToken) {
        let open = |socket: UnixStream| {
            socket.set_nonblocking(true)?;
            tokio::net::UnixStream::from_std(socket)
        };
        let (mut term, mut int) = match (open(self.term), open(self.int)) {
            (Ok(term), Ok(int)) => (term, int),
            (Err(e), _) | (_, Err(e)) => {
                tracing::warn!(error = %e, "cannot watch for signals; stop with SIGKILL");
                return;
            }
        };
        let (mut a, mut b) = ([0u8; 1], [0u8; 1]);
        tokio::select! {
            _ = term.read(&mut a) => tracing::info!("SIGTERM received"),
            _ = int.read(&mut b) => tracing::info!("SIGINT received"),
        }
        stop.cancel();
        tokio::select! {
            _ = term.read(&mut a) => {}
            _ = int.read(&mut b) => {}
        }
        tracing::warn!("second signal: exiting without the final acknowledgement");
        std::process::exit(EXIT_SECOND_SIGNAL);
    }
}

/// `signals` blocked on this thread (at start-up, the only one) until
/// dropped, when the mask it found is restored and what came meanwhile is
/// delivered.
struct Blocked(libc::sigset_t);

impl Blocked {
    #[allow(unsafe_code)]
    fn new(signals: &[libc::c_int]) -> Self {
        // SAFETY: sigset_t is plain data, initialised by sigemptyset;
        // pthread_sigmask only reads `set` and writes `old`.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            for &signal in signals {
                libc::sigaddset(&mut set, signal);
            }
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old);
            Blocked(old)
        }
    }
}

impl Drop for Blocked {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        // SAFETY: restores the mask read in `new`.
        unsafe {
            libc::pthread_sigmask(libc::SIG_SETMASK, &self.0, std::ptr::null_mut());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Cancel after the signal sent before watching started; the second
    /// signal is not tested here (it exits the test process).
    #[tokio::test]
    async fn a_signal_sent_before_the_runtime_watches_still_stops_gracefully() {
        let signals = StopSignals::install().unwrap();
        signal_hook::low_level::raise(signal_hook::consts::SIGINT).unwrap();
        let stop = CancellationToken::new();
        let watching = tokio::spawn(signals.watch(stop.clone()));
        tokio::time::timeout(std::time::Duration::from_secs(5), stop.cancelled())
            .await
            .expect("the early signal cancels the stop token");
        watching.abort();
    }
}
