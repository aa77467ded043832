//! The webhook sink, run as users run it (the binary), against a receiver that
//! verifies every signature with the Standard Webhooks reference library
//! (`tests/data/webhook_receiver.py`), behind TLS.

use std::collections::HashSet;
use std::path::Path;
use std::process::Child;
use std::time::Duration;

use harness::{wait_until, HttpsFront, RelayProcess, TestPki};

use crate::conformance::receiver::SECRET;
use crate::outbox::Outbox;
use crate::sns::{assert_per_aggregate_order, insert};

/// The receiver: a Python process on a free port, its log and its control
/// directory.
struct Receiver {
    child: Child,
    dir: tempfile::TempDir,
    port: u16,
}

/// One request the receiver got.
#[derive(Debug)]
struct Request {
    id: String,
    valid: bool,
    status: u64,
    body: String,
}

impl Receiver {
    async fn start() -> Receiver {
        let (child, dir, port) = crate::conformance::receiver::launch().await;
        Receiver { child, dir, port }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Answer every request with `status` (`None`: as usual).
    fn answer(&self, status: Option<u16>) {
        let path = self.dir.path().join("status");
        match status {
            Some(s) => std::fs::write(path, s.to_string()).expect("write status"),
            None => {
                let _ = std::fs::remove_file(path);
            }
        }
    }

    fn requests(&self) -> Vec<Request> {
        let text =
            std::fs::read_to_string(self.dir.path().join("requests.jsonl")).unwrap_or_default();
        // The receiver appends a line a request, a long one in several
        // writes: the line being written may be read in part. Whole lines only.
        let whole = &text[..text.rfind('\n').map_or(0, |end| end + 1)];
        whole
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).expect("a request line");
                Request {
                    id: v["id"].as_str().unwrap_or_default().to_owned(),
                    valid: v["valid"].as_bool().unwrap_or(false),
                    status: v["status"].as_u64().unwrap_or(0),
                    body: v["body"].as_str().unwrap_or_default().to_owned(),
                }
            })
            .collect()
    }

    /// `(id, aggregate)` of each event delivered (answered 2xx), in arrival order.
    fn delivered(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for r in self.requests().iter().filter(|r| r.status < 300) {
            let v: serde_json::Value = serde_json::from_str(&r.body).expect("JSON");
            let events = match v {
                serde_json::Value::Array(events) => events,
                one => vec![one],
            };
            for e in events {
                out.push((
                    e["id"].as_str().unwrap().to_owned(),
                    e["subject"].as_str().unwrap().to_owned(),
                ));
            }
        }
        out
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn toml(url: &str, extra: &str) -> String {
    format!(
        "[sink]\nkind = \"webhook\"\n[webhook]\nurl = \"{url}\"\n{extra}\n[retry]\nmax = \"500ms\"\n"
    )
}

fn spawn(config: &Path, pki: Option<&TestPki>) -> RelayProcess {
    let ca = pki.map(|p| p.ca().display().to_string());
    let mut env = vec![("OUTBOX_RELAY__WEBHOOK__SECRET", SECRET)];
    if let Some(ca) = &ca {
        env.push(("AWS_CA_BUNDLE", ca.as_str()));
    }
    RelayProcess::spawn(&["run", "--config", config.to_str().unwrap()], &env)
}

async fn wait_delivered(receiver: &Receiver, n: usize) -> Vec<(String, String)> {
    wait_until(Duration::from_secs(120), "every event arrived", || async {
        let got = receiver.delivered();
        let distinct: HashSet<&String> = got.iter().map(|(id, _)| id).collect();
        (distinct.len() >= n).then_some(got)
    })
    .await
}

/// 2,000 events over 20 aggregates, one POST each over HTTPS: every one
/// arrives, verified by the reference library, each aggregate's in commit
/// order; then batched, the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_signed_events_of_twenty_aggregates_arrive_each_aggregate_in_commit_order() {
    let receiver = Receiver::start().await;
    let pki = TestPki::new();
    let front = HttpsFront::start(&receiver.url(), &pki).await;
    let outbox = Outbox::new().await;
    let config = outbox.config_file(&toml(&front.endpoint(), ""));
    let mut relay = spawn(&config, Some(&pki));
    outbox.wait_slot_active(true).await;
    let expected = insert(&outbox, 200, 10, 20).await;
    let got = wait_delivered(&receiver, expected.len()).await;
    assert_per_aggregate_order(&expected, &got);
    let requests = receiver.requests();
    assert!(requests.iter().all(|r| r.valid), "every signature verifies");
    let ids: HashSet<&str> = expected.iter().map(|(id, _)| id.as_str()).collect();
    assert!(
        requests.iter().all(|r| ids.contains(r.id.as_str())),
        "webhook-id is the outbox row id"
    );
    relay.stop_gracefully().await;

    // Batched: one request per batch, a JSON array, same rules.
    let before = receiver.requests().len();
    let config = outbox.config_file(&toml(&front.endpoint(), "batch = true"));
    let mut relay = spawn(&config, Some(&pki));
    outbox.wait_slot_active(true).await;
    let more = insert(&outbox, 100, 10, 20).await;
    let got = wait_delivered(&receiver, expected.len() + more.len()).await;
    assert_per_aggregate_order(&more, &got[expected.len()..]);
    let batched = &receiver.requests()[before..];
    assert!(batched.iter().all(|r| r.valid && r.body.starts_with('[')));
    assert!(
        batched.len() < more.len(),
        "{} requests for {} events",
        batched.len(),
        more.len()
    );
    relay.stop_gracefully().await;
}

