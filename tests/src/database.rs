//! The cluster shared by the tests of a process, and one fresh database per test.

use std::fmt;
use std::ops::Deref;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use tokio_postgres::{Client, NoTls};

use crate::cluster::Cluster;

/// Env var with the admin URL of a cluster started once for the whole test run
/// (by `scripts/test.sh`). When unset, each test process starts its own.
pub const ENV_SHARED_URL: &str = "OUTBOX_RELAY_TEST_PG_URL";

/// The lazily started cluster of this process, alive while someone holds an `Arc`.
static SHARED: Mutex<Weak<Cluster>> = Mutex::new(Weak::new());

/// The admin URL of the shared test cluster, plus what keeps that cluster alive.
///
/// Derefs to the URL (`&str`). Keep it alive for as long as the URL is used: when
/// the cluster was started by this process, the last holder (this or a [`TestDb`])
/// to drop stops it.
#[derive(Clone)]
pub struct SharedAdminUrl {
    url: String,
    cluster: Option<Arc<Cluster>>,
}

impl SharedAdminUrl {
    /// The URL (superuser, database `postgres`).
    pub fn as_str(&self) -> &str {
        &self.url
    }

    /// The cluster, when this process started it (`None` when it came from
    /// `OUTBOX_RELAY_TEST_PG_URL`). Do not stop it: other tests share it.
    pub fn cluster(&self) -> Option<&Arc<Cluster>> {
        self.cluster.as_ref()
    }
}

impl Deref for SharedAdminUrl {
    type Target = str;
    fn deref(&self) -> &str {
        &self.url
    }
}

impl fmt::Display for SharedAdminUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.url)
    }
}

impl fmt::Debug for SharedAdminUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("SharedAdminUrl").field(&self.url).finish()
    }
}

/// The shared test cluster: `$OUTBOX_RELAY_TEST_PG_URL` when set, otherwise a
/// [`Cluster`] started on first use in this process and kept while any returned
/// handle (or [`TestDb`]) lives.
///
/// Blocking when it has to start a cluster (a few seconds); inside async code
/// prefer [`TestDb::new`], which calls it on a blocking thread.
pub fn shared_admin_url() -> SharedAdminUrl {
    if let Some(url) = std::env::var(ENV_SHARED_URL).ok().filter(|u| !u.is_empty()) {
        return SharedAdminUrl { url, cluster: None };
    }
    let mut slot = SHARED.lock().unwrap_or_else(PoisonError::into_inner);
    let cluster = slot.upgrade().unwrap_or_else(|| {
        let cluster = Arc::new(Cluster::start());
        *slot = Arc::downgrade(&cluster);
        cluster
    });
    SharedAdminUrl {
        url: cluster.admin_url(),
        cluster: Some(cluster),
    }
}

/// A fresh database `t_<16 hex>` for one test, dropped with everything in it
/// (sessions, walsenders, replication slots) when this value drops.
///
/// Drop order matters: declare a [`crate::RelayProcess`] *after* the `TestDb`
/// so the relay is killed before its database is dropped.
pub struct TestDb {
    name: String,
    url: String,
    admin_url: String,
    /// Keeps a process-local cluster alive; dropped after the cleanup in `drop`.
    _cluster: Option<Arc<Cluster>>,
}

impl TestDb {
    /// Creates a database on the shared cluster (see [`shared_admin_url`]).
    /// Panics if the cluster cannot be reached.
    pub async fn new() -> TestDb {
        let shared = tokio::task::spawn_blocking(shared_admin_url)
            .await
            .unwrap_or_else(|e| panic!("starting the shared test cluster: {e}"));
        Self::create(shared.url, shared.cluster).await
    }

    /// Creates a database on a private `cluster` (for tests that stop or restart
    /// it); the `TestDb` keeps that cluster alive.
    pub async fn on(cluster: &Arc<Cluster>) -> TestDb {
        Self::create(cluster.admin_url(), Some(Arc::clone(cluster))).await
    }

    /// The cluster this process started and the database lives on (`None`
    /// when it came from `OUTBOX_RELAY_TEST_PG_URL`).
    pub fn cluster(&self) -> Option<&Arc<Cluster>> {
        self._cluster.as_ref()
    }

    /// Creates a database on the shared cluster with `options` after
    /// `CREATE DATABASE name`, e.g. `ENCODING 'SQL_ASCII' ... TEMPLATE template0`.
    pub async fn with_options(options: &str) -> TestDb {
        let shared = tokio::task::spawn_blocking(shared_admin_url)
            .await
            .unwrap_or_else(|e| panic!("starting the shared test cluster: {e}"));
        Self::create_with(shared.url, shared.cluster, options).await
    }

    async fn create(admin_url: String, cluster: Option<Arc<Cluster>>) -> TestDb {
        Self::create_with(admin_url, cluster, "").await
    }

    async fn create_with(
        admin_url: String,
        cluster: Option<Arc<Cluster>>,
        options: &str,
    ) -> TestDb {
        let name = format!("t_{:016x}", fastrand::u64(..));
        let admin = connect(&admin_url).await;
        admin
            .batch_execute(&format!("CREATE DATABASE {} {options}", quote_ident(&name)))
            .await
            .unwrap_or_else(|e| panic!("CREATE DATABASE {name}: {e}"));
        TestDb {
            url: with_database(&admin_url, &name),
            name,
            admin_url,
            _cluster: cluster,
        }
    }

    /// The database name, `t_<16 hex>`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// URL of this database, same credentials as [`TestDb::admin_url`].
    pub fn url(&self) -> &str {
        &self.url
    }

