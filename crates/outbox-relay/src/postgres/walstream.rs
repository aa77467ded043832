//! The replication connection: the walsender's streaming protocol, spoken on
//! the relay's own task.
//!
//! ```text
//!  connect ─► TLS (SSLRequest, the ordinary connection's rustls set-up) ─► StartupMessage
//!          ─► authentication (SCRAM-SHA-256[-PLUS], MD5, password) ─► START_REPLICATION … LOGICAL
//!          ─► CopyBoth: XLogData / keepalives in, standby status updates out
//! ```
//!
//! The stream is read into one buffer, [`READ_BUFFER`] bytes at a time; each
//! CopyData frame is taken from it in place, and only an XLogData's pgoutput
//! message is copied out, into an allocation of its own. So an event that
//! stays in flight for long holds its own few hundred bytes, never a whole
//! read's worth of other rows (a retried message must not pin the buffer it
//! arrived in).
//!
//! # Positions reported
//!
//! A standby status update reports one position as written, flushed and
//! applied: the one given to [`WalStream::send_status`] (or the session's
//! start), never anything else. The caller sends one every `status_interval` ([`WalStream::send_status`]),
//! whether or not it reads, so the walsender's `wal_sender_timeout` never
//! ends a session that is only waiting for its sink; and, when a keepalive
//! asked for a reply ([`WalStream::reply_wanted`]), at the end of the burst
//! that read it.
//!
//! # Cancellation
//!
//! [`WalStream::next`] may be dropped at any await (it sits in the session
//! loop's `select!`): bytes are only ever appended to the buffer by a
//! completed read and only removed with the message they form, so nothing is
//! lost or read twice. Writes (status updates) are awaited to the end outside
//! any `select!`.

use std::io;
use std::path::Path;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use postgres_protocol::authentication::sasl::{
    ChannelBinding, ScramSha256, SCRAM_SHA_256, SCRAM_SHA_256_PLUS,
};
use postgres_protocol::message::frontend;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpStream, UnixStream};

use crate::postgres::position;
use crate::postgres::tls::{ChannelBindingMode, MakeRustls, RustlsStream, TlsError};

/// Size of the read buffer: one `recv` takes up to this much of the stream.
pub(crate) const READ_BUFFER: usize = 256 * 1024;

/// The largest backend message accepted (PostgreSQL's own limit on a
/// message is 1 GiB).
const MAX_MESSAGE: usize = 1 << 30;

/// Why the replication connection failed.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// Reading or writing the socket failed.
    #[error("connection: {0}")]
    Io(#[from] io::Error),
    /// The server closed the connection.
    #[error("the server closed the connection")]
    Closed,
    /// The server ended the replication stream (CopyDone).
    #[error("the server ended the replication stream")]
    Ended,
    /// Nothing arrived for `postgres.receive_timeout`, not even the answer to
    /// a status update that asked for one: the connection is taken for dead.
    #[error(
        "nothing from the server for {} s, not even the reply asked for (postgres.receive_timeout): \
         the connection is taken for dead (a network device dropped it, or the server froze)",
        .0.as_secs()
    )]
    Silent(std::time::Duration),
    /// TLS could not be set up (the message says why and what to do).
    #[error(transparent)]
    Tls(TlsError),
    /// Authentication cannot proceed on the relay's side.
    #[error("authentication: {0}")]
    Auth(String),
    /// The server refused something (an ErrorResponse).
    #[error("server error: {message} (SQLSTATE {code})")]
    Server {
        /// SQLSTATE.
        code: String,
        /// The server's message.
        message: String,
    },
    /// The server sent what the protocol does not allow here.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// `target_session_attrs=read-write` and the server accepts no writes.
    #[error("the server accepts no writes (a standby, or read-only): target_session_attrs=read-write looks for the primary")]
    ReadOnly,
}

/// What the walsender streams.
#[derive(Debug)]
pub enum WalMessage {
    /// XLogData: one pgoutput message, in its own allocation.
    Data {
        /// Where the message starts in the WAL.
        start: u64,
        /// The pgoutput message.
        data: Bytes,
    },
    /// A primary keepalive: everything up to `wal_end` has been sent.
    KeepAlive {
        /// The server's current end of WAL.
        wal_end: u64,
    },
}

/// The socket under the stream.
pub enum Transport {
    /// TCP without TLS.
    Tcp(TcpStream),
    /// TCP with TLS.
    Tls(RustlsStream<TcpStream>),
    /// A unix socket (TLS does not apply, as in libpq).
    Unix(UnixStream),
}

impl Transport {
    /// A unix socket in `dir` for `port` (`.s.PGSQL.<port>`, as libpq names it).
    pub async fn unix(dir: &Path, port: u16) -> Result<Transport, WireError> {
        Ok(Transport::Unix(
            UnixStream::connect(dir.join(format!(".s.PGSQL.{port}"))).await?,
        ))
    }

