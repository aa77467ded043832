//! The relay's own position (`<table>_position`): a restart of PostgreSQL
//! does not send again what was published, and a kept position of doubtful
//! provenance is ignored without losing anything.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use harness::{wait_until, Cluster, RelayProcess, StopMode};

use crate::outbox::{envelope_ids, Outbox};

/// Quick reconnects for tests.
const QUICK_RETRY: &str = "[retry]\ninitial = \"100ms\"\nmax = \"1s\"\n";

/// The kept position of the outbox's slot, if any.
async fn kept(outbox: &Outbox) -> Option<u64> {
    outbox
        .sql
        .query_opt(
            "SELECT confirmed_lsn::text FROM outbox_position WHERE slot_name = $1",
            &[&outbox.slot],
        )
        .await
        .expect("read the position table")
        .map(|row| crate::outbox::parse_lsn(row.get(0)))
}

/// How often each event id came out of `relays`.
fn counts<'a>(relays: impl IntoIterator<Item = &'a RelayProcess>) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for relay in relays {
        for id in envelope_ids(&relay.stdout_lines()) {
            *counts.entry(id).or_insert(0) += 1;
        }
    }
    counts
}

/// Wait until every id of `ids` came out of `relays`.
async fn delivered(relays: &[&RelayProcess], ids: &[String], what: &str) {
    wait_until(Duration::from_secs(30), what, || async {
        let got = counts(relays.iter().copied());
        ids.iter().all(|id| got.contains_key(id))
    })
    .await;
}

