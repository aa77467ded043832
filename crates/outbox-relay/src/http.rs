//! The HTTP listener (`[http] listen`): `/metrics` (Prometheus text format),
//! `/healthz` (the process is alive) and `/readyz` (streaming, or polling when
//! the stream is off here; the slot is not lost; lag under
//! `http.ready_max_lag_bytes`).

use std::convert::Infallible;
use std::net::SocketAddr;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::metrics;

/// Bind `listen`; the error names the key.
pub(crate) async fn bind(listen: &str) -> Result<TcpListener, String> {
    let addr: SocketAddr = listen
        .parse()
        .map_err(|_| format!("http.listen: {listen:?} is not an address with a port"))?;
    TcpListener::bind(addr)
        .await
        .map_err(|e| format!("http.listen: cannot listen on {addr}: {e}"))
}

/// Serve until `stop`.
pub(crate) async fn serve(listener: TcpListener, max_lag: i64, stop: CancellationToken) {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
    }
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %crate::report::Chain(&e), "http accept failed");
                    continue;
                }
            },
            _ = stop.cancelled() => return,
        };
        tokio::spawn(async move {
            let service =
                hyper::service::service_fn(move |req| std::future::ready(respond(&req, max_lag)));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn respond(req: &Request<Incoming>, max_lag: i64) -> Result<Response<Full<Bytes>>, Infallible> {
    let m = metrics::get();
    let (status, content_type, body) = match req.uri().path() {
        "/metrics" => (
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            m.encode(),
        ),
        "/healthz" => (StatusCode::OK, "text/plain", "ok\n".to_owned()),
        "/readyz" => match m.not_ready(max_lag) {
            None => (StatusCode::OK, "text/plain", "ready\n".to_owned()),
            Some(reason) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "text/plain",
                format!("not ready: {reason}\n"),
            ),
        },
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain",
            "try /metrics, /healthz or /readyz\n".to_owned(),
        ),
    };
    Ok(Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Full::new(Bytes::from(body)))
        .expect("a valid response"))
}
