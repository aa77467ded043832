//! outbox-relay's benchmarks (docs/benchmarks.md), in one invocation:
//!
//! 1. **Drain**: an ephemeral cluster, a backlog of `--rows` outbox rows
//!    (`--per-tx` a transaction, ~500-byte JSON payloads), one slot per
//!    contender copied from one slot before the backlog (so all start at the
//!    same LSN). Each contender drains its slot alone: `pg_recvlogical`
//!    (pgoutput, proto_version 1, to /dev/null) as the baseline, the relay with
//!    the stdout sink to /dev/null, and the relay with the SNS sink against a
//!    local SNS endpoint ([`sns`]): answering at once, and `--sns-latency`
//!    away (a standard topic, and a FIFO topic; the backlog has 1,000
//!    aggregates, so 1,000 ordering groups); then, against the same endpoint
//!    `--sns-latency` away, the webhook sink (one event a request, and
//!    batches), the SQS sink (a standard queue and a FIFO queue), the
//!    EventBridge sink and the Kinesis sink. Default configuration but for
//!    the lifecycle (`none`: streaming alone). Printed: rows/s, client CPU
//!    seconds per million rows, peak RSS, messages per call at the endpoint,
//!    WAL written during the drain per row, and every ratio relay /
//!    pg_recvlogical.
//! 2. **Lifecycles** ([`lifecycle`]): for each of the relay with `none`,
//!    `mark` and `derive` (the last when the table has it) `--sns-latency`
//!    away, and `derive` through stdout, a fresh backlog of
//!    `--lifecycle-rows` drained by pg_recvlogical and by the relay: rows/s
//!    until the slot has confirmed and until the table has settled, CPU per
//!    event, peak RSS, and the WAL the relay made the primary write per
//!    event, beside the inserts' own.
//!    Then **Debezium** ([`debezium`]): Debezium 3.6's embedded engine on
//!    a backlog of `--debezium-rows`, beside pg_recvlogical and the relay
//!    (`--no-debezium` skips it, `--debezium` runs it with `--no-lifecycle`
//!    too).
//! 3. **Quota**: for each of `--quotas` (messages/s) and each of
//!    `--quota-bursts` (the size of the quota's token bucket, in seconds of
//!    it), a fresh backlog drained `--sns-latency` away from an endpoint that
//!    throttles above the quota: `--quota-seconds` at it, then
//!    `--raise-seconds` at `--quota-raise` times it, then no quota until the
//!    backlog is drained. Delivered messages against what the bucket gave,
//!    throttled calls, how soon the raised quota was found, lost messages.
//! 4. **Large rows**: for each of `--large-kib`, a fresh backlog of
//!    `--large-rows` rows with payloads of that many KiB (hex digests, not
//!    compressible), drained `--sns-latency` away with the default
//!    configuration, to a topic whose `MaximumMessageSize` is
//!    `--sns-max-message-size`, and also 1 MiB when the payload does not fit
//!    it: peak RSS, rows/s, messages at the endpoint, rows by state.
//! 5. **Steady state**: a producer commits single-row transactions at fixed
//!    rates while the relay streams to the endpoint `--sns-latency` away; p50,
//!    p99 and max of commit-to-confirmed-publish latency from the relay's own
//!    histogram, and the relay's concurrency limit.
//!
//! Figures, not assertions: this machine is shared and noisy, so compare the
//! ratios, which are measured in the same run.

mod debezium;
mod lifecycle;
mod sns;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use harness::Cluster;

/// Command line.
#[derive(Debug, Parser)]
#[command(
    name = "outbox-relay-bench",
    about = "Benchmarks of outbox-relay against pg_recvlogical"
)]
struct Args {
    /// Backlog rows for the drain.
    #[arg(long, default_value_t = 1_000_000)]
    rows: u64,
    /// Rows per transaction in the backlog.
    #[arg(long, default_value_t = 1_000)]
    per_tx: u64,
    /// Steady-state commit rates (single-row transactions per second); `max`
    /// commits as fast as the producer can.
    #[arg(long, value_delimiter = ',', default_value = "1000,5000,max")]
    rates: Vec<String>,
    /// Seconds measured at each steady-state rate (after 2 s of warm-up).
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Drain rounds: each drains the backlog once per contender, in turn;
    /// the figures printed are the medians (ratios: the median of each
    /// round's ratio, both measured minutes apart at most).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Skip the drain.
    #[arg(long)]
    no_drain: bool,
    /// Skip the steady state.
    #[arg(long)]
    no_steady: bool,
    /// The modelled distance to SNS: each answer leaves this long after its call.
    #[arg(long, default_value = "20ms", value_parser = duration)]
    sns_latency: Duration,
    /// Each answer's latency varies uniformly within ± this fraction.
    #[arg(long, default_value_t = 0.1)]
    sns_jitter: f64,
    /// The quota runs' quotas, messages/s; calls above one are throttled.
    #[arg(
        long,
        alias = "sns-quota",
        value_delimiter = ',',
        default_value = "300,1000,3000,10000,30000"
    )]
    quotas: Vec<f64>,
    /// The sizes of the quota's token bucket, in seconds of the quota (AWS
    /// publishes none): each quota runs with each.
    #[arg(long, value_delimiter = ',', default_value = "0.1,1,5")]
    quota_bursts: Vec<f64>,
    /// Seconds at each quota, from the relay's first call.
    #[arg(long, default_value_t = 30)]
    quota_seconds: u64,
    /// The quota is then multiplied by this...
    #[arg(long, default_value_t = 2.0)]
    quota_raise: f64,
    /// ...for this many seconds; then it is lifted and the rest drained.
    #[arg(long, default_value_t = 15)]
    raise_seconds: u64,
    /// The topics' `MaximumMessageSize` that the SNS endpoint answers
    /// `GetTopicAttributes` with, bytes (SNS: 1024 to 1048576).
    #[arg(long, default_value_t = sns::DEFAULT_MAX_MESSAGE_SIZE)]
    sns_max_message_size: usize,
    /// Backlog rows for each contender of the lifecycle run (none, mark,
    /// derive).
    #[arg(long, default_value_t = 200_000)]
    lifecycle_rows: u64,
    /// Rounds of the lifecycle run: each runs every contender once (in an
    /// order turned by one each round), each on a fresh backlog beside
    /// `pg_recvlogical`; the table gives each contender's median.
    #[arg(long, default_value_t = 3)]
    lifecycle_rounds: usize,
    /// Run only these lifecycle contenders: none-sns, mark-sns, derive-sns,
    /// derive-stdout. Default: all.
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = ["none-sns", "mark-sns", "derive-sns", "derive-stdout"]
    )]
    lifecycle_contenders: Vec<String>,
    /// Skip the lifecycle run.
    #[arg(long)]
    no_lifecycle: bool,
    /// Run Debezium's embedded engine (default: after the lifecycle run, when
    /// java and javac are on the PATH; with this flag also with
    /// `--no-lifecycle`, and fail when it cannot run).
    #[arg(long, overrides_with = "no_debezium")]
    debezium: bool,
    /// Skip Debezium.
    #[arg(long, overrides_with = "debezium")]
    no_debezium: bool,
    /// Backlog rows for Debezium (and pg_recvlogical and the relay beside
    /// it): long enough to show its rate once its JIT has warmed up.
    #[arg(long, default_value_t = 400_000)]
    debezium_rows: u64,
    /// Rounds of the Debezium run: each writes a fresh backlog and drains it
    /// with pg_recvlogical, the relay and Debezium; the ratios printed are
    /// the medians of each round's (one JVM's run moves by a fifth from one
    /// round to the next).
    #[arg(long, default_value_t = 3)]
    debezium_rounds: usize,
    /// The JVM's options for Debezium (heap, collector), split on spaces.
    #[arg(
        long,
        default_value = "-Xms64m -Xmx512m -XX:+UseG1GC",
        allow_hyphen_values = true
    )]
    debezium_jvm_options: String,
    /// Debezium's records through the outbox EventRouter SMT (as its outbox
    /// pattern is deployed, comparable to the relay's envelope), or plain
    /// change events.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    debezium_event_router: bool,
    /// Where the Debezium wheel, its jars and the compiled drain program are
    /// kept (default: ~/.cache/outbox-relay-bench/debezium).
    #[arg(long)]
    debezium_cache: Option<PathBuf>,
    /// Skip the quota run.
    #[arg(long)]
    no_quota: bool,
    /// Rows of each large-row drain.
    #[arg(long, default_value_t = 5_000)]
    large_rows: u64,
    /// Payload sizes of the large-row drains, KiB.
    #[arg(long, value_delimiter = ',', default_value = "64,256")]
    large_kib: Vec<u64>,
    /// Skip the large-row drains.
    #[arg(long)]
    no_large: bool,
    /// The relay binary (default: target/release/outbox-relay next to this one).
    #[arg(long)]
    relay: Option<PathBuf>,
    /// Another relay binary (an earlier build) to drain beside the SNS RTT
    /// contender in every round, for a before/after in one invocation.
    #[arg(long)]
    baseline_relay: Option<PathBuf>,
    /// Drain only these contenders (and pg_recvlogical): stdout, sns, snsrtt,
    /// snsfifo, webhook, webhookbatch, sqs, sqsfifo, eventbridge, kinesis,
    /// kinesisloose. Default: all.
    #[arg(long, value_delimiter = ',')]
    contenders: Vec<String>,
}

