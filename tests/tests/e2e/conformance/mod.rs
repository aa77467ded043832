//! One conformance suite for every destination: each destination × each fault,
//! checked on what the destination's consumer *processed* (after the
//! destination's own deduplication), not on what the relay sent.
//!
//! ```text
//! relay ──► front (fault proxy in the destination's protocol, or the webhook
//!           │      receiver itself): lose / delay / slow / fail an entry /
//!           │      throttle at a quota / answer any error of the table
//!           ▼
//!        destination (moto: SNS, SQS, EventBridge, Kinesis; the receiver)
//!           ▼
//!        consumer (a queue, the stream's shards, the receiver's log):
//!        what was processed, in the order processed
//! ```
//!
//! A destination added later joins the suite with one line in the list at the
//! end (and its [`destination::Kind`]): every fault runs against it. The
//! scenarios and the checks are in [`scenario`]; the destinations, their
//! fronts and consumers in [`destination`]. Each test prints one line
//! `conformance: <destination> × <fault>: processed, order, repeats` and
//! appends it to `target/conformance/results.tsv`, the source of the table in
//! docs/guarantees.md.

mod destination;
pub(crate) mod receiver;
mod scenario;

use destination::Kind;
use scenario::{run, Fault};

/// One module per destination, one test per fault, named as sentences.
macro_rules! conformance {
    ($($module:ident => $kind:expr;)*) => {$(
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_answer_lost_after_processing_loses_nothing_and_repeats_at_most_those_events() {
                run($kind, Fault::LostAnswer).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_answer_later_than_the_attempt_timeout_loses_nothing_and_repeats_at_most_those_events() {
                run($kind, Fault::LateAnswer).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_destination_slower_than_the_attempt_timeout_loses_nothing() {
                run($kind, Fault::Slow).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn one_entry_failing_at_every_position_of_a_batch_is_retried_alone_in_order() {
                run($kind, Fault::EntryFailures).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn throttling_at_a_quota_loses_nothing_and_repeats_nothing() {
                run($kind, Fault::Quota).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn every_transient_error_answer_is_retried_and_nothing_is_recorded_failed() {
                run($kind, Fault::TransientErrors).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn every_permanent_error_answer_records_the_event_failed_and_the_stream_moves_on() {
                run($kind, Fault::PermanentErrors).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_relay_killed_mid_batch_and_restarted_loses_nothing() {
                run($kind, Fault::Kill9).await;
            }
        }
    )*};
}

conformance! {
    sns_standard => Kind::SnsStandard;
    sns_fifo => Kind::SnsFifo;
    sqs_standard => Kind::SqsStandard;
    sqs_fifo => Kind::SqsFifo;
    eventbridge => Kind::EventBridge;
    kinesis => Kind::Kinesis;
    webhook => Kind::Webhook;
    webhook_batch => Kind::WebhookBatch;
}

/// The issue's reproduction: a webhook batch processed, answered late, then
/// formed again with an event committed meanwhile. With a batch id of
/// `<first id>+<count>` the receiver drops the new batch as a repeat and the
/// new event is lost; with an id derived from the batch's content it is processed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_batch_formed_again_after_a_late_answer_still_delivers_the_event_committed_meanwhile(
) {
    run(Kind::WebhookBatch, Fault::ReformedBatch).await;
}
