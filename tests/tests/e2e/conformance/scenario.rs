//! The faults of the suite and the checks every one ends with.
//!
//! Each scenario inserts a few transactions of one event per group (ten
//! groups), applies its fault while events are in flight, commits more events
//! of the same groups while the fault lasts, and then checks what the
//! consumer *processed* (after the destination's own deduplication), not what
//! was sent:
//!
//! 1. every committed event was processed at least once (or, where the
//!    destination refused it for good, its row is FAILED with the reason);
//! 2. nothing confirmed was never processed: every event of a commit at or
//!    below the slot's `confirmed_flush_lsn` and every PUBLISHED row, read
//!    while the fault lasted and at the end, was processed;
//! 3. each group's order of first processing is its commit order where the
//!    destination promises order; elsewhere the order seen is reported;
//! 4. repeats are bounded: at most the events of the calls whose answers the
//!    fault took (lost, late, slow), or of the commits not yet confirmed when
//!    the relay was killed; none at all for faults answered before anything
//!    was processed (refusals, throttling, a failed entry).
//!
//! No check depends on timing: conditions are waited for with generous
//! bounds, never slept on.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::time::Duration;

use harness::wait_until;

use super::destination::{Destination, Injected, Kind, ATTEMPT_TIMEOUT};
use crate::outbox::Outbox;

/// Groups (aggregate ids) of every scenario: a batch holds up to ten entries.
const GROUPS: usize = 10;

/// Longer than the relay's attempt timeout: the relay has given up by then.
fn beyond_the_timeout() -> Duration {
    ATTEMPT_TIMEOUT * 5 / 2
}

/// The faults of the suite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// (a) The destination processes a call, the answer is lost (reset).
    LostAnswer,
    /// (a) The destination processes a call, the answer comes after the
    /// attempt timeout.
    LateAnswer,
    /// (e) The destination takes longer than the attempt timeout before it
    /// processes a call.
    Slow,
    /// (b) One entry of a batch fails, at each position in turn.
    EntryFailures,
    /// (c) The destination throttles beyond a quota.
    Quota,
    /// (d) Every transient answer of the destination's error table, each
    /// to three calls in a row.
    TransientErrors,
    /// (d) Every permanent answer of the destination's error table.
    PermanentErrors,
    /// (f) The relay is killed (SIGKILL) with a batch in flight and restarted.
    Kill9,
    /// (a) The case: a webhook batch answered late is formed again
    /// with an event committed meanwhile.
    ReformedBatch,
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::LostAnswer => "answer lost after processing (reset)",
            Fault::LateAnswer => "answer after the attempt timeout",
            Fault::Slow => "slower than the attempt timeout",
            Fault::EntryFailures => "one entry fails, every position",
            Fault::Quota => "throttled at a quota",
            Fault::TransientErrors => "every transient error answer",
            Fault::PermanentErrors => "every permanent error answer",
            Fault::Kill9 => "relay killed mid-batch, restarted",
            Fault::ReformedBatch => "batch formed again after a late answer",
        }
    }
}

/// Events committed, in commit order: `(id, group)`.
type Events = Vec<(String, String)>;

/// Inserts `txs` transactions of one event per group; marks the event of
/// group `marked.0` in every transaction with the text `marked.1` in its payload.
async fn insert(outbox: &Outbox, txs: usize, marked: Option<(usize, &str)>) -> Events {
    insert_runs(outbox, txs, 1, marked).await
}

/// Like [`insert`], with `run` events of each group one after the other
/// (`g0, g0, g1, g1, …`), so a batch carries several events of a group.
async fn insert_runs(
    outbox: &Outbox,
    txs: usize,
    run: usize,
    marked: Option<(usize, &str)>,
) -> Events {
    let mut out = Vec::new();
    for _ in 0..txs {
        let order: Vec<usize> = (0..GROUPS)
            .flat_map(|g| std::iter::repeat_n(g, run))
            .collect();
        let groups: Vec<String> = order.iter().map(|g| format!("g{g}")).collect();
        let marks: Vec<String> = order
            .iter()
            .map(|g| match marked {
                Some((m, text)) if m == *g => text.to_owned(),
                _ => String::new(),
            })
            .collect();
        let rows = outbox
            .sql
            .query(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
                 SELECT 'order', g, 'E', jsonb_build_object('group', g, 'mark', m) \
                 FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS u(g, m, n) \
                 ORDER BY n RETURNING id::text, aggregate_id",
                &[&groups, &marks],
            )
            .await
            .expect("insert outbox rows");
        out.extend(rows.iter().map(|r| (r.get(0), r.get(1))));
    }
    out
}

