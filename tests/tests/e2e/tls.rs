//! Postgres TLS on both connections, against a cluster with a test CA: the
//! relay streams under verify-full, a wrong CA and a wrong host name are
//! refused with a message that says what to do, and client certificates
//! authenticate both connections. `ssl_root_cert = "system"` is the operating
//! system's store and insists on the host name; SCRAM is bound to the TLS
//! session (a front with another trusted certificate is caught), and
//! `channel_binding = require` refuses what is not bound; direct TLS works
//! through a front that does what PostgreSQL 17 does, and against 17 and
//! later themselves.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use harness::{
    server_version_num, wait_until, Cluster, FrontStart, PgTlsFront, RelayProcess, TestPki,
};
use outbox_relay::ErrorClass;
use outbox_relay::CHANNEL_BINDING_NOT_OFFERED;
use outbox_relay::{Config, Secret};
use outbox_relay::{WalStream, WireError};

use crate::outbox::{Collect, Outbox, Running, ROLE_PASSWORD};

/// A private cluster with TLS on, its outbox, and the CA. The relay's role
/// authenticates by `method` (`scram-sha-256` or `cert`) over TLS; with a
/// password it may also connect in plain text, so encryption is the relay's
/// own doing. The harness's superuser keeps plain TCP.
async fn tls_outbox(method: &str) -> (Outbox, Arc<TestPki>) {
    let cluster = Arc::new(tokio::task::spawn_blocking(Cluster::start).await.unwrap());
    let mut outbox = Outbox::on(&cluster).await;
    let pki = Arc::new(TestPki::new());
    let hba = hba(&outbox, method);
    tokio::task::spawn_blocking({
        let cluster = Arc::clone(&cluster);
        let pki = Arc::clone(&pki);
        move || cluster.enable_tls(&pki, &hba)
    })
    .await
    .unwrap();
    outbox.reconnect().await;
    (outbox, pki)
}

/// `pg_hba.conf` of [`tls_outbox`]: the relay's role by `method` over TLS
/// (and in plain text, unless `method` is `cert`).
fn hba(outbox: &Outbox, method: &str) -> String {
    format!(
        "local all all trust\n\
         host all {superuser} 127.0.0.1/32 scram-sha-256\n\
         hostssl all {role} 127.0.0.1/32 {method}\n\
         {plain}\n",
        superuser = harness::SUPERUSER,
        role = outbox.role,
        plain = if method == "cert" {
            "hostnossl all all 127.0.0.1/32 reject".to_owned()
        } else {
            format!("hostnossl all {} 127.0.0.1/32 {method}", outbox.role)
        },
    )
}

fn cluster(outbox: &Outbox) -> &Arc<Cluster> {
    outbox.db.cluster().expect("a private cluster")
}

/// The outbox's relay configuration with `host` in the URL and `tls` keys.
fn config(outbox: &Outbox, host: &str, tls: &str) -> Config {
    let mut config = outbox.config(tls);
    let url = outbox.relay_url().replacen("127.0.0.1", host, 1);
    config.postgres.url = Some(Secret::new(url));
    config
}

/// [`config`] through `port` on `host` (a front) instead of the server.
fn config_at(outbox: &Outbox, host: &str, port: u16, tls: &str) -> Config {
    let mut config = outbox.config(tls);
    let server = format!("127.0.0.1:{}", cluster(outbox).port());
    let url = outbox
        .relay_url()
        .replacen(&server, &format!("{host}:{port}"), 1);
    config.postgres.url = Some(Secret::new(url));
    config
}

/// Log the replication connection in under `config` (and start streaming).
async fn replication_login(config: &Config) -> Result<WalStream, WireError> {
    let conn = outbox_relay::ConnInfo::new(&config.postgres).unwrap();
    conn.replicate(
        config.postgres.slot.as_str(),
        &config.postgres.publication,
        0,
        None,
    )
    .await
}

/// Reload the server's configuration and wait until new sessions see it
/// (the postmaster reloads on its own time after `pg_reload_conf()`).
async fn reload_conf(outbox: &Outbox) {
    let loaded = "SELECT extract(epoch FROM pg_conf_load_time())::float8";
    let before: f64 = outbox.sql.query_one(loaded, &[]).await.unwrap().get(0);
    outbox
        .sql
        .batch_execute("SELECT pg_reload_conf()")
        .await
        .unwrap();
    wait_until(
        Duration::from_secs(20),
        "the server reloaded its configuration",
        || async {
            let fresh = harness::connect(outbox.db.url()).await;
            let now: f64 = fresh.query_one(loaded, &[]).await.ok()?.get(0);
            (now > before).then_some(())
        },
    )
    .await;
}

