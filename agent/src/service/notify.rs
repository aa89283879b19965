//! systemd's notify protocol: `READY=1`, `STATUS=...`, `WATCHDOG=1` as
//! datagrams to `$NOTIFY_SOCKET` (a path, or `@name` for the abstract
//! namespace). Without `$NOTIFY_SOCKET` (not under systemd) nothing is sent.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// Where notifications go, if anywhere.
pub struct Notifier {
    target: Option<(UnixDatagram, SocketAddr)>,
}

impl Notifier {
    /// From `$NOTIFY_SOCKET`.
    pub fn from_env() -> Self {
        Self::to(
            std::env::var_os("NOTIFY_SOCKET")
                .as_deref()
                .and_then(|s| s.to_str()),
        )
    }

    /// To this socket (`@name`: abstract).
    pub fn to(socket: Option<&str>) -> Self {
        let target = socket.and_then(|s| {
            let addr = match s.strip_prefix('@') {
                Some(name) => SocketAddr::from_abstract_name(name.as_bytes()).ok()?,
                None => SocketAddr::from_pathname(s).ok()?,
            };
            Some((UnixDatagram::unbound().ok()?, addr))
        });
        Self { target }
    }

    /// Sends `state` (lines such as `READY=1\nSTATUS=...`); failures are
    /// logged: systemd's notify socket going away must not stop tracing.
    pub fn send(&self, state: &str) {
        if let Some((sock, addr)) = &self.target
            && let Err(e) = sock.send_to_addr(state.as_bytes(), addr)
        {
            tracing::warn!("sd_notify: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notifications_reach_the_socket() {
        let path = std::env::temp_dir().join(format!("xpuscope-notify-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let rx = UnixDatagram::bind(&path).unwrap();
        let n = Notifier::to(path.to_str());
        n.send("READY=1\nSTATUS=tracing 3 processes");
        let mut buf = [0u8; 256];
        let len = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..len], b"READY=1\nSTATUS=tracing 3 processes");
        std::fs::remove_file(&path).unwrap();

        let name = format!("xpuscope-notify-abstract-{}", std::process::id());
        let rx = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap())
            .unwrap();
        Notifier::to(Some(&format!("@{name}"))).send("WATCHDOG=1");
        let len = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..len], b"WATCHDOG=1");
        Notifier::to(None).send("READY=1"); // not under systemd: nothing
    }
}