/// The ids the relay has confirmed: events of commits at or below the slot's
/// confirmed position, and PUBLISHED rows.
async fn confirmed(outbox: &Outbox) -> HashSet<String> {
    let lsn = outbox.confirmed_flush().await;
    let mut ids: HashSet<String> = outbox
        .commits()
        .await
        .into_iter()
        .filter(|c| c.end_lsn <= lsn)
        .flat_map(|c| c.ids)
        .collect();
    let rows = outbox
        .sql
        .query(
            "SELECT id::text FROM outbox_state WHERE state = 'PUBLISHED'",
            &[],
        )
        .await
        .expect("published rows");
    ids.extend(rows.iter().map(|r| r.get::<_, String>(0)));
    ids
}

/// What a scenario leaves for the checks.
struct Outcome {
    /// Repeats the consumer may see at most, and why.
    repeats_bound: (usize, String),
    /// Whether rows may end FAILED (refused for good); otherwise none may.
    may_fail: bool,
    /// What the relay had confirmed while the fault lasted.
    confirmed_during: HashSet<String>,
    /// A note for the report.
    note: String,
}

impl Outcome {
    fn none(note: String) -> Outcome {
        Outcome {
            repeats_bound: (0, "nothing processed twice".to_owned()),
            may_fail: false,
            confirmed_during: HashSet::new(),
            note,
        }
    }
}

/// Whether `fault` applies to `kind`; why not, otherwise.
pub(crate) fn not_applicable(kind: Kind, fault: Fault) -> Option<&'static str> {
    match fault {
        Fault::EntryFailures if kind.is_webhook() => {
            Some("a webhook answer covers its whole request: there is no entry to fail alone")
        }
        Fault::ReformedBatch if kind != Kind::WebhookBatch => {
            Some("the case of a batch webhook-id")
        }
        _ => None,
    }
}

