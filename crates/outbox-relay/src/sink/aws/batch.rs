//! Batches of entries to one AWS destination (SNS `PublishBatch` over the
//! Query protocol; SQS `SendMessageBatch`, EventBridge `PutEvents`, Kinesis
//! `PutRecords` over AWS JSON): what is the same for all of them, once. A
//! destination's folder says only how an entry is written and counted and
//! how an answer lists the entries ([`Protocol`], whose [`Wire`] says how a
//! call is made and a refusal read).
//!
//! * A batch (one destination) is split into requests of at most
//!   [`Protocol::MAX_ENTRIES`] entries and [`Protocol::MAX_REQUEST_BYTES`],
//!   counted as the service counts (and, where [`Protocol::one_per_group`]
//!   says so, one entry of each ordering group); an entry over the
//!   destination's limit alone is rejected before anything is sent, unless
//!   the [`Gate`] stores it elsewhere and a stand-in goes in its place (SNS's
//!   claim check), or the limit is not known yet (then it is retried).
//! * Requests go one after the other; once one is to be retried, the later
//!   ones are not sent (retried with it), so no entry overtakes an earlier one.
//! * Every refusal is classified by its typed parts ([`crate::sink::aws::errors`]):
//!   a missing destination rejects every entry; a request refused for a
//!   reason one entry could cause is narrowed (each entry sent alone, in
//!   order) so only the culprit is rejected; access errors are logged as
//!   errors and retried; load (throttling, 5xx, timeouts) is retried with
//!   its [`Cause`], so the publisher's concurrency limit backs off.
//! * An entry that failed for a reason nobody classified is retried for the
//!   sink's `retry_unknown_errors_for`, then recorded ([`UnknownSince`]).
//! * Nothing that may have reached the service is sent again here: the
//!   publisher retries, and keeps each group in order (after a partial
//!   failure the failed entry and the later ones of its group go again).
//!   The one exception is the gate's: an entry refused that only a learned
//!   limit let through is retried when the gate learns the limit again
//!   ([`Gate::relearn`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use aws_smithy_runtime_api::client::identity::Identity;
use hyper::StatusCode;

use super::errors::{self, Class, UnknownSince};
use super::{json, query, CallError, Client, Request};
use crate::pipeline::sink::{Cause, Concurrency, Message, Outcome, Sink, Source};

/// How a destination writes, counts and reads back the entries of a batch.
pub trait Protocol: Send + Sync + 'static {
    /// What a destination is, in messages: "queue", "event bus", "stream".
    const WHAT: &'static str;
    /// The operation: for the JSON protocols its `X-Amz-Target`
    /// (`AmazonSQS.SendMessageBatch`); a Query protocol's body names it.
    const TARGET: &'static str;
    /// `Content-Type` ([`json::JSON_10`] or [`json::JSON_11`]; a form's for
    /// the Query protocol).
    const CONTENT_TYPE: &'static str;
    /// How calls are made and refusals read.
    const WIRE: Wire = Wire::Json;
    /// Most entries in one request.
    const MAX_ENTRIES: usize;
    /// Most bytes of one request's entries, as the service counts them.
    const MAX_REQUEST_BYTES: usize;

    /// The size of `message`'s entry as the service counts it, or why the
    /// service can never take it.
    fn size(&self, message: &Message) -> Result<usize, String>;

    /// The body of a request of `entries` to `destination`; an entry's id,
    /// where the protocol has ids, is its position in `entries`.
    fn body(&self, destination: &str, entries: &[&Message]) -> Vec<u8>;

    /// Each entry's answer, by position, from a successful call's body
    /// (`None`: the answer does not mention it).
    fn answers(&self, body: &[u8], entries: usize) -> Result<Vec<Option<Answer>>, String>;

    /// What is said of an entry a successful answer does not mention.
    const UNMENTIONED: &'static str = "the answer does not mention the entry";

    /// The size of `entry` as the service counts it. Only a protocol whose
    /// gate stores entries elsewhere ([`Gate::offload`]) sees stand-ins and
    /// says how they count; for the others this is [`Protocol::size`].
    fn entry_size(&self, entry: Entry<'_>) -> Result<usize, String> {
        self.size(entry.message)
    }

    /// The body of a request of `entries` to `destination`: as
    /// [`Protocol::entry_size`] is to [`Protocol::size`], so this is to
    /// [`Protocol::body`].
    fn entry_body(&self, destination: &str, entries: &[Entry<'_>]) -> Vec<u8> {
        let messages: Vec<&Message> = entries.iter().map(|entry| entry.message).collect();
        self.body(destination, &messages)
    }

    /// Most bytes of one request to a destination whose entries take at
    /// most `limit`: [`Protocol::MAX_REQUEST_BYTES`], unless the service
    /// holds a whole request to the destination's limit (SNS).
    fn max_request_bytes(&self, limit: usize) -> usize {
        let _ = limit;
        Self::MAX_REQUEST_BYTES
    }

    /// Why an entry of `size` bytes is rejected where `limit` is the most
    /// the destination takes.
    fn too_large(&self, size: usize, limit: usize) -> String {
        format!(
            "message too large: {size} bytes as the service counts them; the {} takes at most {limit}",
            Self::WHAT
        )
    }

    /// Log `alarm` about `destination` with `error` (every attempt, at error
    /// level: an operator fixes it), in the service's words.
    fn alarm(&self, alarm: Alarm, destination: &str, error: &str) {
        alarm.log(destination, error);
    }

    /// Whether a request to `destination` holds at most one entry of each
    /// ordering group. Where the service may take a later entry of a request
    /// and fail an earlier one of the same group, and its consumers rely on
    /// the order of a group (a Kinesis shard, an SQS FIFO queue), this is what
    /// keeps each group in order: the later entry is then never sent before
    /// the earlier one is taken. The price is one entry per group per round
    /// trip. The sink tells the publisher to form batches of one message a
    /// group ([`Sink::max_run`]) so that a batch is one request; a batch that
    /// holds a group twice all the same is sent as several requests, one
    /// after the other.
    fn one_per_group(&self, destination: &str) -> bool {
        let _ = destination;
        false
    }
}