    /// TCP to `host:port`; with TLS negotiated through `connector` when there
    /// is one (`None` for `sslmode=disable`). `required`: a server that
    /// declines TLS is an error (every mode but `prefer`). `receive_timeout`
    /// sets the socket's keepalive and unacknowledged-send bounds
    /// ([`crate::postgres::silence::tune`]).
    pub async fn tcp(
        host: &str,
        port: u16,
        connector: Option<&MakeRustls>,
        required: bool,
        receive_timeout: std::time::Duration,
    ) -> Result<Transport, WireError> {
        // Bounded as the SQL sockets are: a host that swallows SYNs (a
        // powered-off machine) must not keep the next host of the URL from
        // being tried.
        let tcp = tokio::time::timeout(
            crate::postgres::silence::CONNECT_TIMEOUT,
            TcpStream::connect((host, port)),
        )
        .await
        .map_err(|_| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "no connection to {host}:{port} within {} s",
                    crate::postgres::silence::CONNECT_TIMEOUT.as_secs()
                ),
            )
        })??;
        tcp.set_nodelay(true)?;
        crate::postgres::silence::tune(&tcp, receive_timeout)?;
        match connector {
            None => Ok(Transport::Tcp(tcp)),
            Some(connector) => {
                match crate::postgres::tls::negotiate(connector, tcp, host, required).await {
                    Ok(Ok(tls)) => Ok(Transport::Tls(tls)),
                    Ok(Err(plain)) => Ok(Transport::Tcp(plain)),
                    Err(e) => Err(WireError::Tls(e)),
                }
            }
        }
    }
}

impl Transport {
    /// The `tls-server-end-point` binding of a TLS session; `None` without TLS
    /// or for a certificate whose signature algorithm has none.
    fn tls_server_end_point(&self) -> Option<Vec<u8>> {
        match self {
            Transport::Tls(tls) => tls.tls_server_end_point(),
            Transport::Tcp(_) | Transport::Unix(_) => None,
        }
    }
}

impl AsyncRead for Transport {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Transport::Tls(s) => Pin::new(s).poll_read(cx, buf),
            Transport::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Transport {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Transport::Tls(s) => Pin::new(s).poll_write(cx, buf),
            Transport::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_flush(cx),
            Transport::Tls(s) => Pin::new(s).poll_flush(cx),
            Transport::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Transport::Tls(s) => Pin::new(s).poll_shutdown(cx),
            Transport::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// Who connects, and the session settings of the StartupMessage.
pub struct Startup<'a> {
    /// The role (it needs REPLICATION).
    pub user: &'a str,
    /// Its password, if the server asks for one.
    pub password: Option<&'a str>,
    /// The database the slot belongs to.
    pub database: &'a str,
    /// `application_name` (shown in `pg_stat_replication`).
    pub application_name: &'a str,
    /// The `options` parameter (`-c name=value …`).
    pub options: &'a str,
    /// Whether SCRAM is bound to the TLS session (see [`crate::postgres::tls`]).
    pub channel_binding: ChannelBindingMode,
    /// Only a server that accepts writes will do (`target_session_attrs=read-write`).
    pub read_write: bool,
}

/// What START_REPLICATION asks for.
pub struct Start<'a> {
    /// The logical slot (pgoutput).
    pub slot: &'a str,
    /// The publication.
    pub publication: &'a str,
    /// The slot's confirmed position.
    pub lsn: u64,
    /// The position the relay kept ([`crate::postgres::position`]): the start when it
    /// is later and its provenance certain ([`position::choose`]).
    pub kept: Option<&'a position::Kept>,
    /// The pgoutput protocol to ask for.
    pub protocol: Protocol,
}

/// The pgoutput protocol a stream asks for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Protocol {
    /// `proto_version '1'`: what every supported major speaks, and all an
    /// ordinary slot needs.
    #[default]
    V1,
    /// `proto_version '3', two_phase 'on'` (PostgreSQL 15+), for a slot
    /// created with `two_phase`: prepared transactions come at PREPARE
    /// TRANSACTION as Begin Prepare … Prepare, their outcome later as Commit
    /// Prepared or Rollback Prepared. (The walsender sends those on such a
    /// slot whatever is asked; asking says the relay expects them. On a slot
    /// without `two_phase` the option would turn it on for good, so it is
    /// asked only of slots that have it.)
    TwoPhase,
}

impl Protocol {
    /// The options of START_REPLICATION that choose it.
    fn options(self) -> &'static str {
        match self {
            Protocol::V1 => "proto_version '1'",
            Protocol::TwoPhase => "proto_version '3', two_phase 'on'",
        }
    }
}

/// A logical replication stream after START_REPLICATION.
pub struct WalStream {
    io: Transport,
    /// What was read and not yet taken: whole frames, then at most one partial.
    buf: BytesMut,
    /// `buf` grew for a frame larger than half of [`READ_BUFFER`].
    oversized: bool,
    /// Frontend messages being written.
    out: BytesMut,
    /// The position status updates report: the highest given, or the start.
    confirmed: u64,
    /// A keepalive asked for a reply that has not been sent.
    reply_wanted: bool,
    /// Status updates sent in this session.
    status_updates: u64,
    /// When bytes last arrived (or the caller last set it with
    /// [`WalStream::heard_now`]).
    heard: tokio::time::Instant,
    /// The SASL mechanism of the login, if it was SCRAM.
    mechanism: Option<&'static str>,
    /// What `IDENTIFY_SYSTEM` said.
    system: position::System,
    /// Where the stream started, and why.
    choice: position::Choice,
}

