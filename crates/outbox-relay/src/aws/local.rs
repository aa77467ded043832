//! A local HTTP endpoint for unit tests of the AWS layer and its sinks: it
//! answers every request with what `answer` makes, then closes the
//! connection (without saying so: a client finds out when it reuses it).

use std::sync::{Arc, Mutex};

/// What the endpoint received, request by request.
#[derive(Clone, Default)]
pub struct Seen {
    /// Each request's head (request line and headers).
    pub heads: Arc<Mutex<Vec<String>>>,
    /// Each request's body.
    pub bodies: Arc<Mutex<Vec<String>>>,
}

/// Serve on a free port of 127.0.0.1: its URL, and what it receives.
/// `answer` gives the whole HTTP response for each request.
pub async fn endpoint(answer: impl Fn() -> String + Send + 'static) -> (String, Seen) {
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
            record.heads.lock().unwrap().push(head);
            record
                .bodies
                .lock()
                .unwrap()
                .push(String::from_utf8_lossy(&body).into_owned());
            let _ = socket.write_all(answer().as_bytes()).await;
        }
    });
    (url, seen)
}
