//! Where the probe of every exported function of some ELF libraries goes,
//! and how long deciding it takes: `cargo run --release -p xpuscope-probes
//! --example placement_report -- LIB...`. Prints one line per function
//! (`name +offset probed_insn (cost) first=... skipped=[...]`) to stdout
//! and the time per placement to stderr, so two builds (e.g. two decoders)
//! can be compared with `diff`.

use std::io::{Read, Seek, SeekFrom};
use std::time::Instant;

use xpuscope_probes::placement::{CODE_BYTES, Reg, RegSet, place};
use xpuscope_probes::resolve::exported_functions;

fn main() {
    // The decoders' widest read set: every argument register and rsp.
    let reads = (0..6).fold(RegSet::EMPTY.with(Reg::Rsp), |s, i| s.with(Reg::arg(i)));
    let mut codes = Vec::new();
    for path in std::env::args().skip(1) {
        let exports = exported_functions(path.as_ref()).expect("an ELF library");
        let mut file = std::fs::File::open(&path).expect("open");
        for f in exports {
            let mut code = vec![0u8; CODE_BYTES.min(f.size.max(1) as usize)];
            file.seek(SeekFrom::Start(f.file_offset)).expect("seek");
            let n = file.read(&mut code).expect("read");
            code.truncate(n);
            codes.push((format!("{path}:{}", f.name), f.vaddr, code));
        }
    }
    for (name, vaddr, code) in &codes {
        let p = place(code, *vaddr, reads);
        println!("{name} {p} first={} skipped={:?}", p.first_insn, p.skipped);
    }
    // Timing: every placement, repeated until about a second has passed.
    let start = Instant::now();
    let mut rounds = 0u64;
    while start.elapsed().as_secs_f64() < 1.0 {
        for (_, vaddr, code) in &codes {
            std::hint::black_box(place(code, *vaddr, reads));
        }
        rounds += 1;
    }
    let per = start.elapsed().as_secs_f64() / (rounds as f64 * codes.len() as f64);
    eprintln!(
        "{} functions, {rounds} rounds: {:.2} us per placement",
        codes.len(),
        per * 1e6
    );
}
