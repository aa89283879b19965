//! `agent ctl`: the control API's client over the Unix socket.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Subcommand};
use serde_json::{Value, json};

use crate::service::http::{ClientResponse, parse_response};

// `agent ctl`'s options (`cli` names the subcommand).
#[derive(Args, Debug)]
pub struct CtlArgs {
    /// The service's control socket.
    #[arg(long, default_value = super::DEFAULT_SOCKET)]
    pub socket: PathBuf,
    #[command(subcommand)]
    pub command: CtlCommand,
}

#[derive(Subcommand, Debug)]
pub enum CtlCommand {
    /// The service's state: level, processes, records, drops, flight recorder.
    Status,
    /// The traced processes with their job and rank.
    Processes,
    /// Change the capture level (0-3) without restarting.
    Level { level: u8 },
    /// Write a trace of the flight recorder's window to the dump directory.
    Dump {
        /// Only this job's processes (its job label).
        #[arg(long)]
        job: Option<String>,
        /// The window's length (default: all the recorder holds).
        #[arg(long, value_parser = crate::config::parse_duration)]
        seconds: Option<Duration>,
        /// End the window this long from now (record that much more first).
        #[arg(long, value_parser = crate::config::parse_duration)]
        after: Option<Duration>,
        /// End the window at this wall-clock time (RFC 3339, UTC), the same
        /// on every node it is sent to.
        #[arg(long, conflicts_with = "after")]
        at: Option<String>,
        /// With --after or --at: answer once the dump is written (its
        /// path), not as soon as it is scheduled.
        #[arg(long)]
        wait: bool,
    },
    /// Re-read the configuration file.
    Reload,
}

/// A dump may take this long to be written before the service answers.
const TIMEOUT: Duration = Duration::from_secs(150);

/// Sends one request and reads the whole answer.
pub fn request(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<ClientResponse, String> {
    let mut stream = UnixStream::connect(socket).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => format!(
            "no agent service is listening on {} ({e}); is it running? (systemctl status xpuscope-agent)",
            socket.display()
        ),
        std::io::ErrorKind::PermissionDenied => format!(
            "{}: permission denied; the control API is for root and the configured control.group",
            socket.display()
        ),
        _ => format!("connecting to {}: {e}", socket.display()),
    })?;
    // A dump asked to wait for its scheduled window: the service bounds
    // the wait (the window's end plus its own dump timeout).
    let waits = body.is_some_and(|b| b["wait"] == json!(true));
    let _ = stream.set_read_timeout((!waits).then_some(TIMEOUT));
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: xpuscope\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream
        .write_all(head.as_bytes())
        .and_then(|_| stream.write_all(body.as_bytes()))
        .map_err(|e| format!("sending the request: {e}"))?;
    let mut answer = Vec::new();
    stream
        .read_to_end(&mut answer)
        .map_err(|e| format!("reading the answer: {e}"))?;
    parse_response(&answer)
}

fn seconds(d: Option<Duration>) -> Option<f64> {
    d.map(|d| d.as_secs_f64())
}

/// The request an `agent ctl` command makes.
pub fn command_request(cmd: &CtlCommand) -> (&'static str, &'static str, Option<Value>) {
    match cmd {
        CtlCommand::Status => ("GET", "/status", None),
        CtlCommand::Processes => ("GET", "/processes", None),
        CtlCommand::Level { level } => ("POST", "/level", Some(json!({ "level": level }))),
        CtlCommand::Dump {
            job,
            seconds: s,
            after,
            at,
            wait,
        } => {
            let mut body = serde_json::Map::new();
            if let Some(j) = job {
                body.insert("job".into(), json!(j));
            }
            if let Some(s) = seconds(*s) {
                body.insert("seconds".into(), json!(s));
            }
            if let Some(a) = seconds(*after) {
                body.insert("after".into(), json!(a));
            }
            if let Some(t) = at {
                body.insert("at".into(), json!(t));
            }
            if *wait {
                body.insert("wait".into(), json!(true));
            }
            ("POST", "/dump", Some(Value::Object(body)))
        }
        CtlCommand::Reload => ("POST", "/reload", None),
    }
}

/// `agent ctl ...`: prints the answer; fails on an error status.
pub fn run(args: &CtlArgs) -> ExitCode {
    let (method, path, body) = command_request(&args.command);
    match request(&args.socket, method, path, body.as_ref()) {
        Ok(resp) if (200..300).contains(&resp.status) => {
            print!("{}", resp.body);
            ExitCode::SUCCESS
        }
        Ok(resp) => {
            let reason = serde_json::from_str::<Value>(&resp.body)
                .ok()
                .and_then(|v| v["error"].as_str().map(String::from))
                .unwrap_or(resp.body);
            eprintln!("xpuscope: error: {reason} (HTTP {})", resp.status);
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("xpuscope: error: {e}");
            ExitCode::FAILURE
        }
    }
}
