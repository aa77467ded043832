//! The `stdout` sink: one envelope per line (NDJSON) on standard output.
//!
//! "Delivered" means written and flushed to the file descriptor. Logs go to
//! standard error, so standard output carries envelopes only.
//!
//! A batch is formatted into one buffer and written with as few system calls
//! as the output takes. How it is written depends on what standard output is,
//! looked at once at start-up (and logged), so that a reader that stops
//! reading never stops the runtime (health, metrics, signals keep working;
//! the in-flight limits stop the stream, and the slot keeps what is not yet
//! written):
//!
//! * a **regular file** or **`/dev/null`**: no reader can hold these up, so
//!   the batch is written on the runtime thread, one `write` a batch. (The
//!   kernel may still throttle writes to a slow disk, and a network
//!   filesystem that hangs would stall the runtime; send the output through
//!   a pipe there.)
//! * a **pipe**: opened again, non-blocking, through `/proc/self/fd/<n>` (a
//!   duplicate of fd 1), which makes an open file description of its own, so
//!   standard error on the same pipe stays blocking. A batch is written on
//!   the runtime while the pipe has room; when it is full the write waits for
//!   room as a socket does. The write runs as a task of its own, so that it
//!   always finishes: a batch cut off half-written (the publisher dropping
//!   the call when a session restarts) would leave a torn line for the next
//!   envelope to land on.
//! * **anything else** (a terminal, a socket, another character device), a
//!   pipe that cannot be opened again (no `/proc`, or no permission in a
//!   container running as another user), or no tokio runtime: a writer
//!   thread of the sink's own, which writes each batch with one blocking
//!   `write_all`. Each batch then costs two thread hand-offs, which is why the
//!   cases above avoid it.
//!
//! A closed standard output is not taken for a destination: every batch
//! fails, retryably, saying so, and nothing is acknowledged.

use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::sync::{Arc, Mutex};

use tokio::io::AsyncWriteExt;
use tokio::net::unix::pipe;
use tokio::sync::oneshot;

use crate::pipeline::sink::{Cause, Message, Outcome, Sink};

/// A buffer to write, and where to say how it went (the buffer comes back for reuse).
struct Job {
    buffer: Vec<u8>,
    done: oneshot::Sender<(Vec<u8>, std::io::Result<()>)>,
}

/// How batches reach the output (see the module docs).
enum Output {
    /// A regular file or `/dev/null`, written on the calling thread.
    Direct(Mutex<std::fs::File>),
    /// A pipe, written without blocking; waits for room when full.
    Pipe(Arc<tokio::sync::Mutex<pipe::Sender>>),
    /// A writer thread that takes buffers and gives them back.
    Thread(std::sync::mpsc::Sender<Job>),
}

/// Stands in for a closed standard output: every write fails, saying why.
struct Closed;

impl Write for Closed {
    fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
        Err(std::io::Error::other(
            "standard output is closed (fd 1): start the relay with it open, e.g. redirected to a file or a pipe",
        ))
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Writes envelopes as lines to a writer, by default standard output.
pub(crate) struct StdoutSink {
    output: Output,
    /// A buffer for the next batch.
    spare: Mutex<Vec<u8>>,
}

impl StdoutSink {
    /// A sink on the process's standard output.
    pub(crate) fn new() -> Self {
        let sink = match std::io::stdout().as_fd().try_clone_to_owned() {
            Ok(fd) => Self::on(fd),
            Err(_) => Self::with_writer(Box::new(Closed)),
        };
        tracing::info!(writes = sink.path(), "stdout sink");
        sink
    }

