//! A local AWS endpoint for SNS and SQS ([moto](https://github.com/getmoto/moto)
//! in server mode), AWS SDK clients for it, topics subscribed by a queue, and a
//! receive helper that unwraps SNS notifications.
//!
//! ```no_run
//! use std::time::Duration;
//! use harness::{moto_endpoint, receive_all, sns_client, sqs_client, topic_with_queue};
//!
//! # async fn example() {
//! let moto = moto_endpoint().await; // keep it alive while it is used
//! let topic = topic_with_queue(&moto, "t_0123456789abcdef", true, false).await;
//! let sns = sns_client(&moto).await;
//! sns.publish()
//!     .topic_arn(&topic.arn)
//!     .message("hello")
//!     .message_group_id("order-1")
//!     .message_deduplication_id("event-1")
//!     .send()
//!     .await
//!     .unwrap();
//! let got = receive_all(&sqs_client(&moto).await, &topic.queue_url, 1, Duration::from_secs(10)).await;
//! assert_eq!(got[0].body, "hello");
//! assert_eq!(got[0].group_id.as_deref(), Some("order-1"));
//! # }
//! ```
//!
//! # What moto 5.2 does (checked against moto 5.2.1)
//!
//! Matches AWS:
//! - FIFO topic → FIFO queue: the SQS message carries the published
//!   `MessageGroupId` and `MessageDeduplicationId` as system attributes
//!   (raw and non-raw delivery), and a `SequenceNumber`.
//! - Order within a message group is publish order; a receive returns several
//!   messages of one group in order, and while a group has a message in flight
//!   (received, not deleted) no further message of that group is handed out.
//!   [`receive_all`] therefore deletes each batch right after receiving it.
//! - `Publish` on a FIFO topic without `MessageGroupId` fails with
//!   `MissingParameter`; without `MessageDeduplicationId` (and
//!   `ContentBasedDeduplication=false`) with `InvalidParameter`.
//! - `PublishBatch` takes `MessageGroupId`/`MessageDeduplicationId` per entry;
//!   more than 10 entries fail the call with `TooManyEntriesInBatchRequest`,
//!   duplicate entry ids with `BatchEntryIdsNotDistinct`; an entry whose message
//!   is over 256 KiB is reported in `Failed` (code `InvalidParameter`,
//!   sender fault) while the other entries succeed.
//! - Publishing to a topic ARN that does not exist fails with code `NotFound`.
//!
//! Gaps (do not rely on these in tests; `e2e/sns_fixture.rs` pins some down):
//! - **Deduplication happens only at an SQS FIFO queue**: the topic itself does
//!   not deduplicate (a second publish with the same deduplication id gets a
//!   new `MessageId` and is accepted); the subscribed FIFO queue drops it.
//! - **`SequenceNumber` is random** (20 random digits per message, not
//!   increasing): check order by the receive order, not by sequence numbers.
//!   The SNS publish response has no `SequenceNumber`, and the notification
//!   JSON (non-raw) has no `SequenceNumber` either.
//! - **The 256 KiB limit counts characters, not bytes, and ignores message
//!   attributes**: a message of 262,144 characters passes (raw delivery: even
//!   262,144 two-byte characters), 262,145 fails with `InvalidParameter`
//!   ("Message too long"); 262,000 characters plus a 10,000-character
//!   attribute pass. The 256 KiB total of a `PublishBatch` request is not
//!   checked either (AWS: `BatchRequestTooLong`), nor is an empty batch
//!   (AWS: `EmptyBatchRequest`; moto answers with nothing successful or failed).
//! - **Non-raw delivery escapes non-ASCII** in the notification JSON
//!   (`\u00e9`, 6 bytes a character) and the queue's 1 MiB limit then applies
//!   to that: publishing more than ~174,000 non-ASCII characters fails with
//!   `InvalidParameterValue` ("Message must be shorter than 1048576 bytes").
//! - **Raw delivery + `Binary` message attributes breaks `ReceiveMessage`** on
//!   that queue (HTTP 500: moto hashes the stored base64 text as bytes); use
//!   non-raw delivery when a test publishes binary attributes (there
//!   [`Received::attributes`] holds the base64 text, as AWS sends it).
//! - `PublishBatch` entries failing for a reason other than `InvalidParameter`
//!   (e.g. a `Subject` over 100 characters) are dropped silently: neither in
//!   `Successful` nor in `Failed`.
//! - moto accepts any credentials and does not check signatures (unless a
//!   test turns that on for a server of its own, see below); throttling and
//!   server errors never happen: use [`crate::FaultProxy`] for those.
//!
//! # Signature checks (a private server only)
//!
//! [`Moto::enforce_signatures`] makes the server check every request from
//! then on, as IAM would: the access key must belong to an IAM user
//! ([`Moto::iam_user`]) or to STS credentials ([`Moto::assume_role`]; the
//! `X-Amz-Security-Token` header must then carry their session token), the
//! SigV4 signature must match, and the key's policies must allow the action.
//! It applies to the whole server, so never call it on the shared one. What
//! moto 5.2.1 checks and what it does not:
//! - It recomputes the signature with botocore over the headers the request
//!   lists in `SignedHeaders`, taking their values as received, and over the
//!   body. So a changed body, a changed signed header, or a `Host` (port
//!   included) other than the one signed all give `SignatureDoesNotMatch`;
//!   an unknown key gives `InvalidClientTokenId`, and so do STS keys without
//!   their token or with a wrong one.
//! - **A form body (query protocol: SNS, IAM, STS) is hashed as moto
//!   re-encodes it** from the parsed form with Python's `urlencode` (space as
//!   `+`, upper-case hex, `~` as is), not as it was sent. A correctly signed
//!   body encoded otherwise, e.g. a space as `%20` (RFC 3986; the Rust SDK
//!   writes that), fails with `SignatureDoesNotMatch`; AWS hashes the bytes it
//!   received. The relay encodes as botocore does, so this holds for it; JSON
//!   bodies (SQS) are hashed as sent.
//! - It does not check the clock: an `X-Amz-Date` of 2001 passes (AWS refuses
//!   more than 15 minutes of skew). Region and service are read from the
//!   credential scope and not compared with anything (the scope also routes
//!   the request: a scope of `eu-west-1` reaches moto's `eu-west-1` backend).
//! - The permission checked is `service:<Action>`, e.g. `sns:PublishBatch`,
//!   where AWS checks `sns:Publish` for `PublishBatch`: the policies made here
//!   allow `sns:*` and `sqs:*`.
//! - Its errors come as XML even for SQS's JSON protocol (boto3 shows them as
//!   an unparsed 403).

