//! Database failover: a primary, a streaming standby that synchronizes the
//! relay's failover slot (PostgreSQL 17+), a crash of the primary and the
//! promotion of the standby; the relay follows the URL's hosts to the new
//! primary and streams on from the synchronized slot.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use harness::{wait_until, Cluster, RelayProcess, StopMode};

use crate::outbox::{envelope_ids, Outbox};

const QUICK_RETRY: &str = "[retry]\ninitial = \"100ms\"\nmax = \"1s\"\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_standby_has_the_failover_slot_and_the_relay_streams_on_from_it() {
    let primary = Arc::new(tokio::task::spawn_blocking(Cluster::start).await.unwrap());
    let version: i32 = primary
        .psql("SHOW server_version_num")
        .parse()
        .expect("server_version_num");
    if version < 170_000 {
        // Failover slots (pg_create_logical_replication_slot's `failover`,
        // sync_replication_slots) came with PostgreSQL 17: before it a
        // promoted standby has no logical slot (docs/recovery.md).
        eprintln!("skipped: failover slots need PostgreSQL 17 or later (this is {version})");
        return;
    }
    let mut outbox = Outbox::on(&primary).await;
    // The relay's slot as `setup` creates it with postgres.failover_slot.
    let config = outbox.config(&format!("failover_slot = true\n{QUICK_RETRY}"));
    let files = outbox_relay::setup::render(&config, &outbox.role, false).unwrap();
    let (_, create) = files
        .iter()
        .find(|(file, _)| *file == "003_slot.sql")
        .unwrap();
    outbox
        .sql
        .execute("SELECT pg_drop_replication_slot($1)", &[&outbox.slot])
        .await
        .unwrap();
    outbox.sql.batch_execute(create).await.unwrap();
    let standby = {
        let primary = Arc::clone(&primary);
        tokio::task::spawn_blocking(move || {
            // The test synchronizes by hand (pg_sync_replication_slots), so
            // the moment is known; the worker (sync_replication_slots = on)
            // does the same on its own schedule.
            Cluster::standby_of(&primary, "standby1", "sync_replication_slots = off")
        })
        .await
        .unwrap()
    };
    outbox.reconnect().await;
    // Set after the copy: on the standby it would name a slot it does not
    // have once promoted, and its walsenders would wait for it forever
    // (check warns of that).
    primary.psql("ALTER SYSTEM SET synchronized_standby_slots = 'standby1'");
    primary.psql("SELECT pg_reload_conf()");

    // The relay knows both hosts and wants the writable one.
    let file = outbox.config_file(&format!("failover_slot = true\n{QUICK_RETRY}"));
    let text = std::fs::read_to_string(&file).unwrap();
    let one = format!("127.0.0.1:{}", primary.port());
    let both = format!("127.0.0.1:{},127.0.0.1:{}", primary.port(), standby.port());
    let url_end = text[text.find("url = \"").unwrap() + 7..]
        .find('"')
        .unwrap();
    let url = &text[text.find("url = \"").unwrap() + 7..][..url_end];
    let mut multi = url.replacen(&one, &both, 1);
    multi.push(if multi.contains('?') { '&' } else { '?' });
    multi.push_str("target_session_attrs=read-write");
    std::fs::write(&file, text.replacen(url, &multi, 1)).unwrap();

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
    let mut expected = outbox.insert_many(5, 10, 5).await;
    wait_until(
        Duration::from_secs(30),
        "the first events came out",
        || async {
            let got: HashSet<String> = envelope_ids(&relay.stdout_lines()).into_iter().collect();
            expected.iter().all(|id| got.contains(id))
        },
    )
    .await;
    // The standby takes the slot's state (its copy is kept only once the
    // standby has replayed up to it: asked again until then), then the
    // primary crashes.
    let slot_row = format!(
        "SELECT synced::text || failover::text || (confirmed_flush_lsn >= '{}')::text \
         FROM pg_replication_slots WHERE slot_name = '{}'",
        outbox
            .sql
            .query_one(
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
                &[&outbox.slot]
            )
            .await
            .unwrap()
            .get::<_, String>(0),
        outbox.slot
    );
    wait_until(
        Duration::from_secs(30),
        "the standby has a synchronized copy of the slot, as far as the relay confirmed",
        || async {
            let _ = standby.try_psql("SELECT pg_sync_replication_slots()");
            standby.try_psql(&slot_row).as_deref() == Some("truetruetrue")
        },
    )
    .await;
    {
        let primary = Arc::clone(&primary);
        tokio::task::spawn_blocking(move || primary.stop(StopMode::Immediate))
            .await
            .unwrap();
    }
    standby.promote();

    // Written on the new primary: the relay must find it and stream on.
    let (client, connection) = tokio_postgres::connect(
        &outbox
            .db
            .url()
            .replacen(&one, &format!("127.0.0.1:{}", standby.port()), 1),
        tokio_postgres::NoTls,
    )
    .await
    .expect("connect to the promoted standby");
    tokio::spawn(connection);
    let rows = client
        .query(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
             SELECT 'order', 'agg-' || (n % 5), 'After', jsonb_build_object('n', n) \
             FROM generate_series(1, 20) n RETURNING id::text",
            &[],
        )
        .await
        .unwrap();
    expected.extend(rows.iter().map(|r| r.get::<_, String>(0)));
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let got: HashSet<String> = envelope_ids(&relay.stdout_lines()).into_iter().collect();
        if expected.iter().all(|id| got.contains(id)) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "every event, before and after the failover, came out within 60 s ({} of {}):\n{}",
            expected.iter().filter(|id| got.contains(*id)).count(),
            expected.len(),
            relay.stderr_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let log = relay.stderr_text();
    relay.stop_gracefully().await;
    assert!(
        log.matches("\"streaming\"").count() + log.matches(" streaming").count() >= 2,
        "a second session, on the promoted server:\n{log}"
    );
}
