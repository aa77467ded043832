//! The chaos run (tests/src/bin/chaos.rs, docs/chaos.md), shortened for every
//! test run: a producer at 10 events a second into an outbox relayed to a FIFO
//! SNS topic (moto) while the driver injects 10 faults, two of each kind, 2 to
//! 6 s apart (kill -9 of the relay, PostgreSQL fast and immediate restarts, the
//! SNS endpoint cut, throttling), on the PostgreSQL major of the run (`PG_BIN`)
//! and the shared moto. The binary fails when a committed event is lost, an
//! aggregate's events come out of order, a row is left unpublished by
//! `outbox_state` or called PUBLISHED without having arrived, the slot does
//! not catch up, fewer than 10 faults were injected within 150 s, or the
//! repeats or the poller's share pass 5 %.

#[test]
fn every_committed_event_arrives_in_order_through_ten_faults() {
    crate::stress::run_driver(
        env!("CARGO_BIN_EXE_chaos"),
        &["--faults", "10", "--seconds", "150", "--every-ms", "100"],
        "chaos",
    );
}