use std::collections::HashMap;
use std::fmt;
use std::fs::{self, File};
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use aws_config::{BehaviorVersion, Region, SdkConfig};
use aws_sdk_sns::config::Credentials;
use aws_sdk_sqs::types::{
    DeleteMessageBatchRequestEntry, MessageSystemAttributeName, QueueAttributeName,
};

/// Env var with the endpoint of a moto server started once for the whole test
/// run (by `scripts/test.sh`), e.g. `http://127.0.0.1:5000`. When unset, each
/// test process starts its own (see [`shared_moto_endpoint`]).
pub const ENV_SNS_URL: &str = "OUTBOX_RELAY_TEST_SNS_URL";
/// The account id moto uses in every ARN.
pub const MOTO_ACCOUNT_ID: &str = "123456789012";
/// The region of every client made here.
pub const TEST_REGION: &str = "us-east-1";

/// How long [`Moto::start`] waits for the server to answer.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// A moto server (`tests/data/moto_server.py`: `moto.server` with Kinesis made
/// safe for concurrent PutRecords and EventBridge rules' JSONPath parse cached)
/// on `127.0.0.1:<free port>`, in
/// memory, answering SNS, SQS and every other AWS API it mocks.
///
/// Its output goes to a log file in its own temp dir. Dropping it kills the
/// server; a watchdog process in its own session does the same if this process
/// dies without dropping it.
pub struct Moto {
    child: Child,
    port: u16,
    log_file: PathBuf,
    watchdog: Option<Child>,
    _dir: tempfile::TempDir,
}

impl Moto {
    /// Starts a server and returns once it answers HTTP (usually under a
    /// second; gives up after 20 s). Blocking. Panics with the server's output
    /// when it does not come up (run `scripts/install-deps.sh` if moto is missing).
    pub fn start() -> Moto {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/data/moto_server.py");
        Self::start_program(&[script])
    }

    /// A server of moto with SNS's topic-sized limits
    /// (`tests/data/moto_sized_topics.py`): topics keep their
    /// `MaximumMessageSize` attribute, `GetTopicAttributes` returns it, and a
    /// message whose body and attributes are larger (in bytes) is refused
    /// with `InvalidParameter`, as SNS does. moto itself refuses anything over
    /// 262,144 characters and does not know the attribute.
    pub fn start_sized_topics() -> Moto {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/data/moto_sized_topics.py");
        Self::start_program(&[script])
    }

