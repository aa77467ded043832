//! The stress test of the derived lifecycle (issue 30 §5, docs/stress.md):
//! concurrent writers mixing every kind of transaction the rule must survive,
//! a relay (the real binary, `on_published = "derive"`, the default) streaming
//! to an in-process webhook receiver that records every event it processed,
//! kill -9 of the relay and restarts, graceful stops (SIGTERM) and restarts,
//! optionally one immediate PostgreSQL restart; and checks, during the run
//! and after it settled:
//!
//! 1. every row the derived state calls PUBLISHED was delivered (checked
//!    repeatedly during the run: the set of derived-published ids is read
//!    first, then compared with what the receiver had processed by then);
//! 2. every delivered row is eventually derived PUBLISHED or explicitly
//!    marked (no delivered row reads PENDING after the settle);
//! 3. every committed row is delivered, and rolled-back rows never are;
//! 4. repeats (deliveries beyond the first), by cause: across a relay or
//!    PostgreSQL restart, within one relay's life (the poller, or a mark in a
//!    hole), and how many rows the poller published.
//!
//! ```sh
//! cargo run -p outbox-relay-tests --bin stress -- --seconds 300 --writers 32 --kills 6 --stops 2 --pg-restart
//! ```
//!
//! Exit 0 only when every check holds; the summary is printed either way.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use harness::{Cluster, RelayProcess, StopMode, TestDb};
use http_body_util::BodyExt as _;
use tokio_postgres::Client;

const SLOT: &str = "stress";
/// A signing secret for the webhook sink (the receiver does not verify it).
const SECRET: &str = "whsec_MDEyMzQ1Njc4OWFiY2RlZmdoaWprbG1u";
/// The poller's grace: short, so that a poller republishing what the stream
/// delivered shows within the run.
const GRACE_SECS: u64 = 10;
/// The writers' gate: each transaction holds it shared; the driver takes it
/// alone for the burst of asynchronous commits before the immediate stop,
/// so that no synchronous commit of a writer flushes the burst's WAL first.
type Gate = Arc<tokio::sync::RwLock<()>>;
/// How often rule (1) is checked during the run: each check reads every
/// derived-published id (a scan of the view), so not much more often.
const CHECK_EVERY: Duration = Duration::from_millis(250);
/// The share of deliveries that may be repeats (as the chaos run allows).
const MAX_REPEAT_SHARE: f64 = 0.05;

struct Args {
    seconds: u64,
    writers: usize,
    kills: u32,
    stops: u32,
    pg_restart: bool,
    require_derived: bool,
    grace: u64,
    receiver_delay_ms: u64,
}

fn args() -> Args {
    let mut a = Args {
        seconds: 120,
        writers: 16,
        kills: 4,
        stops: 0,
        pg_restart: false,
        require_derived: false,
        grace: GRACE_SECS,
        receiver_delay_ms: 100,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut num = |name: &str| -> u64 {
            it.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{name} takes a number"))
        };
        match arg.as_str() {
            "--seconds" => a.seconds = num("--seconds"),
            "--writers" => a.writers = num("--writers") as usize,
            "--kills" => a.kills = num("--kills") as u32,
            "--stops" => a.stops = num("--stops") as u32,
            "--pg-restart" => a.pg_restart = true,
            "--require-derived" => a.require_derived = true,
            "--grace" => a.grace = num("--grace"),
            "--receiver-delay-ms" => a.receiver_delay_ms = num("--receiver-delay-ms"),
            other => panic!(
                "unknown argument {other:?} (--seconds N --writers N --kills N --stops N --pg-restart --require-derived --grace SECS --receiver-delay-ms N)"
            ),
        }
    }
    a
}

/// What became of a row a writer inserted, as the writer knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Fate {
    /// COMMIT (or COMMIT PREPARED) answered; `durable` unless the
    /// transaction ran with `synchronous_commit = off`.
    Committed { durable: bool },
    /// ROLLBACK, ROLLBACK TO SAVEPOINT or ROLLBACK PREPARED answered.
    RolledBack,
    /// Prepared under this gid, not yet finished.
    Prepared(String),
    /// The connection broke before the outcome was known.
    Unknown,
}

