//! An HTTP/1.1 proxy in front of an AWS endpoint (moto) that injects faults:
//! cut connections, throttling and server errors; and, call by call on the
//! calls that carry events (SNS `PublishBatch`, SQS `SendMessageBatch`,
//! EventBridge `PutEvents`, Kinesis `PutRecords`), the faults of the
//! conformance suite ([`Fault`]: an answer lost or late after the call was
//! processed, a slow destination, one entry failed at a given position of a
//! batch, any refusal of the destination's error table) and a quota
//! ([`FaultProxy::set_quota`]). It records what each such call carried
//! ([`FaultProxy::calls`]).
//!
//! ```no_run
//! use harness::{moto_endpoint, sns_client, FaultProxy, Mode};
//!
//! # async fn example() {
//! let moto = moto_endpoint().await;
//! let proxy = FaultProxy::start(&moto);
//! let sns = sns_client(&proxy.endpoint()).await; // or the relay's AWS_ENDPOINT_URL
//! proxy.set_mode(Mode::Throttle);
//! // … every request now gets HTTP 400 `Throttling` …
//! proxy.set_mode(Mode::Pass);
//! # }
//! ```

mod publish;

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How the proxy treats requests; switch with [`FaultProxy::set_mode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forward every request to the upstream and its response back.
    Pass,
    /// The endpoint is unreachable: open client connections are shut down and
    /// new ones closed right after accept, without an answer (the SDK sees a
    /// dispatch failure: connection closed / reset).
    Cut,
    /// Answer every request with HTTP 400 `Throttling` ("Rate exceeded"), as
    /// SNS does when a rate limit is exceeded; nothing is forwarded.
    Throttle,
    /// Answer every request with HTTP 500 `InternalError`; nothing is forwarded.
    ServerError,
    /// Forward every request to the upstream, then drop the connection
    /// without its answer: the publish happened, the client never learns it
    /// (the window between publish and acknowledgement).
    LoseAnswers,
    /// Answer every request with HTTP 403 `AuthorizationError`, as SNS does
    /// when the credentials may not publish; nothing is forwarded.
    Deny,
    /// A `PublishBatch` with an entry whose message holds the marker
    /// ([`FaultProxy::set_refusal`]) is refused whole: HTTP 400 with the
    /// refusal's code (as SNS refuses a request for one bad entry); anything
    /// else is forwarded.
    RefuseMarkedRequests,
    /// The entries whose message holds the marker are taken out of each
    /// `PublishBatch` and reported under `Failed` with the refusal's code and
    /// `SenderFault=true` (as SNS fails single entries); the rest is
    /// forwarded.
    FailMarkedEntries,
}

impl Mode {
    fn to_u8(self) -> u8 {
        match self {
            Mode::Pass => 0,
            Mode::Cut => 1,
            Mode::Throttle => 2,
            Mode::ServerError => 3,
            Mode::LoseAnswers => 4,
            Mode::Deny => 5,
            Mode::RefuseMarkedRequests => 6,
            Mode::FailMarkedEntries => 7,
        }
    }

    fn from_u8(v: u8) -> Mode {
        match v {
            1 => Mode::Cut,
            2 => Mode::Throttle,
            3 => Mode::ServerError,
            4 => Mode::LoseAnswers,
            5 => Mode::Deny,
            6 => Mode::RefuseMarkedRequests,
            7 => Mode::FailMarkedEntries,
            _ => Mode::Pass,
        }
    }
}

/// What the proxy does to one call that carries events (see
/// [`FaultProxy::script`]); other calls pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// Forward the call (the destination processes it), then reset the
    /// connection (RST) without the answer.
    LoseAnswer,
    /// Forward the call at once, hold its answer this long (longer than the
    /// relay's attempt timeout: the relay has given up when it comes).
    AnswerLate(Duration),
    /// Hold the call this long, then forward it and answer (a destination
    /// slower than the attempt timeout: it processes the call late).
    Slow(Duration),
    /// Take the entry at this position (modulo the call's entries) out of the
    /// batch, forward the rest, and answer that entry as a transient failure
    /// of its own (`InternalError` with `SenderFault=false` for SNS and SQS,
    /// `InternalFailure` for EventBridge,
    /// `ProvisionedThroughputExceededException` for Kinesis), at its position.
    FailEntry(usize),
    /// Answer with this refusal; nothing is forwarded.
    Refuse(Refusal),
}

/// An error answer: HTTP status and, in the protocol of the request, an AWS
/// error code (`None`: a body that is no AWS error, as a proxy's own page).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// HTTP status.
    pub status: u16,
    /// AWS error code.
    pub code: Option<String>,
}

impl Refusal {
    /// `status` with AWS error `code`.
    pub fn new(status: u16, code: &str) -> Refusal {
        Refusal {
            status,
            code: Some(code.to_owned()),
        }
    }

    /// `status` with a body that is not an AWS error.
    pub fn bare(status: u16) -> Refusal {
        Refusal { status, code: None }
    }
}

/// One call that carried events, as the proxy saw and treated it.
#[derive(Debug, Clone)]
pub struct Call {
    /// Its action (`PublishBatch`, `SendMessageBatch`, `PutEvents`, `PutRecords`).
    pub action: String,
    /// The envelope ids of its entries, in order.
    pub ids: Vec<String>,
    /// The fault applied (`None`: forwarded as it was, or throttled).
    pub fault: Option<Fault>,
    /// Refused for the quota ([`FaultProxy::set_quota`]).
    pub throttled: bool,
    /// The destination got it (whole, or all but a failed entry); known in
    /// [`Mode::Pass`] only (`false` in the other modes).
    pub forwarded: bool,
}

/// A token bucket of entries.
struct Quota {
    per_second: f64,
    burst: f64,
    tokens: f64,
    at: Instant,
}

impl Quota {
    /// Whether a call of `n` entries is within the quota (and takes them).
    fn take(&mut self, n: usize) -> bool {
        let now = Instant::now();
        self.tokens = (self.tokens + now.duration_since(self.at).as_secs_f64() * self.per_second)
            .min(self.burst);
        self.at = now;
        // A call larger than the bucket passes when the bucket is full.
        #[allow(clippy::cast_precision_loss)]
        let need = (n as f64).min(self.burst);
        if self.tokens >= need {
            self.tokens -= need;
            true
        } else {
            false
        }
    }
}

/// How long the proxy waits for the upstream to connect / to answer.
const UPSTREAM_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const UPSTREAM_READ_TIMEOUT: Duration = Duration::from_secs(60);
/// Largest request or response head accepted.
const MAX_HEAD: usize = 1 << 20;

/// A fault-injecting HTTP/1.1 proxy on `127.0.0.1:<free port>` in front of an
/// upstream `http://HOST:PORT` (moto).
///
/// Runs on its own threads (one accepting, one per client connection; blocking
/// I/O), so it keeps working whatever the test's runtime does. Client
/// connections are kept alive; each forwarded request goes to the upstream on a
/// fresh connection with `Connection: close`. Requests and responses may use
/// `Content-Length` or chunked bodies (forwarded with `Content-Length`);
/// `Expect: 100-continue` is answered by the proxy. The `Host` header is
/// forwarded unchanged (moto builds SQS queue URLs from it, so queue URLs
/// created through the proxy point at the proxy).
///
/// Throttle and ServerError answers use the AWS Query protocol's XML error body
/// (SNS); a request of the AWS JSON protocol (`X-Amz-Target`, as SQS uses) gets
/// a JSON body and an `x-amzn-query-error` header instead, so both SDKs report
/// the error code (`Throttling` / `InternalError`).
///
/// What the AWS SDK for Rust (aws-sdk-sns 1.121, standard retry mode) makes of
/// it, checked in `e2e/sns_fixture.rs`:
/// - Throttle: `SdkError::ServiceError`, `code() == Some("Throttling")`,
///   message "Rate exceeded", status 400; `Throttling` is not a modeled error
///   of `Publish`, so it is `PublishError::Unhandled`. The SDK classifies it as
///   throttling and retries: 3 requests per call with default settings (~1–3 s).
/// - ServerError: `code() == Some("InternalError")`, status 500
///   (`PublishError::InternalErrorException`); retried by the SDK too.
/// - Cut: `SdkError::DispatchFailure` (hyper `IncompleteMessage`, "connection
///   closed before message completed"), no `code()`; a transient error the SDK
///   retries (~3 s to fail with default settings, a few ms without retries).
///
/// Dropping it stops accepting and shuts every client connection down.
pub struct FaultProxy {
    shared: Arc<Shared>,
    addr: SocketAddr,
    acceptor: Option<JoinHandle<()>>,
}

struct Shared {
    upstream: SocketAddr,
    mode: AtomicU8,
    stopping: AtomicBool,
    requests: AtomicU64,
    faults: AtomicU64,
    next_conn: AtomicU64,
    /// Clones of the open client connections, to shut them down on Cut / drop.
    conns: Mutex<HashMap<u64, TcpStream>>,
    /// The AWS action of every request read, in order.
    actions: Mutex<Vec<String>>,
    /// Marker and error code of the refusing modes.
    refusal: Mutex<(String, String)>,
    /// Faults for the next calls that carry events, one a call.
    script: Mutex<VecDeque<Fault>>,
    /// Refusals of every call that carries a marker.
    marked: Mutex<Vec<(String, Refusal)>>,
    /// Entries a second the calls that carry events may bring.
    quota: Mutex<Option<Quota>>,
    /// Every call that carried events, in the order read.
    calls: Mutex<Vec<Call>>,
}

impl FaultProxy {
    /// Starts a proxy in [`Mode::Pass`] in front of `upstream`
    /// (`http://127.0.0.1:PORT`, a trailing `/` allowed). Panics if it cannot
    /// bind or `upstream` does not resolve.
    pub fn start(upstream: &str) -> FaultProxy {
        let authority = upstream
            .strip_prefix("http://")
            .unwrap_or_else(|| {
                panic!("FaultProxy upstream must be http://HOST:PORT, got {upstream}")
            })
            .trim_end_matches('/');
        let upstream_addr = authority
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .unwrap_or_else(|| panic!("FaultProxy: cannot resolve upstream {upstream}"));
        let listener = TcpListener::bind("127.0.0.1:0")
            .unwrap_or_else(|e| panic!("FaultProxy: cannot bind 127.0.0.1:0: {e}"));
        let addr = listener.local_addr().expect("listener address");
        let shared = Arc::new(Shared {
            upstream: upstream_addr,
            mode: AtomicU8::new(Mode::Pass.to_u8()),
            stopping: AtomicBool::new(false),
            requests: AtomicU64::new(0),
            faults: AtomicU64::new(0),
            next_conn: AtomicU64::new(0),
            conns: Mutex::new(HashMap::new()),
            actions: Mutex::new(Vec::new()),
            refusal: Mutex::new(("POISON".to_owned(), "ValidationException".to_owned())),
            script: Mutex::new(VecDeque::new()),
            marked: Mutex::new(Vec::new()),
            quota: Mutex::new(None),
            calls: Mutex::new(Vec::new()),
        });
        let acceptor = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("fault-proxy-{}", addr.port()))
                .spawn(move || accept_loop(&listener, &shared))
                .expect("spawn the proxy's accept thread")
        };
        FaultProxy {
            shared,
            addr,
            acceptor: Some(acceptor),
        }
    }

    /// `http://127.0.0.1:PORT` of the proxy.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The proxy's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The current mode.
    pub fn mode(&self) -> Mode {
        Mode::from_u8(self.shared.mode.load(Ordering::SeqCst))
    }

    /// Switches the mode; applies to every request read from now on. Switching
    /// to [`Mode::Cut`] also shuts down the open client connections (a request
    /// being forwarded gets no answer).
    pub fn set_mode(&self, mode: Mode) {
        self.shared.mode.store(mode.to_u8(), Ordering::SeqCst);
        if mode == Mode::Cut {
            let conns = self
                .shared
                .conns
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            for conn in conns.values() {
                if conn.shutdown(Shutdown::Both).is_ok() {
                    self.shared.faults.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
    }

    /// The marker (ASCII letters and digits, so it reads the same
    /// form-encoded) and the error code of [`Mode::RefuseMarkedRequests`] and
    /// [`Mode::FailMarkedEntries`]; `POISON` and `ValidationException` unless set.
    pub fn set_refusal(&self, marker: &str, code: &str) {
        assert!(marker.bytes().all(|b| b.is_ascii_alphanumeric()));
        *self
            .shared
            .refusal
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = (marker.to_owned(), code.to_owned());
    }

    /// Applies `faults`, in order, one to each of the next calls that carry
    /// events (in [`Mode::Pass`]; after them such calls pass again), after
    /// those already waiting.
    pub fn script(&self, faults: impl IntoIterator<Item = Fault>) {
        lock(&self.shared.script).extend(faults);
    }

    /// Faults of [`FaultProxy::script`] not applied yet.
    pub fn faults_pending(&self) -> usize {
        lock(&self.shared.script).len()
    }

    /// Refuses with `refusal` every call that carries events and holds
    /// `marker` (ASCII letters and digits) anywhere in its body, before any
    /// scripted fault (in [`Mode::Pass`]).
    pub fn refuse_marked(&self, marker: &str, refusal: Refusal) {
        assert!(marker.bytes().all(|b| b.is_ascii_alphanumeric()));
        lock(&self.shared.marked).push((marker.to_owned(), refusal));
    }

    /// A quota of `per_second` entries a second (a bucket of `burst`
    /// entries, full at the start) for the calls that carry events: a call
    /// beyond it is answered HTTP 400 with the destination's throttling code
    /// (`Throttling`, `ThrottlingException`,
    /// `ProvisionedThroughputExceededException`). `None` lifts it.
    pub fn set_quota(&self, quota: Option<(f64, f64)>) {
        *lock(&self.shared.quota) = quota.map(|(per_second, burst)| Quota {
            per_second,
            burst,
            tokens: burst,
            at: Instant::now(),
        });
    }

    /// Every call that carried events so far, in the order read (in every
    /// mode; what was done to it is known in [`Mode::Pass`]).
    pub fn calls(&self) -> Vec<Call> {
        lock(&self.shared.calls).clone()
    }

    /// HTTP requests read from clients so far, in any mode (in Cut mode
    /// connections are closed before a request is read: not counted here).
    pub fn requests_seen(&self) -> u64 {
        self.shared.requests.load(Ordering::SeqCst)
    }

    /// Faults injected so far: requests answered with an error (Throttle,
    /// ServerError) plus connections closed or shut down in Cut mode.
    pub fn faults_injected(&self) -> u64 {
        self.shared.faults.load(Ordering::SeqCst)
    }

    /// The AWS action of every request read so far, in order: the `Action`
    /// form parameter (Query protocol: `Publish`, `PublishBatch`, …) or the
    /// operation of `X-Amz-Target` (JSON protocol: `ReceiveMessage`, …);
    /// `?` when neither is there.
    pub fn actions(&self) -> Vec<String> {
        self.shared
            .actions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        // Wake the blocking accept.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
        let conns = self
            .shared
            .conns
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for conn in conns.values() {
            let _ = conn.shutdown(Shutdown::Both);
        }
    }
}

impl fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultProxy")
            .field("endpoint", &self.endpoint())
            .field("upstream", &self.shared.upstream)
            .field("mode", &self.mode())
            .finish()
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = conn else { continue };
        if Mode::from_u8(shared.mode.load(Ordering::SeqCst)) == Mode::Cut {
            let _ = stream.shutdown(Shutdown::Both);
            shared.faults.fetch_add(1, Ordering::SeqCst);
            continue;
        }
        let id = shared.next_conn.fetch_add(1, Ordering::SeqCst);
        let Ok(clone) = stream.try_clone() else {
            continue;
        };
        shared
            .conns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id, clone);
        let shared = Arc::clone(shared);
        let spawned = std::thread::Builder::new()
            .name(format!("fault-proxy-conn-{id}"))
            .spawn(move || {
                let _ = serve_client(stream, &shared);
                shared
                    .conns
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&id);
            });
        if let Err(e) = spawned {
            eprintln!("harness: FaultProxy cannot spawn a connection thread: {e}");
        }
    }
}

