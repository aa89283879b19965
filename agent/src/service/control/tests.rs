//! The control API over a real Unix socket: answers, bad input, access
//! control (a non-root peer under `setpriv`), `curl --unix-socket`, the
//! token-guarded TCP listener.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
#[cfg(feature = "root-tests")]
use std::process::Command;
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use tokio::sync::watch;

use super::client::request;
use super::*;
use crate::sinks::flight_recorder::DumpSpec;

#[derive(Default)]
struct FakeControl {
    level: Mutex<u8>,
    dumps: Mutex<Vec<DumpSpec>>,
}

impl Control for FakeControl {
    fn status(&self) -> Value {
        json!({ "level": *self.level.lock().unwrap(), "processes": 2 })
    }
    fn processes(&self) -> Value {
        json!([{ "pid": 42, "rank": "0", "job": "j" }])
    }
    fn set_level(&self, level: CaptureLevel) -> Result<Value, String> {
        *self.level.lock().unwrap() = level.get();
        Ok(json!({ "level": level.get() }))
    }
    fn dump(&self, spec: DumpSpec, _wait: bool) -> Result<Value, DumpError> {
        self.dumps.lock().unwrap().push(spec);
        Ok(json!({ "trace": "/var/lib/xpuscope/dumps/x.pftrace" }))
    }
    fn reload(&self) -> Result<Value, String> {
        Err("/etc/xpuscope/agent.toml:3: unknown key `levle`".into())
    }
}

struct Server {
    _rt: tokio::runtime::Runtime,
    dir: PathBuf,
    socket: PathBuf,
    control: Arc<FakeControl>,
    _stop: watch::Sender<bool>,
    _file: SocketFile,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn server(name: &str) -> Server {
    let dir = std::env::temp_dir().join(format!("xpuscope-ctl-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // Others may traverse the directory: the socket's own mode is under test.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let socket = dir.join("agent.sock");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let control = Arc::new(FakeControl::default());
    let (stop, stop_rx) = watch::channel(false);
    let (listener, file) = {
        let _guard = rt.enter();
        bind_socket(&socket, None).unwrap()
    };
    let policy = PeerPolicy {
        own_uid: unsafe { libc::geteuid() },
        group: None,
    };
    rt.spawn(serve_unix(listener, policy, control.clone(), stop_rx));
    Server {
        _rt: rt,
        dir,
        socket,
        control,
        _stop: stop,
        _file: file,
    }
}

fn post(socket: &Path, path: &str, body: &str) -> (u16, Value) {
    // Raw bodies (malformed JSON included).
    let mut stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
    use std::io::{Read, Write};
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = Vec::new();
    stream.read_to_end(&mut out).unwrap();
    let r = crate::service::http::parse_response(&out).unwrap();
    (r.status, serde_json::from_str(&r.body).unwrap())
}

fn error_of(v: &Value) -> String {
    v["error"].as_str().unwrap_or_default().to_string()
}

#[test]
fn commands_answer_and_bad_input_gets_its_reason() {
    let s = server("api");
    let meta = std::fs::metadata(&s.socket).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);

    let r = request(&s.socket, "GET", "/status", None).unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(
        serde_json::from_str::<Value>(&r.body).unwrap()["processes"],
        2
    );
    let r = request(&s.socket, "GET", "/processes", None).unwrap();
    assert_eq!(
        serde_json::from_str::<Value>(&r.body).unwrap()[0]["pid"],
        42
    );

    let r = request(&s.socket, "POST", "/level", Some(&json!({ "level": 2 }))).unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(*s.control.level.lock().unwrap(), 2);

    let (status, v) = post(&s.socket, "/level", "{\"level\": 9}");
    assert_eq!(status, 400);
    assert!(error_of(&v).contains("level 9 does not exist"), "{v}");
    let (status, v) = post(&s.socket, "/level", "{\"level\": -1}");
    assert_eq!(status, 400, "{v}");
    let (status, v) = post(&s.socket, "/level", "{\"level\": 2");
    assert_eq!(status, 400);
    assert!(error_of(&v).starts_with("malformed JSON"), "{v}");
    let (status, v) = post(&s.socket, "/level", "{\"lvl\": 2}");
    assert_eq!(status, 400);
    assert!(error_of(&v).contains("unknown field `lvl`"), "{v}");
    assert_eq!(
        *s.control.level.lock().unwrap(),
        2,
        "unchanged by bad requests"
    );

    let (status, v) = post(&s.socket, "/shutdown", "");
    assert_eq!(status, 404);
    assert!(error_of(&v).contains("unknown command `/shutdown`"), "{v}");
    let r = request(&s.socket, "GET", "/../status", None).unwrap();
    assert_eq!(r.status, 404);
    let r = request(&s.socket, "GET", "/dump", None).unwrap();
    assert_eq!(r.status, 405);

    // Dumps: the window and the job label are checked before the recorder.
    let (status, _) = post(&s.socket, "/dump", "");
    assert_eq!(status, 200);
    let (status, v) = post(&s.socket, "/dump", "{\"job\": \"../../etc\"}");
    assert_eq!(status, 400);
    assert!(error_of(&v).contains("never a path"), "{v}");
    let (status, v) = post(&s.socket, "/dump", "{\"path\": \"/etc/passwd\"}");
    assert_eq!(status, 400);
    assert!(error_of(&v).contains("unknown field `path`"), "{v}");
    let (status, v) = post(&s.socket, "/dump", "{\"seconds\": -5}");
    assert_eq!(status, 400);
    assert!(error_of(&v).contains("`seconds` must be"), "{v}");
    let (status, v) = post(&s.socket, "/dump", "{\"at\": \"tomorrow\"}");
    assert_eq!(status, 400);
    assert!(error_of(&v).contains("RFC 3339"), "{v}");
    let (status, v) = post(
        &s.socket,
        "/dump",
        "{\"at\": \"2020-01-01T00:00:00Z\", \"after\": 5}",
    );
    assert_eq!(status, 400, "{v}");
    let (status, _) = post(
        &s.socket,
        "/dump",
        "{\"job\": \"llama\", \"seconds\": 30, \"after\": 5}",
    );
    assert_eq!(status, 200);
    let dumps = s.control.dumps.lock().unwrap().clone();
    assert_eq!(
        dumps.len(),
        2,
        "only the valid requests reached the recorder"
    );
    assert_eq!(dumps[1].job.as_deref(), Some("llama"));
    assert_eq!(dumps[1].seconds, Some(std::time::Duration::from_secs(30)));
    assert_eq!(
        dumps[1].end,
        WindowEnd::After(std::time::Duration::from_secs(5))
    );

    let r = request(&s.socket, "POST", "/reload", None).unwrap();
    assert_eq!(r.status, 400);
    assert!(r.body.contains("agent.toml:3"), "{}", r.body);
}

#[cfg(feature = "root-tests")]
fn ensure_curl() {
    if Command::new("curl").arg("--version").output().is_ok() {
        return;
    }
    let ok = Command::new("apt-get")
        .args(["install", "-y", "-q", "curl"])
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "curl is needed for this test and apt-get install curl failed"
    );
}

#[cfg(feature = "root-tests")]
fn require_root() {
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "this test switches to another uid: run it as root (the project's tests do)"
    );
}

