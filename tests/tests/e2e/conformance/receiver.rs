//! The webhook receiver of the conformance suite (`tests/data/webhook_receiver.py`):
//! verifies each request with the Standard Webhooks reference library,
//! deduplicates by `webhook-id` as the specification tells receivers to, and
//! takes its faults from files in its control directory.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use harness::wait_until;
use serde_json::{json, Value};

/// The signing secret the relay and the receiver share.
pub(crate) const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// A Python receiver on a free port.
pub(crate) struct Receiver {
    child: Child,
    dir: tempfile::TempDir,
    port: u16,
}

/// One request as the receiver logged it.
#[derive(Debug, Clone)]
pub(crate) struct Request {
    /// HTTP status answered (or meant to be, for a lost answer).
    pub status: u64,
    /// Processed: valid, accepted and not a repeat of a `webhook-id` processed before.
    pub processed: bool,
    /// The fault applied (`lose`, `late`, `slow`, `status`, `refuse`, `quota`).
    pub fault: Option<String>,
    /// `(id, subject)` of each envelope in the body, in order.
    pub events: Vec<(String, String)>,
}

/// Start `tests/data/webhook_receiver.py` with [`SECRET`], logging to and
/// taking faults from a new directory: the process, the directory and the
/// port it listens on (once it does).
pub(crate) async fn launch() -> (Child, tempfile::TempDir, u16) {
    let dir = tempfile::tempdir().expect("temp dir");
    let port_file = dir.path().join("port");
    let child = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/data/webhook_receiver.py"
        ))
        .arg(SECRET)
        .arg(&port_file)
        .arg(dir.path().join("requests.jsonl"))
        .arg(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("python3 webhook_receiver.py");
    let port = wait_until(Duration::from_secs(30), "the receiver listens", || {
        let port_file = port_file.clone();
        async move {
            std::fs::read_to_string(&port_file)
                .ok()
                .and_then(|p| p.trim().parse::<u16>().ok())
        }
    })
    .await;
    (child, dir, port)
}

impl Receiver {
    pub(crate) async fn start() -> Receiver {
        let (child, dir, port) = launch().await;
        Receiver { child, dir, port }
    }

    pub(crate) fn url(&self) -> String {
        format!("http://127.0.0.1:{}/hook", self.port)
    }

    fn write(&self, name: &str, value: &Value) {
        let path = self.dir.path().join(name);
        let tmp = self.dir.path().join(format!("{name}.tmp"));
        std::fs::write(&tmp, value.to_string()).expect("write a control file");
        std::fs::rename(&tmp, &path).expect("rename a control file");
    }

    /// Faults for the next requests, one a request (appended to those waiting).
    pub(crate) fn script(&self, faults: &[Value]) {
        let mut all = self.read("script.json");
        all.extend(faults.iter().cloned());
        self.write("script.json", &Value::Array(all));
    }

    /// Scripted faults not applied yet.
    pub(crate) fn faults_pending(&self) -> usize {
        self.read("script.json").len()
    }

    fn read(&self, name: &str) -> Vec<Value> {
        std::fs::read_to_string(self.dir.path().join(name))
            .ok()
            .and_then(|t| serde_json::from_str::<Vec<Value>>(&t).ok())
            .unwrap_or_default()
    }

    /// Answer `status` to every request whose body holds `marker`.
    pub(crate) fn refuse_marked(&self, marker: &str, status: u16) {
        let mut all = self.read("refuse.json");
        all.push(json!({"marker": marker, "status": status}));
        self.write("refuse.json", &Value::Array(all));
    }

    /// At most `per_second` requests a second (a bucket of `burst`); `None` lifts it.
    pub(crate) fn set_quota(&self, quota: Option<(f64, f64)>) {
        match quota {
            Some((per_second, burst)) => self.write(
                "quota.json",
                &json!({"per_second": per_second, "burst": burst}),
            ),
            None => {
                let _ = std::fs::remove_file(self.dir.path().join("quota.json"));
            }
        }
    }

    /// Every request logged so far, in the order logged (processed requests
    /// in the order processed).
    pub(crate) fn requests(&self) -> Vec<Request> {
        let text =
            std::fs::read_to_string(self.dir.path().join("requests.jsonl")).unwrap_or_default();
        // Whole lines only: the last one may be being written.
        let whole = &text[..text.rfind('\n').map_or(0, |end| end + 1)];
        whole.lines().map(parse_request).collect()
    }

    pub(crate) fn log_dir(&self) -> &Path {
        self.dir.path()
    }
}

fn parse_request(line: &str) -> Request {
    let v: Value = serde_json::from_str(line).expect("a request line");
    let body: Value =
        serde_json::from_str(v["body"].as_str().unwrap_or("null")).unwrap_or(Value::Null);
    let envelopes = match body {
        Value::Array(events) => events,
        Value::Null => Vec::new(),
        one => vec![one],
    };
    Request {
        status: v["status"].as_u64().unwrap_or(0),
        processed: v["processed"].as_bool().unwrap_or(false),
        fault: v["fault"]["kind"].as_str().map(ToOwned::to_owned),
        events: envelopes
            .iter()
            .map(|e| {
                (
                    e["id"].as_str().unwrap_or("?").to_owned(),
                    e["subject"].as_str().unwrap_or("?").to_owned(),
                )
            })
            .collect(),
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
