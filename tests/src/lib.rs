//! Test harness of outbox-relay: ephemeral PostgreSQL clusters (14 to 18) with logical
//! replication, one fresh database per test, the relay binary as a child process,
//! a polling helper, a throw-away CA for TLS ([`TestPki`]), a local SNS/SQS endpoint (moto) with topic/queue helpers
//! ([`topic_with_queue`], [`receive_all`]) and a fault-injecting HTTP proxy
//! ([`FaultProxy`]) and an HTTPS front for it ([`HttpsFront`]), a TLS front for
//! PostgreSQL ([`PgTlsFront`]: a man in the middle, or direct TLS as PostgreSQL 17 has it),
//! and a TCP proxy that freezes connections ([`FreezingProxy`]); raw AWS JSON-protocol calls
//! to moto for EventBridge buses and Kinesis streams ([`aws_json`]).
//!
//! ```no_run
//! use std::time::Duration;
//! use harness::{wait_until, TestDb};
//!
//! # async fn example() {
//! let db = TestDb::new().await; // on the shared cluster
//! let client = db.client().await;
//! client.batch_execute("CREATE TABLE outbox (id bigint)").await.unwrap();
//! let n: i64 = wait_until(Duration::from_secs(10), "the outbox has a row", || async {
//!     let row = client.query_one("SELECT count(*) FROM outbox", &[]).await.ok()?;
//!     Some(row.get::<_, i64>(0)).filter(|n| *n > 0)
//! })
//! .await;
//! # }
//! ```
//!
//! Environment: `OUTBOX_RELAY_TEST_PG_URL` (use that cluster instead of starting
//! one per test process), `PG_VERSION` (the PostgreSQL major, 14 to 18, default
//! 15: see [`pg_bin`]), `PG_BIN` (PostgreSQL binaries, overriding `PG_VERSION`),
//! `OUTBOX_RELAY_BIN` (relay binary override),
//! `OUTBOX_RELAY_TEST_SNS_URL` (use that moto server instead of starting one per
//! test process).

pub mod aws_json;
mod cluster;
mod database;
mod freeze;
mod https;
mod pg_front;
mod pki;
mod process;
pub mod proxy;
pub mod sns;

use std::fmt::Display;
use std::future::Future;
use std::time::{Duration, Instant};

pub use cluster::{
    pg_bin, pg_version, Cluster, StopMode, DEFAULT_PG_BIN, DEFAULT_PG_VERSION, ENV_PG_BIN,
    ENV_PG_CACHE, ENV_PG_VERSION, PASSWORD, PG_VERSIONS, SUPERUSER,
};
pub use database::{
    connect, quote_ident, server_version_num, shared_admin_url, with_database, SharedAdminUrl,
    TestDb, ENV_SHARED_URL,
};
pub use freeze::FreezingProxy;
pub use https::{ConnectProxy, HttpsFront};
pub use pg_front::{FrontStart, PgTlsFront};
pub use pki::TestPki;
pub use process::{relay_bin, RelayProcess, ENV_RELAY_BIN};
pub use proxy::{FaultProxy, Mode};
pub use sns::{
    aws_env, error_text, moto_endpoint, queue_depth, receive_all, sdk_config, sdk_config_as,
    shared_moto_endpoint, sns_client, sqs_client, sqs_client_as, topic_with_queue, unique_name,
    AccessKey, Moto, Received, SharedEndpoint, Topic, ENV_SNS_URL, MOTO_ACCOUNT_ID, TEST_REGION,
};

/// What a [`wait_until`] condition returns: `true`, `Some(v)` or `Ok(v)` means done.
pub trait Ready {
    /// The value [`wait_until`] returns once ready.
    type Value;
    /// `Ok(value)` when ready; otherwise `Err` with an optional reason
    /// (shown if the wait times out).
    fn ready(self) -> Result<Self::Value, Option<String>>;
}

impl Ready for bool {
    type Value = ();
    fn ready(self) -> Result<(), Option<String>> {
        if self {
            Ok(())
        } else {
            Err(None)
        }
    }
}

impl<T> Ready for Option<T> {
    type Value = T;
    fn ready(self) -> Result<T, Option<String>> {
        self.ok_or(None)
    }
}

impl<T, E: Display> Ready for Result<T, E> {
    type Value = T;
    fn ready(self) -> Result<T, Option<String>> {
        self.map_err(|e| Some(e.to_string()))
    }
}

/// Polls the async condition `f` every 50 ms until it is ready (`true`,
/// `Some(v)`, `Ok(v)`) and returns its value. Panics with
/// "timed out after … waiting until {what}" (plus the last `Err`, if any) when
/// `timeout` passes; a single call of `f` that hangs is cut off at the deadline.
pub async fn wait_until<F, Fut, R>(timeout: Duration, what: &str, mut f: F) -> R::Value
where
    F: FnMut() -> Fut,
    Fut: Future<Output = R>,
    R: Ready,
{
    let deadline = Instant::now() + timeout;
    let mut last_err = None;
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            // No check is started only to be cut off at once: the last one
            // that ran tells why.
            match last_err {
                Some(e) => {
                    panic!("timed out after {timeout:?} waiting until {what} (last error: {e})")
                }
                None => panic!("timed out after {timeout:?} waiting until {what}"),
            }
        }
        match tokio::time::timeout(remaining, f()).await {
            Ok(r) => match r.ready() {
                Ok(value) => return value,
                Err(reason) => last_err = reason.or(last_err),
            },
            Err(_) => last_err = Some("the last check did not finish in time".to_owned()),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
