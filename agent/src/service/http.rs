//! The HTTP/1.1 subset the service speaks: one request per connection
//! (`Connection: close`), a `Content-Length` body, bounded sizes.
//!
//! Hand-rolled rather than hyper: the two endpoints (`/metrics`, the
//! control API) take a few small requests a minute from curl, Prometheus
//! and `agent ctl`, all of which speak this subset; hyper (with
//! hyper-util and http-body) would add more code than the agent's own
//! pipeline for no feature used here. Anything outside the subset gets a
//! clear 4xx, never a hang: reads are bounded in size and time, writes in
//! time, and each listener serves at most [`MAX_CONNECTIONS`] at once
//! ([`serve_connections`]), so clients that connect and stall cannot pile
//! up tasks and descriptors in an agent meant to run for months.

use std::fmt::Write as _;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{Semaphore, watch};

/// Most bytes of a request line and headers.
pub const MAX_HEAD_BYTES: usize = 16 << 10;
/// Most bytes of a request body (control requests are tiny JSON objects).
pub const MAX_BODY_BYTES: usize = 64 << 10;
/// A client has this long to send its whole request.
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// A client has this long to take the whole response (`/metrics` of a big
/// job is a few hundred KiB; a scraper reads it in milliseconds).
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections one listener serves at once. Its users are a scraper or
/// two and an operator's `agent ctl`: past this, a connection is answered
/// 503 at once instead of adding a task that may wait out the timeouts.
pub const MAX_CONNECTIONS: usize = 32;
/// First pause after a failed accept, doubled at each failure in a row...
const ACCEPT_PAUSE_FIRST: Duration = Duration::from_millis(10);
/// ...up to this.
pub const ACCEPT_PAUSE_MAX: Duration = Duration::from_secs(1);
/// How long the 503 of a connection over the cap may take, and then the
/// wait for the client to close.
const BUSY_WRITE_TIMEOUT: Duration = Duration::from_millis(100);

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    /// The path without the query string.
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    /// A header's value (names compare case-insensitively).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Vec<u8>,
}

impl Response {
    pub fn text(status: u16, body: impl Into<String>) -> Self {
        Self {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into().into_bytes(),
        }
    }

    pub fn json(status: u16, value: &serde_json::Value) -> Self {
        let mut body = serde_json::to_vec_pretty(value).unwrap_or_default();
        body.push(b'\n');
        Self {
            status,
            content_type: "application/json",
            body,
        }
    }

    /// `{"error": message}` with `status`.
    pub fn error(status: u16, message: impl Into<String>) -> Self {
        Self::json(status, &serde_json::json!({ "error": message.into() }))
    }
}

/// Why a request could not be read (answered with the status it names).
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("the request is malformed: {0}")]
    Malformed(String),
    #[error("the request head is larger than {MAX_HEAD_BYTES} bytes")]
    HeadTooLarge,
    #[error("the request body is larger than {MAX_BODY_BYTES} bytes")]
    BodyTooLarge,
    #[error("chunked request bodies are not supported; send Content-Length")]
    Chunked,
    #[error("the client sent no complete request within {READ_TIMEOUT:?}")]
    Timeout,
    #[error("reading the request: {0}")]
    Io(#[from] std::io::Error),
}

impl RequestError {
    pub fn status(&self) -> u16 {
        match self {
            RequestError::HeadTooLarge => 431,
            RequestError::BodyTooLarge => 413,
            RequestError::Chunked => 411,
            RequestError::Timeout => 408,
            RequestError::Malformed(_) | RequestError::Io(_) => 400,
        }
    }
}

/// Reads one request, bounded in size and time.
pub async fn read_request<R: AsyncRead + Unpin>(r: &mut R) -> Result<Request, RequestError> {
    tokio::time::timeout(READ_TIMEOUT, read_request_untimed(r))
        .await
        .unwrap_or(Err(RequestError::Timeout))
}

