//! The stress test of the derived lifecycle (tests/src/bin/stress.rs,
//! docs/stress.md), shortened for every test run: 16 writers mixing plain,
//! asynchronous, savepoint (also more than 64), prepared, rolled-back and long
//! transactions for 60 s, two kill -9 of the relay, a graceful stop longer
//! than the poller's grace and one immediate PostgreSQL restart. The binary fails when a row the derived state calls
//! PUBLISHED was never delivered, a delivered row stays PENDING, a committed
//! row is lost or a rolled-back one delivered, or repeats pass 5 %.

use std::process::Command;

#[test]
fn no_row_is_derived_published_before_delivery_under_sixteen_writers_kills_and_a_crash() {
    run_driver(
        env!("CARGO_BIN_EXE_stress"),
        &[
            "--seconds",
            "60",
            "--writers",
            "16",
            "--kills",
            "2",
            "--stops",
            "1",
            "--pg-restart",
            "--require-derived",
        ],
        "stress",
    );
}

/// Run a driver binary (the stress or the chaos run) with `args`, print its
/// summary and its log, and fail unless it exits 0 and says PASS.
pub fn run_driver(program: &str, args: &[&str], name: &str) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run the {name} binary: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    eprintln!("{stderr}");
    assert!(
        out.status.success() && stdout.contains("result                  PASS"),
        "the {name} run failed ({}); its summary is above",
        out.status
    );
}
