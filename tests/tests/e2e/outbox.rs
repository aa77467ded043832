//! The outbox fixture: a fresh database set up with the shipped SQL, and a
//! witness that tells, independently of the relay, which transaction committed
//! which events and where its commit record ends.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use harness::TestDb;
use outbox_relay::Config;
use outbox_relay::{Message, Outcome, Sink};
use outbox_relay::{RelayError, Summary};
use tokio::task::JoinHandle;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

/// A relay running in this test's process.
pub struct Running {
    pub stop: CancellationToken,
    pub task: JoinHandle<Result<Summary, RelayError>>,
}

impl Running {
    /// Start every enabled worker of `config` with `sink`. The relay's
    /// log goes to the test's output (shown when it fails): information,
    /// and the position keeper's debug lines.
    pub fn start<S: Sink>(config: Config, sink: S) -> Running {
        static LOG: std::sync::Once = std::sync::Once::new();
        LOG.call_once(|| {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(
                    "outbox_relay=info,outbox_relay::postgres::position=debug",
                ))
                .with_test_writer()
                .try_init();
        });
        let stop = CancellationToken::new();
        let task = tokio::spawn({
            let stop = stop.clone();
            async move { outbox_relay::run(&config, Arc::new(sink), stop).await }
        });
        Running { stop, task }
    }

    /// Stop gracefully; the summary.
    pub async fn stop(self) -> Summary {
        self.stop.cancel();
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("the relay stops within 30 s")
            .expect("the relay task does not panic")
            .expect("the relay stops cleanly")
    }
}

/// A database with the outbox table, publication, slot and a witness slot.
pub struct Outbox {
    pub db: TestDb,
    pub sql: Client,
    /// The relay's slot (named after the database: slots are cluster-wide).
    pub slot: String,
    /// The least-privilege role from `sql/004_role.sql` the relay runs as
    /// (one per database, since roles are cluster-wide), password [`ROLE_PASSWORD`].
    pub role: String,
    witness: String,
    dir: tempfile::TempDir,
}

/// Password of [`Outbox::role`].
pub const ROLE_PASSWORD: &str = "relay-secret";

/// One committed transaction, as the witness saw it.
#[derive(Debug, Clone)]
pub struct Commit {
    /// End of the commit record: what the relay confirms.
    pub end_lsn: u64,
    /// Outbox ids inserted, in order.
    pub ids: Vec<String>,
}

impl Outbox {
    /// A fresh database, set up with `outbox-relay setup` SQL.
    pub async fn new() -> Outbox {
        Self::with_schema(None).await
    }

    /// Like [`Outbox::new`], but `table_sql` creates the outbox table (the
    /// shipped table file is skipped); it must create `public.outbox`.
    pub async fn with_schema(table_sql: Option<&str>) -> Outbox {
        Self::build(TestDb::new().await, table_sql).await
    }

    /// Like [`Outbox::new`], in a `SQL_ASCII` database: text columns take any
    /// bytes, so rows can hold text that is not UTF-8.
    pub async fn sql_ascii() -> Outbox {
        let db = TestDb::with_options(
            "ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0",
        )
        .await;
        Self::build(db, None).await
    }

    /// Like [`Outbox::new`], on a private cluster (one the test may restart).
    pub async fn on(cluster: &Arc<harness::Cluster>) -> Outbox {
        Self::build(TestDb::on(cluster).await, None).await
    }

    /// A relay on this database with `extra` configuration, streaming;
    /// what it delivers.
    pub async fn streaming(&self, extra: &str) -> (Collect, Running) {
        let sink = Collect::default();
        let relay = Running::start(self.config(extra), sink.clone());
        self.wait_slot_active(true).await;
        (sink, relay)
    }

    /// Every id in the outbox table.
    pub async fn all_ids(&self) -> std::collections::HashSet<String> {
        self.sql
            .query("SELECT id::text FROM outbox", &[])
            .await
            .expect("read the outbox ids")
            .iter()
            .map(|r| r.get(0))
            .collect()
    }

    /// A new SQL session for the test (after a Postgres restart).
    pub async fn reconnect(&mut self) {
        self.sql = self.db.client().await;
    }

