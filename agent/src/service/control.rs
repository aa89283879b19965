//! The control API: HTTP/JSON over a Unix socket, so `curl --unix-socket`
//! works, with `agent ctl` as its client ([`client`]).
//!
//! | request | body | answer |
//! |---|---|---|
//! | `GET /status` | | level, processes, records, drops, flight recorder |
//! | `GET /processes` | | traced processes with job and rank |
//! | `POST /level` | `{"level": 2}` | the new level |
//! | `POST /dump` | `{"job"?, "seconds"?, "after"?, "at"?, "wait"?}` | the dump written (or scheduled) |
//! | `POST /reload` | | the keys applied, those waiting for a restart |
//!
//! Access: the socket is created mode 0600 (0660 and the configured
//! group's with `control.group`) in a private directory and renamed into
//! place, so it is never reachable with wider permissions, and its mode and
//! group are set through a descriptor, never through a symlink; each peer's
//! uid (and groups) are checked again with SO_PEERCRED, so a socket whose
//! mode was widened still refuses other users. No TCP listener exists
//! unless `control.tcp_listen` is set, and then every request must carry
//! the token from `control.token_file` (`Authorization: Bearer ...`), a
//! file root (or the agent's user) owns and only it may read and write.
//!
//! Bad input gets a 4xx with the reason: malformed JSON or an unknown
//! field (400), an invalid level, window, time or job label (400), an
//! unknown command (404), a wrong method (405), the dump rate limit (429);
//! more than [`http::MAX_CONNECTIONS`] connections at once get 503.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::Sender;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Value, json};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::watch;

use super::config::CaptureLevel;
use super::http::{self, Request, Response};
use crate::sinks::flight_recorder::dump::check_job_label;
use crate::sinks::flight_recorder::{DumpError, DumpRequest, DumpSpec, Trigger, WindowEnd};
use crate::wallclock;

pub const DEFAULT_SOCKET: &str = "/run/xpuscope/agent.sock";
/// How long a dump of a window ending now may take before the API answers
/// without its outcome (it goes on, and shows in status).
const DUMP_WAIT: Duration = Duration::from_secs(120);
/// Latest `at` accepted, from now.
const MAX_AT_AHEAD: Duration = Duration::from_secs(24 * 3600);

/// What the control API asks of the running service.
pub trait Control: Send + Sync + 'static {
    fn status(&self) -> Value;
    fn processes(&self) -> Value;
    /// Switches the capture level; the reason when it could not.
    fn set_level(&self, level: CaptureLevel) -> Result<Value, String>;
    /// A dump; `wait`: answer once a scheduled one is written.
    fn dump(&self, spec: DumpSpec, wait: bool) -> Result<Value, DumpError>;
    /// Re-reads the configuration; the error names file, line and key.
    fn reload(&self) -> Result<Value, String>;
}

/// Sends `spec` to the flight recorder. A window that ends now (or later,
/// with `wait`) is waited for, up to two minutes after its end, and the
/// answer is the dump written (its path); one that ends later is
/// otherwise acknowledged as scheduled (its outcome shows in status).
///
/// A window that ends now ends at this request's instant: the recorder
/// starts it once collect's clock passed that instant, so the records
/// still in the kernel rings or the pipeline's queue when the request
/// came are in the dump (the recorder's own latest record can lag the
/// request by as much as the pipeline is behind).
pub fn request_dump(
    recorder: &Sender<DumpRequest>,
    spec: DumpSpec,
    wait: bool,
) -> Result<Value, DumpError> {
    let now = crate::host::boottime_ns();
    let (end, ends_in) = match spec.end {
        WindowEnd::Now => (now, Duration::ZERO),
        WindowEnd::After(d) => (now.saturating_add(d.as_nanos() as u64), d),
        WindowEnd::At(t) => (t, Duration::from_nanos(t.saturating_sub(now))),
    };
    let waits = wait || spec.end == WindowEnd::Now;
    let (reply, rx) = std::sync::mpsc::channel();
    recorder
        .send(DumpRequest {
            spec: DumpSpec {
                end: WindowEnd::At(end),
                ..spec.clone()
            },
            reply: waits.then_some(reply),
            finding: None,
        })
        .map_err(|_| DumpError::Stopped)?;
    if !waits {
        return Ok(json!({
            "scheduled": true,
            "trigger": spec.trigger.as_str(),
            "ends_in_s": ends_in.as_secs_f64(),
            "note": "its path shows under `last_dump` in `agent ctl status` once written",
        }));
    }
    match rx.recv_timeout(ends_in + DUMP_WAIT) {
        Ok(result) => result.map(|o| serde_json::to_value(o).unwrap_or_default()),
        Err(_) => Ok(
            json!({ "in_progress": true, "note": "the dump is still being written; see status" }),
        ),
    }
}