/// The receiver answers 503: nothing is confirmed past the first event, the
/// relay retries; when it answers again, everything arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_holds_the_slot_until_the_receiver_answers_again() {
    held_while_the_receiver_answers(503).await;
}

/// While the receiver answers `status`, the relay retries: nothing is
/// recorded, nothing confirmed past the first undelivered commit; when it
/// answers 200 again every event arrives, each aggregate's in commit order,
/// every row ends PUBLISHED and the slot passes the last commit.
async fn held_while_the_receiver_answers(status: u16) {
    let receiver = Receiver::start().await;
    let outbox = Outbox::new().await;
    let config = outbox.config_file(&toml(&receiver.url(), ""));
    let mut relay = spawn(&config, None);
    outbox.wait_slot_active(true).await;
    receiver.answer(Some(status));
    let mut expected = insert(&outbox, 1, 4, 4).await;
    // The first transaction's commit ends before this.
    let first_end = outbox.current_lsn().await;
    expected.extend(insert(&outbox, 4, 4, 4).await);
    wait_until(Duration::from_secs(30), "the relay retries", || async {
        receiver
            .requests()
            .iter()
            .filter(|r| r.status == u64::from(status))
            .count()
            >= 8
    })
    .await;
    assert!(receiver.delivered().is_empty());
    let states = crate::sqs::publish_states(&outbox).await;
    assert!(
        states.keys().all(|s| s == "PENDING"),
        "nothing recorded: {states:?}"
    );
    let confirmed = outbox.confirmed_flush().await;
    assert!(
        confirmed < first_end,
        "the slot is not confirmed past undelivered events ({confirmed:X} ≥ {first_end:X})"
    );
    receiver.answer(None);
    let got = wait_delivered(&receiver, expected.len()).await;
    assert_per_aggregate_order(&expected, &got);
    crate::sqs::settled(&outbox, expected.len()).await;
    relay.stop_gracefully().await;
}

/// A 422 is permanent: the event is recorded FAILED with the answer, the
/// events after it (of its aggregate too) are delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_rejection_is_recorded_and_the_stream_moves_on() {
    rejected_and_recorded("poison", "422", false).await;
}

/// A hostile receiver's 422 whose body holds a NUL byte, which PostgreSQL
/// text cannot hold: the reason is recorded with the byte replaced, and the
/// stream moves on (it would otherwise fail to record the event for good,
/// and stop at it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejection_whose_answer_holds_a_nul_byte_is_recorded_and_the_stream_moves_on() {
    rejected_and_recorded("nulbyte", "refused\u{FFFD}by the receiver", false).await;
}

