//! A mutation fuzzer for the pgoutput decoder and the configuration loader,
//! on the stable toolchain (no cargo-fuzz, no nightly).
//!
//! ```sh
//! cargo run --release -p outbox-relay-fuzz -- capture             # refresh fuzz/seeds/pgoutput from a real cluster
//! cargo run --release -p outbox-relay-fuzz -- run pgoutput --seconds 600
//! cargo run --release -p outbox-relay-fuzz -- run config --seconds 600
//! ```
//!
//! `run` mutates the seeds (bit flips, extreme length fields, insertions,
//! deletions, splices between seeds) and runs each input under
//! `catch_unwind`. An input that panics is written to `fuzz/regressions/`,
//! where the crate's test replays it forever after (with every seed).

mod targets;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Parser, Subcommand};
use sha2::Digest;

use targets::Target;

#[derive(Debug, Parser)]
#[command(
    name = "outbox-relay-fuzz",
    about = "Fuzz the pgoutput decoder and the config loader"
)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Capture pgoutput messages from a real PostgreSQL into fuzz/seeds/pgoutput.
    Capture,
    /// Fuzz one target.
    Run {
        /// What to fuzz.
        target: Target,
        /// For how long.
        #[arg(long, default_value_t = 600)]
        seconds: u64,
    },
}

fn dir(sub: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(sub)
}

fn main() -> anyhow::Result<()> {
    match Args::parse().command {
        Command::Capture => tokio::runtime::Runtime::new()?.block_on(capture()),
        Command::Run { target, seconds } => run(target, Duration::from_secs(seconds)),
    }
}

/// Every file in `fuzz/seeds/<target>` and `fuzz/regressions/<target>-*`.
pub fn corpus(target: Target) -> anyhow::Result<Vec<Vec<u8>>> {
    let mut inputs = Vec::new();
    let seeds = dir("seeds").join(target.name());
    for entry in std::fs::read_dir(&seeds).with_context(|| seeds.display().to_string())? {
        inputs.push(std::fs::read(entry?.path())?);
    }
    for entry in std::fs::read_dir(dir("regressions"))? {
        let path = entry?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if name.starts_with(&format!("{}-", target.name())) {
            inputs.push(std::fs::read(&path)?);
        }
    }
    Ok(inputs)
}

fn run(target: Target, length: Duration) -> anyhow::Result<()> {
    let seeds = corpus(target)?;
    anyhow::ensure!(!seeds.is_empty(), "no seeds for {}", target.name());
    // Panics are findings: keep their messages off the terminal, count them.
    std::panic::set_hook(Box::new(|_| {}));
    let started = Instant::now();
    let mut executions = 0u64;
    let mut findings = 0u64;
    let mut last_report = Instant::now();
    let mut input = Vec::new();
    while started.elapsed() < length {
        let seed = &seeds[fastrand::usize(..seeds.len())];
        let other = &seeds[fastrand::usize(..seeds.len())];
        input.clear();
        input.extend_from_slice(seed);
        // A few rounds of mutation on the same input, each one run.
        for _ in 0..8 {
            targets::mutate(&mut input, other);
            executions += 1;
            if std::panic::catch_unwind(|| target.run(&input)).is_err() {
                findings += 1;
                let name = format!(
                    "{}-{:x}",
                    target.name(),
                    sha2::Sha256::digest(&input)
                        .iter()
                        .take(8)
                        .fold(0u64, |a, b| a << 8 | *b as u64)
                );
                let path = dir("regressions").join(name);
                std::fs::write(&path, &input)?;
                eprintln!("finding: {}", path.display());
                break;
            }
        }
        if last_report.elapsed() > Duration::from_secs(30) {
            last_report = Instant::now();
            eprintln!(
                "{}: {executions} executions, {findings} findings, {:.0} s",
                target.name(),
                started.elapsed().as_secs_f64()
            );
        }
    }
    println!(
        "{}: {executions} executions in {:.0} s ({:.0}/s) from {} seeds, {findings} findings",
        target.name(),
        started.elapsed().as_secs_f64(),
        executions as f64 / started.elapsed().as_secs_f64(),
        seeds.len()
    );
    if findings > 0 {
        anyhow::bail!("{findings} inputs panicked; they are in fuzz/regressions");
    }
    Ok(())
}