    async fn build(db: TestDb, table_sql: Option<&str>) -> Outbox {
        let sql = db.client().await;
        let slot = db.name().to_owned();
        let witness = format!("w_{}", db.name());
        let role = format!("r_{}", db.name().trim_start_matches("t_"));
        let dir = tempfile::tempdir().expect("temp dir");
        let outbox = Outbox {
            db,
            sql,
            slot,
            role,
            witness,
            dir,
        };
        let config = outbox.config("");
        let files =
            outbox_relay::setup::render(&config, &outbox.role, false).expect("render setup SQL");
        let mut files: Vec<_> = files.into_iter().collect();
        if let Some(table_sql) = table_sql {
            outbox
                .sql
                .batch_execute(table_sql)
                .await
                .expect("custom outbox table");
            files.retain(|(name, _)| !name.starts_with("001"));
        }
        outbox_relay::setup::apply(&outbox.sql, &files)
            .await
            .unwrap_or_else(|(file, e)| panic!("setup {file}: {e:?}"));
        outbox
            .sql
            .batch_execute(&format!(
                "ALTER ROLE {} PASSWORD '{ROLE_PASSWORD}'",
                outbox.role
            ))
            .await
            .expect("role password");
        outbox
            .sql
            .execute(
                "SELECT pg_create_logical_replication_slot($1, 'test_decoding')",
                &[&outbox.witness],
            )
            .await
            .expect("witness slot");
        outbox
    }

    /// The relay's URL: this database, as [`Outbox::role`].
    pub fn relay_url(&self) -> String {
        let superuser = format!("{}:{}@", harness::SUPERUSER, harness::PASSWORD);
        assert!(self.db.url().contains(&superuser), "{}", self.db.url());
        self.db
            .url()
            .replacen(&superuser, &format!("{}:{ROLE_PASSWORD}@", self.role), 1)
    }

    /// The relay configuration for this database, with `extra` TOML appended
    /// (sections other than `[postgres]`, or keys after a section header).
    pub fn config_toml(&self, extra: &str) -> String {
        // No listener unless the test configures one.
        let http = if extra.contains("[http]") {
            ""
        } else {
            "\n[http]\nlisten = \"\"\n"
        };
        format!(
            "[postgres]\nurl = \"{}\"\nslot = \"{}\"\n{extra}\n{http}",
            self.relay_url(),
            self.slot
        )
    }

    /// Parsed [`Outbox::config_toml`].
    pub fn config(&self, extra: &str) -> Config {
        Config::from_parts(
            &self.config_toml(extra),
            Path::new("test.toml"),
            std::iter::empty(),
        )
        .unwrap_or_else(|e| panic!("test config: {e}"))
    }

    /// Write the configuration to a file for the binary.
    pub fn config_file(&self, extra: &str) -> PathBuf {
        let path = self
            .dir
            .path()
            .join(format!("relay-{}.toml", fastrand::u32(..)));
        std::fs::write(&path, self.config_toml(extra)).expect("write config");
        path
    }

    /// Like [`Outbox::config_file`], but connecting as the table's owner (the
    /// superuser), for what the least-privilege role may not do.
    pub fn owner_config_file(&self, extra: &str) -> PathBuf {
        let path = self.config_file(extra);
        let text = std::fs::read_to_string(&path).expect("read config");
        let owner = text.replacen(&self.relay_url(), self.db.url(), 1);
        assert_ne!(owner, text);
        std::fs::write(&path, owner).expect("write config");
        path
    }

    /// Insert one transaction of events `(aggregate_id, event_type)`; their ids.
    pub async fn insert_tx(&self, events: &[(String, String)]) -> Vec<String> {
        let aggregates: Vec<&str> = events.iter().map(|(a, _)| a.as_str()).collect();
        let types: Vec<&str> = events.iter().map(|(_, t)| t.as_str()).collect();
        let rows = self
            .sql
            .query(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
                 SELECT 'order', a, t, jsonb_build_object('n', n, 'aggregate', a) \
                 FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS u(a, t, n) \
                 ORDER BY n RETURNING id::text",
                &[&aggregates, &types],
            )
            .await
            .expect("insert outbox rows");
        rows.iter().map(|r| r.get(0)).collect()
    }

