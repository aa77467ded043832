//! Tests of the decoder: hand-built messages, a captured-style fixture,
//! malformed input and property tests against a test-only encoder.

mod fixture;
mod malformed;
mod messages;
mod props;
mod wire;