async fn read_request_untimed<R: AsyncRead + Unpin>(r: &mut R) -> Result<Request, RequestError> {
    let mut buf = Vec::with_capacity(1024);
    let head_end = loop {
        if let Some(i) = find(&buf, b"\r\n\r\n") {
            break i;
        }
        if buf.len() > MAX_HEAD_BYTES {
            return Err(RequestError::HeadTooLarge);
        }
        let mut chunk = [0u8; 4096];
        let n = r.read(&mut chunk).await?;
        if n == 0 {
            return Err(RequestError::Malformed(
                "the connection closed before the end of the headers".into(),
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    if head_end > MAX_HEAD_BYTES {
        return Err(RequestError::HeadTooLarge);
    }
    let head = std::str::from_utf8(&buf[..head_end])
        .map_err(|_| RequestError::Malformed("the head is not UTF-8".into()))?;
    let mut lines = head.split("\r\n");
    let request_line = lines.next().unwrap_or_default();
    let mut parts = request_line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(RequestError::Malformed(format!(
            "bad request line `{request_line}`"
        )));
    };
    if !version.starts_with("HTTP/1.") {
        return Err(RequestError::Malformed(format!(
            "unsupported version `{version}`"
        )));
    }
    let mut headers = Vec::new();
    for line in lines {
        let Some((k, v)) = line.split_once(':') else {
            return Err(RequestError::Malformed(format!("bad header line `{line}`")));
        };
        headers.push((k.trim().to_string(), v.trim().to_string()));
    }
    let mut req = Request {
        method: method.to_string(),
        path: target.split('?').next().unwrap_or_default().to_string(),
        headers,
        body: Vec::new(),
    };
    if req
        .header("transfer-encoding")
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"))
    {
        return Err(RequestError::Chunked);
    }
    let length: usize = match req.header("content-length") {
        None => 0,
        Some(v) => v
            .parse()
            .map_err(|_| RequestError::Malformed(format!("bad Content-Length `{v}`")))?,
    };
    if length > MAX_BODY_BYTES {
        return Err(RequestError::BodyTooLarge);
    }
    let mut body = buf.split_off(head_end + 4);
    while body.len() < length {
        let mut chunk = vec![0u8; (length - body.len()).min(8192)];
        let n = r.read(&mut chunk).await?;
        if n == 0 {
            return Err(RequestError::Malformed(
                "the connection closed before the end of the body".into(),
            ));
        }
        body.extend_from_slice(&chunk[..n]);
    }
    body.truncate(length);
    req.body = body;
    Ok(req)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

pub fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        202 => "Accepted",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Content Too Large",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "",
    }
}

/// The response's bytes (head and body).
pub fn encode_response(resp: &Response) -> Vec<u8> {
    let mut head = String::new();
    let _ = write!(
        head,
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        resp.status,
        reason(resp.status),
        resp.content_type,
        resp.body.len()
    );
    let mut out = head.into_bytes();
    out.extend_from_slice(&resp.body);
    out
}

/// Writes `resp` and closes, within [`WRITE_TIMEOUT`].
pub async fn write_response<W: AsyncWrite + Unpin>(
    w: &mut W,
    resp: &Response,
) -> std::io::Result<()> {
    write_response_within(w, resp, WRITE_TIMEOUT).await
}

/// Writes `resp` and closes, or gives up after `limit`: a client that
/// stops reading must not hold the connection (and its slot) for ever.
pub async fn write_response_within<W: AsyncWrite + Unpin>(
    w: &mut W,
    resp: &Response,
    limit: Duration,
) -> std::io::Result<()> {
    let write = async {
        w.write_all(&encode_response(resp)).await?;
        w.shutdown().await
    };
    tokio::time::timeout(limit, write)
        .await
        .unwrap_or_else(|_| {
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the client took no response within {limit:?}"),
            ))
        })
}

/// A listener [`serve_connections`] accepts from.
pub trait Listener: Send + Sync + 'static {
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn accept(&self) -> impl Future<Output = std::io::Result<Self::Stream>> + Send;
}

