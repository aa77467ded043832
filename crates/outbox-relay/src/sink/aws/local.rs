//! A local HTTP endpoint for unit tests of the AWS layer and its sinks: it
//! answers every request with what `answer` makes of its head, then closes
//! the connection (without saying so: a client finds out when it reuses it).

use std::sync::{Arc, Mutex};

/// What the endpoint received, request by request.
#[derive(Clone, Default)]
pub(crate) struct Seen {
    /// Each request's head (request line and headers).
    pub heads: Arc<Mutex<Vec<String>>>,
    /// Each request's body.
    pub bodies: Arc<Mutex<Vec<String>>>,
}

/// Serve on a free port of 127.0.0.1: its URL, and what it receives.
/// `answer` gives the whole HTTP response to a request of this head.
pub(crate) async fn endpoint(answer: impl Fn(&str) -> String + Send + 'static) -> (String, Seen) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = Seen::default();
    let record = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let mut head = Vec::new();
            while !head.ends_with(b"\r\n\r\n") {
                let Ok(byte) = socket.read_u8().await else {
                    break;
                };
                head.push(byte);
            }
            let head = String::from_utf8_lossy(&head).into_owned();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .and_then(|n| n.trim().parse().ok())
                .unwrap_or(0);
            let mut body = vec![0; length];
            let _ = socket.read_exact(&mut body).await;
            let response = answer(&head);
            record.heads.lock().unwrap().push(head);
            record
                .bodies
                .lock()
                .unwrap()
                .push(String::from_utf8_lossy(&body).into_owned());
            let _ = socket.write_all(response.as_bytes()).await;
        }
    });
    (url, seen)
}

/// A client of `service` at `url` with fixed test credentials.
pub(crate) fn client(service: crate::sink::aws::Service, url: &str) -> crate::sink::aws::Client {
    let credentials =
        aws_credential_types::Credentials::new("AKIDTEST", "secret", None, None, "test");
    let sdk = aws_config::SdkConfig::builder()
        .credentials_provider(
            aws_credential_types::provider::SharedCredentialsProvider::new(credentials),
        )
        .build();
    crate::sink::aws::Client::new(
        &sdk,
        service,
        "us-east-1",
        ("endpoint_url", url),
        4,
        std::time::Duration::from_secs(5),
    )
    .unwrap()
}

/// An HTTP 200 response with the AWS JSON 1.1 `body`.
pub(crate) fn json_ok(body: &str) -> String {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/x-amz-json-1.1\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// An HTTP 400 response refusing the call with the AWS JSON error `code`.
pub(crate) fn json_refusal(code: &str, message: &str) -> String {
    let body = format!(r#"{{"__type":"{code}","message":"{message}"}}"#);
    format!(
        "HTTP/1.1 400 Bad Request\r\ncontent-type: application/x-amz-json-1.1\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}