/// curl as `nobody`: (exit status, body).
#[cfg(feature = "root-tests")]
fn curl_as_nobody(socket: &Path) -> (i32, String) {
    let out = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "curl",
            "-sS",
            "--unix-socket",
        ])
        .arg(socket)
        .arg("http://localhost/status")
        .output()
        .expect("setpriv (util-linux) runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

#[test]
#[cfg(feature = "root-tests")]
fn curl_works_and_a_non_root_peer_is_refused() {
    require_root();
    ensure_curl();
    let s = server("peer");
    let out = Command::new("curl")
        .args(["-sS", "--unix-socket"])
        .arg(&s.socket)
        .arg("http://localhost/status")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["processes"], 2);

    // The socket's mode keeps others out...
    let (code, text) = curl_as_nobody(&s.socket);
    assert_eq!(code, 7, "curl cannot connect: {text}");
    assert!(
        text.contains("ermission denied") || text.contains("Couldn't connect"),
        "{text}"
    );
    // ... and with the mode widened, the peer's uid is still checked.
    std::fs::set_permissions(&s.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let (code, text) = curl_as_nobody(&s.socket);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("uid 65534 is not allowed"), "{text}");
    assert_eq!(*s.control.level.lock().unwrap(), 0);
}

#[test]
fn peer_policy() {
    let p = PeerPolicy {
        own_uid: 0,
        group: None,
    };
    assert!(p.allows(0, 0, None));
    assert!(!p.allows(1000, 1000, None));
    let p = PeerPolicy {
        own_uid: 0,
        group: Some(4242),
    };
    assert!(p.allows(1000, 4242, None));
    assert!(!p.allows(1000, 1000, Some(i32::MAX)));
    // Supplementary groups come from /proc: ours include our gid.
    let me = std::process::id() as i32;
    let gid = unsafe { libc::getegid() };
    let ours = supplementary_groups(me);
    let p = PeerPolicy {
        own_uid: u32::MAX,
        group: ours.first().copied(),
    };
    if let Some(g) = ours.first() {
        assert!(p.allows(12345, gid.wrapping_add(1), Some(me)), "group {g}");
    }
    assert!(group_id("root").is_ok_and(|g| g == 0));
    assert!(
        group_id("no-such-group-xyz")
            .unwrap_err()
            .contains("does not exist")
    );
}

