//! The scheduler path allocates nothing in steady state. A separate test
//! binary because it installs a counting global allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use xpuscope_perfetto::TraceWriter;

struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.with(|a| a.set(a.get() + 1));
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.with(|a| a.set(a.get() + 1));
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

/// A few hundred tasks with kernel-length comms, on 4 CPUs.
fn feed(w: &mut TraceWriter<std::io::Sink>, from: u64, n: u64, comms: &[String]) {
    for i in from..from + n {
        let cpu = (i % 4) as u32;
        let ts = 1_000_000 + i * 1_000;
        let task = (i.wrapping_mul(2_654_435_761) % comms.len() as u64) as usize;
        w.sched_switch(
            cpu,
            ts,
            (i % 3) as i64,
            100_000 + task as i32,
            120,
            &comms[task],
        )
        .unwrap();
        if i % 4 == 0 {
            w.sched_waking(cpu, ts + 10, 100_000 + task as i32, 1, 120, &comms[task])
                .unwrap();
        }
    }
}

#[test]
fn sched_path_is_allocation_free_in_steady_state() {
    let comms: Vec<String> = (0..300).map(|i| format!("worker-{i:08}")).collect();
    let mut w = TraceWriter::new(std::io::sink());
    feed(&mut w, 0, 200_000, &comms); // warm up: buffers and pools grow
    let before = allocations();
    feed(&mut w, 200_000, 400_000, &comms);
    let after = allocations();
    assert_eq!(
        after - before,
        0,
        "allocations while encoding 500k sched events"
    );
    w.finish().unwrap();
}