/// Serves one client connection: request after request until it closes.
fn serve_client(stream: TcpStream, shared: &Shared) -> io::Result<()> {
    let mut client = HttpConn::new(stream);
    loop {
        let Some(head) = client.read_head()? else {
            return Ok(());
        };
        if head.has_token("expect", "100-continue") {
            client.stream.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")?;
        }
        let body = client.read_body(&head, false)?;
        shared.requests.fetch_add(1, Ordering::SeqCst);
        let action = action_of(&head, &body);
        shared
            .actions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(action.clone());
        let (marker, code) = shared
            .refusal
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let close = head.has_token("connection", "close") || head.start_line.ends_with("HTTP/1.0");
        let mode = Mode::from_u8(shared.mode.load(Ordering::SeqCst));
        let response = if mode == Mode::Pass && publish::is_publish(&action) {
            match publish_call(shared, &head, &body, &action) {
                Some(response) => response,
                None => {
                    // The answer is lost: reset, not close (SO_LINGER 0 makes
                    // the last close of the socket an RST).
                    reset_on_close(&client.stream);
                    return Ok(());
                }
            }
        } else {
            if publish::is_publish(&action) {
                lock(&shared.calls).push(Call {
                    action: action.clone(),
                    ids: publish::event_ids(&action, &body),
                    fault: None,
                    throttled: false,
                    forwarded: false,
                });
            }
            match mode {
                Mode::Cut => {
                    shared.faults.fetch_add(1, Ordering::SeqCst);
                    let _ = client.stream.shutdown(Shutdown::Both);
                    return Ok(());
                }
                Mode::Throttle => {
                    shared.faults.fetch_add(1, Ordering::SeqCst);
                    error_response(&head, 400, "Sender", "Throttling", "Rate exceeded")
                }
                Mode::ServerError => {
                    shared.faults.fetch_add(1, Ordering::SeqCst);
                    error_response(
                        &head,
                        500,
                        "Receiver",
                        "InternalError",
                        "Request could not be completed",
                    )
                }
                Mode::Deny => {
                    shared.faults.fetch_add(1, Ordering::SeqCst);
                    error_response(
                        &head,
                        403,
                        "Sender",
                        "AuthorizationError",
                        "User is not authorized to perform: SNS:Publish",
                    )
                }
                Mode::LoseAnswers => {
                    shared.faults.fetch_add(1, Ordering::SeqCst);
                    let _ = forward(shared.upstream, &head, &body);
                    let _ = client.stream.shutdown(Shutdown::Both);
                    return Ok(());
                }
                Mode::RefuseMarkedRequests
                    if action == "PublishBatch" && find(&body, marker.as_bytes()).is_some() =>
                {
                    shared.faults.fetch_add(1, Ordering::SeqCst);
                    error_response(&head, 400, "Sender", &code, "refused by the fault proxy")
                }
                Mode::FailMarkedEntries if action == "PublishBatch" => {
                    let (rest, failed) = without_marked_entries(&body, &marker);
                    shared
                        .faults
                        .fetch_add(failed.len() as u64, Ordering::SeqCst);
                    let answer = if rest.contains(".Id=") {
                        forward(shared.upstream, &head, rest.as_bytes())
                    } else {
                        Ok(simple_response(
                        200,
                        "OK",
                        "text/xml",
                        &[],
                        b"<PublishBatchResponse><PublishBatchResult><Successful/></PublishBatchResult>\
                          <ResponseMetadata><RequestId>r</RequestId></ResponseMetadata></PublishBatchResponse>",
                    ))
                    };
                    match answer {
                        Ok(answer) => with_failed_entries(answer, &failed, &code),
                        Err(e) => bad_gateway(shared.upstream, &e),
                    }
                }
                Mode::Pass | Mode::RefuseMarkedRequests | Mode::FailMarkedEntries => {
                    match forward(shared.upstream, &head, &body) {
                        Ok(resp) => resp,
                        Err(e) => bad_gateway(shared.upstream, &e),
                    }
                }
            }
        };
        // A Cut may have come while forwarding: then the client gets nothing.
        if Mode::from_u8(shared.mode.load(Ordering::SeqCst)) == Mode::Cut {
            let _ = client.stream.shutdown(Shutdown::Both);
            return Ok(());
        }
        let response = if close {
            with_connection_close(response)
        } else {
            response
        };
        client.stream.write_all(&response)?;
        if close {
            let _ = client.stream.shutdown(Shutdown::Both);
            return Ok(());
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A call that carries events, in [`Mode::Pass`]: a marked refusal, the next
/// scripted fault or the quota decides; the answer, or `None` to lose it.
fn publish_call(shared: &Shared, head: &Head, body: &[u8], action: &str) -> Option<Vec<u8>> {
    let ids = publish::event_ids(action, body);
    let marked = lock(&shared.marked)
        .iter()
        .find(|(marker, _)| publish::carries(action, body, marker))
        .map(|(_, refusal)| Fault::Refuse(refusal.clone()));
    let fault = marked.or_else(|| lock(&shared.script).pop_front());
    let throttled = fault.is_none()
        && lock(&shared.quota)
            .as_mut()
            .is_some_and(|q| !q.take(ids.len().max(1)));
    if fault.is_some() || throttled {
        shared.faults.fetch_add(1, Ordering::SeqCst);
    }
    let index = {
        let mut calls = lock(&shared.calls);
        calls.push(Call {
            action: action.to_owned(),
            ids,
            fault: fault.clone(),
            throttled,
            forwarded: false,
        });
        calls.len() - 1
    };
    let forwarded = || lock(&shared.calls)[index].forwarded = true;
    let pass = |body: &[u8]| match forward(shared.upstream, head, body) {
        Ok(resp) => resp,
        Err(e) => bad_gateway(shared.upstream, &e),
    };
    if throttled {
        return Some(error_response(
            head,
            400,
            "Sender",
            publish::throttling_code(action),
            "Rate exceeded",
        ));
    }
    Some(match fault {
        None => {
            forwarded();
            pass(body)
        }
        Some(Fault::LoseAnswer) => {
            let _ = forward(shared.upstream, head, body);
            forwarded();
            return None;
        }
        Some(Fault::AnswerLate(delay)) => {
            let answer = pass(body);
            forwarded();
            std::thread::sleep(delay);
            answer
        }
        Some(Fault::Slow(delay)) => {
            std::thread::sleep(delay);
            forwarded();
            pass(body)
        }
        Some(Fault::FailEntry(position)) => match publish::without_entry(action, body, position) {
            None => {
                forwarded();
                pass(body)
            }
            Some(without) => {
                let answer = match &without.rest {
                    Some(rest) => {
                        forwarded();
                        let answer = pass(rest);
                        if !answer.starts_with(b"HTTP/1.1 200") {
                            return Some(answer);
                        }
                        let split = find(&answer, b"\r\n\r\n").map_or(answer.len(), |i| i + 4);
                        Some(answer[split..].to_vec())
                    }
                    None => None,
                };
                let body = publish::with_failed_entry(action, answer.as_deref(), &without);
                let content_type = head
                    .get("content-type")
                    .filter(|_| action != "PublishBatch")
                    .unwrap_or("text/xml")
                    .to_owned();
                simple_response(
                    200,
                    "OK",
                    &content_type,
                    &[("x-amzn-RequestId", request_id())],
                    &body,
                )
            }
        },
        Some(Fault::Refuse(Refusal { status, code })) => {
            let kind = if status >= 500 { "Receiver" } else { "Sender" };
            match code {
                Some(code) => {
                    error_response(head, status, kind, &code, "refused by the fault proxy")
                }
                None => simple_response(
                    status,
                    reason_phrase(status),
                    "text/html",
                    &[],
                    b"<html><body>an answer that is no AWS error</body></html>",
                ),
            }
        }
    })
}

/// Makes the last close of `stream`'s socket a reset (SO_LINGER 0).
#[allow(unsafe_code)]
fn reset_on_close(stream: &TcpStream) {
    use std::os::fd::AsRawFd as _;
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid socket and a `linger` of the size given.
    unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            std::ptr::addr_of!(linger).cast(),
            libc::socklen_t::try_from(std::mem::size_of::<libc::linger>()).unwrap_or(8),
        );
    }
}

fn reason_phrase(status: u16) -> &'static str {
    match status {
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        429 => "Too Many Requests",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ if status >= 500 => "Internal Server Error",
        _ => "Error",
    }
}