/// Runs `fault` against `kind` and checks the outcome.
pub(crate) async fn run(kind: Kind, fault: Fault) {
    if let Some(why) = not_applicable(kind, fault) {
        eprintln!(
            "conformance: {} × {}: not applicable: {why}",
            kind.name(),
            fault.name()
        );
        report(kind, fault, &format!("n/a\tn/a\tn/a\t{why}"));
        return;
    }
    if fault == Fault::ReformedBatch {
        return webhook_batch_formed_again_after_a_late_answer().await;
    }
    let outbox = Outbox::new().await;
    let dest = Destination::new(kind, &outbox).await;
    let mut relay = dest.spawn(&outbox);
    outbox.wait_slot_active(true).await;
    // The relay's first calls (limits, bus checks) and one event per group
    // go through before the fault.
    let mut committed = insert(&outbox, 1, None).await;
    wait_processed(&dest, &committed, &HashSet::new()).await;

    let outcome = match fault {
        Fault::LostAnswer | Fault::LateAnswer | Fault::Slow => {
            let injected = match fault {
                Fault::LostAnswer => Injected::LoseAnswer,
                Fault::LateAnswer => Injected::AnswerLate(beyond_the_timeout()),
                _ => Injected::Slow(beyond_the_timeout()),
            };
            let before = dest.calls().len();
            dest.script(&[injected.clone(), injected]);
            committed.extend(insert(&outbox, 3, None).await);
            // Later events of the same groups commit while the answers are
            // missing: the relay forms its batches again around them.
            wait_until(
                Duration::from_secs(30),
                "the destination got both calls the fault takes the answers of",
                || async {
                    let calls = dest.calls();
                    let faulted: Vec<_> = calls[before.min(calls.len())..]
                        .iter()
                        .filter(|c| c.faulted)
                        .collect();
                    faulted.len() == 2 && faulted.iter().all(|c| c.forwarded)
                },
            )
            .await;
            let confirmed_during = confirmed(&outbox).await;
            committed.extend(insert(&outbox, 3, None).await);
            let in_faulted: usize = dest
                .calls()
                .iter()
                .filter(|c| c.faulted)
                .map(|c| c.ids.len())
                .sum();
            Outcome {
                repeats_bound: (
                    in_faulted,
                    "the events of the calls whose answers were lost, late or slow".to_owned(),
                ),
                may_fail: false,
                confirmed_during,
                note: String::new(),
            }
        }
        Fault::EntryFailures => {
            // Two events of a group in a row: a batch of ten carries five
            // groups, each failed entry has its group's next event behind it
            // in its call (unless the sink keeps one entry of a group a call).
            let positions: Vec<Injected> = (0..GROUPS).map(Injected::FailEntry).collect();
            dest.script(&positions);
            committed.extend(insert_runs(&outbox, 6, 2, None).await);
            wait_until(
                Duration::from_secs(30),
                "a failed entry at every position",
                || async { dest.faults_pending() == 0 },
            )
            .await;
            let calls = dest.calls();
            let sizes: Vec<usize> = calls
                .iter()
                .filter(|c| c.faulted)
                .map(|c| c.ids.len())
                .collect();
            // The publisher sends the entries of the failed entry's group
            // that came after it in its call again after it (docs/guarantees.md,
            // guarantee 2): those may be processed twice.
            let group_of: HashMap<&str, &str> = committed
                .iter()
                .map(|(id, g)| (id.as_str(), g.as_str()))
                .collect();
            let behind: usize = calls
                .iter()
                .filter_map(|c| Some((c, c.failed_position?)))
                .map(|(c, p)| {
                    let group = group_of.get(c.ids[p].as_str());
                    c.ids[p + 1..]
                        .iter()
                        .filter(|id| group_of.get(id.as_str()) == group)
                        .count()
                })
                .sum();
            Outcome {
                repeats_bound: (
                    behind,
                    "the entries of a failed entry's group behind it in its call, sent again after it"
                        .to_owned(),
                ),
                ..Outcome::none(format!("entries of the faulted calls: {sizes:?}"))
            }
        }
        Fault::Quota => {
            // Entries (AWS) or requests (webhooks) a second, a small bucket;
            // a hundred events committed at once (one transaction, ten of
            // each group in a row) go well beyond it.
            let quota = if kind.is_webhook() {
                (20.0, 4.0)
            } else {
                (40.0, 10.0)
            };
            dest.set_quota(Some(quota));
            committed.extend(insert_runs(&outbox, 1, 10, None).await);
            wait_processed(&dest, &committed, &HashSet::new()).await;
            dest.set_quota(None);
            let calls = dest.calls();
            let throttled = calls.iter().filter(|c| c.throttled).count();
            assert!(
                throttled > 0,
                "the quota was reached: {} calls, none throttled",
                calls.len()
            );
            Outcome::none(format!(
                "{throttled} of {} calls throttled at {} a second",
                calls.len(),
                quota.0
            ))
        }
        Fault::TransientErrors => {
            let answers = kind.transient_answers();
            // Each answer three calls in a row, as a throttled or failing
            // service answers for a while: a request refused as if it were
            // invalid is narrowed to its entries, and the first entry sent
            // alone would then be refused too, and recorded.
            let script: Vec<Injected> = answers
                .iter()
                .flat_map(|a| std::iter::repeat_n(Injected::Refuse(a.clone()), 3))
                .collect();
            dest.script(&script);
            committed.extend(insert(&outbox, 2, None).await);
            wait_until(
                Duration::from_secs(60),
                "every transient answer was given",
                || async { dest.faults_pending() == 0 },
            )
            .await;
            let confirmed_during = confirmed(&outbox).await;
            committed.extend(insert(&outbox, 2, None).await);
            let names: Vec<String> = answers.iter().map(ToString::to_string).collect();
            Outcome {
                confirmed_during,
                ..Outcome::none(format!("answers: {}", names.join(", ")))
            }
        }
        Fault::PermanentErrors => {
            let answers = kind.permanent_answers();
            let mut poisons = Vec::new();
            for (i, answer) in answers.iter().enumerate() {
                let marker = format!("CONFORMANCEMARK{i}X");
                dest.refuse_marked(&marker, answer);
                committed.extend(insert(&outbox, 1, None).await);
                let marked = insert(&outbox, 1, Some((i % GROUPS, marker.as_str()))).await;
                let poison = marked[i % GROUPS].0.clone();
                committed.extend(marked);
                committed.extend(insert(&outbox, 1, None).await);
                // One answer at a time: a webhook batch shares its answer, so
                // two marked events in one request would both get the first's.
                crate::sqs::recorded(&outbox, &poison).await;
                poisons.push((poison, answer.clone()));
            }
            // Every event is processed or recorded FAILED.
            wait_until(
                Duration::from_secs(60),
                "every event is processed or recorded FAILED",
                || async {
                    let done: HashSet<String> =
                        dest.processed().into_iter().map(|(id, _)| id).collect();
                    let failed = failed_rows(&outbox).await;
                    let missing = committed
                        .iter()
                        .filter(|(id, _)| !done.contains(id) && !failed.contains_key(id))
                        .count();
                    if missing == 0 {
                        Ok(())
                    } else {
                        Err(format!("{missing} neither processed nor FAILED"))
                    }
                },
            )
            .await;
            let failed = failed_rows(&outbox).await;
            let mut note = String::new();
            for (id, answer) in &poisons {
                let error = failed.get(id).unwrap_or_else(|| {
                    panic!("the event answered {answer} is recorded FAILED: {id}")
                });
                assert!(
                    error.contains(&answer.named_by()),
                    "the row refused with {answer} names it in last_error: {error}"
                );
                let _ = write!(note, "{answer}; ");
            }
            let _ = write!(note, "{} rows FAILED", failed.len());
            Outcome {
                may_fail: true,
                ..Outcome::none(note)
            }
        }
        Fault::ReformedBatch => unreachable!("handled above"),
        Fault::Kill9 => {
            // The rows before are settled first: a relay killed before a
            // pair vouches for what it delivered, its slot ahead of the kept
            // position, leaves those rows to the poller after its grace (at
            // least once; docs/guarantees.md), which this test does not wait for.
            crate::sqs::all_rows(&outbox, "PUBLISHED", committed.len()).await;
            let before = dest.calls().len();
            // A call the destination processed whose answer the relay is
            // still waiting for when it is killed.
            dest.script(&[Injected::AnswerLate(Duration::from_secs(20))]);
            committed.extend(insert(&outbox, 3, None).await);
            wait_until(
                Duration::from_secs(30),
                "the destination got the call in flight",
                || async {
                    let calls = dest.calls();
                    calls[before.min(calls.len())..]
                        .iter()
                        .any(|c| c.faulted && c.forwarded)
                },
            )
            .await;
            committed.extend(insert(&outbox, 2, None).await);
            relay.kill9();
            let at_kill = outbox.confirmed_flush().await;
            let confirmed_during = confirmed(&outbox).await;
            let unconfirmed: usize = outbox
                .commits()
                .await
                .iter()
                .filter(|c| c.end_lsn > at_kill)
                .map(|c| c.ids.len())
                .sum();
            outbox.wait_slot_active(false).await;
            relay = dest.spawn(&outbox);
            outbox.wait_slot_active(true).await;
            committed.extend(insert(&outbox, 2, None).await);
            Outcome {
                repeats_bound: (
                    unconfirmed,
                    "the events of the commits not confirmed at the kill".to_owned(),
                ),
                may_fail: false,
                confirmed_during,
                note: format!("{unconfirmed} events unconfirmed at the kill"),
            }
        }
    };
    check(kind, fault, &outbox, &dest, &committed, outcome).await;
    relay.stop_gracefully().await;
}