    fn start_program(program: &[&str]) -> Moto {
        // The port is picked by binding 127.0.0.1:0; another process may take it
        // before moto binds it, so retry with a new one.
        let mut attempt = 0;
        loop {
            attempt += 1;
            let dir = tempfile::Builder::new()
                .prefix("outbox-relay-moto-")
                .tempdir()
                .unwrap_or_else(|e| panic!("cannot create a temp dir for moto: {e}"));
            let log_file = dir.path().join("moto.log");
            let port = free_port();
            let log = File::create(&log_file)
                .unwrap_or_else(|e| panic!("create {}: {e}", log_file.display()));
            let log2 = log.try_clone().expect("clone the log file handle");
            let child = Command::new("python3")
                .args(program)
                .args(["-H", "127.0.0.1", "-p"])
                .arg(port.to_string())
                .env("PYTHONUNBUFFERED", "1")
                .current_dir(dir.path())
                .stdin(Stdio::null())
                .stdout(log)
                .stderr(log2)
                .spawn()
                .unwrap_or_else(|e| {
                    panic!("cannot run python3 {program:?}: {e} (run scripts/install-deps.sh)")
                });
            let watchdog = spawn_watchdog(child.id(), dir.path());
            let mut moto = Moto {
                child,
                port,
                log_file,
                watchdog,
                _dir: dir,
            };
            match moto.wait_ready() {
                Ok(()) => return moto,
                Err(msg) => {
                    let log = moto.log_tail(30);
                    if attempt < 5 && log.contains("Address already in use") {
                        eprintln!("harness: moto port {port} was taken, retrying");
                        continue; // drops `moto`: kills it, removes its dir
                    }
                    panic!(
                        "moto server on 127.0.0.1:{port}: {msg}\n--- {} ---\n{log}",
                        moto.log_file.display()
                    );
                }
            }
        }
    }

    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("it exited ({status})"));
            }
            if answers_http(self.port) {
                // Another server may have taken the port: make sure ours still runs.
                std::thread::sleep(Duration::from_millis(50));
                return match self.child.try_wait() {
                    Ok(None) => Ok(()),
                    Ok(Some(status)) => Err(format!("it exited ({status})")),
                    Err(e) => Err(format!("cannot check it: {e}")),
                };
            }
            if Instant::now() >= deadline {
                return Err(format!("no HTTP answer within {START_TIMEOUT:?}"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `http://127.0.0.1:PORT`
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The TCP port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's log (one line per request).
    pub fn log_file(&self) -> &Path {
        &self.log_file
    }

    /// The last `n` lines of the server's log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = fs::read(&self.log_file)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Creates IAM user `name` with an access key and an inline policy that
    /// allows `sns:*` and `sqs:*`; the key. Call it before
    /// [`Moto::enforce_signatures`] (the IAM calls are not signed). Panics on
    /// errors.
    pub async fn iam_user(&self, name: &str) -> AccessKey {
        self.query(
            "iam",
            IAM_VERSION,
            &[("Action", "CreateUser"), ("UserName", name)],
        )
        .await;
        self.query(
            "iam",
            IAM_VERSION,
            &[
                ("Action", "PutUserPolicy"),
                ("UserName", name),
                ("PolicyName", "sns-sqs"),
                ("PolicyDocument", SNS_SQS_POLICY),
            ],
        )
        .await;
        let answer = self
            .query(
                "iam",
                IAM_VERSION,
                &[("Action", "CreateAccessKey"), ("UserName", name)],
            )
            .await;
        AccessKey {
            id: xml_text(&answer, "AccessKeyId"),
            secret: xml_text(&answer, "SecretAccessKey"),
            session_token: None,
        }
    }

    /// Creates IAM role `name` (trusting this account, with an inline policy
    /// that allows `sns:*` and `sqs:*`) and assumes it through STS; the
    /// temporary credentials, session token included, valid for an hour.
    /// Call it before [`Moto::enforce_signatures`]. Panics on errors.
    pub async fn assume_role(&self, name: &str) -> AccessKey {
        let trust = format!(
            r#"{{"Version":"2012-10-17","Statement":[{{"Effect":"Allow","Principal":{{"AWS":"arn:aws:iam::{MOTO_ACCOUNT_ID}:root"}},"Action":"sts:AssumeRole"}}]}}"#
        );
        self.query(
            "iam",
            IAM_VERSION,
            &[
                ("Action", "CreateRole"),
                ("RoleName", name),
                ("AssumeRolePolicyDocument", &trust),
            ],
        )
        .await;
        self.query(
            "iam",
            IAM_VERSION,
            &[
                ("Action", "PutRolePolicy"),
                ("RoleName", name),
                ("PolicyName", "sns-sqs"),
                ("PolicyDocument", SNS_SQS_POLICY),
            ],
        )
        .await;
        let role_arn = format!("arn:aws:iam::{MOTO_ACCOUNT_ID}:role/{name}");
        let answer = self
            .query(
                "sts",
                "2011-06-15",
                &[
                    ("Action", "AssumeRole"),
                    ("RoleArn", &role_arn),
                    ("RoleSessionName", "outbox-relay-test"),
                ],
            )
            .await;
        AccessKey {
            id: xml_text(&answer, "AccessKeyId"),
            secret: xml_text(&answer, "SecretAccessKey"),
            session_token: Some(xml_text(&answer, "SessionToken")),
        }
    }

    /// From now on every request to this server must be signed (SigV4) by a
    /// key its IAM knows, and be allowed by that key's policies (see the
    /// module docs for what is checked). For the server of one test only:
    /// it cannot be turned off, and the shared server would fail every other
    /// test. Panics on errors.
    pub async fn enforce_signatures(&self) {
        // The number of requests still let through unchecked: none.
        let port = self.port;
        let (status, body) = tokio::task::spawn_blocking(move || {
            http_post(
                port,
                "/moto-api/reset-auth",
                &[("Content-Type", "text/plain")],
                "0",
            )
        })
        .await
        .unwrap_or_else(|e| panic!("POST /moto-api/reset-auth: {e}"))
        .unwrap_or_else(|e| panic!("POST /moto-api/reset-auth: {e}"));
        assert_eq!(status, 200, "POST /moto-api/reset-auth: {body}");
    }

    /// An unsigned query-protocol call (IAM, STS); the answer's body. moto
    /// finds the service by the credential scope of the `Authorization`
    /// header, so the call carries one with a dummy signature: only accepted
    /// before [`Moto::enforce_signatures`]. Panics unless the answer is 200.
    async fn query(&self, service: &str, version: &str, params: &[(&str, &str)]) -> String {
        let mut form = format!("Version={version}");
        for (name, value) in params {
            form.push_str(&format!("&{name}={}", form_encode(value)));
        }
        let authorization = format!(
            "AWS4-HMAC-SHA256 Credential=test/20240101/{TEST_REGION}/{service}/aws4_request, \
             SignedHeaders=host, Signature=0"
        );
        let port = self.port;
        let call = form.clone();
        let (status, body) = tokio::task::spawn_blocking(move || {
            http_post(
                port,
                "/",
                &[
                    (
                        "Content-Type",
                        "application/x-www-form-urlencoded; charset=utf-8",
                    ),
                    ("Authorization", &authorization),
                ],
                &call,
            )
        })
        .await
        .unwrap_or_else(|e| panic!("{service} {form}: {e}"))
        .unwrap_or_else(|e| panic!("{service} {form}: {e}"));
        assert_eq!(status, 200, "{service} {form}: HTTP {status}: {body}");
        body
    }
}

/// The API version of IAM's query protocol.
const IAM_VERSION: &str = "2010-05-08";
/// The policy of the users and roles made by [`Moto::iam_user`] and [`Moto::assume_role`].
const SNS_SQS_POLICY: &str = r#"{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":["sns:*","sqs:*"],"Resource":"*"}]}"#;

/// AWS credentials of a [`Moto`] server's IAM: an IAM user's access key, or
/// STS temporary credentials (with a session token).
#[derive(Clone, PartialEq, Eq)]
pub struct AccessKey {
    /// `AKIA…` (IAM user) or `ASIA…` (STS).
    pub id: String,
    /// The secret access key.
    pub secret: String,
    /// The session token of STS credentials.
    pub session_token: Option<String>,
}

impl AccessKey {
    /// The same key with another secret: what a misconfigured client signs with.
    pub fn with_secret(&self, secret: &str) -> AccessKey {
        AccessKey {
            secret: secret.to_owned(),
            ..self.clone()
        }
    }

    /// The key as SDK credentials.
    pub fn credentials(&self) -> Credentials {
        Credentials::new(
            &self.id,
            &self.secret,
            self.session_token.clone(),
            None,
            "moto-iam",
        )
    }

    /// [`aws_env`] with this key instead of the static test credentials;
    /// `AWS_SESSION_TOKEN` is always set (empty without a token), so none is
    /// inherited.
    pub fn env(&self, endpoint: &str) -> Vec<(&'static str, String)> {
        let mut env = aws_env(endpoint);
        for (name, value) in &mut env {
            match *name {
                "AWS_ACCESS_KEY_ID" => value.clone_from(&self.id),
                "AWS_SECRET_ACCESS_KEY" => value.clone_from(&self.secret),
                _ => {}
            }
        }
        env.push((
            "AWS_SESSION_TOKEN",
            self.session_token.clone().unwrap_or_default(),
        ));
        env
    }
}

impl fmt::Debug for AccessKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AccessKey")
            .field("id", &self.id)
            .field("session_token", &self.session_token.is_some())
            .finish_non_exhaustive()
    }
}

