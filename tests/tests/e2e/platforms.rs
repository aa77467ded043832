//! Managed services, simulated: `setup` and `check` tell the platform from
//! the roles each service creates in every cluster, and `setup --apply` runs
//! as that service's admin role. Each test that creates a platform's roles
//! does so in a private cluster (roles are cluster-wide: on the shared one
//! every other test's `setup` would take it for that platform).
//!
//! A simulation shows what vanilla PostgreSQL can: that the detection reads
//! the roles as a role without privileges, that the rendered SQL is valid and
//! idempotent, and which privileges it gives. It cannot show the services'
//! own patches (what `rds_replication` or a Cloud SQL admin may do); each
//! test says where it stands in for them.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use harness::{wait_until, Cluster, RelayProcess, StopMode, TestDb};

/// A private cluster.
async fn cluster() -> Arc<Cluster> {
    Arc::new(
        tokio::task::spawn_blocking(Cluster::start)
            .await
            .expect("start a cluster"),
    )
}

/// `ALTER SYSTEM SET wal_level = level` and a restart.
async fn set_wal_level(cluster: &Arc<Cluster>, level: &str) {
    let admin = harness::connect(&cluster.admin_url()).await;
    admin
        .batch_execute(&format!("ALTER SYSTEM SET wal_level = {level}"))
        .await
        .expect("ALTER SYSTEM");
    drop(admin);
    let cluster = Arc::clone(cluster);
    tokio::task::spawn_blocking(move || cluster.restart(StopMode::Fast))
        .await
        .expect("restart");
}

/// `url` with the user and password replaced.
fn as_user(url: &str, user: &str, password: &str) -> String {
    let superuser = format!("{}:{}@", harness::SUPERUSER, harness::PASSWORD);
    assert!(url.contains(&superuser), "{url}");
    url.replacen(&superuser, &format!("{user}:{password}@"), 1)
}

/// A config file connecting to `url`, slot `slot`.
fn config_file(dir: &Path, name: &str, url: &str, slot: &str) -> PathBuf {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(
        &path,
        format!("[postgres]\nurl = \"{url}\"\nslot = \"{slot}\"\n\n[http]\nlisten = \"\"\n"),
    )
    .expect("write config");
    path
}

/// Run the binary with `args` and `--config config` to its end: (exit code,
/// stdout, stderr).
async fn command(args: &[&str], config: &Path) -> (Option<i32>, String, String) {
    let mut all = args.to_vec();
    all.extend(["--config", config.to_str().unwrap()]);
    let mut process = RelayProcess::spawn(&all, &[]);
    let status = process
        .wait_exit_async(Duration::from_secs(60))
        .await
        .unwrap_or_else(|| panic!("{args:?} ends"));
    (status.code(), process.stdout_text(), process.stderr_text())
}

/// Run the relay as `config` says, insert one event as `writer`, and wait
/// until the relay writes it to stdout.
async fn relay_delivers_an_event(config: &Path, writer: &tokio_postgres::Client) {
    let mut relay = RelayProcess::spawn(&["run", "--config", config.to_str().unwrap()], &[]);
    let id: String = writer
        .query_one(
            "INSERT INTO public.outbox (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('order', 'o-1', 'OrderCreated', '{\"total\": 1}') RETURNING id::text",
            &[],
        )
        .await
        .expect("insert an event")
        .get(0);
    wait_until(
        Duration::from_secs(30),
        "the relay delivers the event",
        || {
            let delivered = relay.stdout_lines().iter().any(|line| line.contains(&id));
            async move { delivered }
        },
    )
    .await;
    relay.stop_gracefully().await;
}