/// A rejected event whose row a trigger will not let the relay update (an
/// "outbox rows are immutable" guard): the rejection goes to the
/// dead-letter table, and the stream moves on (it would otherwise try to
/// record it, fail, and start again at it, for ever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejection_the_table_refuses_to_record_goes_to_the_dead_letter_table() {
    rejected_and_recorded("poison", "422", true).await;
}

/// A row whose payload holds `marker` is rejected by the receiver; it ends
/// FAILED with a `last_error` holding `said` (`frozen`: a trigger refuses
/// every update of it, and the reason is in `outbox_dead_letter`), and the
/// rows around it are delivered in order.
async fn rejected_and_recorded(marker: &str, said: &str, frozen: bool) {
    let receiver = Receiver::start().await;
    let outbox = Outbox::new().await;
    if frozen {
        outbox
            .sql
            .batch_execute(&format!(
                "CREATE FUNCTION frozen() RETURNS trigger LANGUAGE plpgsql AS \
                   $$ BEGIN RAISE EXCEPTION 'outbox rows are immutable'; END $$; \
                 CREATE TRIGGER frozen BEFORE UPDATE ON outbox FOR EACH ROW \
                   WHEN (OLD.payload ? '{marker}') EXECUTE FUNCTION frozen()"
            ))
            .await
            .unwrap();
    }
    let config = outbox.config_file(&toml(&receiver.url(), ""));
    let mut relay = spawn(&config, None);
    outbox.wait_slot_active(true).await;
    let before = insert(&outbox, 2, 5, 2).await;
    let poison: String = outbox
        .sql
        .query_one(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('order', 'agg-0', 'E', jsonb_build_object($1::text, true)) RETURNING id::text",
            &[&marker],
        )
        .await
        .unwrap()
        .get(0);
    let after = insert(&outbox, 2, 5, 2).await;
    let got = wait_delivered(&receiver, before.len() + after.len()).await;
    let expected: Vec<_> = before.iter().chain(&after).cloned().collect();
    assert_per_aggregate_order(&expected, &got);
    let (state, error): (String, String) = wait_until(
        Duration::from_secs(30),
        "the rejected row is recorded",
        || async {
            let sql = if frozen {
                "SELECT 'FAILED', reason FROM outbox_dead_letter WHERE event_id = $1"
            } else {
                "SELECT state, coalesce(last_error, '') FROM outbox_state WHERE id::text = $1"
            };
            let row = outbox.sql.query_opt(sql, &[&poison]).await.unwrap()?;
            let state: String = row.get(0);
            (state == "FAILED").then(|| (state, row.get::<_, String>(1)))
        },
    )
    .await;
    assert_eq!(state, "FAILED");
    assert!(error.contains(said), "{error}");
    relay.stop_gracefully().await;
}

/// The connections to the receiver freeze (no FIN, no RST, nothing moves):
/// each request in flight ends at `webhook.timeout` and goes again on a new
/// connection; every event arrives, each aggregate's in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_frozen_in_the_network_are_given_up_and_every_event_arrives() {
    let receiver = Receiver::start().await;
    let proxy = harness::FreezingProxy::start(&format!("127.0.0.1:{}", receiver.port));
    let outbox = Outbox::new().await;
    let url = format!("http://127.0.0.1:{}", proxy.port());
    let config = outbox.config_file(&toml(&url, "timeout = \"2s\""));
    let mut relay = spawn(&config, None);
    outbox.wait_slot_active(true).await;
    let mut expected = insert(&outbox, 5, 4, 4).await;
    wait_delivered(&receiver, expected.len()).await;
    let before = proxy.accepted();
    proxy.freeze();
    expected.extend(insert(&outbox, 10, 4, 4).await);
    let got = wait_delivered(&receiver, expected.len()).await;
    assert_per_aggregate_order(&expected, &got);
    assert!(
        proxy.accepted() > before,
        "new connections replaced the frozen ones"
    );
    relay.stop_gracefully().await;
}