/// The text of the first `<tag>…</tag>` in `xml` (no entities in what is
/// read here: keys, secrets, base64 tokens). Panics when there is none.
fn xml_text(xml: &str, tag: &str) -> String {
    let open = format!("<{tag}>");
    let close = format!("</{tag}>");
    xml.split_once(&open)
        .and_then(|(_, rest)| rest.split_once(&close))
        .map(|(text, _)| text.to_owned())
        .unwrap_or_else(|| panic!("no <{tag}> in the answer: {xml}"))
}

/// `application/x-www-form-urlencoded` value: everything but the unreserved
/// characters percent-encoded.
fn form_encode(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// POSTs `body` to `path` on 127.0.0.1:`port` (HTTP/1.1, one connection,
/// closed after the answer) with `headers`; the answer's status and body.
fn http_post(
    port: u16,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Result<(u16, String), String> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .map_err(|e| format!("connect to {addr}: {e}"))?;
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(10)));
    let mut request = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(body);
    stream
        .write_all(request.as_bytes())
        .map_err(|e| format!("send: {e}"))?;
    let mut answer = Vec::new();
    stream
        .read_to_end(&mut answer)
        .map_err(|e| format!("read the answer: {e}"))?;
    let answer = String::from_utf8_lossy(&answer);
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("not an HTTP answer: {answer}"))?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no status in {head:?}"))?;
    Ok((status, body.to_owned()))
}