/// The AWS protocol a service speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wire {
    /// AWS JSON 1.0 or 1.1 ([`json`]): the operation in `X-Amz-Target`,
    /// answers and errors in JSON.
    Json,
    /// The AWS Query protocol ([`query`]): a form naming its `Action`,
    /// answers and errors in XML.
    Query,
}

impl Wire {
    /// A call of `operation` (named by `target`, [`json::target`]) with `body`.
    fn request<'a>(
        self,
        content_type: &'static str,
        target: &'a [(hyper::header::HeaderName, hyper::header::HeaderValue)],
        body: Vec<u8>,
    ) -> Request<'a> {
        match self {
            Self::Json => json::request(content_type, target, body),
            Self::Query => Request {
                content_type,
                ..Request::form(body)
            },
        }
    }

    /// The error code and message of a refusal's `body`.
    fn parse_error(self, body: &[u8]) -> Option<(String, Option<String>)> {
        match self {
            Self::Json => json::parse_error(body),
            Self::Query => query::parse_error(body),
        }
    }

    /// The request id a refusal's `body` names, for its reason (AWS support
    /// asks for it); the JSON protocols name it in a header only.
    fn request_id(self, body: &[u8]) -> Option<&str> {
        match self {
            Self::Json => None,
            Self::Query => query::request_id(body),
        }
    }
}

/// One entry of a request: a message, and the body sent in its place when
/// the gate stored the message elsewhere ([`Gate::offload`]).
#[derive(Debug, Clone, Copy)]
pub struct Entry<'a> {
    /// The message.
    pub message: &'a Message,
    /// What is sent instead of its body, if anything.
    pub stand_in: Option<&'a str>,
}

impl<'a> Entry<'a> {
    /// `message` as it is.
    pub fn plain(message: &'a Message) -> Self {
        Self {
            message,
            stand_in: None,
        }
    }
}

/// What the loop logs at error level on every attempt (the entries are
/// retried; an operator fixes the cause).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alarm {
    /// The credential chain gave no credentials.
    NoCredentials,
    /// A request could not be signed.
    Signing,
    /// The service refused the credentials or permissions.
    Refused,
}

impl Alarm {
    /// Log it in the AWS layer's words, naming `destination`.
    pub fn log(self, destination: &str, error: &str) {
        match self {
            Self::NoCredentials => {
                tracing::error!(destination, error = %error, "the AWS credential chain gave no credentials; retrying")
            }
            Self::Signing => {
                tracing::error!(destination, error = %error, "cannot sign the requests; retrying")
            }
            Self::Refused => {
                tracing::error!(destination, error = %error, "AWS refused the credentials or permissions; retrying")
            }
        }
    }
}

/// Why a question to the service ([`Batches::ask`]) got no answer.
#[derive(Debug)]
pub enum Question {
    /// The destination does not exist.
    Missing(String),
    /// The service refused to tell (a denied permission, a call the
    /// endpoint lacks).
    Refused(String),
    /// No answer now (network, throttling, 5xx, expired or unknown
    /// credentials, a bad signature).
    Unanswered(String),
}

