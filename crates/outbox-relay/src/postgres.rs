//! Connections to Postgres: the ordinary SQL session and the replication session's settings.
//!
//! Both are built from `[postgres] url`, with the password taken from, in this
//! order, `password_file`, `password`, the URL. The replication connection
//! only streams; slot inspection, lag queries and table writes go through the
//! ordinary one.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use pgwire_replication::{Lsn, ReplicationConfig};
use tokio_postgres::config::Host;

use crate::config::{PostgresConfig, Secret};
use crate::tls::{Bridge, MakeRustls, TlsSettings};

/// Where and as whom to connect, resolved from the configuration.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    sql: tokio_postgres::Config,
    host: Endpoint,
    port: u16,
    user: String,
    password: Option<Secret>,
    /// The database.
    pub dbname: String,
    tls: TlsSettings,
    /// The ordinary connection's TLS; `None` for `sslmode=disable`.
    connector: Option<MakeRustls>,
    application_name: String,
}

#[derive(Debug, Clone)]
enum Endpoint {
    Tcp(String),
    Unix(PathBuf),
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
        let (url, _) = crate::tls::split_url(url.expose());
        let mut sql = tokio_postgres::Config::from_str(&url)
            .map_err(|e| ConnInfoError::Url(format!("not a valid Postgres URL: {e}")))?;
        let password = match (&pg.password_file, &pg.password) {
            (Some(path), _) => {
                let text = std::fs::read_to_string(path).map_err(|source| {
                    ConnInfoError::PasswordFile {
                        path: path.clone(),
                        source,
                    }
                })?;
                Some(Secret::new(text.lines().next().unwrap_or_default()))
            }
            (None, Some(password)) => Some(password.clone()),
            (None, None) => sql
                .get_password()
                .map(|p| Secret::new(String::from_utf8_lossy(p))),
        };
        if let Some(password) = &password {
            sql.password(password.expose());
        }
        sql.application_name(&pg.application_name);
        sql.connect_timeout(Duration::from_secs(10));
        let host = match sql.get_hosts().first() {
            Some(Host::Tcp(h)) => Endpoint::Tcp(h.clone()),
            Some(Host::Unix(p)) => Endpoint::Unix(p.clone()),
            None => return Err(ConnInfoError::Url("names no host".into())),
        };
        let port = sql.get_ports().first().copied().unwrap_or(5432);
        // libpq ignores sslmode on unix sockets; so do we (and tokio-postgres
        // would ask the connector for a host name a socket does not have).
        let unix = matches!(host, Endpoint::Unix(_));
        let connector = if unix { None } else { connector };
        // tokio-postgres only knows whether to ask; verification is the connector's.
        sql.ssl_mode(match tls.mode {
            _ if unix => tokio_postgres::config::SslMode::Disable,
            crate::tls::SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            crate::tls::SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            _ => tokio_postgres::config::SslMode::Require,
        });
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
            host,
            port,
            password,
            tls,
            connector,
            application_name: pg.application_name.clone(),
        })
    }

    /// Open an ordinary SQL session; its connection task runs in the background.
    pub async fn connect(&self) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
        Ok(match &self.connector {
            Some(tls) => background(self.sql.connect(tls.clone()).await?),
            None => background(self.sql.connect(tokio_postgres::NoTls).await?),
        })
    }

    /// A replication connection error, TLS failures explained as for the ordinary one.
    pub fn explain_replication(&self, error: &pgwire_replication::PgWireError) -> Option<String> {
        let host = match &self.host {
            Endpoint::Tcp(h) => h.as_str(),
            Endpoint::Unix(_) => return None,
        };
        error
            .is_tls()
            .then(|| crate::tls::explain(&error.to_string(), &self.tls, host))
    }

    /// `host:port/database` for logs (no credentials).
    pub fn display(&self) -> String {
        match &self.host {
            Endpoint::Tcp(h) => format!("{h}:{}/{}", self.port, self.dbname),
            Endpoint::Unix(p) => format!("{}:{}/{}", p.display(), self.port, self.dbname),
        }
    }

    /// For `verify-ca` over TCP, the relay's own TLS for the replication
    /// connection (see [`Bridge`]); `None` otherwise.
    pub async fn bridge(&self) -> Result<Option<Bridge>, crate::tls::TlsError> {
        match (&self.host, self.tls.mode, &self.connector) {
            (Endpoint::Tcp(host), crate::tls::SslMode::VerifyCa, Some(connector)) => {
                Bridge::open(connector, host, self.port).await.map(Some)
            }
            _ => Ok(None),
        }
    }

    /// Settings of a replication session on `slot` for `publication`, starting
    /// at `start`; through `bridge` when there is one.
    pub fn replication(
        &self,
        slot: &str,
        publication: &str,
        start: Lsn,
        bridge: Option<&Bridge>,
    ) -> ReplicationConfig {
        let password = self
            .password
            .as_ref()
            .map(|p| p.expose().to_owned())
            .unwrap_or_default();
        // A unix socket: the server's, or the verify-ca bridge's.
        let unix = |dir: &std::path::Path| {
            ReplicationConfig::unix(
                dir.to_string_lossy(),
                self.port,
                &self.user,
                password.clone(),
                &self.dbname,
                slot,
                publication,
            )
        };
        let base = match (&self.host, bridge) {
            (_, Some(bridge)) => unix(bridge.dir()),
            (Endpoint::Unix(dir), None) => unix(dir),
            (Endpoint::Tcp(h), None) => ReplicationConfig::new(
                h,
                &self.user,
                password.clone(),
                &self.dbname,
                slot,
                publication,
            )
            .with_port(self.port)
            .with_tls(self.tls.replication(h)),
        };
        base.with_start_lsn(start)
            .with_application_name(&self.application_name)
            // Values arrive as text: fix the formats they are printed in.
            .with_options(
                "-c TimeZone=UTC -c DateStyle=ISO -c bytea_output=hex -c extra_float_digits=3",
            )
    }
}

/// An error with its causes, for logs and messages.
///
/// tokio-postgres prints a server error as just "db error" and keeps the
/// server's message in the source; this prints `ERROR: must be owner of …`.
pub struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut text = self.0.to_string();
        let mut source = self.0.source();
        while let Some(cause) = source {
            let more = cause.to_string();
            if !text.contains(&more) {
                text.push_str(": ");
                text.push_str(&more);
            }
            source = cause.source();
        }
        f.write_str(&text)
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
            tracing::debug!(error = %crate::postgres::Chain(&e), "sql connection closed");
        }
    });
    client
}

/// Parse Postgres's `X/Y` LSN text.
pub fn parse_lsn(text: &str) -> Option<u64> {
    Lsn::parse(text).ok().map(|l| l.0)
}

/// Format an LSN as Postgres does.
pub fn format_lsn(lsn: u64) -> String {
    Lsn(lsn).to_string()
}

/// What `pg_replication_slots` says about one slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotState {
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
pub async fn slot_state(
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
pub async fn wal_sender_timeout(
    client: &tokio_postgres::Client,
) -> Result<Duration, tokio_postgres::Error> {
    let row = client.query_one("SHOW wal_sender_timeout", &[]).await?;
    let text: String = row.get(0);
    Ok(crate::config::parse_duration(&text).unwrap_or(Duration::from_secs(60)))
}

/// How often to send standby status updates: `min(1 s, wal_sender_timeout / 2)`.
pub fn status_interval(wal_sender_timeout: Duration) -> Duration {
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
        assert_eq!(info.port, 5433);
        assert_eq!(info.display(), "h:5433/db");
        std::fs::remove_file(dir).unwrap();
    }
}
