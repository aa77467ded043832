//! The chaos run (docs/chaos.md): a producer commits events continuously into
//! an outbox relayed to a FIFO SNS topic (moto) with a FIFO SQS queue, while a
//! driver injects faults at random: kill -9 of the relay (then a restart),
//! PostgreSQL restarts (fast and immediate), the SNS endpoint cut, and
//! throttling answers. A checker reads everything back from SQS and the table
//! and verifies: every committed event delivered at least once, each
//! aggregate's events in commit order, no row left PENDING (by the derived
//! state, the `outbox_state` view), every row it calls PUBLISHED received, the
//! slot caught up.
//!
//! ```sh
//! cargo run --release -p outbox-relay-tests --bin chaos -- 240   # seconds of faults
//! cargo run -p outbox-relay-tests --bin chaos -- --faults 10 --every-ms 100 --seconds 150
//! ```
//!
//! Arguments: `[SECONDS]` or `--seconds N` (how long faults are injected; with
//! `--faults`, the cap), `--faults M` (stop after M faults; the run fails if
//! the cap comes first), `--min-faults M` (the count the run requires: 20, or
//! M of `--faults`), `--recovery-wait S` (the most the driver waits for a
//! recovery before the next fault: 30), `--settle S` (the most the checker
//! waits, in all, for the slot, the queue and the derived state after the
//! producer stopped: 180), `--gap-ms LOW-HIGH` (the quiet time before each
//! fault: 2000-6000), `--every-ms N` (the producer's pause between two
//! events: 50, 20 a second).
//!
//! Exit 0 only when every check holds; the summary is printed either way.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use harness::{Cluster, FaultProxy, Mode, RelayProcess, StopMode, TestDb};

/// The share of events that may come twice: after crashes of the relay (what
/// was in flight) and restarts of PostgreSQL (at most a status interval,
/// thanks to the relay's own position).
const MAX_REPEAT_SHARE: f64 = 0.05;
const AGGREGATES: u64 = 12;

/// The share of rows that may end with an explicit `PUBLISHED` under the
/// derived lifecycle: the poller's and the stream's marks of rows in holes.
/// Under `mark` it is every row.
const MAX_EXPLICIT_SHARE: f64 = 0.5;

/// The faults, dealt from a shuffled deck holding each once: every kind comes
/// as often as the others (give or take one), however short the run.
const FAULT_KINDS: [&str; 5] = [
    "kill -9 relay",
    "postgres fast restart",
    "postgres immediate restart",
    "sns cut",
    "sns throttling",
];

struct Args {
    /// Seconds of faults; with `faults`, the cap.
    seconds: u64,
    /// Stop after this many faults.
    faults: Option<u32>,
    /// The run fails with fewer faults.
    min_faults: u32,
    /// The most the driver waits for a recovery before the next fault.
    recovery_wait: Duration,
    /// The most the checker waits, in all, once the producer stopped.
    settle: Duration,
    /// The quiet time before each fault, in milliseconds: drawn from this range.
    gap_ms: std::ops::Range<u64>,
    /// The producer's pause between two events, in milliseconds.
    every_ms: u64,
}