/// What the service said of one entry of a successful call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Taken.
    Accepted,
    /// Not taken.
    Failed {
        /// The entry's error code.
        code: String,
        /// Its message.
        message: Option<String>,
        /// Whether the service says the entry is at fault (SQS's `SenderFault`).
        sender_fault: Option<bool>,
    },
}

/// One entry's result in an answer that lists them in request order
/// (EventBridge `Entries`, Kinesis `Records`): an error code, or the id the
/// service gave the entry.
#[derive(Debug, serde::Deserialize)]
pub(crate) struct Positional {
    /// The entry's error code, when it failed.
    #[serde(rename = "ErrorCode")]
    pub error_code: Option<String>,
    /// Its error message.
    #[serde(rename = "ErrorMessage")]
    pub error_message: Option<String>,
    /// The id the service gave it (`EventId`, `SequenceNumber`), when taken.
    #[serde(alias = "EventId", alias = "SequenceNumber")]
    pub id: Option<String>,
}

/// The answers of `results`, by position, for `entries` entries (those the
/// answer does not list: `None`).
pub(crate) fn positional(results: Vec<Positional>, entries: usize) -> Vec<Option<Answer>> {
    let mut answers: Vec<Option<Answer>> = results
        .into_iter()
        .take(entries)
        .map(|result| match (result.error_code, result.id) {
            (Some(code), _) if !code.is_empty() => Some(Answer::Failed {
                code,
                message: result.error_message,
                sender_fault: None,
            }),
            (_, Some(_)) => Some(Answer::Accepted),
            _ => None,
        })
        .collect();
    answers.resize(entries, None);
    answers
}

/// What becomes of one message before it is an [`Outcome`]: the class of a
/// failure is kept until the batch is settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Taken by the destination.
    Delivered,
    /// Never acceptable.
    Rejected(String),
    /// To be sent again.
    Retry(Class, String),
}

/// Sends batches to one service's destinations with `P`.
pub struct Batches<P> {
    client: Client,
    protocol: P,
    operation_timeout: Duration,
    unknown: UnknownSince,
}

impl<P: Protocol> Batches<P> {
    /// Batches through `client`; each call bounded by `operation_timeout`;
    /// unknown failures retried for `retry_unknown_for`.
    pub fn new(
        client: Client,
        protocol: P,
        operation_timeout: Duration,
        retry_unknown_for: Duration,
    ) -> Self {
        Self {
            client,
            protocol,
            operation_timeout,
            unknown: UnknownSince::new(retry_unknown_for),
        }
    }

    /// Ask the service `operation` (a question about a destination, not a
    /// batch) with `body` (as the protocol's [`Wire`] writes it), within the
    /// operation timeout: the answer when it came with a success, else why
    /// not ([`Question`]).
    pub async fn ask(
        &self,
        operation: &'static str,
        body: Vec<u8>,
    ) -> Result<bytes::Bytes, Question> {
        self.question(operation, body)
            .await
            .map_err(|(_, question)| question)
    }

    /// [`Batches::ask`], with the class of a failure, for a caller that
    /// retries entries by it (throttling, an outage, credentials).
    pub async fn question(
        &self,
        operation: &'static str,
        body: Vec<u8>,
    ) -> Result<bytes::Bytes, (Class, Question)> {
        let identity = self
            .client
            .identity()
            .await
            .map_err(|e| (Class::Access, Question::Unanswered(e.to_string())))?;
        let (status, body) = self
            .call(&identity, operation, body)
            .await
            .map_err(|e| (Class::of(&e), Question::Unanswered(e.to_string())))?;
        if status.is_success() {
            return Ok(body);
        }
        let (class, code, reason) = self.refusal(status, &body);
        let reason = format!(
            "{}: {reason}",
            operation.rsplit('.').next().unwrap_or(operation)
        );
        let code = code.as_deref();
        Err((
            class,
            match class {
                Class::Missing => Question::Missing(reason),
                // Only a denied permission or a call the endpoint does not know
                // is an answer worth keeping; expired or unknown credentials, a
                // bad signature or a skewed clock are asked about again soon.
                Class::Access if code.is_some_and(errors::permission_denied) => {
                    Question::Refused(reason)
                }
                Class::Invalid if code.is_some() => Question::Refused(reason),
                Class::Access => {
                    if code.is_some_and(errors::stale_credentials) {
                        self.client.forget_credentials().await;
                    }
                    Question::Unanswered(reason)
                }
                _ => Question::Unanswered(reason),
            },
        ))
    }

