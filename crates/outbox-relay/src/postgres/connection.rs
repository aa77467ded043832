//! Connections to Postgres: the ordinary SQL session and the replication session's settings.
//!
//! Both are built from `[postgres] url`, with the password taken from, in this
//! order, `password_file`, `password`, the URL. The replication connection
//! only streams; slot inspection, lag queries and table writes go through the
//! ordinary one.

use crate::event::Source;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use tokio::net::{TcpStream, UnixStream};
use tokio_postgres::config::{Host, TargetSessionAttrs};
use tokio_postgres::tls::MakeTlsConnect;

use crate::config::{PostgresConfig, Secret};
use crate::postgres::lsn::parse_lsn;
use crate::postgres::silence::Watched;
use crate::postgres::tls::{ChannelBindingMode, MakeRustls, TlsSettings};
use crate::postgres::walstream::{Protocol, Start, Startup, Transport, WalStream, WireError};

/// Where and as whom to connect, resolved from the configuration.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    sql: tokio_postgres::Config,
    /// The hosts of the URL with their ports, tried in order.
    hosts: Vec<(Endpoint, u16)>,
    /// `target_session_attrs=read-write`: only a primary will do.
    read_write: bool,
    user: String,
    password: Option<Secret>,
    /// The database.
    pub dbname: String,
    tls: TlsSettings,
    /// The ordinary connection's TLS; `None` for `sslmode=disable`.
    connector: Option<MakeRustls>,
    application_name: String,
    /// `postgres.receive_timeout`.
    receive_timeout: Duration,
}

#[derive(Debug, Clone)]
enum Endpoint {
    Tcp(String),
    Unix(PathBuf),
}

use crate::postgres::silence::CONNECT_TIMEOUT;

fn connect_timed_out() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("no connection within {} s", CONNECT_TIMEOUT.as_secs()),
    )
}