/// Real pgoutput messages: a cluster, a publication over tables of many
/// types, inserts, updates, deletes, TOAST, truncate, DDL and logical
/// messages, read with `pg_logical_slot_peek_binary_changes`.
async fn capture() -> anyhow::Result<()> {
    let cluster = tokio::task::spawn_blocking(harness::Cluster::start).await?;
    let sql = harness::connect(&cluster.admin_url()).await;
    sql.batch_execute("SELECT pg_create_logical_replication_slot('capture', 'pgoutput')")
        .await?;
    sql.batch_execute(
        "CREATE TABLE outbox (id uuid PRIMARY KEY DEFAULT gen_random_uuid(), aggregate_type text NOT NULL,
            aggregate_id text NOT NULL, event_type text NOT NULL, payload jsonb NOT NULL, headers jsonb,
            topic text, created_at timestamptz NOT NULL DEFAULT now());
         CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
         CREATE TABLE kinds (id bigserial PRIMARY KEY, b bytea, n numeric, f float8, a text[], t timestamptz,
            m mood, big text, flag boolean);
         ALTER TABLE kinds REPLICA IDENTITY FULL;
         CREATE PUBLICATION p FOR TABLE outbox, kinds;
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers, topic)
            VALUES ('order', 'o-1', 'OrderCreated', '{\"total\": 42.5, \"items\": [1, 2]}', '{\"traceparent\": \"00-ab-cd-01\"}', NULL),
                   ('order', 'ö-2 ✓', 'Paid', '\"just a string\"', NULL, 'arn:aws:sns:us-east-1:1:t');
         INSERT INTO kinds (b, n, f, a, t, m, big, flag) VALUES
            ('\\x00ff10', 3.14159265358979323846, 'NaN', '{a,\"b c\",NULL}', now(), 'happy', repeat('x', 10000), true),
            (NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL);
         UPDATE kinds SET flag = false WHERE id = 1;
         UPDATE kinds SET n = 1 WHERE id = 2;
         DELETE FROM kinds WHERE id = 2;
         ALTER TABLE outbox ADD COLUMN extra int;
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, extra) VALUES ('a', 'b', 'c', '{}', 7);
         SELECT pg_logical_emit_message(true, 'outbox-relay-heartbeat', '1234');
         SELECT pg_logical_emit_message(false, 'other', '\\x00'::bytea);
         TRUNCATE kinds;",
    )
    .await?;
    let rows = sql
        .query(
            "SELECT data FROM pg_logical_slot_peek_binary_changes('capture', NULL, NULL, \
             'proto_version', '1', 'publication_names', 'p', 'messages', 'true')",
            &[],
        )
        .await?;
    let out = dir("seeds").join("pgoutput");
    std::fs::create_dir_all(&out)?;
    for (i, row) in rows.iter().enumerate() {
        let data: Vec<u8> = row.get(0);
        std::fs::write(out.join(format!("{i:03}-{}.bin", data[0] as char)), &data)?;
    }
    println!("captured {} messages into {}", rows.len(), out.display());
    // Prepared transactions, as a slot created with two_phase sends them
    // (protocol version 3): Begin Prepare, Prepare, Commit Prepared and
    // Rollback Prepared.
    // COMMIT PREPARED and ROLLBACK PREPARED may not share a simple query with
    // other statements (they cannot run in a transaction block).
    for statement in [
        "SELECT pg_create_logical_replication_slot('capture_2pc', 'pgoutput', false, true)",
        "BEGIN;
         INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
            VALUES ('order', 'o-3', 'Prepared', '{}');
         PREPARE TRANSACTION 'outbox-relay: ö ✓'",
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('a', 'b', 'c', '{}')",
        "COMMIT PREPARED 'outbox-relay: ö ✓'",
        "BEGIN; INSERT INTO kinds (big) VALUES ('rolled back'); PREPARE TRANSACTION 'g2'",
        "ROLLBACK PREPARED 'g2'",
    ] {
        sql.batch_execute(statement).await?;
    }
    let rows = sql
        .query(
            "SELECT data FROM pg_logical_slot_peek_binary_changes('capture_2pc', NULL, NULL, \
             'proto_version', '3', 'two_phase', 'on', 'publication_names', 'p')",
            &[],
        )
        .await?;
    let mut two_phase = 0;
    for (i, row) in rows.iter().enumerate() {
        let data: Vec<u8> = row.get(0);
        let kind = match data[0] {
            b'b' => "begin-prepare",
            b'P' => "prepare",
            b'K' => "commit-prepared",
            b'r' => "rollback-prepared",
            _ => continue, // the version 1 messages are captured above
        };
        std::fs::write(out.join(format!("2pc-{i:03}-{kind}.bin")), &data)?;
        two_phase += 1;
    }
    println!(
        "captured {two_phase} two-phase messages into {}",
        out.display()
    );
    drop(cluster);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every seed and every past finding runs without a panic.
    #[test]
    fn seeds_and_regressions_do_not_panic() {
        for target in [Target::Pgoutput, Target::Config] {
            let inputs = corpus(target).unwrap();
            assert!(!inputs.is_empty(), "{} has seeds", target.name());
            for input in inputs {
                target.run(&input);
            }
        }
    }

    /// The seeds are real: each pgoutput capture decodes.
    #[test]
    fn every_pgoutput_seed_decodes() {
        let seeds = dir("seeds").join("pgoutput");
        for entry in std::fs::read_dir(seeds).unwrap() {
            let path = entry.unwrap().path();
            let bytes = std::fs::read(&path).unwrap();
            pgoutput::decode(bytes.into()).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
    }
}