impl WalStream {
    /// Log in on `io` and start streaming `start`.
    pub async fn start(
        io: Transport,
        startup: &Startup<'_>,
        start: &Start<'_>,
    ) -> Result<WalStream, WireError> {
        let mut stream = WalStream {
            io,
            buf: BytesMut::with_capacity(READ_BUFFER),
            oversized: false,
            out: BytesMut::with_capacity(256),
            confirmed: start.lsn,
            reply_wanted: false,
            status_updates: 0,
            heard: tokio::time::Instant::now(),
            mechanism: None,
            system: position::System::default(),
            choice: position::choose(start.lsn, None, &position::System::default()),
        };
        stream.log_in(startup).await?;
        if startup.read_write && stream.show("transaction_read_only").await? != "off" {
            return Err(WireError::ReadOnly);
        }
        stream.system = stream.identify_system().await?;
        stream.choice = position::choose(start.lsn, start.kept, &stream.system);
        stream.confirmed = stream.choice.lsn;
        let sql = format!(
            "START_REPLICATION SLOT \"{}\" LOGICAL {} ({}, publication_names {}, messages 'true')",
            start.slot.replace('"', "\"\""),
            crate::postgres::lsn::format_lsn(stream.choice.lsn),
            start.protocol.options(),
            crate::postgres::sql::quote_literal(start.publication),
        );
        frontend::query(&sql, &mut stream.out)?;
        stream.write_out().await?;
        loop {
            let (tag, body) = stream.frame().await?;
            match tag {
                b'W' => return Ok(stream), // CopyBothResponse
                b'E' => return Err(server_error(&body)),
                _ => {} // notices, parameter status
            }
        }
    }

    /// Log in as libpq does: the StartupMessage, then every authentication
    /// request answered (each answer written before the next is read) until
    /// the server is ready for queries or refuses.
    async fn log_in(&mut self, startup: &Startup<'_>) -> Result<(), WireError> {
        self.send_startup(startup).await?;
        let mut scram = Scram::default();
        loop {
            let (tag, body) = self.frame().await?;
            match tag {
                b'R' => {
                    self.answer(startup, &mut scram, &body)?;
                    if !self.out.is_empty() {
                        self.write_out().await?;
                    }
                }
                b'E' => return Err(server_error(&body)),
                b'Z' => return Ok(()), // ReadyForQuery
                _ => {}                // ParameterStatus, BackendKeyData, notices
            }
        }
    }

    /// The StartupMessage written: a walsender of `startup.database`
    /// (`replication=database`), speaking UTF-8.
    async fn send_startup(&mut self, startup: &Startup<'_>) -> Result<(), WireError> {
        frontend::startup_message(
            [
                ("user", startup.user),
                ("database", startup.database),
                ("replication", "database"),
                ("client_encoding", "UTF8"),
                ("application_name", startup.application_name),
                ("options", startup.options),
            ],
            &mut self.out,
        )?;
        self.write_out().await
    }

    /// The answer to one authentication request (`body` of an `R`
    /// message), put in `out`; `Err` for a request the login must not or
    /// cannot follow.
    ///
    /// As libpq, under `require` nothing but a bound SCRAM exchange may
    /// proceed: not even a password is sent otherwise.
    fn answer(
        &mut self,
        startup: &Startup<'_>,
        scram: &mut Scram,
        body: &[u8],
    ) -> Result<(), WireError> {
        let (code, data) = match body.split_first_chunk::<4>() {
            Some((code, data)) => (i32::from_be_bytes(*code), data),
            None => return Err(WireError::Protocol("short authentication request".into())),
        };
        let require_binding = startup.channel_binding == ChannelBindingMode::Require;
        match code {
            0 => self.accepted(scram, require_binding)?,
            3 if require_binding => {
                return Err(unbound("the server asked for a cleartext password"))
            }
            5 if require_binding => return Err(unbound("the server asked for md5")),
            3 => frontend::password_message(password(startup)?.as_bytes(), &mut self.out)?,
            5 => self.md5(startup, data)?,
            10 => scram.client = Some(self.sasl_start(startup, data)?),
            11 | 12 => self.sasl_continue(scram, code, data)?,
            other => {
                return Err(WireError::Auth(format!(
                    "the server asks for an authentication method the relay does not speak \
                     (code {other}): allow scram-sha-256, md5 or password for the relay's role \
                     in pg_hba.conf"
                )))
            }
        }
        Ok(())
    }

    /// AuthenticationOk taken only when the login proved what it must:
    /// after SCRAM, that the server knows the password (SASLFinal,
    /// checked); under `require`, that the exchange was bound.
    fn accepted(&self, scram: &Scram, require_binding: bool) -> Result<(), WireError> {
        if scram.client.is_some() && !scram.done {
            return Err(WireError::Auth(
                "the server ended SCRAM-SHA-256 without proving it knows the password".into(),
            ));
        }
        if require_binding && self.mechanism != Some(SCRAM_SHA_256_PLUS) {
            return Err(unbound(
                "the server let the role in without authenticating it",
            ));
        }
        Ok(())
    }

    /// The MD5 password message: the role's password hashed with the salt
    /// the server sent.
    fn md5(&mut self, startup: &Startup<'_>, data: &[u8]) -> Result<(), WireError> {
        let salt = data
            .first_chunk::<4>()
            .ok_or_else(|| WireError::Protocol("MD5 request without its salt".into()))?;
        let hash = postgres_protocol::authentication::md5_hash(
            startup.user.as_bytes(),
            password(startup)?.as_bytes(),
            *salt,
        );
        frontend::password_message(hash.as_bytes(), &mut self.out)?;
        Ok(())
    }

    /// SASL started: a mechanism chosen from those the server offers
    /// ([`choose_mechanism`]) and its first message written; the client
    /// that carries the exchange on.
    fn sasl_start(&mut self, startup: &Startup<'_>, data: &[u8]) -> Result<ScramSha256, WireError> {
        let offered: Vec<&[u8]> = data.split(|&b| b == 0).filter(|m| !m.is_empty()).collect();
        let (mechanism, binding) = choose_mechanism(
            &offered,
            startup.channel_binding,
            self.io.tls_server_end_point(),
            matches!(self.io, Transport::Tls(_)),
        )?;
        self.mechanism = Some(mechanism);
        let client = ScramSha256::new(password(startup)?.as_bytes(), binding);
        frontend::sasl_initial_response(mechanism, client.message(), &mut self.out)?;
        Ok(client)
    }

