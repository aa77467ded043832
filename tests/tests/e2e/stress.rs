//! The stress test of the derived lifecycle (tests/src/bin/stress.rs,
//! docs/stress.md), shortened for every test run: 16 writers mixing plain,
//! asynchronous, savepoint (also more than 64), prepared, rolled-back and long
//! transactions for 60 s, two kill -9 of the relay and one immediate
//! PostgreSQL restart. The binary fails when a row the derived state calls
//! PUBLISHED was never delivered, a delivered row stays PENDING, a committed
//! row is lost or a rolled-back one delivered, or repeats pass 5 %.

use std::process::Command;

#[test]
fn no_row_is_derived_published_before_delivery_under_sixteen_writers_kills_and_a_crash() {
    let out = Command::new(env!("CARGO_BIN_EXE_stress"))
        .args(["--seconds", "60", "--writers", "16", "--kills", "2"])
        .args(["--pg-restart", "--require-derived"])
        .output()
        .expect("run the stress binary");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    eprintln!("{stderr}");
    assert!(
        out.status.success() && stdout.contains("result                  PASS"),
        "the stress run failed ({}); its summary is above",
        out.status
    );
}
