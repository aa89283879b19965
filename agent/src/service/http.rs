//! The HTTP/1.1 subset the service speaks: one request per connection
//! (`Connection: close`), a `Content-Length` body, bounded sizes.
//!
//! Hand-rolled rather than hyper: the two endpoints (`/metrics`, the
//! control API) take a few small requests a minute from curl, Prometheus
//! and `agent ctl`, all of which speak this subset; hyper (with
//! hyper-util and http-body) would add more code than the agent's own
//! pipeline for no feature used here. Anything outside the subset gets a
//! clear 4xx, never a hang: reads are bounded in size and time.

use std::fmt::Write as _;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Most bytes of a request line and headers.
pub const MAX_HEAD_BYTES: usize = 16 << 10;
/// Most bytes of a request body (control requests are tiny JSON objects).
pub const MAX_BODY_BYTES: usize = 64 << 10;
/// A client has this long to send its whole request.
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);

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

pub async fn write_response<W: AsyncWrite + Unpin>(
    w: &mut W,
    resp: &Response,
) -> std::io::Result<()> {
    w.write_all(&encode_response(resp)).await?;
    w.shutdown().await
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
