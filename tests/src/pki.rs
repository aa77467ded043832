//! A throw-away certificate authority for TLS tests, made with the `openssl`
//! command: a CA, a server certificate for `localhost` (a DNS name only, so a
//! connection to `127.0.0.1` fails a host name check), client certificates, and
//! a second, unrelated CA to be wrong with.

use std::path::{Path, PathBuf};
use std::process::Command;

const CA_CONF: &str = "\
[req]
distinguished_name = dn
x509_extensions = ca
prompt = no
[dn]
CN = outbox-relay test CA
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = DNS:localhost
authorityKeyIdentifier = keyid
[client]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = clientAuth
authorityKeyIdentifier = keyid
";

/// A test CA and the certificates it signed, in a temp dir.
pub struct TestPki {
    dir: tempfile::TempDir,
    serial: std::sync::atomic::AtomicU32,
}

impl TestPki {
    /// A CA, a second unrelated CA, and a server certificate for `localhost`.
    /// Panics with openssl's output when a step fails.
    pub fn new() -> TestPki {
        let dir = tempfile::Builder::new()
            .prefix("outbox-relay-pki-")
            .tempdir()
            .expect("temp dir");
        std::fs::write(dir.path().join("ca.cnf"), CA_CONF).expect("write ca.cnf");
        let pki = TestPki {
            dir,
            serial: std::sync::atomic::AtomicU32::new(1),
        };
        for ca in ["ca", "other-ca"] {
            pki.openssl(&[
                "req",
                "-x509",
                "-config",
                "ca.cnf",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-days",
                "3",
                "-keyout",
                &format!("{ca}.key"),
                "-out",
                &format!("{ca}.crt"),
            ]);
        }
        pki.sign("server", "localhost", "server", "ca", "sha256");
        pki
    }

    /// Another server certificate for `localhost` from the same CA, signed
    /// with `digest` (`sha256`, `sha384`, …): for a server whose certificate
    /// hash differs, or a front that is not the server but is trusted as it.
    pub fn another_server(&self, digest: &str) -> (PathBuf, PathBuf) {
        let serial = self.serial.load(std::sync::atomic::Ordering::Relaxed);
        let name = format!("server-{digest}-{serial}");
        self.sign(&name, "localhost", "server", "ca", digest);
        (
            self.path(&format!("{name}.crt")),
            self.path(&format!("{name}.key")),
        )
    }

    /// The CA that signed the server's certificate (PEM).
    pub fn ca(&self) -> PathBuf {
        self.path("ca.crt")
    }

    /// A CA that signed nothing here (PEM).
    pub fn other_ca(&self) -> PathBuf {
        self.path("other-ca.crt")
    }

    /// The server's certificate and key (PEM).
    pub fn server(&self) -> (PathBuf, PathBuf) {
        (self.path("server.crt"), self.path("server.key"))
    }

    /// A client certificate and key for `user` (its common name), signed by the CA.
    pub fn client(&self, user: &str) -> (PathBuf, PathBuf) {
        self.client_of("ca", user)
    }

    /// Like [`TestPki::client`], but signed by the unrelated CA.
    pub fn untrusted_client(&self, user: &str) -> (PathBuf, PathBuf) {
        self.client_of("other-ca", user)
    }

    fn client_of(&self, ca: &str, user: &str) -> (PathBuf, PathBuf) {
        let name = format!("client-{user}-{ca}");
        self.sign(&name, user, "client", ca, "sha256");
        (
            self.path(&format!("{name}.crt")),
            self.path(&format!("{name}.key")),
        )
    }

    fn sign(&self, name: &str, common_name: &str, section: &str, ca: &str, digest: &str) {
        self.openssl(&[
            "req",
            "-new",
            "-config",
            "ca.cnf",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-subj",
            &format!("/CN={common_name}"),
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
        ]);
        let serial = self
            .serial
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}.crt"),
            "-CAkey",
            &format!("{ca}.key"),
            "-set_serial",
            &serial.to_string(),
            &format!("-{digest}"),
            "-days",
            "3",
            "-extfile",
            "ca.cnf",
            "-extensions",
            section,
            "-out",
            &format!("{name}.crt"),
        ]);
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn openssl(&self, args: &[&str]) {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(self.dir.path())
            .output()
            .unwrap_or_else(|e| panic!("openssl (install it: apt-get install openssl): {e}"));
        assert!(
            out.status.success(),
            "openssl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The directory holding every file.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Default for TestPki {
    fn default() -> Self {
        Self::new()
    }
}