    /// SASLContinue (11) answered, or SASLFinal (12) checked: the server's
    /// proof verified before the exchange counts as done.
    fn sasl_continue(
        &mut self,
        scram: &mut Scram,
        code: i32,
        data: &[u8],
    ) -> Result<(), WireError> {
        let client = scram
            .client
            .as_mut()
            .ok_or_else(|| WireError::Protocol("SASL continuation before SASL started".into()))?;
        let checked = if code == 11 {
            client
                .update(data)
                .map(|()| frontend::sasl_response(client.message(), &mut self.out))
        } else {
            scram.done = true;
            client.finish(data).map(|()| Ok(()))
        };
        checked
            .and_then(|written| written)
            .map_err(|e| WireError::Auth(format!("SCRAM-SHA-256: {e}")))
    }

    /// `SHOW name` on the replication connection (a walsender of a database
    /// runs such SQL).
    async fn show(&mut self, name: &str) -> Result<String, WireError> {
        frontend::query(&format!("SHOW {name}"), &mut self.out)?;
        self.write_out().await?;
        let mut value = None;
        loop {
            let (tag, body) = self.frame().await?;
            match tag {
                b'D' => {
                    // One column: count (2), length (4), text.
                    value = body
                        .get(6..)
                        .and_then(|text| std::str::from_utf8(text).ok())
                        .map(str::to_owned);
                }
                b'E' => return Err(server_error(&body)),
                b'Z' => break,
                _ => {}
            }
        }
        value.ok_or_else(|| WireError::Protocol(format!("SHOW {name} returned no row")))
    }

    /// `IDENTIFY_SYSTEM`: the cluster's identifier, its timeline and where
    /// its WAL ends.
    async fn identify_system(&mut self) -> Result<position::System, WireError> {
        frontend::query("IDENTIFY_SYSTEM", &mut self.out)?;
        self.write_out().await?;
        let mut system = None;
        loop {
            let (tag, body) = self.frame().await?;
            match tag {
                b'D' => system = Some(identified(&body)?),
                b'E' => return Err(server_error(&body)),
                b'Z' => break,
                _ => {} // RowDescription, CommandComplete, notices
            }
        }
        system.ok_or_else(|| WireError::Protocol("IDENTIFY_SYSTEM returned no row".into()))
    }

    /// What `IDENTIFY_SYSTEM` said about the server.
    pub fn system(&self) -> &position::System {
        &self.system
    }

    /// Where the stream started, and why ([`position::choose`]).
    pub fn choice(&self) -> &position::Choice {
        &self.choice
    }

