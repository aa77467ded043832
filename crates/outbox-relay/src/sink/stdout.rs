//! The `stdout` sink: one envelope per line (NDJSON) on standard output.
//!
//! "Delivered" means written and flushed to the file descriptor. Logs go to
//! standard error, so standard output carries envelopes only.
//!
//! A batch is formatted into one buffer and written with one blocking
//! `write_all`, on the task that publishes it: writing to /dev/null, a file or
//! a pipe with room takes microseconds, far less than handing the buffer to
//! tokio's blocking pool and back. A reader that stops reading blocks the
//! relay, which is the backpressure a pipe means; the slot keeps what is not
//! yet written.

use std::io::Write;
use std::sync::Mutex;

use super::{Message, Outcome, Sink};

/// Writes envelopes as lines to a writer, by default standard output.
pub struct StdoutSink {
    out: Mutex<Out>,
}

struct Out {
    writer: Box<dyn Write + Send>,
    buffer: Vec<u8>,
}

impl StdoutSink {
    /// A sink on the process's standard output.
    pub fn new() -> Self {
        Self::with_writer(Box::new(std::io::stdout()))
    }

    /// A sink on any writer (tests, files).
    pub fn with_writer(writer: Box<dyn Write + Send>) -> Self {
        Self {
            out: Mutex::new(Out {
                writer,
                buffer: Vec::with_capacity(256 * 1024),
            }),
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
        let result = {
            let mut out = self.out.lock().unwrap_or_else(|p| p.into_inner());
            let Out { writer, buffer } = &mut *out;
            buffer.clear();
            for message in batch {
                buffer.extend_from_slice(&message.body);
                buffer.push(b'\n');
            }
            let result = writer.write_all(buffer).and_then(|()| writer.flush());
            if buffer.capacity() > 4 << 20 {
                // One huge batch should not pin its buffer for the process's life.
                *buffer = Vec::with_capacity(256 * 1024);
            }
            result
        };
        let outcome = match result {
            Ok(()) => Outcome::Delivered,
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
}