fn args() -> Args {
    let mut a = Args {
        seconds: 240,
        faults: None,
        min_faults: 20,
        recovery_wait: Duration::from_secs(30),
        settle: Duration::from_secs(180),
        gap_ms: 2000..6000,
        every_ms: 50,
    };
    let mut min_faults = None;
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut num = |name: &str| -> u64 {
            it.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{name} takes a number"))
        };
        match arg.as_str() {
            "--seconds" => a.seconds = num("--seconds"),
            "--faults" => a.faults = Some(num("--faults") as u32),
            "--min-faults" => min_faults = Some(num("--min-faults") as u32),
            "--recovery-wait" => a.recovery_wait = Duration::from_secs(num("--recovery-wait")),
            "--settle" => a.settle = Duration::from_secs(num("--settle")),
            "--every-ms" => a.every_ms = num("--every-ms").max(1),
            "--gap-ms" => {
                let range = it.next().unwrap_or_default();
                a.gap_ms = range
                    .split_once('-')
                    .and_then(|(lo, hi)| Some(lo.parse().ok()?..hi.parse().ok()?))
                    .filter(|r| !r.is_empty())
                    .unwrap_or_else(|| panic!("--gap-ms takes LOW-HIGH (milliseconds)"));
            }
            n if n.parse::<u64>().is_ok() => a.seconds = n.parse().unwrap(),
            other => panic!(
                "unknown argument {other:?} ([SECONDS] --seconds N --faults M --min-faults M --recovery-wait S --settle S --gap-ms LOW-HIGH --every-ms N)"
            ),
        }
    }
    a.min_faults = min_faults.or(a.faults).unwrap_or(a.min_faults);
    a
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = args();
    let started = Instant::now();
    let cluster = Arc::new(tokio::task::spawn_blocking(Cluster::start).await.unwrap());
    let db = TestDb::on(&cluster).await;
    let moto = harness::moto_endpoint().await;
    let topic =
        harness::topic_with_queue(moto.as_str(), &harness::unique_name("chaos"), true, true).await;
    let proxy = FaultProxy::start(moto.as_str());
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("relay.toml");
    std::fs::write(
        &config,
        format!(
            "[postgres]\nurl = \"{}\"\nslot = \"chaos\"\n[sink]\nkind = \"sns\"\n\
             [sns]\ntopic_arn = \"{}\"\nendpoint_url = \"{}\"\nregion = \"{}\"\nmax_in_flight_batches = 1\n\
             [poller]\ninterval = \"1s\"\ngrace = \"20s\"\n[retry]\nmax = \"2s\"\n\
             [http]\nlisten = \"\"\n[log]\nlevel = \"info\"\nformat = \"pretty\"\n",
            db.url(),
            topic.arn,
            proxy.endpoint(),
            harness::TEST_REGION
        ),
    )
    .unwrap();
    let config = config.to_str().unwrap().to_owned();
    let env: Vec<(&str, String)> = harness::aws_env(&proxy.endpoint());
    let env_refs = || {
        env.iter()
            .map(|(k, v)| (*k, v.as_str()))
            .collect::<Vec<_>>()
    };
    let mut setup = RelayProcess::spawn(&["--config", &config, "setup", "--apply"], &env_refs());
    assert!(
        setup
            .wait_exit_async(Duration::from_secs(60))
            .await
            .unwrap()
            .success(),
        "setup: {}",
        setup.stderr_text()
    );
    // The lifecycle in force: the derived one (the default) reads each row's
    // state from the `outbox_state` view setup creates; without the view the
    // table runs as `mark` and the run fails (it must prove the default).
    let derived: bool = harness::connect(db.url())
        .await
        .query_one("SELECT to_regclass('public.outbox_state') IS NOT NULL", &[])
        .await
        .unwrap()
        .get(0);
    let state_of = if derived {
        "outbox_state"
    } else {
        "(SELECT publish_state AS state, id FROM outbox) AS o"
    };
    let mut relay = RelayProcess::spawn(&["--config", &config, "run"], &env_refs());
    // Every relay's stderr, one after the other, for a look after the run (and
    // the poller's count); named by process, as runs may overlap.
    let relay_log =
        std::env::temp_dir().join(format!("outbox-relay-chaos-{}.log", std::process::id()));
    std::fs::write(&relay_log, "").unwrap();

    // The reader: drains the queue all along (moto's FIFO queues slow down as they fill).
    let received: Arc<Mutex<Vec<(String, u64, String)>>> = Arc::default();
    let stop_reading = Arc::new(AtomicBool::new(false));
    let reader = {
        let received = Arc::clone(&received);
        let stop = Arc::clone(&stop_reading);
        let sqs = harness::sqs_client(moto.as_str()).await;
        let queue = topic.queue_url.clone();
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                for m in harness::receive_all(&sqs, &queue, 0, Duration::from_millis(500)).await {
                    let v: serde_json::Value = serde_json::from_str(&m.body).unwrap();
                    received.lock().unwrap().push((
                        v["subject"].as_str().unwrap().to_owned(),
                        v["data"]["n"].as_u64().unwrap(),
                        v["id"].as_str().unwrap().to_owned(),
                    ));
                }
            }
        })
    };

    // The producer: one single-row transaction every `--every-ms` (50 ms: what
    // moto's FIFO queues pass with room to spare), reconnecting through restarts.
    let stop_producing = Arc::new(AtomicBool::new(false));
    let attempted = Arc::new(AtomicU64::new(0));
    let producer = {
        let url = db.url().to_owned();
        let stop = Arc::clone(&stop_producing);
        let attempted = Arc::clone(&attempted);
        let every = Duration::from_millis(args.every_ms);
        tokio::spawn(async move {
            let mut client: Option<tokio_postgres::Client> = None;
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep(every).await;
                if client.as_ref().is_none_or(|c| c.is_closed()) {
                    client = match tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
                        Ok((c, conn)) => {
                            tokio::spawn(conn);
                            Some(c)
                        }
                        Err(_) => continue,
                    };
                }
                n += 1;
                attempted.fetch_add(1, Ordering::Relaxed);
                let aggregate = format!("agg-{}", n % AGGREGATES);
                let _ = client
                    .as_ref()
                    .unwrap()
                    .execute(
                        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
                         VALUES ('order', $1, 'Changed', jsonb_build_object('n', $2::bigint))",
                        &[&aggregate, &(n as i64)],
                    )
                    .await;
            }
        })
    };

    // The driver.
    let mut faults: BTreeMap<&str, u32> = BTreeMap::new();
    let mut longest_recovery = Duration::ZERO;
    let mut unrecovered = 0u32;
    let sql_url = db.url().to_owned();
    let deadline = Instant::now() + Duration::from_secs(args.seconds);
    let mut deck: Vec<&str> = Vec::new();
    while Instant::now() < deadline && args.faults.is_none_or(|m| faults.values().sum::<u32>() < m)
    {
        tokio::time::sleep(Duration::from_millis(fastrand::u64(args.gap_ms.clone()))).await;
        if deck.is_empty() {
            deck = FAULT_KINDS.to_vec();
            fastrand::shuffle(&mut deck);
        }
        let kind = deck.pop().unwrap();
        match kind {
            "kill -9 relay" => {
                relay.kill9();
                keep_log(&relay_log, &relay);
                tokio::time::sleep(Duration::from_millis(fastrand::u64(0..2000))).await;
                relay = RelayProcess::spawn(&["--config", &config, "run"], &env_refs());
            }
            "postgres fast restart" | "postgres immediate restart" => {
                let mode = if kind.contains("fast") {
                    StopMode::Fast
                } else {
                    StopMode::Immediate
                };
                let c = Arc::clone(&cluster);
                tokio::task::spawn_blocking(move || c.restart(mode))
                    .await
                    .unwrap();
            }
            "sns cut" | "sns throttling" => {
                proxy.set_mode(if kind == "sns cut" {
                    Mode::Cut
                } else {
                    Mode::Throttle
                });
                tokio::time::sleep(Duration::from_millis(fastrand::u64(2000..6000))).await;
                proxy.set_mode(Mode::Pass);
            }
            _ => unreachable!(),
        }
        *faults.entry(kind).or_default() += 1;
        // Recovery: until the slot confirms what was written when the fault
        // ended, or `--recovery-wait` passes; then the next fault comes anyway
        // (the final check waits for everything).
        let ended = Instant::now();
        let recovered = wait_caught_up(&sql_url, args.recovery_wait).await;
        let took = ended.elapsed();
        longest_recovery = longest_recovery.max(took);
        if !recovered {
            unrecovered += 1;
        }
        eprintln!(
            "chaos: {:>5.1} s  {kind:<28} {} {:.1} s",
            started.elapsed().as_secs_f64(),
            if recovered {
                "recovered in"
            } else {
                "still behind after"
            },
            took.as_secs_f64()
        );
        if !relay.is_running() {
            eprintln!("chaos: the relay exited: {}", relay.stderr_text());
            break;
        }
    }
    stop_producing.store(true, Ordering::Relaxed);
    producer.await.unwrap();
    let faults_took = started.elapsed();
    // The settle: one deadline for the slot, the queue and the derived state.
    let settle_started = Instant::now();
    let settle_deadline = settle_started + args.settle;
    let left = || settle_deadline.saturating_duration_since(Instant::now());
    let caught_up = wait_caught_up(&sql_url, left()).await;

    // The truth: every committed row.
    let sql = harness::connect(&sql_url).await;
    let rows = sql
        .query(
            "SELECT id::text, aggregate_id, (payload->>'n')::bigint FROM outbox",
            &[],
        )
        .await
        .unwrap();
    let committed: HashMap<String, (String, u64)> = rows
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get::<_, i64>(2) as u64)))
        .collect();
    // Wait for the queue to hand out everything.
    loop {
        let ids: HashSet<String> = received
            .lock()
            .unwrap()
            .iter()
            .map(|r| r.2.clone())
            .collect();
        if committed.keys().all(|id| ids.contains(id)) || left().is_zero() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    stop_reading.store(true, Ordering::Relaxed);
    reader.await.unwrap();
    let pending = loop {
        let pending: i64 = sql
            .query_one(
                &format!("SELECT count(*) FROM {state_of} WHERE state <> 'PUBLISHED'"),
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if pending == 0 || left().is_zero() {
            break pending;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let settled_in = settle_started.elapsed();
    let lag: i64 = sql
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint \
             FROM pg_replication_slots WHERE slot_name = 'chaos'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    // The derived lifecycle was in force, not `mark` (which the relay falls
    // back to, warning, on a table that lacks what derive needs): a pair is
    // vouched for, and the rows carrying an explicit PUBLISHED are the
    // poller's and the few the stream marked in holes, not every row.
    let (vouched, explicit): (bool, i64) = {
        let row = sql
            .query_one(
                "SELECT (SELECT snapshot IS NOT NULL FROM outbox_position WHERE slot_name = 'chaos'), \
                        (SELECT count(*) FROM outbox WHERE publish_state = 'PUBLISHED')",
                &[],
            )
            .await
            .unwrap();
        (row.get::<_, Option<bool>>(0).unwrap_or(false), row.get(1))
    };
    relay.sigterm();
    let _ = relay.wait_exit_async(Duration::from_secs(30)).await;
    keep_log(&relay_log, &relay);

    // The checks.
    let received = received.lock().unwrap().clone();
    let unique: HashSet<&str> = received.iter().map(|r| r.2.as_str()).collect();
    // Every row the state calls PUBLISHED arrived (the derived rule's promise).
    let published_not_received = sql
        .query(
            &format!("SELECT id::text FROM {state_of} WHERE state = 'PUBLISHED'"),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .filter(|r| !unique.contains(r.get::<_, &str>(0)))
        .count();
    let lost: Vec<&String> = committed
        .keys()
        .filter(|id| !unique.contains(id.as_str()))
        .collect();
    let mut order_violations = 0;
    let mut last: HashMap<&str, u64> = HashMap::new();
    let mut seen: HashSet<&str> = HashSet::new();
    for (aggregate, n, id) in &received {
        if !seen.insert(id) {
            continue; // a repeat: at-least-once
        }
        if let Some(prev) = last.insert(aggregate, *n) {
            if prev > *n {
                order_violations += 1;
            }
        }
    }
    let total_faults: u32 = faults.values().sum();
    println!(
        "== chaos summary ({:.0} s)",
        started.elapsed().as_secs_f64()
    );
    println!(
        "faults for              {:.0} s, then settled in {:.1} s (at most {} s)",
        faults_took.as_secs_f64(),
        settled_in.as_secs_f64(),
        args.settle.as_secs()
    );
    println!("events committed        {}", committed.len());
    println!(
        "insert attempts         {}",
        attempted.load(Ordering::Relaxed)
    );
    println!("messages received       {}", received.len());
    let repeats = received.len() - unique.len();
    let repeat_share = repeats as f64 / unique.len().max(1) as f64;
    println!(
        "repeats                 {repeats} ({:.1} % of the events received; at most {:.0} %)",
        repeat_share * 100.0,
        MAX_REPEAT_SHARE * 100.0
    );
    println!("lost                    {}", lost.len());
    println!("order violations        {order_violations} (per aggregate, first deliveries)");
    println!(
        "faults injected         {total_faults} (at least {})",
        args.min_faults
    );
    for (kind, n) in &faults {
        println!("  {kind:<24}{n}");
    }
    println!(
        "longest recovery        {:.1} s{}",
        longest_recovery.as_secs_f64(),
        if unrecovered > 0 {
            format!(
                " ({unrecovered} faults still behind after {} s: the next came anyway)",
                args.recovery_wait.as_secs()
            )
        } else {
            String::new()
        }
    );
    println!(
        "lifecycle               {}",
        if derived {
            "derived (outbox_state)"
        } else {
            "explicit publish_state (no outbox_state view): FAIL"
        }
    );
    // moto's FIFO queue drops a repeat with the same deduplication id, so
    // the poller publishing again what the stream delivered is counted from
    // the relays' logs: with the derived lifecycle it takes only rows in a
    // hole (after a crash), a share of the events bounded like the repeats.
    let (poller_published, unread_rounds) = poller_published(&relay_log);
    let poller_share = poller_published as f64 / committed.len().max(1) as f64;
    println!(
        "poller published        {poller_published} ({:.1} % of the events; at most {:.0} %)",
        poller_share * 100.0,
        MAX_REPEAT_SHARE * 100.0
    );
    if unread_rounds > 0 {
        println!("poller rounds unread    {unread_rounds} (a `poller round` line without `published=N`): FAIL");
    }
    let explicit_share = explicit as f64 / committed.len().max(1) as f64;
    println!(
        "derived in force        {} (a vouched pair: {vouched}; rows marked PUBLISHED: {explicit}, \
         {:.1} % of the events; at most {:.0} %)",
        if vouched && explicit_share <= MAX_EXPLICIT_SHARE { "yes" } else { "no: FAIL" },
        explicit_share * 100.0,
        MAX_EXPLICIT_SHARE * 100.0
    );
    println!("rows not PUBLISHED      {pending}");
    println!("PUBLISHED, not received {published_not_received}");
    println!("slot lag at the end     {lag} bytes");
    println!("relay logs              {}", relay_log.display());
    let ok = lost.is_empty()
        && order_violations == 0
        && pending == 0
        && derived
        && vouched
        && explicit_share <= MAX_EXPLICIT_SHARE
        && unread_rounds == 0
        && published_not_received == 0
        && caught_up
        && total_faults >= args.min_faults
        && repeat_share <= MAX_REPEAT_SHARE
        && poller_share <= MAX_REPEAT_SHARE;
    println!(
        "result                  {}",
        if ok { "PASS" } else { "FAIL" }
    );
    drop(proxy);
    drop(db);
    if !ok {
        std::process::exit(1);
    }
}

/// Append what `relay` wrote to stderr to `path`.
fn keep_log(path: &std::path::Path, relay: &RelayProcess) {
    use std::io::Write as _;
    let mut file = std::fs::OpenOptions::new().append(true).open(path).unwrap();
    writeln!(file, "==== relay\n{}", relay.stderr_text()).unwrap();
}

/// Rows the poller published, from the `poller round` lines of the relays'
/// logs kept in `path`, and the number of such lines it could not read (a
/// changed wording must fail the run, not count as nothing published).
fn poller_published(path: &std::path::Path) -> (u64, usize) {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let counts: Vec<Option<u64>> = text
        .lines()
        .filter(|l| l.contains("poller round") && !l.contains("poller round failed"))
        .map(|l| {
            let at = l.find("published=")? + "published=".len();
            l[at..]
                .split(|ch: char| !ch.is_ascii_digit())
                .next()?
                .parse::<u64>()
                .ok()
        })
        .collect();
    (
        counts.iter().flatten().sum(),
        counts.iter().filter(|c| c.is_none()).count(),
    )
}

/// Until the slot confirms `pg_current_wal_lsn()` as it was when called (or `limit` passes).
async fn wait_caught_up(url: &str, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    let mut target: Option<String> = None;
    while Instant::now() < deadline {
        if let Ok((client, conn)) = tokio_postgres::connect(url, tokio_postgres::NoTls).await {
            tokio::spawn(conn);
            if target.is_none() {
                target = client
                    .query_one("SELECT pg_current_wal_lsn()::text", &[])
                    .await
                    .ok()
                    .map(|r| r.get(0));
            }
            if let Some(t) = &target {
                let done = client
                    .query_one(
                        "SELECT coalesce(confirmed_flush_lsn >= $1::text::pg_lsn, false) \
                         FROM pg_replication_slots WHERE slot_name = 'chaos'",
                        &[t],
                    )
                    .await
                    .map(|r| r.get::<_, bool>(0))
                    .unwrap_or(false);
                if done {
                    return true;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    false
}
