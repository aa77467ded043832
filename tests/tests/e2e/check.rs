//! `check` and `run` judge a database alike (crate `readiness`): for each
//! state of the slot, publication and table, what `run` refuses at start-up
//! `check` reports as an error in the same words, and what `run` accepts
//! `check` does not call an error.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use harness::{server_version_num, wait_until, RelayProcess};
use outbox_relay::check::{Finding, Severity};
use outbox_relay::Config;
use outbox_relay::ErrorClass;

use crate::outbox::{Collect, Outbox, Running};

/// What `check` finds with `config`, connected as the relay connects.
pub(crate) async fn check(config: &Config) -> Vec<Finding> {
    let conn = outbox_relay::ConnInfo::new(&config.postgres).expect("connection settings");
    let client = conn.connect().await.expect("connect as the relay");
    outbox_relay::check::run(config, &client)
        .await
        .expect("check reads the database")
}

fn said(findings: &[Finding], severity: Severity) -> Vec<String> {
    findings
        .iter()
        .filter(|f| f.severity == severity)
        .map(|f| f.message.clone())
        .collect()
}

/// `check` and `run` both refuse `config`: `run` stops for good with a
/// message that `check` gives as one of its errors, word for word, and that
/// holds `fix`.
async fn both_refuse(what: &str, config: Config, fix: &str) {
    let errors = said(&check(&config).await, Severity::Error);
    let relay = Running::start(config, Collect::default());
    let error = tokio::time::timeout(Duration::from_secs(20), relay.task)
        .await
        .unwrap_or_else(|_| panic!("{what}: run stops by itself"))
        .expect("the relay task does not panic")
        .expect_err("run refuses");
    assert_eq!(error.class(), ErrorClass::Fatal, "{what}: {error}");
    let refusal = error.to_string();
    assert!(
        errors.contains(&refusal),
        "{what}: check does not say what run says.\nrun:   {refusal}\ncheck: {errors:#?}"
    );
    assert!(
        refusal.contains(fix),
        "{what}: no fix {fix:?} in: {refusal}"
    );
}

/// `check` reports no error for `config`, and `run` streams with it.
async fn both_accept(what: &str, outbox: &Outbox, config: Config) -> Vec<Finding> {
    let findings = check(&config).await;
    assert_eq!(
        said(&findings, Severity::Error),
        Vec::<String>::new(),
        "{what}: check calls an error what run accepts"
    );
    let relay = Running::start(config, Collect::default());
    outbox.wait_slot_active(true).await;
    relay.stop().await;
    // The walsender leaves a moment after the relay: a later relay must not
    // take it for its own.
    outbox.wait_slot_active(false).await;
    findings
}

/// The shipped partitioned table file, for `public.outbox`.
pub(crate) fn partitioned_table() -> String {
    let config = Config::from_parts(
        "[postgres]\nurl = \"postgres://u@h/db\"\n",
        Path::new("test.toml"),
        std::iter::empty(),
    )
    .expect("config");
    outbox_relay::setup::render(&config, "outbox_relay", true)
        .expect("render setup SQL")
        .into_iter()
        .find(|(file, _)| file.starts_with("001"))
        .expect("the table file")
        .1
}

