//! Why a session or the relay ends, and what to do about it.
//!
//! Two families, as in Materialize's Postgres source:
//!
//! * **transient** errors are not about the data: the connection broke or went
//!   silent, the server is shutting down or out of connections, the slot is
//!   busy, a serialization failure. The session ends, nothing more is
//!   acknowledged, and a new session starts after a backoff;
//! * **fatal** errors need a person: a certificate or a password is wrong, the
//!   slot, publication or table does not fit, a row's text cannot be sent, a
//!   rejection has nowhere to be recorded. The relay stops, acknowledging
//!   nothing more, with a message that says what to change.
//!
//! # Kinds, policy and advice
//!
//! [`RelayError::kind`] names the [`ErrorKind`], deciding by type, never by
//! message text: a server's error by its SQLSTATE ([`sqlstate_kind`],
//! PostgreSQL's Appendix A), a TLS failure by rustls's error type
//! ([`TlsFailure`]), everything else by its variant. One table, the
//! `kinds!` list below, gives each kind its [`Policy`]: the [`Action`]
//! (retry after a backoff, stand by, stop, or stop unless the slot may be
//! recreated) and the operator's advice (what to do, which doc says more).
//! [`RelayError::class`] is the action's [`ErrorClass`].
//!
//! A message ends with its kind's advice where the error knows nothing more
//! specific than its kind (a row PostgreSQL cannot send, a message that
//! cannot be decoded). Where the code that found the problem knows the exact
//! key, certificate or object (the slot's readiness, the TLS handshake, the
//! recording of a rejection), its message names the fix in those terms, and
//! the table's advice is the general rule behind it. `error::tests` pins
//! every kind's policy, every class and every message this module words.

use crate::event::MappingError;
use crate::pipeline::ack::FramingError;
use crate::postgres::outbox::record::RecordError;
use crate::postgres::tls::TlsFailure;
use crate::postgres::walstream::WireError;
use crate::postgres::{ConnInfoError, SqlError};

/// Whether an error ends the relay or only the session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Retry with backoff: the cause is outside the data and may go away.
    Transient,
    /// Stop: a person must change something first.
    Fatal,
}

/// What the relay does about an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// End the session, acknowledging nothing more, and start another after
    /// the `[retry]` backoff.
    Retry,
    /// Another session streams from the slot: look again every few seconds
    /// and take over when it is free, acknowledging nothing meanwhile.
    StandBy,
    /// Stop the relay, acknowledging nothing more: a person must change
    /// something first.
    Stop,
    /// The slot is gone. The session's start recreates it when
    /// `lifecycle.recreate_slot` is set and a poller can publish what it held
    /// (`pipeline::stream`); an error of this kind means it did not, and the
    /// relay stops as for [`Action::Stop`].
    Recreate,
}

impl Action {
    /// Whether the action ends only the session or the relay.
    pub const fn class(self) -> ErrorClass {
        match self {
            Action::Retry | Action::StandBy => ErrorClass::Transient,
            Action::Stop | Action::Recreate => ErrorClass::Fatal,
        }
    }
}

/// An [`ErrorKind`]'s row of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// What the relay does.
    pub action: Action,
    /// What a person does about it, and which doc says more.
    pub advice: &'static str,
}