/// Amazon RDS (and Aurora, which has the same roles): a private cluster
/// with RDS's roles `rds_superuser` and `rds_replication`, and an admin role
/// shaped like RDS's master user (LOGIN, CREATEROLE, CREATEDB, member of
/// `rds_superuser`, no superuser) that owns the database.
///
/// Shown: `check`, run as that admin, tells RDS from the roles and names
/// `rds.logical_replication` when `wal_level` is not logical; `setup
/// --apply` as that admin tells RDS, renders sql/004_role_rds.sql, and it
/// applies without a superuser, twice (after a first run stopped at the slot,
/// which needs the master user's `rds_replication`, with a hint saying so): the relay's role can log in, is a
/// member of `rds_replication`, and has no REPLICATION attribute (which RDS
/// refuses to give).
///
/// Not shown, and stood in for: on RDS, membership in `rds_replication` is
/// what lets a role create slots and stream (RDS's own patch); on vanilla
/// PostgreSQL it grants nothing. So the superuser gives the admin
/// REPLICATION before `setup` creates the slot, and the relay's role
/// REPLICATION before it streams, standing in for their `rds_replication`.
/// That the relay then delivers an event shows that the rest of what setup
/// granted (schema, table, dead-letter and position tables) is enough.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_as_an_rds_master_user_grants_rds_replication_and_check_names_rds_logical_replication(
) {
    let cluster = cluster().await;
    let superuser = harness::connect(&cluster.admin_url()).await;
    // From PostgreSQL 16 a CREATEROLE role grants only the roles it holds
    // with ADMIN OPTION; RDS's master user may grant rds_replication, so the
    // stand-in holds it so.
    superuser
        .batch_execute(
            "CREATE ROLE rds_superuser NOLOGIN; \
             CREATE ROLE rds_replication NOLOGIN; \
             CREATE ROLE rds_master LOGIN CREATEROLE CREATEDB PASSWORD 'master-secret' \
                 IN ROLE rds_superuser; \
             GRANT rds_replication TO rds_master WITH ADMIN OPTION",
        )
        .await
        .expect("RDS's roles");
    let db = TestDb::on(&cluster).await;
    superuser
        .batch_execute(&format!(
            "ALTER DATABASE {} OWNER TO rds_master",
            harness::quote_ident(db.name())
        ))
        .await
        .expect("the master user owns the database");
    let dir = tempfile::tempdir().unwrap();
    let master_url = as_user(db.url(), "rds_master", "master-secret");
    let master = config_file(dir.path(), "master", &master_url, db.name());

    // wal_level below logical: check names RDS's parameter, not ALTER SYSTEM.
    set_wal_level(&cluster, "replica").await;
    let (code, report, _) = command(&["check"], &master).await;
    assert_eq!(code, Some(3), "{report}");
    let wal_level = report
        .lines()
        .find(|l| l.contains("wal_level = replica"))
        .unwrap_or_else(|| panic!("no wal_level finding:\n{report}"));
    assert!(
        wal_level.starts_with("error")
            && wal_level.contains("on Amazon RDS for PostgreSQL")
            && wal_level.contains("rds.logical_replication = 1")
            && wal_level.contains("reboot")
            && !wal_level.contains("ALTER SYSTEM"),
        "{wal_level}"
    );
    set_wal_level(&cluster, "logical").await;
    let superuser = harness::connect(&cluster.admin_url()).await;

    // Without rds_replication (here: REPLICATION) the slot is refused, and
    // setup says what the master user needs.
    let (code, _, stderr) = command(&["setup", "--apply", "--role", "relay_rds"], &master).await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("error: 003_slot.sql failed")
            && stderr.contains("hint: creating a slot needs rds_replication")
            && stderr.contains("GRANT rds_replication TO CURRENT_USER"),
        "{stderr}"
    );

    // Stands in for the master user's rds_replication: slots need it.
    superuser
        .batch_execute("ALTER ROLE rds_master REPLICATION")
        .await
        .unwrap();
    for round in ["first", "again"] {
        let (code, _, stderr) =
            command(&["setup", "--apply", "--role", "relay_rds"], &master).await;
        assert_eq!(code, Some(0), "setup --apply ({round}): {stderr}");
        assert!(
            stderr.contains(
                "setup for Amazon RDS for PostgreSQL (detected: role rds_superuser, role rds_replication)"
            ) && stderr.contains("004_role_rds.sql"),
            "{stderr}"
        );
    }
    let client = db.client().await;
    let row = client
        .query_one(
            "SELECT r.rolcanlogin, r.rolreplication, r.rolsuper, \
                    pg_has_role('relay_rds', 'rds_replication', 'MEMBER'), \
                    has_table_privilege('relay_rds', 'public.outbox', 'SELECT, UPDATE, DELETE'), \
                    (SELECT tableowner FROM pg_tables WHERE schemaname = 'public' AND tablename = 'outbox') \
             FROM pg_roles r WHERE r.rolname = 'relay_rds'",
            &[],
        )
        .await
        .expect("the relay's role exists");
    let (login, replication, superuser_attr, member, manages, owner): (
        bool,
        bool,
        bool,
        bool,
        bool,
        String,
    ) = (
        row.get(0),
        row.get(1),
        row.get(2),
        row.get(3),
        row.get(4),
        row.get(5),
    );
    assert!(login && member && manages && !replication && !superuser_attr);
    assert_eq!(owner, "rds_master", "setup ran as the master user");

    // Stands in for RDS letting members of rds_replication stream.
    superuser
        .batch_execute("ALTER ROLE relay_rds REPLICATION PASSWORD 'relay-secret'")
        .await
        .unwrap();
    let relay = config_file(
        dir.path(),
        "relay",
        &as_user(db.url(), "relay_rds", "relay-secret"),
        db.name(),
    );
    let (code, report, _) = command(&["check"], &relay).await;
    assert_eq!(code, Some(0), "check as the relay's role:\n{report}");
    relay_delivers_an_event(&relay, &db.client().await).await;
}

