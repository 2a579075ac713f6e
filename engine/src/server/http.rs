//! The server's front door: accepting connections and reading requests, with the limits that
//! keep one client from holding what the others need.
//!
//! - **Connections**: at most `max_connections` open, and optionally
//!   `max_connections_per_address` from one address; one over a limit takes the place of
//!   the connection idle the longest, and only when none is idle is it answered 503 and
//!   closed (see [`super::connections`]). The process's open-file soft limit is raised to
//!   the hard one at start, as vLLM does.
//! - **Headers**: a client must send a request's headers within `header_timeout` (hyper's
//!   header read timeout); the same deadline closes keep-alive connections left idle.
//! - **Bodies**: a request's body must arrive within `body_timeout` (408 otherwise) and be
//!   at most `max_body_bytes` (413, after reading on a little so that a client still
//!   sending reads the answer rather than a reset); it is read here, before any handler runs.
//! - Nagle's algorithm is off: each small SSE chunk (one token) leaves at once, or delayed
//!   ACKs add ~40 ms stalls to inter-token latency.
//!
//! Shutdown stops accepting, then lets open requests finish for up to the drain timeout;
//! past it, or at a second signal, it ends them (each stream gets a final error event).

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower::ServiceExt;

use super::api::ApiError;
use super::connections::{BusyBody, Connections};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HttpLimits {
    pub max_connections: usize,
    /// From one IP address; none: no limit but `max_connections`.
    pub max_connections_per_address: Option<usize>,
    pub header_timeout: Duration,
    pub body_timeout: Duration,
    pub max_body_bytes: usize,
    /// The cheap endpoints' answers a second, together, after a burst of a tenth of that
    /// (see `server::pace`).
    pub cheap_per_second: u32,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            max_connections: 1024,
            max_connections_per_address: None,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_body_bytes: 4 << 20,
            cheap_per_second: 1000,
        }
    }
}

/// Reads each request's body within the limits before the handlers see it.
pub fn with_body_limits(app: Router, limits: HttpLimits) -> Router {
    app.layer(axum::middleware::from_fn_with_state(limits, read_body))
}

/// Past `max_body_bytes`, how much more of a refused body is read and dropped, and for how
/// long, before the 413 goes out. A client still sending when the server closes would get a
/// connection reset instead of the answer (the reset discards the response unread); reading
/// on a while is nginx's "lingering close", bounded so it costs little.
const LINGER_BYTES: usize = 64 << 20;
const LINGER_TIME: Duration = Duration::from_secs(2);

enum BodyError {
    TooLarge,
    Broken(axum::Error),
}

/// The whole body when it is at most `limit` bytes.
async fn read_limited(body: Body, limit: usize) -> Result<bytes::Bytes, BodyError> {
    use futures_util::StreamExt;
    let mut stream = body.into_data_stream();
    let mut buf = bytes::BytesMut::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(BodyError::Broken)?;
        if buf.len() + chunk.len() > limit {
            let mut dropped = buf.len() + chunk.len() - limit;
            let linger = async {
                while let Some(Ok(chunk)) = stream.next().await {
                    dropped += chunk.len();
                    if dropped > LINGER_BYTES {
                        break;
                    }
                }
            };
            let _ = tokio::time::timeout(LINGER_TIME, linger).await;
            return Err(BodyError::TooLarge);
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf.freeze())
}

async fn read_body(State(limits): State<HttpLimits>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let read = read_limited(body, limits.max_body_bytes);
    match tokio::time::timeout(limits.body_timeout, read).await {
        Ok(Ok(bytes)) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Ok(Err(BodyError::TooLarge)) => ApiError::too_large(format!(
            "request body too large: more than {} bytes",
            limits.max_body_bytes
        ))
        .into_response(),
        Ok(Err(BodyError::Broken(e))) => {
            ApiError::bad_request(None, format!("cannot read the request body: {e}"))
                .into_response()
        }
        Err(_) => ApiError {
            status: axum::http::StatusCode::REQUEST_TIMEOUT,
            ..ApiError::bad_request(
                None,
                format!(
                    "the request body did not arrive within {} s",
                    limits.body_timeout.as_secs_f64()
                ),
            )
        }
        .into_response(),
    }
}