/// Every row any writer inserted: id → (kind of transaction, fate).
#[derive(Default)]
struct Ledger {
    rows: HashMap<String, (&'static str, Fate)>,
    transactions: BTreeMap<&'static str, u64>,
}

impl Ledger {
    fn settle(&mut self, ids: &[String], kind: &'static str, fate: Fate) {
        for id in ids {
            self.rows.insert(id.clone(), (kind, fate.clone()));
        }
    }
}

/// One delivery of an event: the generation (relay incarnations plus
/// PostgreSQL restarts) it came in.
#[derive(Default)]
struct Received {
    deliveries: HashMap<String, Vec<u32>>,
    total: u64,
}

type Shared<T> = Arc<Mutex<T>>;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = args();
    let started = Instant::now();
    let cluster = tokio::task::spawn_blocking(|| {
        let c = Cluster::start();
        // A prepared transaction per writer and more; a WAL writer that
        // flushes asynchronous commits late, so that an immediate restart
        // loses some (and their transaction ids are used again).
        std::fs::OpenOptions::new()
            .append(true)
            .open(c.data_dir().join("postgresql.conf"))
            .and_then(|mut f| {
                use std::io::Write as _;
                f.write_all(
                    b"\n# stress\nmax_prepared_transactions = 100\nwal_writer_delay = '2s'\n",
                )
            })
            .expect("append to postgresql.conf");
        c.restart(StopMode::Fast);
        c
    })
    .await
    .unwrap();
    let cluster = Arc::new(cluster);
    let db = TestDb::on(&cluster).await;
    let url = db.url().to_owned();

    // The receiver.
    let generation = Arc::new(AtomicU32::new(0));
    let received: Shared<Received> = Arc::default();
    let port = receiver(
        Arc::clone(&received),
        Arc::clone(&generation),
        args.receiver_delay_ms,
    )
    .await;

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("relay.toml");
    std::fs::write(
        &config,
        format!(
            "[postgres]\nurl = \"{url}\"\nslot = \"{SLOT}\"\n\
             [sink]\nkind = \"webhook\"\n\
             [webhook]\nurl = \"http://127.0.0.1:{port}/events\"\nbatch = true\nmax_batch = 100\n\
             [poller]\ninterval = \"1s\"\ngrace = \"{}s\"\n[retry]\nmax = \"1s\"\n\
             [http]\nlisten = \"\"\n[log]\nlevel = \"info\"\n",
            args.grace
        ),
    )
    .unwrap();
    let config = config.to_str().unwrap().to_owned();
    let env = [("OUTBOX_RELAY__WEBHOOK__SECRET", SECRET)];
    let mut setup = RelayProcess::spawn(&["--config", &config, "setup", "--apply"], &env);
    let status = setup.wait_exit_async(Duration::from_secs(60)).await;
    assert!(
        status.is_some_and(|s| s.success()),
        "setup: {}",
        setup.stderr_text()
    );
    let sql = harness::connect(&url).await;
    let reader = StateReader::detect(&sql).await;
    eprintln!("stress: lifecycle read through {}", reader.describe());
    if args.require_derived && !matches!(reader, StateReader::View) {
        eprintln!("stress: the derived lifecycle is not in force (no outbox_state view): FAIL");
        std::process::exit(1);
    }
    let relay_log =
        std::env::temp_dir().join(format!("outbox-relay-stress-{}.log", std::process::id()));
    std::fs::write(&relay_log, "").unwrap();
    let mut relay = RelayProcess::spawn(&["--config", &config, "run"], &env);

    // The writers.
    let ledger: Shared<Ledger> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let gate: Gate = Arc::default();
    let mut writers = Vec::new();
    for w in 0..args.writers {
        writers.push(tokio::spawn(writer(
            w,
            url.clone(),
            Arc::clone(&ledger),
            Arc::clone(&stop),
            Arc::clone(&gate),
        )));
    }