impl Args {
    /// The SNS endpoint `--sns-latency` away (± `--sns-jitter`), no quota,
    /// topics of `--sns-max-message-size`.
    fn distant(&self) -> sns::Model {
        sns::Model {
            latency: self.sns_latency,
            jitter: self.sns_jitter,
            quota: None,
            burst: sns::DEFAULT_BURST,
            max_message_size: self.sns_max_message_size,
        }
    }
}

fn duration(text: &str) -> Result<Duration, String> {
    outbox_relay::parse_duration(text)
}

/// What one process cost.
#[derive(Debug, Clone, Copy)]
struct Usage {
    wall: Duration,
    cpu: Duration,
    max_rss_kib: i64,
    /// WAL the server wrote from just before the process started until it
    /// had stopped (nothing else writes meanwhile): what it made the
    /// primary write.
    wal_bytes: f64,
}

/// The server's WAL insert position.
async fn wal_lsn(sql: &tokio_postgres::Client) -> anyhow::Result<String> {
    Ok(sql
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await?
        .get(0))
}

/// Bytes of WAL written since `lsn` (from [`wal_lsn`]).
async fn wal_since(sql: &tokio_postgres::Client, lsn: &str) -> anyhow::Result<f64> {
    Ok(sql
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), $1::text::pg_lsn)::float8",
            &[&lsn],
        )
        .await?
        .get(0))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let relay = args.relay.clone().unwrap_or_else(|| {
        std::env::current_exe()
            .expect("own path")
            .with_file_name("outbox-relay")
    });
    if !relay.exists() {
        bail!(
            "no relay binary at {}: build it with `cargo build --release -p outbox-relay` (scripts/bench.sh does)",
            relay.display()
        );
    }
    let pg_bin = harness::pg_bin();
    let cluster = Arc::new(
        tokio::task::spawn_blocking(|| {
            let cluster = Cluster::start();
            // Room for the backlog without checkpoints in the middle of a run,
            // status updates every 200 ms from the relay (half of this), and a
            // slot per drain contender and round (13 a round).
            let conf = cluster.data_dir().join("postgresql.conf");
            let mut text = std::fs::read_to_string(&conf).expect("postgresql.conf");
            text.push_str(
                "\n# outbox-relay bench\nmax_wal_size = '16GB'\ncheckpoint_timeout = '1h'\n\
                 wal_sender_timeout = '400ms'\nmax_replication_slots = 64\nmax_wal_senders = 16\n",
            );
            std::fs::write(&conf, text).expect("postgresql.conf");
            cluster.restart(harness::StopMode::Fast);
            cluster
        })
        .await?,
    );
    let url = cluster.url_for("bench");
    let admin = harness::connect(&cluster.admin_url()).await;
    admin.batch_execute("CREATE DATABASE bench").await?;
    let sql = harness::connect(&url).await;
    let setup_config = relay_config(&url, SETUP_SLOT, "[sink]\nkind = \"stdout\"\n");
    let config = outbox_relay::Config::from_parts(
        &setup_config,
        std::path::Path::new("bench.toml"),
        std::iter::empty(),
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let files = outbox_relay::setup::render(&config, "outbox_relay", false)?;
    let files: Vec<_> = files.into_iter().collect();
    outbox_relay::setup::apply(&sql, &files)
        .await
        .map_err(|(file, e)| anyhow::anyhow!("setup {file}: {e:?}"))?;
    println!(
        "outbox-relay bench: PostgreSQL on 127.0.0.1:{}, relay {}",
        cluster.port(),
        relay.display()
    );

    if !args.no_drain {
        drain(&args, &sql, &url, &relay, &pg_bin, &cluster).await?;
    }
    let mut lifecycles = Vec::new();
    if !args.no_lifecycle {
        lifecycles = lifecycle::lifecycle(&args, &sql, &url, &relay, &pg_bin).await?;
    }
    if !args.no_debezium && (!args.no_lifecycle || args.debezium) {
        debezium::section(
            &args,
            &sql,
            &url,
            cluster.port(),
            &relay,
            &pg_bin,
            &lifecycles,
        )
        .await?;
    }
    if !args.no_quota {
        quota(&args, &sql, &url, &relay).await?;
    }
    if !args.no_large {
        large(&args, &sql, &url, &relay, &pg_bin).await?;
    }
    if !args.no_steady {
        steady(&args, &sql, &url, &relay).await?;
    }
    Ok(())
}

/// The slot of the configuration `setup` renders the bench's SQL from (it
/// creates the slot, and the view `outbox_state` derives states from the
/// position row of this slot).
const SETUP_SLOT: &str = "bench";

/// The `[sink]` and `[sns]` sections for `endpoint`, publishing to `topic`
/// (a name; `.fifo` makes it a FIFO topic).
fn sns_sink(endpoint: &str, topic: &str) -> String {
    format!(
        "[sink]\nkind = \"sns\"\n[sns]\nregion = \"us-east-1\"\n\
         endpoint_url = \"{endpoint}\"\ntopic_arn = \"arn:aws:sns:us-east-1:123456789012:{topic}\"\n"
    )
}

/// The relay's configuration for the bench: stream only, on `slot`.
fn relay_config(url: &str, slot: &str, extra: &str) -> String {
    format!(
        "[postgres]\nurl = \"{url}\"\nslot = \"{slot}\"\n\
         [lifecycle]\non_published = \"none\"\n[poller]\nenabled = false\n\
         [retention]\nenabled = false\n[log]\nlevel = \"warn\"\n{extra}\n"
    )
}

const PAYLOAD: &str = "jsonb_build_object(\
    'order_id', n, 'customer_id', 'customer-' || (n % 5000), 'currency', 'EUR', \
    'total', (n % 1000) * 1.5, 'placed_at', '2026-11-22T10:00:00Z', \
    'lines', jsonb_build_array(\
        jsonb_build_object('sku', 'sku-' || (n % 300), 'quantity', 1 + n % 5, 'price', 9.99), \
        jsonb_build_object('sku', 'sku-' || (n % 700), 'quantity', 1, 'price', 24.5)), \
    'note', repeat(md5(n::text), 8))";

/// Create `names[0]` and copy it to the other names (one start LSN); the
/// slots' start LSN.
async fn slots(sql: &tokio_postgres::Client, names: &[String]) -> anyhow::Result<String> {
    let first = &names[0];
    sql.execute(
        "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
        &[first],
    )
    .await?;
    for name in &names[1..] {
        sql.execute(
            "SELECT pg_copy_logical_replication_slot($1, $2)",
            &[first, name],
        )
        .await?;
    }
    Ok(sql
        .query_one(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[first],
        )
        .await?
        .get(0))
}