/// The kinds of error, one line each:
/// `Kind => Action, "advice";`. From the list come [`ErrorKind`],
/// [`ErrorKind::ALL`] and [`ErrorKind::policy`], so a kind cannot be added
/// without its policy and advice.
macro_rules! kinds {
    ($($(#[$doc:meta])* $kind:ident => $action:ident, $advice:expr;)+) => {
        /// What went wrong, as far as deciding what to do about it.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum ErrorKind {
            $($(#[$doc])* $kind,)+
        }

        impl ErrorKind {
            /// Every kind, in the table's order.
            pub const ALL: &'static [ErrorKind] = &[$(ErrorKind::$kind),+];

            /// What the relay does about an error of this kind, and what a
            /// person can do.
            pub const fn policy(self) -> Policy {
                match self {
                    $(ErrorKind::$kind => Policy { action: Action::$action, advice: $advice },)+
                }
            }
        }
    };
}

kinds! {
    /// The connection broke, closed or went silent (in TLS too), the server
    /// ended the stream, or it is not serving: shutting down or restarting,
    /// not yet accepting connections, a query canceled, an I/O error on its
    /// side (SQLSTATE 08, 57 but 57P04, 58; PgBouncer's passing states,
    /// "server login has been failing, try again later", come as 08P01).
    ConnectionLost => Retry,
        "none while it passes: the relay reconnects after a backoff ([retry]); if it goes on, check that \
         the server is up and reachable, and what closes idle connections on the way (docs/operations.md, \
         Dead connections)";
    /// The server is short of resources, or the request lost a race: too
    /// many connections, out of memory or disk (53), a serialization failure
    /// or deadlock (40), the relay's `lock_timeout` (55P03), an object in use
    /// (55006 on an ordinary session).
    Contention => Retry,
        "none while it passes: retried after a backoff ([retry]); if it goes on, look at max_connections, \
         the server's memory and disk, and long transactions holding locks (docs/operations.md, Stalls)";
    /// The server accepts no writes: a standby, perhaps about to be promoted
    /// (25006, or no host of the URL is the primary).
    ReadOnly => Retry,
        "none during a failover: the relay looks for the primary again; otherwise point postgres.url at \
         the primary, or list every host with target_session_attrs=read-write (docs/recovery.md, \
         Database failover)";
    /// The publisher task stopped without saying why.
    PublisherStopped => Retry,
        "none: a new session starts after a backoff; if it repeats, the log before it says why, and a \
         panic is a bug: please report it";
    /// Another session streams from the slot (55006 on the stream, or the
    /// slot is active).
    SlotBusy => StandBy,
        "none when another relay holds it: this one takes over when it stops; otherwise end the session \
         that holds it (pg_stat_replication) (docs/operations.md, High availability and restarts)";
    /// The connection settings are unusable.
    Settings => Stop,
        "correct postgres.url or postgres.password_file as the message says (docs/configuration.md, \
         [postgres])";
    /// Authentication failed, or cannot proceed on the relay's side (28; a
    /// method, SASL mechanism or channel binding the relay cannot meet).
    Authentication => Stop,
        "check the role, its password (postgres.url, postgres.password_file) and the pg_hba.conf line \
         for the relay's host (docs/operations.md, TLS and authentication)";
    /// A certificate, or TLS the server or the relay refuses: retrying does
    /// not mend it.
    Certificate => Stop,
        "change the certificate or the TLS setting the message names (sslmode, sslrootcert, sslcert, \
         sslkey in postgres.url) (docs/operations.md, TLS and authentication)";
    /// The database was dropped or does not exist (57P04, 3D).
    NoDatabase => Stop,
        "point postgres.url at the database that holds the outbox table (docs/configuration.md, \
         [postgres])";
    /// The slot, publication or table, or the role's rights on them, do not
    /// fit (42: an undefined object, insufficient privilege).
    Unusable => Stop,
        "make them fit as the message says: `outbox-relay check` lists every problem with its fix, and \
         `outbox-relay setup` prints the SQL (docs/operations.md, `outbox-relay check`)";
    /// The slot is missing or invalidated.
    SlotLost => Recreate,
        "set lifecycle.recreate_slot = true to have the relay recreate it and the poller publish what it \
         held, or recreate it and run `outbox-relay replay` (docs/recovery.md, The slot is missing or \
         invalidated)";
    /// The table does not fit the column mapping.
    Mapping => Stop,
        "set the [columns] key the message names to the table's column, or add the column \
         (docs/configuration.md, [columns])";
    /// A row holds text the walsender cannot convert to UTF-8 (22021 on the
    /// stream).
    UnsendableText => Stop,
        "A row holds text that is not valid UTF-8 (a SQL_ASCII database), and PostgreSQL cannot send \
         it: the slot cannot move past that change. Nothing after it was acknowledged. Correct the row's \
         text, then drop the slot and start the relay with lifecycle.recreate_slot = true, or run \
         `outbox-relay replay --state PENDING` after recreating it (docs/recovery.md)";
    /// The server refused the request or its data for a reason no retry
    /// mends (data 22, constraints 23, an invalidated object 55000, internal
    /// XX, and every SQLSTATE not named above).
    Refused => Stop,
        "the server's message and SQLSTATE say what (PostgreSQL's Appendix A); an internal error (XX) is \
         the server's to look into";
    /// The metrics and health listener cannot start.
    Listen => Stop,
        "set http.listen to a free address, or stop what holds it (docs/configuration.md, [http])";
    /// A rejected event has nowhere to be recorded.
    Unrecordable => Stop,
        "create the dead-letter table (`outbox-relay setup --apply`) or give the table the \
         relay-managed columns, then start the relay again (docs/bad-input.md)";
    /// The stream broke the protocol: a message that cannot be decoded, out
    /// of its transaction's frame, or naming a relation never described.
    Undecodable => Stop,
        "this is a bug or a protocol mismatch, please report it";
}

/// Why a replication session ended.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// The connection settings are unusable.
    #[error(transparent)]
    ConnInfo(#[from] ConnInfoError),
    /// The ordinary SQL session failed.
    #[error("postgres: {context}: {}", crate::report::Chain(source))]
    Sql {
        /// What was being done.
        context: &'static str,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// The ordinary SQL session could not be opened (its socket, or a host
    /// name TLS cannot use).
    #[error("postgres: {}", crate::report::Chain(.0))]
    Connect(#[source] crate::postgres::SqlError),
    /// The replication session failed.
    #[error("replication stream: {}", stream_text(.0))]
    Replication(#[source] WireError),
    /// The replication connection's TLS failed (the message says why).
    #[error("replication connection: {message}")]
    Tls {
        /// What happened and what to do.
        message: String,
        /// A certificate problem, which retrying does not mend.
        fatal: bool,
    },
    /// The slot, publication or table cannot be used as it is (the message
    /// says how to fix it).
    #[error("{message}")]
    Unusable {
        /// What is wrong and how to fix it.
        message: String,
        /// Whether waiting may help (the slot is busy).
        transient: bool,
        /// The slot is missing or invalidated (`lifecycle.recreate_slot` can recover).
        lost: bool,
    },
    /// The table does not fit the column mapping.
    #[error("{0}")]
    Mapping(#[from] MappingError),
    /// The HTTP listener cannot start (the message names `http.listen`).
    #[error("{0}")]
    Listen(String),
    /// Rejected events cannot be recorded.
    #[error("{0}")]
    Record(#[from] crate::postgres::outbox::record::RecordError),
    /// A pgoutput message could not be decoded.
    #[error("undecodable pgoutput message at {lsn}: {source}; {}", ErrorKind::Undecodable.policy().advice)]
    Decode {
        /// Where.
        lsn: String,
        /// Why.
        #[source]
        source: pgoutput::DecodeError,
    },
    /// The stream broke Begin/Commit framing.
    #[error("replication stream framing: {0}")]
    Framing(#[from] FramingError),
    /// An Insert for a relation never described.
    #[error("Insert for relation oid {0} arrived before its Relation message")]
    UnknownRelation(u32),
    /// The server ended the stream.
    #[error("the server ended the replication stream")]
    StreamEnded,
    /// The session's SQL connection closed (a fast shutdown terminates it
    /// first, or it broke); marking and recording need it, so the
    /// replication session ends with it.
    #[error(
        "the relay's SQL session closed (the server is shutting down, or the connection broke); \
         the replication session ends with it"
    )]
    SqlSessionClosed,
    /// The publisher task stopped.
    #[error("the publisher stopped unexpectedly")]
    PublisherStopped,
}

/// A replication error's text, ending with its kind's advice when the error
/// says nothing more specific (a row PostgreSQL cannot send).
fn stream_text(error: &WireError) -> String {
    match stream_kind(error) {
        kind @ ErrorKind::UnsendableText => format!("{error}. {}", kind.policy().advice),
        _ => error.to_string(),
    }
}

impl RelayError {
    /// What to do about it: the class of its kind's [`Action`].
    pub fn class(&self) -> ErrorClass {
        self.kind().policy().action.class()
    }

    /// Another session streams from the slot: stand by and look again soon.
    pub fn is_slot_busy(&self) -> bool {
        self.kind().policy().action == Action::StandBy
    }

    /// What went wrong, by type: the table ([`ErrorKind::policy`]) says
    /// what follows.
    pub fn kind(&self) -> ErrorKind {
        use ErrorKind::*;
        match self {
            RelayError::Sql { source, .. } => sql_kind(source),
            RelayError::Replication(e) => stream_kind(e),
            RelayError::Unusable {
                transient: true, ..
            } => SlotBusy,
            RelayError::Unusable { lost: true, .. } => SlotLost,
            RelayError::Unusable { .. } => Unusable,
            RelayError::Tls { fatal, .. } => tls_error_kind(*fatal),
            RelayError::StreamEnded | RelayError::SqlSessionClosed => ConnectionLost,
            RelayError::PublisherStopped => PublisherStopped,
            RelayError::Connect(SqlError::Tls(tls)) => tls_error_kind(tls.fatal),
            RelayError::Connect(SqlError::Postgres(source)) => sql_kind(source),
            RelayError::Connect(SqlError::ReadOnly { .. }) => ReadOnly,
            RelayError::Connect(SqlError::Socket { .. }) => ConnectionLost,
            RelayError::Record(RecordError::Nowhere { .. } | RecordError::RowGone { .. }) => {
                Unrecordable
            }
            RelayError::Record(RecordError::Sql(source) | RecordError::Failed { source, .. }) => {
                sql_kind(source)
            }
            RelayError::ConnInfo(_) => Settings,
            RelayError::Listen(_) => Listen,
            RelayError::Mapping(_) => Mapping,
            RelayError::Decode { .. } | RelayError::Framing(_) | RelayError::UnknownRelation(_) => {
                Undecodable
            }
        }
    }
}

/// The kind of a server error by its SQLSTATE (PostgreSQL's Appendix A).
///
/// Passing: connection exceptions (08), transaction rollbacks (40:
/// serialization, deadlock), insufficient resources (53: too many
/// connections, out of memory or disk), operator intervention (57: shutdown,
/// crash, cancel, not yet accepting connections, but a dropped database
/// stays dropped), system errors (58), an object in use (55006), a lock not
/// available (55P03: the relay's `lock_timeout`) and a read-only transaction
/// (25006: a standby, perhaps about to be promoted). Everything else is about
/// the request or the data (authentication 28, the database 3D, the catalog
/// 42, data 22, invalidated slots 55000, internal errors XX) and needs a
/// person.
pub(crate) fn sqlstate_kind(code: &str) -> ErrorKind {
    let class = code.get(..2).unwrap_or(code);
    match (code, class) {
        ("57P04", _) | (_, "3D") => ErrorKind::NoDatabase,
        ("55006" | "55P03", _) | (_, "40" | "53") => ErrorKind::Contention,
        ("25006", _) => ErrorKind::ReadOnly,
        (_, "08" | "57" | "58") => ErrorKind::ConnectionLost,
        (_, "28") => ErrorKind::Authentication,
        (_, "42") => ErrorKind::Unusable,
        _ => ErrorKind::Refused,
    }
}

/// The kind of a replication error. On the stream two SQLSTATEs are about
/// the slot: 55006 is another session streaming from it, 22021 a row the
/// walsender cannot convert to UTF-8, which the slot cannot move past.
fn stream_kind(error: &WireError) -> ErrorKind {
    match error {
        WireError::Auth(_) => ErrorKind::Authentication,
        WireError::Server { code, .. } if code == "55006" => ErrorKind::SlotBusy,
        WireError::Server { code, .. } if code == "22021" => ErrorKind::UnsendableText,
        WireError::Server { code, .. } => sqlstate_kind(code),
        WireError::Tls(tls) => tls_error_kind(tls.fatal),
        // The server refused our client certificate after the handshake
        // (TLS 1.3): its alert arrives with the first read.
        WireError::Io(io) => tls_failure_kind(TlsFailure::of(io)),
        WireError::Closed | WireError::Ended | WireError::Silent(_) | WireError::Protocol(_) => {
            ErrorKind::ConnectionLost
        }
        WireError::ReadOnly => ErrorKind::ReadOnly,
    }
}

/// A TLS error's kind: a certificate problem (`fatal`), or a connection
/// that broke during the handshake.
fn tls_error_kind(fatal: bool) -> ErrorKind {
    if fatal {
        ErrorKind::Certificate
    } else {
        ErrorKind::ConnectionLost
    }
}

fn tls_failure_kind(failure: TlsFailure) -> ErrorKind {
    tls_error_kind(failure.needs_a_person())
}

/// The kind of an ordinary SQL session's error: the server's SQLSTATE,
/// else what its TLS says, else (the connection broke) passing.
fn sql_kind(source: &tokio_postgres::Error) -> ErrorKind {
    if let Some(code) = source.code() {
        return sqlstate_kind(code.code());
    }
    if let Some(tls) = crate::postgres::tls::TlsError::behind(source) {
        return tls_error_kind(tls.fatal);
    }
    match TlsFailure::of(source) {
        TlsFailure::Broken => {}
        failure => return tls_failure_kind(failure),
    }
    // The connection broke (closed, or an I/O error behind it: refused,
    // reset, timed out): passing. Without either, tokio-postgres refused
    // on the relay's side (no password for the method asked, an
    // authentication method or SASL mechanism it does not speak, a SCRAM
    // server proof that does not match, channel binding required and not
    // offered): a person must change something, as on the replication
    // connection (WireError::Auth).
    if source.is_closed() || has_io_cause(source) {
        ErrorKind::ConnectionLost
    } else {
        ErrorKind::Authentication
    }
}

fn has_io_cause(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(e) = next {
        if e.is::<std::io::Error>() {
            return true;
        }
        next = e.source();
    }
    false
}

impl From<crate::postgres::SqlError> for RelayError {
    fn from(error: crate::postgres::SqlError) -> Self {
        match error {
            crate::postgres::SqlError::Postgres(source) => RelayError::Sql {
                context: "connecting",
                source,
            },
            other => RelayError::Connect(other),
        }
    }
}

impl From<WireError> for RelayError {
    fn from(error: WireError) -> Self {
        match error {
            // Explained like the ordinary connection's.
            WireError::Tls(tls) => RelayError::Tls {
                message: tls.message,
                fatal: tls.fatal,
            },
            WireError::Ended => RelayError::StreamEnded,
            other => RelayError::Replication(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::time::Duration;

    use super::*;
    use ErrorClass::{Fatal, Transient};

    /// The class of a server error by its SQLSTATE alone.
    fn sqlstate_class(code: &str) -> ErrorClass {
        sqlstate_kind(code).policy().action.class()
    }

    fn server(code: &str) -> RelayError {
        RelayError::Replication(WireError::Server {
            code: code.into(),
            message: "whatever the server says".into(),
        })
    }

    #[test]
    fn server_errors_are_classed_by_sqlstate() {
        for (code, class, what) in [
            ("08006", Transient, "connection failure"),
            (
                "08P01",
                Transient,
                "protocol violation: PgBouncer's passing states",
            ),
            ("55P03", Transient, "lock not available (lock_timeout)"),
            ("40001", Transient, "serialization failure"),
            ("40P01", Transient, "deadlock"),
            ("53300", Transient, "too many connections"),
            ("53100", Transient, "disk full"),
            ("57P01", Transient, "admin shutdown"),
            ("57P03", Transient, "cannot connect now (starting up)"),
            ("57014", Transient, "query canceled"),
            ("57P04", Fatal, "database dropped"),
            ("58030", Transient, "I/O error"),
            ("55006", Transient, "object in use: the slot is busy"),
            ("25006", Transient, "read-only transaction: a standby"),
            (
                "55000",
                Fatal,
                "object not in prerequisite state: an invalidated slot",
            ),
            ("28P01", Fatal, "password authentication failed"),
            ("28000", Fatal, "invalid authorization (pg_hba)"),
            ("3D000", Fatal, "database does not exist"),
            ("42501", Fatal, "insufficient privilege"),
            (
                "42704",
                Fatal,
                "undefined object: a missing publication or slot",
            ),
            (
                "22021",
                Fatal,
                "character not in repertoire: a SQL_ASCII row",
            ),
            ("23502", Fatal, "not-null violation"),
            ("XX000", Fatal, "internal error"),
        ] {
            assert_eq!(sqlstate_class(code), class, "{code} ({what})");
            assert_eq!(server(code).class(), class, "{code} on the stream ({what})");
        }
        assert!(server("55006").is_slot_busy());
        assert!(!server("55000").is_slot_busy());
        assert!(server("22021").to_string().contains("not valid UTF-8"));
        assert!(!server("22000").to_string().contains("not valid UTF-8"));
    }

    #[test]
    fn every_other_error_has_its_class() {
        let alert = |a| {
            WireError::Io(io::Error::new(
                io::ErrorKind::InvalidData,
                rustls::Error::AlertReceived(a),
            ))
        };
        let tls = |fatal| crate::postgres::tls::TlsError {
            message: "TLS …".into(),
            fatal,
        };
        let unusable = |transient, lost| RelayError::Unusable {
            message: "…".into(),
            transient,
            lost,
        };
        let cases: Vec<(RelayError, ErrorClass)> = vec![
            (
                RelayError::Replication(WireError::Auth("no password".into())),
                Fatal,
            ),
            (RelayError::Replication(WireError::Closed), Transient),
            (
                RelayError::Replication(WireError::Silent(Duration::from_secs(60))),
                Transient,
            ),
            (
                RelayError::Replication(WireError::Protocol("odd".into())),
                Transient,
            ),
            (
                RelayError::Replication(WireError::Io(io::ErrorKind::ConnectionReset.into())),
                Transient,
            ),
            (
                RelayError::Replication(alert(rustls::AlertDescription::UnknownCA)),
                Fatal,
            ),
            (
                RelayError::Replication(alert(rustls::AlertDescription::CertificateRequired)),
                Fatal,
            ),
            (
                RelayError::Replication(alert(rustls::AlertDescription::HandshakeFailure)),
                Transient,
            ),
            (RelayError::from(WireError::Tls(tls(true))), Fatal),
            (RelayError::from(WireError::Tls(tls(false))), Transient),
            (RelayError::from(WireError::Ended), Transient),
            (
                RelayError::from(SqlError::Socket {
                    endpoint: "db:5432/app".into(),
                    source: io::ErrorKind::TimedOut.into(),
                }),
                Transient,
            ),
            (RelayError::from(SqlError::Tls(tls(true))), Fatal),
            (RelayError::from(SqlError::Tls(tls(false))), Transient),
            (unusable(true, false), Transient),
            (unusable(false, false), Fatal),
            (unusable(false, true), Fatal),
            (
                RelayError::Record(RecordError::Nowhere {
                    table: "public.outbox".into(),
                    dead_letter: "'outbox_dead_letter'".into(),
                }),
                Fatal,
            ),
            (
                RelayError::Record(RecordError::RowGone {
                    id: "e1".into(),
                    reason: "NULL aggregate_id".into(),
                    table: "public.outbox".into(),
                    dead_letter: "outbox_dead_letter".into(),
                }),
                Fatal,
            ),
            (RelayError::StreamEnded, Transient),
            (RelayError::SqlSessionClosed, Transient),
            (RelayError::PublisherStopped, Transient),
            (RelayError::Listen("127.0.0.1:9187 in use".into()), Fatal),
            (RelayError::UnknownRelation(16384), Fatal),
            (
                RelayError::ConnInfo(ConnInfoError::Url("names no host".into())),
                Fatal,
            ),
        ];
        for (error, class) in cases {
            assert_eq!(error.class(), class, "{error}");
        }
    }

    /// The words a user reads (logs, `check`, the exit message) for the
    /// errors this module words itself, to the byte.
    #[test]
    fn every_message_reads_as_its_variant_words_it() {
        let stream = |code: &str, message: &str| {
            RelayError::Replication(WireError::Server {
                code: code.into(),
                message: message.into(),
            })
        };
        let cases: Vec<(RelayError, &str)> = vec![
            (
                stream(
                    "22021",
                    "character with byte sequence 0xe9 in encoding \"SQL_ASCII\" has no equivalent in encoding \"UTF8\"",
                ),
                "replication stream: server error: character with byte sequence 0xe9 in encoding \"SQL_ASCII\" \
                 has no equivalent in encoding \"UTF8\" (SQLSTATE 22021). A row holds text that is not valid \
                 UTF-8 (a SQL_ASCII database), and PostgreSQL cannot send it: the slot cannot move past that \
                 change. Nothing after it was acknowledged. Correct the row's text, then drop the slot and \
                 start the relay with lifecycle.recreate_slot = true, or run `outbox-relay replay --state \
                 PENDING` after recreating it (docs/recovery.md)",
            ),
            (
                stream("55006", "replication slot \"outbox\" is active for PID 7"),
                "replication stream: server error: replication slot \"outbox\" is active for PID 7 (SQLSTATE 55006)",
            ),
            (
                RelayError::Replication(WireError::Closed),
                "replication stream: the server closed the connection",
            ),
            (
                RelayError::Replication(WireError::Auth("no password".into())),
                "replication stream: authentication: no password",
            ),
            (
                RelayError::Tls {
                    message: "TLS: the certificate expired".into(),
                    fatal: true,
                },
                "replication connection: TLS: the certificate expired",
            ),
            (
                RelayError::Unusable {
                    message: "replication slot \"outbox\" does not exist".into(),
                    transient: false,
                    lost: true,
                },
                "replication slot \"outbox\" does not exist",
            ),
            (
                RelayError::ConnInfo(ConnInfoError::Url("names no host".into())),
                "postgres.url: names no host",
            ),
            (
                RelayError::Listen("http.listen: 127.0.0.1:9187 is in use".into()),
                "http.listen: 127.0.0.1:9187 is in use",
            ),
            (
                RelayError::Decode {
                    lsn: "0/16B3748".into(),
                    source: pgoutput::DecodeError::Empty,
                },
                "undecodable pgoutput message at 0/16B3748: empty pgoutput message; this is a bug or a \
                 protocol mismatch, please report it",
            ),
            (
                RelayError::Framing(FramingError::NestedBegin),
                "replication stream framing: Begin received while a transaction is open",
            ),
            (
                RelayError::UnknownRelation(16384),
                "Insert for relation oid 16384 arrived before its Relation message",
            ),
            (
                RelayError::StreamEnded,
                "the server ended the replication stream",
            ),
            (
                RelayError::SqlSessionClosed,
                "the relay's SQL session closed (the server is shutting down, or the connection broke); \
                 the replication session ends with it",
            ),
            (
                RelayError::PublisherStopped,
                "the publisher stopped unexpectedly",
            ),
        ];
        for (error, message) in cases {
            assert_eq!(error.to_string(), message);
        }
    }

    #[test]
    fn every_kind_has_its_policy_and_advice() {
        use Action::{Recreate, Retry, StandBy, Stop};
        use ErrorKind::*;
        let table = [
            (ConnectionLost, Retry),
            (Contention, Retry),
            (ReadOnly, Retry),
            (PublisherStopped, Retry),
            (SlotBusy, StandBy),
            (Settings, Stop),
            (Authentication, Stop),
            (Certificate, Stop),
            (NoDatabase, Stop),
            (Unusable, Stop),
            (SlotLost, Recreate),
            (Mapping, Stop),
            (UnsendableText, Stop),
            (Refused, Stop),
            (Listen, Stop),
            (Unrecordable, Stop),
            (Undecodable, Stop),
        ];
        assert_eq!(ErrorKind::ALL, table.map(|(kind, _)| kind));
        let mut advice = std::collections::HashSet::new();
        for (kind, action) in table {
            let policy = kind.policy();
            assert_eq!(policy.action, action, "{kind:?}");
            assert!(!policy.advice.trim().is_empty(), "{kind:?} has no advice");
            assert!(
                advice.insert(policy.advice),
                "{kind:?} repeats another's advice"
            );
            // What a person does says where to read more, but for what only
            // the server (its SQLSTATE) or the project (a report) can say.
            if action.class() == Fatal && !matches!(kind, Refused | Undecodable) {
                assert!(policy.advice.contains("docs/"), "{kind:?} names no doc");
            }
        }
        assert_eq!(Retry.class(), Transient);
        assert_eq!(StandBy.class(), Transient);
        assert_eq!(Stop.class(), Fatal);
        assert_eq!(Recreate.class(), Fatal);
    }

    #[test]
    fn every_error_has_its_kind() {
        use ErrorKind::*;
        for (code, kind) in [
            ("08006", ConnectionLost),
            ("57P01", ConnectionLost),
            ("58030", ConnectionLost),
            ("40001", Contention),
            ("53300", Contention),
            ("55P03", Contention),
            ("25006", ReadOnly),
            ("57P04", NoDatabase),
            ("3D000", NoDatabase),
            ("28P01", Authentication),
            ("42501", Unusable),
            ("55000", Refused),
            ("23502", Refused),
            ("XX000", Refused),
        ] {
            assert_eq!(sqlstate_kind(code), kind, "{code}");
            assert_eq!(server(code).kind(), kind, "{code} on the stream");
        }
        // On the stream, two SQLSTATEs are about the slot.
        assert_eq!(sqlstate_kind("55006"), Contention);
        assert_eq!(server("55006").kind(), SlotBusy);
        assert_eq!(sqlstate_kind("22021"), Refused);
        assert_eq!(server("22021").kind(), UnsendableText);
        let unusable = |transient, lost| RelayError::Unusable {
            message: "…".into(),
            transient,
            lost,
        };
        let tls = |fatal| crate::postgres::tls::TlsError {
            message: "TLS …".into(),
            fatal,
        };
        let cases: Vec<(RelayError, ErrorKind)> = vec![
            (unusable(true, false), SlotBusy),
            (unusable(false, true), SlotLost),
            (unusable(false, false), Unusable),
            (RelayError::from(WireError::Tls(tls(true))), Certificate),
            (RelayError::from(WireError::Tls(tls(false))), ConnectionLost),
            (RelayError::from(SqlError::Tls(tls(true))), Certificate),
            (
                RelayError::from(SqlError::ReadOnly {
                    endpoint: "db:5432/app".into(),
                }),
                ReadOnly,
            ),
            (
                RelayError::Replication(WireError::Auth("no password".into())),
                Authentication,
            ),
            (RelayError::Replication(WireError::ReadOnly), ReadOnly),
            (RelayError::from(WireError::Ended), ConnectionLost),
            (RelayError::SqlSessionClosed, ConnectionLost),
            (RelayError::PublisherStopped, PublisherStopped),
            (
                RelayError::ConnInfo(ConnInfoError::Url("names no host".into())),
                Settings,
            ),
            (RelayError::Listen("in use".into()), Listen),
            (
                RelayError::Record(RecordError::Nowhere {
                    table: "public.outbox".into(),
                    dead_letter: "'outbox_dead_letter'".into(),
                }),
                Unrecordable,
            ),
            (RelayError::Framing(FramingError::NestedBegin), Undecodable),
            (RelayError::UnknownRelation(16384), Undecodable),
        ];
        for (error, kind) in cases {
            assert_eq!(error.kind(), kind, "{error}");
            assert_eq!(error.class(), kind.policy().action.class(), "{error}");
        }
    }

    #[test]
    fn a_message_that_carries_advice_ends_with_its_kinds() {
        let unsendable = server("22021").to_string();
        assert!(unsendable.ends_with(ErrorKind::UnsendableText.policy().advice));
        let undecodable = RelayError::Decode {
            lsn: "0/0".into(),
            source: pgoutput::DecodeError::Empty,
        };
        assert!(undecodable
            .to_string()
            .ends_with(ErrorKind::Undecodable.policy().advice));
    }
}
