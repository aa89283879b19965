#!/usr/bin/env python3
"""Launch a simulated distributed training job on this machine.

Starts WORLD_SIZE rank processes (C programs built by tests/sim/Makefile, or
the CPython flavor rank.py) on the stand-in device libraries, the way
torchrun does: RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR in the
environment, one process per rank, pinned round-robin to the CPUs, all
killed when one fails. Injects faults and writes a ground-truth JSON file.

    python3 tests/sim/launch.py --steps 100 --out-dir /tmp/job
    python3 tests/sim/launch.py --fault slow:rank=3,factor=3,from_step=20
    # two "nodes" of 4 ranks each, every launcher started on its own:
    python3 tests/sim/launch.py --world-size 8 --nnodes 2 --node-rank 0 --rdv-dir /tmp/rdv &
    python3 tests/sim/launch.py --world-size 8 --nnodes 2 --node-rank 1 --rdv-dir /tmp/rdv

See tests/sim/README.md. Python 3.11 standard library only.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import sim_faults
import sim_nodes
import sim_truth
from sim_layout import Layout, build_layout, collectives_per_step, comm_file_text

HERE = Path(__file__).resolve().parent
DEFAULT_BUILD = HERE.parent.parent / "target" / "fixtures" / "sim"
SCHEMA = "xpuscope-sim-ground-truth/1"
POLL_S = 0.01
# The longest a gated job waits for its start gate before it counts as hung.
GATE_WAIT_S = 600.0
KILL_GRACE_S = 1.0

# (flag, default, help): passed to every rank program unchanged.
WORKLOAD_OPTS = [
    ("microbatches", 2, "microbatches per step (PP send/recv and TP collectives each)"),
    ("layers", 3, "forward kernels per microbatch (backward: as many, twice as long)"),
    ("kernel-us", 300, "forward kernel duration in microseconds"),
    ("opt-kernels", 2, "optimizer kernels per step"),
    ("opt-kernel-us", 200, "optimizer kernel duration in microseconds"),
    ("host-us", 200, "CPU time of the main thread per step (dispatch work)"),
    ("loader-us", 200, "CPU time of the dataloader per batch"),
    ("prefetch", 2, "dataloader queue depth"),
    ("grad-mb", 4, "gradient bytes all-reduced over DP per step (MiB)"),
    ("act-kb", 256, "activation bytes per microbatch (KiB): PP send/recv, TP all-gather"),
]


def clock_pair() -> dict:
    return {
        "boot_ns": time.clock_gettime_ns(time.CLOCK_BOOTTIME),
        "real_ns": time.clock_gettime_ns(time.CLOCK_REALTIME),
    }


@dataclass
class RankProc:
    rank: int
    local_rank: int
    cpu: int | None
    argv: list[str]
    env_extra: dict[str, str]
    step_log: Path
    log: Path
    activity_log: Path | None = None
    proc: subprocess.Popen | None = None
    status: str = "running"
    killed_by_launcher: str | None = None  # "timeout", "peer_failure", "abort"
    exit_clock: dict | None = None


@dataclass
class Neighbour:
    fault: sim_faults.Fault
    cpu: int
    proc: subprocess.Popen | None = None
    started: dict | None = None
    stopped: dict | None = None
    trigger_step: int | None = None


@dataclass
class StepLogTail:
    """Reads a rank's JSON-lines log incrementally (complete lines only)."""

    path: Path
    offset: int = 0
    pending: bytes = b""
    max_step_begun: int = -1
    events: list = field(default_factory=list)

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        self.offset += len(data)
        lines = (self.pending + data).split(b"\n")
        self.pending = lines.pop()
        for line in lines:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("event") == "step_begin":
                self.max_step_begun = max(self.max_step_begun, ev["step"])


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="fault kinds:\n" + sim_faults.__doc__.split("\n\n", 2)[2],
    )
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--world-size", type=int, help="number of ranks (default 8, or tp*pp*dp)")
    p.add_argument("--tp", type=int, help="tensor-parallel size (default 2 when world %% 4 == 0)")
    p.add_argument("--pp", type=int, help="pipeline stages (default 2 when world %% 4 == 0)")
    p.add_argument("--dp", type=int, help="data-parallel size (default world / (tp*pp))")
    p.add_argument("--flavor", choices=["nvidia", "ascend"], default="nvidia")
    p.add_argument("--lang", choices=["c", "python"], default="c")
    p.add_argument("--fault", action="append", default=[], metavar="KIND:K=V,...",
                   help="inject a fault (repeatable), e.g. slow:rank=3,factor=3,from_step=20")
    p.add_argument("--fault-file", help="JSON list of faults ({kind, rank, ...})")
    p.add_argument("--out-dir", help="where logs and ground_truth.json go (default: a new /tmp dir)")
    p.add_argument("--job-name", help="XPUSCOPE_JOB / JOB_NAME (default sim-<flavor>-<pid>)")
    p.add_argument("--job-env", metavar="NAME",
                   help="name the job in this variable only, instead of XPUSCOPE_JOB, JOB_NAME "
                        "and TORCHELASTIC_RUN_ID (a site's own variable)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds before a job still running is killed and recorded as hung "
                        "(counted from the start gate's opening, when given)")
    p.add_argument("--start-delay-ms", type=int, default=0,
                   help="ranks pause this long after init, before step 0 (time to attach)")
    p.add_argument("--start-gate", help="ranks wait after init until this file exists")
    p.add_argument("--on-failure", choices=["kill", "wait"], default="kill",
                   help="when a rank fails: kill the others as torchrun does, or let them "
                        "run into the timeout (hang) (default kill)")
    p.add_argument("--cpus", help="CPUs to pin ranks to round-robin (default: all allowed)")
    p.add_argument("--no-pin", action="store_true", help="do not pin ranks to CPUs")
    p.add_argument("--bw-gbps", type=float, default=10.0,
                   help="stand-in collective bandwidth (STANDIN_NCCL_BW_GBPS / _HCCL_)")
    p.add_argument("--device-mem-mb", type=int,
                   help="stand-in device memory per rank (STANDIN_DEVICE_MEM_BYTES)")
    p.add_argument("--build-dir", default=str(DEFAULT_BUILD),
                   help="the sim fixture build (bin/ inside; stand-ins in ../standins/lib)")
    p.add_argument("--real-libs", metavar="DIR",
                   help="run on the real NVIDIA libraries pip-installed into DIR "
                        "(LD_LIBRARY_PATH; errors tolerated, no GPU needed)")
    p.add_argument("--activity-api", action="store_true",
                   help="the ranks' CUPTI/MSPTI consumers also enable host API records "
                        "(CUPTI RUNTIME / MSPTI API), which link each kernel to its launch "
                        "by correlation id")
    p.add_argument("--activity-log", action="store_true",
                   help="each rank writes every activity record it reads to "
                        "rank<R>.activity.jsonl")
    p.add_argument("--expandable-segments", action="store_true",
                   help="as PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: each rank keeps its "
                        "activations in a reserved range it maps page by page through the CUDA "
                        "driver (cuMemCreate + cuMemMap) and unmaps as it shrinks (NVIDIA; C and "
                        "Python ranks)")
    p.add_argument("--driver-launches", action="store_true",
                   help="each rank also launches library kernels straight through the layer "
                        "below the runtime every step (C and Python ranks): NVIDIA, the CUDA "
                        "driver (cuLaunchKernel as cuBLAS, cuLaunchKernelEx as Triton, a CUDA "
                        "graph by cuGraphLaunch); Ascend, the CANN runtime (rtKernelLaunch, "
                        "rtKernelLaunchWithFlag as operator libraries)")
    p.add_argument("--init-delay-ms", type=int, default=0,
                   help="ranks pause this long before their first device call (an agent "
                        "attached to the launcher then probes communicator set-up)")
    p.add_argument("--spawn-gate",
                   help="the launcher starts its ranks only once this file exists (attach an "
                        "agent to the launcher first)")
    p.add_argument("--nnodes", type=int, default=1,
                   help="nodes of the job, one launcher each (torchrun --nnodes)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this launcher's node (0-based): it starts ranks "
                        "K*L .. K*L+L-1, L = world size / nnodes")
    p.add_argument("--rdv-dir",
                   help="directory every node's launcher shares (rendezvous, communicator ids, "
                        "the job's ground truth); needed with --nnodes > 1; fresh per job")
    p.add_argument("--node-name",
                   help="run this node in its own UTS namespace with this hostname (root)")
    p.add_argument("--quiet", action="store_true")
    for name, default, help_ in WORKLOAD_OPTS:
        p.add_argument(f"--{name}", type=int, default=default, help=help_)
    args = p.parse_args(argv)
    if args.real_libs and args.flavor != "nvidia":
        p.error("--real-libs only exists for --flavor nvidia")
    if args.expandable_segments and args.flavor != "nvidia":
        p.error("--expandable-segments needs --flavor nvidia")
    return args


