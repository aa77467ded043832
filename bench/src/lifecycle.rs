//! The lifecycles side by side (issue 30): what each costs the primary and
//! how soon the table has settled.
//!
//! Every contender drains a fresh backlog of `--lifecycle-rows` rows (the
//! table emptied, two new slots, one a copy of the other; the relay's is the
//! slot `setup` was configured with, made afresh without a position row,
//! because the view `outbox_state` derives states from that slot's row):
//! `pg_recvlogical`
//! drains one copy (the baseline, the rate at which PostgreSQL streams these
//! rows at all), then the relay the other, with
//!
//! * `none`: streaming alone (no poller, no retention), as in the drain;
//! * `mark`: every published row updated to `PUBLISHED`, poller and
//!   retention on; settled when no row is `publish_state = 'PENDING'`;
//! * `derive`: nothing written per row, the published state derived from the
//!   relay's confirmed snapshot, poller and retention on; settled when the
//!   slot has confirmed the backlog and the view `outbox_state` derives no
//!   row as `PENDING`. Run only when the table has the column `relay_txid`
//!   and the view (else printed as skipped).
//!
//! each through SNS `--sns-latency` away, and `derive` once more through
//! stdout. Before its backlog is written, each relay runs once on its slot
//! (started, streaming, stopped), as a deployed relay would have.
//!
//! The WAL a contender made the primary write is measured from the WAL insert
//! position just before it starts until it has settled and stopped; nothing
//! else writes meanwhile. The section runs with `full_page_writes = on` (the
//! test clusters turn it off; production never does): the backlog ends with a
//! CHECKPOINT, so the first change to each page after it carries the page's
//! image, a real cost of writing rows back. Autovacuum is off on the outbox
//! table meanwhile, so its work on the inserts is not counted as the relay's
//! (a lifecycle that leaves dead rows behind owes a vacuum later, not counted).

use std::time::Duration;

use anyhow::Context;

use super::{
    aws_env, backlog, reap, recvlogical, relay_config, run_relay_until, slots, sns, sns_sink,
    wait_confirmed, wal_lsn, Args, KillOnError, Settle, Usage, SETUP_SLOT,
};

/// What the relay does with a row once it is published (`[lifecycle]
/// on_published`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnPublished {
    None,
    Mark,
    Derive,
}

impl OnPublished {
    fn name(self) -> &'static str {
        match self {
            OnPublished::None => "none",
            OnPublished::Mark => "mark",
            OnPublished::Derive => "derive",
        }
    }

    fn settle(self) -> Settle {
        match self {
            OnPublished::None => Settle::Confirmed,
            OnPublished::Mark => Settle::Marked,
            OnPublished::Derive => Settle::Derived,
        }
    }
}

/// Where the relay publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sink {
    /// The bench's SNS endpoint `--sns-latency` away.
    Distant,
    /// Standard output, to /dev/null.
    Stdout,
}

const CONTENDERS: [(OnPublished, Sink); 4] = [
    (OnPublished::None, Sink::Distant),
    (OnPublished::Mark, Sink::Distant),
    (OnPublished::Derive, Sink::Distant),
    (OnPublished::Derive, Sink::Stdout),
];

/// One contender's drain of its own backlog, beside `pg_recvlogical`'s
/// drain of the same rows.
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
    pub(crate) name: String,
    /// The round it ran in (from 1).
    pub(crate) round: usize,
    pub(crate) rows: u64,
    /// WAL the backlog's inserts wrote.
    pub(crate) insert_wal: f64,
    pub(crate) baseline: Usage,
    pub(crate) usage: Usage,
    /// Wall time from the relay's start until the table had settled.
    pub(crate) settled: Option<Duration>,
    /// Where the two cores went while the relay drained.
    pub(crate) budget: Budget,
    /// Messages the endpoint received beyond one an event (SNS only).
    pub(crate) repeats: Option<u64>,
}

/// CPU spent while the relay ran, by the processes that share the machine
/// with it: the walsender streaming to it, the relay's SQL sessions'
/// backends (recording, the keeper, the poller, retention, the metrics'
/// counts), and the bench's own process, which is the SNS endpoint
/// (answering, parsing every body, counting) and the settle checks.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Budget {
    pub(crate) walsender: Duration,
    pub(crate) backends: Duration,
    pub(crate) bench: Duration,
}

/// This process's CPU time so far.
fn own_cpu() -> Duration {
    // SAFETY: getrusage fills the struct it is given.
    #[allow(unsafe_code)]
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let time = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    time(usage.ru_utime) + time(usage.ru_stime)
}