    /// One call of `operation` with `body`, signed with `identity`,
    /// within the operation timeout: the answer's status and body.
    async fn call(
        &self,
        identity: &Identity,
        operation: &'static str,
        body: Vec<u8>,
    ) -> Result<(StatusCode, bytes::Bytes), CallError> {
        let target = json::target(operation);
        let call = self
            .client
            .send(identity, P::WIRE.request(P::CONTENT_TYPE, &target, body));
        match tokio::time::timeout(self.operation_timeout, call).await {
            Ok(answer) => answer,
            Err(_) => Err(CallError::Timeout {
                endpoint: self.client.endpoint().to_owned(),
                timeout: self.operation_timeout,
            }),
        }
    }

    /// What a refusal (an answer of `status` other than success, with
    /// `body`) says: its class, the service's error code, and a reason.
    fn refusal(&self, status: StatusCode, body: &[u8]) -> (Class, Option<String>, String) {
        errors::refusal(
            status,
            self.client.endpoint(),
            body,
            P::WIRE.parse_error(body),
        )
    }

    /// Deliver `batch` (one destination) with entries of at most `limit`
    /// bytes and no gate; one outcome per message, in order.
    #[cfg(test)]
    pub async fn publish(&self, batch: &[Message], limit: usize) -> Vec<Outcome> {
        self.deliver(batch, Admission::sure(limit), &Fixed(limit))
            .await
    }

    /// Deliver `batch` (one destination) as `admission` says, with `gate`'s
    /// hooks for entries over the limit and for refusals; one outcome per
    /// message, in order.
    pub async fn deliver<G: Gate<P>>(
        &self,
        batch: &[Message],
        admission: Admission,
        gate: &G,
    ) -> Vec<Outcome> {
        let Some(first) = batch.first() else {
            return Vec::new();
        };
        let destination = &*first.destination;
        let mut round = Round {
            verdicts: vec![None; batch.len()],
            sizes: vec![None; batch.len()],
            stand_ins: vec![None; batch.len()],
        };
        let over = self.measure(batch, admission.limit, &mut round);
        self.over_limit(batch, &admission, gate, over, &mut round)
            .await;
        let Round {
            mut verdicts,
            sizes,
            stand_ins,
        } = round;
        for request in self.requests(destination, batch, admission.limit, &sizes) {
            // An earlier request is to be sent again: later ones wait unsent,
            // so nothing overtakes it.
            if !retrying(&verdicts) {
                let entries = (batch, &stand_ins[..]);
                self.send(destination, entries, &request, &mut verdicts)
                    .await;
            }
        }
        retry_relearned(gate, destination, &sizes, &mut verdicts);
        settle(&self.unknown, batch, verdicts)
    }

    /// Each message's size as the service counts it, kept in `round` for
    /// those within `limit`; a message the service can never take is
    /// rejected; the others (index and size) are over the limit.
    fn measure(&self, batch: &[Message], limit: usize, round: &mut Round) -> Vec<(usize, usize)> {
        let mut over = Vec::new();
        for (i, message) in batch.iter().enumerate() {
            debug_assert_eq!(
                *message.destination, *batch[0].destination,
                "one destination per batch"
            );
            match self.protocol.entry_size(Entry::plain(message)) {
                Ok(size) if size > limit => over.push((i, size)),
                Ok(size) => round.sizes[i] = Some(size),
                Err(reason) => round.verdicts[i] = Some(Verdict::Rejected(reason)),
            }
        }
        over
    }

    /// The messages over the limit (`over`: index and size): retried while
    /// the limit is not known ([`Admission::unsure`]), else stored elsewhere
    /// by the gate and sent as their stand-ins ([`Gate::offload`]), else
    /// rejected as too large. A failure to store one holds the batch: nothing
    /// is sent before its payload is stored, and every undecided message is
    /// retried with that failure.
    async fn over_limit<G: Gate<P>>(
        &self,
        batch: &[Message],
        admission: &Admission,
        gate: &G,
        over: Vec<(usize, usize)>,
        round: &mut Round,
    ) {
        let limit = admission.limit;
        for (i, size) in over {
            if let Some((class, reason)) = &admission.unsure {
                round.verdicts[i] = Some(Verdict::Retry(*class, reason.clone()));
                continue;
            }
            let stand_in = match gate.offload(&batch[i]).await {
                None => {
                    let reason = self.protocol.too_large(size, limit);
                    round.verdicts[i] = Some(Verdict::Rejected(reason));
                    continue;
                }
                Some(Ok(stand_in)) => stand_in,
                Some(Err((class, reason))) => {
                    for verdict in round.verdicts.iter_mut().filter(|v| v.is_none()) {
                        *verdict = Some(Verdict::Retry(class, reason.clone()));
                    }
                    round.sizes.fill(None);
                    return;
                }
            };
            let entry = Entry {
                message: &batch[i],
                stand_in: Some(&stand_in),
            };
            match self.protocol.entry_size(entry) {
                Ok(size) if size > limit => {
                    round.verdicts[i] =
                        Some(Verdict::Rejected(self.protocol.too_large(size, limit)));
                }
                Ok(size) => {
                    round.sizes[i] = Some(size);
                    round.stand_ins[i] = Some(stand_in);
                }
                Err(reason) => round.verdicts[i] = Some(Verdict::Rejected(reason)),
            }
        }
    }