/// Who may use the socket.
#[derive(Clone, Debug)]
pub struct PeerPolicy {
    /// The service's own uid (root in production).
    pub own_uid: u32,
    /// Members of this group are allowed too.
    pub group: Option<u32>,
}

impl PeerPolicy {
    /// Whether a peer with these credentials may use the API.
    pub fn allows(&self, uid: u32, gid: u32, pid: Option<i32>) -> bool {
        if uid == 0 || uid == self.own_uid {
            return true;
        }
        let Some(group) = self.group else {
            return false;
        };
        gid == group || pid.is_some_and(|pid| supplementary_groups(pid).contains(&group))
    }
}

fn supplementary_groups(pid: i32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| l.strip_prefix("Groups:")).map(|g| {
                g.split_whitespace()
                    .filter_map(|n| n.parse().ok())
                    .collect()
            })
        })
        .unwrap_or_default()
}

/// A group's id by name.
pub fn group_id(name: &str) -> Result<u32, String> {
    let cname = std::ffi::CString::new(name).map_err(|_| format!("bad group name `{name}`"))?;
    let mut buf = vec![0 as libc::c_char; 16 << 10];
    // SAFETY: zeroed is a valid `group`; getgrnam_r fills it and points its
    // strings into `buf`, which outlives the call; `result` says whether it
    // found one.
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut result: *mut libc::group = std::ptr::null_mut();
    // SAFETY: as above; every pointer is to memory we own, sized as given.
    let rc = unsafe {
        libc::getgrnam_r(
            cname.as_ptr(),
            &mut grp,
            buf.as_mut_ptr(),
            buf.len(),
            &mut result,
        )
    };
    if rc != 0 || result.is_null() {
        return Err(format!("group `{name}` does not exist (control.group)"));
    }
    Ok(grp.gr_gid)
}

/// The socket file, removed when the server ends.
#[derive(Debug)]
pub struct SocketFile(pub PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Binds the control socket at `path`: created in a private directory
/// beside it, given its mode (and group), then renamed into place. A
/// stale socket is replaced; anything else at `path` is refused.
pub fn bind_socket(path: &Path, group: Option<u32>) -> Result<(UnixListener, SocketFile), String> {
    bind_socket_with(path, group, |_| {})
}

/// A directory removed (with what is left in it) when dropped.
struct PrivateDir(PathBuf);

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// [`bind_socket`]; `after_bind` runs between the bind and the mode change
/// (tests put a rival there).
fn bind_socket_with(
    path: &Path,
    group: Option<u32>,
    after_bind: impl FnOnce(&Path),
) -> Result<(UnixListener, SocketFile), String> {
    use std::os::unix::fs::DirBuilderExt;
    let dir = path
        .parent()
        .ok_or_else(|| format!("{}: not a socket path", path.display()))?;
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    if let Ok(meta) = path.symlink_metadata() {
        use std::os::unix::fs::FileTypeExt;
        if !meta.file_type().is_socket() {
            return Err(format!(
                "{} exists and is not a socket; remove it or set control.socket",
                path.display()
            ));
        }
    }
    // Bound in a directory only this user can enter: between the bind and
    // the rename nobody else can put a file, a symlink or a socket of
    // their own where the mode and owner are set.
    let private = dir.join(format!(
        ".{}.{}.d",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("sock"),
        std::process::id()
    ));
    let _ = std::fs::remove_file(&private);
    let _ = std::fs::remove_dir_all(&private);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&private)
        .map_err(|e| format!("creating {}: {e}", private.display()))?;
    let private = PrivateDir(private);
    let tmp = private.0.join("sock");
    let listener =
        UnixListener::bind(&tmp).map_err(|e| format!("binding {}: {e}", tmp.display()))?;
    let mut guard = SocketFile(tmp.clone());
    after_bind(&tmp);
    let mode = if group.is_some() { 0o660 } else { 0o600 };
    set_socket_mode(&tmp, mode, group)?;
    std::fs::rename(&tmp, path).map_err(|e| format!("placing {}: {e}", path.display()))?;
    guard.0 = path.to_path_buf();
    Ok((listener, guard))
}

