//! The `stdout` sink: one envelope per line (NDJSON) on standard output.
//!
//! "Delivered" means written and flushed to the file descriptor. Logs go to
//! standard error, so standard output carries envelopes only.
//!
//! A batch is formatted into one buffer and handed to a writer thread of the
//! sink's own, which writes it with one blocking `write_all`: cheaper than
//! tokio's blocking pool per write, and a reader that stops reading blocks
//! only that thread. The relay stays responsive (health, metrics, signals);
//! its in-flight limits stop the stream, and the slot keeps what is not yet
//! written.

use std::io::Write;
use std::sync::Mutex;

use tokio::sync::oneshot;

use super::{Message, Outcome, Sink};

/// A buffer to write, and where to say how it went (the buffer comes back for reuse).
struct Job {
    buffer: Vec<u8>,
    done: oneshot::Sender<(Vec<u8>, std::io::Result<()>)>,
}

/// Writes envelopes as lines to a writer, by default standard output.
pub struct StdoutSink {
    jobs: std::sync::mpsc::Sender<Job>,
    /// A buffer for the next batch.
    spare: Mutex<Vec<u8>>,
}

impl StdoutSink {
    /// A sink on the process's standard output.
    pub fn new() -> Self {
        Self::with_writer(Box::new(std::io::stdout()))
    }

    /// A sink on any writer (tests, files).
    pub fn with_writer(mut writer: Box<dyn Write + Send>) -> Self {
        let (jobs, queue) = std::sync::mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("stdout-sink".into())
            .spawn(move || {
                // Ends when the sink is dropped.
                for job in queue {
                    let result = writer.write_all(&job.buffer).and_then(|()| writer.flush());
                    let _ = job.done.send((job.buffer, result));
                }
            })
            .expect("cannot start the stdout writer thread");
        Self {
            jobs,
            spare: Mutex::new(Vec::with_capacity(256 * 1024)),
        }
    }

    /// Write `buffer`; the buffer back, and how it went.
    async fn write(&self, buffer: Vec<u8>) -> Result<Vec<u8>, String> {
        let (done, wait) = oneshot::channel();
        self.jobs
            .send(Job { buffer, done })
            .map_err(|_| "the stdout writer thread stopped".to_owned())?;
        match wait.await {
            Ok((buffer, Ok(()))) => Ok(buffer),
            Ok((_, Err(e))) => Err(e.to_string()),
            Err(_) => Err("the stdout writer thread stopped".to_owned()),
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
        let mut buffer = std::mem::take(&mut *self.spare.lock().unwrap_or_else(|p| p.into_inner()));
        buffer.clear();
        // Sized once: growing by doubling leaves garbage behind on the allocator.
        buffer.reserve(batch.iter().map(|m| m.body.len() + 1).sum());
        for message in batch {
            buffer.extend_from_slice(&message.body);
            buffer.push(b'\n');
        }
        let outcome = match self.write(buffer).await {
            Ok(buffer) => {
                // One huge batch should not pin its buffer for the process's life.
                if buffer.capacity() <= 1 << 20 {
                    *self.spare.lock().unwrap_or_else(|p| p.into_inner()) = buffer;
                }
                Outcome::Delivered
            }
            Err(e) => Outcome::Retryable(format!("writing to standard output failed: {e}")),
        };
        vec![outcome; batch.len()]
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    struct Broken;

    impl Write for Broken {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(std::io::Error::from(std::io::ErrorKind::BrokenPipe))
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn message(body: &str) -> Message {
        Message {
            ticket: crate::ack::Ticket::detached(),
            event: crate::event::OutboxEvent {
                id: "id".into(),
                aggregate_type: "t".into(),
                aggregate_id: "g".into(),
                event_type: "E".into(),
                payload: crate::event::Payload::Json("{}".into()),
                headers: None,
                topic: None,
                group: "g".into(),
                time: "t".into(),
            },
            body: bytes::Bytes::from(body.to_owned()),
            destination: crate::route::nowhere(),
            commit_time: 0,
        }
    }

    #[tokio::test]
    async fn a_batch_becomes_lines_and_a_failed_write_is_retryable() {
        let shared = Shared::default();
        let sink = StdoutSink::with_writer(Box::new(shared.clone()));
        let outcomes = sink
            .publish(&[message("{\"a\":1}"), message("{\"b\":2}")])
            .await;
        assert_eq!(outcomes, vec![Outcome::Delivered; 2]);
        assert_eq!(&*shared.0.lock().unwrap(), b"{\"a\":1}\n{\"b\":2}\n");
        let broken = StdoutSink::with_writer(Box::new(Broken));
        let outcomes = broken.publish(&[message("x")]).await;
        assert!(matches!(&outcomes[0], Outcome::Retryable(e) if e.contains("standard output")));
    }

    /// A writer that waits for a go before each write.
    struct Gate(std::sync::mpsc::Receiver<()>);

    impl Write for Gate {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0
                .recv()
                .map_err(|_| std::io::Error::other("gate closed"))?;
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_reader_that_stops_reading_does_not_stop_the_runtime() {
        let (go, gate) = std::sync::mpsc::channel();
        let sink = Arc::new(StdoutSink::with_writer(Box::new(Gate(gate))));
        let publishing = tokio::spawn({
            let sink = Arc::clone(&sink);
            async move { sink.publish(&[message("x")]).await }
        });
        // The one runtime thread keeps running other tasks (timers here).
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert!(!publishing.is_finished(), "the write waits for the reader");
        go.send(()).unwrap();
        assert_eq!(publishing.await.unwrap(), vec![Outcome::Delivered]);
    }
}