    // The checker of rule (1), all along.
    let violations: Shared<Vec<(String, f64)>> = Arc::default();
    let checks = Arc::new(AtomicU64::new(0));
    let stop_checking = Arc::new(AtomicBool::new(false));
    let checker = {
        let (url, received, violations, checks, stop) = (
            url.clone(),
            Arc::clone(&received),
            Arc::clone(&violations),
            Arc::clone(&checks),
            Arc::clone(&stop_checking),
        );
        tokio::spawn(async move {
            let mut client: Option<Client> = None;
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep(CHECK_EVERY).await;
                if client.as_ref().is_none_or(|c| c.is_closed()) {
                    client = try_connect(&url).await;
                }
                let Some(c) = &client else { continue };
                let Ok(published) = reader.published(c).await else {
                    continue;
                };
                let r = received.lock().unwrap();
                let mut v = violations.lock().unwrap();
                for id in published {
                    if !r.deliveries.contains_key(&id) && !v.iter().any(|(x, _)| *x == id) {
                        eprintln!(
                            "stress: VIOLATION at {:.1} s: {id} reads PUBLISHED, never delivered",
                            started.elapsed().as_secs_f64()
                        );
                        v.push((id, started.elapsed().as_secs_f64()));
                    }
                }
                checks.fetch_add(1, Ordering::Relaxed);
            }
        })
    };

    // The driver: kills spread over the run, graceful stops half way between
    // them, the PostgreSQL restart between the first two kills.
    let mut events: Vec<(f64, &str)> = (1..=args.kills)
        .map(|i| {
            let at = args.seconds as f64 * i as f64 / (args.kills + 1) as f64;
            (at + fastrand::f64() * 2.0 - 1.0, "kill -9 relay")
        })
        .collect();
    events.extend((0..args.stops).map(|i| {
        let at = args.seconds as f64 * (i as f64 + 0.6) / (args.kills + 1) as f64;
        (at, "graceful stop of the relay")
    }));
    let mut stopped_pending: Vec<usize> = Vec::new();
    if args.pg_restart {
        events.push((
            args.seconds as f64 * 1.5 / (args.kills + 1) as f64,
            "postgres immediate restart",
        ));
    }
    events.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut faults: BTreeMap<&str, u32> = BTreeMap::new();
    let mut lost_async_burst = 0usize;
    for (at, kind) in &events {
        let wait = Duration::from_secs_f64(*at).saturating_sub(started.elapsed());
        tokio::time::sleep(wait).await;
        match *kind {
            "kill -9 relay" => {
                relay.kill9();
                keep_log(&relay_log, &relay);
                generation.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(fastrand::u64(0..1500))).await;
                relay = RelayProcess::spawn(&["--config", &config, "run"], &env);
            }
            "graceful stop of the relay" => {
                relay.sigterm();
                let exit = relay.wait_exit_async(Duration::from_secs(60)).await;
                keep_log(&relay_log, &relay);
                assert!(
                    exit.is_some_and(|s| s.success()),
                    "a graceful stop ended {exit:?}; log {}",
                    relay_log.display()
                );
                // While it is stopped: delivered rows that read PENDING (its
                // last pair did not cover them: parked prepared events, a stop
                // behind the stream). Informational; rule (1) is checked on.
                let checking = harness::connect(&url).await;
                let states = reader.states(&checking).await.unwrap();
                stopped_pending.push({
                    let r = received.lock().unwrap();
                    r.deliveries
                        .keys()
                        .filter(|id| states.get(*id).is_some_and(|s| s == "PENDING"))
                        .count()
                });
                generation.fetch_add(1, Ordering::SeqCst);
                // Stopped longer than the grace once: what it left and what
                // is written meanwhile are the next stream's alone.
                let pause = if stopped_pending.len() == 1 {
                    Duration::from_secs(args.grace + 2)
                } else {
                    Duration::from_millis(fastrand::u64(0..1500))
                };
                tokio::time::sleep(pause).await;
                relay = RelayProcess::spawn(&["--config", &config, "run"], &env);
            }
            _ => {
                // A burst of asynchronous commits right before the stop: some
                // are lost, and their ids come again after the restart.
                let alone = gate.write().await;
                lost_async_burst = async_burst(&url, &ledger).await;
                let c = Arc::clone(&cluster);
                tokio::task::spawn_blocking(move || c.restart(StopMode::Immediate))
                    .await
                    .unwrap();
                drop(alone);
                generation.fetch_add(1, Ordering::SeqCst);
            }
        }
        *faults.entry(kind).or_default() += 1;
        eprintln!("stress: {:>6.1} s  {kind}", started.elapsed().as_secs_f64());
    }
    let rest = Duration::from_secs(args.seconds).saturating_sub(started.elapsed());
    tokio::time::sleep(rest).await;
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }
    let wrote_for = started.elapsed();
    let sql = harness::connect(&url).await;
    // Prepared transactions a broken connection left behind: commit them.
    let left: Vec<String> = sql
        .query(
            "SELECT gid FROM pg_prepared_xacts WHERE gid LIKE 'stress-%'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    for gid in &left {
        sql.batch_execute(&format!("COMMIT PREPARED '{gid}'"))
            .await
            .unwrap();
        let mut l = ledger.lock().unwrap();
        for (_, fate) in l.rows.values_mut() {
            if *fate == Fate::Prepared(gid.clone()) {
                *fate = Fate::Committed { durable: true };
            }
        }
    }
    for (_, fate) in ledger.lock().unwrap().rows.values_mut() {
        if matches!(fate, Fate::Prepared(_)) {
            *fate = Fate::Unknown; // finished, but the answer was lost
        }
    }

    // Settle: every row in the table delivered, no delivered row PENDING.
    let settle_deadline = Instant::now() + Duration::from_secs(120 + 2 * args.grace.min(60));
    let (table, states) = loop {
        let table = table_rows(&sql).await;
        let states = reader.states(&sql).await.unwrap();
        let all_delivered = {
            let r = received.lock().unwrap();
            table.keys().all(|id| r.deliveries.contains_key(id))
        };
        let none_pending = states.values().all(|s| s != "PENDING");
        if (all_delivered && none_pending) || Instant::now() > settle_deadline {
            break (table, states);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let settled_in = wrote_for.abs_diff(started.elapsed());
    // One more check of rule (1) on the settled table.
    stop_checking.store(true, Ordering::Relaxed);
    checker.await.unwrap();
    let published = reader.published(&sql).await.unwrap();
    let poller_rounds = poller_published(&relay_log, &relay);
    relay.sigterm();
    let _ = relay.wait_exit_async(Duration::from_secs(30)).await;
    keep_log(&relay_log, &relay);

    // The checks.
    let received = received.lock().unwrap();
    let ledger = ledger.lock().unwrap();
    let mut v1: Vec<String> = violations
        .lock()
        .unwrap()
        .iter()
        .map(|(id, _)| id.clone())
        .collect();
    let during = v1.len();
    for id in &published {
        if !received.deliveries.contains_key(id) && !v1.contains(id) {
            v1.push(id.clone());
        }
    }
    // (2) delivered rows still PENDING; explicit marks by state.
    let mut still_pending = Vec::new();
    let mut by_state: BTreeMap<String, u64> = BTreeMap::new();
    for id in received.deliveries.keys() {
        if let Some(s) = states.get(id) {
            *by_state.entry(s.clone()).or_default() += 1;
            if s == "PENDING" {
                still_pending.push(id.clone());
            }
        }
    }
    // (3) lost rows, rolled-back rows delivered, phantoms, durable commits gone.
    let lost: Vec<&String> = table
        .keys()
        .filter(|id| !received.deliveries.contains_key(*id))
        .collect();
    let mut rolled_back_delivered = Vec::new();
    let mut rolled_back_in_table = Vec::new();
    let mut durable_missing = Vec::new();
    let mut async_missing = 0u64;
    let mut fates: BTreeMap<&str, u64> = BTreeMap::new();
    for (id, (_, fate)) in &ledger.rows {
        *fates
            .entry(match fate {
                Fate::Committed { durable: true } => "committed",
                Fate::Committed { durable: false } => "committed asynchronously",
                Fate::RolledBack => "rolled back",
                Fate::Prepared(_) => "prepared",
                Fate::Unknown => "unknown (connection lost)",
            })
            .or_default() += 1;
        match fate {
            Fate::RolledBack => {
                if received.deliveries.contains_key(id) {
                    rolled_back_delivered.push(id.clone());
                }
                if table.contains_key(id) {
                    rolled_back_in_table.push(id.clone());
                }
            }
            Fate::Committed { durable } if !table.contains_key(id) => {
                if *durable {
                    durable_missing.push(id.clone());
                } else {
                    async_missing += 1;
                }
            }
            _ => {}
        }
    }
    let phantoms: Vec<&String> = received
        .deliveries
        .keys()
        .filter(|id| !table.contains_key(*id))
        .collect();
    // (4) repeats by cause.
    let mut across_restarts = 0u64;
    let mut within_life = 0u64;
    let mut within_life_explicit = 0u64;
    for (id, gens) in &received.deliveries {
        for pair in gens.windows(2) {
            if pair[0] != pair[1] {
                across_restarts += 1;
            } else {
                within_life += 1;
                if states.get(id).is_some_and(|s| s != "PENDING")
                    && table
                        .get(id)
                        .is_some_and(|explicit| explicit == "PUBLISHED")
                {
                    within_life_explicit += 1;
                }
            }
        }
    }
    let unique = received.deliveries.len() as u64;
    let repeats = received.total - unique;
    let repeat_share = repeats as f64 / unique.max(1) as f64;
    let explicit_published = table.values().filter(|s| *s == "PUBLISHED").count();

    println!(
        "== stress summary ({:.0} s: {:.0} s of writes, settled in {:.1} s)",
        started.elapsed().as_secs_f64(),
        wrote_for.as_secs_f64(),
        settled_in.as_secs_f64()
    );
    println!("lifecycle               {}", reader.describe());
    println!("writers                 {}", args.writers);
    println!(
        "transactions            {}",
        ledger.transactions.values().sum::<u64>()
    );
    for (kind, n) in &ledger.transactions {
        println!("  {kind:<26}{n}");
    }
    println!("rows written            {}", ledger.rows.len());
    for (fate, n) in &fates {
        println!("  {fate:<26}{n}");
    }
    println!("rows in the table       {}", table.len());
    println!("faults                  {}", faults.values().sum::<u32>());
    for (kind, n) in &faults {
        println!("  {kind:<26}{n}");
    }
    if args.pg_restart {
        println!(
            "async commits lost      {async_missing} (the burst right before the restart committed {lost_async_burst})"
        );
    }
    println!(
        "deliveries              {} of {unique} rows",
        received.total
    );
    println!(
        "repeats                 {repeats} ({:.2} %; at most {:.0} %)",
        repeat_share * 100.0,
        MAX_REPEAT_SHARE * 100.0
    );
    println!("  across a restart      {across_restarts}");
    println!(
        "  within one relay life {within_life} (of rows explicitly PUBLISHED: {within_life_explicit})"
    );
    println!("poller published        {poller_rounds} (relay logs); rows explicitly PUBLISHED {explicit_published}");
    if args.stops > 0 {
        println!("delivered, PENDING while stopped {stopped_pending:?} (after each graceful stop)");
    }
    println!("delivered rows by state");
    for (s, n) in &by_state {
        println!("  {s:<26}{n}");
    }
    println!(
        "(1) published, not delivered   {} ({during} found during the run, {} checks)",
        v1.len(),
        checks.load(Ordering::Relaxed)
    );
    println!("(2) delivered, still PENDING   {}", still_pending.len());
    println!("(3) committed, not delivered   {}", lost.len());
    println!(
        "    rolled back, delivered     {} (in the table: {})",
        rolled_back_delivered.len(),
        rolled_back_in_table.len()
    );
    println!("    delivered, not in table    {}", phantoms.len());
    println!("    durable commit missing     {}", durable_missing.len());
    for (what, ids) in [
        ("published, not delivered", v1.iter().collect::<Vec<_>>()),
        ("delivered, still PENDING", still_pending.iter().collect()),
        ("committed, not delivered", lost.clone()),
        (
            "rolled back, delivered",
            rolled_back_delivered.iter().collect(),
        ),
        ("delivered, not in table", phantoms.clone()),
        ("durable commit missing", durable_missing.iter().collect()),
    ] {
        for id in ids.iter().take(5) {
            let kind = ledger.rows.get(*id).map_or("?", |(k, _)| k);
            println!("  {what}: {id} ({kind})");
        }
    }
    println!("relay logs              {}", relay_log.display());
    let ok = v1.is_empty()
        && still_pending.is_empty()
        && lost.is_empty()
        && rolled_back_delivered.is_empty()
        && rolled_back_in_table.is_empty()
        && phantoms.is_empty()
        && durable_missing.is_empty()
        && repeat_share <= MAX_REPEAT_SHARE
        && faults.get("kill -9 relay").copied().unwrap_or(0) == args.kills
        && faults
            .get("graceful stop of the relay")
            .copied()
            .unwrap_or(0)
            == args.stops
        && unique > 0
        && (!args.require_derived || matches!(reader, StateReader::View));
    println!(
        "result                  {}",
        if ok { "PASS" } else { "FAIL" }
    );
    drop(db);
    if !ok {
        std::process::exit(1);
    }
}

/// How the derived state is read: the `outbox_state` view setup creates, or
/// (before it exists) the explicit state alone (the `mark` lifecycle).
#[derive(Clone, Copy)]
enum StateReader {
    View,
    Explicit,
}

impl StateReader {
    async fn detect(sql: &Client) -> Self {
        let view: bool = sql
            .query_one("SELECT to_regclass('public.outbox_state') IS NOT NULL", &[])
            .await
            .unwrap()
            .get(0);
        if view {
            Self::View
        } else {
            Self::Explicit
        }
    }

    fn describe(&self) -> &'static str {
        match self {
            Self::View => "derived (the outbox_state view)",
            Self::Explicit => "explicit publish_state (no outbox_state view: mark)",
        }
    }

    fn relation(&self) -> &'static str {
        match self {
            Self::View => "outbox_state",
            Self::Explicit => "(SELECT *, publish_state AS state FROM outbox) AS o",
        }
    }

    /// The ids the state calls PUBLISHED.
    async fn published(&self, sql: &Client) -> Result<Vec<String>, tokio_postgres::Error> {
        let rows = sql
            .query(
                &format!(
                    "SELECT id::text FROM {} WHERE state = 'PUBLISHED'",
                    self.relation()
                ),
                &[],
            )
            .await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// Every row's state.
    async fn states(&self, sql: &Client) -> Result<HashMap<String, String>, tokio_postgres::Error> {
        let rows = sql
            .query(
                &format!("SELECT id::text, state FROM {}", self.relation()),
                &[],
            )
            .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }
}