/// Sets the mode (and group) of the socket file at `path`, never of what a
/// symlink there points to: the file is opened without following links,
/// checked to be a socket of this user's, and changed through that
/// descriptor.
fn set_socket_mode(path: &Path, mode: u32, group: Option<u32>) -> Result<(), String> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
    use std::os::unix::io::AsRawFd;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| format!("opening {}: {e}", path.display()))?;
    let meta = file
        .metadata()
        .map_err(|e| format!("stat {}: {e}", path.display()))?;
    // SAFETY: geteuid has no preconditions.
    let own = unsafe { libc::geteuid() };
    if !meta.file_type().is_socket() || meta.uid() != own {
        return Err(format!(
            "{} was replaced after the agent bound it (now a {} of uid {}); \
             refusing to change its mode",
            path.display(),
            if meta.file_type().is_symlink() {
                "symlink"
            } else if meta.file_type().is_socket() {
                "socket"
            } else {
                "file"
            },
            meta.uid()
        ));
    }
    // chmod has no form taking an O_PATH descriptor; its /proc link names
    // this very inode, whatever happens to the path.
    let by_fd = format!("/proc/self/fd/{}", file.as_raw_fd());
    std::fs::set_permissions(&by_fd, std::fs::Permissions::from_mode(mode))
        .map_err(|e| format!("chmod {}: {e}", path.display()))?;
    if let Some(gid) = group {
        // SAFETY: the descriptor is open for the call; the empty path with
        // AT_EMPTY_PATH names the descriptor's own file.
        let rc = unsafe {
            libc::fchownat(
                file.as_raw_fd(),
                c"".as_ptr(),
                u32::MAX,
                gid,
                libc::AT_EMPTY_PATH,
            )
        };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            let hint = if e.kind() == std::io::ErrorKind::PermissionDenied {
                "; giving the socket to control.group needs CAP_CHOWN (under the systemd \
                 unit: `systemctl edit xpuscope-agent`, add `CapabilityBoundingSet=CAP_CHOWN` \
                 under [Service])"
            } else {
                ""
            };
            return Err(format!("chown {}: {e}{hint}", path.display()));
        }
    }
    Ok(())
}

/// Serves the Unix socket until `stop` turns true.
pub async fn serve_unix(
    listener: UnixListener,
    policy: PeerPolicy,
    control: Arc<dyn Control>,
    stop: watch::Receiver<bool>,
) {
    http::serve_connections(
        "control socket",
        listener,
        http::MAX_CONNECTIONS,
        busy(),
        stop,
        move |mut stream| {
            let policy = policy.clone();
            let control = control.clone();
            async move {
                let allowed = match stream.peer_cred() {
                    Ok(c) => {
                        if policy.allows(c.uid(), c.gid(), c.pid()) {
                            Ok(())
                        } else {
                            Err(format!(
                                "uid {} is not allowed to use the control API (root{}only)",
                                c.uid(),
                                if policy.group.is_some() {
                                    " and the control group "
                                } else {
                                    " "
                                }
                            ))
                        }
                    }
                    Err(e) => Err(format!("the peer's credentials could not be read: {e}")),
                };
                let resp = match (allowed, http::read_request(&mut stream).await) {
                    (Err(reason), _) => Response::error(403, reason),
                    (Ok(()), Err(e)) => Response::error(e.status(), e.to_string()),
                    (Ok(()), Ok(req)) => dispatch(control, req).await,
                };
                let _ = http::write_response(&mut stream, &resp).await;
            }
        },
    )
    .await
}