/// Sends the request to `upstream` on a new connection (`Connection: close`)
/// and returns the response re-framed with `Content-Length`.
fn forward(upstream: SocketAddr, head: &Head, body: &[u8]) -> io::Result<Vec<u8>> {
    let stream = TcpStream::connect_timeout(&upstream, UPSTREAM_CONNECT_TIMEOUT)?;
    stream.set_read_timeout(Some(UPSTREAM_READ_TIMEOUT))?;
    stream.set_write_timeout(Some(UPSTREAM_READ_TIMEOUT))?;
    let mut request = Vec::with_capacity(body.len() + 1024);
    request.extend_from_slice(head.start_line.as_bytes());
    request.extend_from_slice(b"\r\n");
    for (name, value) in &head.headers {
        if !is_hop_by_hop(name) && !name.eq_ignore_ascii_case("expect") {
            request.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
        }
    }
    request.extend_from_slice(
        format!(
            "Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        )
        .as_bytes(),
    );
    request.extend_from_slice(body);
    let mut upstream_conn = HttpConn::new(stream);
    upstream_conn.stream.write_all(&request)?;

    let is_head = head.start_line.starts_with("HEAD ");
    let resp_head = loop {
        let h = upstream_conn.read_head()?.ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "upstream closed without a response",
            )
        })?;
        // Skip interim responses (100 Continue and the like).
        if !h
            .start_line
            .split(' ')
            .nth(1)
            .is_some_and(|s| s.starts_with('1'))
        {
            break h;
        }
    };
    let status = resp_head.start_line.split(' ').nth(1).unwrap_or("");
    let bodyless = is_head || status == "204" || status == "304";
    let resp_body = if bodyless {
        Vec::new()
    } else {
        upstream_conn.read_body(&resp_head, true)?
    };
    let mut response = Vec::with_capacity(resp_body.len() + 1024);
    response.extend_from_slice(resp_head.start_line.as_bytes());
    response.extend_from_slice(b"\r\n");
    for (name, value) in &resp_head.headers {
        let keep = if is_head {
            !name.eq_ignore_ascii_case("connection") && !name.eq_ignore_ascii_case("keep-alive")
        } else {
            !is_hop_by_hop(name)
        };
        if keep {
            response.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
        }
    }
    if !is_head {
        response.extend_from_slice(format!("Content-Length: {}\r\n", resp_body.len()).as_bytes());
    }
    response.extend_from_slice(b"\r\n");
    response.extend_from_slice(&resp_body);
    Ok(response)
}