/// Every row of the table: id → explicit `publish_state`.
async fn table_rows(sql: &Client) -> HashMap<String, String> {
    sql.query("SELECT id::text, publish_state FROM outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

async fn try_connect(url: &str) -> Option<Client> {
    let (c, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .ok()?;
    tokio::spawn(conn);
    Some(c)
}

/// The webhook receiver: after 0 to `delay_ms` ms, records every event of a
/// request before it answers 200, with the generation it came in. Returns its
/// port.
async fn receiver(received: Shared<Received>, generation: Arc<AtomicU32>, delay_ms: u64) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let (received, generation) = (Arc::clone(&received), Arc::clone(&generation));
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let (received, generation) =
                            (Arc::clone(&received), Arc::clone(&generation));
                        async move {
                            let body = req.into_body().collect().await.map(|b| b.to_bytes());
                            // The generation the request came in: a relay
                            // killed while it was held had sent it.
                            let g = generation.load(Ordering::SeqCst);
                            // Work takes time: events stay in flight (and are
                            // unconfirmed) for a while, as at a real destination.
                            tokio::time::sleep(Duration::from_millis(fastrand::u64(0..=delay_ms)))
                                .await;
                            let status = match body
                                .ok()
                                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                            {
                                Some(v) => {
                                    let events = match v {
                                        serde_json::Value::Array(events) => events,
                                        one => vec![one],
                                    };
                                    let mut r = received.lock().unwrap();
                                    for e in events {
                                        if let Some(id) = e["id"].as_str() {
                                            r.deliveries.entry(id.to_owned()).or_default().push(g);
                                            r.total += 1;
                                        }
                                    }
                                    200
                                }
                                None => 400,
                            };
                            let mut answer = hyper::Response::new(http_body_util::Empty::<
                                hyper::body::Bytes,
                            >::new(
                            ));
                            *answer.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
                            Ok::<_, Infallible>(answer)
                        }
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    port
}

const INSERT: &str = "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
                      VALUES ('stress', $1, $2, jsonb_build_object('kind', $2::text)) RETURNING id::text";

/// A writer: transactions of every kind, one after the other, on its own
/// connection (made again when it breaks), until `stop`.
async fn writer(w: usize, url: String, ledger: Shared<Ledger>, stop: Arc<AtomicBool>, gate: Gate) {
    let aggregate = format!("w{w}");
    let mut client: Option<Client> = None;
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(fastrand::u64(10..60))).await;
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            client = try_connect(&url).await;
            if client.is_none() {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        }
        let c = client.as_ref().unwrap();
        n += 1;
        let kind = match fastrand::u32(0..100) {
            0..35 => "plain",
            35..50 => "async commit",
            50..65 => "savepoints",
            65..68 => "over 64 savepoints",
            68..78 => "prepared",
            78..88 => "rollback",
            _ => "long",
        };
        *ledger.lock().unwrap().transactions.entry(kind).or_default() += 1;
        let gid = format!("stress-{w}-{n}");
        let _shared = gate.read().await;
        if transaction(c, &aggregate, kind, &gid, &ledger)
            .await
            .is_err()
        {
            let _ = c.batch_execute("ROLLBACK").await;
        }
    }
}