    /// Insert `txs` transactions of `per_tx` events over `aggregates`
    /// aggregates (round robin); all ids in commit order.
    pub async fn insert_many(&self, txs: usize, per_tx: usize, aggregates: usize) -> Vec<String> {
        let mut ids = Vec::with_capacity(txs * per_tx);
        for t in 0..txs {
            let events: Vec<(String, String)> = (0..per_tx)
                .map(|i| {
                    let n = t * per_tx + i;
                    (format!("agg-{}", n % aggregates), format!("Event{n}"))
                })
                .collect();
            ids.extend(self.insert_tx(&events).await);
        }
        ids
    }

    /// Every committed transaction that touched the outbox, in commit order.
    pub async fn commits(&self) -> Vec<Commit> {
        let rows = self
            .sql
            .query(
                "SELECT lsn::text, data FROM pg_logical_slot_peek_changes($1, NULL, NULL)",
                &[&self.witness],
            )
            .await
            .expect("peek witness slot");
        let mut commits = Vec::new();
        let mut ids = Vec::new();
        for row in rows {
            let lsn: &str = row.get(0);
            let data: &str = row.get(1);
            if data.starts_with("BEGIN") {
                ids.clear();
            } else if let Some(rest) = data.strip_prefix("table public.outbox: INSERT: ") {
                if let Some(id) = column_value(rest) {
                    ids.push(id);
                }
            } else if data.starts_with("COMMIT") && !ids.is_empty() {
                commits.push(Commit {
                    end_lsn: parse_lsn(lsn),
                    ids: std::mem::take(&mut ids),
                });
            }
        }
        commits
    }

    /// Each of `ids`' explicit `publish_state`, sorted.
    pub async fn explicit_states(&self, ids: &[String]) -> Vec<String> {
        self.sorted_column("publish_state", "outbox", ids).await
    }

    /// Each of `ids`' state as the view `outbox_state` (the one `setup`
    /// creates) derives it, sorted.
    pub async fn view_states(&self, ids: &[String]) -> Vec<String> {
        self.sorted_column("state", "outbox_state", ids).await
    }

    /// `column` of `relation`'s rows of `ids`, sorted.
    async fn sorted_column(&self, column: &str, relation: &str, ids: &[String]) -> Vec<String> {
        self.sql
            .query(
                &format!(
                    "SELECT {column} FROM {relation} WHERE id::text = ANY($1) ORDER BY {column}"
                ),
                &[&ids],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    }

    /// Drop the relay's slot, once its walsender has let it go: a relay that
    /// stopped has closed its connection, but its walsender exits on its own
    /// time, and `pg_drop_replication_slot` refuses an active slot at once.
    pub async fn drop_slot(&self) {
        self.wait_slot_active(false).await;
        self.sql
            .execute("SELECT pg_drop_replication_slot($1)", &[&self.slot])
            .await
            .expect("drop the relay's slot");
    }

    /// Drop the relay's slot and create it again (pgoutput) with the further
    /// arguments `args` of `pg_create_logical_replication_slot` (e.g.
    /// `"false, true"`: not temporary, two-phase).
    pub async fn recreate_slot(&self, args: &str) {
        self.drop_slot().await;
        self.sql
            .execute(
                &format!("SELECT pg_create_logical_replication_slot($1, 'pgoutput', {args})"),
                &[&self.slot],
            )
            .await
            .expect("create the relay's slot");
    }

    /// The relay slot's `confirmed_flush_lsn`.
    pub async fn confirmed_flush(&self) -> u64 {
        let row = self
            .sql
            .query_one(
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
                &[&self.slot],
            )
            .await
            .expect("read slot");
        parse_lsn(row.get(0))
    }

    /// Whether a backend is streaming from the relay's slot (false when the slot is missing).
    pub async fn slot_active(&self) -> bool {
        let row = self
            .sql
            .query_opt(
                "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                &[&self.slot],
            )
            .await
            .expect("read slot");
        row.is_some_and(|r| r.get(0))
    }

    /// `pg_current_wal_lsn()`.
    pub async fn current_lsn(&self) -> u64 {
        let row = self
            .sql
            .query_one("SELECT pg_current_wal_lsn()::text", &[])
            .await
            .expect("current lsn");
        parse_lsn(row.get(0))
    }

    /// Wait until the relay's slot is streaming (or not).
    pub async fn wait_slot_active(&self, active: bool) {
        harness::wait_until(
            Duration::from_secs(30),
            if active {
                "the relay streams from its slot"
            } else {
                "the slot is released"
            },
            || async { self.slot_active().await == active },
        )
        .await;
    }
}

/// The `id` column's value in a test_decoding row: `id[uuid]:'…' …`.
fn column_value(row: &str) -> Option<String> {
    let rest = row.strip_prefix("id[uuid]:'")?;
    Some(rest[..rest.find('\'')?].to_owned())
}

/// `X/Y` to a number.
pub fn parse_lsn(text: &str) -> u64 {
    let (hi, lo) = text.split_once('/').expect("an LSN");
    (u64::from_str_radix(hi, 16).unwrap() << 32) | u64::from_str_radix(lo, 16).unwrap()
}

/// The ids in NDJSON envelope lines (lines that do not parse are skipped: a
/// line cut short by kill -9 was never reported delivered).
pub fn envelope_ids(lines: &[String]) -> Vec<String> {
    lines
        .iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["id"].as_str().map(str::to_owned))
        .collect()
}

