//! The derived lifecycle (`on_published = "derive"`): the stream writes
//! nothing per published row; a row's state is derived from the snapshot the
//! relay vouched for, except in the holes, where rows keep explicit states.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use harness::{wait_until, RelayProcess};

use crate::outbox::{envelope_ids, Collect, Outbox, Running};

const DERIVE: &str = "[lifecycle]\non_published = \"derive\"\n";

/// Quick reconnects for tests.
const QUICK_RETRY: &str = "[retry]\ninitial = \"100ms\"\nmax = \"1s\"\n";

/// Each row's state: derived `PUBLISHED`, or its explicit one; and whether
/// it was derived.
async fn states(outbox: &Outbox) -> HashMap<String, (String, bool)> {
    outbox
        .sql
        .query(
            // The view setup made: derived when it reads PUBLISHED while the
            // row itself still says PENDING.
            "SELECT id::text, state, state = 'PUBLISHED' AND publish_state = 'PENDING' FROM outbox_state",
            &[],
        )
        .await
        .expect("read the derived states")
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2))))
        .collect()
}

/// Ids derived published.
async fn derived_published(outbox: &Outbox) -> HashSet<String> {
    states(outbox)
        .await
        .into_iter()
        .filter(|(_, (_, derived))| *derived)
        .map(|(id, _)| id)
        .collect()
}

/// The slot's row: vouched snapshot, its W, and the holes (`from`, `to`).
struct Position {
    snapshot: Option<String>,
    lsn: Option<String>,
    holes: Option<Vec<(String, String)>>,
}

async fn position(outbox: &Outbox) -> Option<Position> {
    let row = outbox
        .sql
        .query_opt(
            "SELECT snapshot::text, snapshot_lsn::text, hole_from::text[], hole_to::text[] \
             FROM outbox_position WHERE slot_name = $1",
            &[&outbox.slot],
        )
        .await
        .expect("read the position row")?;
    let from: Option<Vec<String>> = row.get(2);
    let to: Option<Vec<String>> = row.get(3);
    Some(Position {
        snapshot: row.get(0),
        lsn: row.get(1),
        holes: from.zip(to).map(|(f, t)| f.into_iter().zip(t).collect()),
    })
}