    /// A sink on an open file descriptor; how it is written depends on what
    /// it is (see the module docs).
    pub(crate) fn on(fd: OwnedFd) -> Self {
        let file = std::fs::File::from(fd);
        let Ok(meta) = file.metadata() else {
            return Self::with_writer(Box::new(file));
        };
        let kind = meta.file_type();
        let is_dev_null = kind.is_char_device()
            && std::fs::metadata("/dev/null").is_ok_and(|null| null.rdev() == meta.rdev());
        if kind.is_file() || is_dev_null {
            return Self::with_output(Output::Direct(Mutex::new(file)));
        }
        // A pipe is registered with the runtime's reactor.
        if kind.is_fifo() && tokio::runtime::Handle::try_current().is_ok() {
            let path = format!("/proc/self/fd/{}", file.as_raw_fd());
            if let Ok(sender) = pipe::OpenOptions::new().open_sender(path) {
                return Self::with_output(Output::Pipe(Arc::new(tokio::sync::Mutex::new(sender))));
            }
        }
        Self::with_writer(Box::new(file))
    }

    /// A sink on any writer, written by a thread of its own (the fallback
    /// for outputs the runtime cannot wait on, and tests).
    pub(crate) fn with_writer(mut writer: Box<dyn Write + Send>) -> Self {
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
        Self::with_output(Output::Thread(jobs))
    }

    /// How batches are written: `directly`, `to a non-blocking pipe` or
    /// `by a writer thread`.
    pub(crate) fn path(&self) -> &'static str {
        match self.output {
            Output::Direct(_) => "directly",
            Output::Pipe(_) => "to a non-blocking pipe",
            Output::Thread(_) => "by a writer thread",
        }
    }

    fn with_output(output: Output) -> Self {
        Self {
            output,
            spare: Mutex::new(Vec::with_capacity(256 * 1024)),
        }
    }

    /// Write `buffer`; the buffer back, and how it went.
    async fn write(&self, buffer: Vec<u8>) -> Result<Vec<u8>, String> {
        let stopped = || "the stdout writer stopped".to_owned();
        let (buffer, result) = match &self.output {
            Output::Direct(file) => {
                let result = file
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .write_all(&buffer);
                (buffer, result)
            }
            Output::Pipe(sender) => {
                // Batches are written in the order they take the lock; once
                // one has it, its write finishes even if this call is dropped.
                let mut sender = Arc::clone(sender).lock_owned().await;
                tokio::spawn(async move {
                    let result = sender.write_all(&buffer).await;
                    (buffer, result)
                })
                .await
                .map_err(|_| stopped())?
            }
            Output::Thread(jobs) => {
                let (done, wait) = oneshot::channel();
                jobs.send(Job { buffer, done }).map_err(|_| stopped())?;
                wait.await.map_err(|_| stopped())?
            }
        };
        result.map(|()| buffer).map_err(|e| e.to_string())
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
            // A local write: nothing to tell about a destination's load.
            Err(e) => Outcome::retry(
                Cause::Other,
                format!("writing to standard output failed: {e}"),
            ),
        };
        vec![outcome; batch.len()]
    }
}