/// An ordinary SQL session failed: its socket, or Postgres.
#[derive(Debug, thiserror::Error)]
pub enum SqlError {
    /// The socket could not be opened.
    #[error("cannot connect to {endpoint}: {source}")]
    Socket {
        /// `host:port/database`.
        endpoint: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// TLS could not be set up (the message says why and what to do).
    #[error(transparent)]
    Tls(crate::postgres::tls::TlsError),
    /// `target_session_attrs=read-write` and no host of the URL was the primary.
    #[error("{endpoint} accepts no writes (a standby, or read-only): target_session_attrs=read-write looks for the primary among the URL's hosts")]
    ReadOnly {
        /// `host:port/database`.
        endpoint: String,
    },
    /// Postgres refused, or the session broke.
    #[error(transparent)]
    Postgres(#[from] tokio_postgres::Error),
}

/// The connection settings cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConnInfoError {
    /// `postgres.password_file` cannot be read.
    #[error("postgres.password_file: cannot read {path}: {source}")]
    PasswordFile {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `postgres.url` is unusable (validation normally catches this first).
    #[error("postgres.url: {0}")]
    Url(String),
    /// A TLS setting is unusable, e.g. a certificate file that cannot be read.
    #[error("{key}: {message}")]
    Tls {
        /// The key, `postgres.ssl_…`.
        key: String,
        /// What is wrong.
        message: String,
    },
}

/// The password: from `password_file` (its first line), else `password`,
/// else the URL's.
fn password(
    pg: &PostgresConfig,
    sql: &tokio_postgres::Config,
) -> Result<Option<Secret>, ConnInfoError> {
    Ok(match (&pg.password_file, &pg.password) {
        (Some(path), _) => {
            let text =
                std::fs::read_to_string(path).map_err(|source| ConnInfoError::PasswordFile {
                    path: path.clone(),
                    source,
                })?;
            Some(Secret::new(text.lines().next().unwrap_or_default()))
        }
        (None, Some(password)) => Some(password.clone()),
        (None, None) => sql
            .get_password()
            .map(|p| Secret::new(String::from_utf8_lossy(p))),
    })
}

/// The URL's hosts with their ports.
fn endpoints(sql: &tokio_postgres::Config) -> Vec<(Endpoint, u16)> {
    let ports = sql.get_ports();
    sql.get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| {
            // One port for every host, or one each (libpq's rule).
            let port = match ports.len() {
                0 => 5432,
                1 => ports[0],
                _ => ports.get(i).copied().unwrap_or(5432),
            };
            let host = match host {
                Host::Tcp(h) => Endpoint::Tcp(h.clone()),
                Host::Unix(p) => Endpoint::Unix(p.clone()),
            };
            (host, port)
        })
        .collect()
}

/// Tell tokio-postgres how to ask for TLS, how to start it and whether to
/// bind; `unix`: the hosts are sockets, where TLS does not apply.
fn ask_for_tls_as(sql: &mut tokio_postgres::Config, tls: &TlsSettings, unix: bool) {
    // tokio-postgres only knows whether to ask; verification is the connector's.
    sql.ssl_mode(match tls.mode {
        _ if unix => tokio_postgres::config::SslMode::Disable,
        crate::postgres::tls::SslMode::Disable => tokio_postgres::config::SslMode::Disable,
        crate::postgres::tls::SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
        _ => tokio_postgres::config::SslMode::Require,
    });
    sql.ssl_negotiation(match tls.negotiation {
        crate::postgres::tls::SslNegotiation::Postgres => {
            tokio_postgres::config::SslNegotiation::Postgres
        }
        crate::postgres::tls::SslNegotiation::Direct => {
            tokio_postgres::config::SslNegotiation::Direct
        }
    });
    // tokio-postgres binds with what the connector's stream gives
    // (`RustlsStream::channel_binding`) and, for `require`, refuses every
    // login that is not SCRAM-SHA-256-PLUS before sending the password.
    sql.channel_binding(match tls.channel_binding {
        ChannelBindingMode::Disable => tokio_postgres::config::ChannelBinding::Disable,
        ChannelBindingMode::Prefer => tokio_postgres::config::ChannelBinding::Prefer,
        ChannelBindingMode::Require => tokio_postgres::config::ChannelBinding::Require,
    });
}

impl ConnInfo {
    /// Resolve `[postgres]`.
    pub fn new(pg: &PostgresConfig) -> Result<Self, ConnInfoError> {
        let url = pg
            .url
            .as_ref()
            .ok_or_else(|| ConnInfoError::Url("missing".into()))?;
        let tls = pg.tls().map_err(|mut problems| {
            let (key, message) = problems.remove(0);
            ConnInfoError::Tls { key, message }
        })?;
        let connector = tls
            .connector()
            .map_err(|(key, message)| ConnInfoError::Tls { key, message })?;
        let (url, _) = crate::config::tls::split_url(url.expose());
        let mut sql = tokio_postgres::Config::from_str(&url)
            .map_err(|e| ConnInfoError::Url(format!("not a valid Postgres URL: {e}")))?;
        let password = password(pg, &sql)?;
        if let Some(password) = &password {
            sql.password(password.expose());
        }
        sql.application_name(&pg.application_name);
        let hosts = endpoints(&sql);
        let Some((host, _)) = hosts.first() else {
            return Err(ConnInfoError::Url("names no host".into()));
        };
        let read_write = sql.get_target_session_attrs() == TargetSessionAttrs::ReadWrite;
        // libpq ignores sslmode on unix sockets; so do we (and tokio-postgres
        // would ask the connector for a host name a socket does not have).
        let unix = matches!(host, Endpoint::Unix(_));
        let connector = if unix { None } else { connector };
        ask_for_tls_as(&mut sql, &tls, unix);
        Ok(Self {
            user: sql
                .get_user()
                .ok_or_else(|| ConnInfoError::Url("names no user".into()))?
                .to_owned(),
            dbname: sql
                .get_dbname()
                .ok_or_else(|| ConnInfoError::Url("names no database".into()))?
                .to_owned(),
            sql,
            hosts,
            read_write,
            password,
            tls,
            connector,
            application_name: pg.application_name.clone(),
            receive_timeout: pg.receive_timeout,
        })
    }

    /// Open an ordinary SQL session; its connection task runs in the background.
    ///
    /// The hosts of the URL are tried in order, as libpq does; with
    /// `target_session_attrs=read-write` a host that accepts no writes (a
    /// standby) is passed over, so after a failover the relay finds the new
    /// primary. The socket is the relay's own, with TCP keepalives and a
    /// bound on unanswered requests ([`crate::postgres::silence`]): a session on a
    /// connection that went silent ends instead of waiting forever.
    pub async fn connect(&self) -> Result<tokio_postgres::Client, SqlError> {
        let mut last = None;
        for (host, port) in &self.hosts {
            let client = match self.connect_to(host, *port).await {
                Ok(client) => client,
                Err(error) => {
                    last = Some(error);
                    continue;
                }
            };
            if !self.read_write {
                return Ok(client);
            }
            match client.query_one("SHOW transaction_read_only", &[]).await {
                Ok(row) if row.get::<_, &str>(0) == "off" => return Ok(client),
                Ok(_) => {
                    last = Some(SqlError::ReadOnly {
                        endpoint: self.display_one(host, *port),
                    })
                }
                Err(error) => last = Some(error.into()),
            }
        }
        Err(last.expect("ConnInfo::new checks there is a host"))
    }