#[test]
fn tcp_needs_the_token() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let (_stop, stop_rx) = watch::channel(false);
    let control: Arc<dyn Control> = Arc::new(FakeControl::default());
    rt.spawn(serve_tcp(
        listener,
        "s3cret-token-0123456789".into(),
        control,
        stop_rx,
    ));
    let get = |auth: &str| {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        write!(s, "GET /status HTTP/1.1\r\n{auth}\r\n").unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).unwrap();
        crate::service::http::parse_response(&out).unwrap().status
    };
    assert_eq!(get(""), 401);
    assert_eq!(get("Authorization: Bearer wrong\r\n"), 401);
    assert_eq!(
        get("Authorization: Bearer s3cret-token-0123456789\r\n"),
        200
    );

    let dir = std::env::temp_dir().join(format!("xpuscope-token-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let token = dir.join("token");
    std::fs::write(&token, "s3cret-token-0123456789\n").unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o644)).unwrap();
    assert!(
        read_token(&token)
            .unwrap_err()
            .contains("readable by its group or others")
    );
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o620)).unwrap();
    let e = read_token(&token).unwrap_err();
    assert!(
        e.contains(&token.display().to_string())
            && e.contains("writable by its group or others (mode 620)")
            && e.contains("chmod 600"),
        "{e}"
    );
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(read_token(&token).unwrap(), "s3cret-token-0123456789");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A token file another user owns is refused even when private: its
/// owner could write a token of their choosing.
#[test]
#[cfg(feature = "root-tests")]
fn a_token_file_owned_by_another_user_is_refused() {
    require_root();
    let dir = std::env::temp_dir().join(format!("xpuscope-token-owner-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let token = dir.join("token");
    std::fs::write(&token, "s3cret-token-0123456789\n").unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::chown(&token, Some(65534), Some(65534)).unwrap();
    let e = read_token(&token).unwrap_err();
    assert!(
        e.contains(&token.display().to_string())
            && e.contains("owned by uid 65534, not root")
            && e.contains("chown root:root"),
        "{e}"
    );
    // Through a symlink, the file it points to is what is checked.
    let link = dir.join("link");
    std::os::unix::fs::symlink(&token, &link).unwrap();
    assert!(
        read_token(&link)
            .unwrap_err()
            .contains("owned by uid 65534")
    );
    std::os::unix::fs::chown(&token, Some(0), Some(0)).unwrap();
    assert_eq!(read_token(&link).unwrap(), "s3cret-token-0123456789");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A rival that swaps the freshly bound socket for a symlink (the window
/// between bind and chmod) gets its target left alone: the mode is set
/// through a descriptor of the socket, never through the path.
#[test]
fn the_socket_mode_is_never_set_through_a_symlink() {
    let dir = std::env::temp_dir().join(format!("xpuscope-sock-link-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let victim = dir.join("victim");
    std::fs::write(&victim, "x").unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o644)).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _guard = rt.enter();
    let path = dir.join("agent.sock");
    let e = bind_socket_with(&path, None, |bound| {
        std::fs::remove_file(bound).unwrap();
        std::os::unix::fs::symlink(&victim, bound).unwrap();
    })
    .unwrap_err();
    assert!(
        e.contains("was replaced after the agent bound it (now a symlink"),
        "{e}"
    );
    let mode = std::fs::metadata(&victim).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o644, "the symlink's target kept its mode");
    assert!(path.symlink_metadata().is_err(), "nothing placed");
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["victim"], "the private directory is gone");
    // Unhindered, the socket is placed private.
    let (_l, file) = bind_socket(&path, None).unwrap();
    let mode = std::fs::symlink_metadata(&path)
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600);
    drop(file);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_stale_socket_is_replaced_and_other_files_are_not() {
    let dir = std::env::temp_dir().join(format!("xpuscope-stale-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _guard = rt.enter();
    let path = dir.join("agent.sock");
    let first = bind_socket(&path, None).unwrap();
    std::mem::forget(first); // a crashed agent leaves its socket
    let (_l, file) = bind_socket(&path, None).unwrap();
    drop(file);
    assert!(!path.exists(), "removed at the end");
    let plain = dir.join("plain");
    std::fs::write(&plain, "x").unwrap();
    assert!(
        bind_socket(&plain, None)
            .unwrap_err()
            .contains("is not a socket")
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// With `control.group`, the socket (not what a path might point to) gets
/// mode 0660 and the group.
#[test]
#[cfg(feature = "root-tests")]
fn the_socket_goes_to_the_control_group() {
    use std::os::unix::fs::MetadataExt;
    require_root();
    let dir = std::env::temp_dir().join(format!("xpuscope-sock-group-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _guard = rt.enter();
    let path = dir.join("agent.sock");
    let (_l, file) = bind_socket(&path, Some(65534)).unwrap();
    let meta = std::fs::symlink_metadata(&path).unwrap();
    assert_eq!((meta.mode() & 0o777, meta.gid()), (0o660, 65534));
    drop(file);
    std::fs::remove_dir_all(&dir).unwrap();
}