/// Commit a backlog of `rows` (`per_tx` a transaction, from two
/// connections) of [`PAYLOAD`]s, print what it is, checkpoint; the LSN after it.
async fn backlog(
    sql: &tokio_postgres::Client,
    url: &str,
    rows: u64,
    per_tx: u64,
    start_lsn: &str,
    what: &str,
) -> anyhow::Result<String> {
    backlog_of(sql, url, rows, per_tx, PAYLOAD, start_lsn, what).await
}

/// [`backlog`] with `payload`, an SQL expression of the row number `n`.
async fn backlog_of(
    sql: &tokio_postgres::Client,
    url: &str,
    rows: u64,
    per_tx: u64,
    payload: &str,
    start_lsn: &str,
    what: &str,
) -> anyhow::Result<String> {
    let loading = Instant::now();
    let txs = rows.div_ceil(per_tx);
    let insert = format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
         SELECT 'order', 'order-' || (n % 1000), 'OrderPlaced', {payload} \
         FROM generate_series($1::bigint, $2::bigint) AS n"
    );
    // Two loaders (one per core); each statement is one transaction.
    let mut loaders = Vec::new();
    for part in 0..2u64 {
        let url = url.to_owned();
        let insert = insert.clone();
        loaders.push(tokio::spawn(async move {
            let client = harness::connect(&url).await;
            let statement = client.prepare(&insert).await?;
            let mut tx = part;
            while tx < txs {
                let first = (tx * per_tx) as i64;
                let last = (((tx + 1) * per_tx).min(rows) - 1) as i64;
                client.execute(&statement, &[&first, &last]).await?;
                tx += 2;
            }
            anyhow::Ok(())
        }));
    }
    for loader in loaders {
        loader.await??;
    }
    let end_lsn: String = sql
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .get(0);
    let row = sql
        .query_one(
            "SELECT count(*), avg(octet_length(payload::text))::float8, \
             pg_wal_lsn_diff($1::text::pg_lsn, $2::text::pg_lsn)::float8 FROM outbox",
            &[&end_lsn, &start_lsn],
        )
        .await?;
    let (count, payload, wal): (i64, f64, f64) = (row.get(0), row.get(1), row.get(2));
    println!(
        "\n== {what}: {count} rows in {txs} transactions, payload {payload:.0} bytes on average, \
         {:.0} MiB of WAL, loaded in {:.1} s",
        wal / 1048576.0,
        loading.elapsed().as_secs_f64()
    );
    sql.batch_execute("CHECKPOINT").await?;
    Ok(end_lsn)
}

/// pg_recvlogical draining `slot` to `end_lsn`; what it cost.
async fn recvlogical(
    pg_bin: &std::path::Path,
    url: &str,
    sql: &tokio_postgres::Client,
    slot: &str,
    end_lsn: &str,
) -> anyhow::Result<Usage> {
    let before = wal_lsn(sql).await?;
    let usage = run_to_exit(
        Command::new(pg_bin.join("pg_recvlogical"))
            .arg("--dbname")
            .arg(url)
            .args([
                "--slot",
                slot,
                "--start",
                "--no-loop",
                "--option=proto_version=1",
                "--option=publication_names=outbox_relay",
                "--file=/dev/null",
                "--status-interval=1",
            ])
            .arg(format!("--endpos={end_lsn}")),
    )
    .await?;
    wait_confirmed(sql, slot, end_lsn, Duration::from_secs(30), None).await?;
    Ok(Usage {
        wal_bytes: wal_since(sql, &before).await?,
        ..usage
    })
}

/// The network contenders of the drain: name, destination (an SNS topic, a
/// webhook and its mode, or another sink: [`network_sink`]). The first
/// answers at once, the others `--sns-latency` away.
const NETWORK_CONTENDERS: [(&str, &str); 10] = [
    ("relay, SNS 0 ms", "bench"),
    ("relay, SNS RTT", "bench"),
    ("relay, SNS RTT, FIFO", "bench.fifo"),
    ("relay, webhook RTT", "webhook"),
    ("relay, webhook RTT, batch", "webhook-batch"),
    ("relay, SQS RTT", "sqs"),
    ("relay, SQS RTT, FIFO", "sqs-fifo"),
    ("relay, EventBridge RTT", "eventbridge"),
    ("relay, Kinesis RTT", "kinesis"),
    ("relay, Kinesis RTT, strict_order off", "kinesis-loose"),
];

/// The `[sink]` section and the destination's for `destination` (a
/// [`NETWORK_CONTENDERS`] entry) at `endpoint`. Each names the endpoint
/// itself (`endpoint_url`) besides the environment's `AWS_ENDPOINT_URL`;
/// everything else is the sink's default (Kinesis: `strict_order = true`,
/// at most one record of a group a call; `kinesis-loose` sets it `false`,
/// to show what that costs).
fn network_sink(endpoint: &str, destination: &str) -> String {
    let aws = format!("region = \"us-east-1\"\nendpoint_url = \"{endpoint}\"\n");
    match destination {
        "webhook" | "webhook-batch" => format!(
            "[sink]\nkind = \"webhook\"\n[webhook]\nurl = \"{endpoint}/hook\"\n\
             secret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"\nbatch = {}\n",
            destination == "webhook-batch"
        ),
        "sqs" | "sqs-fifo" => {
            let fifo = if destination == "sqs-fifo" {
                ".fifo"
            } else {
                ""
            };
            format!("[sink]\nkind = \"sqs\"\n[sqs]\n{aws}queue_url = \"{endpoint}/123456789012/bench{fifo}\"\n")
        }
        "eventbridge" => {
            format!("[sink]\nkind = \"eventbridge\"\n[eventbridge]\n{aws}bus = \"bench\"\n")
        }
        "kinesis" | "kinesis-loose" => format!(
            "[sink]\nkind = \"kinesis\"\n[kinesis]\n{aws}stream = \"bench\"\nstrict_order = {}\n",
            destination == "kinesis"
        ),
        topic => sns_sink(endpoint, topic),
    }
}

