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
//! [`RelayError::class`] decides by type, never by message text: a server's
//! error by its SQLSTATE ([`sqlstate_class`], PostgreSQL's Appendix A), a TLS
//! failure by rustls's error type ([`crate::postgres::tls::TlsFailure`]), everything else
//! by its variant. `error::tests` pins every class.

use crate::event::MappingError;
use crate::pipeline::ack::FramingError;
use crate::postgres::outbox::record::RecordError;
use crate::postgres::tls::TlsFailure;
use crate::postgres::walstream::WireError;
use crate::postgres::{ConnInfoError, SqlError};

/// A replication error, with what to do when the cause is known.
fn with_advice(error: &WireError) -> String {
    let text = error.to_string();
    match error {
        // The walsender converts text to the client's UTF-8 and cannot.
        WireError::Server { code, .. } if code == "22021" => format!(
            "{text}. A row holds text that is not valid UTF-8 (a SQL_ASCII database), and PostgreSQL cannot \
             send it: the slot cannot move past that change. Nothing after it was acknowledged. Correct the \
             row's text, then drop the slot and start the relay with lifecycle.recreate_slot = true, or \
             run `outbox-relay replay --state PENDING` after recreating it (docs/recovery.md)"
        ),
        _ => text,
    }
}

/// The class of a server error by its SQLSTATE (PostgreSQL's Appendix A).
///
/// Transient: connection exceptions (08; a pooler such as PgBouncer reports
/// its own passing states, "server login has been failing, try again later",
/// as 08P01), transaction rollbacks (40: serialization, deadlock),
/// insufficient resources (53: too many connections, out of memory or disk),
/// operator intervention (57: shutdown, crash, cancel, not yet accepting
/// connections, but a dropped database stays dropped), system errors (58), an
/// object in use (55006: the slot is busy), a lock not available (55P03: the
/// relay's `lock_timeout`) and a read-only transaction (25006: a standby,
/// perhaps about to be promoted). Everything else is about the request or the
/// data (authentication 28, the catalog 3D and 42, data 22, invalidated
/// slots 55000, internal errors XX) and needs a person.
pub fn sqlstate_class(code: &str) -> ErrorClass {
    match code {
        "57P04" => ErrorClass::Fatal,
        "55006" | "55P03" | "25006" => ErrorClass::Transient,
        _ if ["08", "40", "53", "57", "58"]
            .iter()
            .any(|class| code.starts_with(class)) =>
        {
            ErrorClass::Transient
        }
        _ => ErrorClass::Fatal,
    }
}

fn tls_class(failure: TlsFailure) -> ErrorClass {
    if failure.needs_a_person() {
        ErrorClass::Fatal
    } else {
        ErrorClass::Transient
    }
}

/// Whether an error ends the relay or only the session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Retry with backoff: the cause is outside the data and may go away.
    Transient,
    /// Stop: a person must change something first.
    Fatal,
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
    #[error("replication stream: {}", with_advice(.0))]
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
    #[error("undecodable pgoutput message at {lsn}: {source}; this is a bug or a protocol mismatch, please report it")]
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

impl RelayError {
    /// What to do about it.
    pub fn class(&self) -> ErrorClass {
        use ErrorClass::*;
        match self {
            RelayError::Sql { source, .. } => sql_class(source),
            RelayError::Replication(e) => match e {
                WireError::Auth(_) => Fatal,
                WireError::Server { code, .. } => sqlstate_class(code),
                WireError::Tls(tls) if tls.fatal => Fatal,
                // The server refused our client certificate after the
                // handshake (TLS 1.3): its alert arrives with the first read.
                WireError::Io(io) => tls_class(TlsFailure::of(io)),
                WireError::Closed
                | WireError::Ended
                | WireError::Silent(_)
                | WireError::Tls(_)
                | WireError::Protocol(_)
                | WireError::ReadOnly => Transient,
            },
            RelayError::Unusable { transient, .. } => {
                if *transient {
                    Transient
                } else {
                    Fatal
                }
            }
            RelayError::Tls { fatal: true, .. } => Fatal,
            RelayError::Tls { fatal: false, .. } => Transient,
            RelayError::StreamEnded
            | RelayError::SqlSessionClosed
            | RelayError::PublisherStopped => Transient,
            RelayError::Connect(SqlError::Tls(tls)) if tls.fatal => Fatal,
            RelayError::Connect(SqlError::Postgres(source)) => sql_class(source),
            RelayError::Connect(_) => Transient,
            RelayError::Record(RecordError::Nowhere { .. } | RecordError::RowGone { .. }) => Fatal,
            RelayError::Record(RecordError::Sql(source) | RecordError::Failed { source, .. }) => {
                sql_class(source)
            }
            RelayError::ConnInfo(_)
            | RelayError::Listen(_)
            | RelayError::Mapping(_)
            | RelayError::Decode { .. }
            | RelayError::Framing(_)
            | RelayError::UnknownRelation(_) => Fatal,
        }
    }

    /// Another session streams from the slot: stand by and look again soon.
    pub fn is_slot_busy(&self) -> bool {
        match self {
            RelayError::Unusable { transient, .. } => *transient,
            RelayError::Replication(WireError::Server { code, .. }) => code == "55006",
            _ => false,
        }
    }
}

/// The class of an ordinary SQL session's error: the server's SQLSTATE,
/// else what its TLS says, else (the connection broke) transient.
fn sql_class(source: &tokio_postgres::Error) -> ErrorClass {
    if let Some(code) = source.code() {
        return sqlstate_class(code.code());
    }
    if let Some(tls) = crate::postgres::tls::TlsError::behind(source) {
        return if tls.fatal {
            ErrorClass::Fatal
        } else {
            ErrorClass::Transient
        };
    }
    match TlsFailure::of(source) {
        TlsFailure::Broken => {}
        failure => return tls_class(failure),
    }
    // The connection broke (closed, or an I/O error behind it: refused,
    // reset, timed out): transient. Without either, tokio-postgres refused
    // on the relay's side (no password for the method asked, an
    // authentication method or SASL mechanism it does not speak, a SCRAM
    // server proof that does not match, channel binding required and not
    // offered): a person must change something, as on the replication
    // connection (WireError::Auth).
    if source.is_closed() || has_io_cause(source) {
        ErrorClass::Transient
    } else {
        ErrorClass::Fatal
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
}
