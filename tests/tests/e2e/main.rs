//! End-to-end tests of outbox-relay, one binary (see `harness` for the helpers).

mod bad_input;
mod check;
mod conformance;
mod derived;
mod derived_readers;
mod eventbridge;
mod failover;
mod harness_smoke;
mod kinesis;
mod lifecycle;
mod migration;
mod operations;
mod outbox;
mod packaging;
mod platforms;
mod position;
mod process;
mod sns;
mod sns_fixture;
mod sqs;
mod stall;
mod stream;
mod stress;
mod tls;
mod two_phase;
mod webhook;