    /// The requests the messages of `sizes` (index: size; `None` for those
    /// not sent) make, in order: at most [`Protocol::MAX_ENTRIES`] and
    /// [`Protocol::max_request_bytes`] a request, and where
    /// [`Protocol::one_per_group`] says so one message of each group.
    fn requests(
        &self,
        destination: &str,
        batch: &[Message],
        limit: usize,
        sizes: &[Option<usize>],
    ) -> Vec<Vec<usize>> {
        let max_bytes = self.protocol.max_request_bytes(limit);
        let one_per_group = self.protocol.one_per_group(destination);
        let mut groups = std::collections::HashSet::new();
        let mut requests: Vec<Vec<usize>> = Vec::new();
        let mut request = Vec::new();
        let mut bytes = 0;
        for (i, size) in sizes.iter().enumerate() {
            let Some(size) = *size else { continue };
            let group = batch[i].event.group();
            let group_again = one_per_group && !groups.insert(group);
            let full = request.len() == P::MAX_ENTRIES || bytes + size > max_bytes;
            if !request.is_empty() && (full || group_again) {
                requests.push(std::mem::take(&mut request));
                bytes = 0;
                groups.clear();
                groups.insert(group);
            }
            request.push(i);
            bytes += size;
        }
        if !request.is_empty() {
            requests.push(request);
        }
        requests
    }

    /// Send one request of the messages of `batch` at `indices` (each as
    /// itself or its stand-in); fill their verdicts.
    async fn send(
        &self,
        destination: &str,
        (batch, stand_ins): (&[Message], &[Option<String>]),
        indices: &[usize],
        verdicts: &mut [Option<Verdict>],
    ) {
        // Outside the call's timeout: a credential fetch is bounded by the
        // providers' own timeouts and must not be cut off halfway.
        let identity = match self.client.identity().await {
            Ok(identity) => identity,
            Err(error) => {
                let reason = error.to_string();
                self.protocol
                    .alarm(Alarm::NoCredentials, destination, &reason);
                retry_all(indices, verdicts, Class::Access, &reason);
                return;
            }
        };
        let entries: Vec<Entry<'_>> = indices
            .iter()
            .map(|&i| Entry {
                message: &batch[i],
                stand_in: stand_ins[i].as_deref(),
            })
            .collect();
        let body = self.protocol.entry_body(destination, &entries);
        let (status, body) = match self.call(&identity, P::TARGET, body).await {
            Ok(answer) => answer,
            Err(error) => {
                let reason = error.to_string();
                if let CallError::Signing(_) = error {
                    self.protocol.alarm(Alarm::Signing, destination, &reason);
                }
                retry_all(indices, verdicts, Class::of(&error), &reason);
                return;
            }
        };
        if status.is_success() {
            self.read_answers(destination, &body, indices, verdicts);
            return;
        }
        let (class, code, mut reason) = self.refusal(status, &body);
        if code.is_some() {
            if let Some(id) = P::WIRE.request_id(&body) {
                reason.push_str(&format!(" (request id {id})"));
            }
        }
        match class {
            Class::Missing => {
                let reason = missing::<P>(destination, &reason);
                for &i in indices {
                    verdicts[i] = Some(Verdict::Rejected(reason.clone()));
                }
            }
            _ if class.narrows() && indices.len() > 1 => {
                // Find the culprit: each entry alone, in order; after a
                // failure that is retried the rest wait unsent, so nothing
                // overtakes it.
                for &i in indices {
                    if retrying(verdicts) {
                        break;
                    }
                    Box::pin(self.send(destination, (batch, stand_ins), &[i], verdicts)).await;
                }
            }
            Class::Invalid => {
                for &i in indices {
                    verdicts[i] = Some(Verdict::Rejected(reason.clone()));
                }
            }
            Class::Access => {
                self.protocol.alarm(Alarm::Refused, destination, &reason);
                if code.as_deref().is_some_and(errors::stale_credentials) {
                    self.client.forget_credentials().await;
                }
                retry_all(indices, verdicts, class, &reason);
            }
            _ => retry_all(indices, verdicts, class, &reason),
        }
    }