impl Drop for Moto {
    fn drop(&mut self) {
        if let Some(mut watchdog) = self.watchdog.take() {
            let _ = watchdog.kill();
            let _ = watchdog.wait();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl fmt::Debug for Moto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Moto")
            .field("endpoint", &self.endpoint())
            .field("pid", &self.child.id())
            .finish()
    }
}

/// `setsid sh -c 'read; kill PID; rm -rf DIR'` with its stdin a pipe we hold:
/// when this process dies the pipe closes and the watchdog (out of reach of
/// process-group kills) kills the server and removes its dir.
fn spawn_watchdog(pid: u32, dir: &Path) -> Option<Child> {
    const SCRIPT: &str = r#"read -r _ignored; kill "$1" 2>/dev/null; sleep 1; rm -rf -- "$2""#;
    Command::new("setsid")
        .args(["sh", "-c", SCRIPT, "moto-watchdog"])
        .arg(pid.to_string())
        .arg(dir)
        .current_dir("/")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| eprintln!("harness: no cleanup watchdog for moto (setsid: {e})"))
        .ok()
}

/// Whether something on 127.0.0.1:`port` answers `GET /` with an HTTP response.
fn answers_http(port: u16) -> bool {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(500)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(2)));
    if stream
        .write_all(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut head = [0u8; 8];
    stream.read_exact(&mut head).is_ok() && head.starts_with(b"HTTP/1.")
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("cannot bind 127.0.0.1:0 to pick a port: {e}"))
}

/// The moto server of this process, alive while someone holds an `Arc`.
static SHARED: Mutex<Weak<Moto>> = Mutex::new(Weak::new());

/// The endpoint of the shared moto server, plus what keeps that server alive.
///
/// Derefs to the endpoint (`&str`, `http://127.0.0.1:PORT`). Keep it alive for
/// as long as the endpoint is used: when this process started the server, the
/// last holder to drop stops it.
#[derive(Clone)]
pub struct SharedEndpoint {
    url: String,
    moto: Option<Arc<Moto>>,
}

impl SharedEndpoint {
    /// The endpoint, `http://127.0.0.1:PORT`.
    pub fn as_str(&self) -> &str {
        &self.url
    }

    /// The server, when this process started it (`None` when the endpoint came
    /// from `OUTBOX_RELAY_TEST_SNS_URL`).
    pub fn moto(&self) -> Option<&Arc<Moto>> {
        self.moto.as_ref()
    }
}

impl Deref for SharedEndpoint {
    type Target = str;
    fn deref(&self) -> &str {
        &self.url
    }
}

impl fmt::Display for SharedEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.url)
    }
}

impl fmt::Debug for SharedEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("SharedEndpoint").field(&self.url).finish()
    }
}

/// The shared moto endpoint: `$OUTBOX_RELAY_TEST_SNS_URL` when set, otherwise a
/// [`Moto`] started on first use in this process and kept while any returned
/// handle lives. Blocking when it has to start one (about a second); inside
/// async code prefer [`moto_endpoint`].
///
/// The server is shared: give every topic and queue a unique name (e.g. the
/// [`crate::TestDb`] name, or [`unique_name`]).
pub fn shared_moto_endpoint() -> SharedEndpoint {
    if let Some(url) = std::env::var(ENV_SNS_URL).ok().filter(|u| !u.is_empty()) {
        return SharedEndpoint {
            url: url.trim_end_matches('/').to_owned(),
            moto: None,
        };
    }
    let mut slot = SHARED.lock().unwrap_or_else(PoisonError::into_inner);
    let moto = slot.upgrade().unwrap_or_else(|| {
        let moto = Arc::new(Moto::start());
        *slot = Arc::downgrade(&moto);
        moto
    });
    SharedEndpoint {
        url: moto.endpoint(),
        moto: Some(moto),
    }
}

/// [`shared_moto_endpoint`] on a blocking thread, for async code.
pub async fn moto_endpoint() -> SharedEndpoint {
    tokio::task::spawn_blocking(shared_moto_endpoint)
        .await
        .unwrap_or_else(|e| panic!("starting the shared moto server: {e}"))
}

/// `prefix` plus 16 random hex digits: a name for a topic or queue that no
/// other test uses (letters, digits, `_` and `-` only in `prefix`).
pub fn unique_name(prefix: &str) -> String {
    format!("{prefix}{:016x}", fastrand::u64(..))
}