/// A `PublishBatch` form body without the entries whose message holds
/// `marker` (the others renumbered from 1), and the ids of those taken out.
fn without_marked_entries(body: &[u8], marker: &str) -> (String, Vec<String>) {
    const MEMBER: &str = "PublishBatchRequestEntries.member.";
    let body = String::from_utf8_lossy(body);
    let mut others = Vec::new();
    let mut members: std::collections::BTreeMap<u32, Vec<(String, String)>> =
        std::collections::BTreeMap::new();
    for pair in body.split('&') {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key
            .strip_prefix(MEMBER)
            .and_then(|rest| rest.split_once('.'))
            .and_then(|(n, field)| Some((n.parse::<u32>().ok()?, field)))
        {
            Some((n, field)) => members
                .entry(n)
                .or_default()
                .push((field.to_owned(), value.to_owned())),
            None => others.push(pair.to_owned()),
        }
    }
    let mut failed = Vec::new();
    let mut kept = 0;
    for fields in members.values() {
        let marked = fields
            .iter()
            .any(|(field, value)| field == "Message" && value.contains(marker));
        if marked {
            if let Some((_, id)) = fields.iter().find(|(field, _)| field == "Id") {
                failed.push(id.clone());
            }
            continue;
        }
        kept += 1;
        for (field, value) in fields {
            others.push(format!("{MEMBER}{kept}.{field}={value}"));
        }
    }
    (others.join("&"), failed)
}