def real_lib_path(root: str) -> str:
    base = Path(root).resolve()
    dirs = [base / "nvidia" / sub / "lib" for sub in ("cuda_runtime", "nccl", "cuda_cupti")]
    return ":".join(str(d) for d in dirs + [base] if d.is_dir())


def rank_argv(args, build: Path, rank: int, comm_file: Path, rdv: Path, step_log: Path,
              activity_log: Path | None, inj: sim_faults.RankInjection | None) -> list[str]:
    if args.lang == "c":
        argv = [str(build / "bin" / f"sim_rank_{args.flavor}")]
    else:
        argv = [sys.executable, str(HERE / "rank.py"), "--flavor", args.flavor]
        if not args.real_libs:
            argv += ["--lib-dir", str(build.parent / "standins" / "lib")]
    argv += ["--steps", str(args.steps), "--comms", str(comm_file), "--rdv", str(rdv),
             "--step-log", str(step_log)]
    for name, _, _ in WORKLOAD_OPTS:
        argv += [f"--{name}", str(getattr(args, name.replace("-", "_")))]
    if args.start_delay_ms:
        argv += ["--start-delay-ms", str(args.start_delay_ms)]
    if args.start_gate:
        argv += ["--start-gate", str(Path(args.start_gate).resolve())]
    if args.init_delay_ms:
        argv += ["--init-delay-ms", str(args.init_delay_ms)]
    if args.real_libs:
        argv.append("--tolerate-errors")
    if args.activity_api:
        argv.append("--activity-api")
    if args.expandable_segments:
        argv.append("--expandable-segments")
    if args.driver_launches:
        argv.append("--driver-launches")
    if activity_log:
        argv += ["--activity-log", str(activity_log)]
    if inj:
        argv += inj.args
    return argv