/// `id → last_error` of the FAILED rows (DEAD, once the poller gave up on them).
async fn failed_rows(outbox: &Outbox) -> HashMap<String, String> {
    outbox
        .sql
        .query(
            "SELECT id::text, coalesce(last_error, '') FROM outbox_state \
             WHERE state IN ('FAILED', 'DEAD')",
            &[],
        )
        .await
        .expect("failed rows")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// Waits until the consumer processed every event of `events` but those in `except`.
async fn wait_processed(dest: &Destination, events: &Events, except: &HashSet<String>) {
    wait_until(
        Duration::from_secs(60),
        "the consumer processed every committed event",
        || async {
            let done: HashSet<String> = dest.processed().into_iter().map(|(id, _)| id).collect();
            let missing: Vec<&str> = events
                .iter()
                .map(|(id, _)| id.as_str())
                .filter(|id| !done.contains(*id) && !except.contains(*id))
                .collect();
            if missing.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "{} of {} not processed, e.g. {:?}",
                    missing.len(),
                    events.len(),
                    &missing[..missing.len().min(3)]
                ))
            }
        },
    )
    .await;
}

/// The checks every scenario ends with (see the module's documentation).
async fn check(
    kind: Kind,
    fault: Fault,
    outbox: &Outbox,
    dest: &Destination,
    committed: &Events,
    outcome: Outcome,
) {
    let failed: HashMap<String, String> = if outcome.may_fail {
        failed_rows(outbox).await
    } else {
        HashMap::new()
    };
    let failed_ids: HashSet<String> = failed.keys().cloned().collect();
    // 1. Every committed event processed at least once.
    wait_processed(dest, committed, &failed_ids).await;
    crate::sqs::slot_passes_last_commit(outbox).await;
    let published = committed.len() - failed.len();
    crate::sqs::all_rows(outbox, "PUBLISHED", published).await;
    let states = crate::sqs::publish_states(outbox).await;
    assert_eq!(
        states.get("FAILED").copied().unwrap_or(0) + states.get("DEAD").copied().unwrap_or(0),
        i64::try_from(failed.len()).unwrap(),
        "rows FAILED or DEAD: {states:?}"
    );
    let processed = dest.processed();
    let distinct: HashSet<&str> = processed.iter().map(|(id, _)| id.as_str()).collect();
    // A FAILED row was refused every time it was sent: never processed.
    for id in &failed_ids {
        assert!(
            !distinct.contains(id.as_str()),
            "FAILED event {id} was processed too"
        );
        assert!(
            dest.calls().iter().any(|c| c.refused && c.ids.contains(id)),
            "FAILED event {id} was refused by the destination"
        );
    }
    // 2. Nothing confirmed that was never processed.
    let mut confirmed_ids = confirmed(outbox).await;
    confirmed_ids.extend(outcome.confirmed_during);
    let never: Vec<&String> = confirmed_ids
        .iter()
        .filter(|id| !distinct.contains(id.as_str()) && !failed_ids.contains(*id))
        .collect();
    assert!(
        never.is_empty(),
        "{} events confirmed (slot or PUBLISHED) were never processed, e.g. {:?} ({})",
        never.len(),
        &never[..never.len().min(3)],
        dest.describe_front()
    );
    // 3. Each group's order of first processing against its commit order.
    let mut want: HashMap<&str, Vec<&str>> = HashMap::new();
    for (id, group) in committed {
        if !failed_ids.contains(id) {
            want.entry(group).or_default().push(id);
        }
    }
    let mut first: HashSet<&str> = HashSet::new();
    let mut have: HashMap<&str, Vec<&str>> = HashMap::new();
    for (id, group) in &processed {
        if first.insert(id) {
            have.entry(group).or_default().push(id);
        }
    }
    let out_of_order: Vec<&str> = want
        .iter()
        .filter(|(group, ids)| have.get(*group) != Some(*ids))
        .map(|(group, _)| *group)
        .collect();
    let order = if out_of_order.is_empty() {
        format!("in commit order ({} of {} groups)", want.len(), want.len())
    } else {
        format!(
            "{} of {} groups out of order",
            out_of_order.len(),
            want.len()
        )
    };
    // 4. Repeats bounded.
    let repeats = processed.len() - distinct.len();
    let (bound, why) = &outcome.repeats_bound;
    let summary = format!(
        "{}/{}\t{order}\t{repeats} (bound {bound}: {why})\t{}",
        distinct.len(),
        committed.len() - failed.len(),
        outcome.note
    );
    eprintln!("conformance: {} × {}: {summary}", kind.name(), fault.name());
    report(kind, fault, &summary);
    if kind.promises_order() {
        assert!(
            out_of_order.is_empty(),
            "{}: groups {out_of_order:?} were first processed out of commit order",
            kind.name()
        );
    }
    assert!(
        repeats <= *bound,
        "{repeats} repeats processed, more than {bound} ({why}); the calls:\n{}",
        dest.describe_calls()
    );
}