/// Cloud SQL, Azure flexible server, Supabase and Neon: `setup --apply`
/// tells each from its admin role (`cloudsqlsuperuser`, `azure_pg_admin`,
/// `supabase_admin`, `neon_superuser`), created in turn in a private
/// cluster, and applies sql/004_role_alter.sql: the relay's role is created
/// with LOGIN and given REPLICATION by ALTER ROLE, and streams as it is.
///
/// Not shown: these services let their admin role (no superuser) give
/// REPLICATION; vanilla PostgreSQL 15 lets only a superuser do it (16 and
/// later: a role with CREATEROLE that has REPLICATION itself). So setup
/// runs as the superuser here, and this shows the detection, that the SQL
/// is valid and idempotent, and that the role it makes can stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_tells_cloud_sql_azure_supabase_and_neon_from_their_admin_roles_and_gives_replication_by_alter_role(
) {
    let cluster = cluster().await;
    let superuser = harness::connect(&cluster.admin_url()).await;
    let db = TestDb::on(&cluster).await;
    let dir = tempfile::tempdir().unwrap();
    let admin = config_file(dir.path(), "admin", db.url(), db.name());
    let platforms = [
        ("cloudsqlsuperuser", "Google Cloud SQL for PostgreSQL"),
        (
            "azure_pg_admin",
            "Azure Database for PostgreSQL flexible server",
        ),
        ("supabase_admin", "Supabase"),
        ("neon_superuser", "Neon"),
    ];
    for (marker, name) in platforms {
        superuser
            .batch_execute(&format!("CREATE ROLE {marker} NOLOGIN"))
            .await
            .unwrap();
        let role = format!("relay_{marker}");
        for round in ["first", "again"] {
            let (code, _, stderr) = command(&["setup", "--apply", "--role", &role], &admin).await;
            assert_eq!(code, Some(0), "{name} ({round}): {stderr}");
            assert!(
                stderr.contains(&format!("setup for {name} (detected: role {marker}"))
                    && stderr.contains("004_role_alter.sql"),
                "{name}: {stderr}"
            );
        }
        let row = superuser
            .query_one(
                "SELECT rolcanlogin, rolreplication, rolsuper FROM pg_roles WHERE rolname = $1",
                &[&role],
            )
            .await
            .unwrap_or_else(|e| panic!("{name}: no role {role}: {e}"));
        let (login, replication, superuser_attr): (bool, bool, bool) =
            (row.get(0), row.get(1), row.get(2));
        assert!(login && replication && !superuser_attr, "{name}");
        superuser
            .batch_execute(&format!("DROP ROLE {marker}"))
            .await
            .unwrap();
    }
    superuser
        .batch_execute("ALTER ROLE relay_neon_superuser PASSWORD 'relay-secret'")
        .await
        .unwrap();
    let relay = config_file(
        dir.path(),
        "relay",
        &as_user(db.url(), "relay_neon_superuser", "relay-secret"),
        db.name(),
    );
    relay_delivers_an_event(&relay, &db.client().await).await;
}

/// `setup` without `--apply` connects to nothing unless asked to tell the
/// platform: by default it prints for self-managed PostgreSQL and says so,
/// with `--platform` for the given platform's role file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_prints_for_the_platform_it_is_given_and_says_which_without_a_server() {
    let dir = tempfile::tempdir().unwrap();
    // Nothing listens there.
    let config = config_file(
        dir.path(),
        "nowhere",
        "postgres://u:p@127.0.0.1:1/app",
        "outbox_relay",
    );
    let (code, sql, stderr) = command(&["setup"], &config).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        sql.starts_with("-- outbox-relay setup for self-managed PostgreSQL (the default;")
            && sql.contains("--platform auto")
            && sql.contains("-- ==== 004_role.sql")
            && sql.contains("CREATE ROLE outbox_relay WITH LOGIN REPLICATION;"),
        "{sql}"
    );
    let (code, sql, stderr) = command(&["setup", "--platform", "aurora"], &config).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        sql.starts_with("-- outbox-relay setup for Amazon Aurora PostgreSQL (--platform)")
            && sql.contains("-- ==== 004_role_rds.sql")
            && sql.contains("GRANT rds_replication TO outbox_relay;")
            && !sql.contains("LOGIN REPLICATION"),
        "{sql}"
    );
    let (code, sql, _) = command(&["setup", "--platform", "cloud-sql"], &config).await;
    assert_eq!(code, Some(0));
    assert!(
        sql.contains("-- ==== 004_role_alter.sql")
            && sql.contains("ALTER ROLE outbox_relay WITH REPLICATION;"),
        "{sql}"
    );
    let (code, _, stderr) = command(&["setup", "--platform", "heroku"], &config).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("unknown platform \"heroku\"") && stderr.contains("cloud-sql"),
        "{stderr}"
    );
}