/// Store the relay role's password as an MD5 hash (or the server answers an
/// md5 line of pg_hba.conf with SCRAM).
async fn store_password_as_md5(outbox: &Outbox) {
    outbox
        .sql
        .batch_execute(&format!(
            "SET password_encryption = 'md5'; ALTER ROLE {} PASSWORD '{ROLE_PASSWORD}'",
            outbox.role
        ))
        .await
        .unwrap();
}

fn toml_path(path: &Path) -> String {
    format!("{:?}", path.display().to_string())
}

/// The relay's sessions as Postgres sees them: (backend type, ssl, client DN).
async fn relay_sessions(outbox: &Outbox) -> Vec<(String, bool, Option<String>)> {
    outbox
        .sql
        .query(
            "SELECT a.backend_type, s.ssl, s.client_dn \
             FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
             WHERE a.usename = $1 ORDER BY 1",
            &[&outbox.role],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

/// Stream a few events under `config`; what Postgres saw of the relay's
/// sessions, and every event id delivered (those written before included).
async fn stream_some(
    outbox: &Outbox,
    config: Config,
) -> (Vec<(String, bool, Option<String>)>, Vec<String>) {
    let sink = Collect::default();
    let relay = Running::start(config, sink.clone());
    outbox.wait_slot_active(true).await;
    let ids = outbox.insert_many(3, 2, 2).await;
    wait_until(Duration::from_secs(30), "every event arrived", || async {
        sink.ids().ends_with(&ids)
    })
    .await;
    let last = outbox.commits().await.last().unwrap().end_lsn;
    wait_until(
        Duration::from_secs(30),
        "the slot confirms the last commit",
        || async { outbox.confirmed_flush().await >= last },
    )
    .await;
    let sessions = relay_sessions(outbox).await;
    relay.stop().await;
    (sessions, sink.ids())
}

/// Run the relay until it gives up; its error.
async fn refused(config: Config) -> outbox_relay::RelayError {
    let relay = Running::start(config, Collect::default());
    tokio::time::timeout(Duration::from_secs(30), relay.task)
        .await
        .expect("a certificate problem stops the relay at once")
        .unwrap()
        .expect_err("the relay refuses the connection")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_with_the_test_ca_encrypts_both_connections() {
    let (outbox, pki) = tls_outbox("scram-sha-256").await;
    let config = config(
        &outbox,
        "localhost",
        &format!(
            "ssl_mode = \"verify-full\"\nssl_root_cert = {}",
            toml_path(&pki.ca())
        ),
    );
    let (sessions, _) = stream_some(&outbox, config).await;
    assert!(
        sessions.iter().any(|(kind, _, _)| kind == "walsender"),
        "the replication connection is among them: {sessions:?}"
    );
    assert!(
        sessions.iter().any(|(kind, _, _)| kind == "client backend"),
        "the ordinary connection is among them: {sessions:?}"
    );
    assert!(
        sessions.iter().all(|(_, ssl, _)| *ssl),
        "every session of the relay is encrypted: {sessions:?}"
    );
}

/// MD5 and cleartext passwords (what `pg_hba.conf` may still ask for)
/// authenticate both connections, in plain text (`disable`) and with TLS
/// when the server offers it (`prefer`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn md5_and_cleartext_passwords_log_both_connections_in() {
    for method in ["md5", "password"] {
        let (outbox, _pki) = tls_outbox(method).await;
        // Stored as MD5, or the server answers an md5 line with SCRAM.
        store_password_as_md5(&outbox).await;
        let mut delivered = 0;
        for (mode, encrypted) in [("disable", false), ("prefer", true)] {
            let tls = format!("ssl_mode = \"{mode}\"");
            let (sessions, ids) = stream_some(&outbox, config(&outbox, "127.0.0.1", &tls)).await;
            assert!(
                sessions.iter().any(|(kind, _, _)| kind == "walsender"),
                "{method}, {mode}: the replication connection logged in: {sessions:?}"
            );
            assert!(
                sessions.iter().all(|(_, ssl, _)| *ssl == encrypted),
                "{method}, {mode}: encrypted {encrypted}: {sessions:?}"
            );
            // Three transactions of two each, every time, none twice.
            assert_eq!(ids.len(), 6, "{method}, {mode}: {ids:?}");
            delivered += ids.len();
        }
        assert_eq!(delivered, 12, "{method}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_or_host_name_is_refused_with_a_message_that_says_so() {
    let (outbox, pki) = tls_outbox("scram-sha-256").await;
    let before = outbox.confirmed_flush().await;
    let early = outbox.insert_many(1, 2, 1).await;

    // A CA that did not sign the server's certificate.
    let wrong = config(
        &outbox,
        "localhost",
        &format!(
            "ssl_mode = \"verify-full\"\nssl_root_cert = {}",
            toml_path(&pki.other_ca())
        ),
    );
    let error = refused(wrong.clone()).await;
    let text = error.to_string();
    assert_eq!(error.class(), ErrorClass::Fatal, "{text}");
    assert!(
        text.contains("not signed by a CA in")
            && text.contains(&pki.other_ca().display().to_string())
            && text.contains("postgres.ssl_root_cert"),
        "{text}"
    );
    // The replication connection explains it in the same words.
    let conn = outbox_relay::ConnInfo::new(&wrong.postgres).unwrap();
    let failure = match conn
        .replicate(&outbox.slot, &wrong.postgres.publication, 0, None)
        .await
    {
        Err(outbox_relay::WireError::Tls(e)) => e,
        Err(other) => panic!("a TLS error: {other}"),
        Ok(_) => panic!("the replication connection refuses the wrong CA"),
    };
    assert!(failure.fatal);
    assert!(
        failure.message.contains("not signed by a CA in"),
        "{}",
        failure.message
    );

    // The right CA, but a host name the certificate does not hold.
    let by_ip = |mode: &str| {
        config(
            &outbox,
            "127.0.0.1",
            &format!(
                "ssl_mode = \"{mode}\"\nssl_root_cert = {}",
                toml_path(&pki.ca())
            ),
        )
    };
    let text = refused(by_ip("verify-full")).await.to_string();
    assert!(
        text.contains("not valid for the host name \"127.0.0.1\"") && text.contains("verify-ca"),
        "{text}"
    );

    // Nothing was streamed or confirmed meanwhile.
    assert_eq!(outbox.confirmed_flush().await, before);
    // verify-ca checks the chain only, so the same address works.
    let (sessions, delivered) = stream_some(&outbox, by_ip("verify-ca")).await;
    assert!(sessions.iter().all(|(_, ssl, _)| *ssl), "{sessions:?}");
    assert!(
        sessions.iter().any(|(kind, _, _)| kind == "walsender"),
        "{sessions:?}"
    );
    assert_eq!(
        &delivered[..2],
        &early[..],
        "the events written while the relay was refused arrive first"
    );
    assert_eq!(delivered.len(), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificates_authenticate_both_connections() {
    let (outbox, pki) = tls_outbox("cert").await;
    let (cert, key) = pki.client(&outbox.role);
    let without_password = |tls: &str| {
        let mut config = config(&outbox, "localhost", tls);
        let url = outbox
            .relay_url()
            .replacen("127.0.0.1", "localhost", 1)
            .replacen(&format!(":{ROLE_PASSWORD}@"), "@", 1);
        config.postgres.url = Some(Secret::new(url));
        config
    };
    let verify = format!(
        "ssl_mode = \"verify-full\"\nssl_root_cert = {}",
        toml_path(&pki.ca())
    );

    // Without a certificate the server says what it wants.
    let text = refused(without_password(&verify)).await.to_string();
    assert!(
        text.contains("connection requires a valid client certificate"),
        "{text}"
    );
    // One the server's CA did not sign is refused, and retrying would not help.
    let (bad_cert, bad_key) = pki.untrusted_client(&outbox.role);
    let error = refused(without_password(&format!(
        "{verify}\nssl_cert = {}\nssl_key = {}",
        toml_path(&bad_cert),
        toml_path(&bad_key)
    )))
    .await;
    assert_eq!(error.class(), ErrorClass::Fatal, "{error}");
    let text = error.to_string();
    assert!(
        text.contains("UnknownCA") || text.contains("unknown ca"),
        "{text}"
    );

    let config = without_password(&format!(
        "{verify}\nssl_cert = {}\nssl_key = {}",
        toml_path(&cert),
        toml_path(&key)
    ));
    let (sessions, _) = stream_some(&outbox, config).await;
    let dn = format!("/CN={}", outbox.role);
    assert!(
        sessions.len() >= 2
            && sessions
                .iter()
                .all(|(_, ssl, client_dn)| *ssl && client_dn.as_deref() == Some(dn.as_str())),
        "both connections present the client certificate: {sessions:?}"
    );
}

/// Both connections log in with SCRAM-SHA-256-PLUS, and the server checks the
/// binding: through a front that presents another certificate the relay
/// trusts (same CA, same name), an unbound login passes and a bound one is
/// refused by the server, whose hash of its own certificate differs from the
/// relay's of the front's. A server certificate signed with SHA-384 binds
/// with SHA-384.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_binding_ties_both_connections_to_the_servers_certificate() {
    let (mut outbox, pki) = tls_outbox("scram-sha-256").await;
    let verify = format!(
        "ssl_mode = \"verify-full\"\nssl_root_cert = {}",
        toml_path(&pki.ca())
    );
    let binding = |mode: &str| format!("{verify}\nchannel_binding = \"{mode}\"");

    let (sessions, ids) =
        stream_some(&outbox, config(&outbox, "localhost", &binding("require"))).await;
    assert_eq!(ids.len(), 6);
    assert!(
        sessions.iter().any(|(kind, _, _)| kind == "walsender")
            && sessions.iter().any(|(kind, _, _)| kind == "client backend")
            && sessions.iter().all(|(_, ssl, _)| *ssl),
        "{sessions:?}"
    );
    for (mode, mechanism) in [
        ("require", "SCRAM-SHA-256-PLUS"),
        ("prefer", "SCRAM-SHA-256-PLUS"),
        ("disable", "SCRAM-SHA-256"),
    ] {
        let stream = replication_login(&config(&outbox, "localhost", &binding(mode)))
            .await
            .unwrap_or_else(|e| panic!("{mode}: {e}"));
        assert_eq!(stream.mechanism(), Some(mechanism), "{mode}");
        stream.close().await;
        outbox.wait_slot_active(false).await;
    }

    // The man in the middle.
    let front = PgTlsFront::start(
        cluster(&outbox).port(),
        &pki,
        pki.another_server("sha256"),
        FrontStart::SslRequest,
    )
    .await;
    let through = |mode: &str| config_at(&outbox, "localhost", front.port(), &binding(mode));
    let (_, ids) = stream_some(&outbox, through("disable")).await;
    assert_eq!(ids.len(), 6, "unbound, the front is not noticed");
    for mode in ["prefer", "require"] {
        let error = refused(through(mode)).await;
        let text = error.to_string();
        assert_eq!(error.class(), ErrorClass::Fatal, "{text}");
        assert!(
            text.contains("SCRAM channel binding check failed"),
            "{mode}: {text}"
        );
        match replication_login(&through(mode)).await {
            Err(WireError::Server { message, .. }) => {
                assert_eq!(message, "SCRAM channel binding check failed", "{mode}")
            }
            Err(other) => panic!("{mode}: the server's refusal, not {other}"),
            Ok(_) => panic!("{mode}: the replication connection is refused through the front"),
        }
    }

    // A certificate signed with SHA-384.
    let hba = hba(&outbox, "scram-sha-256");
    tokio::task::spawn_blocking({
        let cluster = Arc::clone(cluster(&outbox));
        let pki = Arc::clone(&pki);
        move || cluster.enable_tls_with(&pki, pki.another_server("sha384"), &hba)
    })
    .await
    .unwrap();
    outbox.reconnect().await;
    // (PostgreSQL 15 may give back what was confirmed before the restart:
    // stream_some waits for the new events only.)
    let (sessions, _) =
        stream_some(&outbox, config(&outbox, "localhost", &binding("require"))).await;
    assert!(
        sessions.iter().any(|(kind, _, _)| kind == "walsender"),
        "{sessions:?}"
    );
}

/// `channel_binding = require` against a role that logs in by md5, a
/// cleartext password or trust: both connections refuse, in the same words,
/// and the relay stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channel_binding_require_refuses_md5_password_and_trust_in_libpqs_words() {
    let (outbox, pki) = tls_outbox("md5").await;
    store_password_as_md5(&outbox).await;
    let require = config(
        &outbox,
        "localhost",
        &format!(
            "ssl_mode = \"verify-full\"\nssl_root_cert = {}\nchannel_binding = \"require\"",
            toml_path(&pki.ca())
        ),
    );
    for (method, what) in [
        ("md5", "asked for md5"),
        ("password", "asked for a cleartext password"),
        ("trust", "without authenticating"),
    ] {
        std::fs::write(
            cluster(&outbox).data_dir().join("pg_hba.conf"),
            hba(&outbox, method),
        )
        .unwrap();
        reload_conf(&outbox).await;

        let error = refused(require.clone()).await;
        let text = error.to_string();
        assert_eq!(error.class(), ErrorClass::Fatal, "{method}: {text}");
        assert!(
            text.contains(CHANNEL_BINDING_NOT_OFFERED) && text.contains("postgres.channel_binding"),
            "{method}: {text}"
        );
        match replication_login(&require).await {
            Err(WireError::Auth(text)) => assert!(
                text.starts_with(CHANNEL_BINDING_NOT_OFFERED) && text.contains(what),
                "{method}: {text}"
            ),
            Err(other) => panic!("{method}: a refusal, not {other}"),
            Ok(_) => panic!("{method}: the replication connection refuses"),
        }
        // Without `require` the same role logs in.
        let prefer = config(
            &outbox,
            "localhost",
            &format!(
                "ssl_mode = \"verify-full\"\nssl_root_cert = {}",
                toml_path(&pki.ca())
            ),
        );
        let stream = replication_login(&prefer)
            .await
            .unwrap_or_else(|e| panic!("{method}: {e}"));
        assert_eq!(stream.mechanism(), None, "{method}");
        stream.close().await;
        outbox.wait_slot_active(false).await;
    }
}

/// Direct TLS (PostgreSQL 17's `sslnegotiation=direct`) through a front
/// that does what PostgreSQL 17 does, in front of any major: TLS from the
/// first byte (an SSLRequest would fail its handshake), ALPN `postgresql` or
/// the door. Then against the server itself: 17 and later stream over it;
/// before 17 the relay says what the closed connection means.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_tls_starts_without_an_ssl_request_and_agrees_on_alpn_postgresql() {
    let (outbox, pki) = tls_outbox("scram-sha-256").await;
    let direct = format!(
        "ssl_mode = \"verify-full\"\nssl_root_cert = {}\nssl_negotiation = \"direct\"\nchannel_binding = \"require\"",
        toml_path(&pki.ca())
    );
    let front = PgTlsFront::start(
        cluster(&outbox).port(),
        &pki,
        pki.server(),
        FrontStart::Direct,
    )
    .await;
    let (sessions, ids) = stream_some(
        &outbox,
        config_at(&outbox, "localhost", front.port(), &direct),
    )
    .await;
    assert_eq!(ids.len(), 6);
    assert!(
        sessions.iter().any(|(kind, _, _)| kind == "walsender")
            && sessions.iter().any(|(kind, _, _)| kind == "client backend"),
        "{sessions:?}"
    );
    let alpn = front.alpn();
    assert!(
        alpn.len() >= 2 && alpn.iter().all(|p| p.as_deref() == Some("postgresql")),
        "every session of both connections agreed on ALPN postgresql: {alpn:?}"
    );

    let config = config(&outbox, "localhost", &direct);
    if server_version_num(&outbox.sql).await >= 170_000 {
        // PostgreSQL 17 and later take direct TLS themselves: both
        // connections stream from the server, encrypted.
        let (sessions, _) = stream_some(&outbox, config).await;
        assert!(
            sessions.iter().any(|(kind, _, _)| kind == "walsender")
                && sessions.iter().any(|(kind, _, _)| kind == "client backend")
                && sessions.iter().all(|(_, ssl, _)| *ssl),
            "{sessions:?}"
        );
        return;
    }
    // Before 17 the server reads the TLS hello as a start-up packet and hangs up.
    let conn = outbox_relay::ConnInfo::new(&config.postgres).unwrap();
    let sql = conn
        .connect()
        .await
        .expect_err("no direct TLS before PostgreSQL 17");
    let text = outbox_relay::Chain(&sql).to_string();
    assert!(text.contains("PostgreSQL 16 and older"), "{text}");
    match replication_login(&config).await {
        Err(WireError::Tls(e)) => {
            assert!(
                e.message.contains("PostgreSQL 16 and older"),
                "{}",
                e.message
            )
        }
        Err(other) => panic!("a TLS error, not {other}"),
        Ok(_) => panic!("no direct TLS before PostgreSQL 17"),
    }
}

/// `ssl_root_cert = "system"` is the operating system's trust store, which
/// `SSL_CERT_FILE` replaces (as for OpenSSL): with the test CA there, the
/// relay binary streams under verify-full, and still checks the host name;
/// without it, the test CA is not trusted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn system_roots_are_the_operating_systems_store_and_check_the_host_name() {
    let (outbox, pki) = tls_outbox("scram-sha-256").await;
    let dir = tempfile::tempdir().unwrap();
    let file = |host: &str| {
        let path = dir.path().join(format!("relay-{host}.toml"));
        let text = outbox
            .config_toml("ssl_root_cert = \"system\"")
            .replacen("127.0.0.1", host, 1);
        std::fs::write(&path, text).unwrap();
        path
    };
    let ca = pki.ca();
    let with_ca = [("SSL_CERT_FILE", ca.to_str().unwrap())];
    let run = |path: &Path, env: &[(&str, &str)]| {
        RelayProcess::spawn(&["run", "--config", path.to_str().unwrap()], env)
    };

    let mut relay = run(&file("localhost"), &with_ca);
    outbox.wait_slot_active(true).await;
    let ids = outbox.insert_many(2, 2, 1).await;
    wait_until(Duration::from_secs(30), "the events come out", || async {
        crate::outbox::envelope_ids(&relay.stdout_lines()).ends_with(&ids)
    })
    .await;
    relay.sigterm();
    relay
        .wait_exit_async(Duration::from_secs(30))
        .await
        .expect("stops");
    let stderr = relay.stderr_text();
    assert!(
        stderr.contains("trusts the operating system's CA certificates"),
        "{stderr}"
    );

    for (host, env, expected) in [
        (
            "127.0.0.1",
            &with_ca[..],
            "not valid for the host name \"127.0.0.1\"",
        ),
        (
            "localhost",
            &[][..],
            "not signed by a CA in the operating system's trust store",
        ),
    ] {
        let mut relay = run(&file(host), env);
        let status = relay
            .wait_exit_async(Duration::from_secs(30))
            .await
            .expect("a certificate problem stops the relay");
        let stderr = relay.stderr_text();
        assert!(!status.success(), "{stderr}");
        assert!(stderr.contains(expected), "{host}: {stderr}");
    }
}

/// What libpq refuses is refused before connecting, naming the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_libpq_refuses_stop_the_relay_at_startup_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let url = "postgres://u@h/db";
    let cases = [
        (
            format!("url = \"{url}\"\nssl_root_cert = \"system\"\nssl_mode = \"require\""),
            "postgres.ssl_mode",
            "weak sslmode \"require\" may not be used with sslrootcert=system (use \"verify-full\")",
        ),
        (
            format!("url = \"{url}?sslmode=verify-ca&sslrootcert=system\""),
            "postgres.url",
            "weak sslmode \"verify-ca\" may not be used with sslrootcert=system",
        ),
        (
            format!("url = \"{url}\"\nssl_mode = \"disable\"\nchannel_binding = \"require\""),
            "postgres.channel_binding",
            "sslmode is disable",
        ),
        (
            "url = \"postgres://u@%2Ftmp/db\"\nchannel_binding = \"require\"".to_owned(),
            "postgres.channel_binding",
            "unix socket",
        ),
        (
            format!("url = \"{url}\"\nssl_negotiation = \"direct\""),
            "postgres.ssl_negotiation",
            "weak sslmode \"prefer\" may not be used with sslnegotiation=direct",
        ),
        (
            format!("url = \"{url}?channel_binding=require\"\nchannel_binding = \"disable\""),
            "postgres.channel_binding",
            "disagrees",
        ),
    ];
    for (postgres, key, words) in cases {
        let path = dir.path().join("relay.toml");
        std::fs::write(&path, format!("[postgres]\n{postgres}\n")).unwrap();
        let stderr = crate::process::refused_at_startup_naming(&path, &[], key).await;
        assert!(stderr.contains(words), "{key}: {stderr}");
    }
}