/// Which messages a [`Collect`] sink holds back.
type Hold = fn(&Message) -> bool;

/// A sink that records what it delivers; messages for which `hold` says yes
/// wait until [`Collect::release`].
#[derive(Clone, Default)]
pub struct Collect {
    pub delivered: Arc<Mutex<Vec<Message>>>,
    held: Arc<Mutex<Option<Hold>>>,
    released: Arc<tokio::sync::Notify>,
    /// Messages currently waiting in [`Collect::publish`].
    pub waiting: Arc<Mutex<Vec<String>>>,
}

impl Collect {
    /// Hold messages matching `hold` until released.
    pub fn holding(hold: Hold) -> Self {
        let c = Self::default();
        *c.held.lock().unwrap() = Some(hold);
        c
    }

    /// Let held messages through.
    pub fn release(&self) {
        *self.held.lock().unwrap() = None;
        self.released.notify_waiters();
    }

    /// Ids delivered so far, in order.
    pub fn ids(&self) -> Vec<String> {
        self.delivered
            .lock()
            .unwrap()
            .iter()
            .map(|m| m.event.id().to_string())
            .collect()
    }
}

impl Sink for Collect {
    fn name(&self) -> &'static str {
        "collect"
    }

    fn max_batch(&self) -> usize {
        10
    }

    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        for m in batch {
            loop {
                let notified = self.released.notified();
                let hold = *self.held.lock().unwrap();
                match hold {
                    Some(hold) if hold(m) => {
                        self.waiting.lock().unwrap().push(m.event.id().to_string());
                        notified.await;
                    }
                    _ => break,
                }
            }
            self.delivered.lock().unwrap().push(m.clone());
        }
        vec![Outcome::Delivered; batch.len()]
    }
}

/// A metric of this process's relay (tests run one to a process), from
/// its exposition text: the first sample whose name and labels start with
/// `series`.
pub fn metric(series: &str) -> f64 {
    let text = outbox_relay::metrics().encode();
    text.lines()
        .find(|l| l.starts_with(series) && !l.starts_with('#'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no sample {series} in\n{text}"))
}

/// Insert small transactions until `stop`, reconnecting through outages.
pub fn produce(
    url: String,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<usize> {
    tokio::spawn(async move {
        let mut committed = 0;
        let mut client: Option<tokio_postgres::Client> = None;
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            if client.as_ref().is_none_or(|c| c.is_closed()) {
                client = match tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
                    Ok((c, conn)) => {
                        tokio::spawn(conn);
                        Some(c)
                    }
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
            }
            let insert = client.as_ref().unwrap().batch_execute(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
                 SELECT 'order', 'agg-' || (g % 5), 'E', '{}' FROM generate_series(1, 3) g",
            );
            match insert.await {
                Ok(()) => committed += 1,
                Err(_) => client = None,
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        committed
    })
}