/// `answer` (a `PublishBatch` answer) with `ids` listed as failed entries of
/// `code`, sender's fault.
fn with_failed_entries(answer: Vec<u8>, ids: &[String], code: &str) -> Vec<u8> {
    let Some(split) = find(&answer, b"\r\n\r\n") else {
        return answer;
    };
    let (head, body) = (&answer[..split], &answer[split + 4..]);
    let body = String::from_utf8_lossy(body);
    let failed: String = ids
        .iter()
        .map(|id| {
            format!(
                "<member><Id>{id}</Id><Code>{code}</Code><Message>refused by the fault proxy</Message>\
                 <SenderFault>true</SenderFault></member>"
            )
        })
        .collect();
    let body = body.replacen(
        "<PublishBatchResult>",
        &format!("<PublishBatchResult><Failed>{failed}</Failed>"),
        1,
    );
    let mut out = String::new();
    for line in String::from_utf8_lossy(head).split("\r\n") {
        if line.to_ascii_lowercase().starts_with("content-length:") {
            out.push_str(&format!("Content-Length: {}\r\n", body.len()));
        } else {
            out.push_str(line);
            out.push_str("\r\n");
        }
    }
    out.push_str("\r\n");
    out.push_str(&body);
    out.into_bytes()
}

/// Headers that describe one connection's framing, not the message.
fn is_hop_by_hop(name: &str) -> bool {
    [
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "content-length",
        "te",
        "trailer",
        "upgrade",
    ]
    .iter()
    .any(|h| name.eq_ignore_ascii_case(h))
}

