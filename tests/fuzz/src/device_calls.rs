//! The device-call decoder fed arbitrary raw records: a sequence of
//! operations (entry, return, call site, thread exit, process exit), each
//! naming one probe of a table that holds every catalog function of every
//! library, with argument registers, stack words and copied bytes taken
//! from the input. What a traced process controls is exactly that: the
//! argument values and the memory behind them.

use xpuscope_common::uprobe::{DEREF_BYTES, ENTRY_STACK_WORDS, UprobeEntry, UprobeReturn};
use xpuscope_common::{EventHeader, EventKind};
use xpuscope_probes::catalog::{FunctionSpec, Library};
use xpuscope_probes::decode::Decoder;
use xpuscope_probes::decode::table::{ProbeTable, ProbeTarget};

/// Two processes, so per-process state (communicators, memory) is mixed.
const TGIDS: [u32; 2] = [100, 200];

/// Input bytes read front to back; zeros once they run out.
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        let Some((&b, rest)) = self.0.split_first() else {
            return 0;
        };
        self.0 = rest;
        b
    }

    fn u64(&mut self) -> u64 {
        // Mostly small values and the interesting edges, some raw words.
        match self.u8() % 8 {
            0 => 0,
            1 => u64::MAX,
            2 => u64::from(self.u8()),
            3 => 1 << (self.u8() % 64),
            _ => (0..8).fold(0, |w, i| w | u64::from(self.u8()) << (8 * i)),
        }
    }

    fn fill(&mut self, out: &mut [u8]) -> u32 {
        let n = usize::from(self.u8()).min(out.len());
        for b in out.iter_mut().take(n) {
            *b = self.u8();
        }
        // The claimed length may exceed what was copied: the kernel's is a
        // number the decoder must not trust blindly either.
        if self.u8() & 1 == 0 {
            n as u32
        } else {
            u32::from(self.u8()) * 4
        }
    }
}

fn functions() -> Vec<(Library, &'static FunctionSpec)> {
    Library::ALL
        .into_iter()
        .flat_map(|l| l.functions().iter().map(move |f| (l, f)))
        .collect()
}

fn probe_ip(i: usize) -> u64 {
    0x7f00_0000_0000 + 0x100 * i as u64
}

/// Feeds `data` to a fresh [`Decoder`] as a sequence of records.
pub fn device_calls(data: &[u8]) {
    let functions = functions();
    let mut table = ProbeTable::new();
    for &tgid in &TGIDS {
        for (i, &(library, function)) in functions.iter().enumerate() {
            let target = ProbeTarget {
                library,
                function,
                sp_delta: 0,
            };
            table.insert(tgid, probe_ip(i), target);
            table.insert_slot(i as u32, target);
        }
    }
    let mut decoder = Decoder::new(table);
    let mut input = Bytes(data);
    let mut out = Vec::new();
    let mut ts = 1_000u64;
    while !input.0.is_empty() {
        let op = input.u8();
        let tgid = TGIDS[usize::from(op >> 7)];
        let tid = tgid + u32::from(input.u8() % 4);
        let pick = usize::from(input.u8()) | usize::from(input.u8()) << 8;
        // Mostly a known probe; sometimes an address nothing is attached at.
        let index = pick % (functions.len() + 1);
        let ip = probe_ip(index);
        ts += u64::from(input.u8());
        match op % 8 {
            0..=2 => {
                let mut e = UprobeEntry {
                    header: EventHeader {
                        kind: EventKind::UprobeEntry as u32,
                        cpu: 0,
                        ts,
                    },
                    tid,
                    tgid,
                    probe_ip: ip,
                    args: [0; 6],
                    sp: 0x7ffd_0000_1000,
                    stack: [0; ENTRY_STACK_WORDS],
                    deref_len: 0,
                    slot: index as u32,
                    deref: [0; DEREF_BYTES],
                };
                for a in &mut e.args {
                    *a = input.u64();
                }
                for w in e.stack.iter_mut().take(usize::from(input.u8() % 9)) {
                    *w = input.u64();
                }
                e.deref_len = input.fill(&mut e.deref);
                decoder.on_entry(&e, &mut out);
            }
            3..=5 => {
                let mut r = UprobeReturn {
                    header: EventHeader {
                        kind: EventKind::UprobeReturn as u32,
                        cpu: 0,
                        ts,
                    },
                    tid,
                    tgid,
                    probe_ip: ip,
                    ret: input.u64(),
                    deref_len: 0,
                    slot: index as u32,
                    launches: Default::default(),
                    deref: [0; DEREF_BYTES],
                };
                r.deref_len = input.fill(&mut r.deref);
                decoder.on_return(&r, &mut out);
            }
            6 => decoder.on_call_site(tgid, tid, ip, input.u64()),
            _ if op & 0x40 == 0 => decoder.thread_exited(tgid, tid, &mut out),
            _ => decoder.process_exited(tgid, &mut out),
        }
        // What the trace stage does with each result: format it.
        for d in out.drain(..) {
            let _ = format!("{d:?}");
        }
    }
    let _ = decoder.stats();
    let _ = decoder.in_flight().count();
    for &tgid in &TGIDS {
        let _ = decoder.memory(tgid).map(|m| format!("{m:?}"));
        let _ = decoder.communicators(tgid).map(|c| format!("{c:?}"));
    }
}