    /// The SASL mechanism the login used: `SCRAM-SHA-256-PLUS` when it was
    /// bound to the TLS session, `SCRAM-SHA-256`; `None` without SCRAM.
    pub fn mechanism(&self) -> Option<&'static str> {
        self.mechanism
    }

    /// The next message of the stream: from the buffer, or read for.
    /// Cancel-safe (see the module docs).
    pub async fn next(&mut self) -> Result<WalMessage, WireError> {
        loop {
            if let Some(message) = self.buffered()? {
                return Ok(message);
            }
            self.fill().await?;
        }
    }

    /// The next message if the buffer holds all of it.
    pub fn buffered(&mut self) -> Result<Option<WalMessage>, WireError> {
        while let Some((tag, total)) = self.complete()? {
            let body = &self.buf[5..total];
            let message = match (tag, body.first()) {
                (b'd', Some(b'w')) if body.len() >= 25 => WalMessage::Data {
                    start: be_u64(&body[1..9]),
                    // wal_end (9..17) and the send time (17..25) are not used.
                    data: Bytes::copy_from_slice(&body[25..]),
                },
                (b'd', Some(b'k')) if body.len() >= 18 => {
                    self.reply_wanted |= body[17] != 0;
                    WalMessage::KeepAlive {
                        wal_end: be_u64(&body[1..9]),
                    }
                }
                (b'd', kind) => {
                    return Err(WireError::Protocol(format!(
                        "unknown or short CopyData message (kind {:?}, {} bytes)",
                        kind.map(|&k| k as char),
                        body.len()
                    )))
                }
                (b'E', _) => return Err(server_error(body)),
                // CopyDone; or CommandComplete, which a walsender sends
                // alone when the server shuts down once the client has
                // confirmed everything it sent (WalSndDone).
                (b'c' | b'C', _) => return Err(WireError::Ended),
                (b'N' | b'S', _) => {
                    // A notice or a parameter change: nothing to act on.
                    self.buf.advance(total);
                    continue;
                }
                (other, _) => {
                    return Err(WireError::Protocol(format!(
                        "unexpected message {:?} in the replication stream",
                        other as char
                    )))
                }
            };
            self.buf.advance(total);
            return Ok(Some(message));
        }
        Ok(None)
    }

    /// The tag and length of the first frame, if all of it is buffered.
    fn complete(&mut self) -> Result<Option<(u8, usize)>, WireError> {
        let Some(header) = self.buf.first_chunk::<5>() else {
            return Ok(None);
        };
        let length = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
        if !(4..=MAX_MESSAGE).contains(&length) {
            return Err(WireError::Protocol(format!(
                "a message of {length} bytes (tag {:?})",
                header[0] as char
            )));
        }
        let total = 1 + length;
        if self.buf.len() < total {
            // Room for exactly the rest of it; the next reads complete it.
            self.oversized |= total > READ_BUFFER / 2;
            self.buf.reserve(total - self.buf.len());
            return Ok(None);
        }
        Ok(Some((header[0], total)))
    }

    /// One read from the socket into the buffer.
    async fn fill(&mut self) -> Result<(), WireError> {
        if self.oversized && self.buf.len() < READ_BUFFER / 2 {
            // The large message is taken: back to a buffer of the usual size
            // (with what followed it), the large one freed.
            let mut usual = BytesMut::with_capacity(READ_BUFFER);
            usual.extend_from_slice(&self.buf);
            self.buf = usual;
            self.oversized = false;
        } else if !self.oversized && self.buf.capacity() - self.buf.len() < READ_BUFFER / 4 {
            // Moves the partial frame to the front (the buffer is ours
            // alone). Not while a large frame fills the room reserved for it:
            // that would reallocate it, twice its size.
            self.buf.reserve(READ_BUFFER / 2);
        }
        match self.io.read_buf(&mut self.buf).await? {
            0 => Err(WireError::Closed),
            _ => {
                self.heard = tokio::time::Instant::now();
                Ok(())
            }
        }
    }

    /// The next whole frame, read for as needed: its tag and body.
    /// For the start-up exchange, where nothing is hot.
    async fn frame(&mut self) -> Result<(u8, Bytes), WireError> {
        loop {
            if let Some((tag, total)) = self.complete()? {
                let body = Bytes::copy_from_slice(&self.buf[5..total]);
                self.buf.advance(total);
                return Ok((tag, body));
            }
            self.fill().await?;
        }
    }

    async fn write_out(&mut self) -> Result<(), WireError> {
        self.io.write_all(&self.out).await?;
        self.io.flush().await?;
        self.out.clear();
        Ok(())
    }

    /// Whether a keepalive asked for a reply not yet sent.
    pub fn reply_wanted(&self) -> bool {
        self.reply_wanted
    }

    /// Status updates sent on this stream.
    pub fn status_updates(&self) -> u64 {
        self.status_updates
    }

    /// How long nothing has arrived (see [`WalStream::heard_now`]).
    pub fn quiet(&self) -> std::time::Duration {
        self.heard.elapsed()
    }

    /// Count silence from now: while the caller does not read, what the
    /// server sent waits unread, and its silence means nothing.
    pub fn heard_now(&mut self) {
        self.heard = tokio::time::Instant::now();
    }

    /// Send a standby status update now, reporting `confirmed` as written,
    /// flushed and applied; with `reply`, ask the server to answer at once (a
    /// keepalive), which tells a live connection from a dead one. The
    /// position reported never goes back: a lower one reports the last again.
    pub async fn send_status(&mut self, confirmed: u64, reply: bool) -> Result<(), WireError> {
        self.confirmed = self.confirmed.max(confirmed);
        let now = crate::time::pg_micros_from_unix(crate::time::unix_micros_now());
        // CopyData of 34 bytes: 'r', written, flushed, applied, the clock, reply asked or not.
        self.out.put_u8(b'd');
        self.out.put_u32(4 + 34);
        self.out.put_u8(b'r');
        for _ in 0..3 {
            self.out.put_u64(self.confirmed);
        }
        self.out.put_i64(now);
        self.out.put_u8(u8::from(reply));
        self.write_out().await?;
        self.reply_wanted = false;
        self.status_updates += 1;
        Ok(())
    }

    /// End the stream politely: CopyDone, then Terminate. Errors are moot
    /// (the connection is dropped either way).
    pub async fn close(mut self) {
        frontend::copy_done(&mut self.out);
        frontend::terminate(&mut self.out);
        let _ = self.write_out().await;
        let _ = self.io.shutdown().await;
    }
}

/// A login's SCRAM exchange: the client once SASL started, and whether the
/// server's final message was checked.
#[derive(Default)]
struct Scram {
    client: Option<ScramSha256>,
    done: bool,
}

/// The role's password, or why the login cannot answer a server that asks
/// for one.
fn password<'a>(startup: &Startup<'a>) -> Result<&'a str, WireError> {
    startup.password.ok_or_else(|| {
        WireError::Auth(
            "the server asks for a password and none is set: set postgres.password_file, \
             postgres.password or the password in postgres.url"
                .into(),
        )
    })
}

/// A login refused under `channel_binding = require`, in the words the
/// ordinary connection uses too.
fn unbound(what: &str) -> WireError {
    WireError::Auth(crate::postgres::tls::channel_binding_refused(Some(what)))
}