    /// The verdicts a successful call's answer gives the entries at `indices`.
    fn read_answers(
        &self,
        destination: &str,
        body: &[u8],
        indices: &[usize],
        verdicts: &mut [Option<Verdict>],
    ) {
        let answers = match self.protocol.answers(body, indices.len()) {
            Ok(answers) => answers,
            Err(error) => {
                // A success the relay cannot read (a proxy's page, a service
                // that is not the one configured): the entries may have been
                // taken, and nothing says a retry will do better, so they are
                // retried for `retry_unknown_errors_for`, then recorded.
                let reason = format!("unreadable answer from {}: {error}", self.client.endpoint());
                retry_all(indices, verdicts, Class::Unknown, &reason);
                return;
            }
        };
        for (n, &i) in indices.iter().enumerate() {
            verdicts[i] = Some(match answers.get(n).cloned().flatten() {
                Some(Answer::Accepted) => Verdict::Delivered,
                Some(Answer::Failed {
                    code,
                    message,
                    sender_fault,
                }) => {
                    let reason = format!("{code}: {}", message.as_deref().unwrap_or("no message"));
                    match errors::classify(None, Some(&code), sender_fault) {
                        Class::Missing => Verdict::Rejected(missing::<P>(destination, &reason)),
                        Class::Invalid => Verdict::Rejected(reason),
                        Class::Access => {
                            self.protocol.alarm(Alarm::Refused, destination, &reason);
                            Verdict::Retry(Class::Access, reason)
                        }
                        class => Verdict::Retry(class, reason),
                    }
                }
                None => Verdict::Retry(Class::Unknown, P::UNMENTIONED.into()),
            });
        }
    }
}

/// A batch's messages on their way: each one's verdict once decided, its
/// size when it is to be sent, and what is sent in its place if anything.
struct Round {
    verdicts: Vec<Option<Verdict>>,
    sizes: Vec<Option<usize>>,
    stand_ins: Vec<Option<String>>,
}

/// The rejections of messages the gate's learned limit let through (of
/// `sizes`, as sent) that the gate answers by learning the limit again
/// ([`Gate::relearn`]): those are retried under the new limit.
fn retry_relearned<P, G: Gate<P>>(
    gate: &G,
    destination: &str,
    sizes: &[Option<usize>],
    verdicts: &mut [Option<Verdict>],
) {
    let mut relearning = false;
    for (verdict, size) in verdicts.iter_mut().zip(sizes) {
        let (Some(Verdict::Rejected(reason)), Some(size)) = (&*verdict, *size) else {
            continue;
        };
        if let Some(note) = gate.relearn(destination, size, relearning) {
            relearning = true;
            let reason = format!("{reason} ({note})");
            *verdict = Some(Verdict::Retry(Class::Unknown, reason));
        }
    }
}

/// What a gate admits of a batch: the size limit of its entries, and
/// whether that is only a floor while the real limit is not known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admission {
    /// Entries of at most this many bytes are sent.
    pub limit: usize,
    /// Why the limit is not known now: larger entries are then retried for
    /// it, not rejected (class and reason).
    pub unsure: Option<(Class, String)>,
}

impl Admission {
    /// Entries of at most `limit` bytes; larger ones are over the limit.
    pub fn sure(limit: usize) -> Self {
        Self {
            limit,
            unsure: None,
        }
    }
}

