//! The `outbox-relay` binary as an operator runs it: killed, stopped,
//! restarted, misconfigured.

use std::collections::HashSet;
use std::time::Duration;

use harness::{wait_until, RelayProcess};

use crate::outbox::{envelope_ids, Outbox};

fn run(config: &std::path::Path) -> RelayProcess {
    RelayProcess::spawn(&["run", "--config", config.to_str().unwrap()], &[])
}

/// Insert `txs` transactions of 5 events in the background, one after another.
fn produce(outbox: &Outbox, txs: usize) -> tokio::task::JoinHandle<Vec<String>> {
    let url = outbox.db.url().to_owned();
    tokio::spawn(async move {
        let client = harness::connect(&url).await;
        let mut ids = Vec::new();
        for t in 0..txs {
            let rows = client
                .query(
                    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
                     SELECT 'order', 'agg-' || (g % 7), 'E', jsonb_build_object('t', $1::int, 'g', g) \
                     FROM generate_series(1, 5) g ORDER BY g RETURNING id::text",
                    &[&(t as i32)],
                )
                .await
                .expect("insert");
            ids.extend(rows.iter().map(|r| r.get::<_, String>(0)));
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        ids
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_9_then_restart_loses_nothing_and_repeats_only_unconfirmed_commits() {
    let outbox = Outbox::new().await;
    let config = outbox.config_file("");
    let mut first = run(&config);
    outbox.wait_slot_active(true).await;
    let producer = produce(&outbox, 400);
    // Kill at a random point while events flow.
    tokio::time::sleep(Duration::from_millis(300 + fastrand::u64(..1500))).await;
    first.kill9();
    outbox.wait_slot_active(false).await;
    let confirmed = outbox.confirmed_flush().await;
    let before_kill = envelope_ids(&first.stdout_lines());
    let expected = producer.await.unwrap();

    let mut second = run(&config);
    // Signalled only once streaming: a stop while starting is another test's.
    outbox.wait_slot_active(true).await;
    wait_until(
        Duration::from_secs(60),
        "every event has come out",
        || async {
            let seen: HashSet<String> = before_kill
                .iter()
                .cloned()
                .chain(envelope_ids(&second.stdout_lines()))
                .collect();
            expected.iter().all(|id| seen.contains(id))
        },
    )
    .await;
    second.stop_gracefully().await;
    let after = envelope_ids(&second.stdout_lines());

    let commits = outbox.commits().await;
    let confirmed_ids: HashSet<&String> = commits
        .iter()
        .filter(|c| c.end_lsn <= confirmed)
        .flat_map(|c| &c.ids)
        .collect();
    let repeated: Vec<&String> = after.iter().filter(|id| before_kill.contains(id)).collect();
    for id in &repeated {
        assert!(
            !confirmed_ids.contains(id),
            "{id} was in a commit confirmed before the kill (at {confirmed:X}) and came out again"
        );
    }
    let unique: HashSet<&String> = after.iter().collect();
    assert_eq!(
        unique.len(),
        after.len(),
        "the second run emits each event once"
    );
    eprintln!(
        "killed after {} events ({} confirmed); {} repeated after restart",
        before_kill.len(),
        confirmed_ids.len(),
        repeated.len()
    );
}

/// An orchestrator may stop a container right after starting it: the relay
/// takes a SIGTERM at any moment of its start as a graceful stop and exits 0,
/// never killed by the signal. Its configuration comes through a named pipe
/// that the test fills only after signalling, so the signal lands while the
/// relay is still reading its configuration, before any runtime exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigterm_while_starting_ends_the_relay_cleanly_not_by_the_signal() {
    use std::os::unix::process::ExitStatusExt;
    let outbox = Outbox::new().await;
    let config = outbox.config_file("");
    let text = std::fs::read_to_string(&config).unwrap();
    for (round, delay_us) in [0, 2_000, 20_000].into_iter().enumerate() {
        let fifo = config.with_extension(format!("fifo{round}"));
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success(), "mkfifo");
        let mut relay = run(&fifo);
        // From the moment the program's own code runs: before that the
        // dynamic loader relocates the binary (1-5 ms for the debug build on
        // a busy machine), and no program can catch a signal then.
        let running = catching_sigterm(relay.pid());
        std::thread::sleep(Duration::from_micros(delay_us));
        relay.sigterm();
        // From a thread: opening a FIFO blocks until the relay opens it,
        // forever if it died before.
        let writer = std::thread::spawn({
            let (fifo, text) = (fifo.clone(), text.clone());
            move || std::fs::write(fifo, text)
        });
        let status = relay.wait_exit_async(Duration::from_secs(30)).await;
        if !writer.is_finished() {
            // Unblock the writer: the relay never read its configuration.
            drop(std::fs::File::open(&fifo));
        }
        writer.join().unwrap().ok();
        let status = status.unwrap_or_else(|| {
            panic!(
                "the relay exits after a SIGTERM {delay_us} µs after start; stderr:\n{}",
                relay.stderr_text()
            )
        });
        assert_eq!(
            (status.code(), status.signal()),
            (Some(0), None),
            "SIGTERM {delay_us} µs after start: a clean exit, not death by signal; stderr:\n{}",
            relay.stderr_text()
        );
        eprintln!(
            "handlers in place {running:?} after the spawn; SIGTERM {delay_us} µs later: exit 0"
        );
    }
    // And once running, the same relay configuration delivers.
    let ids = outbox.insert_many(1, 2, 1).await;
    let mut relay = run(&config);
    wait_until(Duration::from_secs(30), "the events come out", || async {
        envelope_ids(&relay.stdout_lines()) == ids
    })
    .await;
    relay.stop_gracefully().await;
}

/// Wait until process `pid` catches SIGTERM (`SigCgt` in /proc); how long
/// after now that was.
fn catching_sigterm(pid: u32) -> Duration {
    let started = std::time::Instant::now();
    loop {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let caught = status
            .lines()
            .find_map(|l| l.strip_prefix("SigCgt:"))
            .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
            .unwrap_or(0);
        if caught & (1 << (libc::SIGTERM - 1)) != 0 {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the relay catches SIGTERM within 10 s of its start"
        );
        std::thread::yield_now();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigterm_then_restart_repeats_nothing() {
    let outbox = Outbox::new().await;
    let config = outbox.config_file("");
    let mut first = run(&config);
    outbox.wait_slot_active(true).await;
    let producer = produce(&outbox, 300);
    tokio::time::sleep(Duration::from_millis(300 + fastrand::u64(..1000))).await;
    first.sigterm();
    let status = first.wait_exit_async(Duration::from_secs(30)).await;
    assert!(
        status.is_some_and(|s| s.success()),
        "clean exit: {status:?}\n{}",
        first.stderr_text()
    );
    let before = envelope_ids(&first.stdout_lines());
    let expected = producer.await.unwrap();

    let mut second = run(&config);
    // Signalled only once streaming: a stop while starting is another test's.
    outbox.wait_slot_active(true).await;
    wait_until(
        Duration::from_secs(60),
        "every event has come out",
        || async { before.len() + envelope_ids(&second.stdout_lines()).len() >= expected.len() },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    second.sigterm();
    second.wait_exit_async(Duration::from_secs(30)).await;
    let after = envelope_ids(&second.stdout_lines());
    let mut all = before.clone();
    all.extend(after.iter().cloned());
    assert_eq!(
        all, expected,
        "each event exactly once, in commit order, across the restart"
    );
    assert!(
        !before.is_empty(),
        "the first run published something before the stop"
    );
    assert!(first.stderr_text().contains("final position acknowledged"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aws_settings_the_sns_client_cannot_use_stop_it_at_startup_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let not_pem = dir.path().join("not-a-ca.pem");
    std::fs::write(&not_pem, "hello").unwrap();
    let sns = |endpoint: &str| {
        format!(
            "[postgres]\nurl = \"postgres://u@h/db\"\n[sink]\nkind = \"sns\"\n[sns]\n\
             topic_arn = \"arn:aws:sns:eu-west-1:123456789012:orders\"\nendpoint_url = \"{endpoint}\"\n"
        )
    };
    let missing = dir.path().join("missing.pem");
    let cases = [
        (sns("localhost:4566"), vec![], "sns.endpoint_url"),
        (
            sns("https://sns.example"),
            vec![("AWS_CA_BUNDLE", missing.to_str().unwrap())],
            "AWS_CA_BUNDLE",
        ),
        (
            sns("https://sns.example"),
            vec![("AWS_CA_BUNDLE", not_pem.to_str().unwrap())],
            "AWS_CA_BUNDLE",
        ),
        (
            sns("https://sns.example"),
            vec![("HTTPS_PROXY", "https://proxy.example:443")],
            "HTTPS_PROXY",
        ),
    ];
    for (text, env, key) in cases {
        let path = dir.path().join("relay.toml");
        std::fs::write(&path, text).unwrap();
        let mut env = env;
        env.extend([
            ("AWS_ACCESS_KEY_ID", "test"),
            ("AWS_SECRET_ACCESS_KEY", "test"),
            ("AWS_EC2_METADATA_DISABLED", "true"),
        ]);
        refused_at_startup_naming(&path, &env, key).await;
    }
}

/// Runs the relay on the configuration file `path` with `env`; checks that
/// it stops at start-up (exit 2) naming `key`; its standard error.
pub(crate) async fn refused_at_startup_naming(
    path: &std::path::Path,
    env: &[(&str, &str)],
    key: &str,
) -> String {
    let mut relay = RelayProcess::spawn(&["run", "--config", path.to_str().unwrap()], env);
    let status = relay
        .wait_exit_async(Duration::from_secs(10))
        .await
        .expect("exits");
    let stderr = relay.stderr_text();
    assert_eq!(status.code(), Some(2), "{key}: {stderr}");
    assert!(stderr.contains(key), "{key} not named in: {stderr}");
    stderr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_configuration_fails_at_startup_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "[postgres]\nurl = \"postgres://u@h/db\"\nslto = \"x\"\n",
            "postgres.slto",
        ),
        ("[postgres]\nslot = \"s\"\n", "postgres.url"),
        (
            "[postgres]\nurl = \"postgres://u:pw@h:notaport/db\"\n",
            "postgres.url",
        ),
        (
            "[postgres]\nurl = \"postgres://u@h/db\"\n[stream]\nmax_in_flight = \"many\"\n",
            "stream.max_in_flight",
        ),
    ];
    for (text, key) in cases {
        let path = dir.path().join("relay.toml");
        std::fs::write(&path, text).unwrap();
        let stderr = refused_at_startup_naming(&path, &[], key).await;
        assert!(!stderr.contains("pw@"), "the password is echoed: {stderr}");
    }
    // An unknown key from the environment names the variable.
    let path = dir.path().join("relay.toml");
    std::fs::write(&path, "[postgres]\nurl = \"postgres://u@h/db\"\n").unwrap();
    let mut relay = RelayProcess::spawn(
        &["run", "--config", path.to_str().unwrap()],
        &[("OUTBOX_RELAY__POSTGRES__SLTO", "x")],
    );
    relay
        .wait_exit_async(Duration::from_secs(10))
        .await
        .expect("exits");
    assert!(relay.stderr_text().contains("OUTBOX_RELAY__POSTGRES__SLTO"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_applies_idempotently_and_check_names_what_is_missing() {
    let db = harness::TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("relay.toml");
    std::fs::write(
        &path,
        format!(
            "[postgres]\nurl = \"{}\"\nslot = \"{}\"\n",
            db.url(),
            db.name()
        ),
    )
    .unwrap();
    let cmd = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend(["--config", path.to_str().unwrap()]);
        RelayProcess::spawn(&all, &[])
    };
    let mut check = cmd(&["check"]);
    let status = check
        .wait_exit_async(Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(status.code(), Some(3));
    let report = check.stdout_text();
    for missing in ["slot", "publication", "table public.outbox does not exist"] {
        assert!(
            report.contains(missing),
            "{missing} not reported:\n{report}"
        );
    }
    assert!(
        report.contains("setup --config FILE --apply"),
        "no fix given:\n{report}"
    );

    for _ in 0..2 {
        let mut setup = cmd(&["setup", "--apply"]);
        let status = setup
            .wait_exit_async(Duration::from_secs(30))
            .await
            .unwrap();
        assert!(status.success(), "setup --apply: {}", setup.stderr_text());
    }
    let mut check = cmd(&["check"]);
    let status = check
        .wait_exit_async(Duration::from_secs(20))
        .await
        .unwrap();
    assert!(
        status.success(),
        "check after setup:\n{}",
        check.stdout_text()
    );

    // The printed SQL is what --apply ran.
    let mut print = cmd(&["setup"]);
    print
        .wait_exit_async(Duration::from_secs(10))
        .await
        .unwrap();
    let sql = print.stdout_text();
    assert!(sql.contains("CREATE PUBLICATION outbox_relay FOR TABLE public.outbox"));
    assert!(sql.contains(&format!(
        "pg_create_logical_replication_slot('{}', 'pgoutput')",
        db.name()
    )));

    // The least-privilege role may stream and touch the outbox table only.
    let client = db.client().await;
    let row = client
        .query_one(
            "SELECT rolreplication, rolsuper, has_table_privilege('outbox_relay', 'public.outbox', 'SELECT, UPDATE, DELETE'),
                    has_table_privilege('outbox_relay', 'public.outbox', 'INSERT')
             FROM pg_roles WHERE rolname = 'outbox_relay'",
            &[],
        )
        .await
        .unwrap();
    let (replication, superuser, manages, inserts): (bool, bool, bool, bool) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    assert!(replication && manages && !superuser && !inserts);
}