/// Rows whose only version is the one their transaction inserted: nothing
/// updated them (a row's `xmin` is its inserting transaction, `relay_txid`
/// the same id here: no savepoints, epoch 0).
async fn untouched(outbox: &Outbox) -> i64 {
    outbox
        .sql
        .query_one(
            "SELECT count(*) FROM outbox WHERE publish_state = 'PENDING' AND xmin::text = relay_txid::text",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// Wait until the slot's row holds its holes (the boundary, at a first
/// start); them.
async fn boundary_hole(outbox: &Outbox) -> Vec<(String, String)> {
    wait_until(
        Duration::from_secs(30),
        "the boundary hole is written",
        || async {
            position(outbox)
                .await
                .and_then(|p| p.holes)
                .filter(|h| !h.is_empty())
        },
    )
    .await
}

/// Wait until the slot's row holds no hole (`what` names it).
async fn holes_closed(outbox: &Outbox, within: Duration, what: &str) {
    wait_until(within, what, || async {
        position(outbox)
            .await
            .and_then(|p| p.holes)
            .is_some_and(|h| h.is_empty())
    })
    .await;
}

/// Wait until every id of `ids` is derived published.
async fn all_derived(outbox: &Outbox, ids: &[String], what: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let published = derived_published(outbox).await;
        if ids.iter().all(|id| published.contains(id)) {
            return;
        }
        if std::time::Instant::now() > deadline {
            panic!(
                "timed out after 30s waiting until {what}; {}",
                keeper_state(outbox, ids).await
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Wait until every row of `ids` reads `PUBLISHED` explicitly (marked, not
/// derived): `what` names it in the timeout's message.
async fn all_marked(outbox: &Outbox, ids: &[String], what: &str) {
    wait_until(Duration::from_secs(30), what, || async {
        let states = states(outbox).await;
        ids.iter()
            .all(|id| states[id] == ("PUBLISHED".to_owned(), false))
    })
    .await;
}

/// What tells why no pair vouches for `ids`: the slot's row, the slot and
/// its walsender, the server's positions and the rows' ids.
async fn keeper_state(outbox: &Outbox, ids: &[String]) -> String {
    outbox
        .sql
        .query_one(
            "SELECT format('row: snapshot %s at %s, confirmed %s, updated %s, holes %s..%s; \
                    slot: confirmed %s, active %s; walsender: sent %s, flush %s, state %s, reply %s; \
                    server: insert %s, flush %s, snapshot %s; ids %s', \
                    p.snapshot, p.snapshot_lsn, p.confirmed_lsn, p.updated_at, p.hole_from, p.hole_to, \
                    s.confirmed_flush_lsn, s.active_pid, r.sent_lsn, r.flush_lsn, r.state, r.reply_time, \
                    pg_current_wal_insert_lsn(), pg_current_wal_flush_lsn(), pg_current_snapshot(), \
                    (SELECT string_agg(o.relay_txid::text || ' ' || o.publish_state, ', ') \
                     FROM outbox o WHERE o.id::text = ANY($2))) \
             FROM pg_replication_slots s \
             LEFT JOIN outbox_position p ON p.slot_name = s.slot_name \
             LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid \
             WHERE s.slot_name = $1",
            &[&outbox.slot, &ids],
        )
        .await
        .map(|r| r.get::<_, String>(0))
        .unwrap_or_else(|e| format!("(cannot read the keeper's state: {e})"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn derive_publishes_every_row_and_writes_none_of_them() {
    let outbox = Outbox::new().await;
    let (sink, relay) = outbox.streaming(DERIVE).await;
    let ids = outbox.insert_many(20, 50, 7).await;
    wait_until(
        Duration::from_secs(30),
        "every row reached the sink",
        || async { sink.ids().len() >= ids.len() },
    )
    .await;
    all_derived(&outbox, &ids, "every row is derived published").await;
    assert_eq!(sink.ids().len(), ids.len(), "each row once");
    // Not one row written by the relay: every row is the version its
    // transaction inserted, still PENDING.
    assert_eq!(untouched(&outbox).await, ids.len() as i64);
    let p = position(&outbox).await.expect("the slot's row");
    assert!(p.snapshot.is_some() && p.lsn.is_some());
    let holes = p.holes.expect("the holes were written");
    assert!(holes.len() <= 1, "{:?}", holes);
    if let Some((from, _)) = holes.first() {
        assert_eq!(from, "1:1:", "the first hole is the slot's boundary");
    }
    // The boundary held no row with an id: it closes at the first look.
    holes_closed(&outbox, Duration::from_secs(20), "the boundary hole closes").await;
    // An idle relay writes nothing: the row stays as it is.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before: String = outbox
        .sql
        .query_one(
            "SELECT xmin::text FROM outbox_position WHERE slot_name = $1",
            &[&outbox.slot],
        )
        .await
        .unwrap()
        .get(0);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after: String = outbox
        .sql
        .query_one(
            "SELECT xmin::text FROM outbox_position WHERE slot_name = $1",
            &[&outbox.slot],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(before, after, "an idle relay wrote its position row");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_in_the_boundary_hole_is_marked_by_the_stream_and_not_polled_again() {
    let outbox = Outbox::new().await;
    // After the slot exists, before the relay's first start: in the boundary.
    let early = outbox.insert_many(1, 3, 3).await;
    let inserted = std::time::Instant::now();
    let sink = Collect::default();
    let relay = Running::start(
        outbox.config(&format!(
            "{DERIVE}[poller]\ninterval = \"200ms\"\ngrace = \"8s\"\n"
        )),
        sink.clone(),
    );
    outbox.wait_slot_active(true).await;
    all_marked(&outbox, &early, "the early rows end explicitly PUBLISHED").await;
    // Past the poller's grace (long enough for the stream to get there
    // first on a busy machine: a poller that wins publishes them too, at
    // least once), several rounds: the stream marked them, so the poller
    // takes none of them again.
    tokio::time::sleep(Duration::from_secs(10).saturating_sub(inserted.elapsed())).await;
    let got = sink.ids();
    for id in &early {
        assert_eq!(
            got.iter().filter(|g| *g == id).count(),
            1,
            "{id} reached the sink once"
        );
    }
    // With no PENDING row left in it, the boundary closes (first look 5 s in).
    holes_closed(&outbox, Duration::from_secs(20), "the boundary hole closes").await;
    relay.stop().await;
}

/// A session's round of closing holes writes the arrays it read, minus the
/// holes it closed; a round outlives its session, and a later session (of
/// this relay, or of one that took the slot over) may have opened a hole
/// meanwhile. The round writes only over the holes it read: here a hole
/// written into the row behind the running session's back survives the
/// session's closing of the boundary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_holes_never_erases_a_hole_another_session_wrote() {
    let outbox = Outbox::new().await;
    let early = outbox.insert_many(1, 3, 3).await;
    let sink = Collect::default();
    let started = std::time::Instant::now();
    let relay = Running::start(outbox.config(DERIVE), sink.clone());
    let boundary = boundary_hole(&outbox).await;
    // The first look at the holes is 5 s into the session.
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "the boundary was written {:?} into the session, too late for this test",
        started.elapsed()
    );
    let other: String = outbox
        .sql
        .query_one(
            "UPDATE outbox_position SET hole_from = hole_from || pg_current_snapshot(), \
                    hole_to = hole_to || pg_current_snapshot() \
              WHERE slot_name = $1 RETURNING pg_current_snapshot()::text",
            &[&outbox.slot],
        )
        .await
        .unwrap()
        .get(0);
    all_marked(&outbox, &early, "the stream marks the boundary's rows").await;
    // Past the first look, with nothing left in the boundary.
    tokio::time::sleep(Duration::from_secs(12).saturating_sub(started.elapsed())).await;
    let holes = position(&outbox).await.and_then(|p| p.holes).unwrap();
    assert!(
        holes.contains(&(other.clone(), other.clone())),
        "the hole another session wrote is kept: {holes:?} (the boundary was {boundary:?})"
    );
    relay.stop().await;
}

/// Rows of an `UNLOGGED` partition write no WAL: never streamed, yet every
/// later snapshot sees their ids. While the outbox has such a partition the
/// relay vouches for nothing new: the stream marks what it publishes, the
/// poller publishes the partition's rows, and `check` says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_of_an_unlogged_partition_are_never_derived_published() {
    let outbox = with_an_unlogged_partition().await;
    let warned = crate::check::warnings(&crate::check::check(&outbox.config("")).await);
    assert!(
        warned.len() == 1
            && warned[0].contains("outbox_2019 (unlogged) of table public.outbox writes no WAL")
            && warned[0].contains("SET LOGGED"),
        "{warned:#?}"
    );
    let (sink, relay) = outbox
        .streaming(&format!(
            "{DERIVE}[poller]\ninterval = \"200ms\"\ngrace = \"2s\"\n"
        ))
        .await;
    let unlogged = returned(
        outbox
            .sql
            .simple_query(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at) \
                 SELECT 'order', 'u-' || g, 'E', '{}', timestamptz '2019-06-01' + g * interval '1 s' \
                   FROM generate_series(1, 3) g RETURNING id::text",
            )
            .await
            .unwrap(),
    );
    let logged = outbox.insert_many(2, 2, 1).await;
    published_once_by_the_poller(&outbox, &sink, &unlogged, &logged).await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_without_an_id_is_marked_explicitly() {
    let outbox = Outbox::new().await;
    // Before the migration: no id.
    let old = outbox.insert_many(1, 2, 2).await;
    outbox
        .sql
        .execute(
            "UPDATE outbox SET relay_txid = NULL WHERE id::text = ANY($1)",
            &[&old],
        )
        .await
        .unwrap();
    let sink = Collect::default();
    let relay = Running::start(
        outbox.config(&format!("{DERIVE}[poller]\nenabled = false\n")),
        sink.clone(),
    );
    outbox.wait_slot_active(true).await;
    // A NULL written after the relay started (outside every hole), and an
    // ordinary row.
    let forged: String = outbox
        .sql
        .query_one(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, relay_txid) \
             VALUES ('order', 'n', 'Null', '{}', NULL) RETURNING id::text",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let plain = outbox.insert_many(1, 1, 1).await;
    let unmarked: Vec<String> = old.iter().chain([&forged]).cloned().collect();
    all_marked(&outbox, &unmarked, "rows without an id end PUBLISHED").await;
    all_derived(&outbox, &plain, "the ordinary row is derived published").await;
    assert_eq!(sink.ids().len(), 4);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_asynchronous_commits_the_vouched_w_was_flushed_when_stored() {
    let outbox = Outbox::new().await;
    // Each write of the row, with the flush position at that moment.
    outbox
        .sql
        .batch_execute(
            "CREATE TABLE pair_audit (w pg_lsn, flushed pg_lsn); \
             CREATE FUNCTION audit_pair() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$ \
             BEGIN \
                 IF NEW.snapshot_lsn IS NOT NULL THEN \
                     INSERT INTO pair_audit VALUES (NEW.snapshot_lsn, pg_current_wal_flush_lsn()); \
                 END IF; \
                 RETURN NEW; \
             END $$; \
             CREATE TRIGGER audit_pair BEFORE INSERT OR UPDATE ON outbox_position \
                 FOR EACH ROW EXECUTE FUNCTION audit_pair();",
        )
        .await
        .unwrap();
    let sink = Collect::default();
    let relay = Running::start(
        outbox.config(&format!("{DERIVE}[poller]\nenabled = false\n")),
        sink.clone(),
    );
    outbox.wait_slot_active(true).await;
    // Writers committing asynchronously: visible before their commit is flushed.
    let mut writers = Vec::new();
    for w in 0..4 {
        let client = outbox.db.client().await;
        writers.push(tokio::spawn(async move {
            client
                .batch_execute("SET synchronous_commit = off")
                .await
                .unwrap();
            let mut ids = Vec::new();
            for t in 0..40 {
                let rows = client
                    .query(
                        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
                         SELECT 'order', 'w' || $1::int || '-' || n % 5, 'Async', \
                                jsonb_build_object('pad', repeat('x', 2000), 'n', n) \
                         FROM generate_series(1, 25) n RETURNING id::text",
                        &[&(w * 1000 + t)],
                    )
                    .await
                    .unwrap();
                ids.extend(rows.iter().map(|r| r.get::<_, String>(0)));
            }
            ids
        }));
    }
    let mut ids = Vec::new();
    for w in writers {
        ids.extend(w.await.unwrap());
    }
    all_derived(
        &outbox,
        &ids,
        "every asynchronously committed row is derived published",
    )
    .await;
    let audit = outbox
        .sql
        .query(
            "SELECT w::text, flushed::text, w <= flushed FROM pair_audit",
            &[],
        )
        .await
        .unwrap();
    assert!(!audit.is_empty(), "no pair was stored");
    for row in &audit {
        assert!(
            row.get::<_, bool>(2),
            "a pair was stored with W {} beyond the flushed WAL {}",
            row.get::<_, String>(0),
            row.get::<_, String>(1)
        );
    }
    relay.stop().await;
}

/// Insert `rows` rows of `event_type` in one transaction, over `aggregates`
/// aggregates, their payloads naming `t`; their ids.
async fn insert_rows(
    client: &tokio_postgres::Client,
    event_type: &str,
    t: i32,
    rows: i32,
    aggregates: i32,
) -> Vec<String> {
    client
        .query(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
             SELECT 'order', $2 || '-' || n % $4, $2, jsonb_build_object('t', $1::int, 'n', n) \
             FROM generate_series(1, $3) n RETURNING id::text",
            &[&t, &event_type, &rows, &aggregates],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// The relay binary with `config`.
fn run(config: &std::path::Path) -> RelayProcess {
    RelayProcess::spawn(&["run", "--config", config.to_str().unwrap()], &[])
}

fn delivered(relays: &[&RelayProcess]) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for relay in relays {
        for id in envelope_ids(&relay.stdout_lines()) {
            *counts.entry(id).or_insert(0) += 1;
        }
    }
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_mid_stream_derives_nothing_it_did_not_deliver() {
    let outbox = Outbox::new().await;
    let config = outbox.config_file(&format!("{DERIVE}{QUICK_RETRY}[poller]\nenabled = false\n"));
    let mut first = run(&config);
    outbox.wait_slot_active(true).await;
    let before = outbox.insert_many(10, 50, 5).await;
    all_derived(&outbox, &before, "the first rows are derived published").await;
    // More rows, and kill -9 while they stream.
    let writing = {
        let client = outbox.db.client().await;
        tokio::spawn(async move {
            let mut ids = Vec::new();
            for t in 0..60 {
                ids.extend(insert_rows(&client, "Kill", t, 50, 5).await);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            ids
        })
    };
    wait_until(
        Duration::from_secs(30),
        "some of the new rows came out",
        || async { delivered(&[&first]).len() > before.len() + 200 },
    )
    .await;
    first.kill9();
    let during = writing.await.unwrap();
    let vouched = position(&outbox).await.expect("the slot's row");
    let kept: String = outbox
        .sql
        .query_one(
            "SELECT confirmed_lsn::text FROM outbox_position WHERE slot_name = $1",
            &[&outbox.slot],
        )
        .await
        .unwrap()
        .get(0);
    let slot_ahead = outbox.confirmed_flush().await > crate::outbox::parse_lsn(&kept);
    let holes_before = vouched.holes.clone().unwrap_or_default();

    // Derived published so far: delivered, every one.
    let out = delivered(&[&first]);
    let derived = derived_published(&outbox).await;
    let undelivered: Vec<_> = derived.iter().filter(|id| !out.contains_key(*id)).collect();
    assert!(
        undelivered.is_empty(),
        "derived published, never delivered: {undelivered:?}"
    );

    let mut second = run(&config);
    outbox.wait_slot_active(true).await;
    let after = outbox.insert_many(2, 10, 2).await;
    let all: Vec<String> = before
        .iter()
        .chain(&during)
        .chain(&after)
        .cloned()
        .collect();
    wait_until(Duration::from_secs(30), "every row came out", || async {
        let out = delivered(&[&first, &second]);
        all.iter().all(|id| out.contains_key(id))
    })
    .await;
    all_derived(
        &outbox,
        &after,
        "the rows after the restart are derived published",
    )
    .await;
    let out = delivered(&[&first, &second]);
    let derived = derived_published(&outbox).await;
    let undelivered: Vec<_> = derived.iter().filter(|id| !out.contains_key(*id)).collect();
    assert!(
        undelivered.is_empty(),
        "derived published, never delivered: {undelivered:?}"
    );
    // The holes: a new one from the vouched snapshot when the slot was
    // ahead of the kept position (kill -9 before the keeper wrote it).
    let holes = position(&outbox).await.unwrap().holes.unwrap();
    if slot_ahead {
        let (from, _) = holes.last().expect("a hole opened at the restart");
        assert_eq!(Some(from), vouched.snapshot.as_ref(), "{holes:?}");
    } else {
        assert!(
            holes.len() <= holes_before.len(),
            "{holes:?} after {holes_before:?}"
        );
    }
    // Rows the new session published in a hole are marked: explicit states.
    let states = states(&outbox).await;
    let second_out: HashSet<String> = envelope_ids(&second.stdout_lines()).into_iter().collect();
    for id in &second_out {
        let (state, _) = &states[id];
        assert_eq!(state, "PUBLISHED", "{id}");
    }
    second.stop_gracefully().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vouched_snapshot_of_doubtful_identity_is_discarded_until_a_new_one() {
    let outbox = Outbox::new().await;
    let config = outbox.config_file(&format!("{DERIVE}{QUICK_RETRY}[poller]\nenabled = false\n"));
    let mut relay = run(&config);
    outbox.wait_slot_active(true).await;
    let first = outbox.insert_many(2, 5, 2).await;
    all_derived(&outbox, &first, "the first rows are derived published").await;
    relay.stop_gracefully().await;

    // An S whose xmax is ahead of the server's (an earlier point in time).
    outbox
        .sql
        .execute(
            "UPDATE outbox_position SET snapshot = (x || ':' || x || ':')::pg_snapshot \
             FROM (SELECT (pg_snapshot_xmax(pg_current_snapshot())::text::int8 + 1000000)::text AS x) f \
             WHERE slot_name = $1",
            &[&outbox.slot],
        )
        .await
        .unwrap();
    let mut relay = run(&config);
    outbox.wait_slot_active(true).await;
    wait_until(
        Duration::from_secs(10),
        "the snapshot is discarded",
        || async { position(&outbox).await.unwrap().snapshot.is_none() },
    )
    .await;
    assert!(
        relay
            .stderr_text()
            .contains("vouched snapshot in the position table is discarded: its snapshot"),
        "{}",
        relay.stderr_text()
    );
    assert!(
        derived_published(&outbox).await.is_empty(),
        "nothing derived without a pair"
    );
    let second = outbox.insert_many(1, 3, 1).await;
    let both: Vec<String> = first.iter().chain(&second).cloned().collect();
    all_derived(&outbox, &both, "a new pair vouches for every row again").await;
    relay.stop_gracefully().await;

    // A row written by another system: its snapshots name another history.
    outbox
        .sql
        .execute(
            "UPDATE outbox_position SET system_identifier = '7000000000000000001' WHERE slot_name = $1",
            &[&outbox.slot],
        )
        .await
        .unwrap();
    let mut relay = run(&config);
    outbox.wait_slot_active(true).await;
    wait_until(
        Duration::from_secs(10),
        "the snapshot is discarded",
        || async { position(&outbox).await.unwrap().snapshot.is_none() },
    )
    .await;
    assert!(
        relay
            .stderr_text()
            .contains("vouched snapshot in the position table is discarded: it was written by another PostgreSQL system"),
        "{}",
        relay.stderr_text()
    );
    let holes = position(&outbox).await.unwrap().holes.unwrap();
    assert_eq!(holes.len(), 1, "a fresh boundary: {holes:?}");
    assert_eq!(holes[0].0, "1:1:");
    let third = outbox.insert_many(1, 2, 1).await;
    all_derived(&outbox, &third, "a new pair vouches for the new rows").await;
    let derived = derived_published(&outbox).await;
    assert!(
        both.iter().all(|id| !derived.contains(id)),
        "rows before the fresh boundary stay the poller's"
    );
    let out: HashSet<String> = envelope_ids(&relay.stdout_lines()).into_iter().collect();
    assert!(third.iter().all(|id| out.contains(id)));
    relay.stop_gracefully().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_written_while_the_slot_was_missing_are_never_derived_published() {
    let outbox = Outbox::new().await;
    let config = format!("{DERIVE}recreate_slot = true\n[poller]\nenabled = false\n");
    let (sink, relay) = outbox.streaming(&config).await;
    let first = outbox.insert_many(2, 5, 2).await;
    all_derived(&outbox, &first, "the first rows are derived published").await;
    relay.stop().await;
    let vouched = position(&outbox).await.unwrap().snapshot.expect("a pair");

    // The slot is lost; rows written meanwhile are in no slot's stream.
    outbox.drop_slot().await;
    let missed = outbox.insert_many(1, 4, 2).await;
    let relay = Running::start(outbox.config(&config), sink.clone());
    // Not only the slot active: a slot the relay creates is active while
    // CREATE_REPLICATION_SLOT runs, before the session opens the hole to a
    // snapshot of its own. A row written then lands in the hole (streamed,
    // and marked PUBLISHED by the stream) rather than after it.
    wait_until(
        Duration::from_secs(30),
        "a hole from the vouched snapshot",
        || async {
            let holes = position(&outbox).await.and_then(|p| p.holes);
            holes.is_some_and(|h| h.last().map(|(from, _)| from) == Some(&vouched))
        },
    )
    .await;
    outbox.wait_slot_active(true).await;
    let after = outbox.insert_many(1, 3, 1).await;
    all_derived(&outbox, &after, "a new pair vouches for the rows after").await;
    let derived = derived_published(&outbox).await;
    let got: HashSet<String> = sink.ids().into_iter().collect();
    for id in &missed {
        assert!(!got.contains(id), "{id} was never streamed");
        assert!(
            !derived.contains(id),
            "{id} derived published, never delivered"
        );
    }
    relay.stop().await;
}

/// Rows committed while the publication did not carry the table are never
/// streamed (the walsender decodes with the catalog as it was), yet every
/// later snapshot sees them: the keeper finds the publication changed,
/// stores no pair and opens a hole to every later transaction; the poller
/// publishes those rows, and nothing is derived published that was not
/// delivered. A restart narrows the hole and vouching resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_written_while_the_publication_left_the_table_out_are_never_derived_published() {
    let outbox = Outbox::new().await;
    let config = format!("{DERIVE}[poller]\ninterval = \"1s\"\ngrace = \"3s\"\n");
    let (sink, relay) = outbox.streaming(&config).await;
    let first = outbox.insert_many(2, 5, 2).await;
    all_derived(&outbox, &first, "the first rows are derived published").await;
    let publication = outbox.config("").postgres.publication.clone();

    // An operator's slip: the table out of the publication for a moment.
    outbox
        .sql
        .batch_execute(&format!(
            "ALTER PUBLICATION \"{publication}\" DROP TABLE outbox"
        ))
        .await
        .unwrap();
    let dark = outbox.insert_many(1, 4, 2).await;
    outbox
        .sql
        .batch_execute(&format!(
            "ALTER PUBLICATION \"{publication}\" ADD TABLE outbox"
        ))
        .await
        .unwrap();
    let light = outbox.insert_many(2, 3, 2).await;
    wait_until(
        Duration::from_secs(30),
        "the rows after reach the sink",
        || async {
            let got: HashSet<String> = sink.ids().into_iter().collect();
            light.iter().all(|id| got.contains(id))
        },
    )
    .await;
    // While the poller has not taken them, nothing derives them published,
    // however many status intervals pass.
    for _ in 0..6 {
        let derived = derived_published(&outbox).await;
        let got: HashSet<String> = sink.ids().into_iter().collect();
        for id in dark.iter().chain(&light) {
            assert!(
                !derived.contains(id) || got.contains(id),
                "{id} derived published, never delivered"
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // A hole holds them: open to every later transaction when the keeper
    // looked while the table was out, from the vouched snapshot to its look
    // when it looked after the table was back.
    let held: bool = outbox
        .sql
        .query_one(
            "SELECT bool_and(EXISTS (SELECT 1 FROM unnest(p.hole_from, p.hole_to) h(f, t) \
                 WHERE o.relay_txid >= pg_snapshot_xmin(h.f) AND o.relay_txid < pg_snapshot_xmax(h.t) \
                   AND NOT pg_visible_in_snapshot(o.relay_txid, h.f))) \
             FROM outbox o CROSS JOIN outbox_position p WHERE o.id::text = ANY($1)",
            &[&dark],
        )
        .await
        .unwrap()
        .get(0);
    let holes = position(&outbox).await.unwrap().holes;
    assert!(held, "a hole holds every row left out: {holes:?}");
    // The poller publishes what the stream never carried and marks it: the
    // sink has each row before the round's transaction writes its state.
    wait_sent_and_published(
        &outbox,
        &sink,
        &dark,
        Duration::from_secs(60),
        "the poller publishes the rows left out and marks them PUBLISHED",
    )
    .await;
    relay.stop().await;

    // A restart finds the table carried: the hole is narrowed and vouching resumes.
    let relay = Running::start(outbox.config(&config), sink.clone());
    outbox.wait_slot_active(true).await;
    let after = outbox.insert_many(1, 3, 1).await;
    all_derived(
        &outbox,
        &after,
        "a new pair vouches for the rows after the restart",
    )
    .await;
    let holes = position(&outbox).await.unwrap().holes.unwrap();
    assert!(
        holes
            .iter()
            .all(|(_, to)| !to.starts_with("9223372036854775807:")),
        "the open hole was narrowed: {holes:?}"
    );
    let counts = sink.ids().into_iter().fold(HashMap::new(), |mut m, id| {
        *m.entry(id).or_insert(0) += 1;
        m
    });
    for id in dark.iter().chain(&first).chain(&after) {
        assert_eq!(counts.get(id), Some(&1), "{id} delivered once");
    }
    relay.stop().await;
}

/// An operator sends rows again the way the lifecycle always allowed: by
/// setting them to `PENDING`. A row published by the derived rule is
/// `PENDING` on disk already, so the requeue trigger clears its id; the
/// poller then publishes it, and it ends `PUBLISHED` explicitly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_set_to_pending_by_hand_is_sent_again() {
    let outbox = Outbox::new().await;
    let config = format!("{DERIVE}[poller]\ninterval = \"1s\"\ngrace = \"1s\"\n");
    let (sink, relay) = outbox.streaming(&config).await;
    let ids = outbox.insert_many(1, 2, 1).await;
    all_derived(&outbox, &ids, "the rows are derived published").await;
    outbox
        .sql
        .execute(
            "UPDATE outbox SET publish_state = 'PENDING' WHERE id::text = $1",
            &[&ids[0]],
        )
        .await
        .unwrap();
    wait_until(Duration::from_secs(30), "the row is sent again", || async {
        sink.ids().iter().filter(|id| **id == ids[0]).count() == 2
    })
    .await;
    wait_until(
        Duration::from_secs(10),
        "it ends PUBLISHED explicitly",
        || async {
            let row = outbox
                .sql
                .query_one(
                    "SELECT publish_state, relay_txid IS NULL FROM outbox WHERE id::text = $1",
                    &[&ids[0]],
                )
                .await
                .unwrap();
            row.get::<_, String>(0) == "PUBLISHED" && row.get::<_, bool>(1)
        },
    )
    .await;
    assert_eq!(
        sink.ids().iter().filter(|id| **id == ids[1]).count(),
        1,
        "the other row is not sent again"
    );
    relay.stop().await;
}

/// A transaction's commit can be decoded, streamed and delivered before it
/// is visible to other snapshots: under synchronous replication it stays
/// invisible until the standby answers, and under load a backend can be
/// descheduled between flushing its commit and leaving the proc array. A
/// pair taken then does not vouch for it; the keeper takes pairs until one
/// sees every transaction it delivered, so the rows are derived published
/// once visible, with no further event to prompt it. Here the standby never
/// answers until the test lets the commit go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_delivered_before_it_became_visible_is_vouched_for_once_visible() {
    let (_cluster, outbox) = private().await;
    let (sink, relay, _) = vouching_without_poller(&outbox).await;

    // A synchronous standby that never answers: commits wait, invisible.
    standby(&outbox, "SET synchronous_standby_names = 'ghost'").await;
    let (insert, waiting) = hold_a_commit(&outbox, &sink).await;
    // Pairs are taken and stored meanwhile (the relay's own writes commit
    // locally: they do not wait for the standby); none can see the commit.
    let before_wait = position(&outbox).await.unwrap().snapshot;
    wait_until(
        Duration::from_secs(30),
        "a pair is stored while the commit waits",
        || async { position(&outbox).await.unwrap().snapshot != before_wait },
    )
    .await;
    assert!(
        !derived_published(&outbox).await.contains(&waiting),
        "not derived published while invisible"
    );

    standby(&outbox, "RESET synchronous_standby_names").await;
    let ids = tokio::time::timeout(Duration::from_secs(30), insert)
        .await
        .expect("the commit is let go")
        .unwrap();
    assert_eq!(
        ids.last(),
        Some(&waiting),
        "the row delivered while invisible"
    );
    all_derived(
        &outbox,
        &ids,
        "a pair vouches for the commit delivered before it was visible",
    )
    .await;
    relay.stop().await;
}

/// With a synchronous standby that never answers set: insert until a commit
/// waits for it (its commit record written, the transaction in progress and
/// invisible), and until `sink` received that commit's row. The writer (the
/// ids it inserted, once the commit is let go) and the held row's id.
async fn hold_a_commit(
    outbox: &Outbox,
    sink: &Collect,
) -> (tokio::task::JoinHandle<Vec<String>>, String) {
    let writer = outbox.db.client().await;
    let (tx, rx) = tokio::sync::oneshot::channel();
    // Set once a commit was seen waiting: the insert in flight is the last.
    let seen = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let insert = tokio::spawn({
        let seen = std::sync::Arc::clone(&seen);
        async move {
            let _ = tx.send(
                writer
                    .query_one("SELECT pg_backend_pid()", &[])
                    .await
                    .unwrap()
                    .get::<_, i32>(0),
            );
            // Until the configuration reaches the checkpointer, a commit does
            // not wait: insert until one does.
            let mut ids = Vec::new();
            loop {
                let row = writer
                    .query_one(
                        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
                     VALUES ('order', 'sync', 'held', '{}') RETURNING id::text",
                        &[],
                    )
                    .await
                    .unwrap();
                ids.push(row.get::<_, String>(0));
                if seen.load(std::sync::atomic::Ordering::SeqCst) {
                    return ids;
                }
            }
        }
    });
    let pid = rx.await.unwrap();
    waits_for_standby(outbox, pid, "a commit waits for the standby").await;
    seen.store(true, std::sync::atomic::Ordering::SeqCst);
    let held = wait_until(
        Duration::from_secs(30),
        "the waiting commit is delivered while invisible",
        || async {
            let visible = outbox.all_ids().await;
            let held: Vec<String> = sink
                .ids()
                .into_iter()
                .filter(|id| !visible.contains(id))
                .collect();
            (held.len() == 1).then(|| held[0].clone())
        },
    )
    .await;
    (insert, held)
}

/// A graceful stop's last pair sees every transaction the session
/// delivered, also one no candidate saw: delivered before it was visible
/// (here a synchronous standby holds it; under load, a commit in the
/// instant between a candidate's snapshot and its WAL read is the same).
/// Its rows read derived published while the relay is stopped, so a poller
/// past their grace does not send them again; no row the relay did not
/// deliver does (a transaction open through the stop, one after it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_vouches_for_a_commit_it_delivered_before_it_became_visible() {
    let (_cluster, outbox) = private().await;
    let (sink, relay, before) = vouching_without_poller(&outbox).await;
    // Open through the stop: in progress in every snapshot the relay takes.
    let open = outbox.db.client().await;
    let open_id = open_row(&open).await;

    standby(&outbox, "SET synchronous_standby_names = 'ghost'").await;
    let (insert, held) = hold_a_commit(&outbox, &sink).await;
    relay.stop().await;
    commit_locally(&open).await;
    let after = outbox.db.client().await;
    let after_id = open_row(&after).await;
    commit_locally(&after).await;
    standby(&outbox, "RESET synchronous_standby_names").await;
    let ids = tokio::time::timeout(Duration::from_secs(30), insert)
        .await
        .expect("the commit is let go")
        .unwrap();
    assert_eq!(ids.last(), Some(&held), "the row delivered while invisible");

    let states = states(&outbox).await;
    let published = ("PUBLISHED".to_owned(), true);
    let unvouched: Vec<_> = before
        .iter()
        .chain(&ids)
        .filter(|id| states[*id] != published)
        .map(|id| (id, &states[id]))
        .collect();
    assert!(
        unvouched.is_empty(),
        "every delivered row reads derived PUBLISHED while the relay is stopped (the held one \
         {held}): {unvouched:?}"
    );
    for (id, what) in [
        (&open_id, "open through the stop"),
        (&after_id, "written after it"),
    ] {
        assert_eq!(states[id].0, "PENDING", "a row {what}, never delivered");
    }
}

/// The keeper's writes commit locally: a synchronous standby that never
/// answers holds neither the closing of a hole nor the pairs stored after
/// it. (Waiting there would hold the keeper's round, and with it every pair
/// and the final position of a stop, until the standby came back.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hole_closes_and_pairs_are_stored_while_a_synchronous_standby_is_away() {
    let (_cluster, outbox) = private().await;
    // Begun before the boundary hole's snapshot: the hole stays open while
    // it is in progress, so it closes only once the standby is away.
    let early = outbox.db.client().await;
    early
        .batch_execute("BEGIN; SELECT pg_current_xact_id()")
        .await
        .unwrap();
    let config = format!("{DERIVE}[poller]\nenabled = false\n");
    let (sink, relay) = outbox.streaming(&config).await;
    let hole = boundary_hole(&outbox).await;

    standby(&outbox, "SET synchronous_standby_names = 'ghost'").await;
    // A commit waits for the standby: the setting is in force.
    let (insert, _) = hold_a_commit(&outbox, &sink).await;
    assert_eq!(
        position(&outbox).await.and_then(|p| p.holes),
        Some(hole),
        "the boundary hole is open while a transaction begun before it is in progress"
    );
    commit_locally(&early).await;
    // The first look at the holes comes 5 s into the session, the next a
    // minute later.
    holes_closed(
        &outbox,
        Duration::from_secs(90),
        "the boundary hole closes while the standby is away",
    )
    .await;
    let writer = outbox.db.client().await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(open_row(&writer).await);
        commit_locally(&writer).await;
    }
    all_derived(
        &outbox,
        &ids,
        "rows committed after the hole closed are derived published while the standby is away",
    )
    .await;
    standby(&outbox, "RESET synchronous_standby_names").await;
    tokio::time::timeout(Duration::from_secs(30), insert)
        .await
        .expect("the commit is let go")
        .unwrap();
    relay.stop().await;
}

/// Begin a transaction on `client` and insert a row in it; its id.
async fn open_row(client: &tokio_postgres::Client) -> String {
    client.batch_execute("BEGIN").await.unwrap();
    client
        .query_one(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('order', 'open', 'open', '{}') RETURNING id::text",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// A database on a cluster of its own (the test changes the server's
/// settings or restarts it), and the cluster, which lives as long as it is
/// held.
async fn private() -> (std::sync::Arc<harness::Cluster>, Outbox) {
    let cluster = std::sync::Arc::new(
        tokio::task::spawn_blocking(harness::Cluster::start)
            .await
            .unwrap(),
    );
    let outbox = Outbox::on(&cluster).await;
    (cluster, outbox)
}

/// A relay on `outbox` under the derived lifecycle without the poller,
/// streaming; what it delivers, and two rows it has vouched for.
async fn vouching_without_poller(outbox: &Outbox) -> (Collect, Running, Vec<String>) {
    let config = format!("{DERIVE}[poller]\nenabled = false\n");
    let (sink, relay) = outbox.streaming(&config).await;
    let before = outbox.insert_many(1, 2, 1).await;
    all_derived(outbox, &before, "the rows before are derived published").await;
    (sink, relay, before)
}

/// Commit `client`'s open transaction with a local synchronous commit (a
/// ghost standby holds every other commit).
async fn commit_locally(client: &tokio_postgres::Client) {
    client
        .batch_execute("SET LOCAL synchronous_commit = local; COMMIT")
        .await
        .expect("commit locally");
}

/// `ALTER SYSTEM <change>`, then reload the configuration.
async fn standby(outbox: &Outbox, change: &str) {
    for sql in [
        format!("ALTER SYSTEM {change}"),
        "SELECT pg_reload_conf()".into(),
    ] {
        outbox.sql.batch_execute(&sql).await.unwrap();
    }
}

/// Wait until backend `pid` waits for a synchronous standby (its commit
/// record written, the transaction still in progress).
async fn waits_for_standby(outbox: &Outbox, pid: i32, what: &str) {
    wait_until(Duration::from_secs(30), what, || async {
        outbox
            .sql
            .query_one(
                "SELECT coalesce(wait_event = 'SyncRep', false) FROM pg_stat_activity WHERE pid = $1",
                &[&pid],
            )
            .await
            .map(|r| r.get::<_, bool>(0))
            .unwrap_or(false)
    })
    .await;
}

/// Log a running-transactions record now (a checkpoint does), so that a
/// slot being created moves on to its next phase without waiting for the
/// background writer's.
async fn log_running_xacts(outbox: &Outbox) {
    outbox.sql.batch_execute("CHECKPOINT").await.unwrap();
}

/// A transaction writes its commit record, then waits for a synchronous
/// standby, in progress, invisible. A slot created meanwhile can reach its
/// consistent point after that record (the transaction began after the
/// slot's first phases, so the slot does not wait for it): the slot never
/// streams it, and the snapshot the relay's boundary hole is taken to does
/// not see it. Once visible, a later vouched snapshot would see it: the
/// boundary hole holds every transaction begun before its snapshot, not only
/// the visible ones, so the row is the poller's, never derived published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_written_before_the_slot_was_consistent_and_visible_only_after_is_the_pollers() {
    let (_cluster, outbox) = private().await;
    outbox.drop_slot().await;
    standby(&outbox, "SET synchronous_standby_names = 'ghost'").await;

    // The slot's phases (snapbuild.c): its first record of running
    // transactions lists O1, so it waits for O1; the next lists O2 (begun
    // after the first), so it has a full snapshot and waits for O2; the
    // next lists only T (begun after the second): consistent there, after
    // T's commit record, while T waits for the standby.
    let o1 = outbox.db.client().await;
    o1.batch_execute("BEGIN; SELECT pg_current_xact_id()")
        .await
        .unwrap();
    let creator = outbox.db.client().await;
    let slot = outbox.slot.clone();
    let create = tokio::spawn(async move {
        creator
            .query_one(
                "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')",
                &[&slot],
            )
            .await
            .map(|r| r.get::<_, String>(0))
    });
    // The slot's first record of running transactions is written at its
    // restart position, right after the slot has one (the same function
    // sets one and writes the other): O2 begins once the WAL is past it.
    wait_until(
        Duration::from_secs(30),
        "the slot writes its first record of running transactions",
        || async {
            outbox
                .sql
                .query_one(
                    "SELECT count(*) FROM pg_replication_slots \
                     WHERE slot_name = $1 AND restart_lsn < pg_current_wal_insert_lsn()",
                    &[&outbox.slot],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
                == 1
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let o2 = outbox.db.client().await;
    o2.batch_execute("BEGIN; SELECT pg_current_xact_id()")
        .await
        .unwrap();
    commit_locally(&o1).await;
    log_running_xacts(&outbox).await;

    let t = outbox.db.client().await;
    let pid: i32 = t
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    t.batch_execute("BEGIN").await.unwrap();
    let row = t
        .query_one(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('order', 'early', 'held', '{}') RETURNING id::text, relay_txid::text",
            &[],
        )
        .await
        .unwrap();
    let (held, xid): (String, String) = (row.get(0), row.get(1));
    let committing = tokio::spawn(async move { t.batch_execute("COMMIT").await });
    waits_for_standby(&outbox, pid, "T's commit waits for the standby").await;
    commit_locally(&o2).await;
    log_running_xacts(&outbox).await;
    let consistent = tokio::time::timeout(Duration::from_secs(30), create)
        .await
        .expect("the slot is consistent while T waits")
        .unwrap()
        .unwrap();
    let t_waited = !committing.is_finished();

    let sink = Collect::default();
    let relay = Running::start(
        outbox.config(&format!(
            "{DERIVE}[poller]\ninterval = \"200ms\"\ngrace = \"2s\"\n"
        )),
        sink.clone(),
    );
    outbox.wait_slot_active(true).await;
    let boundary = boundary_hole(&outbox).await;
    // Nothing may fail while the standby holds commits (a cluster with a
    // commit waiting does not stop): checks come after.
    standby(&outbox, "RESET synchronous_standby_names").await;
    // The precondition: T was in progress when the boundary was taken.
    let to = &boundary[0].1;
    let visible: bool = outbox
        .sql
        .query_one(
            "SELECT pg_visible_in_snapshot($1::text::xid8, $2::text::pg_snapshot)",
            &[&xid, to],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        !visible,
        "T ({xid}) in progress at the boundary's snapshot {to} (slot consistent at {consistent})"
    );
    assert!(
        t_waited,
        "T still waited for the standby when the slot was consistent"
    );
    tokio::time::timeout(Duration::from_secs(30), committing)
        .await
        .expect("T's commit is let go")
        .unwrap()
        .unwrap();
    let after = outbox.insert_many(1, 2, 1).await;
    all_derived(&outbox, &after, "a pair vouches for the rows after").await;
    assert!(
        !derived_published(&outbox).await.contains(&held),
        "T's row, never streamed, is not derived published"
    );
    all_marked(
        &outbox,
        std::slice::from_ref(&held),
        "the poller publishes T's row and marks it",
    )
    .await;
    assert_eq!(
        sink.ids().iter().filter(|id| **id == held).count(),
        1,
        "T's row reaches the sink once"
    );
    relay.stop().await;
}

/// Write transactions of 10 rows on a connection of its own until `stop`;
/// the ids written.
async fn write_until(
    outbox: &Outbox,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<Vec<String>> {
    let client = outbox.db.client().await;
    tokio::spawn(async move {
        let mut ids = Vec::new();
        let mut t = 0;
        while !stop.is_cancelled() {
            ids.extend(insert_rows(&client, "Stop", t, 10, 3).await);
            t += 1;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        ids
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_vouches_for_what_it_delivered_and_a_restart_after_the_grace_sends_each_row_once(
) {
    let outbox = Outbox::new().await;
    // A grace shorter than the stop: every row the first run left PENDING is
    // past it when the second starts (the default is 5 minutes).
    let config = outbox.config_file(&format!(
        "{DERIVE}{QUICK_RETRY}[poller]\ngrace = \"2s\"\ninterval = \"200ms\"\n"
    ));
    let mut first = run(&config);
    outbox.wait_slot_active(true).await;
    let stop_writing = tokio_util::sync::CancellationToken::new();
    let writing = write_until(&outbox, stop_writing.clone()).await;
    wait_until(Duration::from_secs(30), "rows stream out", || async {
        delivered(&[&first]).len() >= 300
    })
    .await;
    // Stopped while rows are being written and delivered: the session's last
    // pair must be taken after its last delivered commit.
    let stopping = std::time::Instant::now();
    first.sigterm();
    let status = first.wait_exit_async(Duration::from_secs(30)).await;
    let stop_took = stopping.elapsed();
    assert!(
        status.is_some_and(|s| s.success()),
        "clean exit: {status:?}\n{}",
        first.stderr_text()
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop_writing.cancel();
    let written = writing.await.unwrap();
    let out = delivered(&[&first]);
    let states = states(&outbox).await;
    // While the relay is stopped: what it delivered reads PUBLISHED, derived
    // (no row was written); nothing else does.
    let unvouched: Vec<&String> = out
        .keys()
        .filter(|id| states[*id] != ("PUBLISHED".to_owned(), true))
        .collect();
    assert!(
        unvouched.is_empty(),
        "{} of {} delivered rows do not read derived PUBLISHED after a graceful stop (stop took {stop_took:?}): {:?}\n{}",
        unvouched.len(),
        out.len(),
        &unvouched[..unvouched.len().min(5)],
        first.stderr_text()
    );
    let undelivered_published: Vec<&String> = written
        .iter()
        .filter(|id| !out.contains_key(*id) && states[*id].0 == "PUBLISHED")
        .collect();
    assert!(
        undelivered_published.is_empty(),
        "read PUBLISHED, never delivered: {undelivered_published:?}"
    );
    let left = written.len() - out.len();
    assert!(left > 0, "rows were written after the stop");
    eprintln!(
        "stop took {stop_took:?}; {} rows delivered, all derived published; {left} left for the next run",
        out.len()
    );

    // Stopped longer than the grace: the rows it left are the next stream's.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut second = run(&config);
    wait_until(Duration::from_secs(30), "every row came out", || async {
        let out = delivered(&[&first, &second]);
        written.iter().all(|id| out.contains_key(id))
    })
    .await;
    // Several poller rounds past the grace of every row.
    tokio::time::sleep(Duration::from_secs(3)).await;
    second.stop_gracefully().await;
    let out = delivered(&[&first, &second]);
    let repeated: Vec<_> = out.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        repeated.is_empty(),
        "{} rows sent twice across a stop longer than the grace: {:?}\n{}",
        repeated.len(),
        &repeated[..repeated.len().min(5)],
        second.stderr_text()
    );
    all_derived(&outbox, &written, "every row ends derived published").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_the_keeper_cannot_vouch_for_wait_for_it_a_grace_then_the_poller_takes_them() {
    let outbox = Outbox::new().await;
    let config = outbox.config_file(&format!(
        "{DERIVE}{QUICK_RETRY}[poller]\ngrace = \"5s\"\ninterval = \"200ms\"\n"
    ));
    let mut relay = run(&config);
    outbox.wait_slot_active(true).await;
    let first = outbox.insert_many(2, 10, 2).await;
    all_derived(&outbox, &first, "the first rows are derived published").await;
    // The slot's position row held by another session: no pair can be
    // stored (the keeper's write waits for the lock), as when the position
    // table cannot be written for a while.
    let mut locker = outbox.db.client().await;
    let lock = locker.transaction().await.unwrap();
    lock.execute(
        "SELECT 1 FROM outbox_position WHERE slot_name = $1 FOR UPDATE",
        &[&outbox.slot],
    )
    .await
    .unwrap();
    let written = std::time::Instant::now();
    let held = outbox.insert_many(5, 10, 5).await;
    wait_until(Duration::from_secs(30), "the rows came out", || async {
        let out = delivered(&[&relay]);
        held.iter().all(|id| out.contains_key(id))
    })
    .await;
    let last_commit = outbox.commits().await.last().unwrap().end_lsn;
    wait_until(
        Duration::from_secs(30),
        "the slot confirmed past them",
        || async { outbox.confirmed_flush().await >= last_commit },
    )
    .await;
    // Past their grace (5 s) by about two seconds, fifteen poller rounds: the
    // stream has passed them and no pair vouches for them, but the keeper
    // gets a grace of its own from the first round that withheld them.
    tokio::time::sleep(Duration::from_secs(8).saturating_sub(written.elapsed())).await;
    let seen = states(&outbox).await;
    let out = delivered(&[&relay]);
    let taken: Vec<&String> = held
        .iter()
        .filter(|id| seen[*id].0 != "PENDING" || out[*id] > 1)
        .collect();
    assert!(
        taken.is_empty(),
        "rows the stream delivered were sent again or marked while the keeper could still vouch for them: {taken:?}\n{}",
        relay.stderr_text()
    );
    // Still no pair: after that grace the poller publishes them and marks
    // them (at least once), as it would rows nothing vouches for.
    all_marked(
        &outbox,
        &held,
        "the poller publishes and marks the rows nothing vouched for",
    )
    .await;
    let taken_at = written.elapsed();
    assert!(
        relay
            .stderr_text()
            .contains("none was stored for poller.grace"),
        "{}",
        relay.stderr_text()
    );
    lock.rollback().await.unwrap();
    let after = outbox.insert_many(1, 10, 2).await;
    all_derived(
        &outbox,
        &after,
        "pairs are stored again once the row is free",
    )
    .await;
    relay.stop_gracefully().await;
    eprintln!("the poller took the rows {taken_at:?} after they were written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_a_foreign_consumer_of_the_slot_swallows_are_published_by_the_poller_once() {
    let outbox = Outbox::new().await;
    let config = outbox.config_file(&format!(
        "{DERIVE}{QUICK_RETRY}[poller]\ngrace = \"2s\"\ninterval = \"200ms\"\n"
    ));
    let mut first = run(&config);
    outbox.wait_slot_active(true).await;
    let before = outbox.insert_many(2, 10, 2).await;
    all_derived(&outbox, &before, "the first rows are derived published").await;
    first.stop_gracefully().await;
    // An operator debugging with the relay's slot: pg_recvlogical holds it
    // and confirms what it reads; the relay stands by.
    let mut foreign = std::process::Command::new(harness::pg_bin().join("pg_recvlogical"))
        .args([
            "-d",
            outbox.db.url(),
            "-S",
            &outbox.slot,
            "--start",
            "-f",
            "/dev/null",
        ])
        .args([
            "-o",
            "proto_version=1",
            "-o",
            "publication_names=outbox_relay",
            "-F",
            "1",
            "-s",
            "1",
        ])
        .spawn()
        .expect("pg_recvlogical");
    outbox.wait_slot_active(true).await;
    let mut second = run(&config);
    let mut swallowed = outbox.insert_many(5, 10, 5).await;
    // A last transaction, whose commit the consumer confirms (at its end)
    // once it read it: past `end`, which lies past every commit before.
    let end = insert_lsn(&outbox.sql).await;
    swallowed.extend(outbox.insert_many(1, 1, 1).await);
    // No pair is stored meanwhile: after the rows' grace and one more, the
    // poller takes them.
    wait_until(
        Duration::from_secs(30),
        "the poller publishes what the foreign consumer swallowed",
        || async {
            let out = delivered(&[&second]);
            swallowed.iter().all(|id| out.contains_key(id))
        },
    )
    .await;
    assert!(
        second
            .stderr_text()
            .contains("none was stored for poller.grace"),
        "{}",
        second.stderr_text()
    );
    // Swallowed: the foreign consumer confirmed them (its feedback comes a
    // second apart); killed before, it would leave the slot behind them and
    // the stream would send them again.
    wait_until(
        Duration::from_secs(30),
        "the foreign consumer confirmed the rows it swallowed",
        || async { outbox.confirmed_flush().await >= end },
    )
    .await;
    let active_pid = |sql: &'static str| {
        let outbox = &outbox;
        async move {
            outbox
                .sql
                .query_one(sql, &[&outbox.slot])
                .await
                .unwrap()
                .get::<_, Option<i32>>(0)
        }
    };
    const ACTIVE: &str = "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1";
    let foreigns = active_pid(ACTIVE).await;
    foreign.kill().unwrap();
    let _ = foreign.wait();
    // The relay takes its slot back (a hole from its vouched snapshot: the
    // slot is ahead of its kept position); nothing comes twice. The rows
    // after are written once it streams: written while the slot is idle for
    // longer than `poller.grace` (a takeover slowed down), they would be
    // the poller's as well as the stream's, at least once, as documented.
    wait_until(
        Duration::from_secs(30),
        "the relay streams from its slot",
        || async {
            active_pid(ACTIVE)
                .await
                .is_some_and(|pid| Some(pid) != foreigns)
        },
    )
    .await;
    let after = outbox.insert_many(1, 10, 2).await;
    wait_until(Duration::from_secs(30), "the stream is back", || async {
        let out = delivered(&[&second]);
        after.iter().all(|id| out.contains_key(id))
    })
    .await;
    // Poller rounds past every row's grace.
    tokio::time::sleep(Duration::from_secs(4)).await;
    second.stop_gracefully().await;
    let out = delivered(&[&second]);
    let repeated: Vec<&String> = swallowed
        .iter()
        .chain(&after)
        .filter(|id| out[*id] > 1)
        .collect();
    assert!(repeated.is_empty(), "sent twice: {repeated:?}");
    let states = states(&outbox).await;
    let unpublished: Vec<&String> = swallowed
        .iter()
        .chain(&after)
        .filter(|id| states[*id].0 != "PUBLISHED")
        .collect();
    assert!(unpublished.is_empty(), "not published: {unpublished:?}");
}

/// The server's WAL insert position, in bytes.
async fn insert_lsn(sql: &tokio_postgres::Client) -> u64 {
    let lsn: i64 = sql
        .query_one("SELECT (pg_current_wal_insert_lsn() - '0/0')::int8", &[])
        .await
        .unwrap()
        .get(0);
    lsn as u64
}

/// What moving the insert position by the one-row transaction of
/// [`PAGE_ROW`] takes, in bytes, measured twice alike (another writer in
/// between shows as a difference).
async fn row_transaction_size(sql: &tokio_postgres::Client) -> u64 {
    let mut sizes = Vec::new();
    loop {
        let before = insert_lsn(sql).await;
        sql.batch_execute(PAGE_ROW).await.unwrap();
        // A page header in between shows as a difference too.
        sizes.push(insert_lsn(sql).await - before);
        if let [.., a, b] = sizes[..] {
            if a == b {
                return a;
            }
        }
        assert!(sizes.len() < 20, "no two alike: {sizes:?}");
    }
}

/// One row in its own transaction, its payload's size fixed: each such
/// transaction writes the same WAL (`full_page_writes` is off in the tests).
const PAGE_ROW: &str = "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
     VALUES ('order', 'page-1', 'Page', '{\"n\": 1}')";

/// When the WAL's last record ends exactly at a page's end,
/// `pg_current_wal_insert_lsn()` points past the next page's header, which
/// a walsender on an idle server never reaches: it reports the page
/// boundary. A pair taken then is stored with the boundary as its W, and
/// vouches for the rows delivered before it. (Before, its W was past the
/// header, and the pair waited for anything else to write WAL: on an idle
/// server, the background writer's next snapshot of running transactions,
/// up to 15 s; at a graceful stop, longer than the stop waits, so the last
/// pair was lost.)
///
/// The keeper's candidate follows its own write of the position, so that
/// write is what must end at the boundary: a row is placed (after a logical
/// message of the size that leaves the room) to end where the keeper's
/// write, as long as the one before, then ends at the page's end. The
/// cluster is the test's own; when the keeper's write came out another
/// size (a HOT update or not), or the background writer wrote in between,
/// the pair's W is elsewhere, and the placement is tried again with the
/// size seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pair_taken_when_the_wal_ends_at_a_page_boundary_is_stored_on_an_idle_server() {
    let (_cluster, outbox) = private().await;
    let (_sink, relay) = outbox
        .streaming(&format!("{DERIVE}[poller]\nenabled = false\n"))
        .await;
    let sql = &outbox.sql;
    let block: i64 = sql
        .query_one("SELECT current_setting('wal_block_size')::int8", &[])
        .await
        .unwrap()
        .get(0);
    let block = block as u64;
    let row_size = row_transaction_size(sql).await;
    // A logical message's record: its text and a fixed overhead, aligned to
    // 8 bytes. `overhead` is at most 7 above the true one, so a message of
    // `size - overhead` makes a record of exactly `size` (a multiple of 8).
    let overhead = loop {
        let before = insert_lsn(sql).await;
        sql.batch_execute("SELECT pg_logical_emit_message(false, 'pad', repeat('x', 1000))")
            .await
            .unwrap();
        let after = insert_lsn(sql).await;
        // Measured within one page (a page header in between is no part of
        // the record).
        if before / block == after / block {
            break after - before - 1000;
        }
    };
    let pad = |size: u64| {
        format!(
            "SELECT pg_logical_emit_message(false, 'pad', repeat('x', {}))",
            size - overhead
        )
    };
    let lsn_text = |lsn: u64| format!("{:X}/{:X}", lsn >> 32, lsn as u32);
    // What the keeper writes before it takes a candidate; learnt.
    let mut keeper_write = None;
    let mut tried = Vec::new();
    while tried.len() < 12 {
        let ids = outbox.all_ids().await.into_iter().collect::<Vec<_>>();
        all_derived(&outbox, &ids, "the rows so far are derived published").await;
        // The keeper stored its pair: nothing of the relay's writes now.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let now = insert_lsn(sql).await;
        let boundary = (now / block + 1) * block;
        let row_end = boundary - keeper_write.unwrap_or(0);
        if row_end < now + row_size + 400 {
            // Too close to the page's end for a pad of a known size: onto
            // the next page first.
            sql.batch_execute(&pad(boundary - now + 400)).await.unwrap();
            tried.push(format!(
                "at {now:X}, too close to the page's end at {boundary:X}"
            ));
            continue;
        }
        sql.batch_execute(&pad(row_end - row_size - now))
            .await
            .unwrap();
        sql.batch_execute(PAGE_ROW).await.unwrap();
        let after = insert_lsn(sql).await;
        let placed = if keeper_write.is_some() {
            row_end
        } else {
            // The row itself ends at the page's end: the header follows.
            after.max(row_end)
        };
        if after != placed || (keeper_write.is_none() && after - row_end > 40) {
            tried.push(format!("the row ended at {after:X}, not {row_end:X}"));
            continue;
        }
        // The keeper writes the position, then takes its candidate; the
        // pair is stored once the slot confirmed its W.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut stored = None;
        while std::time::Instant::now() < deadline {
            stored = position(&outbox)
                .await
                .and_then(|p| p.lsn)
                .filter(|w| *w != lsn_text(0));
            let newer = stored
                .as_deref()
                .and_then(|w| {
                    let (high, low) = w.split_once('/')?;
                    Some(
                        u64::from_str_radix(high, 16).ok()? << 32
                            | u64::from_str_radix(low, 16).ok()?,
                    )
                })
                .filter(|w| *w >= after);
            if let Some(w) = newer {
                if w == boundary && keeper_write.is_some() {
                    // It vouches for every row so far, the one placed too.
                    let ids = outbox.all_ids().await.into_iter().collect::<Vec<_>>();
                    let published = derived_published(&outbox).await;
                    let unvouched: Vec<&String> =
                        ids.iter().filter(|id| !published.contains(*id)).collect();
                    assert!(
                        unvouched.is_empty(),
                        "the pair stored at the boundary leaves rows unpublished: {unvouched:?}"
                    );
                    eprintln!(
                        "the keeper's write ended at the page boundary {}: the pair was stored \
                         with W = {} (placements: {})",
                        lsn_text(boundary),
                        lsn_text(w),
                        tried.len() + 1
                    );
                    relay.stop().await;
                    return;
                }
                // Past the boundary: the keeper's write came out another
                // size (or the placement was the first, to learn it).
                keeper_write = Some(w - after);
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tried.push(format!(
            "row ended at {after:X}, the page at {boundary:X}; stored W {stored:?}; {}",
            keeper_state(&outbox, &[]).await
        ));
    }
    panic!(
        "no pair was stored at the page boundary the keeper's write ended at:\n{}",
        tried.join("\n")
    );
}

/// An operator (or a managed service) that revoked `pg_control_init()`,
/// which sizes the WAL's page headers for the candidates' W: the relay reads
/// the layout once a session, says it cannot, and vouches as before (only a
/// W just past a page's header then waits for the next write to the WAL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_pg_control_init_leaves_the_derived_lifecycle_vouching() {
    let outbox = Outbox::new().await;
    outbox
        .sql
        .batch_execute("REVOKE EXECUTE ON FUNCTION pg_control_init() FROM PUBLIC")
        .await
        .unwrap();
    let as_relay = outbox.db.client().await;
    as_relay
        .batch_execute(&format!("SET ROLE \"{}\"", outbox.role))
        .await
        .unwrap();
    let refused = as_relay
        .query_one("SELECT max_data_alignment FROM pg_control_init()", &[])
        .await;
    assert!(refused.is_err(), "the relay's role cannot call it now");
    let (_sink, relay) = outbox
        .streaming(&format!("{DERIVE}[poller]\nenabled = false\n"))
        .await;
    let ids = outbox.insert_many(3, 10, 2).await;
    all_derived(&outbox, &ids, "the rows are derived published").await;
    let more = outbox.insert_many(2, 10, 2).await;
    all_derived(&outbox, &more, "later rows too").await;
    relay.stop().await;
}

/// A partitioned outbox with an `UNLOGGED` partition for 2019: its rows
/// are never streamed, the poller publishes them.
async fn with_an_unlogged_partition() -> Outbox {
    let outbox = Outbox::with_schema(Some(&crate::check::partitioned_table())).await;
    outbox
        .sql
        .batch_execute(
            "CREATE UNLOGGED TABLE outbox_2019 PARTITION OF outbox \
             FOR VALUES FROM ('2019-01-01') TO ('2020-01-01')",
        )
        .await
        .unwrap();
    outbox
}

/// SQL: a trigger that refuses (raises on) every update of the rows whose
/// `aggregate_id` starts with `evil`.
const FROZEN: &str = "CREATE FUNCTION frozen() RETURNS trigger LANGUAGE plpgsql AS \
       $$ BEGIN RAISE EXCEPTION 'row % is frozen', OLD.aggregate_id; END $$; \
     CREATE TRIGGER frozen BEFORE UPDATE ON outbox FOR EACH ROW \
       WHEN (OLD.aggregate_id LIKE 'evil%') EXECUTE FUNCTION frozen()";

/// Wait up to `within` until every row of `ids` reached `sink` and reads
/// PUBLISHED (derived or marked).
async fn wait_sent_and_published(
    outbox: &Outbox,
    sink: &Collect,
    ids: &[String],
    within: Duration,
    what: &str,
) {
    wait_until(within, what, || async {
        let got: HashSet<String> = sink.ids().into_iter().collect();
        let states = states(outbox).await;
        ids.iter()
            .all(|id| got.contains(id) && states[id].0 == "PUBLISHED")
    })
    .await;
}

/// Wait until the rows `good` reached the sink and read PUBLISHED, let the
/// poller run `linger` more, and check each was published once; what the
/// sink got and the rows' states then.
async fn published_once_beside_refused(
    outbox: &Outbox,
    sink: &Collect,
    good: &[String],
    linger: Duration,
) -> (Vec<String>, HashMap<String, (String, bool)>) {
    wait_sent_and_published(
        outbox,
        sink,
        good,
        Duration::from_secs(30),
        "the good rows reach the sink and read PUBLISHED",
    )
    .await;
    tokio::time::sleep(linger).await;
    let got = sink.ids();
    for id in good {
        assert_eq!(
            got.iter().filter(|g| *g == id).count(),
            1,
            "{id} published once: {got:?}"
        );
    }
    let states = states(outbox).await;
    (got, states)
}

/// A hostile schema: a trigger that refuses the relay's update of one row
/// (here, any update of it). The poller publishes that row and the others
/// of its round, but cannot mark it: the others are marked all the same,
/// once each, and the refused row is published once and passed over after,
/// with an error naming it, not published again every round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_the_table_refuses_to_mark_does_not_make_the_poller_publish_its_round_again() {
    // An unlogged partition: its rows are the poller's. One trigger raises
    // on the 'evil' rows, another suppresses the update of the 'mute' one
    // (returns NULL: no error, no row written).
    let outbox = with_an_unlogged_partition().await;
    outbox
        .sql
        .batch_execute(
            "CREATE FUNCTION mute() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$; \
             CREATE TRIGGER mute BEFORE UPDATE ON outbox FOR EACH ROW \
               WHEN (OLD.aggregate_id = 'mute') EXECUTE FUNCTION mute()",
        )
        .await
        .unwrap();
    outbox.sql.batch_execute(FROZEN).await.unwrap();
    // Rounds of two: the refused rows, oldest, would fill every round.
    let (sink, relay) = outbox
        .streaming(&format!(
            "{DERIVE}[poller]\ninterval = \"200ms\"\ngrace = \"1s\"\nbatch_size = 2\n"
        ))
        .await;
    let mut good = returned(
        outbox
            .sql
            .simple_query(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at) \
                 SELECT 'order', (ARRAY['evil-1', 'evil-2', 'mute', 'good-4', 'good-5', 'good-6', 'good-7'])[g], \
                        'E', '{}', timestamptz '2019-06-01' + g * interval '1 s' \
                   FROM generate_series(1, 7) g RETURNING id::text",
            )
            .await
            .unwrap(),
    );
    let refused: Vec<String> = good.drain(..3).collect();
    // Many poller rounds after.
    let (got, states) =
        published_once_beside_refused(&outbox, &sink, &good, Duration::from_secs(4)).await;
    relay.stop().await;
    for id in &refused {
        assert_eq!(
            got.iter().filter(|g| *g == id).count(),
            1,
            "{id} published once: {got:?}"
        );
        assert_eq!(
            states[id].0, "PENDING",
            "{id}: the refused row is not marked"
        );
    }
}

/// The same trigger under `on_published = "mark"`: the stream's marks of a
/// transaction's rows go in one statement, which the table refuses. They
/// are written again row by row: the other rows are marked (and not
/// published again by the poller), the refused one stays PENDING.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_the_table_refuses_to_mark_leaves_the_streams_other_marks_written() {
    let outbox = Outbox::new().await;
    outbox.sql.batch_execute(FROZEN).await.unwrap();
    let (sink, relay) = outbox
        .streaming("[lifecycle]\non_published = \"mark\"\n[poller]\ninterval = \"200ms\"\ngrace = \"1s\"\n")
        .await;
    let mut good = returned(
        outbox
            .sql
            .simple_query(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
                 SELECT 'order', CASE WHEN g = 3 THEN 'evil' ELSE 'good-' || g END, 'E', '{}' \
                   FROM generate_series(1, 6) g RETURNING id::text",
            )
            .await
            .unwrap(),
    );
    let evil = good.remove(2);
    // The poller's grace, and rounds after it.
    let (_, states) =
        published_once_beside_refused(&outbox, &sink, &good, Duration::from_secs(3)).await;
    relay.stop().await;
    assert_eq!(states[&evil].0, "PENDING", "the refused row is not marked");
}

/// An operator's bulk load "for speed": a partition set `UNLOGGED`, loaded
/// and set `LOGGED` again, in three statements and in one transaction. The
/// rows wrote no WAL and are never streamed, and the publication reads as
/// before; but `SET LOGGED` rewrote the partition, which the keeper's next
/// look sees: a hole opens over what committed since the vouched snapshot,
/// and the poller publishes the loaded rows, once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_written_while_a_partition_was_briefly_unlogged_are_published_by_the_poller() {
    let outbox = Outbox::with_schema(Some(&crate::check::partitioned_table())).await;
    outbox
        .sql
        .batch_execute(
            "CREATE TABLE outbox_2019 PARTITION OF outbox \
             FOR VALUES FROM ('2019-01-01') TO ('2020-01-01')",
        )
        .await
        .unwrap();
    let (sink, relay) = vouching_and_idle(&outbox).await;
    let load = |tag: &str| {
        format!(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at) \
             SELECT 'order', '{tag}-' || g, 'E', '{{}}', timestamptz '2019-06-01' + g * interval '1 s' \
               FROM generate_series(1, 3) g RETURNING id::text"
        )
    };
    outbox
        .sql
        .batch_execute("ALTER TABLE outbox_2019 SET UNLOGGED")
        .await
        .unwrap();
    let mut loaded = returned(outbox.sql.simple_query(&load("apart")).await.unwrap());
    outbox
        .sql
        .batch_execute("ALTER TABLE outbox_2019 SET LOGGED")
        .await
        .unwrap();
    loaded.extend(returned(
        outbox
            .sql
            .simple_query(&format!(
                "BEGIN; ALTER TABLE outbox_2019 SET UNLOGGED; {}; ALTER TABLE outbox_2019 SET LOGGED; COMMIT",
                load("together")
            ))
            .await
            .unwrap(),
    ));
    assert_eq!(loaded.len(), 6);
    let after = outbox.insert_many(2, 1, 1).await;
    published_once_by_the_poller(&outbox, &sink, &loaded, &after).await;
    relay.stop().await;
}

/// A relay streaming `outbox` with [`UNLOGGED_FOR_A_WHILE`], a pair stored
/// over its first rows, then idle (no candidate owed, none waiting).
async fn vouching_and_idle(outbox: &Outbox) -> (Collect, Running) {
    let (sink, relay) = outbox.streaming(UNLOGGED_FOR_A_WHILE).await;
    let first = outbox.insert_many(2, 2, 1).await;
    all_derived(outbox, &first, "the first rows are derived published").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    (sink, relay)
}

/// The poller's settings of the tests of a table briefly `UNLOGGED`.
const UNLOGGED_FOR_A_WHILE: &str = concat!(
    "[lifecycle]\non_published = \"derive\"\n",
    "[poller]\ninterval = \"200ms\"\ngrace = \"1s\"\n"
);

/// The ids a simple query's `RETURNING id::text` gave.
fn returned(messages: Vec<tokio_postgres::SimpleQueryMessage>) -> Vec<String> {
    messages
        .into_iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some(r.get(0)?.to_owned()),
            _ => None,
        })
        .collect()
}

/// Wait until the rows `loaded` (never streamed) and `after` (streamed)
/// reached the sink and read PUBLISHED; each of `loaded` was sent once (by
/// the poller) and is marked, never derived: were it derived published, the
/// poller would never send it.
async fn published_once_by_the_poller(
    outbox: &Outbox,
    sink: &Collect,
    loaded: &[String],
    after: &[String],
) {
    wait_sent_and_published(
        outbox,
        sink,
        &[loaded, after].concat(),
        Duration::from_secs(30),
        "every row loaded while the table was unlogged reaches the sink and reads PUBLISHED",
    )
    .await;
    let derived = derived_published(outbox).await;
    let got = sink.ids();
    for id in loaded {
        assert!(
            !derived.contains(id),
            "{id}: never streamed, not derived published"
        );
        assert_eq!(
            got.iter().filter(|g| *g == id).count(),
            1,
            "{id} reaches the sink once"
        );
    }
}

/// A row set back to `PENDING` by hand to send it again (the
/// documented way: the `<table>_requeue` trigger clears its id), in a
/// session with `session_replication_role = replica` (as data fixes and
/// bulk loads often run, to skip foreign-key triggers): the trigger, an
/// ordinary one, does not fire, the row keeps its id, reads `PUBLISHED`
/// and is never sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_requeued_under_the_replica_role_is_sent_again() {
    let outbox = Outbox::new().await;
    let (sink, relay) = outbox
        .streaming(&format!(
            "{DERIVE}[poller]\ninterval = \"200ms\"\ngrace = \"1s\"\n"
        ))
        .await;
    let ids = outbox.insert_many(2, 1, 1).await;
    all_derived(&outbox, &ids, "the rows are derived published").await;
    outbox
        .sql
        .execute(
            "UPDATE outbox SET publish_state = 'DEAD' WHERE id::text = ANY($1)",
            &[&ids],
        )
        .await
        .unwrap();
    outbox
        .sql
        .batch_execute(&format!(
            "UPDATE outbox SET publish_state = 'PENDING' WHERE id = '{}'",
            ids[0]
        ))
        .await
        .unwrap();
    outbox
        .sql
        .batch_execute(&format!(
            "SET session_replication_role = replica; \
             UPDATE outbox SET publish_state = 'PENDING' WHERE id = '{}'; \
             RESET session_replication_role",
            ids[1]
        ))
        .await
        .unwrap();
    let times = |id: &str| sink.ids().iter().filter(|g| *g == id).count();
    wait_until(
        Duration::from_secs(30),
        "the row requeued as usual is sent again",
        || async { times(&ids[0]) >= 2 },
    )
    .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while times(&ids[1]) < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the row requeued under the replica role was never sent again: it reads {:?}",
            states(&outbox).await[&ids[1]]
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    relay.stop().await;
    // `check` names a trigger that does not fire always, and the fix.
    let requeue = |warned: Vec<String>| {
        warned
            .into_iter()
            .filter(|w| w.contains("outbox_requeue"))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        requeue(crate::check::warnings(
            &crate::check::check(&outbox.config("")).await
        )),
        Vec::<String>::new()
    );
    for (how, said) in [
        ("DISABLE TRIGGER outbox_requeue", "disabled"),
        (
            "ENABLE TRIGGER outbox_requeue",
            "not under session_replication_role = replica",
        ),
    ] {
        outbox
            .sql
            .batch_execute(&format!("ALTER TABLE outbox {how}"))
            .await
            .unwrap();
        let warned = requeue(crate::check::warnings(
            &crate::check::check(&outbox.config("")).await,
        ));
        assert!(
            warned.len() == 1
                && warned[0].contains(&format!("outbox: {said}"))
                && warned[0].contains("ENABLE ALWAYS TRIGGER outbox_requeue"),
            "{how}: {warned:#?}"
        );
    }
}

/// The same round trip on a plain (not partitioned) outbox under a
/// publication `FOR TABLES IN SCHEMA` (15+), which PostgreSQL lets go
/// `UNLOGGED` (it refuses only a table a publication names).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_written_while_a_schema_published_outbox_was_briefly_unlogged_are_published_by_the_poller(
) {
    let outbox = Outbox::new().await;
    if harness::server_version_num(&outbox.sql).await < 150_000 {
        return;
    }
    outbox
        .sql
        .batch_execute(
            "DROP PUBLICATION outbox_relay; \
             CREATE PUBLICATION outbox_relay FOR TABLES IN SCHEMA public \
               WITH (publish = 'insert', publish_via_partition_root = true)",
        )
        .await
        .unwrap();
    let (sink, relay) = vouching_and_idle(&outbox).await;
    let loaded = returned(
        outbox
            .sql
            .simple_query(
                "BEGIN; ALTER TABLE outbox SET UNLOGGED; \
                 INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
                 SELECT 'order', 'l-' || g, 'E', '{}' FROM generate_series(1, 3) g RETURNING id::text; \
                 ALTER TABLE outbox SET LOGGED; COMMIT",
            )
            .await
            .expect("the outbox goes UNLOGGED and back"),
    );
    assert_eq!(loaded.len(), 3);
    let after = outbox.insert_many(2, 1, 1).await;
    published_once_by_the_poller(&outbox, &sink, &loaded, &after).await;
    relay.stop().await;
}