    async fn connect_to(
        &self,
        host: &Endpoint,
        port: u16,
    ) -> Result<tokio_postgres::Client, SqlError> {
        let mut sql = self.sql.clone();
        if !self.receive_timeout.is_zero() {
            // A lock wait is silence too: end it with an error (55P03, retried)
            // well before the silence bound takes the connection for dead.
            let lock_timeout =
                format!("-c lock_timeout={}", (self.receive_timeout / 2).as_millis());
            let options = match sql.get_options() {
                Some(theirs) => format!("{theirs} {lock_timeout}"),
                None => lock_timeout,
            };
            sql.options(&options);
        }
        let socket_error = |source| SqlError::Socket {
            endpoint: self.display_one(host, port),
            source,
        };
        match host {
            Endpoint::Unix(dir) => {
                let path = dir.join(format!(".s.PGSQL.{port}"));
                let socket = tokio::time::timeout(CONNECT_TIMEOUT, UnixStream::connect(path))
                    .await
                    .unwrap_or_else(|_| Err(connect_timed_out()))
                    .map_err(socket_error)?;
                let socket = Watched::new(socket, self.receive_timeout);
                Ok(background(
                    sql.connect_raw(socket, tokio_postgres::NoTls).await?,
                ))
            }
            Endpoint::Tcp(host) => {
                let socket = tokio::time::timeout(
                    CONNECT_TIMEOUT,
                    TcpStream::connect((host.as_str(), port)),
                )
                .await
                .unwrap_or_else(|_| Err(connect_timed_out()))
                .map_err(socket_error)?;
                socket.set_nodelay(true).map_err(socket_error)?;
                crate::postgres::silence::tune(&socket, self.receive_timeout)
                    .map_err(socket_error)?;
                let mut socket = Watched::new(socket, self.receive_timeout);
                let Some(connector) = &self.connector else {
                    return Ok(background(
                        sql.connect_raw(socket, tokio_postgres::NoTls).await?,
                    ));
                };
                // The TLS request is the relay's own, as on the replication
                // connection: a server that declines a required TLS is then
                // a typed error in the same words on both. What follows is
                // tokio-postgres's handshake, told that the server agreed.
                let required = self.tls.mode != crate::postgres::tls::SslMode::Prefer;
                if crate::postgres::tls::ask_for_tls(connector, &mut socket, host, required)
                    .await
                    .map_err(SqlError::Tls)?
                {
                    sql.ssl_mode(tokio_postgres::config::SslMode::Require);
                    sql.ssl_negotiation(tokio_postgres::config::SslNegotiation::Direct);
                    let tls = MakeTlsConnect::<Watched<TcpStream>>::make_tls_connect(
                        &mut connector.clone(),
                        host,
                    )
                    .map_err(SqlError::Tls)?;
                    Ok(background(sql.connect_raw(socket, tls).await?))
                } else {
                    sql.ssl_mode(tokio_postgres::config::SslMode::Disable);
                    Ok(background(
                        sql.connect_raw(socket, tokio_postgres::NoTls).await?,
                    ))
                }
            }
        }
    }

    /// The same settings without the silence bound on SQL requests, for
    /// one-off sessions whose statements may legitimately run long without
    /// a word: creating a slot (it waits for every running transaction),
    /// building an index, the commands' counts over a large table.
    pub fn without_silence_bound(&self) -> ConnInfo {
        ConnInfo {
            receive_timeout: Duration::ZERO,
            ..self.clone()
        }
    }

    /// `host:port/database` for logs (no credentials); every host, comma
    /// separated, when the URL names several.
    pub fn display(&self) -> String {
        let hosts: Vec<String> = self
            .hosts
            .iter()
            .map(|(host, port)| match host {
                Endpoint::Tcp(h) => format!("{h}:{port}"),
                Endpoint::Unix(p) => format!("{}:{port}", p.display()),
            })
            .collect();
        format!("{}/{}", hosts.join(","), self.dbname)
    }