/// A TCP listener that counts the connections made to it (and answers
/// none): where a request must never go.
struct Trap {
    port: u16,
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Trap {
    fn start() -> Trap {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().unwrap().port();
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = std::sync::Arc::clone(&accepted);
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                drop(stream);
            }
        });
        Trap { port, accepted }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Rows whose `topic` names a URL of another origin (an internal service,
/// the same host on another port, the allowed host hidden as user
/// information) are recorded FAILED saying why, and no connection is ever
/// made there; a row naming another path of the configured origin and the
/// events around them are delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_naming_a_url_of_another_origin_is_recorded_failed_and_nothing_is_sent_there() {
    let receiver = Receiver::start().await;
    let trap = Trap::start();
    let outbox = Outbox::new().await;
    let config = outbox.config_file(&toml(&format!("{}/in", receiver.url()), ""));
    let mut relay = spawn(&config, None);
    outbox.wait_slot_active(true).await;
    let mut expected = insert(&outbox, 2, 5, 2).await;
    let hostile = [
        format!("http://127.0.0.1:{}/admin/reset", trap.port),
        format!(
            "http://127.0.0.1:{}@127.0.0.1:{}/",
            receiver.port, trap.port
        ),
        format!("https://127.0.0.1:{}/in", receiver.port),
        format!("http://localhost:{}/in", trap.port),
    ];
    let mut refused = Vec::new();
    for (i, url) in hostile.iter().enumerate() {
        refused.push(
            crate::sqs::insert_routed(&outbox, &format!("agg-{}", i % 2), "Hostile", url).await,
        );
    }
    let elsewhere = format!("{}/other/path", receiver.url());
    let routed = crate::sqs::insert_routed(&outbox, "agg-1", "Routed", &elsewhere).await;
    expected.push((routed.clone(), "agg-1".to_owned()));
    expected.extend(insert(&outbox, 2, 5, 2).await);
    let got = wait_delivered(&receiver, expected.len()).await;
    assert_per_aggregate_order(&expected, &got);
    for (id, url) in refused.iter().zip(&hostile) {
        let (state, _, error) = crate::sqs::recorded(&outbox, id).await;
        assert_eq!(state, "FAILED", "{url}: {error}");
        assert!(
            error.contains("not a destination the configuration allows"),
            "{url}: {error}"
        );
    }
    let (state, _, _) = crate::sqs::recorded(&outbox, &routed).await;
    assert_eq!(state, "PUBLISHED");
    relay.stop_gracefully().await;
    assert_eq!(
        trap.accepted(),
        0,
        "no connection went where the configuration did not allow"
    );
}

/// The receiver answers 401 (its secret is being rotated) for a while: the
/// relay retries, records nothing FAILED and confirms nothing; when it
/// answers 200 again every event arrives, each aggregate's in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_refusing_access_while_its_secret_rotates_gets_every_event_in_order() {
    held_while_the_receiver_answers(401).await;
}

/// `check` prints the origins data may name: the configured URL's, then
/// those `webhook.allowed_origins` adds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_shows_the_origins_a_row_may_name() {
    let outbox = Outbox::new().await;
    let config = outbox.config_file(&toml(
        "https://hooks.example.com/in",
        "allowed_origins = [\"http://audit.example.com:8080\"]",
    ));
    let mut check = RelayProcess::spawn(
        &["check", "--config", config.to_str().unwrap()],
        &[("OUTBOX_RELAY__WEBHOOK__SECRET", SECRET)],
    );
    let status = check
        .wait_exit_async(Duration::from_secs(30))
        .await
        .unwrap();
    let report = check.stdout_text();
    assert!(status.success(), "{report}\n{}", check.stderr_text());
    assert!(
        report.contains(
            "routing: rows and templates may name only origin https://hooks.example.com:443, \
             origin http://audit.example.com:8080"
        ),
        "{report}"
    );
}