/// The SASL mechanism and channel-binding flag of a login, as libpq picks
/// them: `SCRAM-SHA-256-PLUS` when the server offers it and the TLS session
/// gives a binding (`tls_server_end_point`), unless `channel_binding` is
/// `disable`; under `require`, nothing else. Without binding, the GS2 flag
/// tells the server whether the client could have bound (`y`: it would
/// notice a man in the middle who removed `-PLUS` from the offer) or not (`n`).
fn choose_mechanism(
    offered: &[&[u8]],
    mode: ChannelBindingMode,
    tls_server_end_point: Option<Vec<u8>>,
    tls: bool,
) -> Result<(&'static str, ChannelBinding), WireError> {
    let has = |mechanism: &str| offered.contains(&mechanism.as_bytes());
    if has(SCRAM_SHA_256_PLUS) && !tls {
        return Err(WireError::Protocol(
            "the server offered SCRAM-SHA-256-PLUS over a connection without TLS".into(),
        ));
    }
    let binding = tls_server_end_point.filter(|_| mode != ChannelBindingMode::Disable);
    if has(SCRAM_SHA_256_PLUS) {
        if let Some(hash) = binding {
            return Ok((
                SCRAM_SHA_256_PLUS,
                ChannelBinding::tls_server_end_point(hash),
            ));
        }
    }
    if mode == ChannelBindingMode::Require {
        let what = if !tls {
            "the connection is not encrypted: the server offered SCRAM-SHA-256 without binding"
        } else if has(SCRAM_SHA_256_PLUS) {
            "the server's certificate is signed with an algorithm that has no tls-server-end-point \
             hash (RSA-PSS or Ed25519)"
        } else {
            "the server offered SCRAM-SHA-256 without binding"
        };
        return Err(WireError::Auth(
            crate::postgres::tls::channel_binding_refused(Some(what)),
        ));
    }
    if !has(SCRAM_SHA_256) {
        return Err(WireError::Auth(format!(
            "the server offers SASL mechanisms {:?}; the relay speaks SCRAM-SHA-256",
            offered
                .iter()
                .map(|m| String::from_utf8_lossy(m))
                .collect::<Vec<_>>()
        )));
    }
    let flag = if binding.is_some() {
        ChannelBinding::unrequested()
    } else {
        ChannelBinding::unsupported()
    };
    Ok((SCRAM_SHA_256, flag))
}

fn be_u64(bytes: &[u8]) -> u64 {
    u64::from_be_bytes(bytes[..8].try_into().expect("eight bytes"))
}

/// `IDENTIFY_SYSTEM`'s row: systemid, timeline, xlogpos, dbname (text).
fn identified(body: &[u8]) -> Result<position::System, WireError> {
    let bad = |what: &str| WireError::Protocol(format!("IDENTIFY_SYSTEM: {what}"));
    let mut rest = body;
    let mut take = |n: usize| {
        if rest.len() < n {
            return Err(bad("short row"));
        }
        let (head, tail) = rest.split_at(n);
        rest = tail;
        Ok(head)
    };
    let count = u16::from_be_bytes(take(2)?.try_into().expect("two bytes"));
    let mut fields = Vec::with_capacity(usize::from(count));
    for _ in 0..count {
        let len = i32::from_be_bytes(take(4)?.try_into().expect("four bytes"));
        let field = match usize::try_from(len) {
            Ok(len) => Some(std::str::from_utf8(take(len)?).map_err(|_| bad("not UTF-8"))?),
            Err(_) => None, // NULL
        };
        fields.push(field);
    }
    let field = |i: usize| fields.get(i).copied().flatten();
    Ok(position::System {
        id: field(0).ok_or_else(|| bad("no systemid"))?.to_owned(),
        timeline: field(1)
            .and_then(|t| t.parse().ok())
            .ok_or_else(|| bad("no timeline"))?,
        wal_end: field(2)
            .and_then(crate::postgres::lsn::parse_lsn)
            .ok_or_else(|| bad("no xlogpos"))?,
    })
}