/// AWS SDK configuration for `endpoint`: region `us-east-1`, static
/// credentials `test`/`test`, behavior version latest, SDK default retries
/// (standard mode, 3 attempts). Start from it to change retries or timeouts:
/// `aws_sdk_sns::config::Builder::from(&sdk_config(ep).await).retry_config(…)`.
pub async fn sdk_config(endpoint: &str) -> SdkConfig {
    sdk_config_with(
        endpoint,
        Credentials::new("test", "test", None, None, "static"),
    )
    .await
}

/// [`sdk_config`] signing with `key`: for a [`Moto`] that checks signatures
/// ([`Moto::enforce_signatures`]).
pub async fn sdk_config_as(endpoint: &str, key: &AccessKey) -> SdkConfig {
    sdk_config_with(endpoint, key.credentials()).await
}

async fn sdk_config_with(endpoint: &str, credentials: Credentials) -> SdkConfig {
    aws_config::defaults(BehaviorVersion::latest())
        .region(Region::new(TEST_REGION))
        .credentials_provider(credentials)
        .endpoint_url(endpoint)
        .load()
        .await
}

/// An SNS client for `endpoint` (see [`sdk_config`]).
pub async fn sns_client(endpoint: &str) -> aws_sdk_sns::Client {
    aws_sdk_sns::Client::new(&sdk_config(endpoint).await)
}

/// An SQS client for `endpoint` (see [`sdk_config`]).
pub async fn sqs_client(endpoint: &str) -> aws_sdk_sqs::Client {
    aws_sdk_sqs::Client::new(&sdk_config(endpoint).await)
}

/// An SQS client for `endpoint` signing with `key` (see [`sdk_config_as`]).
pub async fn sqs_client_as(endpoint: &str, key: &AccessKey) -> aws_sdk_sqs::Client {
    aws_sdk_sqs::Client::new(&sdk_config_as(endpoint, key).await)
}

/// Environment for a child process (the relay) using `endpoint` through the
/// AWS SDK's standard variables: `AWS_ENDPOINT_URL`, `AWS_REGION`, static test
/// credentials, and no instance metadata lookups.
pub fn aws_env(endpoint: &str) -> Vec<(&'static str, String)> {
    vec![
        ("AWS_ENDPOINT_URL", endpoint.to_owned()),
        ("AWS_REGION", TEST_REGION.to_owned()),
        ("AWS_ACCESS_KEY_ID", "test".to_owned()),
        ("AWS_SECRET_ACCESS_KEY", "test".to_owned()),
        ("AWS_EC2_METADATA_DISABLED", "true".to_owned()),
    ]
}

/// An SNS topic with one SQS queue subscribed to it.
#[derive(Debug, Clone)]
pub struct Topic {
    /// `arn:aws:sns:us-east-1:123456789012:NAME`
    pub arn: String,
    /// `http://127.0.0.1:PORT/123456789012/NAME`
    pub queue_url: String,
    /// `arn:aws:sqs:us-east-1:123456789012:NAME`
    pub queue_arn: String,
    /// The subscription of the queue to the topic.
    pub subscription_arn: String,
    /// Whether topic and queue are FIFO.
    pub fifo: bool,
    /// Whether the subscription has `RawMessageDelivery=true`.
    pub raw_delivery: bool,
}

/// Creates topic `name` and queue `name` at `endpoint` and subscribes the queue
/// to the topic (protocol `sqs`, `RawMessageDelivery` = `raw_delivery`).
///
/// With `fifo`, both are FIFO (`.fifo` is appended to `name` unless present;
/// topic attributes `FifoTopic=true`, `ContentBasedDeduplication=false`, so
/// every publish needs `MessageGroupId` and `MessageDeduplicationId`; queue
/// `FifoQueue=true`). `name` must be unique on the server (moto is shared by the
/// tests of a run) and at most 75 characters of letters, digits, `_` and `-`.
/// Panics on any error.
pub async fn topic_with_queue(endpoint: &str, name: &str, fifo: bool, raw_delivery: bool) -> Topic {
    let name = if fifo && !name.ends_with(".fifo") {
        format!("{name}.fifo")
    } else {
        name.to_owned()
    };
    let sns = sns_client(endpoint).await;
    let sqs = sqs_client(endpoint).await;

    let mut create_topic = sns.create_topic().name(&name);
    if fifo {
        create_topic = create_topic
            .attributes("FifoTopic", "true")
            .attributes("ContentBasedDeduplication", "false");
    }
    let arn = create_topic
        .send()
        .await
        .unwrap_or_else(|e| panic!("CreateTopic {name}: {}", error_text(&e)))
        .topic_arn
        .unwrap_or_else(|| panic!("CreateTopic {name}: no TopicArn"));

    let mut create_queue = sqs.create_queue().queue_name(&name);
    if fifo {
        create_queue = create_queue.attributes(QueueAttributeName::FifoQueue, "true");
    }
    let queue_url = create_queue
        .send()
        .await
        .unwrap_or_else(|e| panic!("CreateQueue {name}: {}", error_text(&e)))
        .queue_url
        .unwrap_or_else(|| panic!("CreateQueue {name}: no QueueUrl"));
    let queue_arn = sqs
        .get_queue_attributes()
        .queue_url(&queue_url)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GetQueueAttributes {queue_url}: {}", error_text(&e)))
        .attributes
        .and_then(|mut a| a.remove(&QueueAttributeName::QueueArn))
        .unwrap_or_else(|| panic!("GetQueueAttributes {queue_url}: no QueueArn"));

    let subscription_arn = sns
        .subscribe()
        .topic_arn(&arn)
        .protocol("sqs")
        .endpoint(&queue_arn)
        .attributes(
            "RawMessageDelivery",
            if raw_delivery { "true" } else { "false" },
        )
        .return_subscription_arn(true)
        .send()
        .await
        .unwrap_or_else(|e| panic!("Subscribe {queue_arn} to {arn}: {}", error_text(&e)))
        .subscription_arn
        .unwrap_or_else(|| panic!("Subscribe {queue_arn} to {arn}: no SubscriptionArn"));

    Topic {
        arn,
        queue_url,
        queue_arn,
        subscription_arn,
        fifo,
        raw_delivery,
    }
}