/// What a sink learns of a destination before a batch goes to it: the
/// largest entry the destination takes, or the outcome of every event for it
/// without a call: recorded FAILED (it does not exist) or retried (it could
/// not be verified now). The answer is usually kept a while
/// ([`crate::sink::aws::known::Known`]).
pub trait Gate<P>: Send + Sync + 'static {
    /// `Ok(limit)`: send, entries of at most `limit` bytes; `Err(outcome)`:
    /// every event for `destination` has it, and nothing is sent.
    fn admit(
        &self,
        batches: &Batches<P>,
        destination: &Arc<str>,
    ) -> impl Future<Output = Result<usize, Outcome>> + Send;

    /// [`Gate::admit`], with whether the limit is only a floor for now
    /// ([`Admission::unsure`]). A gate that can be unsure says so here.
    fn admission(
        &self,
        batches: &Batches<P>,
        destination: &Arc<str>,
    ) -> impl Future<Output = Result<Admission, Outcome>> + Send {
        let admit = self.admit(batches, destination);
        async move { admit.await.map(Admission::sure) }
    }

    /// Store `message`, which is over the limit, elsewhere: the body sent in
    /// its place, or why it could not be stored now (class and reason: it is
    /// retried). `None`: the gate stores nothing and the message is rejected
    /// as too large.
    fn offload(
        &self,
        message: &Message,
    ) -> impl Future<Output = Option<Result<String, (Class, String)>>> + Send {
        let _ = message;
        std::future::ready(None)
    }

    /// The service rejected an entry of `size` bytes to `destination` that
    /// the gate's limit let through. `Some(why)`: the limit it learned may be
    /// stale and is learned again, and the entry is retried, its reason
    /// noting why; `None`: the rejection stands. `relearning`: an earlier
    /// entry of the same answer already had the limit learned again, so an
    /// entry the stale limit could explain is retried under the new one too.
    fn relearn(&self, destination: &str, size: usize, relearning: bool) -> Option<&'static str> {
        let _ = (destination, size, relearning);
        None
    }

    /// The events come from `source` ([`Sink::source`]).
    fn source(&self, source: &Source) {
        let _ = source;
    }
}

/// A fixed entry limit, asked of nobody (Kinesis).
pub struct Fixed(pub usize);

impl<P: Sync> Gate<P> for Fixed {
    async fn admit(&self, _: &Batches<P>, _: &Arc<str>) -> Result<usize, Outcome> {
        Ok(self.0)
    }
}

/// A sink that is a batch protocol and a gate: the publisher's concurrency
/// and linger, at most `max_run` messages of a group a batch (SNS, SQS,
/// EventBridge, Kinesis).
pub struct BatchSink<P, G> {
    name: &'static str,
    batches: Batches<P>,
    concurrency: Concurrency,
    linger: Duration,
    gate: G,
    max_run: usize,
}

impl<P: Protocol, G: Gate<P>> BatchSink<P, G> {
    /// The gate, to change in tests.
    #[cfg(test)]
    pub fn gate_mut(&mut self) -> &mut G {
        &mut self.gate
    }

    /// The sink `name` sending with `batches` what `gate` admits, at most
    /// `max_run` messages of a group a batch ([`Sink::max_run`]).
    pub fn assemble(
        name: &'static str,
        batches: Batches<P>,
        (concurrency, linger): (Concurrency, Duration),
        gate: G,
        max_run: usize,
    ) -> Self {
        Self {
            name,
            batches,
            concurrency,
            linger,
            gate,
            max_run,
        }
    }
}

impl<P: Protocol, G: Gate<P>> Sink for BatchSink<P, G> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn max_batch(&self) -> usize {
        P::MAX_ENTRIES
    }

    fn max_run(&self) -> usize {
        self.max_run
    }

    fn concurrency(&self) -> Concurrency {
        self.concurrency
    }

    fn linger(&self) -> Duration {
        self.linger
    }

    fn source(&self, source: &Source) {
        self.gate.source(source);
    }

    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        let Some(first) = batch.first() else {
            return Vec::new();
        };
        match self.gate.admission(&self.batches, &first.destination).await {
            Ok(admission) => self.batches.deliver(batch, admission, &self.gate).await,
            Err(outcome) => vec![outcome; batch.len()],
        }
    }
}

/// Why entries for a destination that does not exist are rejected.
pub(crate) fn missing<P: Protocol>(destination: &str, reason: &str) -> String {
    format!(
        "{} {destination} does not exist ({reason}): create it or fix the routing",
        P::WHAT
    )
}

/// Whether an entry of `verdicts` is to be sent again: the entries after it
/// then wait unsent, without a verdict (a failure of their own would start
/// [`UnknownSince`]'s clock for entries that never reached the service).
pub(crate) fn retrying(verdicts: &[Option<Verdict>]) -> bool {
    verdicts
        .iter()
        .any(|v| matches!(v, Some(Verdict::Retry(..))))
}

/// The messages at `indices` are to be sent again, for `reason`.
pub(crate) fn retry_all(
    indices: &[usize],
    verdicts: &mut [Option<Verdict>],
    class: Class,
    reason: &str,
) {
    for &i in indices {
        verdicts[i] = Some(Verdict::Retry(class, reason.to_owned()));
    }
}

