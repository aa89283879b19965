//! `/metrics` and `/healthz` on `metrics.listen` (default
//! `127.0.0.1:9464`): the metrics sink's families as OpenMetrics text, and
//! whether the pipeline is alive (it fed the metrics sink within
//! [`LIVENESS_NS`](crate::sinks::metrics::LIVENESS_NS)).

use tokio::net::TcpListener;
use tokio::sync::watch;

use super::http::{self, Request, Response};
use crate::sinks::metrics::MetricsHandle;

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// One request to its answer.
pub fn route(handle: &MetricsHandle, req: &Request, now: u64) -> Response {
    match (req.method.as_str(), req.path.as_str()) {
        ("GET", "/metrics") => Response {
            status: 200,
            content_type: OPENMETRICS,
            body: handle.render().into_bytes(),
        },
        ("GET", "/healthz") if handle.alive(now) => Response::text(200, "ok\n"),
        ("GET", "/healthz") => Response::text(
            503,
            "the pipeline has not fed the metrics sink recently: it is stuck or stopped\n",
        ),
        (_, "/metrics" | "/healthz") => Response::text(405, "GET only\n"),
        (_, other) => Response::text(404, format!("no {other} here: /metrics, /healthz\n")),
    }
}

/// Serves until `stop` turns true, at most [`http::MAX_CONNECTIONS`]
/// connections at once.
pub async fn serve(listener: TcpListener, handle: MetricsHandle, stop: watch::Receiver<bool>) {
    let busy = Response::text(
        503,
        "too many connections to the metrics endpoint at once; retry later\n",
    );
    http::serve_connections(
        "metrics listener",
        listener,
        http::MAX_CONNECTIONS,
        busy,
        stop,
        move |mut stream| {
            let handle = handle.clone();
            async move {
                let resp = match http::read_request(&mut stream).await {
                    Ok(req) => route(&handle, &req, crate::host::boottime_ns()),
                    Err(e) => Response::text(e.status(), format!("{e}\n")),
                };
                let _ = http::write_response(&mut stream, &resp).await;
            }
        },
    )
    .await
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    use super::*;
    use crate::model::{RankIdentity, Record};
    use crate::sinks::metrics::MetricsSink;
    use crate::sinks::{Sink, SinkCounters};

    fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).unwrap();
        let text = String::from_utf8_lossy(&out).into_owned();
        let r = http::parse_response(&out).unwrap();
        assert!(text.contains("Content-Length:"), "{text}");
        (r.status, r.body)
    }

    #[test]
    fn metrics_and_healthz_over_loopback() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let listener = rt.block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
        let addr = listener.local_addr().unwrap();
        let (mut sink, handle, _) = MetricsSink::new("node-a");
        sink.on_batch(
            &[Record::Identity {
                tgid: 5,
                identity: Box::new(RankIdentity::from_environ(b"RANK=3\0")),
            }],
            &SinkCounters::default(),
        )
        .unwrap();
        let (_stop, stop_rx) = watch::channel(false);
        rt.spawn(serve(listener, handle.clone(), stop_rx));

        let (status, body) = get(addr, "/metrics");
        assert_eq!(status, 200);
        assert!(
            body.contains("xpuscope_agent_records_total{kind=\"identity\"} 1"),
            "{body}"
        );
        assert!(
            body.contains("# TYPE xpuscope_agent_records counter"),
            "{body}"
        );
        assert!(body.ends_with("# EOF\n"));
        assert_eq!(get(addr, "/healthz"), (200, "ok\n".into()));
        assert_eq!(get(addr, "/nope").0, 404);

        // A pipeline not heard from for longer than the liveness bound.
        let req = Request {
            method: "GET".into(),
            path: "/healthz".into(),
            headers: vec![],
            body: vec![],
        };
        let later = crate::host::boottime_ns() + 2 * crate::sinks::metrics::LIVENESS_NS;
        assert_eq!(route(&handle, &req, later).status, 503);
    }

    /// Clients that connect and send nothing hold at most
    /// `MAX_CONNECTIONS` slots: the next one is told 503 at once, not
    /// queued behind them, and a slot frees as soon as a client leaves.
    #[test]
    fn stalled_clients_cannot_take_more_than_the_connection_cap() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let listener = rt.block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
        let addr = listener.local_addr().unwrap();
        let (_sink, handle, _) = MetricsSink::new("node-a");
        let (_stop, stop_rx) = watch::channel(false);
        rt.spawn(serve(listener, handle, stop_rx));
        let mut stalled: Vec<std::net::TcpStream> = (0..http::MAX_CONNECTIONS)
            .map(|_| std::net::TcpStream::connect(addr).unwrap())
            .collect();
        // Every stalled client accepted before the next one comes.
        std::thread::sleep(std::time::Duration::from_millis(300));
        let started = std::time::Instant::now();
        let (status, body) = get(addr, "/metrics");
        assert_eq!(status, 503, "{body}");
        assert!(body.contains("too many connections"), "{body}");
        assert!(
            started.elapsed() < http::READ_TIMEOUT,
            "answered at once, not after the stalled clients' timeout"
        );
        drop(stalled.pop());
        let end = std::time::Instant::now() + std::time::Duration::from_secs(3);
        loop {
            let (status, _) = get(addr, "/metrics");
            if status == 200 {
                break;
            }
            assert!(std::time::Instant::now() < end, "no slot freed: {status}");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}