/// An AWS error answer in the protocol of the request.
fn error_response(request: &Head, status: u16, kind: &str, code: &str, message: &str) -> Vec<u8> {
    let reason = reason_phrase(status);
    let request_id = request_id();
    if request.get("x-amz-target").is_some() {
        // AWS JSON 1.0 with awsQueryCompatible (SQS): the SDK takes the code
        // from x-amzn-query-error.
        let body = serde_json::json!({
            "__type": format!("com.amazonaws.sqs#{code}"),
            "message": message,
        })
        .to_string();
        simple_response(
            status,
            reason,
            "application/x-amz-json-1.0",
            &[
                ("x-amzn-query-error", format!("{code};{kind}")),
                ("x-amzn-RequestId", request_id),
            ],
            body.as_bytes(),
        )
    } else {
        let body = format!(
            "<ErrorResponse xmlns=\"http://sns.amazonaws.com/doc/2010-03-31/\">\
             <Error><Type>{kind}</Type><Code>{code}</Code><Message>{message}</Message></Error>\
             <RequestId>{request_id}</RequestId></ErrorResponse>"
        );
        simple_response(
            status,
            reason,
            "text/xml",
            &[("x-amzn-RequestId", request_id)],
            body.as_bytes(),
        )
    }
}

/// The proxy's answer when the upstream cannot be reached.
fn bad_gateway(upstream: SocketAddr, error: &dyn fmt::Display) -> Vec<u8> {
    simple_response(
        502,
        "Bad Gateway",
        "text/plain",
        &[],
        format!("FaultProxy: upstream {upstream}: {error}\n").as_bytes(),
    )
}