/// What happens to open requests at shutdown.
pub struct Drain {
    /// How long open requests may take to finish.
    pub timeout: Duration,
    /// Ends them at once when it completes first (a second signal).
    pub force: std::pin::Pin<Box<dyn Future<Output = ()> + Send>>,
    /// Ends the engine's live requests: their streams get a final error event.
    pub end_requests: Box<dyn FnOnce() + Send>,
}

/// Serves `app` (its bodies read by [`with_body_limits`]) on `listener` until `shutdown`
/// completes, then drains open requests.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()>,
    drain: Drain,
) {
    let connections = Connections::new(limits.max_connections, limits.max_connections_per_address);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                // Out of descriptors or a connection reset before accept: go on.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let ticket = match connections.admit(peer.ip(), Instant::now()) {
            Ok(ticket) => Arc::new(ticket),
            Err(refusal) => {
                tokio::spawn(refuse(stream, refusal.message()));
                continue;
            }
        };
        let service = hyper::service::service_fn({
            let (app, ticket) = (app.clone(), ticket.clone());
            move |req: hyper::Request<Incoming>| {
                let busy = ticket.busy();
                let response = app.clone().oneshot(req.map(Body::new));
                async move {
                    let response = response.await?;
                    Ok::<_, Infallible>(response.map(|inner| Body::new(BusyBody::new(inner, busy))))
                }
            }
        });
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout);
        let conn = builder.serve_connection(TokioIo::new(stream), service);
        tokio::spawn(async move {
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = ticket.close.notified() => {
                    // Reaped or shutting down: after the request in progress, if any.
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
        });
    }
    drop(listener);
    connections.close_all();
    let mut drained = std::pin::pin!(connections.all_closed());
    tokio::select! {
        _ = &mut drained => return,
        _ = tokio::time::sleep(drain.timeout) => {}
        _ = drain.force => {}
    }
    (drain.end_requests)();
    // The ended requests' final events go out; a client that does not read them is not
    // waited for long.
    let _ = tokio::time::timeout(Duration::from_secs(2), drained).await;
}

/// Over a connection limit: a 503 and close.
async fn refuse(mut stream: TcpStream, why: &str) {
    let body = ApiError::overloaded(why).body().to_string();
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: 1\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let write = stream.write_all(response.as_bytes());
    if tokio::time::timeout(Duration::from_secs(1), write)
        .await
        .is_err()
    {
        return;
    }
    // A lingering close: closing with the request unread would reset the connection, and
    // a reset discards the 503 before the client reads it (9 times in 10 for a client still
    // sending its body). So send FIN, then read and drop what the client still sends, until
    // it closes, at most a body's worth or a second. Only so many at once: a flood of
    // connections must not hold the descriptors the limits keep (past it, close at once).
    let Ok(_lingering) = LINGERING.try_acquire() else {
        return;
    };
    let _ = stream.shutdown().await;
    let drain = async {
        let mut buf = [0u8; 8192];
        let mut left = 8usize << 20;
        while left > 0 {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
}

/// Refused connections in their lingering close: at most this many at once.
static LINGERING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(64);

/// Raise the open-file soft limit to the hard limit (vLLM does the same): every
/// connection is a descriptor.
pub fn raise_fd_limit() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: plain syscalls on a local struct.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
                lim.rlim_cur = lim.rlim_max;
                libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_so_many_refused_connections_linger_at_once() {
        let held: Vec<_> = (0..64)
            .map(|_| LINGERING.try_acquire().expect("under the cap"))
            .collect();
        assert!(
            LINGERING.try_acquire().is_err(),
            "past the cap: closed at once"
        );
        drop(held);
        assert!(LINGERING.try_acquire().is_ok());
    }
}
