//! The relay binary as a child process, for kill / restart tests.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Env var overriding the path returned by [`relay_bin`].
pub const ENV_RELAY_BIN: &str = "OUTBOX_RELAY_BIN";

/// The `outbox-relay` binary of this workspace: `$OUTBOX_RELAY_BIN` when set,
/// otherwise `target/<profile>/outbox-relay` next to the running test binary
/// (which lives in `target/<profile>/deps/`). Panics if it is missing.
pub fn relay_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os(ENV_RELAY_BIN).filter(|v| !v.is_empty()) {
        return PathBuf::from(bin);
    }
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe
        .parent()
        .expect("test binary has a parent dir")
        .to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let bin = dir.join("outbox-relay");
    assert!(
        bin.is_file(),
        "{} is missing: build it first: cargo build --bin outbox-relay",
        bin.display()
    );
    bin
}

/// A running child process (normally the relay) whose stdout and stderr go to
/// files in its own temp dir, so a test can read them while it runs.
///
/// Dropping it SIGKILLs the process if it still runs; when the test is
/// panicking, the tail of its stderr and stdout is printed first.
pub struct RelayProcess {
    child: Child,
    program: PathBuf,
    stdout_path: PathBuf,
    stderr_path: PathBuf,
    _dir: tempfile::TempDir,
}

impl RelayProcess {
    /// Starts [`relay_bin`] with `args` and extra environment `envs` (the rest of
    /// the environment is inherited; stdin is `/dev/null`). Panics on failure.
    pub fn spawn(args: &[&str], envs: &[(&str, &str)]) -> RelayProcess {
        Self::spawn_program(&relay_bin(), args, envs)
    }

    /// Like [`RelayProcess::spawn`], for any program.
    pub fn spawn_program(program: &Path, args: &[&str], envs: &[(&str, &str)]) -> RelayProcess {
        let dir = tempfile::Builder::new()
            .prefix("outbox-relay-proc-")
            .tempdir()
            .expect("create a temp dir for the child's output");
        let stdout_path = dir.path().join("stdout");
        let stderr_path = dir.path().join("stderr");
        let create =
            |p: &Path| File::create(p).unwrap_or_else(|e| panic!("create {}: {e}", p.display()));
        let child = Command::new(program)
            .args(args)
            .envs(envs.iter().copied())
            .stdin(Stdio::null())
            .stdout(create(&stdout_path))
            .stderr(create(&stderr_path))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", program.display()));
        RelayProcess {
            child,
            program: program.to_path_buf(),
            stdout_path,
            stderr_path,
            _dir: dir,
        }
    }

    /// The child's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Path of the file receiving stdout.
    pub fn stdout_path(&self) -> &Path {
        &self.stdout_path
    }

    /// Path of the file receiving stderr.
    pub fn stderr_path(&self) -> &Path {
        &self.stderr_path
    }

    /// Everything written to stdout so far (lossy UTF-8).
    pub fn stdout_text(&self) -> String {
        read_lossy(&self.stdout_path)
    }

    /// Everything written to stderr so far (lossy UTF-8).
    pub fn stderr_text(&self) -> String {
        read_lossy(&self.stderr_path)
    }

    /// The complete (newline-terminated) stdout lines so far; a trailing line
    /// still being written is left out.
    pub fn stdout_lines(&self) -> Vec<String> {
        self.stdout_text()
            .split_inclusive('\n')
            .filter_map(|line| line.strip_suffix('\n'))
            .map(|line| line.strip_suffix('\r').unwrap_or(line).to_owned())
            .collect()
    }

    /// Whether the process is still running (not yet exited).
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Sends SIGKILL (no-op if it already exited).
    pub fn kill9(&mut self) {
        if self.is_running() {
            let _ = self.child.kill();
        }
    }

    /// Sends SIGTERM (no-op if it already exited).
    pub fn sigterm(&mut self) {
        self.signal(libc::SIGTERM);
    }

    /// Sends signal `sig` (no-op if it already exited and was reaped, so a
    /// recycled pid is never hit).
    pub fn signal(&mut self, sig: libc::c_int) {
        if self.is_running() {
            send_signal(self.child.id(), sig);
        }
    }

    /// Waits up to `timeout` for the process to exit (blocking, polls every 20 ms);
    /// `None` if it still runs.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// [`RelayProcess::wait_exit`] without blocking the async runtime.
    pub async fn wait_exit_async(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGTERM, then assert a graceful exit (status 0) within 30 s.
    pub async fn stop_gracefully(&mut self) {
        self.sigterm();
        let status = self.wait_exit_async(Duration::from_secs(30)).await;
        assert!(
            status.is_some_and(|s| s.success()),
            "a graceful exit after SIGTERM, not {status:?}; stderr:\n{}",
            self.stderr_text()
        );
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "--- {} (pid {}) stderr, last 60 lines ---\n{}\n--- stdout, last 20 lines ---\n{}",
                self.program.display(),
                self.child.id(),
                tail(&self.stderr_text(), 60),
                tail(&self.stdout_text(), 20)
            );
        }
        if self.is_running() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

fn read_lossy(path: &Path) -> String {
    fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[allow(unsafe_code)]
fn send_signal(pid: u32, sig: libc::c_int) {
    let pid = libc::pid_t::try_from(pid).expect("pid fits pid_t");
    // SAFETY: kill(2) takes plain integers; the pid belongs to our unreaped
    // child (checked by the caller), so it cannot name an unrelated process.
    let rc = unsafe { libc::kill(pid, sig) };
    if rc != 0 {
        eprintln!(
            "harness: kill({pid}, {sig}): {}",
            std::io::Error::last_os_error()
        );
    }
}
