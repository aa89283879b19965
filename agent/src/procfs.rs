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

/// The fields of `/proc/PID/stat` service discovery uses (parsed here,
/// with [`Stat`], so that the fuzz targets reach it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcStat {
    pub comm: String,
    /// Clock ticks after boot: with the pid, names one process.
    pub start_time: u64,
    /// Bytes of address space; 0 for kernel threads.
    pub vsize: u64,
}

impl ProcStat {
    pub fn parse(text: &str) -> Option<ProcStat> {
        let (comm, rest) = split_stat(text)?;
        // starttime is field 22 and vsize field 23 (proc(5)); `rest`
        // starts at field 3.
        let mut rest = rest.skip(19);
        Some(ProcStat {
            comm: comm.to_string(),
            start_time: rest.next()?.parse().ok()?,
            vsize: rest.next()?.parse().ok()?,
        })
    }
}

/// `/proc/PID/stat` as its comm and the fields after it (from field 3,
/// the state). A process names itself, so its comm may hold spaces, `(`
/// and `)`: it runs from the first `(` to the LAST `)`, as the fields
/// after it hold no parenthesis.
pub fn split_stat(text: &str) -> Option<(&str, std::str::SplitWhitespace<'_>)> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text.get(open + 1..close)?;
    Some((comm, text.get(close + 1..)?.split_whitespace()))
}

pub fn parse_stat(text: &str) -> Option<Stat> {
    let (comm, mut rest) = split_stat(text)?;
    let state = rest.next()?.chars().next()?;
    let ppid = rest.next()?.parse().ok()?;
    Some(Stat {
        comm: comm.to_string(),
        state,
        ppid,
    })
}

/// A `/proc` text file, bytes that are not UTF-8 replaced. A comm is any
/// bytes a process gives `prctl(PR_SET_NAME)`, and it is in `stat` and
/// `status`: read as strict UTF-8, such a process would look gone (left
/// out of discovery and of a traced job's descendants, taken for dead).
pub fn read_lossy(path: &str) -> Option<String> {
    Some(String::from_utf8_lossy(&fs::read(path).ok()?).into_owned())
}

pub fn stat(pid: u32) -> Option<Stat> {
    parse_stat(&read_lossy(&format!("/proc/{pid}/stat"))?)
}