/// An ErrorResponse's message and SQLSTATE.
fn server_error(body: &[u8]) -> WireError {
    let (mut code, mut message) = (String::new(), String::new());
    let mut rest = body;
    while let Some((&field, tail)) = rest.split_first() {
        if field == 0 {
            break;
        }
        let end = tail.iter().position(|&b| b == 0).unwrap_or(tail.len());
        let value = String::from_utf8_lossy(&tail[..end]);
        match field {
            b'C' => code = value.into_owned(),
            b'M' => message = value.into_owned(),
            _ => {}
        }
        rest = tail.get(end + 1..).unwrap_or_default();
    }
    WireError::Server { code, message }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream over one end of a socket pair, already streaming.
    fn streaming() -> (WalStream, UnixStream) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let stream = WalStream {
            io: Transport::Unix(ours),
            buf: BytesMut::with_capacity(READ_BUFFER),
            oversized: false,
            out: BytesMut::new(),
            confirmed: 0x10,
            reply_wanted: false,
            status_updates: 0,
            heard: tokio::time::Instant::now(),
            mechanism: None,
            system: position::System::default(),
            choice: position::choose(0x10, None, &position::System::default()),
        };
        (stream, theirs)
    }

    #[test]
    fn identify_system_rows_are_read_and_bad_ones_refused() {
        let row = |fields: &[Option<&str>]| {
            let mut body = (fields.len() as u16).to_be_bytes().to_vec();
            for field in fields {
                match field {
                    Some(text) => {
                        body.extend_from_slice(&(text.len() as i32).to_be_bytes());
                        body.extend_from_slice(text.as_bytes());
                    }
                    None => body.extend_from_slice(&(-1i32).to_be_bytes()),
                }
            }
            body
        };
        let system = identified(&row(&[
            Some("7441018406417473822"),
            Some("3"),
            Some("0/1A2B3C8"),
            Some("app"),
        ]))
        .unwrap();
        assert_eq!(
            system,
            position::System {
                id: "7441018406417473822".into(),
                timeline: 3,
                wal_end: 0x1A2B3C8,
            }
        );
        assert!(identified(&row(&[Some("1"), Some("x"), Some("0/1"), None])).is_err());
        assert!(identified(&row(&[Some("1"), Some("1")])).is_err());
        let mut cut = row(&[Some("1"), Some("1"), Some("0/1"), None]);
        cut.truncate(cut.len() - 3);
        for n in 0..cut.len() {
            let _ = identified(&cut[..n]); // never panics
        }
    }

    fn xlog(start: u64, data: &[u8]) -> Vec<u8> {
        let mut body = vec![b'w'];
        body.extend_from_slice(&start.to_be_bytes());
        body.extend_from_slice(&(start + 100).to_be_bytes());
        body.extend_from_slice(&0i64.to_be_bytes());
        body.extend_from_slice(data);
        frame(b'd', &body)
    }

    fn keepalive(wal_end: u64, reply: bool) -> Vec<u8> {
        let mut body = vec![b'k'];
        body.extend_from_slice(&wal_end.to_be_bytes());
        body.extend_from_slice(&0i64.to_be_bytes());
        body.push(reply as u8);
        frame(b'd', &body)
    }

    fn frame(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut out = vec![tag];
        out.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
        out.extend_from_slice(body);
        out
    }

    #[tokio::test]
    async fn messages_split_anywhere_across_reads_come_out_whole_and_in_order() {
        let (mut stream, mut server) = streaming();
        let mut wire = Vec::new();
        let big = vec![7u8; 3 * READ_BUFFER]; // larger than the buffer
        wire.extend(xlog(1, b"first"));
        wire.extend(keepalive(50, false));
        wire.extend(frame(b'N', b"SNOTICE\0\0"));
        wire.extend(xlog(2, &big));
        wire.extend(xlog(3, b"last"));
        let writer = tokio::spawn(async move {
            // Odd-sized pieces, so frames and headers are cut at every offset.
            for piece in wire.chunks(4093) {
                server.write_all(piece).await.unwrap();
                tokio::task::yield_now().await;
            }
            server
        });
        let mut seen = Vec::new();
        for _ in 0..4 {
            seen.push(match stream.next().await.unwrap() {
                WalMessage::Data { start, data } => (start, data.len(), data.first().copied()),
                WalMessage::KeepAlive { wal_end } => (wal_end, 0, None),
            });
        }
        assert_eq!(
            seen,
            [
                (1, 5, Some(b'f')),
                (50, 0, None),
                (2, big.len(), Some(7)),
                (3, 4, Some(b'l'))
            ]
        );
        assert!(!stream.reply_wanted());
        let mut server = writer.await.unwrap();
        assert!(stream.buffered().unwrap().is_none());
        assert_eq!(stream.buf.len(), 0, "nothing left over");
        // The large message's buffer is given back at the next read.
        server.write_all(&keepalive(60, false)).await.unwrap();
        assert!(matches!(
            stream.next().await.unwrap(),
            WalMessage::KeepAlive { wal_end: 60 }
        ));
        assert!(
            stream.buf.capacity() <= READ_BUFFER,
            "{}",
            stream.buf.capacity()
        );
    }

    #[tokio::test]
    async fn a_reply_request_is_answered_with_the_confirmed_position() {
        let (mut stream, mut server) = streaming();
        server.write_all(&keepalive(0x99, true)).await.unwrap();
        assert!(matches!(
            stream.next().await.unwrap(),
            WalMessage::KeepAlive { wal_end: 0x99 }
        ));
        assert!(stream.reply_wanted());
        stream.send_status(0x40, false).await.unwrap();
        assert!(!stream.reply_wanted());
        assert_eq!(stream.status_updates(), 1);
        // A lower position reports the last one again: what was reported
        // is never taken back. This one asks the server for a reply.
        stream.send_status(0x30, true).await.unwrap();
        assert_eq!(stream.status_updates(), 2);
        for asks in [0, 1] {
            let mut update = [0u8; 39];
            server.read_exact(&mut update).await.unwrap();
            assert_eq!(&update[..6], &[b'd', 0, 0, 0, 38, b'r']);
            for at in [6, 14, 22] {
                assert_eq!(be_u64(&update[at..]), 0x40, "position at byte {at}");
            }
            assert_eq!(update[38], asks, "reply requested");
        }
    }

    /// The relay's login as `relay` with password `secret`.
    fn login(channel_binding: ChannelBindingMode) -> Startup<'static> {
        Startup {
            user: "relay",
            password: Some("secret"),
            database: "app",
            application_name: "outbox-relay",
            options: "",
            channel_binding,
            read_write: false,
        }
    }

    const START: Start<'static> = Start {
        slot: "s",
        publication: "p",
        lsn: 0,
        kept: None,
        protocol: Protocol::V1,
    };

    /// A server that starts SCRAM and then says the login succeeded, never
    /// proving it knows the password, is refused.
    #[tokio::test]
    async fn a_server_skipping_the_end_of_scram_is_refused() {
        let (ours, mut server) = UnixStream::pair().unwrap();
        let (startup, start) = (login(ChannelBindingMode::Prefer), START);
        let server = tokio::spawn(async move {
            let mut body = 10i32.to_be_bytes().to_vec();
            body.extend_from_slice(b"SCRAM-SHA-256\0\0");
            server.write_all(&frame(b'R', &body)).await.unwrap();
            server
                .write_all(&frame(b'R', &0i32.to_be_bytes()))
                .await
                .unwrap();
            // Then nothing: a relay that took the word for it would wait
            // for ReadyForQuery, and find the connection closed after 2 s.
            let mut sent = Vec::new();
            let _ = tokio::time::timeout(
                std::time::Duration::from_secs(2),
                server.read_to_end(&mut sent),
            )
            .await;
        });
        let refused = WalStream::start(Transport::Unix(ours), &startup, &start).await;
        match refused {
            Err(WireError::Auth(text)) => assert!(text.contains("without proving"), "{text}"),
            Err(other) => panic!("an authentication error, not {other}"),
            Ok(_) => panic!("an authentication error"),
        }
        server.await.unwrap();
    }

    /// Under `channel_binding = require` a server asking for a password (or
    /// letting the role in unauthenticated) is refused in libpq's words, and
    /// nothing of the password goes out.
    #[tokio::test]
    async fn require_refuses_a_login_without_binding_and_sends_no_password() {
        for (code, salt, what) in [
            (5i32, &[1u8, 2, 3, 4][..], "md5"),
            (3, &[][..], "cleartext"),
            (0, &[][..], "without authenticating"),
        ] {
            let (ours, mut server) = UnixStream::pair().unwrap();
            let (startup, start) = (login(ChannelBindingMode::Require), START);
            let server = tokio::spawn(async move {
                let mut body = code.to_be_bytes().to_vec();
                body.extend_from_slice(salt);
                server.write_all(&frame(b'R', &body)).await.unwrap();
                let mut sent = Vec::new();
                server.read_to_end(&mut sent).await.unwrap();
                sent
            });
            let refused = WalStream::start(Transport::Unix(ours), &startup, &start).await;
            match refused {
                Err(WireError::Auth(text)) => {
                    assert!(
                        text.starts_with(crate::report::CHANNEL_BINDING_NOT_OFFERED)
                            && text.contains(what)
                            && text.contains("postgres.channel_binding"),
                        "{text}"
                    );
                }
                Err(other) => panic!("an authentication error, not {other}"),
                Ok(_) => panic!("refused ({what})"),
            }
            let sent = server.await.unwrap();
            // Only the StartupMessage (its length first): no PasswordMessage.
            let startup_length = u32::from_be_bytes(sent[..4].try_into().unwrap());
            assert_eq!(sent.len(), startup_length as usize, "{what}: {sent:?}");
        }
    }

    #[test]
    fn the_mechanism_is_bound_when_offered_and_possible_and_required_means_required() {
        use ChannelBindingMode::{Disable, Prefer, Require};
        let both: &[&[u8]] = &[b"SCRAM-SHA-256-PLUS", b"SCRAM-SHA-256"];
        let plain: &[&[u8]] = &[b"SCRAM-SHA-256"];
        let hash = || Some(vec![7u8; 32]);
        let pick = |offered, mode, hash, tls| {
            choose_mechanism(offered, mode, hash, tls).map(|(mechanism, _)| mechanism)
        };
        for mode in [Prefer, Require] {
            assert_eq!(
                pick(both, mode, hash(), true).unwrap(),
                "SCRAM-SHA-256-PLUS"
            );
        }
        assert_eq!(pick(both, Disable, hash(), true).unwrap(), "SCRAM-SHA-256");
        // No binding from the certificate (RSA-PSS, Ed25519): unbound, unless required.
        assert_eq!(pick(both, Prefer, None, true).unwrap(), "SCRAM-SHA-256");
        let text = pick(both, Require, None, true).unwrap_err().to_string();
        assert!(text.contains("RSA-PSS"), "{text}");
        // Not offered: unbound, unless required.
        assert_eq!(pick(plain, Prefer, hash(), true).unwrap(), "SCRAM-SHA-256");
        let text = pick(plain, Require, hash(), true).unwrap_err().to_string();
        assert!(
            text.contains(crate::report::CHANNEL_BINDING_NOT_OFFERED),
            "{text}"
        );
        let text = pick(plain, Require, None, false).unwrap_err().to_string();
        assert!(text.contains("not encrypted"), "{text}");
        // -PLUS without TLS cannot be honest.
        assert!(matches!(
            choose_mechanism(both, Prefer, None, false),
            Err(WireError::Protocol(_))
        ));
        // The GS2 header says whether the client could have bound: `y` lets
        // the server notice an offer stripped of -PLUS.
        let header = |offered, mode, hash| {
            let (mechanism, binding) = choose_mechanism(offered, mode, hash, true).unwrap();
            let scram = ScramSha256::new(b"pw", binding);
            (mechanism, scram.message()[..2].to_vec())
        };
        assert_eq!(header(plain, Prefer, hash()).1, b"y,");
        assert_eq!(header(both, Disable, hash()).1, b"n,");
        assert_eq!(header(both, Prefer, hash()).1, b"p=");
    }

    #[tokio::test]
    async fn errors_copy_done_and_a_closed_socket_end_the_stream_with_their_cause() {
        let (mut stream, mut server) = streaming();
        server
            .write_all(&frame(b'E', b"SERROR\0C55000\0Mslot is gone\0\0"))
            .await
            .unwrap();
        let error = stream.next().await.unwrap_err();
        assert_eq!(
            error.to_string(),
            "server error: slot is gone (SQLSTATE 55000)"
        );

        for end in [frame(b'c', b""), frame(b'C', b"COPY 0\0")] {
            let (mut stream, mut server) = streaming();
            server.write_all(&end).await.unwrap();
            assert!(matches!(stream.next().await, Err(WireError::Ended)));
        }

        let (mut stream, server) = streaming();
        drop(server);
        assert!(matches!(stream.next().await, Err(WireError::Closed)));

        let (mut stream, mut server) = streaming();
        server.write_all(&[b'd', 0xff, 0, 0, 0]).await.unwrap();
        assert!(matches!(stream.next().await, Err(WireError::Protocol(_))));
    }
}