fn busy() -> Response {
    Response::error(
        503,
        "too many connections to the control API at once; retry later",
    )
}

/// Serves the optional TCP listener: every request needs the token.
pub async fn serve_tcp(
    listener: TcpListener,
    token: String,
    control: Arc<dyn Control>,
    stop: watch::Receiver<bool>,
) {
    let token = Arc::new(token);
    http::serve_connections(
        "control TCP listener",
        listener,
        http::MAX_CONNECTIONS,
        busy(),
        stop,
        move |mut stream| {
            let control = control.clone();
            let token = token.clone();
            async move {
                let resp = match http::read_request(&mut stream).await {
                    Err(e) => Response::error(e.status(), e.to_string()),
                    Ok(req) => {
                        let given = req
                            .header("authorization")
                            .and_then(|v| v.strip_prefix("Bearer "))
                            .unwrap_or("");
                        if constant_time_eq(given.as_bytes(), token.as_bytes()) {
                            dispatch(control, req).await
                        } else {
                            Response::error(
                                401,
                                "missing or wrong token (Authorization: Bearer <control.token_file>)",
                            )
                        }
                    }
                };
                let _ = http::write_response(&mut stream, &resp).await;
            }
        },
    )
    .await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Reads the TCP token. The file must be root's (or the agent's own
/// user's) and private to it: whoever else could write it could choose
/// the token, whoever else could read it could use it.
pub fn read_token(path: &Path) -> Result<String, String> {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;
    let name = |e: &dyn std::fmt::Display| format!("control.token_file {}: {e}", path.display());
    // Checked on the file opened, not on the path: it cannot be swapped
    // between the check and the read. A symlink is followed (a mounted
    // secret is one); what it points to is checked.
    let mut file = std::fs::File::open(path).map_err(|e| name(&e))?;
    let meta = file.metadata().map_err(|e| name(&e))?;
    // SAFETY: geteuid has no preconditions.
    let own = unsafe { libc::geteuid() };
    if meta.uid() != 0 && meta.uid() != own {
        return Err(format!(
            "control.token_file {} is owned by uid {}, not root{}: another user could change \
             the token; `chown root:root` it (and `chmod 600`)",
            path.display(),
            meta.uid(),
            if own == 0 {
                String::new()
            } else {
                format!(" or the agent's uid {own}")
            }
        ));
    }
    let mode = meta.mode() & 0o777;
    if mode & 0o022 != 0 {
        return Err(format!(
            "control.token_file {} is writable by its group or others (mode {mode:03o}): they \
             could change the token; `chmod 600` it",
            path.display()
        ));
    }
    if mode & 0o044 != 0 {
        return Err(format!(
            "control.token_file {} is readable by its group or others (mode {mode:03o}); \
             `chmod 600` it",
            path.display()
        ));
    }
    let mut token = String::new();
    file.read_to_string(&mut token).map_err(|e| name(&e))?;
    let token = token.trim().to_string();
    if token.len() < 16 {
        return Err(format!(
            "control.token_file {} holds a token shorter than 16 characters",
            path.display()
        ));
    }
    Ok(token)
}

/// Routes off the runtime: handlers may wait (a dump).
async fn dispatch(control: Arc<dyn Control>, req: Request) -> Response {
    tokio::task::spawn_blocking(move || route(&*control, &req))
        .await
        .unwrap_or_else(|e| Response::error(500, format!("the request failed: {e}")))
}

const COMMANDS: &str = "GET /status, GET /processes, POST /level, POST /dump, POST /reload";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LevelBody {
    level: i64,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct DumpBody {
    job: Option<String>,
    seconds: Option<f64>,
    after: Option<f64>,
    at: Option<String>,
    /// Answer once a scheduled (`after`, `at`) dump is written.
    wait: Option<bool>,
}

fn body<T: for<'de> Deserialize<'de>>(req: &Request, empty: Option<T>) -> Result<T, Response> {
    if req.body.iter().all(u8::is_ascii_whitespace)
        && let Some(v) = empty
    {
        return Ok(v);
    }
    serde_json::from_slice(&req.body)
        .map_err(|e| Response::error(400, format!("malformed JSON: {e}")))
}

fn positive_seconds(v: f64, what: &str) -> Result<Duration, Response> {
    if !v.is_finite() || v <= 0.0 || v > 7.0 * 86400.0 {
        return Err(Response::error(
            400,
            format!("`{what}` must be a number of seconds above 0 and at most 7 days"),
        ));
    }
    Ok(Duration::from_secs_f64(v))
}

/// The dump asked for, and whether to wait for a scheduled one.
fn dump_spec(b: DumpBody) -> Result<(DumpSpec, bool), Response> {
    if let Some(job) = &b.job {
        check_job_label(job).map_err(|e| Response::error(400, e))?;
    }
    let seconds = b
        .seconds
        .map(|s| positive_seconds(s, "seconds"))
        .transpose()?;
    let end = match (b.after, b.at) {
        (Some(_), Some(_)) => return Err(Response::error(400, "give `after` or `at`, not both")),
        (Some(after), None) => WindowEnd::After(positive_seconds(after, "after")?),
        (None, Some(at)) => {
            let real = wallclock::parse_rfc3339(&at).map_err(|e| Response::error(400, e))?;
            let now = wallclock::realtime_ns();
            if real > now + MAX_AT_AHEAD.as_nanos() as u64 {
                return Err(Response::error(
                    400,
                    format!("`at` {at} is more than 24 hours ahead"),
                ));
            }
            WindowEnd::At(wallclock::realtime_to_boottime(real))
        }
        (None, None) => WindowEnd::Now,
    };
    Ok((
        DumpSpec {
            trigger: Trigger::Manual,
            job: b.job,
            seconds,
            end,
        },
        b.wait.unwrap_or(false),
    ))
}

fn dump_error(e: DumpError) -> Response {
    let status = match &e {
        DumpError::BadRequest(_) => 400,
        DumpError::RateLimited { .. } => 429,
        DumpError::Io { .. } => 500,
        DumpError::Stopped => 503,
    };
    Response::error(status, e.to_string())
}

/// One request to its handler.
pub fn route(control: &dyn Control, req: &Request) -> Response {
    let method = req.method.as_str();
    let expected = match req.path.as_str() {
        "/status" | "/processes" => "GET",
        "/level" | "/dump" | "/reload" => "POST",
        other => {
            return Response::error(
                404,
                format!("unknown command `{other}`; commands: {COMMANDS}"),
            );
        }
    };
    if method != expected {
        return Response::error(405, format!("{} takes {expected}, not {method}", req.path));
    }
    let result = match req.path.as_str() {
        "/status" => Ok(Response::json(200, &control.status())),
        "/processes" => Ok(Response::json(200, &control.processes())),
        "/level" => body::<LevelBody>(req, None).and_then(|b| {
            let level = u8::try_from(b.level)
                .map_err(|_| {
                    format!(
                        "level {} does not exist; levels are 0 to {}",
                        b.level,
                        CaptureLevel::MAX
                    )
                })
                .and_then(CaptureLevel::new)
                .map_err(|e| Response::error(400, e))?;
            control
                .set_level(level)
                .map(|v| Response::json(200, &v))
                .map_err(|e| Response::error(409, format!("the level could not be changed: {e}")))
        }),
        "/dump" => body::<DumpBody>(req, Some(DumpBody::default()))
            .and_then(dump_spec)
            .and_then(|(spec, wait)| {
                control
                    .dump(spec, wait)
                    .map(|v| Response::json(200, &v))
                    .map_err(dump_error)
            }),
        "/reload" => control
            .reload()
            .map(|v| Response::json(200, &v))
            .map_err(|e| Response::error(400, e)),
        _ => Err(Response::error(404, "unknown command")),
    };
    result.unwrap_or_else(|r| r)
}

pub mod client;

#[cfg(test)]
mod tests;