/// A zombie (`Z`) or a process being reaped (`X`): exited.
pub fn is_dead(state: char) -> bool {
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
            read_lossy(&format!("/proc/{pid}/task/{tid}/stat"))
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
/// rewrite its own), secrets redacted ([`redact_secrets`]).
pub fn parse_cmdline(raw: &[u8]) -> Vec<String> {
    redact_secrets(
        raw.split(|b| *b == 0)
            .filter(|s| !s.is_empty())
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect(),
    )
}

/// What replaces a secret in a command line.
pub const REDACTED: &str = "[redacted]";

/// A command line with the values of secret-looking arguments replaced:
/// `--api-key=X`, `--password X`, `HF_TOKEN=X` (a flag or variable whose
/// name says token, password, secret, key, credential or auth). Traces and
/// dumps keep command lines, and secrets are passed in argv more often than
/// they should be; the agent is not where they should end up.
pub fn redact_secrets(args: Vec<String>) -> Vec<String> {
    let mut out = Vec::with_capacity(args.len());
    let mut value_next = false;
    for arg in args {
        if value_next && !arg.starts_with('-') {
            value_next = false;
            out.push(REDACTED.to_string());
            continue;
        }
        value_next = false;
        match arg.split_once('=') {
            Some((name, value)) if !value.is_empty() && secret_name(name) => {
                out.push(format!("{name}={REDACTED}"));
            }
            None if arg.starts_with('-') && secret_name(&arg) => {
                value_next = true;
                out.push(arg);
            }
            _ => out.push(arg),
        }
    }
    out
}

/// A flag (`--hf-token`) or variable (`WANDB_API_KEY`) naming a secret,
/// by its words: `token` names one, `tokenizer` does not.
fn secret_name(name: &str) -> bool {
    const WORDS: [&str; 9] = [
        "token",
        "password",
        "passwd",
        "secret",
        "credential",
        "credentials",
        "apikey",
        "accesskey",
        "auth",
    ];
    const KEYS: [&str; 4] = ["api", "access", "secret", "private"];
    let name = name.trim_start_matches('-');
    if name.is_empty() || name.len() > 64 {
        return false;
    }
    let words: Vec<String> = name
        .split(|c: char| !c.is_ascii_alphanumeric())
        .map(str::to_ascii_lowercase)
        .collect();
    words.iter().any(|w| WORDS.contains(&w.as_str()))
        || words
            .windows(2)
            .any(|p| KEYS.contains(&p[0].as_str()) && p[1] == "key")
}

fn uid(pid: u32) -> Option<u32> {
    parse_status_uid(&read_lossy(&format!("/proc/{pid}/status"))?)
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
            let comm = read_lossy(&format!("/proc/{pid}/task/{tid}/comm"))?;
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
    fn a_comm_closing_its_own_parenthesis_does_not_shift_the_fields() {
        let tail = "S 77 8 8 0 -1 4194304 1 0 0 0 3 4 0 0 20 0 2 0 777 123456 100";
        for comm in ["(a) b)", "a) b", ")", "x) S 1 (y", ") R 5 6 7 8", " )( "] {
            let text = format!("1234 ({comm}) {tail}");
            let s = parse_stat(&text).unwrap();
            assert_eq!(
                (s.comm.as_str(), s.state, s.ppid),
                (comm, 'S', 77),
                "{text}"
            );
            assert_eq!(
                ProcStat::parse(&text),
                Some(ProcStat {
                    comm: comm.into(),
                    start_time: 777,
                    vsize: 123456
                }),
                "{text}"
            );
        }
        // Fields missing after the comm: no stat, not a shifted one.
        assert!(ProcStat::parse("1 ((a) b) S 1 2 3").is_none());
        assert!(parse_stat("1 ((a) b)").is_none());
        assert!(parse_stat(") 1 (").is_none());
    }

    #[test]
    fn a_thread_named_with_bytes_that_are_not_utf8_is_read() {
        // The kernel keeps the first 15 bytes: all of these.
        let name = b"\xff(a) b)\xfe";
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            // A thread may rename itself through its own comm file.
            fs::write("/proc/thread-self/comm", name).unwrap();
            let link = fs::read_link("/proc/thread-self").unwrap();
            let tid: u32 = link.file_name().unwrap().to_str().unwrap().parse().unwrap();
            tx.send(tid).unwrap();
            done_rx.recv().ok();
        });
        let tid = rx.recv().unwrap();
        let want = "\u{fffd}(a) b)\u{fffd}";
        let s = stat(tid).expect("a thread's stat with a comm that is not UTF-8");
        assert_eq!(s.comm, want);
        let p = ProcStat::parse(&read_lossy(&format!("/proc/{tid}/stat")).unwrap()).unwrap();
        assert_eq!(p.comm, want);
        assert!(p.vsize > 0 && p.start_time > 0);
        let me = std::process::id();
        let listed = threads(me);
        assert!(
            listed.iter().any(|t| t.tid == tid && t.comm == want),
            "{listed:?}"
        );
        done_tx.send(()).unwrap();
        t.join().unwrap();
    }

    #[test]
    fn secrets_in_command_lines_are_redacted_and_nothing_else() {
        let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            redact_secrets(args(&[
                "torchrun",
                "--hf-token=hf_abc",
                "--password",
                "hunter2",
                "WANDB_API_KEY=k1",
                "--tokenizer-model=/m/tok.model",
                "--api_key",
                "--lr=0.1",
                "--keys=3",
                "train.py",
            ])),
            args(&[
                "torchrun",
                "--hf-token=[redacted]",
                "--password",
                "[redacted]",
                "WANDB_API_KEY=[redacted]",
                "--tokenizer-model=/m/tok.model",
                "--api_key",
                "--lr=0.1",
                "--keys=3",
                "train.py",
            ]),
            "a flag with no value before the next flag keeps the next flag"
        );
        assert_eq!(
            parse_cmdline(b"python\0--secret\0s3cr3t\0--auth=u:p\0"),
            args(&["python", "--secret", "[redacted]", "--auth=[redacted]"])
        );
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