impl Listener for tokio::net::TcpListener {
    type Stream = tokio::net::TcpStream;
    async fn accept(&self) -> std::io::Result<Self::Stream> {
        tokio::net::TcpListener::accept(self).await.map(|(s, _)| s)
    }
}

impl Listener for tokio::net::UnixListener {
    type Stream = tokio::net::UnixStream;
    async fn accept(&self) -> std::io::Result<Self::Stream> {
        tokio::net::UnixListener::accept(self).await.map(|(s, _)| s)
    }
}

/// Pauses after failed accepts. An accept that fails for want of a
/// resource (EMFILE, ENFILE, ENOBUFS) leaves the connection queued, so the
/// listener stays ready and retrying at once spins a core for as long as
/// the shortage lasts; each failure in a row doubles the pause, and a
/// burst is logged once when it starts and once when it ends.
#[derive(Debug, Default)]
pub struct AcceptBackoff {
    failures: u64,
    since: Option<Instant>,
}

impl AcceptBackoff {
    /// A failed accept: how long to pause, and whether it starts a burst.
    pub fn failed(&mut self) -> (Duration, bool) {
        self.failures += 1;
        let first = self.since.is_none();
        if first {
            self.since = Some(Instant::now());
        }
        let doublings = (self.failures - 1).min(16) as u32;
        (
            ACCEPT_PAUSE_FIRST
                .saturating_mul(1 << doublings)
                .min(ACCEPT_PAUSE_MAX),
            first,
        )
    }

    /// An accept succeeded: the burst it ends (failures, how long it
    /// lasted), if one was going on.
    pub fn succeeded(&mut self) -> Option<(u64, Duration)> {
        let since = self.since.take()?;
        Some((std::mem::take(&mut self.failures), since.elapsed()))
    }
}

/// Accepts from `listener` until `stop` turns true and runs `handle` on
/// each connection, at most `max_connections` at once; a connection over
/// that is answered `busy` and closed. `name` names the listener in logs.
pub async fn serve_connections<L, F, Fut>(
    name: &'static str,
    listener: L,
    max_connections: usize,
    busy: Response,
    mut stop: watch::Receiver<bool>,
    handle: F,
) where
    L: Listener,
    F: Fn(L::Stream) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(max_connections));
    let refusals = Arc::new(Semaphore::new(max_connections));
    let mut backoff = AcceptBackoff::default();
    loop {
        let mut stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(s) => {
                    if let Some((failures, lasted)) = backoff.succeeded() {
                        tracing::info!(
                            "{name}: accepting again after {failures} failed accepts over {lasted:?}"
                        );
                    }
                    s
                }
                Err(e) => {
                    let (pause, first) = backoff.failed();
                    if first {
                        tracing::warn!(
                            "{name}: accept failed ({e}); retrying with pauses of up to \
                             {ACCEPT_PAUSE_MAX:?} while it fails (e.g. out of file descriptors)"
                        );
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(pause) => continue,
                        _ = stop.changed() => return,
                    }
                }
            },
            _ = stop.changed() => return,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            // Over the cap the connection is only told so, by tasks bounded
            // in number and time too; past those it is just closed.
            if let Ok(refusing) = refusals.clone().try_acquire_owned() {
                let busy = busy.clone();
                tokio::spawn(async move {
                    let _ = write_response_within(&mut stream, &busy, BUSY_WRITE_TIMEOUT).await;
                    // Closing with the request unread would reset the
                    // connection, and the client could lose the 503.
                    let _ = tokio::time::timeout(BUSY_WRITE_TIMEOUT, async {
                        let mut sink = [0u8; 1024];
                        while let Ok(1..) = stream.read(&mut sink).await {}
                    })
                    .await;
                    drop(refusing);
                });
            }
            continue;
        };
        let served = handle(stream);
        tokio::spawn(async move {
            served.await;
            drop(slot);
        });
    }
}