/// CPU time of process `pid` (utime + stime from `/proc/<pid>/stat`).
fn process_cpu(pid: i32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command's closing parenthesis: state is field 3, so
    // utime (14) and stime (15) are the 12th and 13th after it.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf reads a constant.
    #[allow(unsafe_code)]
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Some(Duration::from_micros(ticks * 1_000_000 / hz))
}

/// The CPU of the relay's walsenders and other backends (its sessions of
/// `application_name` in this database that started after `since`, a
/// server time in seconds since the epoch), sampled every 100 ms until
/// `done` is set: the last reading of each process (a restarted stream's
/// earlier walsenders are added; a backend that ended between two samples
/// counts up to its last; one that lived less than a sample is missed).
async fn watch_backends(
    sql: &tokio_postgres::Client,
    since: f64,
    application_name: &str,
    done: &std::sync::atomic::AtomicBool,
) -> (Duration, Duration) {
    // By process and start: a pid used again is another process.
    let mut last: std::collections::HashMap<(i32, u64), (bool, Duration)> = Default::default();
    while !done.load(std::sync::atomic::Ordering::Relaxed) {
        let rows = sql
            .query(
                "SELECT a.pid, extract(epoch FROM a.backend_start)::float8, a.backend_type = 'walsender' \
                 FROM pg_stat_activity a \
                 WHERE a.datname = current_database() AND a.application_name = $2 \
                   AND a.backend_start >= to_timestamp($1)",
                &[&since, &application_name],
            )
            .await
            .unwrap_or_default();
        for row in rows {
            let (pid, start, walsender): (i32, f64, bool) = (row.get(0), row.get(1), row.get(2));
            if let Some(cpu) = process_cpu(pid) {
                last.insert((pid, start.to_bits()), (walsender, cpu));
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    last.values().fold(
        (Duration::ZERO, Duration::ZERO),
        |(w, b), &(walsender, cpu)| {
            if walsender {
                (w + cpu, b)
            } else {
                (w, b + cpu)
            }
        },
    )
}

impl Outcome {
    fn rate(&self, wall: Duration) -> f64 {
        self.rows as f64 / wall.as_secs_f64()
    }

    /// Bytes of WAL a row written by `usage`'s process.
    pub(crate) fn wal_per_row(&self, usage: &Usage) -> f64 {
        usage.wal_bytes / self.rows as f64
    }

    /// Microseconds of CPU a row in `usage`'s process.
    pub(crate) fn cpu_per_row(&self, usage: &Usage) -> f64 {
        usage.cpu.as_secs_f64() * 1e6 / self.rows as f64
    }

    /// Cores the relay, its walsender and backends and the bench kept busy until the
    /// table had settled (the slot confirmed, for `none`): the CPU each spent
    /// until then (the relay's until it exited, a stop after the settling),
    /// over that time.
    fn cores(&self) -> f64 {
        (self.usage.cpu + self.budget.walsender + self.budget.backends + self.budget.bench)
            .as_secs_f64()
            / self.settled.unwrap_or(self.usage.wall).as_secs_f64()
    }

    fn insert_wal_per_row(&self) -> f64 {
        self.insert_wal / self.rows as f64
    }
}

/// Turns the primary into a production-like one for measuring WAL
/// (`full_page_writes = on`, autovacuum off on the outbox table), or back.
pub(crate) async fn measuring_wal(sql: &tokio_postgres::Client, on: bool) -> anyhow::Result<()> {
    // One statement a call: ALTER SYSTEM refuses to run in a transaction
    // block, and a multi-statement query is one.
    let statements: [&str; 3] = if on {
        [
            "ALTER SYSTEM SET full_page_writes = on",
            "SELECT pg_reload_conf()",
            "ALTER TABLE outbox SET (autovacuum_enabled = false)",
        ]
    } else {
        [
            "ALTER SYSTEM RESET full_page_writes",
            "SELECT pg_reload_conf()",
            "ALTER TABLE outbox RESET (autovacuum_enabled)",
        ]
    };
    for statement in statements {
        sql.batch_execute(statement).await?;
    }
    // The checkpointer takes the new setting on its reload.
    let want = if on { "on" } else { "off" };
    for _ in 0..50 {
        let now: String = sql
            .query_one("SELECT current_setting('full_page_writes')", &[])
            .await?
            .get(0);
        if now == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    Ok(())
}

/// Bytes of WAL between two LSNs.
pub(crate) async fn wal_between(
    sql: &tokio_postgres::Client,
    from: &str,
    to: &str,
) -> anyhow::Result<f64> {
    Ok(sql
        .query_one(
            "SELECT pg_wal_lsn_diff($2::text::pg_lsn, $1::text::pg_lsn)::float8",
            &[&from, &to],
        )
        .await?
        .get(0))
}

/// Starts the relay on `slot`, waits until it streams and has confirmed
/// what the server wrote meanwhile (its own start-up writes included), and
/// stops it.
pub(crate) async fn warm_start(
    relay: &std::path::Path,
    sql: &tokio_postgres::Client,
    config: &str,
    envs: &[(&'static str, String)],
    slot: &str,
) -> anyhow::Result<()> {
    let path = std::env::temp_dir().join(format!("outbox-relay-bench-{slot}-warm.toml"));
    std::fs::write(&path, config)?;
    let child = std::process::Command::new(relay)
        .arg("--config")
        .arg(&path)
        .arg("run")
        .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .context("spawn the relay")?;
    let pid = child.id() as libc::pid_t;
    let guard = KillOnError(pid);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let active: bool = sql
            .query_one(
                "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await?
            .get(0);
        if active {
            break;
        }
        if std::time::Instant::now() > deadline {
            anyhow::bail!("the relay did not stream from {slot} within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let lsn = wal_lsn(sql).await?;
    wait_confirmed(sql, slot, &lsn, Duration::from_secs(30), Some(pid)).await?;
    std::mem::forget(guard);
    // SAFETY: signalling our own child.
    #[allow(unsafe_code)]
    unsafe {
        libc::kill(pid, libc::SIGTERM);
    }
    tokio::task::spawn_blocking(move || reap(pid)).await??;
    Ok(())
}

/// Drops `slot` if it exists and the relay's position row for it, if any.
async fn fresh_slot(sql: &tokio_postgres::Client, slot: &str) -> anyhow::Result<()> {
    sql.execute(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
         WHERE slot_name = $1",
        &[&slot],
    )
    .await?;
    let position: bool = sql
        .query_one("SELECT to_regclass('outbox_position') IS NOT NULL", &[])
        .await?
        .get(0);
    if position {
        sql.execute("DELETE FROM outbox_position WHERE slot_name = $1", &[&slot])
            .await?;
    }
    Ok(())
}

/// The lifecycles' run: one [`Outcome`] per contender that ran.
pub(crate) async fn lifecycle(
    args: &Args,
    sql: &tokio_postgres::Client,
    url: &str,
    relay: &std::path::Path,
    pg_bin: &std::path::Path,
) -> anyhow::Result<Vec<Outcome>> {
    let rows = args.lifecycle_rows;
    let derive = super::derive_available(sql).await?;
    let endpoint = sns::Endpoint::start(args.distant()).await?;
    let distant = format!("SNS {:?}", args.sns_latency);
    println!(
        "\n== lifecycles side by side: {rows} rows a contender, each on a fresh backlog beside \
         pg_recvlogical on a copy of its slot; {distant} away (± {:.0} %) unless said; \
         full_page_writes on, autovacuum off on the outbox table",
        args.sns_jitter * 100.0
    );
    measuring_wal(sql, true).await?;
    let mut outcomes = Vec::new();
    let rounds = args.lifecycle_rounds.max(1);
    for round in 0..rounds {
        for turn in 0..CONTENDERS.len() {
            let i = (turn + round) % CONTENDERS.len();
            let (on, sink) = CONTENDERS[i];
            let key = format!(
                "{}-{}",
                on.name(),
                match sink {
                    Sink::Distant => "sns",
                    Sink::Stdout => "stdout",
                }
            );
            if !args.lifecycle_contenders.is_empty() && !args.lifecycle_contenders.contains(&key) {
                continue;
            }
            let name = format!(
                "relay, {}, {}",
                on.name(),
                match sink {
                    Sink::Distant => distant.as_str(),
                    Sink::Stdout => "stdout",
                }
            );
            if on == OnPublished::Derive && !derive {
                println!(
                    "{name}: skipped (not available: the outbox table has no column relay_txid \
                 or there is no view outbox_state)"
                );
                continue;
            }
            sql.batch_execute("TRUNCATE outbox").await?;
            // The relay's slot is the one `setup` was configured with: the view
            // `outbox_state` derives states from that slot's position row. Made
            // afresh, without a position row (a first install), for each.
            let names = [SETUP_SLOT.to_owned(), format!("bench_lc_recvlogical_{i}")];
            fresh_slot(sql, SETUP_SLOT).await?;
            slots(sql, &names).await?;
            let (relay_slot, recvlogical_slot) = (&names[0], &names[1]);
            let (sink_config, envs) = match sink {
                Sink::Distant => (sns_sink(&endpoint.url, "bench"), aws_env(&endpoint.url)),
                Sink::Stdout => ("[sink]\nkind = \"stdout\"\n".to_owned(), Vec::new()),
            };
            let config = match on {
                // Streaming alone, as in the drain: no poller, no retention.
                OnPublished::None => relay_config(
                    url,
                    relay_slot,
                    &format!("[http]\nlisten = \"\"\n{sink_config}"),
                ),
                // The default configuration but for the lifecycle named.
                OnPublished::Mark | OnPublished::Derive => format!(
                "[postgres]\nurl = \"{url}\"\nslot = \"{}\"\n[lifecycle]\non_published = \"{}\"\n\
                 [log]\nlevel = \"warn\"\n[http]\nlisten = \"\"\n{sink_config}",
                relay_slot,
                on.name()
            ),
            };
            warm_start(relay, sql, &config, &envs, relay_slot).await?;
            let start_lsn = wal_lsn(sql).await?;
            let end_lsn = backlog(
                sql,
                url,
                rows,
                args.per_tx,
                &start_lsn,
                &format!("lifecycle, {name}"),
            )
            .await?;
            let insert_wal = wal_between(sql, &start_lsn, &end_lsn).await?;
            let baseline = recvlogical(pg_bin, url, sql, recvlogical_slot, &end_lsn).await?;
            let (before, calls_before, _) = endpoint.counts.snapshot();
            let done = std::sync::atomic::AtomicBool::new(false);
            let bench_before = own_cpu();
            let since: f64 = sql
                .query_one("SELECT extract(epoch FROM clock_timestamp())::float8", &[])
                .await?
                .get(0);
            let (ran, (walsender, backends)) = tokio::join!(
                async {
                    let ran = run_relay_until(
                        relay,
                        sql,
                        &config,
                        &envs,
                        relay_slot,
                        &end_lsn,
                        on.settle(),
                        None,
                    )
                    .await;
                    done.store(true, std::sync::atomic::Ordering::Relaxed);
                    ran
                },
                // The application_name the relay's configuration leaves at its default.
                watch_backends(sql, since, "outbox-relay", &done),
            );
            let (usage, settled) = ran?;
            let budget = Budget {
                walsender,
                backends,
                bench: own_cpu().saturating_sub(bench_before),
            };
            let (after, calls_after, _) = endpoint.counts.snapshot();
            if sink == Sink::Distant && after - before < rows {
                anyhow::bail!(
                    "the endpoint received {} messages of {rows} ({name})",
                    after - before
                );
            }
            for slot in &names {
                sql.execute("SELECT pg_drop_replication_slot($1)", &[slot])
                    .await?;
            }
            let outcome = Outcome {
                name,
                round: round + 1,
                rows,
                insert_wal,
                baseline,
                usage,
                settled,
                budget,
                repeats: (sink == Sink::Distant).then(|| (after - before).saturating_sub(rows)),
            };
            print_line(&outcome);
            if sink == Sink::Distant {
                println!(
                    "  SNS endpoint: {} messages in {} calls",
                    after - before,
                    calls_after - calls_before
                );
            }
            outcomes.push(outcome);
        }
    }
    measuring_wal(sql, false).await?;
    let medians = medians(&outcomes);
    print_table(&outcomes, &medians);
    Ok(medians)
}

/// The ratio a contender is judged by: its settled rate over
/// `pg_recvlogical`'s on the same rows (its confirmed rate when it has no
/// settling).
fn judged(o: &Outcome) -> f64 {
    let base = o.rate(o.baseline.wall);
    o.rate(o.settled.unwrap_or(o.usage.wall)) / base
}

/// Each contender's median round (by [`judged`]), in the contenders' order.
fn medians(outcomes: &[Outcome]) -> Vec<Outcome> {
    let mut names: Vec<&str> = Vec::new();
    for o in outcomes {
        if !names.contains(&o.name.as_str()) {
            names.push(&o.name);
        }
    }
    names
        .iter()
        .filter_map(|name| {
            let mut rounds: Vec<&Outcome> = outcomes.iter().filter(|o| o.name == *name).collect();
            rounds.sort_by(|a, b| judged(a).total_cmp(&judged(b)));
            rounds.get(rounds.len() / 2).map(|o| (*o).clone())
        })
        .collect()
}

fn print_line(o: &Outcome) {
    let base = o.rate(o.baseline.wall);
    let confirmed = o.rate(o.usage.wall);
    let settled = o.settled.map_or(String::new(), |s| {
        format!(
            ", table settled {:.0} rows/s ({:.2}x)",
            o.rate(s),
            o.rate(s) / base
        )
    });
    println!(
        "{}: slot confirmed {confirmed:.0} rows/s ({:.2}x pg_recvlogical's {base:.0} on the same rows){settled}; \
         {:.2} µs CPU/event; {:.1} MiB peak RSS; WAL {:.1} B/event beyond the inserts' {:.0} ({:.1} %)",
        o.name,
        confirmed / base,
        o.cpu_per_row(&o.usage),
        o.usage.max_rss_kib as f64 / 1024.0,
        o.wal_per_row(&o.usage),
        o.insert_wal_per_row(),
        o.wal_per_row(&o.usage) / o.insert_wal_per_row() * 100.0,
    );
    let per_event = |d: Duration| d.as_secs_f64() * 1e6 / o.rows as f64;
    println!(
        "  round {}; CPU while it ran: relay {:.2}, walsender {:.2}, relay's SQL backends {:.2}, \
         bench (endpoint) {:.2} µs/event: {:.2} of 2 cores busy until settled{}",
        o.round,
        o.cpu_per_row(&o.usage),
        per_event(o.budget.walsender),
        per_event(o.budget.backends),
        per_event(o.budget.bench),
        o.cores(),
        o.repeats.map_or(String::new(), |r| format!(
            "; {r} messages beyond one an event"
        )),
    );
}

fn print_table(outcomes: &[Outcome], medians: &[Outcome]) {
    if outcomes.is_empty() {
        return;
    }
    let median = |f: &dyn Fn(&Outcome) -> f64| super::median(outcomes.iter().map(f).collect());
    println!(
        "\n{:<32} {:>11} {:>7} {:>11} {:>7} {:>9} {:>9} {:>11} {:>9} {:>8} {:>8} {:>8} {:>6}",
        "lifecycle contender",
        "confirmed/s",
        "x",
        "settled/s",
        "x",
        "µs CPU/ev",
        "peak MiB",
        "WAL B/event",
        "% inserts",
        "walsndr",
        "backends",
        "bench",
        "cores"
    );
    println!(
        "{:<32} {:>11.0} {:>7} {:>11} {:>7} {:>9.2} {:>9.1} {:>11.1} {:>8.1}%",
        "pg_recvlogical (median)",
        median(&|o| o.rate(o.baseline.wall)),
        "1.00x",
        "-",
        "-",
        median(&|o| o.cpu_per_row(&o.baseline)),
        median(&|o| o.baseline.max_rss_kib as f64 / 1024.0),
        median(&|o| o.wal_per_row(&o.baseline)),
        median(&|o| o.wal_per_row(&o.baseline) / o.insert_wal_per_row() * 100.0),
    );
    for o in medians {
        let base = o.rate(o.baseline.wall);
        let (settled, settled_x) = o.settled.map_or(("-".into(), "-".into()), |s| {
            (
                format!("{:.0}", o.rate(s)),
                format!("{:.2}x", o.rate(s) / base),
            )
        });
        let per_event = |d: Duration| d.as_secs_f64() * 1e6 / o.rows as f64;
        println!(
            "{:<32} {:>11.0} {:>7} {:>11} {:>7} {:>9.2} {:>9.1} {:>11.1} {:>8.1}% {:>8.2} {:>8.2} {:>8.2} {:>6.2}",
            o.name,
            o.rate(o.usage.wall),
            format!("{:.2}x", o.rate(o.usage.wall) / base),
            settled,
            settled_x,
            o.cpu_per_row(&o.usage),
            o.usage.max_rss_kib as f64 / 1024.0,
            o.wal_per_row(&o.usage),
            o.wal_per_row(&o.usage) / o.insert_wal_per_row() * 100.0,
            per_event(o.budget.walsender),
            per_event(o.budget.backends),
            per_event(o.budget.bench),
            o.cores(),
        );
    }
    println!(
        "(each contender's median round of {}, by its settled ratio; inserts' own WAL: {:.0} B/event, \
         median; x: against pg_recvlogical on the same backlog; walsndr, backends and bench: µs of CPU \
         an event of the walsender streaming to the relay, of the relay's SQL sessions' backends \
         (mark's updates, the keeper, the poller, retention) and of the bench's process, the SNS \
         endpoint; cores: all four over the time to settle)",
        outcomes.iter().map(|o| o.round).max().unwrap_or(1),
        median(&|o| o.insert_wal_per_row())
    );
    println!(
        "targets: derive through SNS, settled >= 0.9x and WAL <= 5 % of the inserts'; \
         derive through stdout, settled >= 1.0x; mark, settled >= 0.5x"
    );
}
