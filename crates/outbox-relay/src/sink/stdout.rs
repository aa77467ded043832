//! The `stdout` sink: one envelope per line (NDJSON) on standard output.
//!
//! "Delivered" means written and flushed to the file descriptor. Logs go to
//! standard error, so standard output carries envelopes only.

use tokio::io::{AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::Mutex;

use super::{Message, Outcome, Sink};

/// Writes envelopes as lines to a writer, by default standard output.
pub struct StdoutSink {
    out: Mutex<BufWriter<Box<dyn AsyncWrite + Send + Unpin>>>,
}

impl StdoutSink {
    /// A sink on the process's standard output.
    pub fn new() -> Self {
        Self::with_writer(Box::new(tokio::io::stdout()))
    }

    /// A sink on any writer (tests, files).
    pub fn with_writer(writer: Box<dyn AsyncWrite + Send + Unpin>) -> Self {
        Self {
            out: Mutex::new(BufWriter::with_capacity(256 * 1024, writer)),
        }
    }
}

impl Default for StdoutSink {
    fn default() -> Self {
        Self::new()
    }
}

impl Sink for StdoutSink {
    fn name(&self) -> &'static str {
        "stdout"
    }

    fn max_batch(&self) -> usize {
        1024
    }

    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        let mut out = self.out.lock().await;
        let mut result = Ok(());
        for message in batch {
            result = async {
                out.write_all(&message.body).await?;
                out.write_all(b"\n").await
            }
            .await;
            if result.is_err() {
                break;
            }
        }
        if result.is_ok() {
            result = out.flush().await;
        }
        let outcome = match result {
            Ok(()) => Outcome::Delivered,
            Err(e) => Outcome::Retryable(format!("writing to standard output failed: {e}")),
        };
        vec![outcome; batch.len()]
    }
}
