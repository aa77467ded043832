//! After a confirmed publish: mark rows PUBLISHED (or delete them), batched.
//!
//! `[lifecycle] on_published`:
//! * `mark`: `publish_state = 'PUBLISHED', published_at = now()`; filtered-out
//!   events become `SKIPPED`;
//! * `delete`: the rows are deleted (filtered-out ones too);
//! * `none`: the table is left alone (application-managed, Debezium style).
//!
//! Marks are collected from the publisher and the stream and written in
//! batches, one statement per batch. The publication carries inserts only,
//! so these updates and deletes never come back through the stream.
//!
//! Marking is not part of the acknowledgement: a row the relay published but
//! could not mark (a crash in between) stays PENDING and the poller publishes
//! it again after its grace period, a bounded, identifiable repeat.
//!
//! A statement that fails is retried with backoff. When the connection itself
//! is gone (PostgreSQL restarted, failed over), the task opens its own and
//! keeps trying for [`RECONNECT_FOR`], so that a restart does not drop the
//! marks of events already delivered.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use crate::config::OnPublished;
use crate::retry::Backoff;
use crate::table::Table;

/// Most ids in one statement.
const BATCH: usize = 1000;
/// How long marks gather before they are written.
const GATHER: Duration = Duration::from_millis(20);
/// How long a statement is retried on a lost connection before its marks are
/// given up: longer than the default `postgres.receive_timeout`, so a
/// connection taken for dead is opened again and the statement retried.
const RECONNECT_FOR: Duration = Duration::from_secs(150);

/// What to record about a row.
#[derive(Debug, Clone)]
pub enum Mark {
    /// It was published.
    Published(String),
    /// It was filtered out.
    Skipped(String),
}

/// Sends marks to the marking task; cheap to clone.
#[derive(Debug, Clone)]
pub struct Marker(mpsc::UnboundedSender<Mark>);

impl Marker {
    /// Record `mark` (a no-op once the task is gone).
    pub fn send(&self, mark: Mark) {
        let _ = self.0.send(mark);
    }
}

/// Start the marking task for `mode`; `None` when the table is left alone.
/// The task ends (after writing what it has) when every [`Marker`] is dropped.
pub fn spawn(
    client: Arc<tokio_postgres::Client>,
    conn: crate::postgres::ConnInfo,
    table: &Table,
    mode: OnPublished,
    backoff: Backoff,
) -> Option<(Marker, tokio::task::JoinHandle<()>)> {
    let (Some(published), Some(skipped)) = (table.published_sql(mode), table.skipped_sql(mode))
    else {
        return None;
    };
    let (tx, mut rx) = mpsc::unbounded_channel::<Mark>();
    let task = tokio::spawn(async move {
        let mut client = client;
        let mut marks = Vec::with_capacity(BATCH);
        loop {
            if rx.recv_many(&mut marks, BATCH).await == 0 {
                return;
            }
            tokio::time::sleep(GATHER).await;
            let room = BATCH.saturating_sub(marks.len());
            if room > 0 {
                while let Ok(m) = rx.try_recv() {
                    marks.push(m);
                    if marks.len() >= BATCH {
                        break;
                    }
                }
            }
            let mut done: Vec<&str> = Vec::new();
            let mut filtered: Vec<&str> = Vec::new();
            for m in &marks {
                match m {
                    Mark::Published(id) => done.push(id.as_str()),
                    Mark::Skipped(id) => filtered.push(id.as_str()),
                }
            }
            for (sql, ids) in [(&published, &done), (&skipped, &filtered)] {
                if ids.is_empty() {
                    continue;
                }
                let mut attempt = 0;
                let started = tokio::time::Instant::now();
                while let Err(e) = client.execute(sql.as_str(), &[ids]).await {
                    let lost = client.is_closed();
                    if (!lost && attempt >= 5) || started.elapsed() > RECONNECT_FOR {
                        tracing::error!(rows = ids.len(), error = %crate::postgres::Chain(&e), "cannot mark rows; they stay as they were (the poller may publish them again)");
                        break;
                    }
                    let delay = backoff.delay(attempt);
                    attempt += 1;
                    tracing::warn!(rows = ids.len(), attempt, error = %crate::postgres::Chain(&e), "marking rows failed, retrying");
                    tokio::time::sleep(delay).await;
                    if lost {
                        match conn.connect().await {
                            Ok(fresh) => client = Arc::new(fresh),
                            Err(e) => {
                                tracing::debug!(error = %crate::postgres::Chain(&e), "marking cannot reconnect yet")
                            }
                        }
                    }
                }
            }
            drop(done);
            drop(filtered);
            marks.clear();
        }
    });
    Some((Marker(tx), task))
}