/// One transaction of `kind`; its rows go into the ledger with their fate
/// as soon as it is known (Unknown until then).
async fn transaction(
    c: &Client,
    aggregate: &str,
    kind: &'static str,
    gid: &str,
    ledger: &Shared<Ledger>,
) -> Result<(), tokio_postgres::Error> {
    let insert = |kind: &'static str| async move {
        let id: String = c.query_one(INSERT, &[&aggregate, &kind]).await?.get(0);
        ledger
            .lock()
            .unwrap()
            .settle(std::slice::from_ref(&id), kind, Fate::Unknown);
        Ok::<_, tokio_postgres::Error>(id)
    };
    let mut kept = Vec::new();
    let mut dropped = Vec::new();
    c.batch_execute("BEGIN").await?;
    match kind {
        "plain" => {
            for _ in 0..fastrand::usize(1..4) {
                kept.push(insert(kind).await?);
            }
        }
        "async commit" => {
            c.batch_execute("SET LOCAL synchronous_commit = off")
                .await?;
            kept.push(insert(kind).await?);
        }
        "savepoints" => {
            kept.push(insert(kind).await?);
            c.batch_execute("SAVEPOINT a").await?;
            kept.push(insert(kind).await?);
            c.batch_execute("RELEASE SAVEPOINT a").await?;
            c.batch_execute("SAVEPOINT b").await?;
            dropped.push(insert(kind).await?);
            c.batch_execute("ROLLBACK TO SAVEPOINT b").await?;
            kept.push(insert(kind).await?);
        }
        "over 64 savepoints" => {
            // More subtransactions than a backend caches (64): snapshots
            // taken meanwhile are suboverflowed.
            for i in 0..fastrand::usize(65..100) {
                c.batch_execute(&format!("SAVEPOINT s{i}")).await?;
                let id = insert(kind).await?;
                if i % 5 == 4 {
                    c.batch_execute(&format!("ROLLBACK TO SAVEPOINT s{i}"))
                        .await?;
                    dropped.push(id);
                } else {
                    kept.push(id);
                }
            }
        }
        "prepared" => {
            kept.push(insert(kind).await?);
            kept.push(insert(kind).await?);
            c.batch_execute(&format!("PREPARE TRANSACTION '{gid}'"))
                .await?;
            ledger
                .lock()
                .unwrap()
                .settle(&kept, kind, Fate::Prepared(gid.to_owned()));
            ledger
                .lock()
                .unwrap()
                .settle(&dropped, kind, Fate::RolledBack);
            // Held across status intervals, then finished.
            tokio::time::sleep(Duration::from_millis(fastrand::u64(0..3000))).await;
            if fastrand::u32(0..5) == 0 {
                c.batch_execute(&format!("ROLLBACK PREPARED '{gid}'"))
                    .await?;
                ledger.lock().unwrap().settle(&kept, kind, Fate::RolledBack);
            } else {
                c.batch_execute(&format!("COMMIT PREPARED '{gid}'")).await?;
                ledger
                    .lock()
                    .unwrap()
                    .settle(&kept, kind, Fate::Committed { durable: true });
            }
            return Ok(());
        }
        "rollback" => {
            dropped.push(insert(kind).await?);
            c.batch_execute("ROLLBACK").await?;
            ledger
                .lock()
                .unwrap()
                .settle(&dropped, kind, Fate::RolledBack);
            return Ok(());
        }
        "long" => {
            // Open across several status intervals (1 s).
            kept.push(insert(kind).await?);
            tokio::time::sleep(Duration::from_millis(fastrand::u64(2500..5000))).await;
            kept.push(insert(kind).await?);
        }
        _ => unreachable!(),
    }
    c.batch_execute("COMMIT").await?;
    let mut l = ledger.lock().unwrap();
    l.settle(
        &kept,
        kind,
        Fate::Committed {
            durable: kind != "async commit",
        },
    );
    l.settle(&dropped, kind, Fate::RolledBack);
    Ok(())
}

