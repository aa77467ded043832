//! The harness itself works: clusters, databases, replication, cleanup, restarts
//! and child processes.

use std::os::unix::process::ExitStatusExt as _;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use harness::{
    connect, pg_bin, shared_admin_url, wait_until, Cluster, RelayProcess, StopMode, TestDb,
};
use tokio_postgres::error::SqlState;
use tokio_postgres::{Config, NoTls};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_database_has_logical_wal_level() {
    let db = TestDb::new().await;
    assert!(
        db.name().starts_with("t_") && db.name().len() == 18,
        "{}",
        db.name()
    );

    let client = db.client().await;
    let wal_level: String = client
        .query_one("SHOW wal_level", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(wal_level, "logical");

    // The client came in over TCP (inet_server_addr is NULL on a unix socket)
    // with the password, into the test's own database.
    let row = client
        .query_one(
            "SELECT current_database()::text, inet_server_addr()::text",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), db.name());
    assert!(
        row.get::<_, Option<String>>(1).is_some(),
        "expected a TCP connection"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_is_refused() {
    let db = TestDb::new().await;
    let mut config: Config = db.url().parse().unwrap();
    config.password("not-the-password");
    let err = config
        .connect(NoTls)
        .await
        .err()
        .expect("login with a wrong password must fail");
    assert_eq!(err.code(), Some(&SqlState::INVALID_PASSWORD), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replication_connection_with_scram_is_accepted() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE outbox (id bigserial PRIMARY KEY, payload text NOT NULL);
             CREATE PUBLICATION relay_pub FOR TABLE outbox;",
        )
        .await
        .unwrap();
    client
        .execute(
            "SELECT pg_create_logical_replication_slot('relay_slot', 'pgoutput')",
            &[],
        )
        .await
        .unwrap();
    client
        .execute("INSERT INTO outbox (payload) VALUES ('hello-outbox')", &[])
        .await
        .unwrap();
    // The insert position: with synchronous_commit=off, pg_current_wal_lsn()
    // (the write position) can still be behind the commit.
    let end_lsn: String = client
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);

    // pgoutput decodes the insert: Begin, Relation, Insert, Commit. Decoding
    // only sees flushed WAL, and with synchronous_commit=off the commit is
    // flushed by the WAL writer a little later, hence the wait.
    let kinds = wait_until(
        Duration::from_secs(10),
        "the insert is decodable",
        || async {
            let rows = client
            .query(
                "SELECT data FROM pg_logical_slot_peek_binary_changes('relay_slot', NULL, NULL, \
                 'proto_version', '1', 'publication_names', 'relay_pub')",
                &[],
            )
            .await
            .unwrap();
            let kinds: Vec<u8> = rows.iter().map(|r| r.get::<_, Vec<u8>>(0)[0]).collect();
            (!kinds.is_empty()).then_some(kinds)
        },
    )
    .await;
    assert_eq!(kinds, b"BRIC", "pgoutput message kinds");

    // A replication-protocol connection over TCP with SCRAM.
    let replication_url = format!("{}?replication=database", db.url());
    let out = tokio::process::Command::new(pg_bin().join("psql"))
        .args([
            "-X",
            "-A",
            "-t",
            "-d",
            &replication_url,
            "-c",
            "IDENTIFY_SYSTEM",
        ])
        .output()
        .await
        .expect("run psql");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "psql IDENTIFY_SYSTEM: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.trim_end().ends_with(db.name()),
        "IDENTIFY_SYSTEM said {stdout:?}"
    );

    // And the slot streams over it: pg_recvlogical up to the insert's LSN.
    let dir = tempfile::tempdir().unwrap();
    let changes = dir.path().join("changes.bin");
    let recv = tokio::process::Command::new(pg_bin().join("pg_recvlogical"))
        .args([
            "-d",
            db.url(),
            "--slot",
            "relay_slot",
            "--start",
            "--no-loop",
        ])
        .args(["-o", "proto_version=1", "-o", "publication_names=relay_pub"])
        .args(["--endpos", &end_lsn, "-f"])
        .arg(&changes)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(30), recv)
        .await
        .expect("pg_recvlogical reached --endpos within 30 s")
        .expect("run pg_recvlogical");
    assert!(
        out.status.success(),
        "pg_recvlogical: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let streamed = std::fs::read(&changes).unwrap();
    let has = |needle: &[u8]| streamed.windows(needle.len()).any(|w| w == needle);
    assert!(
        has(b"outbox") && has(b"hello-outbox"),
        "streamed {} bytes without the insert",
        streamed.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_test_database_removes_its_slots() {
    let db = TestDb::new().await;
    let admin_url = shared_admin_url(); // keeps a per-process cluster alive after `db`
    let name = db.name().to_owned();
    let client = db.client().await;
    client
        .batch_execute("CREATE TABLE outbox (id bigint); CREATE PUBLICATION p FOR TABLE outbox;")
        .await
        .unwrap();
    for slot in [format!("{name}_idle"), format!("{name}_busy")] {
        client
            .execute(
                "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
                &[&slot],
            )
            .await
            .unwrap();
    }
    // Keep one slot active: a walsender streams it while the database is dropped.
    let busy = format!("{name}_busy");
    let mut streamer = RelayProcess::spawn_program(
        &pg_bin().join("pg_recvlogical"),
        &[
            "-d",
            db.url(),
            "--slot",
            &busy,
            "--start",
            "--no-loop",
            "-o",
            "proto_version=1",
            "-o",
            "publication_names=p",
            "-f",
            "-",
        ],
        &[],
    );
    let admin = connect(&admin_url).await;
    wait_until(
        Duration::from_secs(20),
        "the busy slot is active",
        || async {
            let row = admin
                .query_one(
                    "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1 AND active",
                    &[&busy],
                )
                .await
                .ok()?;
            (row.get::<_, i64>(0) == 1).then_some(())
        },
    )
    .await;

    drop(client);
    drop(db);

    let slots: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE $1 || '%'",
            &[&name],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(slots, 0, "slots of {name} left behind");
    let dbs: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_database WHERE datname = $1",
            &[&name],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(dbs, 0, "database {name} left behind");
    assert!(
        streamer
            .wait_exit_async(Duration::from_secs(10))
            .await
            .is_some(),
        "pg_recvlogical should end once its walsender is terminated"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_cluster_comes_back_after_fast_and_immediate_restarts() {
    let cluster = Arc::new(tokio::task::spawn_blocking(Cluster::start).await.unwrap());
    let port = cluster.port();
    let db = TestDb::on(&cluster).await;
    let client = db.client().await;
    client
        .batch_execute("CREATE TABLE t (v int); INSERT INTO t VALUES (1);")
        .await
        .unwrap();
    client
        .execute(
            "SELECT pg_create_logical_replication_slot('survivor', 'pgoutput')",
            &[],
        )
        .await
        .unwrap();

    let restart = |mode| {
        let cluster = Arc::clone(&cluster);
        tokio::task::spawn_blocking(move || cluster.restart(mode))
    };

    restart(StopMode::Fast).await.unwrap();
    assert!(
        client.query_one("SELECT 1", &[]).await.is_err(),
        "the old session must be gone"
    );
    assert_eq!(cluster.port(), port);
    let client = db.client().await;
    client
        .batch_execute("INSERT INTO t VALUES (2)")
        .await
        .unwrap();
    // A crash may lose commits not yet flushed (synchronous_commit=off):
    // CHECKPOINT, as its own statement, flushes the WAL.
    client.batch_execute("CHECKPOINT").await.unwrap();

    restart(StopMode::Immediate).await.unwrap();
    let (client, connection) =
        wait_until(Duration::from_secs(10), "a new session is accepted", || {
            tokio_postgres::connect(db.url(), NoTls)
        })
        .await;
    tokio::spawn(connection);
    let count: i64 = client
        .query_one("SELECT count(*) FROM t", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(count, 2);
    let slots: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'survivor'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(slots, 1, "the logical slot survives both restarts");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_process_is_read_while_running_then_signalled() {
    let script =
        "echo ready; echo oops >&2; trap 'echo bye; exit 3' TERM; while :; do sleep 0.05; done";
    let mut child =
        RelayProcess::spawn_program(Path::new("/bin/sh"), &["-c", script], &[("GREETING", "x")]);
    // The shell writes "oops" a moment after "ready": wait for both.
    wait_until(
        Duration::from_secs(5),
        "the child printed ready, and oops on stderr",
        || async { child.stdout_lines() == ["ready"] && child.stderr_text().contains("oops") },
    )
    .await;
    assert!(child.is_running());

    child.sigterm();
    let status = child
        .wait_exit_async(Duration::from_secs(5))
        .await
        .expect("exits on SIGTERM");
    assert_eq!(status.code(), Some(3));
    assert_eq!(child.stdout_lines(), ["ready", "bye"]);
    assert!(!child.is_running());

    let mut sleeper = RelayProcess::spawn_program(Path::new("/bin/sleep"), &["30"], &[]);
    sleeper.kill9();
    let status = sleeper
        .wait_exit(Duration::from_secs(5))
        .expect("exits on SIGKILL");
    assert_eq!(status.signal(), Some(libc::SIGKILL));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_built_relay_binary_is_found_and_runs() {
    let mut relay = RelayProcess::spawn(&["--help"], &[]);
    let status = relay
        .wait_exit_async(Duration::from_secs(30))
        .await
        .expect("--help exits");
    assert!(
        status.success(),
        "outbox-relay --help: {status}\n{}",
        relay.stderr_text()
    );
    assert!(
        relay.stdout_text().contains("Usage"),
        "{}",
        relay.stdout_text()
    );
}

/// A test that fails between PREPARE TRANSACTION and COMMIT PREPARED leaves
/// a prepared transaction: dropping its database rolls it back, so the
/// database goes and later slot creations in the cluster do not wait on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_test_database_rolls_back_its_prepared_transactions() {
    let db = TestDb::new().await;
    let admin_url = shared_admin_url(); // keeps a per-process cluster alive after `db`
    let name = db.name().to_owned();
    let gid = format!("{name}-left-behind");
    let client = db.client().await;
    client
        .batch_execute(&format!(
            "CREATE TABLE t (x int); BEGIN; INSERT INTO t VALUES (1); PREPARE TRANSACTION '{gid}';"
        ))
        .await
        .unwrap();
    drop(client);
    drop(db);
    let admin = connect(&admin_url).await;
    let left: i64 = admin
        .query_one(
            "SELECT (SELECT count(*) FROM pg_prepared_xacts WHERE gid = $1) \
             + (SELECT count(*) FROM pg_database WHERE datname = $2)",
            &[&gid, &name],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        left, 0,
        "the prepared transaction and the database are gone"
    );
}