/// Wait until the relay kept a position at or past the last commit.
async fn kept_past_last_commit(outbox: &Outbox) {
    let last = outbox.commits().await.last().expect("a commit").end_lsn;
    wait_until(
        Duration::from_secs(10),
        "the relay kept the position of the last commit",
        || async { kept(outbox).await.is_some_and(|at| at >= last) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarts_of_postgres_do_not_send_again_what_was_published() {
    let cluster = Arc::new(tokio::task::spawn_blocking(Cluster::start).await.unwrap());
    let mut outbox = Outbox::on(&cluster).await;
    let config = outbox.config_file(QUICK_RETRY);
    let run = || RelayProcess::spawn(&["run", "--config", config.to_str().unwrap()], &[]);
    let mut first = run();
    outbox.wait_slot_active(true).await;
    let mut expected = Vec::new();

    // With the relay running: a fast, then an immediate restart.
    for mode in [StopMode::Fast, StopMode::Immediate] {
        let ids = outbox.insert_many(3, 100, 10).await;
        delivered(&[&first], &ids, "the events came out").await;
        kept_past_last_commit(&outbox).await;
        expected.extend(ids);
        let restarting = Arc::clone(&cluster);
        tokio::task::spawn_blocking(move || restarting.restart(mode))
            .await
            .unwrap();
        outbox.reconnect().await;
        outbox.wait_slot_active(true).await;
        // One more event, so the new session has streamed past the old ones.
        let after = outbox.insert_many(1, 1, 1).await;
        delivered(&[&first], &after, "the event after the restart came out").await;
        expected.extend(after);
    }

    // With the relay stopped gracefully: a fast, then an immediate restart,
    // each followed by a new relay.
    let ids = outbox.insert_many(3, 100, 10).await;
    delivered(&[&first], &ids, "the events came out").await;
    expected.extend(ids);
    first.stop_gracefully().await;
    let mut relays = vec![first];
    for mode in [StopMode::Fast, StopMode::Immediate] {
        let restarting = Arc::clone(&cluster);
        tokio::task::spawn_blocking(move || restarting.restart(mode))
            .await
            .unwrap();
        outbox.reconnect().await;
        let mut next = run();
        outbox.wait_slot_active(true).await;
        let after = outbox.insert_many(1, 100, 10).await;
        let all: Vec<&RelayProcess> = relays.iter().chain([&next]).collect();
        delivered(&all, &after, "the events after the restart came out").await;
        expected.extend(after);
        next.stop_gracefully().await;
        relays.push(next);
    }

    let got = counts(&relays);
    let repeated: Vec<_> = got.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        repeated.is_empty(),
        "{} of {} events were published again after the restarts: {:?}\n{}",
        repeated.len(),
        expected.len(),
        repeated.iter().take(5).collect::<Vec<_>>(),
        relays.last().unwrap().stderr_text()
    );
    assert!(expected.iter().all(|id| got.contains_key(id)));
    assert_eq!(got.len(), expected.len());
}

/// `n` events written while no relay runs; their ids.
async fn events_while_stopped(outbox: &Outbox, n: usize) -> Vec<String> {
    outbox.insert_many(1, n, 3).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_position_of_doubtful_provenance_is_ignored_and_nothing_is_lost() {
    let outbox = Outbox::new().await;
    let config = outbox.config_file(QUICK_RETRY);
    let run = || RelayProcess::spawn(&["run", "--config", config.to_str().unwrap()], &[]);
    let row = outbox
        .sql
        .query_one(
            "SELECT system_identifier::text, (SELECT timeline_id FROM pg_control_checkpoint()), \
                    (SELECT oid FROM pg_database WHERE datname = current_database())::int8 \
             FROM pg_control_system()",
            &[],
        )
        .await
        .unwrap();
    let (system, timeline, database): (String, i32, i64) = (row.get(0), row.get(1), row.get(2));
    // A row ahead of the slot, written on another system, timeline, in another
    // database (a copy), or ahead of the server's WAL: each a case where
    // trusting it would skip the events written while the relay was stopped.
    let doubts = [
        (
            "another system",
            "7000000000000000001",
            timeline,
            database,
            false,
            "another PostgreSQL system",
        ),
        (
            "another timeline",
            system.as_str(),
            timeline + 1,
            database,
            false,
            "timeline",
        ),
        (
            "another database",
            system.as_str(),
            timeline,
            database + 1,
            false,
            "another database",
        ),
        (
            "ahead of the WAL",
            system.as_str(),
            timeline,
            database,
            true,
            "ahead of the server's WAL",
        ),
    ];
    let mut relays = Vec::new();
    for (case, system, timeline, database, beyond, words) in doubts {
        let ids = events_while_stopped(&outbox, 20).await;
        let lsn = if beyond {
            "FFFF/0".to_owned()
        } else {
            outbox
                .sql
                .query_one("SELECT pg_current_wal_lsn()::text", &[])
                .await
                .unwrap()
                .get(0)
        };
        outbox
            .sql
            .execute(
                "INSERT INTO outbox_position (slot_name, system_identifier, timeline, database_oid, confirmed_lsn) \
                 VALUES ($1, $2, $3, $4::int8::oid, $5::text::pg_lsn) \
                 ON CONFLICT (slot_name) DO UPDATE SET system_identifier = excluded.system_identifier, \
                     timeline = excluded.timeline, database_oid = excluded.database_oid, \
                     confirmed_lsn = excluded.confirmed_lsn",
                &[&outbox.slot, &system, &timeline, &database, &lsn],
            )
            .await
            .unwrap();
        let mut relay = run();
        delivered(&[&relay], &ids, case).await;
        relay.stop_gracefully().await;
        let log = relay.stderr_text();
        assert!(log.contains(words), "{case}: the warning says why:\n{log}");
        relays.push(relay);
    }
    // The control: a row of certain provenance ahead of the slot is used, and
    // what committed before it is not sent (as after a PostgreSQL restart that
    // lost the slot's position, the events before it were published).
    let skipped = events_while_stopped(&outbox, 5).await;
    outbox
        .sql
        .execute(
            "UPDATE outbox_position SET system_identifier = $2, timeline = $3, \
                 database_oid = $4::int8::oid, confirmed_lsn = pg_current_wal_lsn() \
             WHERE slot_name = $1",
            &[&outbox.slot, &system, &timeline, &database],
        )
        .await
        .unwrap();
    let mut relay = run();
    let after = events_while_stopped(&outbox, 1).await;
    delivered(&[&relay], &after, "the event after the kept position").await;
    relay.stop_gracefully().await;
    let log = relay.stderr_text();
    assert!(
        log.contains("behind the position the relay confirmed"),
        "the kept position was used:\n{log}"
    );
    let got = counts(&relays);
    let fresh = counts([&relay]);
    assert!(
        skipped
            .iter()
            .all(|id| !fresh.contains_key(id) && !got.contains_key(id)),
        "what committed before the kept position is not sent again"
    );
}