    fn display_one(&self, host: &Endpoint, port: u16) -> String {
        match host {
            Endpoint::Tcp(h) => format!("{h}:{port}/{}", self.dbname),
            Endpoint::Unix(p) => format!("{}:{port}/{}", p.display(), self.dbname),
        }
    }

    /// Open a replication session on `slot` for `publication`, streaming
    /// from `start` with protocol version 1: over TLS as the ordinary
    /// connection is (same modes, same certificates, same explanations),
    /// authenticated as the same role.
    pub async fn replicate(
        &self,
        slot: &str,
        publication: &str,
        start: u64,
        kept: Option<&crate::postgres::position::Kept>,
    ) -> Result<WalStream, WireError> {
        self.replicate_with(slot, publication, start, kept, Protocol::V1)
            .await
    }

    /// [`ConnInfo::replicate`], asking for `protocol` (two-phase decoding for
    /// a slot created with `two_phase`, see [`Protocol`]). The URL's hosts
    /// are tried in order, as for [`ConnInfo::connect`].
    pub async fn replicate_with(
        &self,
        slot: &str,
        publication: &str,
        start: u64,
        kept: Option<&crate::postgres::position::Kept>,
        protocol: Protocol,
    ) -> Result<WalStream, WireError> {
        // As libpq, a host that fails is passed over whatever the failure
        // (down, starting up, full, refusing the login, a standby); the error
        // reported is the most telling one, a failure of the primary itself
        // before a standby's or an unreachable host's.
        let mut last: Option<WireError> = None;
        for (host, port) in &self.hosts {
            match self
                .replicate_at(host, *port, slot, publication, start, kept, protocol)
                .await
            {
                Ok(stream) => return Ok(stream),
                Err(error) if self.hosts.len() > 1 => {
                    tracing::debug!(host = %self.display_one(host, *port), error = %error, "trying the next host");
                    let telling =
                        |e: &WireError| !matches!(e, WireError::Io(_) | WireError::ReadOnly);
                    if last.as_ref().is_none_or(|l| telling(&error) || !telling(l)) {
                        last = Some(error);
                    }
                }
                Err(error) => return Err(error),
            }
        }
        Err(last.expect("ConnInfo::new checks there is a host"))
    }

    #[allow(clippy::too_many_arguments)]
    async fn replicate_at(
        &self,
        host: &Endpoint,
        port: u16,
        slot: &str,
        publication: &str,
        start: u64,
        kept: Option<&crate::postgres::position::Kept>,
        protocol: Protocol,
    ) -> Result<WalStream, WireError> {
        let io = match host {
            Endpoint::Unix(dir) => Transport::unix(dir, port).await?,
            Endpoint::Tcp(host) => {
                let required = self.tls.mode != crate::postgres::tls::SslMode::Prefer;
                Transport::tcp(
                    host,
                    port,
                    self.connector.as_ref(),
                    required,
                    self.receive_timeout,
                )
                .await?
            }
        };
        let startup = Startup {
            user: &self.user,
            password: self.password.as_ref().map(Secret::expose),
            database: &self.dbname,
            application_name: &self.application_name,
            // Values arrive as text: fix the formats they are printed in.
            options: "-c TimeZone=UTC -c DateStyle=ISO -c bytea_output=hex -c extra_float_digits=3",
            channel_binding: self.tls.channel_binding,
            read_write: self.read_write,
        };
        let start = Start {
            slot,
            publication,
            lsn: start,
            kept,
            protocol,
        };
        WalStream::start(io, &startup, &start).await
    }
}

/// Run a connection's task in the background; its client.
fn background<S, T>(
    (client, connection): (tokio_postgres::Client, tokio_postgres::Connection<S, T>),
) -> tokio_postgres::Client
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %crate::report::Chain(&e), "sql connection closed");
        }
    });
    client
}

/// What `pg_replication_slots` says about one slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SlotState {
    /// Output plugin (`pgoutput` for ours); `None` for a physical slot.
    pub plugin: Option<String>,
    /// Database of a logical slot.
    pub database: Option<String>,
    /// Position confirmed by the consumer.
    pub confirmed_flush: Option<u64>,
    /// Oldest WAL the slot holds.
    pub restart_lsn: Option<u64>,
    /// Backend streaming from it, if any.
    pub active_pid: Option<i32>,
    /// `reserved`, `extended`, `unreserved` or `lost`.
    pub wal_status: Option<String>,
}