def preexec(cpu: int | None):
    """Runs in the child before exec: pin it and make it die with the launcher."""
    libc = ctypes.CDLL(None, use_errno=True)

    def setup():
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})

    return setup


class Job:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.build = Path(args.build_dir).resolve()
        self.layout: Layout = build_layout(args.world_size, args.tp, args.pp, args.dp)
        faults = [sim_faults.parse_spec(s) for s in args.fault]
        if args.fault_file:
            faults += sim_faults.parse_file(args.fault_file)
        sim_faults.validate(faults, self.layout.world_size,
                            {c.name for c in self.layout.comms}, args.steps)
        if args.lang == "python" and any(f.kind == "device_error" for f in faults):
            raise sim_faults.FaultError("fault device_error: C ranks only (--lang c)")
        self.faults = faults
        self.node = sim_nodes.spec_from_args(args, self.layout.world_size)
        self.local_ranks = set(self.node.local_ranks(self.layout.world_size))
        if args.job_name:
            self.job = args.job_name
        elif self.node.multi:
            self.job = sim_nodes.default_job_name(args.flavor, self.node.rdv_dir)
        else:
            self.job = f"sim-{args.flavor}-{os.getpid()}"
        if args.out_dir:
            self.out = Path(args.out_dir).resolve()
            self.out.mkdir(parents=True, exist_ok=True)
        elif self.node.multi:
            self.out = self.node.rdv_dir / f"node{self.node.node_rank}"
            self.out.mkdir(parents=True, exist_ok=True)
        else:
            import tempfile

            self.out = Path(tempfile.mkdtemp(prefix=f"xpuscope-{self.job}-"))
        self.gt_path = self.out / "ground_truth.json"
        # Where the ranks play their devices for the stand-in management
        # library: GPUs for libnvidia-ml.so.1, NPUs for libdcmi.so (one
        # state file per local device; an agent points the stand-in here).
        self.nvml_dir = self.out / "nvml"
        self.dcmi_dir = self.out / "dcmi"
        (self.nvml_dir if args.flavor == "nvidia" else self.dcmi_dir).mkdir(
            parents=True, exist_ok=True)
        allowed = sorted(os.sched_getaffinity(0))
        self.cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else allowed
        self.ranks: list[RankProc] = []
        # A cpu_hog is not pinned (cpu None): it spreads over the job's CPUs.
        self.neighbours = [Neighbour(f, self.cpu_of(f.rank) if f.kind == "cpu_contention"
                                     else None)
                           for f in faults
                           if f.kind in ("cpu_contention", "cpu_hog")
                           and f.rank in self.local_ranks]
        self.tails: dict[int, StepLogTail] = {}
        self.status = "running"
        self.hang: dict | None = None
        self.first_failure: dict | None = None
        self.launch_clock = clock_pair()
        self.end_clock: dict | None = None

    def cpu_of(self, rank: int) -> int | None:
        local = rank - min(self.local_ranks)
        return None if self.args.no_pin else self.cpus[local % len(self.cpus)]

    def local_faults(self) -> list[sim_faults.Fault]:
        return [f for f in self.faults if f.rank in self.local_ranks]

    # ---- set-up ----

    def base_env(self) -> dict[str, str]:
        a = self.args
        env = {
            "WORLD_SIZE": str(self.layout.world_size),
            "LOCAL_WORLD_SIZE": str(len(self.local_ranks)),
            "GROUP_RANK": str(self.node.node_rank),
            "NODE_RANK": str(self.node.node_rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
            "NCCL_SOCKET_IFNAME": "lo",
            "STANDIN_NCCL_BW_GBPS": str(a.bw_gbps),
            "STANDIN_HCCL_BW_GBPS": str(a.bw_gbps),
            "PYTHONUNBUFFERED": "1",
        }
        for name in [a.job_env] if a.job_env else ["XPUSCOPE_JOB", "JOB_NAME",
                                                    "TORCHELASTIC_RUN_ID"]:
            env[name] = self.job
        if a.flavor == "ascend":
            env["RANK_SIZE"] = str(self.layout.world_size)
            env["STANDIN_DCMI_DIR"] = str(self.dcmi_dir)
        else:
            env["STANDIN_NVML_DIR"] = str(self.nvml_dir)
        if a.device_mem_mb:
            env["STANDIN_DEVICE_MEM_BYTES"] = str(a.device_mem_mb << 20)
        if a.real_libs:
            path = real_lib_path(a.real_libs)
            old = os.environ.get("LD_LIBRARY_PATH")
            env["LD_LIBRARY_PATH"] = f"{path}:{old}" if old else path
        return env

    def prepare(self) -> None:
        a = self.args
        if a.lang == "c":
            binary = self.build / "bin" / f"sim_rank_{a.flavor}"
            if not binary.exists():
                raise SystemExit(f"launch.py: {binary} not built: run "
                                 f"`make -C tests/standins OUT=target/fixtures/standins && "
                                 f"make -C tests/sim` (or cargo test -p xpuscope-tests)")
        comm_dir = self.out / "comms"
        comm_dir.mkdir(exist_ok=True)
        if self.node.multi:
            # Shared by every node; fresh per job (registration refuses a
            # directory an earlier job used).
            sim_nodes.register(self.node, self.job, self.layout.world_size, self.out)
            rdv = self.node.rdv_dir / "ids"
        else:
            rdv = self.out / "rdv"
            rdv.mkdir(exist_ok=True)
            for stale in rdv.iterdir():
                stale.unlink()
        inj = sim_faults.injections(self.local_faults(), a.flavor)
        base = self.base_env()
        for c in self.layout.ranks:
            r = c.rank
            if r not in self.local_ranks:
                continue
            local = r - min(self.local_ranks)
            comm_file = comm_dir / f"rank{r}.comms"
            comm_file.write_text(comm_file_text(self.layout, r))
            step_log = self.out / f"rank{r}.steps.jsonl"
            step_log.unlink(missing_ok=True)
            activity_log = self.out / f"rank{r}.activity.jsonl" if a.activity_log else None
            if activity_log:
                activity_log.unlink(missing_ok=True)
            env = dict(base)
            env.update({"RANK": str(r), "LOCAL_RANK": str(local)})
            if a.flavor == "ascend":
                env.update({"RANK_ID": str(r), "DEVICE_ID": str(local),
                            "ASCEND_DEVICE_ID": str(local)})
            if r in inj:
                env.update(inj[r].env)
            self.ranks.append(RankProc(
                rank=r, local_rank=local, cpu=self.cpu_of(r),
                argv=rank_argv(a, self.build, r, comm_file, rdv, step_log, activity_log,
                               inj.get(r)),
                env_extra=env, step_log=step_log, log=self.out / f"rank{r}.log",
                activity_log=activity_log))
            self.tails[r] = StepLogTail(step_log)

    # ---- running ----

    def start(self) -> None:
        if self.node.multi:
            sim_nodes.wait_for_nodes(self.node, self.job, self.args.timeout)
        if self.args.spawn_gate:
            self.write_ground_truth()  # the launcher's pid and layout, before any rank
            gate = Path(self.args.spawn_gate)
            # The job's own time (--timeout) starts with its ranks.
            deadline = time.monotonic() + GATE_WAIT_S
            while not gate.exists():
                if time.monotonic() > deadline:
                    raise sim_nodes.NodeError(f"--spawn-gate {gate} did not appear within "
                                              f"{GATE_WAIT_S} s")
                time.sleep(POLL_S)
        self.launch_clock = clock_pair()
        for rp in self.ranks:
            env = dict(os.environ)
            env.update(rp.env_extra)
            with open(rp.log, "wb") as log:
                rp.proc = subprocess.Popen(rp.argv, env=env, stdin=subprocess.DEVNULL,
                                           stdout=log, stderr=subprocess.STDOUT,
                                           preexec_fn=preexec(rp.cpu), cwd=self.out)
        self.write_ground_truth()
        if not self.args.quiet:
            pids = " ".join(f"{rp.rank}:{rp.proc.pid}" for rp in self.ranks)
            print(f"launch.py: job {self.job}: {len(self.ranks)} ranks started (rank:pid {pids}); "
                  f"ground truth {self.gt_path}", flush=True)

    def start_neighbour(self, n: Neighbour, step: int) -> None:
        p = n.fault.params
        if n.fault.kind == "cpu_hog":
            # CPU -1: the neighbour keeps the launcher's CPUs (the job's).
            cpu, threads = -1, p["threads"] or 2 * len(self.cpus)
        else:
            cpu, threads = (n.cpu if n.cpu is not None else 0), p["threads"]
        argv = [str(self.build / "bin" / "noisy_neighbour"), str(cpu), str(threads),
                str(p["duration_ms"])]
        n.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, preexec_fn=preexec(None))
        n.started = clock_pair()
        n.trigger_step = step

    def poll_neighbours(self) -> None:
        for n in self.neighbours:
            if n.proc is None:
                tail = self.tails[n.fault.rank]
                tail.poll()
                if tail.max_step_begun >= n.fault.params["from_step"]:
                    self.start_neighbour(n, tail.max_step_begun)
            elif n.stopped is None and n.proc.poll() is not None:
                n.stopped = clock_pair()

    def stop_neighbours(self) -> None:
        for n in self.neighbours:
            if n.proc is not None and n.proc.poll() is None:
                n.proc.kill()
                n.proc.wait()
            if n.proc is not None and n.stopped is None:
                n.stopped = clock_pair()

    def kill_ranks(self, reason: str, status: str) -> None:
        alive = [rp for rp in self.ranks if rp.proc is not None and rp.proc.poll() is None]
        for rp in alive:
            rp.killed_by_launcher = reason
            rp.status = status
            rp.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + KILL_GRACE_S
        for rp in alive:
            try:
                rp.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rp.proc.kill()
                rp.proc.wait()
            rp.exit_clock = clock_pair()

    def reap(self) -> list[RankProc]:
        """Records ranks that exited on their own; returns those that failed."""
        failed = []
        for rp in self.ranks:
            if rp.exit_clock is None and rp.proc.poll() is not None:
                rp.exit_clock = clock_pair()
                rc = rp.proc.returncode
                rp.status = "ok" if rc == 0 else ("crashed" if rc < 0 else "failed")
                if rc != 0:
                    failed.append(rp)
        return failed

    def run(self) -> int:
        # With a start gate the job's time starts when the gate opens (a
        # test opens it once its agent is attached, which a busy machine
        # may take seconds to do); until then only a generous bound holds.
        gate = Path(self.args.start_gate) if self.args.start_gate else None
        deadline = time.monotonic() + (GATE_WAIT_S if gate else self.args.timeout)
        while True:
            if gate is not None and gate.exists():
                gate = None
                deadline = time.monotonic() + self.args.timeout
            failed = self.reap()
            if failed and self.first_failure is None:
                rp = failed[0]
                self.first_failure = {"rank": rp.rank, "status": rp.status,
                                      "returncode": rp.proc.returncode, **rp.exit_clock}
                if self.node.multi:
                    sim_nodes.report_failure(self.node, rp.rank, rp.status)
                if self.args.on_failure == "kill":
                    self.kill_ranks("peer_failure", "terminated")
            elif (self.node.multi and self.first_failure is None
                  and self.args.on_failure == "kill"):
                peer = sim_nodes.peer_failure(self.node)
                if peer is not None:
                    self.first_failure = {"rank": peer["rank"], "status": peer["status"],
                                          "node_rank": peer["node_rank"], **clock_pair()}
                    self.kill_ranks("peer_failure", "terminated")
            if all(rp.exit_clock is not None for rp in self.ranks):
                break
            if time.monotonic() >= deadline:
                alive = [rp.rank for rp in self.ranks if rp.proc.poll() is None]
                self.hang = {"detected_by": "timeout", "timeout_s": self.args.timeout,
                             "ranks_alive": alive, **clock_pair()}
                self.kill_ranks("timeout", "hung")
                break
            self.poll_neighbours()
            time.sleep(POLL_S)
        self.stop_neighbours()
        self.end_clock = clock_pair()
        if self.hang:
            self.status = "hung"
        elif all(rp.status == "ok" for rp in self.ranks):
            self.status = "completed"
        else:
            self.status = "failed"
        self.write_ground_truth()
        if self.node.multi:
            sim_nodes.write_job_ground_truth(self.node)
        if not self.args.quiet:
            dur = (self.end_clock["boot_ns"] - self.launch_clock["boot_ns"]) / 1e9
            print(f"launch.py: job {self.job} {self.status} in {dur:.2f} s; "
                  f"ground truth {self.gt_path}", flush=True)
        return {"completed": 0, "failed": 1, "hung": 124}.get(self.status, 2)

    def abort(self, signum: int) -> None:
        self.kill_ranks("abort", "terminated")
        self.stop_neighbours()
        self.status = "aborted"
        self.end_clock = clock_pair()
        self.write_ground_truth()
        if self.node.multi:
            sim_nodes.write_job_ground_truth(self.node)
        raise SystemExit(128 + signum)

    # ---- ground truth ----

    def write_ground_truth(self) -> None:
        gt = sim_truth.ground_truth(self)
        tmp = self.gt_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(gt, indent=1) + "\n")
        tmp.rename(self.gt_path)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        job = Job(args)
        if args.node_name:
            sim_nodes.enter_uts_namespace(args.node_name)
        job.prepare()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda s, _f: job.abort(s))
        job.start()
    except (ValueError, sim_faults.FaultError, sim_nodes.NodeError) as e:
        print(f"launch.py: {e}", file=sys.stderr)
        return 2
    return job.run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
