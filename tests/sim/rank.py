#!/usr/bin/env python3
"""One rank of the simulated training job, in CPython: the loop of
src/rank.c with real Python functions (train_step, forward, backward,
allreduce_gradients, optimizer_step, dataloader_main) calling the device
libraries through ctypes, so Python stacks mean something. Same command line,
step log and fault injection as the C rank; the launcher starts it with
--lang python.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import queue
import signal
import sys
import threading
import time

from sim_devices import DriverKernel, open_device

_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_NAME, PR_SET_DUMPABLE = 15, 4
BATCH_BYTES = 64 * 1024
# Most pages of the expandable segment.
SEGMENT_PAGES = 64


def boot_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME)


def real_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_REALTIME)


def cpu_work_us(us: int) -> None:
    """Burns `us` microseconds of this thread's CPU time (holding the GIL)."""
    end = time.thread_time_ns() + us * 1000
    x = 1
    while time.thread_time_ns() < end:
        for _ in range(200):
            x = (x * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF


def num_at(text: str, conv=float):
    a, _, b = text.rpartition("@")
    return conv(a), int(b)


class StepLog:
    def __init__(self, path: str):
        self.f = open(path, "a", buffering=1)
        self.lock = threading.Lock()

    def write(self, **fields) -> None:
        line = json.dumps(fields, separators=(",", ":"))
        with self.lock:
            self.f.write(line + "\n")
            self.f.flush()

    def fault(self, kind: str, step: int, **extra) -> None:
        self.write(event="fault", kind=kind, step=step, **extra, boot_ns=boot_ns(),
                   real_ns=real_ns())


class Comm:
    def __init__(self, line: str):
        parts = line.split()
        self.name, self.kind = parts[0], parts[1]
        self.size, self.rank = int(parts[2]), int(parts[3])
        self.members = [int(m) for m in parts[4:4 + self.size]]
        self.handle = None
        self.seq = 0


def parse_args(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--flavor", choices=["nvidia", "ascend"], default="nvidia")
    p.add_argument("--lib-dir")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--comms")
    p.add_argument("--rdv")
    p.add_argument("--step-log", required=True)
    for name, default in [("microbatches", 2), ("layers", 3), ("kernel-us", 300),
                          ("opt-kernels", 2), ("opt-kernel-us", 200), ("host-us", 200),
                          ("loader-us", 200), ("prefetch", 2), ("grad-mb", 4), ("act-kb", 256),
                          ("start-delay-ms", 0), ("init-delay-ms", 0), ("hang-step", -1), ("hang-inside", -1)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--start-gate")
    p.add_argument("--tolerate-errors", action="store_true")
    p.add_argument("--activity-api", action="store_true")
    p.add_argument("--activity-log")
    p.add_argument("--expandable-segments", action="store_true")
    p.add_argument("--driver-launches", action="store_true")
    p.add_argument("--slow")
    p.add_argument("--host-work")
    p.add_argument("--stall")
    p.add_argument("--leak")
    p.add_argument("--crash")
    p.add_argument("--hang")
    p.add_argument("--delay")
    p.add_argument("--delay-step")
    p.add_argument("--throttle")
    p.add_argument("--xid")
    args = p.parse_args(argv)
    if args.expandable_segments and args.flavor != "nvidia":
        p.error("--expandable-segments needs --flavor nvidia")
    return args


class Rank:
    FWD = ["embedding_fwd", "attention_fwd", "mlp_fwd"]
    BWD = ["mlp_bwd", "attention_bwd"]
    OPT = ["grad_scale", "adam"]
    # Kernels of libraries that launch below the runtime (src/rank.c). NVIDIA,
    # through the driver: a cuBLAS GEMM (cuModuleGetFunction +
    # cuLaunchKernel), a Triton kernel (cuLibraryGetKernel +
    # cuKernelGetFunction + cuLaunchKernelEx), and the nodes of a CUDA graph
    # launched whole (cuGraphLaunch). Ascend, through the CANN runtime:
    # operator kernels by registered stub (rtFunctionRegister +
    # rtKernelLaunch) and by stub found by name (rtGetFunctionByName +
    # rtKernelLaunchWithFlag); no graphs.
    # Each: (name, got through the library API, launched by the Ex / WithFlag call).
    DRIVER = {"nvidia": [("sim_cublas_gemm", False, False), ("sim_triton_fused_adam", True, True)],
              "ascend": [("sim_tbe_matmul", False, False), ("sim_tbe_fused_adam", True, True)]}
    GRAPH_NODES = {"nvidia": ["sim_graph_rmsnorm", "sim_graph_rotary"], "ascend": []}

    def __init__(self, args):
        self.a = args
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.log = StepLog(args.step_log)
        self.dev = open_device(args.flavor, args.lib_dir)
        self.step = -1
        self.mem_bytes = 0
        self.kernel_ns = 0
        # Launches this step: through the runtime, straight through the
        # driver, graphs.
        self.runtime_launches = self.driver_launches = self.graph_launches = 0
        self.driver_kernels = [DriverKernel(name, library, ex)
                               for name, library, ex in Rank.DRIVER[args.flavor]]
        self.graph_nodes = [DriverKernel(name) for name in Rank.GRAPH_NODES[args.flavor]]
        # The expandable segment: reserved range, page size, mapped pages'
        # handles.
        self.seg_base = self.seg_page = 0
        self.seg_handles: list[int] = []
        self.leaked = []
        self.hang_inside_logged = False
        self.slow = num_at(args.slow) if args.slow else (1.0, -1)
        self.host_work = num_at(args.host_work, int) if args.host_work else (0, -1)
        self.stall = num_at(args.stall, int) if args.stall else (0, -1)
        self.leak = num_at(args.leak, int) if args.leak else (0, -1)
        self.crash = num_at(args.crash, int) if args.crash else (0, -1)
        self.hang = args.hang.rpartition("@") if args.hang else None
        self.delay_step = num_at(args.delay_step, int) if args.delay_step else (0, -1)
        self.throttle = num_at(args.throttle, int) if args.throttle else (GPU_MAX_MHZ, -1)
        self.xid = num_at(args.xid, int) if args.xid else (0, -1)
        self.gpu = GpuState(self.local_rank, self.dev.flavor)
        if args.delay:
            ms, _, rest = args.delay.partition("@")
            comm, _, seq = rest.rpartition("@")
            self.delay = (int(ms), comm, int(seq))
        else:
            self.delay = None
        self.comms = []
        if args.comms:
            with open(args.comms) as f:
                self.comms = [Comm(line) for line in f if line.strip() and line[0] != "#"]
        self.dp = next((c for c in self.comms if c.kind == "dp"), None)
        self.tp = next((c for c in self.comms if c.kind == "tp"), None)
        self.pp_next = next((c for c in self.comms if c.kind == "pp" and c.rank == 0), None)
        self.pp_prev = next((c for c in self.comms if c.kind == "pp" and c.rank == 1), None)

    # ---- helpers ----

    def check(self, err: int, what: str) -> None:
        if err and not self.a.tolerate_errors:
            print(f"sim rank {self.rank}: {what} failed at step {self.step}: {err}",
                  file=sys.stderr, flush=True)
            self.log.write(event="error", what=what, status=err, step=self.step)
            os._exit(1)

    def alloc(self, nbytes: int, what: str):
        err, ptr = self.dev.malloc(nbytes)
        if err == 0:
            self.mem_bytes += nbytes
        elif err != self.dev.OOM:
            self.check(err, what)
        return err, ptr

    def kernel_time(self, base_ns: int) -> int:
        factor, from_step = self.slow
        ns = int(base_ns * factor) if 0 <= from_step <= self.step else base_ns
        # A GPU at a lower clock runs the same kernel longer, in proportion.
        mhz, throttle_step = self.throttle
        if 0 <= throttle_step <= self.step:
            ns = ns * GPU_MAX_MHZ // mhz
        return ns

    def launch(self, name: str, base_ns: int) -> None:
        ns = self.kernel_time(base_ns)
        self.kernel_ns += ns
        self.check(self.dev.launch(self.kernels[name], ns, self.compute), "kernel launch")
        self.runtime_launches += 1

    def before_collective(self, c: Comm, op: str, grad_sync: bool = False) -> None:
        seq = c.seq
        c.seq += 1
        where = {"comm": c.name, "seq": seq, "op": op}
        delay_ms = 0
        if self.delay and self.delay[1] == c.name and self.delay[2] == seq:
            delay_ms = self.delay[0]
        elif grad_sync and self.delay_step[1] == self.step:
            delay_ms = self.delay_step[0]
        if delay_ms > 0:
            self.log.fault("delay", self.step, ms=delay_ms, **where)
            late_before_collective(delay_ms)
        hang_here = self.hang is not None and self.hang[0] == c.name and int(self.hang[2]) == seq
        if hang_here or (grad_sync and self.a.hang_step == self.step):
            self.log.fault("hang", self.step, **where)
            stuck_before_collective()
        if self.a.hang_inside == seq and c.kind != "pp" and not self.hang_inside_logged:
            self.hang_inside_logged = True
            self.log.fault("hang_inside", self.step, **where)

    def sync(self, stream, what="stream sync") -> None:
        self.check(self.dev.stream_sync(stream), what)

    # ---- set-up ----

    def setup(self) -> None:
        a = self.a
        self.log.write(event="init", rank=self.rank, local_rank=self.local_rank,
                       world_size=self.world, pid=os.getpid(), flavor=self.dev.flavor,
                       lang="python", boot_ns=boot_ns(), real_ns=real_ns())
        if self.a.init_delay_ms:
            # Time for an agent attached to the launcher to probe the
            # libraries just loaded, before communicator set-up.
            time.sleep(self.a.init_delay_ms / 1000)
        self.check(self.dev.init(self.local_rank), "device init")
        if a.driver_launches or a.expandable_segments:
            self.dev.open_driver()
        if a.activity_log:
            self.dev.activity.open_log(a.activity_log)
        self.check(self.dev.activity_start(a.activity_api), "activity consumer start")
        self.kernels = {}
        for name in self.FWD + self.BWD + self.OPT:
            err, handle = self.dev.register_kernel(name, not a.tolerate_errors)
            self.check(err, "register kernel")
            self.kernels[name] = handle
        err, self.compute = self.dev.stream_create()
        self.check(err, "compute stream create")
        err, self.comm_stream = self.dev.stream_create()
        self.check(err, "comm stream create")
        for c in self.comms:
            self.rendezvous(c)
        self.grad_count = (a.grad_mb << 20) // 4
        self.act_count = (a.act_kb << 10) // 4
        tp = self.tp.size if self.tp else 1
        sizes = {"params": self.grad_count * 4, "grads": self.grad_count * 4, "input": BATCH_BYTES,
                 "act": self.act_count * 4, "act_grad": self.act_count * 4,
                 "tp_gather": self.act_count * 4 * tp}
        self.buf = {}
        for name, nbytes in sizes.items():
            err, self.buf[name] = self.alloc(nbytes, f"alloc {name}")
            if err and not a.tolerate_errors:
                print(f"sim rank {self.rank}: out of memory at start-up", file=sys.stderr)
                os._exit(1)
        # An expandable segment reserves address space only: nothing mapped.
        if a.expandable_segments:
            err, self.seg_page = self.dev.segment_page_size()
            self.check(err, "segment granularity")
            err, self.seg_base = self.dev.segment_reserve(SEGMENT_PAGES * self.seg_page)
            self.check(err, "segment reserve")
        if self.dp:
            self.before_collective(self.dp, "broadcast")
            self.check(self.dev.broadcast(self.buf["params"], self.grad_count, 0, self.dp.handle,
                                          self.comm_stream), "broadcast")
            self.sync(self.comm_stream)

    def rendezvous(self, c: Comm) -> None:
        path = os.path.join(self.a.rdv, f"{c.name}.id")
        size = ctypes.sizeof(self.dev.ID_TYPE)
        if c.rank == 0:
            err, blob = self.dev.comm_id_create()
            self.check(err, f"unique id of {c.name}")
            tmp = f"{path}.tmp.{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(blob)
            os.rename(tmp, path)
        else:
            deadline = time.monotonic() + 120
            while True:
                try:
                    with open(path, "rb") as f:
                        blob = f.read()
                    if len(blob) == size:
                        break
                except FileNotFoundError:
                    pass
                if time.monotonic() > deadline:
                    print(f"sim rank {self.rank}: timed out waiting for {path}", file=sys.stderr)
                    os._exit(1)
                time.sleep(0.002)
        err, c.handle = self.dev.comm_init(c.size, blob, c.rank)
        self.log.write(event="comm_init", comm=c.name, kind=c.kind, size=c.size, comm_rank=c.rank,
                       handle=hex(c.handle.value or 0), status=err, boot_ns=boot_ns())
        self.check(err, f"init of communicator {c.name}")

    def wait_for_start(self) -> None:
        self.gpu.mem_used = self.mem_bytes
        self.gpu.publish()
        self.log.write(event="ready", rank=self.rank, pid=os.getpid(), flavor=self.dev.flavor,
                       mem_bytes=self.mem_bytes, boot_ns=boot_ns(), real_ns=real_ns())
        if self.a.start_delay_ms:
            time.sleep(self.a.start_delay_ms / 1000)
        while self.a.start_gate and not os.path.exists(self.a.start_gate):
            time.sleep(0.01)
        self.log.write(event="start", boot_ns=boot_ns(), real_ns=real_ns())


# The GPU's highest SM clock as the stand-in NVML reports it.
GPU_MAX_MHZ = 1980


class GpuState:
    """This rank's device (index LOCAL_RANK) for the stand-in management
    library: its GPU for libnvidia-ml.so.1 (state file under
    $STANDIN_NVML_DIR, format: standin_nvml.h) or, for the Ascend flavor,
    its NPU for libdcmi.so (under $STANDIN_DCMI_DIR, format:
    standin_dcmi.h), written aside and renamed over the old one. Nothing
    without the variable."""

    def __init__(self, index: int, flavor: str):
        self.ascend = flavor == "ascend"
        d = os.environ.get("STANDIN_DCMI_DIR" if self.ascend else "STANDIN_NVML_DIR")
        name = f"npu{index}" if self.ascend else f"gpu{index}"
        self.path = os.path.join(d, name) if d else None
        self.pids = [os.getpid()]
        self.sm_mhz = GPU_MAX_MHZ
        self.reasons = 0
        self.util = 90
        self.mem_used = 0
        # An Xid on a GPU, an error code on an NPU (whose health then
        # turns to a major alarm).
        self.xids: list[int] = []

    def throttle(self, mhz: int) -> None:
        # NVML names a thermal slowdown; DCMI shows the frequency alone.
        self.sm_mhz, self.reasons = mhz, (0 if self.ascend else 0x20)  # SwThermalSlowdown
        self.publish()

    def publish(self) -> None:
        if not self.path:
            return
        lines = [f"pid {p}" for p in self.pids]
        if self.ascend:
            lines += [f"aicore_mhz {self.sm_mhz}", f"max_aicore_mhz {GPU_MAX_MHZ}",
                      f"util_aicore {self.util}", f"hbm_used_mb {(self.mem_used + (1 << 20) - 1) >> 20}",
                      f"hbm_total_mb {64 << 10}", f"health {2 if self.xids else 0}"]
            lines += [f"error_code {x}" for x in self.xids]
        else:
            lines += [f"sm_mhz {self.sm_mhz}", f"max_sm_mhz {GPU_MAX_MHZ}",
                      f"reasons {self.reasons}", f"util_gpu {self.util}",
                      f"mem_used {self.mem_used}", f"mem_total {80 << 30}", "ecc_uncorrected 0"]
            lines += [f"xid {x}" for x in self.xids]
        with open(self.path + ".tmp", "w") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(self.path + ".tmp", self.path)


# ---- the faults, as functions that show up on stacks ----

def stuck_before_collective() -> None:
    while True:
        time.sleep(3600)


def late_before_collective(ms: int) -> None:
    time.sleep(ms / 1000)


def crash_now(sig: int) -> None:
    _libc.prctl(PR_SET_DUMPABLE, 0)
    os.kill(os.getpid(), sig)
    os.abort()


def read_shard_stalled(r: Rank, index: int, ms: int) -> None:
    r.log.fault("dataloader_stall", index, ms=ms)
    time.sleep(ms / 1000)


def cache_activations(r: Rank) -> None:
    mb, from_step = r.leak
    if from_step < 0 or r.step < from_step:
        return
    if r.step == from_step:
        r.log.fault("mem_leak", r.step)
    err, ptr = r.alloc(mb << 20, "leak alloc")
    if err == r.dev.OOM:
        print(f"sim rank {r.rank}: out of memory at step {r.step}: tried to allocate "
              f"{mb << 20} bytes with {r.mem_bytes} bytes in use", file=sys.stderr, flush=True)
        r.log.write(event="oom", step=r.step, request_bytes=mb << 20, in_use_bytes=r.mem_bytes,
                    status=err, boot_ns=boot_ns(), real_ns=real_ns())
        os._exit(1)
    r.leaked.append(ptr)


# ---- the dataloader ----

def load_batch(r: Rank, index: int) -> bytearray:
    ms, step = r.stall
    if index == step and ms > 0:
        read_shard_stalled(r, index, ms)
    batch = bytearray(BATCH_BYTES)
    cpu_work_us(r.a.loader_us)
    return batch


def dataloader_main(r: Rank, q: queue.Queue) -> None:
    _libc.prctl(PR_SET_NAME, b"dataloader")
    for i in range(r.a.steps):
        q.put(load_batch(r, i))


# ---- below the runtime ----

def library_kernels(r: Rank, base_ns: int) -> None:
    """Library kernels launched through the driver (the CANN runtime on
    Ascend), and the graph (NVIDIA)."""
    ns = r.kernel_time(base_ns)
    for k in r.driver_kernels:
        r.check(r.dev.driver_launch(k, ns, r.compute), "driver launch")
        r.driver_launches += 1
        r.kernel_ns += ns
    if r.graph_nodes:
        r.check(r.dev.graph_launch(r.graph_nodes, ns, r.compute), "graph launch")
        r.graph_launches += 1
        r.kernel_ns += len(r.graph_nodes) * ns


def grow_segment(r: Rank, pages: int) -> None:
    """The expandable segment grows to `pages` mapped pages, one page at a
    time."""
    pages = min(pages, SEGMENT_PAGES)
    while len(r.seg_handles) < pages:
        addr = r.seg_base + len(r.seg_handles) * r.seg_page
        err, handle = r.dev.segment_map(addr, r.seg_page)
        r.check(err, "segment map")
        r.seg_handles.append(handle)
        r.mem_bytes += r.seg_page


def shrink_segment(r: Rank, pages: int) -> None:
    """... and shrinks to `pages`: its top pages unmapped in one call, then
    released."""
    n = len(r.seg_handles) - pages
    if n <= 0:
        return
    addr = r.seg_base + pages * r.seg_page
    r.check(r.dev.segment_unmap(addr, n * r.seg_page, r.seg_handles[pages:]), "segment unmap")
    del r.seg_handles[pages:]
    r.mem_bytes -= n * r.seg_page


# ---- the training step ----

def forward(r: Rank) -> None:
    cache_activations(r)
    # Activations: a page per microbatch, and more on some steps.
    if r.a.expandable_segments:
        grow_segment(r, r.a.microbatches + r.step % 3)
    k_ns = r.a.kernel_us * 1000
    b = r.buf
    for _ in range(r.a.microbatches):
        if r.pp_prev:
            r.before_collective(r.pp_prev, "recv")
            r.check(r.dev.recv(b["act"], r.act_count, 0, r.pp_prev.handle, r.comm_stream),
                    "pp recv")
            r.sync(r.comm_stream)
        for layer in range(r.a.layers):
            r.launch(Rank.FWD[layer % 3], k_ns)
        if r.tp:
            r.before_collective(r.tp, "all_gather")
            r.check(r.dev.allgather(b["act"], b["tp_gather"], r.act_count, r.tp.handle,
                                    r.compute), "tp all-gather")
        if r.pp_next:
            r.sync(r.compute)
            r.before_collective(r.pp_next, "send")
            r.check(r.dev.send(b["act"], r.act_count, 1, r.pp_next.handle, r.comm_stream),
                    "pp send")
    r.sync(r.compute)
    r.sync(r.comm_stream)


def backward(r: Rank) -> None:
    k_ns = 2 * r.a.kernel_us * 1000
    b = r.buf
    for _ in range(r.a.microbatches):
        if r.pp_next:
            r.before_collective(r.pp_next, "recv")
            r.check(r.dev.recv(b["act_grad"], r.act_count, 1, r.pp_next.handle, r.comm_stream),
                    "pp recv")
            r.sync(r.comm_stream)
        for layer in range(r.a.layers):
            r.launch(Rank.BWD[layer % 2], k_ns)
        if r.tp:
            r.before_collective(r.tp, "reduce_scatter")
            r.check(r.dev.reducescatter(b["tp_gather"], b["act_grad"], r.act_count, r.tp.handle,
                                        r.compute), "tp reduce-scatter")
        if r.pp_prev:
            r.sync(r.compute)
            r.before_collective(r.pp_prev, "send")
            r.check(r.dev.send(b["act_grad"], r.act_count, 0, r.pp_prev.handle, r.comm_stream),
                    "pp send")
    r.sync(r.compute)
    r.sync(r.comm_stream)


def allreduce_gradients(r: Rank) -> None:
    if r.dp is None:
        if r.delay_step[1] == r.step:
            r.log.fault("delay", r.step, ms=r.delay_step[0])
            late_before_collective(r.delay_step[0])
        if r.a.hang_step == r.step:
            r.log.fault("hang", r.step)
            stuck_before_collective()
        return
    r.before_collective(r.dp, "all_reduce", grad_sync=True)
    r.check(r.dev.allreduce(r.buf["grads"], r.grad_count, r.dp.handle, r.comm_stream),
            "dp all-reduce")
    r.sync(r.comm_stream)


def optimizer_step(r: Rank) -> None:
    k_ns = r.a.opt_kernel_us * 1000
    for i in range(r.a.opt_kernels):
        r.launch(Rank.OPT[i % 2], k_ns)
    if r.a.driver_launches:
        library_kernels(r, k_ns)
    r.sync(r.compute)
    # The allocator gives memory back: the segment shrinks.
    if r.a.expandable_segments:
        shrink_segment(r, r.step % 2)


def dispatch_host_work(r: Rank) -> None:
    extra_ms, from_step = r.host_work
    extra = extra_ms * 1000 if 0 <= from_step <= r.step else 0
    cpu_work_us(r.a.host_us + extra)


def train_step(r: Rank, q: queue.Queue) -> None:
    t0, real0 = boot_ns(), real_ns()
    r.kernel_ns = 0
    r.runtime_launches = r.driver_launches = r.graph_launches = 0
    r.log.write(event="step_begin", step=r.step, boot_ns=t0)
    sig, crash_step = r.crash
    if r.step == crash_step:
        r.log.fault("crash", r.step, signal=sig)
        crash_now(sig)
    if r.step == r.host_work[1]:
        r.log.fault("host_work", r.step, ms=r.host_work[0])
    if r.step == r.slow[1]:
        r.log.fault("slow", r.step, factor=r.slow[0])
    if r.step == r.throttle[1]:
        r.gpu.throttle(r.throttle[0])
        r.log.fault("throttle", r.step, mhz=r.throttle[0])
    if r.step == r.xid[1]:
        r.gpu.xids.append(r.xid[0])
        r.gpu.publish()
        r.log.fault("xid", r.step, code=r.xid[0])
    rng = r.dev.range_start(f"step {r.step}")
    batch = q.get()
    t_data = boot_ns()
    src = (ctypes.c_char * len(batch)).from_buffer(batch)
    r.check(r.dev.memcpy_h2d(r.buf["input"], ctypes.addressof(src), len(batch), r.compute),
            "h2d copy")
    dispatch_host_work(r)
    t_host = boot_ns()
    forward(r)
    t_fwd = boot_ns()
    backward(r)
    t_bwd = boot_ns()
    allreduce_gradients(r)
    t_sync = boot_ns()
    optimizer_step(r)
    t1 = boot_ns()
    r.dev.range_end(rng)
    del src
    records = r.dev.activity_drain()
    r.log.write(event="step", rank=r.rank, step=r.step, start_boot_ns=t0, end_boot_ns=t1,
                start_real_ns=real0, dur_ns=t1 - t0, data_wait_ns=t_data - t0,
                host_ns=t_host - t_data, fwd_ns=t_fwd - t_host, bwd_ns=t_bwd - t_fwd,
                grad_sync_ns=t_sync - t_bwd, opt_ns=t1 - t_sync, kernel_ns=r.kernel_ns,
                mem_bytes=r.mem_bytes, activity_records=records,
                segment_bytes=len(r.seg_handles) * r.seg_page,
                runtime_launches=r.runtime_launches, driver_launches=r.driver_launches,
                graph_launches=r.graph_launches)


def main(argv) -> int:
    r = Rank(parse_args(argv))
    r.setup()
    q: queue.Queue = queue.Queue(maxsize=max(1, r.a.prefetch))
    threading.Thread(target=dataloader_main, args=(r, q), name="dataloader", daemon=True).start()
    r.wait_for_start()
    for step in range(r.a.steps):
        r.step = step
        train_step(r, q)
    for c in r.comms:
        r.dev.comm_destroy(c.handle)
    # The process is gone from its GPU, as NVML shows it.
    r.gpu.pids, r.gpu.util, r.gpu.mem_used = [], 0, 0
    r.gpu.publish()
    r.log.write(event="done", steps=r.a.steps, boot_ns=boot_ns(), real_ns=real_ns())
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.exit(main(sys.argv[1:]))