    /// URL of the cluster's `postgres` database as superuser.
    pub fn admin_url(&self) -> &str {
        &self.admin_url
    }

    /// A new connection to this database (its connection task is spawned on the
    /// current tokio runtime). Panics if it cannot connect.
    pub async fn client(&self) -> Client {
        connect(&self.url).await
    }

    /// A new superuser connection to the `postgres` database.
    pub async fn admin_client(&self) -> Client {
        connect(&self.admin_url).await
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let (admin_url, name) = (self.admin_url.clone(), self.name.clone());
        // Own thread and runtime: works whether or not we are inside a runtime.
        let joined = std::thread::Builder::new()
            .name(format!("drop-{name}"))
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| format!("cannot build a runtime: {e}"))?;
                rt.block_on(drop_database(&admin_url, &name))
            })
            .map(|handle| handle.join());
        match joined {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(msg))) => eprintln!("harness: cleanup of test database {}: {msg}", self.name),
            Ok(Err(_)) => eprintln!("harness: cleanup of test database {} panicked", self.name),
            Err(e) => eprintln!(
                "harness: cleanup of test database {}: no thread: {e}",
                self.name
            ),
        }
    }
}

/// Rolls back the prepared transactions of `name` (a test that failed
/// between PREPARE and COMMIT PREPARED leaves one): they would keep the
/// database from being dropped, and hold every logical slot created in the
/// cluster afterwards (slot creation waits for running transactions),
/// hanging the tests that come after.
async fn rollback_prepared(admin_url: &str, name: &str) -> Result<(), String> {
    let url = with_database(admin_url, name);
    let (client, conn) = tokio_postgres::connect(&url, NoTls)
        .await
        .map_err(|e| format!("connect {url}: {e}"))?;
    tokio::spawn(conn);
    let prepared = client
        .query(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()",
            &[],
        )
        .await
        .map_err(|e| format!("listing prepared transactions: {e}"))?;
    for row in prepared {
        let gid: String = row.get(0);
        client
            .batch_execute(&format!("ROLLBACK PREPARED '{}'", gid.replace('\'', "''")))
            .await
            .map_err(|e| format!("ROLLBACK PREPARED {gid:?}: {e}"))?;
        eprintln!("harness: rolled back prepared transaction {gid:?} left in {name}");
    }
    Ok(())
}

/// Terminates the sessions (walsenders included) of `name`, rolls back its
/// prepared transactions, drops its replication slots, then drops it.
async fn drop_database(admin_url: &str, name: &str) -> Result<(), String> {
    rollback_prepared(admin_url, name).await?;
    let (client, conn) = tokio_postgres::connect(admin_url, NoTls)
        .await
        .map_err(|e| format!("connect {admin_url}: {e}"))?;
    tokio::spawn(conn);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        client
            .execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE datname = $1 AND pid <> pg_backend_pid()",
                &[&name],
            )
            .await
            .map_err(|e| format!("terminating backends: {e}"))?;
        let slots = client
            .query(
                "SELECT slot_name FROM pg_replication_slots WHERE database = $1",
                &[&name],
            )
            .await
            .map_err(|e| format!("listing replication slots: {e}"))?;
        let mut busy = Vec::new();
        for row in slots {
            let slot: String = row.get(0);
            if let Err(e) = client
                .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
                .await
            {
                busy.push(format!("{slot}: {e}"));
            }
        }
        if busy.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!(
                "replication slots still in use: {}",
                busy.join("; ")
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    client
        .batch_execute(&format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            quote_ident(name)
        ))
        .await
        .map_err(|e| format!("DROP DATABASE: {e}"))
}

/// Connects to `url` without TLS, spawns the connection task on the current
/// tokio runtime and returns the client. Panics (naming the URL) on failure.
pub async fn connect(url: &str) -> Client {
    let (client, conn) = tokio_postgres::connect(url, NoTls)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"));
    // Errors surface on the client's calls; a closed connection is expected in
    // restart tests, so nothing is printed here.
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
}

/// The server's `server_version_num` (e.g. 180004 for 18.4): for the few
/// tests whose expectation differs between majors.
pub async fn server_version_num(client: &Client) -> u32 {
    let text: String = client
        .query_one("SHOW server_version_num", &[])
        .await
        .expect("SHOW server_version_num")
        .get(0);
    text.parse()
        .unwrap_or_else(|e| panic!("server_version_num {text:?}: {e}"))
}

/// `url` with its database (path) replaced by `dbname`; query string kept.
pub fn with_database(url: &str, dbname: &str) -> String {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    let (base, query) = match url[after_scheme..].find('?') {
        Some(q) => url.split_at(after_scheme + q),
        None => (url, ""),
    };
    let authority_end = base[after_scheme..]
        .find('/')
        .map_or(base.len(), |i| after_scheme + i);
    format!("{}/{dbname}{query}", &base[..authority_end])
}

/// Double-quotes an SQL identifier.
pub fn quote_ident(ident: &str) -> String {
    format!("\"{}\"", ident.replace('"', "\"\""))
}

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn with_database_replaces_only_the_path() {
        assert_eq!(
            with_database("postgres://u:p@h:1/postgres", "x"),
            "postgres://u:p@h:1/x"
        );
        assert_eq!(
            with_database("postgres://u:p@h:1", "x"),
            "postgres://u:p@h:1/x"
        );
        assert_eq!(
            with_database("postgresql://u@h/db?sslmode=disable", "x"),
            "postgresql://u@h/x?sslmode=disable"
        );
    }
}
