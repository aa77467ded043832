//! Postgres TLS on both connections, against a cluster with a test CA: the
//! relay streams under verify-full, a wrong CA and a wrong host name are
//! refused with a message that says what to do, and client certificates
//! authenticate both connections.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use harness::{wait_until, Cluster, TestPki};
use outbox_relay::config::{Config, Secret};
use outbox_relay::replication::ErrorClass;

use crate::outbox::{Collect, Outbox, Running, ROLE_PASSWORD};

/// A private cluster with TLS on, its outbox, and the CA. The relay's role
/// authenticates by `method` (`scram-sha-256` or `cert`) over TLS; with a
/// password it may also connect in plain text, so encryption is the relay's
/// own doing. The harness's superuser keeps plain TCP.
async fn tls_outbox(method: &str) -> (Outbox, Arc<TestPki>) {
    let cluster = Arc::new(tokio::task::spawn_blocking(Cluster::start).await.unwrap());
    let mut outbox = Outbox::on(&cluster).await;
    let pki = TestPki::new();
    let hba = format!(
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
    );
    let pki = Arc::new(pki);
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

/// The outbox's relay configuration with `host` in the URL and `tls` keys.
fn config(outbox: &Outbox, host: &str, tls: &str) -> Config {
    let mut config = outbox.config(tls);
    let url = outbox.relay_url().replacen("127.0.0.1", host, 1);
    config.postgres.url = Some(Secret::new(url));
    config
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
        outbox
            .sql
            .batch_execute(&format!(
                "SET password_encryption = 'md5'; ALTER ROLE {} PASSWORD '{ROLE_PASSWORD}'",
                outbox.role
            ))
            .await
            .unwrap();
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
    let conn = outbox_relay::postgres::ConnInfo::new(&wrong.postgres).unwrap();
    let failure = match conn
        .replicate(&outbox.slot, &wrong.postgres.publication, 0)
        .await
    {
        Err(outbox_relay::walstream::WireError::Tls(e)) => e,
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