/// The fix a refusal must name, for an outbox.
type Fix = fn(&Outbox) -> String;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_state_run_refuses_at_start_check_reports_as_an_error_in_the_same_words() {
    let pgoutput = |outbox: &Outbox| {
        format!(
            "pg_create_logical_replication_slot('{}', 'pgoutput')",
            outbox.slot
        )
    };
    let states: [(&str, &str, Fix); 5] = [
        (
            "no publication",
            "DROP PUBLICATION outbox_relay",
            |_| "CREATE PUBLICATION outbox_relay FOR TABLE public.outbox".into(),
        ),
        (
            "a row filter on the outbox table",
            "ALTER PUBLICATION outbox_relay SET TABLE outbox WHERE (aggregate_id <> 'x')",
            |_| "ALTER PUBLICATION outbox_relay SET TABLE public.outbox".into(),
        ),
        (
            "a column list without a required column",
            "ALTER PUBLICATION outbox_relay SET TABLE outbox (id, aggregate_type, aggregate_id, payload)",
            |_| "ALTER PUBLICATION outbox_relay SET TABLE public.outbox".into(),
        ),
        (
            "a slot of another plugin",
            "SELECT pg_drop_replication_slot('{slot}');
             SELECT pg_create_logical_replication_slot('{slot}', 'test_decoding');",
            pgoutput,
        ),
        (
            "nowhere to record rejected events",
            // The state view and the requeue trigger read publish_state: they go first.
            "DROP VIEW outbox_state; DROP TRIGGER outbox_requeue ON outbox; \
             ALTER TABLE outbox DROP COLUMN publish_state; \
             DROP TABLE outbox_dead_letter",
            |_| "outbox_dead_letter".into(),
        ),
    ];
    for (what, change, fix) in states {
        let outbox = Outbox::new().await;
        if what.starts_with("a row filter") || what.starts_with("a column list") {
            // Row filters and column lists came with PostgreSQL 15: on 14 a
            // publication cannot be in these states.
            if server_version_num(&outbox.sql).await < 150_000 {
                continue;
            }
        }
        outbox
            .sql
            .batch_execute(&change.replace("{slot}", &outbox.slot))
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let extra = if what.starts_with("nowhere") {
            "[lifecycle]\non_published = \"none\""
        } else {
            ""
        };
        both_refuse(what, outbox.config(extra), &fix(&outbox)).await;
    }
    // A two-phase slot is fine: check says how prepared transactions go.
    let outbox = Outbox::new().await;
    outbox.recreate_slot("false, true").await; // temporary = false, two_phase = true
    let findings = check(&outbox.config("")).await;
    assert!(said(&findings, Severity::Error).is_empty(), "{findings:#?}");
    let slot = said(&findings, Severity::Ok)
        .into_iter()
        .find(|f| f.contains("replication slot"))
        .unwrap_or_else(|| panic!("{findings:#?}"));
    assert!(
        slot.contains("two_phase") && slot.contains("COMMIT PREPARED"),
        "{slot}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_outbox_not_published_via_its_root_is_refused_by_run_and_check_alike() {
    let outbox = Outbox::with_schema(Some(&partitioned_table())).await;
    outbox
        .sql
        .batch_execute("ALTER PUBLICATION outbox_relay SET (publish_via_partition_root = false)")
        .await
        .unwrap();
    both_refuse(
        "a partitioned table not published via its root",
        outbox.config(""),
        "ALTER PUBLICATION outbox_relay SET (publish_via_partition_root = true)",
    )
    .await;
    // Published via its root, both accept it.
    outbox
        .sql
        .batch_execute("ALTER PUBLICATION outbox_relay SET (publish_via_partition_root = true)")
        .await
        .unwrap();
    both_accept("published via its root", &outbox, outbox.config("")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalidated_slot_is_refused_by_run_and_check_alike_naming_why() {
    // max_slot_wal_keep_size is per cluster: a private one.
    let cluster = Arc::new(
        tokio::task::spawn_blocking(harness::Cluster::start)
            .await
            .expect("start a cluster"),
    );
    let outbox = Outbox::on(&cluster).await;
    for setting in [
        "ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'",
        "SELECT pg_reload_conf()",
    ] {
        outbox.sql.batch_execute(setting).await.unwrap();
    }
    wait_until(
        Duration::from_secs(30),
        "the slot is invalidated",
        || async {
            // Fill a segment, move to the next, and let a checkpoint give up
            // the WAL the slot still holds.
            outbox.insert_tx(&[("a".into(), "E".into())]).await;
            outbox
                .sql
                .batch_execute("SELECT pg_switch_wal()")
                .await
                .unwrap();
            outbox.sql.batch_execute("CHECKPOINT").await.unwrap();
            let status: Option<String> = outbox
                .sql
                .query_one(
                    "SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1",
                    &[&outbox.slot],
                )
                .await
                .unwrap()
                .get(0);
            status.as_deref() == Some("lost")
        },
    )
    .await;
    both_refuse(
        "an invalidated slot",
        outbox.config(""),
        "lifecycle.recreate_slot = true",
    )
    .await;
    let errors = said(&check(&outbox.config("")).await, Severity::Error);
    // PostgreSQL 15 keeps no reason; 17 and later say wal_removed.
    assert!(
        errors.iter().any(|e| e.contains("wal_status = lost")
            && e.contains("the WAL it needed was removed")),
        "{errors:#?}"
    );
    // With lifecycle.recreate_slot, run recovers, and check only warns.
    let findings = both_accept(
        "an invalidated slot with lifecycle.recreate_slot",
        &outbox,
        outbox.config("[lifecycle]\nrecreate_slot = true"),
    )
    .await;
    assert!(
        said(&findings, Severity::Warning)
            .iter()
            .any(|w| w.contains("is invalidated")),
        "{findings:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_run_accepts_or_waits_out_check_does_not_call_an_error() {
    let outbox = Outbox::new().await;
    let findings = both_accept("as set up", &outbox, outbox.config("")).await;
    assert_eq!(said(&findings, Severity::Warning), Vec::<String>::new());
    assert!(
        findings.iter().all(|f| f.severity == Severity::Ok) && findings.len() == 5,
        "{findings:#?}"
    );

    // A slot in use: run stands by, check warns.
    let sink = Collect::default();
    let relay = Running::start(outbox.config(""), sink.clone());
    outbox.wait_slot_active(true).await;
    let findings = check(&outbox.config("")).await;
    assert_eq!(said(&findings, Severity::Error), Vec::<String>::new());
    assert!(
        said(&findings, Severity::Warning)
            .iter()
            .any(|w| w.contains("is in use by backend PID")),
        "{findings:#?}"
    );
    let standby = Running::start(outbox.config(""), Collect::default());
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!standby.task.is_finished(), "the second relay stands by");
    standby.stop().await;
    relay.stop().await;
    outbox.wait_slot_active(false).await;

    // A missing slot run may recreate: a warning.
    outbox.drop_slot().await;
    both_accept(
        "a missing slot with lifecycle.recreate_slot",
        &outbox,
        outbox.config("[lifecycle]\nrecreate_slot = true"),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_is_refused_by_run_and_check_alike() {
    let primary = Arc::new(
        tokio::task::spawn_blocking(harness::Cluster::start)
            .await
            .expect("start a cluster"),
    );
    let mut outbox = Outbox::on(&primary).await;
    let standby = {
        let primary = Arc::clone(&primary);
        tokio::task::spawn_blocking(move || harness::Cluster::standby_of(&primary, "standby1", ""))
            .await
            .unwrap()
    };
    outbox.reconnect().await;
    // The relay pointed at the standby alone.
    let text = outbox.config_toml("").replacen(
        &format!("127.0.0.1:{}", primary.port()),
        &format!("127.0.0.1:{}", standby.port()),
        1,
    );
    let config = Config::from_parts(&text, std::path::Path::new("test.toml"), std::iter::empty())
        .expect("config");
    both_refuse(
        "a standby",
        config,
        "target_session_attrs=read-write so the relay finds the primary",
    )
    .await;
}

/// `check`'s line for the lifecycle, or its warning that `derive` runs as
/// `mark`: the one that names the lifecycle.
fn lifecycle_line(findings: &[Finding]) -> &Finding {
    findings
        .iter()
        .find(|f| f.message.starts_with("lifecycle ") || f.message.contains("runs as \"mark\""))
        .unwrap_or_else(|| panic!("no lifecycle line: {findings:#?}"))
}

/// The warnings.
pub(crate) fn warnings(findings: &[Finding]) -> Vec<String> {
    said(findings, Severity::Warning)
}

/// `check`'s warnings after `change`; it finds no error.
async fn warned_after(outbox: &Outbox, change: String) -> Vec<String> {
    outbox
        .sql
        .batch_execute(&change)
        .await
        .unwrap_or_else(|e| panic!("{change}: {e}"));
    let findings = check(&outbox.config("")).await;
    assert_eq!(said(&findings, Severity::Error), Vec::<String>::new());
    warnings(&findings)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_says_which_lifecycle_is_in_force_and_why() {
    let outbox = Outbox::new().await;
    // As set up: derive.
    let findings = check(&outbox.config("")).await;
    let line = lifecycle_line(&findings);
    assert_eq!(line.severity, Severity::Ok);
    assert!(line.message.starts_with("lifecycle derive: "), "{line}");
    for (mode, says) in [
        ("mark", "lifecycle mark"),
        ("delete", "lifecycle delete"),
        ("none", "lifecycle none"),
    ] {
        let findings =
            check(&outbox.config(&format!("[lifecycle]\non_published = \"{mode}\""))).await;
        let line = lifecycle_line(&findings);
        assert!(
            line.severity == Severity::Ok && line.message.starts_with(says),
            "{mode}: {line}"
        );
    }

    // A table from before the derived lifecycle: derive runs as mark, and
    // check says what is missing and the command that adds it. run accepts it.
    crate::migration::old_shape(&outbox, crate::migration::OLD_TABLE).await;
    let findings = both_accept("a table from before", &outbox, outbox.config("")).await;
    let line = lifecycle_line(&findings);
    assert_eq!(line.severity, Severity::Warning, "{line}");
    for part in [
        "lifecycle.on_published = \"derive\" runs as \"mark\"",
        "table public.outbox has no column relay_txid",
        "table 'outbox_position' has no column snapshot, snapshot_lsn, snapshot_at, hole_from, hole_to",
        "`outbox-relay setup --config FILE --apply`",
    ] {
        assert!(line.message.contains(part), "{part:?} in {line}");
    }
    // run decides by the same finding: it warns in check's words and runs
    // as mark, updating the row it published.
    let config = outbox.config_file("");
    let mut relay = RelayProcess::spawn(&["run", "--config", config.to_str().unwrap()], &[]);
    outbox.wait_slot_active(true).await;
    let id = outbox.insert_tx(&[("a".into(), "E".into())]).await;
    wait_until(
        Duration::from_secs(30),
        "the row is delivered and marked PUBLISHED",
        || async {
            relay.stdout_text().contains(&id[0])
                && outbox
                    .sql
                    .query_one(
                        "SELECT publish_state = 'PUBLISHED' FROM outbox WHERE id = $1::text::uuid",
                        &[&id[0]],
                    )
                    .await
                    .unwrap()
                    .get::<_, bool>(0)
        },
    )
    .await;
    relay.stop_gracefully().await;
    outbox.wait_slot_active(false).await;
    let stderr = relay.stderr_text();
    assert!(
        stderr.contains(&line.message),
        "run does not warn in check's words: {}\n{stderr}",
        line.message
    );
    // Migrated: derive, and nothing to warn of.
    crate::migration::setup_apply(&outbox, &[]).await;
    let findings = check(&outbox.config("")).await;
    assert!(
        lifecycle_line(&findings)
            .message
            .starts_with("lifecycle derive: "),
        "{findings:#?}"
    );
    assert_eq!(warnings(&findings), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_warns_of_what_weakens_the_derived_lifecycle_and_names_the_fix() {
    let outbox = Outbox::new().await;
    let warned = |change: String| warned_after(&outbox, change);
    // The column without its default.
    let said = warned("ALTER TABLE outbox ALTER COLUMN relay_txid DROP DEFAULT".into()).await;
    assert!(
        said.len() == 1
            && said[0].contains("column relay_txid of table public.outbox has no default")
            && said[0].contains("SET DEFAULT pg_current_xact_id()"),
        "{said:#?}"
    );
    let said = warned("ALTER TABLE outbox ALTER COLUMN relay_txid SET DEFAULT '5'".into()).await;
    assert!(
        said.len() == 1 && said[0].contains("has the default '5'::xid8, not pg_current_xact_id()"),
        "{said:#?}"
    );
    // setup puts the default back.
    crate::migration::setup_apply(&outbox, &[]).await;
    assert_eq!(warned("SELECT 1".into()).await, Vec::<String>::new());

    // Its index missing.
    let said = warned("DROP INDEX outbox_txid_idx".into()).await;
    assert!(
        said.len() == 1
            && said[0].contains("has no valid index outbox_txid_idx")
            && said[0].contains("CREATE INDEX CONCURRENTLY"),
        "{said:#?}"
    );
    crate::migration::setup_apply(&outbox, &[]).await;
    assert_eq!(warned("SELECT 1".into()).await, Vec::<String>::new());

    // The application may set the column: a table-level grant, which a
    // column REVOKE does not narrow.
    let app = format!("app_{}", outbox.db.name().trim_start_matches("t_"));
    let said = warned(format!(
        "CREATE ROLE {app} LOGIN PASSWORD 'app'; GRANT SELECT, INSERT, UPDATE ON outbox TO {app}; \
         REVOKE INSERT (relay_txid), UPDATE (relay_txid) ON outbox FROM {app}"
    ))
    .await;
    assert!(
        said.len() == 1
            && said[0].contains(&format!(
                "role {app} may set relay_txid in table public.outbox"
            ))
            && said[0].contains("--producer-role"),
        "{said:#?}"
    );
    // The fix the warning names: column privileges.
    crate::migration::setup_apply(&outbox, &["--producer-role", &app]).await;
    assert_eq!(warned("SELECT 1".into()).await, Vec::<String>::new());
    let producer = harness::connect(&outbox.db.url().replacen(
        &format!("{}:{}@", harness::SUPERUSER, harness::PASSWORD),
        &format!("{app}:app@"),
        1,
    ))
    .await;
    let row = producer
        .query_one(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('order', 'a', 'E', '{}') RETURNING relay_txid IS NOT NULL",
            &[],
        )
        .await
        .expect("a producer naming its columns inserts");
    assert!(row.get::<_, bool>(0));
    for forged in [
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, relay_txid) \
         VALUES ('order', 'a', 'E', '{}', '1')",
        "UPDATE outbox SET relay_txid = '1'",
        "UPDATE outbox SET publish_state = 'PUBLISHED'",
        // Without a column list an INSERT targets the columns in table
        // order, as far as it gives values: up to the relay's, even DEFAULT
        // needs a privilege on them.
        "INSERT INTO outbox VALUES (DEFAULT, 'order', 'a', 'E', '{}', NULL, NULL, DEFAULT, \
         DEFAULT, DEFAULT, NULL, NULL, NULL, DEFAULT)",
    ] {
        let error = producer.batch_execute(forged).await.expect_err(forged);
        assert_eq!(
            error.code(),
            Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE),
            "{forged}: {error}"
        );
    }
    producer
        .batch_execute("UPDATE outbox SET topic = 't'")
        .await
        .expect("its own columns it may update");

    // The application may write the position row (as default privileges
    // that grant every new table to it do).
    let said = warned(format!("GRANT SELECT, UPDATE ON outbox_position TO {app}")).await;
    assert!(
        said.len() == 1
            && said[0].contains(&format!(
                "role {app} may write table public.outbox_position, whose row says what the relay delivered"
            ))
            && said[0].contains(&format!(
                "REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON public.outbox_position FROM {app}"
            )),
        "{said:#?}"
    );
    let said = warned(format!(
        "REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON outbox_position FROM {app}"
    ))
    .await;
    assert_eq!(said, Vec::<String>::new());

    // Another publication sending the column (column lists: 15+).
    if server_version_num(&outbox.sql).await >= 150_000 {
        let said = warned("CREATE PUBLICATION other FOR TABLE outbox".into()).await;
        assert!(
            said.len() == 1
                && said[0].contains(
                    "publication other publishes table public.outbox with its column relay_txid"
                )
                && said[0].contains("ALTER PUBLICATION name SET TABLE public.outbox (column, ...)"),
            "{said:#?}"
        );
        let said = warned(
            "ALTER PUBLICATION other SET TABLE outbox (id, aggregate_type, aggregate_id, event_type, payload)".into(),
        )
        .await;
        assert_eq!(said, Vec::<String>::new());
    }
}

/// Roles that bypass column privileges may set `relay_txid` whatever is
/// granted: check names each that may log in (a member of
/// `pg_write_all_data`, another superuser, a member of the owner's role),
/// and its ok line names the owner and the bootstrap superuser, which every
/// table has. The role checking is not named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_the_roles_that_bypass_column_privileges() {
    // Roles belong to the cluster: a private one, so that no other test's
    // check meets them.
    let cluster = Arc::new(
        tokio::task::spawn_blocking(harness::Cluster::start)
            .await
            .expect("start a cluster"),
    );
    let outbox = Outbox::on(&cluster).await;
    let warned = |change: &'static str| warned_after(&outbox, change.into());
    let lifecycle = |findings: Vec<Finding>| lifecycle_line(&findings).message.clone();
    let superuser = harness::SUPERUSER;
    let line = lifecycle(check(&outbox.config("")).await);
    assert!(
        line.starts_with("lifecycle derive: ")
            && line.contains(&format!(
                "the owner {superuser}, the bootstrap superuser, bypass column privileges and may \
                 set relay_txid: they must be trusted application code or not write the outbox"
            )),
        "{line}"
    );
    assert_eq!(warned("SELECT 1").await, Vec::<String>::new());

    // A member of pg_write_all_data: granted nothing on the table, it
    // forges an id all the same.
    let said = warned("CREATE ROLE etl LOGIN PASSWORD 'etl'; GRANT pg_write_all_data TO etl").await;
    assert!(
        said.len() == 1
            && said[0].contains(
                "role etl (member of pg_write_all_data) bypasses column privileges and may set \
                 relay_txid in table public.outbox whatever is granted: they must be trusted \
                 application code or not write the outbox"
            )
            && said[0].contains("REVOKE pg_write_all_data FROM name")
            && !said[0].contains("--producer-role"),
        "{said:#?}"
    );
    let etl = harness::connect(&outbox.db.url().replacen(
        &format!("{superuser}:{}@", harness::PASSWORD),
        "etl:etl@",
        1,
    ))
    .await;
    outbox.insert_tx(&[("a".into(), "E".into())]).await;
    let forged = etl
        .execute("UPDATE public.outbox SET relay_txid = '1'", &[])
        .await
        .expect("a member of pg_write_all_data writes the column");
    assert_eq!(forged, 1);

    // Another superuser, a member of the owner's role, and a role that may
    // SET ROLE to a superuser role that cannot log in: each named with why.
    let said = warned(
        "CREATE ROLE admin LOGIN SUPERUSER PASSWORD 'admin'; CREATE ROLE app_owner NOLOGIN; \
         ALTER TABLE outbox OWNER TO app_owner; CREATE ROLE app LOGIN; GRANT app_owner TO app; \
         CREATE ROLE su_group NOLOGIN SUPERUSER; CREATE ROLE ops LOGIN; GRANT su_group TO ops",
    )
    .await;
    assert!(
        said.len() == 1
            && said[0].contains(
                "roles admin (superuser), app (member of the owner app_owner), etl (member of \
                 pg_write_all_data), ops (may act as a superuser role) bypass column privileges"
            ),
        "{said:#?}"
    );
    // From 16 a membership may give neither the role's privileges nor SET
    // ROLE to it: such a member can write nothing, and is not named.
    if harness::server_version_num(&outbox.sql).await >= 160_000 {
        let unchanged = warned(
            "CREATE ROLE audit LOGIN; GRANT pg_write_all_data TO audit WITH INHERIT FALSE, SET FALSE",
        )
        .await;
        assert!(
            unchanged.len() == 1 && !unchanged[0].contains("audit"),
            "{unchanged:#?}"
        );
    }
    let line = lifecycle(check(&outbox.config("")).await);
    assert!(
        line.contains(&format!(
            "the owner app_owner and the bootstrap superuser {superuser} bypass column privileges"
        )),
        "{line}"
    );
    // Checked as admin, admin is not named: the others are.
    let as_admin = Config::from_parts(
        &outbox.config_toml("").replacen(
            &outbox.relay_url(),
            &outbox.db.url().replacen(
                &format!("{superuser}:{}@", harness::PASSWORD),
                "admin:admin@",
                1,
            ),
            1,
        ),
        Path::new("test.toml"),
        std::iter::empty(),
    )
    .expect("config");
    let said = warnings(&check(&as_admin).await);
    assert!(
        said.len() == 1
            && said[0].contains(
                "roles app (member of the owner app_owner), etl (member of pg_write_all_data), \
                 ops (may act as a superuser role) bypass column privileges"
            ),
        "{said:#?}"
    );
    // Taken back, nothing is named.
    assert_eq!(
        warned(
            "REVOKE pg_write_all_data FROM etl; ALTER ROLE admin NOSUPERUSER; REVOKE app_owner FROM app; \
             REVOKE su_group FROM ops"
        )
        .await,
        Vec::<String>::new()
    );
}

/// A role may set `relay_txid` through a partition of the outbox (a grant
/// on the partition, as `ALTER DEFAULT PRIVILEGES … GRANT INSERT ON TABLES`
/// gives every partition created later): an insert straight into a
/// partition is checked against the partition's privileges alone, and
/// streamed as the table's. `check` names the role and the partition, and
/// `setup --producer-role` takes the partition's grant away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_a_role_that_may_set_relay_txid_through_a_partition() {
    let outbox = Outbox::with_schema(Some(&partitioned_table())).await;
    let app = format!("app_{}", outbox.db.name().trim_start_matches("t_"));
    outbox
        .sql
        .batch_execute(&format!(
            "CREATE TABLE outbox_2019 PARTITION OF outbox FOR VALUES FROM ('2019-01-01') TO ('2020-01-01'); \
             CREATE ROLE {app} LOGIN PASSWORD 'app'; GRANT USAGE ON SCHEMA public TO {app}; \
             GRANT SELECT ON outbox TO {app}; \
             GRANT INSERT (id, aggregate_type, aggregate_id, event_type, payload, headers, topic, created_at) \
               ON outbox TO {app}"
        ))
        .await
        .unwrap();
    let before = warnings(&check(&outbox.config("")).await);
    assert!(
        !before.iter().any(|w| w.contains(&app)),
        "column privileges on the root only: {before:#?}"
    );
    outbox
        .sql
        .batch_execute(&format!("GRANT INSERT ON outbox_2019 TO {app}"))
        .await
        .unwrap();
    let producer = harness::connect(&outbox.db.url().replacen(
        &format!("{}:{}@", harness::SUPERUSER, harness::PASSWORD),
        &format!("{app}:app@"),
        1,
    ))
    .await;
    // A row of 2019 with a forged id, inserted into `into`.
    let forge = |into: &str| {
        format!(
            "INSERT INTO {into} (aggregate_type, aggregate_id, event_type, payload, relay_txid, created_at) \
             VALUES ('order', 'a', 'E', '{{}}', '1', '2019-06-01')"
        )
    };
    producer
        .batch_execute(&forge("outbox"))
        .await
        .expect_err("the root refuses the column");
    producer
        .batch_execute(&forge("outbox_2019"))
        .await
        .expect("the partition takes a forged relay_txid");
    let after = warnings(&check(&outbox.config("")).await);
    assert!(
        after
            .iter()
            .any(|w| w.contains(&app) && w.contains("relay_txid")),
        "{app} may set relay_txid through outbox_2019, and check does not say so: {after:#?}"
    );
    assert!(
        after
            .iter()
            .any(|w| w.contains(&format!("{app} (through outbox_2019)"))),
        "the partition is named: {after:#?}"
    );
    crate::migration::setup_apply(&outbox, &["--producer-role", &app]).await;
    producer
        .batch_execute(&forge("outbox_2019"))
        .await
        .expect_err("the partition's grant is taken away");
    producer
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at) \
             VALUES ('order', 'b', 'E', '{}', '2019-06-02')",
        )
        .await
        .expect("the producer inserts through the table");
    let fixed = warnings(&check(&outbox.config("")).await);
    assert!(
        !fixed.iter().any(|w| w.contains(&app)),
        "{app} no longer named: {fixed:#?}"
    );
}

/// The table's owner may set `relay_txid` through the table whatever is
/// granted (docs/producers.md): a grant it also holds on a partition another
/// role owns adds nothing, and is not reported as a way to forge ids.
#[tokio::test]
async fn check_does_not_name_the_tables_owner_for_its_grant_on_a_partition() {
    let outbox = Outbox::with_schema(Some(&partitioned_table())).await;
    let owner = format!("own_{}", outbox.db.name().trim_start_matches("t_"));
    let app = format!("app_{}", outbox.db.name().trim_start_matches("t_"));
    outbox
        .sql
        .batch_execute(&format!(
            "CREATE TABLE outbox_2019 PARTITION OF outbox FOR VALUES FROM ('2019-01-01') TO ('2020-01-01'); \
             CREATE ROLE {owner} LOGIN; CREATE ROLE {app} LOGIN; \
             ALTER TABLE ONLY outbox OWNER TO {owner}; \
             GRANT INSERT ON outbox_2019 TO {owner}, {app}"
        ))
        .await
        .unwrap();
    let found = warnings(&check(&outbox.config("")).await);
    assert!(
        found
            .iter()
            .any(|w| w.contains(&format!("{app} (through outbox_2019)"))),
        "the other grantee is named: {found:#?}"
    );
    assert!(
        !found.iter().any(|w| w.contains(&owner)),
        "the table's owner is not named: {found:#?}"
    );
}