fn simple_response(
    status: u16,
    reason: &str,
    content_type: &str,
    headers: &[(&str, String)],
    body: &[u8],
) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        out.push_str(&format!("{name}: {value}\r\n"));
    }
    out.push_str("\r\n");
    let mut out = out.into_bytes();
    out.extend_from_slice(body);
    out
}

/// Inserts `Connection: close` after the status line.
fn with_connection_close(response: Vec<u8>) -> Vec<u8> {
    match find(&response, b"\r\n") {
        Some(i) => {
            let mut out = Vec::with_capacity(response.len() + 19);
            out.extend_from_slice(&response[..i + 2]);
            out.extend_from_slice(b"Connection: close\r\n");
            out.extend_from_slice(&response[i + 2..]);
            out
        }
        None => response,
    }
}

fn request_id() -> String {
    let a = fastrand::u64(..);
    let b = fastrand::u64(..);
    format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xffff,
        b >> 48,
        b & 0xffff_ffff_ffff
    )
}

/// `Action` of a Query-protocol form body, or the operation of `X-Amz-Target`.
fn action_of(head: &Head, body: &[u8]) -> String {
    if let Some(target) = head.get("x-amz-target") {
        return target.rsplit('.').next().unwrap_or(target).to_owned();
    }
    let query = head
        .start_line
        .split(' ')
        .nth(1)
        .and_then(|target| target.split_once('?'))
        .map_or("", |(_, q)| q);
    let body = std::str::from_utf8(body).unwrap_or("");
    query
        .split('&')
        .chain(body.split('&'))
        .find_map(|pair| pair.strip_prefix("Action="))
        .map_or_else(|| "?".to_owned(), ToOwned::to_owned)
}

/// A request or response head.
struct Head {
    start_line: String,
    headers: Vec<(String, String)>,
}

impl Head {
    fn parse(raw: &[u8]) -> io::Result<Head> {
        let text = String::from_utf8_lossy(raw);
        let mut lines = text.split("\r\n");
        let start_line = lines.next().unwrap_or_default().to_owned();
        if start_line.is_empty() {
            return Err(invalid("empty start line"));
        }
        let mut headers = Vec::new();
        for line in lines.filter(|l| !l.is_empty()) {
            let (name, value) = line
                .split_once(':')
                .ok_or_else(|| invalid(&format!("bad header line {line:?}")))?;
            headers.push((name.trim().to_owned(), value.trim().to_owned()));
        }
        Ok(Head {
            start_line,
            headers,
        })
    }

    fn get(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Whether any `name` header lists `token` (comma-separated, any case).
    fn has_token(&self, name: &str, token: &str) -> bool {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .flat_map(|(_, v)| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case(token))
    }
}

fn invalid(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.to_owned())
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// A stream with a read buffer, for parsing HTTP/1.1 messages.
struct HttpConn {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl HttpConn {
    fn new(stream: TcpStream) -> HttpConn {
        HttpConn {
            stream,
            buf: Vec::new(),
        }
    }

    /// Reads more bytes into the buffer; 0 at EOF.
    fn fill(&mut self) -> io::Result<usize> {
        let mut chunk = [0u8; 16 * 1024];
        let n = loop {
            match self.stream.read(&mut chunk) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                other => break other?,
            }
        };
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(n)
    }