/// Asynchronous commits in a burst on a connection of its own, just before
/// an immediate stop: how many were written.
async fn async_burst(url: &str, ledger: &Shared<Ledger>) -> usize {
    let Some(c) = try_connect(url).await else {
        return 0;
    };
    let mut n = 0;
    for _ in 0..50 {
        if transaction(&c, "burst", "async commit", "", ledger)
            .await
            .is_err()
        {
            break;
        }
        n += 1;
    }
    n
}

/// Append what `relay` wrote to stderr to `path`.
fn keep_log(path: &std::path::Path, relay: &RelayProcess) {
    use std::io::Write as _;
    let mut file = std::fs::OpenOptions::new().append(true).open(path).unwrap();
    writeln!(file, "==== relay\n{}", relay.stderr_text()).unwrap();
}

/// Rows the poller published, from the "poller round" lines of every relay's
/// log (the kept ones and the running one's).
fn poller_published(path: &std::path::Path, relay: &RelayProcess) -> u64 {
    let text = std::fs::read_to_string(path).unwrap_or_default() + &relay.stderr_text();
    text.lines()
        .filter(|l| l.contains("poller round"))
        .filter_map(|l| {
            let at = l.find("published=")? + "published=".len();
            l[at..]
                .split(|ch: char| !ch.is_ascii_digit())
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}
