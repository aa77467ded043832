//! Database failover: a primary, a streaming standby that synchronizes the
//! relay's failover slot (PostgreSQL 17+), a crash of the primary and the
//! promotion of the standby; the relay follows the URL's hosts to the new
//! primary and streams on from the synchronized slot.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use harness::{wait_until, Cluster, RelayProcess, StopMode};

use crate::outbox::{envelope_ids, produce, Outbox};

const QUICK_RETRY: &str = "[retry]\ninitial = \"100ms\"\nmax = \"1s\"\n";

/// Point the relay configuration `file` at both servers, wanting the
/// writable one (`target_session_attrs=read-write`), as an operator whose
/// database may fail over writes it.
fn follow_both(file: &std::path::Path, primary: &Cluster, standby: &Cluster) {
    let text = std::fs::read_to_string(file).unwrap();
    let one = format!("127.0.0.1:{}", primary.port());
    let both = format!("127.0.0.1:{},127.0.0.1:{}", primary.port(), standby.port());
    let start = text.find("url = \"").unwrap() + 7;
    let url = &text[start..][..text[start..].find('"').unwrap()];
    let mut multi = url.replacen(&one, &both, 1);
    multi.push(if multi.contains('?') { '&' } else { '?' });
    multi.push_str("target_session_attrs=read-write");
    std::fs::write(file, text.replacen(url, &multi, 1)).unwrap();
}

/// The relay's failover slot, created as `setup` renders it with
/// `postgres.failover_slot` (instead of the test database's own slot).
async fn failover_slot(outbox: &Outbox) {
    let config = outbox.config(&format!("failover_slot = true\n{QUICK_RETRY}"));
    let files = outbox_relay::setup::render(&config, &outbox.role, false).unwrap();
    let (_, create) = files
        .iter()
        .find(|(file, _)| *file == "003_slot.sql")
        .unwrap();
    outbox.drop_slot().await;
    outbox.sql.batch_execute(create).await.unwrap();
}

/// Whether `cluster` is PostgreSQL 17 or later (failover slots); says so
/// when it is not.
fn has_failover_slots(cluster: &Cluster) -> bool {
    let version: i32 = cluster
        .psql("SHOW server_version_num")
        .parse()
        .expect("server_version_num");
    if version < 170_000 {
        // Failover slots (pg_create_logical_replication_slot's `failover`,
        // sync_replication_slots) came with PostgreSQL 17: before it a
        // promoted standby has no logical slot (docs/recovery.md).
        eprintln!("skipped: failover slots need PostgreSQL 17 or later (this is {version})");
    }
    version >= 170_000
}