/// A response as a client reads it (`agent ctl`, tests).
#[derive(Debug)]
pub struct ClientResponse {
    pub status: u16,
    pub body: String,
}

/// Parses a whole response read to the end of the connection.
pub fn parse_response(bytes: &[u8]) -> Result<ClientResponse, String> {
    let end = find(bytes, b"\r\n\r\n").ok_or("the response has no end of headers")?;
    let head = String::from_utf8_lossy(&bytes[..end]);
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad status line in `{}`", head.lines().next().unwrap_or("")))?;
    Ok(ClientResponse {
        status,
        body: String::from_utf8_lossy(&bytes[end + 4..]).into_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn parse(bytes: &[u8]) -> Result<Request, RequestError> {
        let mut r = bytes;
        read_request(&mut r).await
    }

    #[tokio::test]
    async fn requests() {
        let req = parse(
            b"POST /level?x=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\n{\"level\":2}",
        )
        .await
        .unwrap();
        assert_eq!(req.method, "POST");
        assert_eq!(req.path, "/level");
        assert_eq!(req.header("content-length"), Some("11"));
        assert_eq!(req.body, b"{\"level\":2}");
        let req = parse(b"GET /metrics HTTP/1.0\r\n\r\n").await.unwrap();
        assert_eq!((req.method.as_str(), req.body.len()), ("GET", 0));
    }

    #[tokio::test]
    async fn bad_requests_get_their_status() {
        let status = |r: Result<Request, RequestError>| r.unwrap_err().status();
        assert_eq!(status(parse(b"GET\r\n\r\n").await), 400);
        assert_eq!(status(parse(b"GET / SPDY/3\r\n\r\n").await), 400);
        assert_eq!(status(parse(b"GET / HTTP/1.1\r\nbad\r\n\r\n").await), 400);
        assert_eq!(status(parse(b"GET / HTTP/1.1\r\n").await), 400, "truncated");
        assert_eq!(
            status(parse(b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc").await),
            400,
            "short body"
        );
        assert_eq!(
            status(parse(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n").await),
            411
        );
        let big = format!(
            "POST / HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
            MAX_BODY_BYTES + 1
        );
        assert_eq!(status(parse(big.as_bytes()).await), 413);
        let huge = format!(
            "GET / HTTP/1.1\r\nX: {}\r\n\r\n",
            "a".repeat(MAX_HEAD_BYTES)
        );
        assert_eq!(status(parse(huge.as_bytes()).await), 431);
    }

    #[tokio::test]
    async fn a_client_that_stops_reading_is_dropped_after_the_write_timeout() {
        // A pipe holding 64 bytes that nobody reads: a stalled client.
        let (mut server, _client) = tokio::io::duplex(64);
        let resp = Response::text(200, "x".repeat(4096));
        let started = Instant::now();
        let e = write_response_within(&mut server, &resp, Duration::from_millis(100))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn accept_failures_in_a_row_pause_longer_and_log_once() {
        let mut b = AcceptBackoff::default();
        assert_eq!(b.succeeded(), None);
        let (p1, first1) = b.failed();
        let (p2, first2) = b.failed();
        assert!(first1 && !first2);
        assert_eq!((p1, p2), (ACCEPT_PAUSE_FIRST, 2 * ACCEPT_PAUSE_FIRST));
        for _ in 0..100 {
            assert!(b.failed().0 <= ACCEPT_PAUSE_MAX);
        }
        assert_eq!(b.failed().0, ACCEPT_PAUSE_MAX);
        assert_eq!(b.succeeded().map(|(n, _)| n), Some(103));
        // A new burst starts over.
        assert_eq!(b.failed(), (ACCEPT_PAUSE_FIRST, true));
    }

    /// A listener out of file descriptors: every accept fails with EMFILE
    /// (the connection stays queued, the listener stays ready).
    struct Exhausted(Arc<std::sync::atomic::AtomicU64>);

    impl Listener for Exhausted {
        type Stream = tokio::io::DuplexStream;
        fn accept(&self) -> impl Future<Output = std::io::Result<Self::Stream>> + Send {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            std::future::ready(Err(std::io::Error::from_raw_os_error(libc::EMFILE)))
        }
    }

    #[test]
    fn an_accept_loop_out_of_descriptors_backs_off_instead_of_spinning() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let tries = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (stop, stop_rx) = watch::channel(false);
        let l = Exhausted(tries.clone());
        rt.block_on(async {
            let serving = tokio::spawn(serve_connections(
                "test listener",
                l,
                4,
                Response::text(503, "busy"),
                stop_rx,
                |_s| async {},
            ));
            tokio::time::sleep(Duration::from_millis(500)).await;
            stop.send(true).unwrap();
            tokio::time::timeout(Duration::from_secs(2), serving)
                .await
                .expect("the loop stops while backing off")
                .unwrap();
        });
        let tries = tries.load(std::sync::atomic::Ordering::Relaxed);
        // 10, 20, 40, 80, 160 ms...: about 6 tries in half a second.
        assert!((2..=12).contains(&tries), "{tries} accepts in 500 ms");
    }

    #[test]
    fn responses_round_trip() {
        let bytes = encode_response(&Response::error(400, "no"));
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{text}");
        let parsed = parse_response(&bytes).unwrap();
        assert_eq!(parsed.status, 400);
        let v: serde_json::Value = serde_json::from_str(&parsed.body).unwrap();
        assert_eq!(v["error"], "no");
    }

    /// Fuzzing: arbitrary edits of valid requests, read as they would come
    /// off the socket and routed to a control stub, give a response with a
    /// status the API uses, never a panic (6,000 seeded cases per run).
    #[test]
    fn arbitrary_requests_never_panic() {
        struct Stub;
        impl crate::service::control::Control for Stub {
            fn status(&self) -> serde_json::Value {
                serde_json::json!({})
            }
            fn processes(&self) -> serde_json::Value {
                serde_json::json!([])
            }
            fn set_level(
                &self,
                level: crate::service::config::CaptureLevel,
            ) -> Result<serde_json::Value, String> {
                Ok(serde_json::json!({ "level": level.get() }))
            }
            fn dump(
                &self,
                _spec: crate::sinks::flight_recorder::DumpSpec,
                _wait: bool,
            ) -> Result<serde_json::Value, crate::sinks::flight_recorder::DumpError> {
                Ok(serde_json::json!({}))
            }
            fn reload(&self) -> Result<serde_json::Value, String> {
                Ok(serde_json::json!({}))
            }
        }
        let seeds: [&[u8]; 4] = [
            b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n",
            b"POST /level HTTP/1.1\r\nContent-Length: 11\r\n\r\n{\"level\":2}",
            b"POST /dump HTTP/1.1\r\nContent-Length: 40\r\n\r\n{\"job\":\"j\",\"seconds\":30,\"after\":5}   ",
            b"POST /dump HTTP/1.1\r\nContent-Length: 36\r\n\r\n{\"at\":\"2026-01-01T00:00:00Z\",\"job\":\"a\"}",
        ];
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let mut m = crate::service::fuzzing::Mutator::new(0x0ff1_ce42);
        for round in 0..6_000 {
            let bytes = m.mutate(seeds[round % seeds.len()]);
            let mut reader: &[u8] = &bytes;
            match rt.block_on(read_request(&mut reader)) {
                Ok(req) => {
                    let resp = crate::service::control::route(&Stub, &req);
                    assert!(
                        [200, 400, 404, 405, 409, 413, 429].contains(&resp.status),
                        "{} for {:?}",
                        resp.status,
                        String::from_utf8_lossy(&bytes)
                    );
                }
                Err(e) => assert!((400..500).contains(&e.status()), "{e:?}"),
            }
        }
    }
}
