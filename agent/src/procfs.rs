//! Reading processes and threads from `/proc`.
//!
//! Everything here comes from other processes and is parsed defensively:
//! a process may vanish between two reads, and names are arbitrary bytes.

use std::collections::{HashMap, VecDeque};
use std::fs;

/// A process as `/proc` describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessEntry {
    pub pid: u32,
    pub ppid: u32,
    pub comm: String,
    /// Empty for kernel threads and processes that are gone.
    pub cmdline: Vec<String>,
    pub uid: Option<u32>,
    pub threads: Vec<ThreadEntry>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ThreadEntry {
    pub tid: u32,
    pub comm: String,
}

/// Fields of `/proc/PID/stat` the agent uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stat {
    pub comm: String,
    pub state: char,
    pub ppid: u32,
}

/// Parses `/proc/PID/stat`; the comm may contain spaces and parentheses, so
/// the fields after it are found from the LAST `)`.
pub fn parse_stat(text: &str) -> Option<Stat> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text.get(open + 1..close)?.to_string();
    let mut rest = text.get(close + 1..)?.split_whitespace();
    let state = rest.next()?.chars().next()?;
    let ppid = rest.next()?.parse().ok()?;
    Some(Stat { comm, state, ppid })
}

pub fn stat(pid: u32) -> Option<Stat> {
    parse_stat(&fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

fn is_dead(state: char) -> bool {
    state == 'Z' || state == 'X'
}

/// Whether `pid` is a live process: not gone, and not a zombie. A process
/// whose main thread has exited (`pthread_exit` in `main`) shows its
/// leader as a zombie in `/proc/PID/stat` while its other threads run on:
/// it is alive if any thread is.
pub fn is_alive(pid: u32) -> bool {
    match stat(pid) {
        None => false,
        Some(s) if !is_dead(s.state) => true,
        Some(_) => threads_alive(pid),
    }
}

/// Whether any thread of `pid` other than its leader is alive.
fn threads_alive(pid: u32) -> bool {
    let Ok(dir) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|tid| *tid != pid)
        .any(|tid| {
            fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat"))
                .ok()
                .and_then(|t| parse_stat(&t))
                .is_some_and(|s| !is_dead(s.state))
        })
}

pub fn cmdline(pid: u32) -> Vec<String> {
    fs::read(format!("/proc/{pid}/cmdline"))
        .map(|raw| parse_cmdline(&raw))
        .unwrap_or_default()
}

/// `/proc/PID/cmdline`: NUL-separated arguments (any bytes; a process may
/// rewrite its own).
pub fn parse_cmdline(raw: &[u8]) -> Vec<String> {
    raw.split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

fn uid(pid: u32) -> Option<u32> {
    parse_status_uid(&fs::read_to_string(format!("/proc/{pid}/status")).ok()?)
}

/// The real uid from the `Uid:` line of `/proc/PID/status`.
pub fn parse_status_uid(status: &str) -> Option<u32> {
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// The threads of `pid` with their names.
pub fn threads(pid: u32) -> Vec<ThreadEntry> {
    let Ok(dir) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    let mut out: Vec<ThreadEntry> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|tid| {
            let comm = fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")).ok()?;
            Some(ThreadEntry {
                tid,
                comm: comm.trim_end_matches('\n').to_string(),
            })
        })
        .collect();
    out.sort_by_key(|t| t.tid);
    out
}

/// A full description of `pid`, or `None` if it is gone.
pub fn process(pid: u32) -> Option<ProcessEntry> {
    let st = stat(pid)?;
    Some(ProcessEntry {
        pid,
        ppid: st.ppid,
        comm: st.comm,
        cmdline: cmdline(pid),
        uid: uid(pid),
        threads: threads(pid),
    })
}

/// Every pid in `/proc`.
pub fn all_pids() -> Vec<u32> {
    let Ok(dir) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    pids.sort_unstable();
    pids
}

/// `root` and all its live descendant processes.
pub fn with_descendants(root: u32) -> Vec<u32> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for pid in all_pids() {
        if let Some(st) = stat(pid) {
            children.entry(st.ppid).or_default().push(pid);
        }
    }
    descendants_from(root, &children)
}

fn descendants_from(root: u32, children: &HashMap<u32, Vec<u32>>) -> Vec<u32> {
    let mut out = vec![root];
    let mut queue = VecDeque::from([root]);
    while let Some(p) = queue.pop_front() {
        for c in children.get(&p).into_iter().flatten() {
            if !out.contains(c) {
                out.push(*c);
                queue.push_back(*c);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_with_hostile_comm() {
        let s = parse_stat("1234 (evil) R 1 (x) S 77 1234 1234 0 -1").unwrap();
        assert_eq!(s.comm, "evil) R 1 (x");
        assert_eq!((s.state, s.ppid), ('S', 77));
        assert!(parse_stat("garbage").is_none());
        assert!(parse_stat("1 (x) S notanumber").is_none());
    }

    #[test]
    fn status_and_cmdline_from_hostile_bytes() {
        assert_eq!(
            parse_status_uid("Name:\tx\nUid:\t1000\t1000\t0\t0\n"),
            Some(1000)
        );
        assert_eq!(parse_status_uid("Uid:\n"), None);
        assert_eq!(parse_status_uid("Uid: -1 0 0 0"), None);
        assert_eq!(
            parse_cmdline(b"python\0train.py\0\0--x\xff\0"),
            ["python", "train.py", "--x\u{fffd}"]
        );
        assert!(parse_cmdline(b"").is_empty());
    }

    #[test]
    fn descendants_walk_the_tree() {
        let children = HashMap::from([(1, vec![2, 3]), (2, vec![4]), (4, vec![5]), (9, vec![10])]);
        let mut d = descendants_from(2, &children);
        d.sort();
        assert_eq!(d, vec![2, 4, 5]);
    }

    #[test]
    fn reads_this_process() {
        let me = process(std::process::id()).unwrap();
        assert!(!me.cmdline.is_empty());
        assert!(me.threads.iter().any(|t| t.tid == std::process::id()));
        assert!(is_alive(std::process::id()));
        assert!(!is_alive(u32::MAX));
    }
}
