//! Flood control for device calls: past a rate per (process, function),
//! calls are summarized per thread and per 100 ms window (counts per
//! function and the time spent in them) instead of a record each, so a pathological loop
//! (860k `cudaDeviceSynchronize` a second) cannot blow up memory or the
//! trace. Calls that carry what diagnosis needs are never summarized:
//! collectives and communicator set-up (sequence numbers), device memory
//! (the ledger and OOM stacks), and failed calls.

use foldhash::{HashMap, HashMapExt};

use xpuscope_probes::catalog::CallKind;
use xpuscope_probes::decode::DeviceCall;

use crate::model::{CallSummary, Record};

/// Length of a summary window.
pub const WINDOW_NS: u64 = 100_000_000;
/// Most (process, function) buckets and summary windows kept; past it,
/// calls are recorded one by one (never lost).
const MAX_KEYS: usize = 1 << 16;

/// Whether calls of `kind` may be summarized.
fn limitable(kind: CallKind) -> bool {
    !matches!(
        kind,
        CallKind::Collective(_)
            | CallKind::SendRecv(_)
            | CallKind::UniqueId
            | CallKind::CommInit(_)
            | CallKind::CommEnd(_)
            | CallKind::Malloc
            | CallKind::Free
            | CallKind::ActivityNextRecord
            | CallKind::ActivityFlush
            | CallKind::ActivityRegister
            | CallKind::ActivityEnable
    )
}

struct Bucket {
    tokens: f64,
    last_ns: u64,
}

pub struct FloodLimiter {
    /// Calls per second per (process, function) recorded one by one; 0:
    /// no limit.
    rate: u32,
    buckets: HashMap<(u32, &'static str), Bucket>,
    /// One window per thread: windows of one thread never overlap, so
    /// their slices nest with its other calls.
    windows: HashMap<(u32, u32), CallSummary>,
}

impl FloodLimiter {
    pub fn new(rate: u32) -> Self {
        Self {
            rate,
            buckets: HashMap::new(),
            windows: HashMap::new(),
        }
    }

    /// Whether `call` gets a record of its own; if not, it is counted in its
    /// thread's summary window (a window that ended is pushed to `out`).
    pub fn admit(&mut self, call: &DeviceCall, out: &mut Vec<Record>) -> bool {
        if self.rate == 0 || call.error || !limitable(call.kind) {
            return true;
        }
        let rate = f64::from(self.rate);
        let key = (call.tgid, call.function);
        if !self.buckets.contains_key(&key) && self.buckets.len() >= MAX_KEYS {
            return true;
        }
        let bucket = self.buckets.entry(key).or_insert(Bucket {
            tokens: rate,
            last_ns: call.start_ts,
        });
        let elapsed = call.start_ts.saturating_sub(bucket.last_ns) as f64 / 1e9;
        bucket.tokens = (bucket.tokens + elapsed * rate).min(rate);
        bucket.last_ns = bucket.last_ns.max(call.start_ts);
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            return true;
        }
        let wkey = (call.tgid, call.tid);
        if let Some(w) = self.windows.get(&wkey)
            && call.start_ts >= w.start + WINDOW_NS
            && let Some(done) = self.windows.remove(&wkey)
        {
            out.push(Record::CallsSummarized(done));
        }
        if !self.windows.contains_key(&wkey) && self.windows.len() >= MAX_KEYS {
            return true;
        }
        let end = call.end_ts.unwrap_or(call.start_ts).max(call.start_ts);
        let w = self.windows.entry(wkey).or_insert(CallSummary {
            tgid: call.tgid,
            tid: call.tid,
            functions: Vec::new(),
            start: call.start_ts,
            end,
            calls: 0,
            busy_ns: 0,
        });
        match w.functions.iter_mut().find(|f| f.1 == call.function) {
            Some(f) => f.2 += 1,
            None => w.functions.push((call.library.name(), call.function, 1)),
        }
        w.calls += 1;
        w.busy_ns += end - call.start_ts;
        w.end = w.end.max(end);
        false
    }

    /// Thread `tid` exited: its windows end.
    pub fn thread_exited(&mut self, tgid: u32, tid: u32, out: &mut Vec<Record>) {
        self.flush(|k| k.0 == tgid && k.1 == tid, out);
    }

    /// Process `tgid` ended: its windows end, its buckets go.
    pub fn process_ended(&mut self, tgid: u32, out: &mut Vec<Record>) {
        self.flush(|k| k.0 == tgid, out);
        self.buckets.retain(|k, _| k.0 != tgid);
    }

    /// The recording ended: every window ends.
    pub fn finish(&mut self, out: &mut Vec<Record>) {
        self.flush(|_| true, out);
    }

    fn flush(&mut self, which: impl Fn(&(u32, u32)) -> bool, out: &mut Vec<Record>) {
        let mut keys: Vec<_> = self.windows.keys().filter(|k| which(k)).copied().collect();
        keys.sort_unstable();
        for k in keys {
            if let Some(w) = self.windows.remove(&k) {
                out.push(Record::CallsSummarized(w));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use xpuscope_probes::catalog::{Library, SyncKind};
    use xpuscope_probes::decode::args::CallArgs;

    use super::*;

    fn sync(tid: u32, ts: u64) -> DeviceCall {
        DeviceCall {
            library: Library::Cudart,
            function: "cudaDeviceSynchronize",
            kind: CallKind::Sync(SyncKind::Device),
            tgid: 1,
            tid,
            start_ts: ts,
            end_ts: Some(ts + 100),
            args: CallArgs::None,
            ret: Some(0),
            error: false,
            name: "cudaDeviceSynchronize".into(),
            comm: None,
            memory: None,
            site: None,
            launches: None,
        }
    }

    #[test]
    fn past_the_rate_calls_are_summarized_per_window() {
        let mut f = FloodLimiter::new(100);
        let mut out = Vec::new();
        // 1,000 calls in 0.25 s: the first 100 (the burst) and about 25
        // refilled ones are recorded, the rest summarized per 100 ms.
        let mut admitted = 0;
        for i in 0..1_000u64 {
            if f.admit(&sync(7, i * 250_000), &mut out) {
                admitted += 1;
            }
        }
        f.finish(&mut out);
        let summarized: u64 = out
            .iter()
            .map(|r| match r {
                Record::CallsSummarized(s) => s.calls,
                _ => 0,
            })
            .sum();
        assert!((100..=130).contains(&admitted), "{admitted}");
        assert_eq!(admitted + summarized, 1_000, "every call is counted once");
        assert!(out.len() >= 2, "several 100 ms windows: {}", out.len());
        for r in &out {
            let Record::CallsSummarized(s) = r else {
                panic!()
            };
            assert!(s.end - s.start < WINDOW_NS + 1_000, "{s:?}");
            assert_eq!(s.busy_ns, s.calls * 100);
        }
    }

    #[test]
    fn calls_diagnosis_needs_are_never_summarized() {
        let mut f = FloodLimiter::new(1);
        let mut out = Vec::new();
        let mut failed = sync(7, 0);
        failed.error = true;
        let mut malloc = sync(7, 0);
        malloc.kind = CallKind::Malloc;
        for i in 0..100 {
            failed.start_ts = i;
            malloc.start_ts = i;
            assert!(f.admit(&failed, &mut out));
            assert!(f.admit(&malloc, &mut out));
        }
        assert!(
            FloodLimiter::new(0).admit(&sync(7, 0), &mut out),
            "0: no limit"
        );
        assert!(out.is_empty());
    }
}