/// The outcomes of `verdicts`: a failure of unknown class is retried until
/// the same event has failed so for `unknown`'s limit, then recorded.
pub(crate) fn settle(
    unknown: &UnknownSince,
    batch: &[Message],
    verdicts: Vec<Option<Verdict>>,
) -> Vec<Outcome> {
    let is_unknown = |v: &Option<Verdict>| matches!(v, Some(Verdict::Retry(Class::Unknown, _)));
    let (unknown_ids, other_ids): (Vec<_>, Vec<_>) = batch
        .iter()
        .zip(&verdicts)
        .partition(|(_, v)| is_unknown(v));
    let given_up = unknown.settle(
        std::time::Instant::now(),
        unknown_ids.iter().map(|(m, _)| m.event.id()),
        other_ids.iter().map(|(m, _)| m.event.id()),
    );
    batch
        .iter()
        .zip(verdicts)
        .map(|(message, verdict)| match verdict {
            Some(Verdict::Delivered) => Outcome::Delivered,
            Some(Verdict::Rejected(reason)) => Outcome::Rejected(reason),
            Some(Verdict::Retry(Class::Unknown, reason))
                if given_up.contains(&message.event.id()) =>
            {
                Outcome::Rejected(format!(
                    "{reason} (failing for {:?} for a reason not known to pass)",
                    unknown.limit()
                ))
            }
            Some(Verdict::Retry(class, reason)) => Outcome::retry(class.cause(), reason),
            None => Outcome::retry(
                Cause::Other,
                "not sent: an earlier entry of its batch is sent again first",
            ),
        })
        .collect()
}

/// Whether `value` is 64 lower-case hex digits: what [`fifo_id`] and the
/// claim-check keys replace a value by.
pub(crate) fn looks_hashed(value: &str) -> bool {
    value.len() == 64
        && value
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// A FIFO `MessageGroupId` / `MessageDeduplicationId` (SNS and SQS take at
/// most 128 characters of ASCII letters, digits and punctuation). A value
/// that does not fit is replaced by the hex SHA-256 of it: stable (the same
/// aggregate keeps its group, a repeat keeps its dedup id) and distinct in
/// practice. So is a value that looks like such a hash, so no row's id can
/// be the hash another row's id was replaced by (and a destination that
/// deduplicates by it drop the other).
pub(crate) fn fifo_id(value: &str) -> std::borrow::Cow<'_, str> {
    use sha2::Digest as _;
    let fits = !value.is_empty()
        && value.len() <= 128
        && !looks_hashed(value)
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b.is_ascii_punctuation());
    if fits {
        return std::borrow::Cow::Borrowed(value);
    }
    let digest = sha2::Sha256::digest(value.as_bytes());
    let mut hex = String::with_capacity(64);
    for byte in digest {
        hex.push_str(&format!("{byte:02x}"));
    }
    std::borrow::Cow::Owned(hex)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// A gate whose limit is stale until it is learned again, which happens
    /// once (as SNS's topic limits: forgotten by the first refusal).
    struct Stale {
        learned: AtomicUsize,
    }

    impl<P: Sync> Gate<P> for Stale {
        async fn admit(&self, _: &Batches<P>, _: &Arc<str>) -> Result<usize, Outcome> {
            Ok(usize::MAX)
        }

        fn relearn(&self, _: &str, size: usize, relearning: bool) -> Option<&'static str> {
            let forgotten_now = self.learned.fetch_add(1, Ordering::SeqCst) == 0;
            (size > 10 && (relearning || forgotten_now)).then_some("learned again")
        }
    }

    #[test]
    fn every_entry_of_one_answer_refused_over_a_stale_limit_is_retried_not_only_the_first() {
        let gate = Stale {
            learned: AtomicUsize::new(0),
        };
        let refused = || Some(Verdict::Rejected("too large".into()));
        let mut verdicts = vec![
            refused(),
            Some(Verdict::Delivered),
            refused(),
            refused(),
            refused(),
        ];
        let sizes = [Some(20), Some(20), Some(30), Some(5), None];
        retry_relearned::<(), _>(&gate, "t", &sizes, &mut verdicts);
        let retried = |v: &Option<Verdict>| matches!(v, Some(Verdict::Retry(Class::Unknown, r)) if r == "too large (learned again)");
        assert!(retried(&verdicts[0]), "the first: {:?}", verdicts[0]);
        assert_eq!(verdicts[1], Some(Verdict::Delivered));
        assert!(
            retried(&verdicts[2]),
            "a later one of the same answer: {:?}",
            verdicts[2]
        );
        assert_eq!(
            verdicts[3],
            refused(),
            "one the limit cannot explain stands"
        );
        assert_eq!(verdicts[4], refused(), "one not measured stands");
    }
}