    /// The next head, or `None` at a clean EOF before it.
    fn read_head(&mut self) -> io::Result<Option<Head>> {
        let mut scanned = 0;
        loop {
            if let Some(i) = find(&self.buf[scanned..], b"\r\n\r\n") {
                let end = scanned + i + 4;
                let head = Head::parse(&self.buf[..end - 4])?;
                self.buf.drain(..end);
                return Ok(Some(head));
            }
            scanned = self.buf.len().saturating_sub(3);
            if self.buf.len() > MAX_HEAD {
                return Err(invalid("head too large"));
            }
            if self.fill()? == 0 {
                return if self.buf.is_empty() {
                    Ok(None)
                } else {
                    Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "EOF inside a head",
                    ))
                };
            }
        }
    }

    /// The body after `head`: chunked (decoded), `Content-Length`, or — for a
    /// response without either (`until_eof`) — everything up to EOF.
    fn read_body(&mut self, head: &Head, until_eof: bool) -> io::Result<Vec<u8>> {
        if head.has_token("transfer-encoding", "chunked") {
            return self.read_chunked();
        }
        if let Some(len) = head.get("content-length") {
            let len: usize = len
                .parse()
                .map_err(|_| invalid(&format!("bad Content-Length {len:?}")))?;
            return self.take(len);
        }
        if until_eof {
            while self.fill()? > 0 {}
            return Ok(std::mem::take(&mut self.buf));
        }
        Ok(Vec::new())
    }

    fn take(&mut self, len: usize) -> io::Result<Vec<u8>> {
        while self.buf.len() < len {
            if self.fill()? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "EOF inside a body",
                ));
            }
        }
        Ok(self.buf.drain(..len).collect())
    }

    fn read_line(&mut self) -> io::Result<String> {
        loop {
            if let Some(i) = find(&self.buf, b"\r\n") {
                let line = String::from_utf8_lossy(&self.buf[..i]).into_owned();
                self.buf.drain(..i + 2);
                return Ok(line);
            }
            if self.buf.len() > MAX_HEAD {
                return Err(invalid("line too long"));
            }
            if self.fill()? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "EOF inside a chunk",
                ));
            }
        }
    }

    fn read_chunked(&mut self) -> io::Result<Vec<u8>> {
        let mut body = Vec::new();
        loop {
            let line = self.read_line()?;
            let size = line.split(';').next().unwrap_or("").trim();
            let size = usize::from_str_radix(size, 16)
                .map_err(|_| invalid(&format!("bad chunk size {line:?}")))?;
            if size == 0 {
                // Trailers, up to the empty line.
                while !self.read_line()?.is_empty() {}
                return Ok(body);
            }
            body.extend(self.take(size)?);
            if !self.read_line()?.is_empty() {
                return Err(invalid("no CRLF after a chunk"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-shot upstream answering with `response` (raw bytes); returns the
    /// request it received.
    fn upstream_once(response: &'static [u8]) -> (String, JoinHandle<Vec<u8>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let handle = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut conn = HttpConn::new(stream);
            let head = conn.read_head().unwrap().unwrap();
            let body = conn.read_body(&head, false).unwrap();
            conn.stream.write_all(response).unwrap();
            let mut seen = head.start_line.into_bytes();
            for (n, v) in head.headers {
                seen.extend_from_slice(format!("\n{n}: {v}").as_bytes());
            }
            seen.extend_from_slice(b"\n\n");
            seen.extend(body);
            seen
        });
        (url, handle)
    }

    fn roundtrip(proxy: &FaultProxy, request: &[u8]) -> String {
        let mut s = TcpStream::connect(proxy.addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(request).unwrap();
        let mut conn = HttpConn::new(s);
        let head = conn.read_head().unwrap().unwrap();
        let body = conn.read_body(&head, false).unwrap();
        format!("{}\n{}", head.start_line, String::from_utf8_lossy(&body))
    }

    #[test]
    fn chunked_requests_and_eof_framed_responses_are_forwarded_with_content_length() {
        let (url, upstream) = upstream_once(b"HTTP/1.1 200 OK\r\nX-A: 1\r\n\r\nhello world");
        let proxy = FaultProxy::start(&url);
        let answer = roundtrip(
            &proxy,
            b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n\
              5\r\nAct=1\r\n6\r\n&b=two\r\n0\r\n\r\n",
        );
        assert_eq!(answer, "HTTP/1.1 200 OK\nhello world");
        let seen = String::from_utf8(upstream.join().unwrap()).unwrap();
        assert!(seen.contains("Content-Length: 11"), "{seen}");
        assert!(seen.contains("Connection: close"), "{seen}");
        assert!(
            !seen.to_ascii_lowercase().contains("transfer-encoding"),
            "{seen}"
        );
        assert!(seen.ends_with("Act=1&b=two"), "{seen}");
        assert_eq!(proxy.requests_seen(), 1);
    }

    #[test]
    fn throttle_mode_answers_with_a_query_protocol_error_and_keeps_the_connection() {
        let proxy = FaultProxy::start("http://127.0.0.1:9");
        proxy.set_mode(Mode::Throttle);
        let mut s = TcpStream::connect(proxy.addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut conn = HttpConn::new(s.try_clone().unwrap());
        for _ in 0..2 {
            s.write_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 14\r\n\r\nAction=Publish")
                .unwrap();
            let head = conn.read_head().unwrap().unwrap();
            let body = String::from_utf8(conn.read_body(&head, false).unwrap()).unwrap();
            assert_eq!(head.start_line, "HTTP/1.1 400 Bad Request");
            assert_eq!(head.get("content-type"), Some("text/xml"));
            assert!(body.contains("<Code>Throttling</Code>"), "{body}");
        }
        assert_eq!(proxy.faults_injected(), 2);
        assert_eq!(proxy.actions(), ["Publish", "Publish"]);
    }
}