async fn drain(
    args: &Args,
    sql: &tokio_postgres::Client,
    url: &str,
    relay: &std::path::Path,
    pg_bin: &std::path::Path,
    cluster: &Cluster,
) -> anyhow::Result<()> {
    let rounds = args.rounds.max(1);
    // Slots `bench_<contender>_<round>`, all copies of the first: one start LSN.
    let all = [
        "recvlogical",
        "stdout",
        "sns",
        "snsrtt",
        "snsfifo",
        "webhook",
        "webhookbatch",
        "sqs",
        "sqsfifo",
        "eventbridge",
        "kinesis",
        "kinesisloose",
    ];
    for name in &args.contenders {
        if !all[1..].contains(&name.as_str()) {
            bail!(
                "--contenders: no contender {name} (one of {})",
                all[1..].join(", ")
            );
        }
    }
    let runs = |contender: &str| {
        contender == "recvlogical"
            || args.contenders.is_empty()
            || args.contenders.iter().any(|c| c == contender)
    };
    let baseline = args.baseline_relay.as_deref();
    let mut contenders: Vec<&str> = all.iter().copied().filter(|c| runs(c)).collect();
    if baseline.is_some() {
        contenders.push("snsrttbase");
    }
    let slot = |contender: &str, round: usize| format!("bench_{contender}_{round}");
    let names: Vec<String> = (0..rounds)
        .flat_map(|round| contenders.iter().map(move |c| slot(c, round)))
        .collect();
    let start_lsn = slots(sql, &names).await?;
    let end_lsn = backlog(sql, url, args.rows, args.per_tx, &start_lsn, "drain").await?;
    let rows = args.rows;

    let local = sns::Endpoint::start(sns::Model {
        max_message_size: args.sns_max_message_size,
        ..sns::Model::LOCAL
    })
    .await?;
    let distant = sns::Endpoint::start(args.distant()).await?;
    println!(
        "SNS endpoints: local (answers at once) and {:?} away (± {:.0} %)",
        args.sns_latency,
        args.sns_jitter * 100.0
    );
    if let Some(baseline) = baseline {
        println!(
            "relay (baseline): {}, drained to the endpoint {:?} away after the SNS RTT contender",
            baseline.display(),
            args.sns_latency
        );
    }
    let (mut recvlogicals, mut stdouts, mut baselines) = (Vec::new(), Vec::new(), Vec::new());
    let mut snss: [Vec<Usage>; NETWORK_CONTENDERS.len()] = Default::default();
    // Messages and calls at the endpoint, per contender, over the rounds.
    let mut traffic = [(0u64, 0u64); NETWORK_CONTENDERS.len()];
    let mut baseline_traffic = (0u64, 0u64);
    for round in 0..rounds {
        recvlogicals
            .push(recvlogical(pg_bin, url, sql, &slot("recvlogical", round), &end_lsn).await?);

        if runs("stdout") {
            let stdout_slot = slot("stdout", round);
            stdouts.push(
                run_relay(
                    relay,
                    sql,
                    &relay_config(
                        url,
                        &stdout_slot,
                        "[sink]\nkind = \"stdout\"\n[http]\nlisten = \"\"\n",
                    ),
                    &[],
                    &stdout_slot,
                    &end_lsn,
                )
                .await?,
            );
        }

        for (i, ((name, destination), contender)) in
            NETWORK_CONTENDERS.iter().zip(&all[2..]).enumerate()
        {
            // The SNS RTT contender again with the baseline binary, next to
            // it (first in odd rounds, so neither always goes first).
            let mut binaries = vec![(relay, *contender)];
            if let Some(b) = baseline.filter(|_| *contender == "snsrtt") {
                binaries.push((b, "snsrttbase"));
                if round % 2 == 1 {
                    binaries.reverse();
                }
            }
            for (binary, contender) in binaries {
                if !runs(contender) && contender != "snsrttbase" {
                    continue;
                }
                let endpoint = if i == 0 { &local } else { &distant };
                let (before, calls_before, _) = endpoint.counts.snapshot();
                let sns_slot = slot(contender, round);
                let sink = network_sink(&endpoint.url, destination);
                let config =
                    relay_config(url, &sns_slot, &format!("[http]\nlisten = \"\"\n{sink}"));
                let usage = run_relay(
                    binary,
                    sql,
                    &config,
                    &aws_env(&endpoint.url),
                    &sns_slot,
                    &end_lsn,
                )
                .await?;
                let (after, calls_after, _) = endpoint.counts.snapshot();
                if after - before < rows {
                    bail!(
                        "the endpoint received {} messages of {rows} ({name}, {})",
                        after - before,
                        binary.display()
                    );
                }
                let seen = (after - before, calls_after - calls_before);
                if contender == "snsrttbase" {
                    baselines.push(usage);
                    baseline_traffic.0 += seen.0;
                    baseline_traffic.1 += seen.1;
                } else {
                    snss[i].push(usage);
                    traffic[i].0 += seen.0;
                    traffic[i].1 += seen.1;
                }
            }
        }
        if rounds > 1 {
            let rate = |u: &Usage| rows as f64 / u.wall.as_secs_f64();
            let b = &recvlogicals[round];
            let mut line = format!("round {}: rows/s pg_recvlogical {:.0}", round + 1, rate(b));
            let named = std::iter::once(("stdout", &stdouts))
                .chain(
                    NETWORK_CONTENDERS
                        .iter()
                        .zip(&snss)
                        .map(|((name, _), runs)| (name.trim_start_matches("relay, "), runs)),
                )
                .chain(std::iter::once(("baseline SNS RTT", &baselines)));
            for (name, runs) in named {
                if let Some(n) = runs.get(round) {
                    line.push_str(&format!(
                        ", {name} {:.0} ({:.2}x)",
                        rate(n),
                        rate(n) / rate(b)
                    ));
                }
            }
            println!("{line}");
        }
    }
    let _ = cluster;

    // Medians over the rounds: of each figure, and of each round's ratios.
    let rate = |u: &Usage| rows as f64 / u.wall.as_secs_f64();
    let cpu = |u: &Usage| u.cpu.as_secs_f64() * 1e6 / rows as f64;
    let report = |name: &str, runs: &[Usage], traffic: Option<(u64, u64)>| {
        if runs.is_empty() {
            return;
        }
        println!(
            "{name:<36} {:>10.0} rows/s {:>8.2} s {:>8.2} CPU s/M rows {:>8.1} MiB peak RSS {:>7.1} B/row{}",
            median(runs.iter().map(rate).collect()),
            median(runs.iter().map(|u| u.wall.as_secs_f64()).collect()),
            median(runs.iter().map(cpu).collect()),
            median(runs.iter().map(|u| u.max_rss_kib as f64 / 1024.0).collect()),
            median(runs.iter().map(|u| u.wal_bytes / rows as f64).collect()),
            traffic.map_or(String::new(), |(messages, calls)| format!(
                " {:>8.1} messages/call",
                messages as f64 / calls.max(1) as f64
            )),
        )
    };
    println!(
        "{:<36} {:>17} {:>10} {:>21} {:>19} {:>13} {:>22}",
        if rounds > 1 {
            "median of rounds"
        } else {
            "contender"
        },
        "throughput",
        "wall",
        "client CPU",
        "memory",
        "WAL written",
        "at the endpoint"
    );
    report("pg_recvlogical (baseline)", &recvlogicals, None);
    report("relay, stdout sink", &stdouts, None);
    for (((name, _), runs), traffic) in NETWORK_CONTENDERS.iter().zip(&snss).zip(traffic) {
        report(name, runs, Some(traffic));
    }
    report(
        "baseline relay, SNS RTT",
        &baselines,
        Some(baseline_traffic),
    );
    let ratio = |runs: &[Usage]| {
        let pairs = || runs.iter().zip(&recvlogicals);
        (
            median(pairs().map(|(u, b)| rate(u) / rate(b)).collect()),
            median(pairs().map(|(u, b)| cpu(u) / cpu(b)).collect()),
        )
    };
    if !stdouts.is_empty() {
        let (speed, per_row) = ratio(&stdouts);
        println!("ratio stdout / pg_recvlogical: {speed:.2}x rows/s (target >= 1.0), {per_row:.2}x CPU per row (target <= 1.0)");
    }
    let targets = ["0.6", "0.5", "0.3", "-", "-", "-", "-", "-", "-", "-"];
    let network = NETWORK_CONTENDERS
        .iter()
        .map(|(name, _)| name.trim_start_matches("relay, "))
        .zip(snss.iter().map(Vec::as_slice))
        .zip(targets)
        .chain(std::iter::once((
            ("baseline SNS RTT", baselines.as_slice()),
            "0.5",
        )));
    for ((name, runs), target) in network {
        if runs.is_empty() {
            continue;
        }
        let (speed, per_row) = ratio(runs);
        let target = if target == "-" {
            String::new()
        } else {
            format!(" (target >= {target})")
        };
        println!(
            "ratio {name} / pg_recvlogical: {speed:.2}x rows/s{target}, {per_row:.2}x CPU per row"
        );
    }
    if !baselines.is_empty() && !snss[1].is_empty() {
        let pairs = snss[1].iter().zip(&baselines);
        let ratio = median(pairs.map(|(new, old)| rate(new) / rate(old)).collect());
        println!("ratio SNS RTT / baseline SNS RTT: {ratio:.2}x rows/s (median of the rounds)");
    }
    for (what, endpoint) in [("local", &local), ("distant", &distant)] {
        let (messages, calls, _) = endpoint.counts.snapshot();
        println!("endpoint ({what}): {messages} messages in {calls} calls");
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// What the endpoint saw in one quota run: a quota at one bucket size.
#[derive(Debug, Clone)]
struct QuotaRun {
    quota: f64,
    burst: f64,
    raised: f64,
    /// At the quota, from the first call until the raise.
    at_quota: Stretch,
    /// After the raise, until the quota is lifted.
    after_raise: Stretch,
    /// Seconds from the raise until a second's worth of accepted messages
    /// first reached 85 % of the raised quota.
    found: Option<f64>,
    rows: u64,
    /// Messages accepted in all, after the quota was lifted and the backlog
    /// drained.
    accepted: u64,
}

/// The endpoint's counts over a stretch of time, and what its bucket could
/// have given in it.
#[derive(Debug, Clone, Copy, Default)]
struct Stretch {
    seconds: f64,
    messages: u64,
    calls: u64,
    throttled: u64,
    /// The bucket's tokens at the start plus its refill over the stretch.
    available: f64,
}

impl Stretch {
    fn delivered(&self) -> f64 {
        self.messages as f64 / self.available
    }
    fn throttled_share(&self) -> f64 {
        self.throttled as f64 / self.calls.max(1) as f64
    }
}

/// Drains against an endpoint that throttles above a quota: for each of
/// `--quotas` and each of `--quota-bursts` (the bucket's size, in seconds of
/// the quota), `--quota-seconds` at the quota from the first call, then
/// `--raise-seconds` at `--quota-raise` times it; then the quota is lifted
/// and the relay drains the rest, so every row is counted (lost = rows minus
/// messages accepted: a throttled call accepts nothing). One backlog per
/// quota, a slot for each bucket size.
async fn quota(
    args: &Args,
    sql: &tokio_postgres::Client,
    url: &str,
    relay: &std::path::Path,
) -> anyhow::Result<()> {
    let (t1, t2) = (args.quota_seconds as f64, args.raise_seconds as f64);
    let widest = args.quota_bursts.iter().copied().fold(0.0, f64::max);
    println!(
        "\n== quota runs: SNS {:?} away (± {:.0} %), {} s at each quota, then {} s at {}x it; load average {}",
        args.sns_latency,
        args.sns_jitter * 100.0,
        args.quota_seconds,
        args.raise_seconds,
        args.quota_raise,
        load_average()
    );
    let mut runs = Vec::new();
    for &quota in &args.quotas {
        sql.batch_execute("TRUNCATE outbox").await?;
        let raised = quota * args.quota_raise;
        // Both stretches at their full quota, the widest burst, and a margin.
        let rows = ((quota * (t1 + widest) + raised * t2) * 1.15) as u64 + 1_000;
        let names: Vec<String> = (0..args.quota_bursts.len())
            .map(|i| format!("bench_quota_{}_{i}", quota as u64))
            .collect();
        let start_lsn = slots(sql, &names).await?;
        let end_lsn = backlog(
            sql,
            url,
            rows,
            args.per_tx,
            &start_lsn,
            &format!("quota {quota:.0} messages/s, raised to {raised:.0}"),
        )
        .await?;
        for (&burst, slot) in args.quota_bursts.iter().zip(&names) {
            let run = quota_run(args, sql, url, relay, slot, &end_lsn, rows, quota, burst).await?;
            let (a, b) = (&run.at_quota, &run.after_raise);
            println!(
                "quota {quota:.0}/s, bucket {burst} s: {:.1} % delivered ({} of the {:.0} the bucket gave in {:.1} s), \
                 {:.2} % of calls throttled ({} of {}); raised to {raised:.0}/s: 85 % {}, {:.1} % delivered, \
                 {:.2} % throttled ({} of {}); lost {} of {rows} rows{}",
                a.delivered() * 100.0,
                a.messages,
                a.available,
                a.seconds,
                a.throttled_share() * 100.0,
                a.throttled,
                a.calls,
                run.found
                    .map_or(format!("not within {:.0} s", b.seconds), |s| format!("after {s:.1} s")),
                b.delivered() * 100.0,
                b.throttled_share() * 100.0,
                b.throttled,
                b.calls,
                rows.saturating_sub(run.accepted),
                if run.accepted > rows {
                    format!(" ({} accepted twice)", run.accepted - rows)
                } else {
                    String::new()
                },
            );
            if a.messages + b.messages >= rows {
                println!("  (the backlog ran out before the end: figures understated)");
            }
            sql.execute("SELECT pg_drop_replication_slot($1)", &[slot])
                .await?;
            runs.push(run);
        }
    }
    println!(
        "\n| quota (msg/s) | bucket | delivered | throttled calls | raised to | 85 % after | delivered | throttled calls | lost |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for run in &runs {
        let (a, b) = (&run.at_quota, &run.after_raise);
        println!(
            "| {:.0} | {} s | {:.1} % | {:.2} % ({}/{}) | {:.0} | {} | {:.1} % | {:.2} % | {} |",
            run.quota,
            run.burst,
            a.delivered() * 100.0,
            a.throttled_share() * 100.0,
            a.throttled,
            a.calls,
            run.raised,
            run.found.map_or("—".into(), |s| format!("{s:.1} s")),
            b.delivered() * 100.0,
            b.throttled_share() * 100.0,
            run.rows.saturating_sub(run.accepted),
        );
    }
    println!("load average after the quota runs: {}", load_average());
    Ok(())
}

/// One quota run on `slot` (its backlog `rows` rows, ending at `end_lsn`).
#[allow(clippy::too_many_arguments)]
async fn quota_run(
    args: &Args,
    sql: &tokio_postgres::Client,
    url: &str,
    relay: &std::path::Path,
    slot: &str,
    end_lsn: &str,
    rows: u64,
    quota: f64,
    burst: f64,
) -> anyhow::Result<QuotaRun> {
    let raised = quota * args.quota_raise;
    let endpoint = Arc::new(
        sns::Endpoint::start(sns::Model {
            quota: Some(quota),
            burst: Duration::from_secs_f64(burst),
            ..args.distant()
        })
        .await?,
    );
    // Errors only: a warning for every throttled call is the point here.
    let config = relay_config(
        url,
        slot,
        &format!(
            "[http]\nlisten = \"\"\n{}",
            sns_sink(&endpoint.url, "bench")
        ),
    )
    .replace("level = \"warn\"", "level = \"error\"");
    let stretches = (
        Duration::from_secs(args.quota_seconds),
        Duration::from_secs(args.raise_seconds),
    );
    let control = tokio::spawn(quota_phases(Arc::clone(&endpoint), raised, stretches));
    let drained = run_relay(relay, sql, &config, &aws_env(&endpoint.url), slot, end_lsn).await;
    if drained.is_err() {
        control.abort();
    }
    drained?;
    let (at_quota, after_raise, found) = control.await??;
    let capacity = (quota * burst).max(10.0);
    Ok(QuotaRun {
        quota,
        burst,
        raised,
        at_quota: Stretch {
            available: capacity + quota * at_quota.seconds,
            ..at_quota
        },
        after_raise,
        found,
        rows,
        accepted: endpoint.counts.snapshot().0,
    })
}

/// From the endpoint's first call: the quota for `stretches.0`, then
/// `raised` for `stretches.1`, then lifted. What each stretch saw (the
/// second's `available` filled in: the bucket's tokens at the raise and its
/// refill), and seconds from the raise until a second's worth of accepted
/// messages reached 85 % of `raised` (sampled every 100 ms).
async fn quota_phases(
    endpoint: Arc<sns::Endpoint>,
    raised: f64,
    stretches: (Duration, Duration),
) -> anyhow::Result<(Stretch, Stretch, Option<f64>)> {
    let waiting = Instant::now();
    while endpoint.counts.snapshot().1 == 0 {
        if waiting.elapsed() > Duration::from_secs(120) {
            bail!("the relay made no call in 120 s");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let start = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    // (seconds, messages, calls, throttled)
    let mut samples: Vec<(f64, u64, u64, u64)> = vec![(0.0, 0, 0, 0)];
    let mut raise: Option<(usize, f64)> = None;
    loop {
        tick.tick().await;
        let t = start.elapsed().as_secs_f64();
        let (messages, calls, throttled) = endpoint.counts.snapshot();
        samples.push((t, messages, calls, throttled));
        if raise.is_none() && t >= stretches.0.as_secs_f64() {
            raise = Some((samples.len() - 1, endpoint.set_quota(Some(raised))));
        }
        if t >= (stretches.0 + stretches.1).as_secs_f64() {
            endpoint.set_quota(None);
            break;
        }
    }
    let (at, held) = raise.expect("raised before the end");
    let stretch = |from: (f64, u64, u64, u64), to: (f64, u64, u64, u64)| Stretch {
        seconds: to.0 - from.0,
        messages: to.1 - from.1,
        calls: to.2 - from.2,
        throttled: to.3 - from.3,
        available: 0.0,
    };
    let last = *samples.last().expect("samples");
    let after = stretch(samples[at], last);
    let found = (at..samples.len()).find_map(|i| {
        let (t, m, ..) = samples[i];
        let j = (at..i).rev().find(|&j| samples[j].0 <= t - 1.0)?;
        let (tj, mj, ..) = samples[j];
        ((m - mj) as f64 / (t - tj) >= 0.85 * raised).then(|| t - samples[at].0)
    });
    Ok((
        stretch(samples[0], samples[at]),
        Stretch {
            available: held + raised * after.seconds,
            ..after
        },
        found,
    ))
}

/// `/proc/loadavg`'s three averages.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|text| {
            text.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_else(|| "?".into())
}

/// Rows a transaction in the large-row backlogs: 25 MiB at 256 KiB, within
/// `logical_decoding_work_mem` (64 MiB), so the walsender does not spill.
const LARGE_PER_TX: u64 = 100;

/// A payload of about `kib` KiB: `{"order_id": n, "blob": "<hex>"}`, the blob
/// SHA-512 digests of distinct inputs in hex (128 characters each), so
/// neither TOAST nor anything else compresses it, and every character is
/// form-encoded as itself.
fn large_payload(kib: u64) -> String {
    format!(
        "jsonb_build_object('order_id', n, 'blob', (SELECT string_agg(\
         encode(sha512((n::text || '/' || i::text)::bytea), 'hex'), '') \
         FROM generate_series(1, {}) AS i))",
        kib * 8
    )
}

/// Drains of large rows at a distance with the default configuration: peak
/// RSS (issue 18: at most 160 MiB at 64 and 256 KiB), rate, and what the
/// endpoint received. For each payload size, a topic of
/// `--sns-max-message-size`, and one of 1 MiB too when the payload alone is
/// not under that limit (a topic configured for large messages).
/// `pg_recvlogical` drains a copy of each slot first: the rate at which
/// PostgreSQL streams these rows at all.
async fn large(
    args: &Args,
    sql: &tokio_postgres::Client,
    url: &str,
    relay: &std::path::Path,
    pg_bin: &std::path::Path,
) -> anyhow::Result<()> {
    const MAX_LIMIT: usize = 1024 * 1024;
    let rows = args.large_rows;
    for &kib in &args.large_kib {
        let mut limits = vec![args.sns_max_message_size];
        if (kib as usize) * 1024 >= args.sns_max_message_size
            && args.sns_max_message_size < MAX_LIMIT
        {
            limits.push(MAX_LIMIT);
        }
        for limit in limits {
            // Only this backlog's rows: "settled" is "none PENDING", and the
            // states counted are this drain's.
            sql.batch_execute("TRUNCATE outbox").await?;
            let slot = format!("bench_large_{kib}_{limit}");
            let names = [
                format!("bench_recvlogical_large_{kib}_{limit}"),
                slot.clone(),
            ];
            let start_lsn = slots(sql, &names).await?;
            let end_lsn = backlog_of(
                sql,
                url,
                rows,
                LARGE_PER_TX,
                &large_payload(kib),
                &start_lsn,
                &format!(
                    "large rows: {kib} KiB payloads, SNS {:?} away, topic MaximumMessageSize {limit}",
                    args.sns_latency
                ),
            )
            .await?;
            let payload_bytes: f64 = sql
                .query_one(
                    "SELECT sum(octet_length(payload::text))::float8 FROM outbox",
                    &[],
                )
                .await?
                .get(0);
            let baseline = recvlogical(pg_bin, url, sql, &names[0], &end_lsn).await?;
            let endpoint = sns::Endpoint::start(sns::Model {
                max_message_size: limit,
                ..args.distant()
            })
            .await?;
            // The default configuration: nothing but where to connect and
            // publish (the HTTP listener off, so no port is shared), and the
            // SNS sink's debug log, which says what limit the relay learned.
            let config = format!(
                "[postgres]\nurl = \"{url}\"\nslot = \"{slot}\"\n\
                 [log]\nlevel = \"warn,outbox_relay::sink::sns=debug\"\n[http]\nlisten = \"\"\n{}",
                sns_sink(&endpoint.url, "bench")
            );
            let log = std::env::temp_dir().join(format!("outbox-relay-bench-{slot}.log"));
            let settle = Settle::default_for(sql).await?;
            let (usage, settled) = run_relay_until(
                relay,
                sql,
                &config,
                &aws_env(&endpoint.url),
                &slot,
                &end_lsn,
                settle,
                Some(&log),
            )
            .await?;
            let settled = settled.expect("waited for the table");
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let learned: Vec<&str> = text
                .lines()
                .filter(|l| l.contains("learned the topic's MaximumMessageSize"))
                .filter_map(|l| l.rsplit_once("limit=").map(|(_, v)| v.trim()))
                .collect();
            let rejected = "event rejected and recorded as failed";
            let rejections = text.lines().filter(|l| l.contains(rejected)).count();
            let others: Vec<&str> = text
                .lines()
                .filter(|l| !l.contains(" DEBUG ") && !l.contains(rejected))
                .collect();
            let (messages, calls, _) = endpoint.counts.snapshot();
            let attribute_calls = endpoint
                .counts
                .attribute_calls
                .load(std::sync::atomic::Ordering::Relaxed);
            let bytes = endpoint
                .counts
                .bytes
                .load(std::sync::atomic::Ordering::Relaxed);
            let largest = endpoint
                .counts
                .largest
                .load(std::sync::atomic::Ordering::Relaxed);
            let states: Vec<String> = sql
                .query(
                    "SELECT publish_state::text || ' ' || count(*) FROM outbox \
                     GROUP BY publish_state ORDER BY 1",
                    &[],
                )
                .await?
                .iter()
                .map(|r| r.get(0))
                .collect();
            let error: Option<String> = sql
                .query_opt(
                    "SELECT last_error FROM outbox WHERE last_error IS NOT NULL LIMIT 1",
                    &[],
                )
                .await?
                .map(|r| r.get(0));
            let secs = usage.wall.as_secs_f64();
            let base = baseline.wall.as_secs_f64();
            println!(
                "pg_recvlogical: {:.0} rows/s, {:.1} MiB/s of payload",
                rows as f64 / base,
                payload_bytes / 1048576.0 / base
            );
            println!(
                "relay learned MaximumMessageSize {} ({attribute_calls} GetTopicAttributes calls)",
                learned.first().copied().unwrap_or("? (not in its log)")
            );
            println!(
                "slot confirmed after {secs:.1} s: {:.0} rows/s, {:.1} MiB/s of payload; \
                 {:.2}x pg_recvlogical; table settled after {:.1} s; {:.1} CPU s; \
                 {:.1} MiB peak RSS (target <= 160)",
                rows as f64 / secs,
                payload_bytes / 1048576.0 / secs,
                base / secs,
                settled.as_secs_f64(),
                usage.cpu.as_secs_f64(),
                usage.max_rss_kib as f64 / 1024.0
            );
            println!(
                "SNS endpoint: {messages} messages in {calls} publish calls, {:.1} MiB of requests, \
                 the largest {largest} bytes; rows {}",
                bytes as f64 / 1048576.0,
                states.join(", ")
            );
            if let Some(error) = error {
                println!("a row's last_error: {error}");
            }
            if rejections > 0 {
                println!("relay log: {rejections} times \"{rejected}\"");
            }
            if !others.is_empty() {
                println!("relay log, {} other lines:", others.len());
                for line in others.iter().take(3) {
                    println!("  {line}");
                }
            }
            for name in &names {
                sql.execute("SELECT pg_drop_replication_slot($1)", &[name])
                    .await?;
            }
        }
    }
    Ok(())
}

fn aws_env(endpoint: &str) -> Vec<(&'static str, String)> {
    harness::aws_env(endpoint)
}

/// Run `command` to its end; what it cost.
async fn run_to_exit(command: &mut Command) -> anyhow::Result<Usage> {
    let started = Instant::now();
    let child = command
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .context("spawn")?;
    let pid = child.id() as libc::pid_t;
    let peak = PeakRss::watch(pid);
    let usage = peak.reap().await?;
    Ok(Usage {
        wall: started.elapsed(),
        ..usage
    })
}

/// `VmHWM` of process `pid` (KiB): the peak resident set of its own memory
/// since it started its program; `None` when it is gone or a zombie.
fn vm_hwm(pid: libc::pid_t) -> Option<i64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// A child's own peak RSS, sampled from `/proc` every 20 ms while it runs.
///
/// `wait4`'s `ru_maxrss` cannot be used for it: Linux starts a spawned
/// child's high-water mark at the parent's resident set (the child runs on
/// the parent's memory, or a copy of it, until it executes its program), so
/// every child of a 30 MiB bench would show at least 30 MiB. `VmHWM` is the
/// high-water mark of the program's own memory; sampled, it misses at most
/// the last 20 ms of growth of a process that exits by itself (none for one
/// the bench stops: [`PeakRss::sample`] reads it just before).
struct PeakRss {
    pid: libc::pid_t,
    peak: Arc<std::sync::atomic::AtomicI64>,
    sampler: tokio::task::JoinHandle<()>,
}

impl PeakRss {
    fn watch(pid: libc::pid_t) -> PeakRss {
        let peak = Arc::new(std::sync::atomic::AtomicI64::new(0));
        let sampler = tokio::spawn({
            let peak = Arc::clone(&peak);
            async move {
                loop {
                    if let Some(kib) = vm_hwm(pid) {
                        peak.fetch_max(kib, std::sync::atomic::Ordering::Relaxed);
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        });
        PeakRss { pid, peak, sampler }
    }

    /// Read it now (before the bench stops the process).
    fn sample(&self) {
        if let Some(kib) = vm_hwm(self.pid) {
            self.peak
                .fetch_max(kib, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Stop sampling; the peak seen, if any.
    fn stop(self) -> Option<i64> {
        self.sampler.abort();
        Some(self.peak.load(std::sync::atomic::Ordering::Relaxed)).filter(|&kib| kib > 0)
    }

    /// Wait for the process to exit ([`reap`]); what it cost, with its own
    /// peak RSS.
    async fn reap(self) -> anyhow::Result<Usage> {
        let pid = self.pid;
        let usage = tokio::task::spawn_blocking(move || reap(pid)).await;
        self.own(usage?)
    }

    /// `usage` (from [`reap`]) with the sampled peak RSS.
    fn own(self, usage: anyhow::Result<Usage>) -> anyhow::Result<Usage> {
        let peak = self.stop();
        let usage = usage?;
        Ok(Usage {
            max_rss_kib: peak.unwrap_or(usage.max_rss_kib),
            ..usage
        })
    }
}

/// Wait for `pid` to exit; its CPU time and `ru_maxrss` (its wall time is
/// the caller's; its own peak RSS is [`PeakRss`]'s).
fn reap(pid: libc::pid_t) -> anyhow::Result<Usage> {
    let mut status = 0;
    // SAFETY: plain FFI call with valid out-pointers.
    #[allow(unsafe_code)]
    let (got, usage) = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        let got = libc::wait4(pid, &mut status, 0, &mut usage);
        (got, usage)
    };
    if got != pid {
        bail!("wait4({pid}): {}", std::io::Error::last_os_error());
    }
    if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
        bail!("process {pid} ended with status {status:#x}");
    }
    let time = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    Ok(Usage {
        wall: Duration::ZERO,
        cpu: time(usage.ru_utime) + time(usage.ru_stime),
        max_rss_kib: usage.ru_maxrss,
        wal_bytes: 0.0,
    })
}

/// Run the relay until `slot` confirmed `end_lsn`, then stop it; what it cost.
async fn run_relay(
    relay: &std::path::Path,
    sql: &tokio_postgres::Client,
    config: &str,
    envs: &[(&'static str, String)],
    slot: &str,
    end_lsn: &str,
) -> anyhow::Result<Usage> {
    Ok(run_relay_until(
        relay,
        sql,
        config,
        envs,
        slot,
        end_lsn,
        Settle::Confirmed,
        None,
    )
    .await?
    .0)
}

/// When a drain is over, besides the slot's confirmation of the backlog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settle {
    /// The slot confirmed the end of the backlog: nothing more.
    Confirmed,
    /// And no row is `publish_state = 'PENDING'` (`on_published = "mark"`).
    Marked,
    /// And the view `outbox_state` derives no row as `PENDING`
    /// (`on_published = "derive"`: published state derived from the
    /// relay's confirmed snapshot).
    Derived,
}

impl Settle {
    /// The query that says whether rows are still pending, if any.
    fn pending_query(self) -> Option<&'static str> {
        match self {
            Settle::Confirmed => None,
            // The partial index on PENDING/FAILED rows answers this.
            Settle::Marked => {
                Some("SELECT EXISTS (SELECT 1 FROM outbox WHERE publish_state = 'PENDING')")
            }
            Settle::Derived => {
                Some("SELECT EXISTS (SELECT 1 FROM outbox_state WHERE state = 'PENDING')")
            }
        }
    }

    /// How the default configuration settles on this table: by the derived
    /// state when the table has it (the column `relay_txid` and the view
    /// `outbox_state`), else by the marks.
    async fn default_for(sql: &tokio_postgres::Client) -> anyhow::Result<Settle> {
        Ok(if derive_available(sql).await? {
            Settle::Derived
        } else {
            Settle::Marked
        })
    }
}

/// Whether the outbox table has what the derived lifecycle needs: the column
/// `relay_txid` and the view `outbox_state`.
async fn derive_available(sql: &tokio_postgres::Client) -> anyhow::Result<bool> {
    Ok(sql
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM information_schema.columns \
                            WHERE table_schema = current_schema() AND table_name = 'outbox' \
                              AND column_name = 'relay_txid') \
                    AND to_regclass('outbox_state') IS NOT NULL",
            &[],
        )
        .await?
        .get(0))
}

/// Run the relay until `slot` confirmed `end_lsn` (and until the table has
/// settled by `settle`), then stop it; what it cost (its wall time to the
/// confirmation, the WAL written from just before its start until it
/// stopped) and the wall time until the table settled (with a `settle` other
/// than [`Settle::Confirmed`]). Its log goes to `log` when given, else to
/// the bench's standard error.
#[allow(clippy::too_many_arguments)]
async fn run_relay_until(
    relay: &std::path::Path,
    sql: &tokio_postgres::Client,
    config: &str,
    envs: &[(&'static str, String)],
    slot: &str,
    end_lsn: &str,
    settle: Settle,
    log: Option<&std::path::Path>,
) -> anyhow::Result<(Usage, Option<Duration>)> {
    let path = std::env::temp_dir().join(format!("outbox-relay-bench-{slot}.toml"));
    std::fs::write(&path, config)?;
    let stderr = match log {
        Some(log) => Stdio::from(std::fs::File::create(log).context("the relay's log file")?),
        None => Stdio::inherit(),
    };
    let wal_before = wal_lsn(sql).await?;
    let started = Instant::now();
    let child = Command::new(relay)
        .arg("--config")
        .arg(&path)
        .arg("run")
        .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .context("spawn the relay")?;
    let pid = child.id() as libc::pid_t;
    let guard = KillOnError(pid);
    let peak = PeakRss::watch(pid);
    // Long enough for the slowest contender (Kinesis with strict_order drains
    // a 200,000-row backlog at a few hundred rows/s: docs/benchmarks.md).
    wait_confirmed(sql, slot, end_lsn, Duration::from_secs(3600), Some(pid)).await?;
    let wall = started.elapsed();
    let settled = if let Some(query) = settle.pending_query() {
        let deadline = Instant::now() + Duration::from_secs(600);
        loop {
            let asking = Instant::now();
            let pending: bool = sql.query_one(query, &[]).await?.get(0);
            if !pending {
                // Settled as of the question's snapshot, not its answer:
                // the last question scans the whole table (no row is
                // pending), the ones before stop at the first pending row.
                break Some(asking.duration_since(started));
            }
            if Instant::now() > deadline {
                bail!("rows still PENDING 600 s after the slot confirmed ({settle:?})");
            }
            // Every 20 ms, or less often when the question is costly (the
            // derived state is computed over the table), so the asking does
            // not take the relay's CPU.
            let cost = asking.elapsed();
            tokio::time::sleep(Duration::from_millis(20).max(cost * 3)).await;
        }
    } else {
        None
    };
    std::mem::forget(guard);
    peak.sample();
    // SAFETY: signalling our own child.
    #[allow(unsafe_code)]
    unsafe {
        libc::kill(pid, libc::SIGTERM);
    }
    let usage = peak.reap().await?;
    let wal_bytes = wal_since(sql, &wal_before).await?;
    Ok((
        Usage {
            wall,
            wal_bytes,
            ..usage
        },
        settled,
    ))
}

/// Poll until `slot`'s confirmed_flush_lsn reaches `lsn`.
async fn wait_confirmed(
    sql: &tokio_postgres::Client,
    slot: &str,
    lsn: &str,
    limit: Duration,
    pid: Option<libc::pid_t>,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        let done: bool = sql
            .query_one(
                "SELECT coalesce(confirmed_flush_lsn >= $2::text::pg_lsn, false) \
                 FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot, &lsn],
            )
            .await?
            .get(0);
        if done {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{slot} did not confirm {lsn} within {limit:?}");
        }
        if let Some(pid) = pid {
            // A zombie (or nothing) in /proc: the process is gone.
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            if stat
                .rsplit_once(") ")
                .is_none_or(|(_, rest)| rest.starts_with('Z'))
            {
                bail!("the relay (pid {pid}) exited before {slot} confirmed {lsn}");
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn steady(
    args: &Args,
    sql: &tokio_postgres::Client,
    url: &str,
    relay: &std::path::Path,
) -> anyhow::Result<()> {
    sql.execute(
        "SELECT pg_create_logical_replication_slot('bench_steady', 'pgoutput')",
        &[],
    )
    .await?;
    let endpoint = sns::Endpoint::start(args.distant()).await?;
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?.port()
    };
    let metrics = format!("127.0.0.1:{port}");
    let config = relay_config(
        url,
        "bench_steady",
        &format!(
            "[http]\nlisten = \"{metrics}\"\n{}",
            sns_sink(&endpoint.url, "bench")
        ),
    );
    let path = std::env::temp_dir().join("outbox-relay-bench-steady.toml");
    std::fs::write(&path, config)?;
    let mut child = Command::new(relay)
        .arg("--config")
        .arg(&path)
        .arg("run")
        .envs(aws_env(&endpoint.url).iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .context("spawn the relay")?;
    let guard = KillOnError(child.id() as libc::pid_t);
    let deadline = Instant::now() + Duration::from_secs(30);
    while scrape(&metrics).await.is_err() {
        if Instant::now() > deadline {
            bail!("the relay's /metrics did not come up");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "\n== steady state: single-row commits, relay streaming to the SNS endpoint {:?} away, {} s a rate",
        args.sns_latency, args.seconds
    );
    println!(
        "{:<10} {:>12} {:>10} {:>10} {:>12} {:>8}",
        "target", "achieved/s", "p50 ms", "p99 ms", "max ms (<=)", "limit"
    );
    for rate in &args.rates {
        let target = if rate == "max" {
            None
        } else {
            Some(rate.parse::<f64>().context("--rates: numbers or max")?)
        };
        produce(url, target, Duration::from_secs(2)).await?;
        let before = histogram(&scrape(&metrics).await?);
        let achieved = produce(url, target, Duration::from_secs(args.seconds)).await?;
        // Let the last commits be confirmed.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let text = scrape(&metrics).await?;
        let after = histogram(&text);
        let limit = text
            .lines()
            .find_map(|l| l.strip_prefix("outbox_relay_sink_concurrency_limit "))
            .unwrap_or("?")
            .trim()
            .to_owned();
        let window: Vec<(f64, f64)> = after
            .iter()
            .zip(&before)
            .map(|((le, a), (_, b))| (*le, a - b))
            .collect();
        let q = |p: f64| quantile(&window, p) * 1000.0;
        // The upper bound of the highest bucket with a sample in it.
        let total = window.last().map_or(0.0, |(_, c)| *c);
        let max = window
            .iter()
            .find(|(_, c)| *c >= total)
            .map_or(f64::NAN, |(le, _)| *le);
        println!(
            "{:<10} {:>12.0} {:>10.1} {:>10.1} {:>12} {:>8}",
            rate,
            achieved,
            q(0.5),
            q(0.99),
            if max.is_finite() {
                format!("{:.0}", max * 1000.0)
            } else {
                "> top bucket".into()
            },
            limit
        );
    }
    std::mem::forget(guard);
    // SAFETY: signalling our own child.
    #[allow(unsafe_code)]
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    let _ = child.wait();
    Ok(())
}

/// Kills a relay the bench started when the bench gives up on an error
/// before stopping it (otherwise it would outlive the bench, retrying a
/// cluster that is gone). Forgotten on the way that stops it.
struct KillOnError(libc::pid_t);

impl Drop for KillOnError {
    fn drop(&mut self) {
        // SAFETY: signalling our own child, not yet reaped.
        #[allow(unsafe_code)]
        unsafe {
            libc::kill(self.0, libc::SIGKILL);
        }
    }
}

/// Commit single-row transactions at `rate` per second (or as fast as
/// possible) for `length`, from 4 connections; the rate achieved.
async fn produce(url: &str, rate: Option<f64>, length: Duration) -> anyhow::Result<f64> {
    const CONNECTIONS: usize = 4;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..CONNECTIONS {
        let url = url.to_owned();
        tasks.push(tokio::spawn(async move {
            let client = harness::connect(&url).await;
            let insert = client
                .prepare(&format!(
                    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
                     SELECT 'order', 'order-' || (n % 1000), 'OrderPlaced', {PAYLOAD} \
                     FROM (SELECT $1::bigint AS n) AS s"
                ))
                .await?;
            let mut sent = 0u64;
            let per_conn = rate.map(|r| r / CONNECTIONS as f64);
            let mut n = c as i64;
            while started.elapsed() < length {
                if let Some(r) = per_conn {
                    let due = started + Duration::from_secs_f64(sent as f64 / r);
                    tokio::time::sleep_until(due.into()).await;
                }
                client.execute(&insert, &[&n]).await?;
                n += CONNECTIONS as i64;
                sent += 1;
            }
            anyhow::Ok(sent)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    Ok(total as f64 / started.elapsed().as_secs_f64())
}

/// GET /metrics.
async fn scrape(addr: &str) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut text = String::new();
    stream.read_to_string(&mut text).await?;
    Ok(text)
}

/// The end-to-end latency histogram: cumulative (upper bound, count) pairs.
fn histogram(scrape: &str) -> Vec<(f64, f64)> {
    scrape
        .lines()
        .filter_map(|l| l.strip_prefix("outbox_relay_end_to_end_latency_seconds_bucket{le=\""))
        .filter_map(|rest| {
            let (le, count) = rest.split_once("\"} ")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, count.trim().parse().ok()?))
        })
        .collect()
}

/// The `p` quantile of a cumulative histogram, interpolated inside its bucket.
fn quantile(buckets: &[(f64, f64)], p: f64) -> f64 {
    let Some(&(_, total)) = buckets.last() else {
        return f64::NAN;
    };
    if total == 0.0 {
        return f64::NAN;
    }
    let rank = p * total;
    let mut lower = (0.0, 0.0);
    for &(le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return lower.0;
            }
            let inside = count - lower.1;
            let fraction = if inside > 0.0 {
                (rank - lower.1) / inside
            } else {
                1.0
            };
            return lower.0 + (le - lower.0) * fraction;
        }
        lower = (le, count);
    }
    lower.0
}