/// A message taken from a queue by [`receive_all`], as it was published to SNS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// The published message (the SNS notification envelope, if any, removed).
    pub body: String,
    /// The published message attributes: name → value (`String` and `Number`
    /// values as text; `Binary` values base64-encoded).
    pub attributes: HashMap<String, String>,
    /// SQS `MessageGroupId` (FIFO queues; the group given to SNS).
    pub group_id: Option<String>,
    /// SQS `MessageDeduplicationId` (FIFO queues; the id given to SNS).
    pub dedup_id: Option<String>,
    /// SQS `SequenceNumber` (FIFO queues; random in moto, do not compare).
    pub sequence: Option<String>,
    /// The SNS `MessageId` (from the notification envelope; `None` with raw
    /// delivery, where SNS's id is not delivered).
    pub message_id: Option<String>,
}

/// Receives from `queue_url` until `expected` messages arrived or `timeout`
/// passed, deleting every batch right after receiving it (an SQS FIFO queue
/// hands out a group's next message only once the previous one is deleted), and
/// returns them in receive order; the caller asserts on count and content.
/// With `expected == 0` it collects for the whole `timeout` (to check that
/// nothing (more) arrives). May return more than `expected`.
///
/// Long polls (`WaitTimeSeconds=1`, up to 10 messages). An SNS notification
/// envelope (non-raw delivery: a JSON object with `"Type":"Notification"`,
/// `"TopicArn"` and `"Message"`) is unwrapped: `body` is its `Message` and
/// `attributes` its `MessageAttributes`; otherwise (raw delivery) `body` is the
/// SQS body and `attributes` the SQS message attributes. Panics on SQS errors.
pub async fn receive_all(
    sqs: &aws_sdk_sqs::Client,
    queue_url: &str,
    expected: usize,
    timeout: Duration,
) -> Vec<Received> {
    let deadline = Instant::now() + timeout;
    let mut got = Vec::new();
    loop {
        if expected > 0 && got.len() >= expected {
            return got;
        }
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return got;
        }
        // Short polls: moto's long poll waits out the whole wait time whenever
        // fewer than 10 messages are ready (FIFO queues hand out few at once).
        let wait = 0;
        let out = sqs
            .receive_message()
            .queue_url(queue_url)
            .max_number_of_messages(10)
            .wait_time_seconds(wait)
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .message_attribute_names("All")
            .send()
            .await
            .unwrap_or_else(|e| panic!("ReceiveMessage {queue_url}: {}", error_text(&e)));
        let messages = out.messages.unwrap_or_default();
        if messages.is_empty() {
            tokio::time::sleep(remaining.min(Duration::from_millis(100))).await;
            continue;
        }
        let mut entries = Vec::with_capacity(messages.len());
        for (i, msg) in messages.iter().enumerate() {
            if let Some(handle) = msg.receipt_handle() {
                entries.push(
                    DeleteMessageBatchRequestEntry::builder()
                        .id(i.to_string())
                        .receipt_handle(handle)
                        .build()
                        .expect("id and receipt handle are set"),
                );
            }
        }
        let deleted = sqs
            .delete_message_batch()
            .queue_url(queue_url)
            .set_entries(Some(entries))
            .send()
            .await
            .unwrap_or_else(|e| panic!("DeleteMessageBatch {queue_url}: {}", error_text(&e)));
        assert!(
            deleted.failed.is_empty(),
            "DeleteMessageBatch {queue_url}: failed entries {:?}",
            deleted.failed
        );
        got.extend(messages.iter().map(received));
    }
}