/// The operator's slip of issue 28: the primary waits for its standby's
/// physical slot (`synchronized_standby_slots = 'standby1'`), the standby is
/// copied with that setting, and promoted after a crash. The promoted server
/// names a slot it does not have, so its walsender waits for ever: the
/// relay's `/readyz` fails and its log names the slot and the fix within a
/// minute, and once the operator resets the setting every event written on
/// the promoted server arrives.
/// A standby of `primary`, `standby1`, whose slot sync worker keeps its copy
/// of the failover slot as a standby should: on its own schedule, while the
/// relay streams.
async fn syncing_standby(primary: &Arc<Cluster>) -> Cluster {
    let primary = Arc::clone(primary);
    tokio::task::spawn_blocking(move || {
        Cluster::standby_of(&primary, "standby1", "sync_replication_slots = on")
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_standby_left_with_a_stale_synchronized_standby_slots_is_named_and_the_fix_delivers_everything(
) {
    let primary = Arc::new(tokio::task::spawn_blocking(Cluster::start).await.unwrap());
    if !has_failover_slots(&primary) {
        return;
    }
    let mut outbox = Outbox::on(&primary).await;
    failover_slot(&outbox).await;
    // Set before the copy: the standby inherits it.
    primary.psql("ALTER SYSTEM SET synchronized_standby_slots = 'standby1'");
    primary.psql("SELECT pg_reload_conf()");
    let standby = syncing_standby(&primary).await;
    outbox.reconnect().await;
    let addr = crate::stall::free_addr();
    let file = outbox.config_file(&format!(
        "failover_slot = true\n{QUICK_RETRY}[http]\nlisten = \"{addr}\""
    ));
    follow_both(&file, &primary, &standby);
    let mut relay = RelayProcess::spawn(&["run", "--config", file.to_str().unwrap()], &[]);
    outbox.wait_slot_active(true).await;
    let before = outbox.insert_many(2, 5, 5).await;
    crate::stall::wait_delivered(&relay, &before).await;
    let synced = format!(
        "SELECT synced::text || (NOT temporary)::text FROM pg_replication_slots WHERE slot_name = '{}'",
        outbox.slot
    );
    wait_until(
        Duration::from_secs(60),
        "the standby has a synchronized copy of the slot",
        || async { standby.try_psql(&synced).as_deref() == Some("truetrue") },
    )
    .await;

    {
        let primary = Arc::clone(&primary);
        tokio::task::spawn_blocking(move || primary.stop(StopMode::Fast))
            .await
            .unwrap();
    }
    standby.promote();
    let standby_url = outbox.db.url().replacen(
        &format!("127.0.0.1:{}", primary.port()),
        &format!("127.0.0.1:{}", standby.port()),
        1,
    );
    let (client, connection) = tokio_postgres::connect(&standby_url, tokio_postgres::NoTls)
        .await
        .expect("connect to the promoted standby");
    tokio::spawn(connection);
    let after: Vec<String> = client
        .query(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
             SELECT 'order', 'agg-' || (n % 5), 'After', '{}' FROM generate_series(1, 20) n \
             RETURNING id::text",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let body = crate::stall::wait_stall_reported(&relay, &addr, &["standby1"]).await;
    let got: HashSet<String> = envelope_ids(&relay.stdout_lines()).into_iter().collect();
    assert!(
        after.iter().all(|id| !got.contains(id)),
        "nothing written on the promoted server came out while it waits: {body}"
    );
    standby.psql("ALTER SYSTEM RESET synchronized_standby_slots");
    standby.psql("SELECT pg_reload_conf()");
    crate::stall::wait_delivered(&relay, &after).await;
    crate::stall::wait_ready(&addr).await;
    relay.stop_gracefully().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_standby_has_the_failover_slot_and_the_relay_streams_on_from_it() {
    let primary = Arc::new(tokio::task::spawn_blocking(Cluster::start).await.unwrap());
    if !has_failover_slots(&primary) {
        return;
    }
    let mut outbox = Outbox::on(&primary).await;
    failover_slot(&outbox).await;
    let standby = syncing_standby(&primary).await;
    outbox.reconnect().await;
    // Set after the copy: on the standby it would name a slot it does not
    // have once promoted, and its walsenders would wait for it forever
    // (check warns of that).
    primary.psql("ALTER SYSTEM SET synchronized_standby_slots = 'standby1'");
    primary.psql("SELECT pg_reload_conf()");

    // The relay knows both hosts and wants the writable one.
    let file = outbox.config_file(&format!("failover_slot = true\n{QUICK_RETRY}"));
    follow_both(&file, &primary, &standby);
    let one = format!("127.0.0.1:{}", primary.port());
    let both = format!("127.0.0.1:{},127.0.0.1:{}", primary.port(), standby.port());

    // A name the server has no physical slot for would stall every logical
    // walsender: check says so.
    primary.psql("ALTER SYSTEM SET synchronized_standby_slots = 'ghost'");
    primary.psql("SELECT pg_reload_conf()");
    let mut check = RelayProcess::spawn(&["check", "--config", file.to_str().unwrap()], &[]);
    check.wait_exit_async(Duration::from_secs(30)).await;
    assert!(
        check
            .stdout_text()
            .contains("names ghost that this server does not have"),
        "check warns of the missing standby slot:\n{}",
        check.stdout_text()
    );
    primary.psql("ALTER SYSTEM SET synchronized_standby_slots = 'standby1'");
    primary.psql("SELECT pg_reload_conf()");
    let mut check = RelayProcess::spawn(&["check", "--config", file.to_str().unwrap()], &[]);
    check.wait_exit_async(Duration::from_secs(30)).await;
    assert!(
        !check
            .stdout_text()
            .contains("synchronized_standby_slots is empty")
            && !check.stdout_text().contains("created without failover"),
        "check sees a failover slot waited for by a standby:\n{}",
        check.stdout_text()
    );

    let mut relay = RelayProcess::spawn(&["run", "--config", file.to_str().unwrap()], &[]);
    outbox.wait_slot_active(true).await;
    // The standby's worker has a synchronized copy of the slot, kept (a copy
    // stays temporary, and is dropped at a promotion, until the standby has
    // replayed as far as the slot on the primary).
    let synced = format!(
        "SELECT synced::text || failover::text || (NOT temporary)::text \
         FROM pg_replication_slots WHERE slot_name = '{}'",
        outbox.slot
    );
    wait_until(
        Duration::from_secs(60),
        "the standby has a synchronized copy of the slot",
        || async { standby.try_psql(&synced).as_deref() == Some("truetruetrue") },
    )
    .await;

    // A producer commits small transactions without pause; the primary is
    // stopped immediately in the middle of it and the standby promoted.
    let primary_url = outbox.db.url().to_owned();
    let standby_url = primary_url.replacen(&one, &format!("127.0.0.1:{}", standby.port()), 1);
    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let stop = Arc::clone(&stop);
        let url = format!(
            "{}{}target_session_attrs=read-write",
            primary_url.replacen(&one, &both, 1),
            if primary_url.contains('?') { '&' } else { '?' }
        );
        produce(url, stop)
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    {
        let primary = Arc::clone(&primary);
        tokio::task::spawn_blocking(move || primary.stop(StopMode::Immediate))
            .await
            .unwrap();
    }
    standby.promote();
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::SeqCst);
    assert!(producer.await.unwrap() > 0);

    // Every event the promoted server has (what was committed and survived
    // the crash) comes out.
    let (client, connection) = tokio_postgres::connect(&standby_url, tokio_postgres::NoTls)
        .await
        .expect("connect to the promoted standby");
    tokio::spawn(connection);
    let after = client
        .query(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
             SELECT 'order', 'agg-' || (n % 5), 'After', '{}' FROM generate_series(1, 10) n \
             RETURNING id::text",
            &[],
        )
        .await
        .unwrap()
        .len();
    let expected: HashSet<String> = client
        .query("SELECT id::text FROM outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    loop {
        let got: HashSet<String> = envelope_ids(&relay.stdout_lines()).into_iter().collect();
        if expected.is_subset(&got) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "every event the promoted server has came out within 90 s ({} of {}):\n{}",
            expected.intersection(&got).count(),
            expected.len(),
            relay.stderr_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let log = relay.stderr_text();
    relay.stop_gracefully().await;
    assert!(
        log.matches(" streaming").count() >= 2,
        "a second session, on the promoted server:\n{log}"
    );
    eprintln!(
        "{} events, {} of them on the promoted server",
        expected.len(),
        after
    );
}