/// Look up `slot`; `None` when it does not exist.
pub(crate) async fn slot_state(
    client: &tokio_postgres::Client,
    slot: &str,
) -> Result<Option<SlotState>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "SELECT plugin::text, database::text, confirmed_flush_lsn::text, restart_lsn::text, \
             active_pid, wal_status FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(row.map(|r| SlotState {
        plugin: r.get(0),
        database: r.get(1),
        confirmed_flush: r.get::<_, Option<&str>>(2).and_then(parse_lsn),
        restart_lsn: r.get::<_, Option<&str>>(3).and_then(parse_lsn),
        active_pid: r.get(4),
        wal_status: r.get(5),
    }))
}

/// The server's `wal_sender_timeout`; zero when switched off.
pub(crate) async fn wal_sender_timeout(
    client: &tokio_postgres::Client,
) -> Result<Duration, tokio_postgres::Error> {
    let row = client.query_one("SHOW wal_sender_timeout", &[]).await?;
    let text: String = row.get(0);
    Ok(crate::config::parse_duration(&text).unwrap_or(Duration::from_secs(60)))
}

/// Where events on `client`'s connection come from, for the sink
/// ([`Source`]): the cluster's system identifier (which any role may read),
/// `database` and `table`.
pub(crate) async fn source(
    client: &tokio_postgres::Client,
    database: &str,
    table: &crate::config::TableName,
) -> Result<Source, tokio_postgres::Error> {
    let row = client
        .query_one(
            "SELECT system_identifier::text FROM pg_control_system()",
            &[],
        )
        .await?;
    Ok(Source {
        system: row.get(0),
        database: database.to_owned(),
        table: table.to_string(),
    })
}

/// How often to send standby status updates: `min(1 s, wal_sender_timeout / 2)`.
pub(crate) fn status_interval(wal_sender_timeout: Duration) -> Duration {
    const CEILING: Duration = Duration::from_secs(1);
    if wal_sender_timeout.is_zero() {
        CEILING
    } else {
        CEILING.min(wal_sender_timeout / 2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_unix_socket_takes_no_tls_whatever_the_mode() {
        for mode in ["prefer", "require"] {
            let pg = PostgresConfig {
                url: Some(Secret::new(format!(
                    "postgres://relay@%2Fvar%2Frun%2Fpostgresql/app?sslmode={mode}"
                ))),
                ..PostgresConfig::default()
            };
            let conn = ConnInfo::new(&pg).unwrap();
            assert!(conn.connector.is_none(), "{mode}");
            assert_eq!(
                conn.sql.get_ssl_mode(),
                tokio_postgres::config::SslMode::Disable
            );
        }
    }

    #[test]
    fn status_updates_come_at_least_twice_per_sender_timeout() {
        assert_eq!(
            status_interval(Duration::from_secs(60)),
            Duration::from_secs(1)
        );
        assert_eq!(
            status_interval(Duration::from_secs(1)),
            Duration::from_millis(500)
        );
        assert_eq!(status_interval(Duration::ZERO), Duration::from_secs(1));
    }

    #[test]
    fn the_password_file_wins_and_is_read_to_its_first_line() {
        let dir = std::env::temp_dir().join(format!("or-pw-{}", std::process::id()));
        std::fs::write(&dir, "from-file\nignored\n").unwrap();
        let pg = PostgresConfig {
            url: Some(Secret::new("postgres://u:from-url@h:5433/db")),
            password_file: Some(dir.clone()),
            ..PostgresConfig::default()
        };
        let info = ConnInfo::new(&pg).unwrap();
        assert_eq!(info.password.as_ref().unwrap().expose(), "from-file");
        assert_eq!(info.display(), "h:5433/db");
        std::fs::remove_file(dir).unwrap();
    }

    #[test]
    fn several_hosts_are_tried_in_order_with_their_ports() {
        let info = |url: &str| {
            ConnInfo::new(&PostgresConfig {
                url: Some(Secret::new(url)),
                ..PostgresConfig::default()
            })
            .unwrap()
        };
        let one_port_each = info("postgres://u@a:5433,b:5434/db?target_session_attrs=read-write");
        assert_eq!(one_port_each.display(), "a:5433,b:5434/db");
        assert!(one_port_each.read_write);
        let shared = info("postgres://u@a,b/db");
        assert_eq!(shared.display(), "a:5432,b:5432/db");
        assert!(!shared.read_write);
    }
}