/// Appends one line to `target/conformance/results.tsv` (destination, fault,
/// then the summary), from which docs/guarantees.md's table is made.
fn report(kind: Kind, fault: Fault, summary: &str) {
    use std::io::Write as _;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/conformance");
    let _ = std::fs::create_dir_all(&dir);
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("results.tsv"))
    {
        let _ = writeln!(f, "{}\t{}\t{summary}", kind.name(), fault.name());
    }
}

/// The webhook batch the issue reproduced: A (group g1) and B (g2) go out as
/// one request; the receiver processes it and answers after the timeout;
/// meanwhile A2 (g1) commits; the relay forms its batches again (B alone,
/// then A with A2, or any other way). A receiver that drops a `webhook-id` it
/// has processed must still process A2: a batch's id names its content.
/// Three rounds, so the re-formed batch is met whatever the relay's timing;
/// each ends once the slot confirmed it.
async fn webhook_batch_formed_again_after_a_late_answer() {
    let outbox = Outbox::new().await;
    let dest = Destination::new(Kind::WebhookBatch, &outbox).await;
    let mut relay = dest.spawn(&outbox);
    outbox.wait_slot_active(true).await;
    let mut committed: Events = Vec::new();
    for round in 0..3 {
        let (g1, g2) = (format!("r{round}-g1"), format!("r{round}-g2"));
        let before = dest.calls().len();
        dest.script(&[Injected::AnswerLate(beyond_the_timeout())]);
        let ab = outbox
            .insert_tx(&[(g1.clone(), "A".to_owned()), (g2.clone(), "B".to_owned())])
            .await;
        committed.extend(ab.into_iter().zip([g1.clone(), g2]));
        wait_until(
            Duration::from_secs(30),
            "the receiver processed [A, B]",
            || async {
                let calls = dest.calls();
                calls[before.min(calls.len())..]
                    .iter()
                    .any(|c| c.faulted && c.forwarded)
            },
        )
        .await;
        let a2 = outbox.insert_tx(&[(g1.clone(), "A2".to_owned())]).await;
        committed.extend(a2.into_iter().map(|id| (id, g1.clone())));
        wait_processed(&dest, &committed, &HashSet::new()).await;
        // Every call of the round answered, so the next round's scripted
        // fault meets its own batch: a call of this one still in flight
        // (answered late by a loaded machine) would take it, and re-form
        // with the next round's events.
        crate::sqs::slot_passes_last_commit(&outbox).await;
    }
    let outcome = Outcome {
        repeats_bound: (
            6,
            "A and B of each round once more, after the late answer".to_owned(),
        ),
        may_fail: false,
        confirmed_during: HashSet::new(),
        note: "the issue's re-formed batch, three rounds".to_owned(),
    };
    check(
        Kind::WebhookBatch,
        Fault::ReformedBatch,
        &outbox,
        &dest,
        &committed,
        outcome,
    )
    .await;
    relay.stop_gracefully().await;
}