#[cfg(test)]
mod tests {
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
        Message::for_test("id", "g", body, "")
    }

    /// Everything the pipe's writers write, read on a thread until the last
    /// of them is gone.
    fn read_to_end(mut reader: std::io::PipeReader) -> std::thread::JoinHandle<Vec<u8>> {
        std::thread::spawn(move || {
            let mut all = Vec::new();
            std::io::Read::read_to_end(&mut reader, &mut all).unwrap();
            all
        })
    }

    /// The lines of `output`, without their ends.
    fn lines(output: &[u8]) -> Vec<&[u8]> {
        output
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .collect()
    }

    /// One outcome, a retryable failure whose reason says `words`.
    fn assert_retryable(outcomes: &[Outcome], words: &str) {
        assert!(
            matches!(outcomes, [Outcome::Retryable(e)] if e.cause == Cause::Other && e.reason.contains(words)),
            "{outcomes:?}"
        );
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
        assert_retryable(&outcomes, "standard output");
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
    async fn a_regular_file_and_dev_null_are_written_directly() {
        let path = std::env::temp_dir().join(format!("outbox-relay-stdout-{}", std::process::id()));
        let file = std::fs::File::create(&path).unwrap();
        let sink = StdoutSink::on(file.into());
        assert_eq!(sink.path(), "directly");
        let outcomes = sink
            .publish(&[message("{\"a\":1}"), message("{\"b\":2}")])
            .await;
        assert_eq!(outcomes, vec![Outcome::Delivered; 2]);
        assert_eq!(
            sink.publish(&[message("{\"c\":3}")]).await,
            vec![Outcome::Delivered]
        );
        assert_eq!(
            std::fs::read(&path).unwrap(),
            b"{\"a\":1}\n{\"b\":2}\n{\"c\":3}\n"
        );
        std::fs::remove_file(&path).unwrap();

        let null = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/null")
            .unwrap();
        assert_eq!(StdoutSink::on(null.into()).path(), "directly");
        // Another character device is not: it may block.
        let tty_like = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/zero")
            .unwrap();
        assert_eq!(StdoutSink::on(tty_like.into()).path(), "by a writer thread");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_full_pipe_waits_for_room_without_stopping_the_runtime() {
        let (reader, writer) = std::io::pipe().unwrap();
        let sink = Arc::new(StdoutSink::on(writer.into()));
        assert_eq!(sink.path(), "to a non-blocking pipe");
        // More than a pipe holds (64 KiB on Linux), in one batch.
        let line = "x".repeat(1000);
        let batch: Vec<Message> = (0..200).map(|_| message(&line)).collect();
        let publishing = tokio::spawn({
            let sink = Arc::clone(&sink);
            async move { sink.publish(&batch).await }
        });
        // The one runtime thread keeps running other tasks (timers here).
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert!(!publishing.is_finished(), "the write waits for the reader");
        let reading = read_to_end(reader);
        assert_eq!(publishing.await.unwrap(), vec![Outcome::Delivered; 200]);
        drop(sink); // the last writer: the reader sees the end
        let all = reading.join().unwrap();
        let lines = lines(&all);
        assert_eq!(lines.len(), 200);
        assert!(lines.iter().all(|l| *l == line.as_bytes()));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_pipe_write_cut_off_by_its_caller_still_ends_its_lines() {
        let (reader, writer) = std::io::pipe().unwrap();
        let sink = Arc::new(StdoutSink::on(writer.into()));
        let line = "x".repeat(1000);
        let batch: Vec<Message> = (0..200).map(|_| message(&line)).collect();
        // The pipe fills and the publisher gives up on the call (a session
        // restarting drops it) with the batch half written.
        let cut = tokio::time::timeout(std::time::Duration::from_millis(100), sink.publish(&batch));
        assert!(cut.await.is_err(), "the write should have waited for room");
        let reading = read_to_end(reader);
        // The next batch starts on a line of its own.
        assert_eq!(
            sink.publish(&[message("y")]).await,
            vec![Outcome::Delivered]
        );
        drop(sink);
        let all = reading.join().unwrap();
        assert!(all.ends_with(b"\n"));
        let lines = lines(&all);
        assert_eq!(lines.last(), Some(&&b"y"[..]));
        assert!(
            lines[..lines.len() - 1]
                .iter()
                .all(|l| *l == line.as_bytes()),
            "a torn line: {} lines",
            lines.len()
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_closed_standard_output_fails_every_batch_saying_so() {
        let sink = StdoutSink::with_writer(Box::new(Closed));
        let outcomes = sink.publish(&[message("x")]).await;
        assert_retryable(&outcomes, "standard output is closed");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_pipe_whose_reader_is_gone_is_a_retryable_failure() {
        let (reader, writer) = std::io::pipe().unwrap();
        let sink = StdoutSink::on(writer.into());
        drop(reader);
        let outcomes = sink.publish(&[message("x")]).await;
        assert_retryable(&outcomes, "standard output");
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