fn received(msg: &aws_sdk_sqs::types::Message) -> Received {
    let system = |name: MessageSystemAttributeName| {
        msg.attributes()
            .and_then(|a| a.get(&name))
            .map(ToOwned::to_owned)
    };
    let body = msg.body().unwrap_or_default();
    let (body, attributes, message_id) = match unwrap_notification(body) {
        Some(n) => n,
        None => {
            let attributes = msg
                .message_attributes()
                .map(|attrs| {
                    attrs
                        .iter()
                        .map(|(k, v)| {
                            let value = match (v.string_value(), v.binary_value()) {
                                (Some(s), _) => s.to_owned(),
                                (None, Some(b)) => base64(b.as_ref()),
                                (None, None) => String::new(),
                            };
                            (k.clone(), value)
                        })
                        .collect()
                })
                .unwrap_or_default();
            (body.to_owned(), attributes, None)
        }
    };
    Received {
        body,
        attributes,
        group_id: system(MessageSystemAttributeName::MessageGroupId),
        dedup_id: system(MessageSystemAttributeName::MessageDeduplicationId),
        sequence: system(MessageSystemAttributeName::SequenceNumber),
        message_id,
    }
}

/// `(Message, MessageAttributes, MessageId)` of an SNS notification envelope.
fn unwrap_notification(body: &str) -> Option<(String, HashMap<String, String>, Option<String>)> {
    let serde_json::Value::Object(obj) = serde_json::from_str(body).ok()? else {
        return None;
    };
    if obj.get("Type")?.as_str()? != "Notification" || !obj.contains_key("TopicArn") {
        return None;
    }
    let message = obj.get("Message")?.as_str()?.to_owned();
    let attributes = obj
        .get("MessageAttributes")
        .and_then(|a| a.as_object())
        .map(|attrs| {
            attrs
                .iter()
                .map(|(k, v)| {
                    let value = match v.get("Value") {
                        Some(serde_json::Value::String(s)) => s.clone(),
                        Some(other) => other.to_string(),
                        None => String::new(),
                    };
                    (k.clone(), value)
                })
                .collect()
        })
        .unwrap_or_default();
    let message_id = obj
        .get("MessageId")
        .and_then(|m| m.as_str())
        .map(ToOwned::to_owned);
    Some((message, attributes, message_id))
}

/// Messages in `queue_url` not yet deleted: visible + in flight + delayed
/// (SQS's approximate counts; exact in moto). Panics on SQS errors.
pub async fn queue_depth(sqs: &aws_sdk_sqs::Client, queue_url: &str) -> usize {
    let attrs = sqs
        .get_queue_attributes()
        .queue_url(queue_url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesDelayed)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GetQueueAttributes {queue_url}: {}", error_text(&e)))
        .attributes
        .unwrap_or_default();
    attrs
        .values()
        .map(|v| v.parse::<usize>().unwrap_or(0))
        .sum()
}

/// An SDK error with its service code and message when there are some
/// (`Display` of `SdkError` alone says only "service error").
pub fn error_text<E, R>(err: &aws_sdk_sns::error::SdkError<E, R>) -> String
where
    E: aws_sdk_sns::error::ProvideErrorMetadata + std::error::Error + 'static,
    R: fmt::Debug,
{
    use aws_sdk_sns::error::ProvideErrorMetadata as _;
    match (err.code(), err.message()) {
        (Some(code), Some(msg)) => format!("{code}: {msg}"),
        (Some(code), None) => code.to_owned(),
        _ => format!("{}", aws_sdk_sns::error::DisplayErrorContext(err)),
    }
}

fn base64(bytes: &[u8]) -> String {
    const TABLE: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(TABLE[(n >> (18 - 6 * i)) as usize & 63]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{base64, unwrap_notification};

    #[test]
    fn base64_pads() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foob"), "Zm9vYg==");
        assert_eq!(base64(&[0xff, 0xfe, 0x00]), "//4A");
    }

    #[test]
    fn a_notification_is_unwrapped_and_anything_else_is_not() {
        let n = r#"{"Type":"Notification","TopicArn":"arn:t","MessageId":"m1","Message":"{\"a\":1}",
            "MessageAttributes":{"k":{"Type":"String","Value":"v"},"n":{"Type":"Number","Value":"3"}}}"#;
        let (body, attrs, id) = unwrap_notification(n).unwrap();
        assert_eq!(body, r#"{"a":1}"#);
        assert_eq!(attrs["k"], "v");
        assert_eq!(attrs["n"], "3");
        assert_eq!(id.as_deref(), Some("m1"));
        assert!(unwrap_notification(r#"{"Type":"Notification"}"#).is_none());
        assert!(unwrap_notification(r#"{"a":1}"#).is_none());
        assert!(unwrap_notification("plain").is_none());
    }
}
