"""Several "nodes" of one simulated job, each with its own launcher.

Real jobs start one launcher per machine (torchrun --nnodes N --node-rank K)
and those launchers meet in a rendezvous before any rank starts. Here the
"machines" share one kernel, so the launchers meet in a shared directory
(--rdv-dir) and the ranks of every node reach each other through the
stand-ins' POSIX shared-memory communicators, whose unique ids rank 0 of each
communicator publishes as files under <rdv-dir>/ids.

    <rdv-dir>/launchers/node<K>.json   a launcher's registration (created once:
                                       a second launcher for node K, or a stale
                                       directory, is refused)
    <rdv-dir>/ids/<comm>.id            communicator unique ids
    <rdv-dir>/failed                   the first rank failure anywhere: every
                                       launcher stops its ranks (torchrun's
                                       peer-failure handling)
    <rdv-dir>/ground_truth.json        the job's ground truth: every node's,
                                       rewritten as each launcher finishes

A node may get its own UTS namespace and hostname (--node-name), so an agent
run in that namespace (nsenter --uts --target <launcher pid>) records the
node's name, as a real node's agent would.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWUTS = 0x04000000
JOB_SCHEMA = "xpuscope-sim-job-ground-truth/1"


class NodeError(ValueError):
    pass


@dataclass
class NodeSpec:
    nnodes: int
    node_rank: int
    rdv_dir: Path | None
    node_name: str | None

    @property
    def multi(self) -> bool:
        return self.rdv_dir is not None

    def local_ranks(self, world_size: int) -> list[int]:
        local = world_size // self.nnodes
        return list(range(self.node_rank * local, (self.node_rank + 1) * local))

    def to_json(self, world_size: int) -> dict:
        return {
            "nnodes": self.nnodes,
            "node_rank": self.node_rank,
            "node_name": self.node_name,
            "hostname": socket.gethostname(),
            "launcher_pid": os.getpid(),
            "local_world_size": world_size // self.nnodes,
            "ranks": self.local_ranks(world_size),
            "rdv_dir": str(self.rdv_dir) if self.rdv_dir else None,
        }


def spec_from_args(args, world_size: int) -> NodeSpec:
    if args.nnodes < 1:
        raise NodeError("--nnodes must be at least 1")
    if not 0 <= args.node_rank < args.nnodes:
        raise NodeError(f"--node-rank {args.node_rank} outside 0..{args.nnodes - 1}")
    if world_size % args.nnodes:
        raise NodeError(f"world size {world_size} is not a multiple of --nnodes {args.nnodes}")
    if args.nnodes > 1 and not args.rdv_dir:
        raise NodeError("--nnodes > 1 needs --rdv-dir (the directory every node's launcher shares)")
    rdv = Path(args.rdv_dir).resolve() if args.rdv_dir else None
    return NodeSpec(args.nnodes, args.node_rank, rdv, args.node_name)


def default_job_name(flavor: str, rdv_dir: Path) -> str:
    """The same on every node: derived from the shared directory."""
    digest = hashlib.sha1(str(rdv_dir).encode()).hexdigest()[:8]
    return f"sim-{flavor}-{digest}"


def enter_uts_namespace(name: str) -> None:
    """Gives this launcher (and the ranks it starts) its own hostname."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUTS) != 0:
        err = ctypes.get_errno()
        raise NodeError(f"--node-name needs a new UTS namespace: unshare failed: "
                        f"{os.strerror(err)} (run as root)")
    socket.sethostname(name)


def register(spec: NodeSpec, job: str, world_size: int, out_dir: Path) -> None:
    """Creates this node's registration; refuses a taken slot."""
    d = spec.rdv_dir / "launchers"
    d.mkdir(parents=True, exist_ok=True)
    (spec.rdv_dir / "ids").mkdir(exist_ok=True)
    path = d / f"node{spec.node_rank}.json"
    info = spec.to_json(world_size) | {"job": job, "out_dir": str(out_dir)}
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise NodeError(f"{path} exists: node {spec.node_rank} already registered in "
                        f"{spec.rdv_dir} (a second launcher, or a directory left by an earlier "
                        f"job: give every job a fresh --rdv-dir)") from None
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)


def registrations(spec: NodeSpec) -> dict[int, dict]:
    out = {}
    for k in range(spec.nnodes):
        try:
            out[k] = json.loads((spec.rdv_dir / "launchers" / f"node{k}.json").read_text())
        except (FileNotFoundError, ValueError):
            pass  # not there yet, or being written
    return out


def wait_for_nodes(spec: NodeSpec, job: str, timeout_s: float) -> dict[int, dict]:
    """The launchers' rendezvous: every node registered for the same job."""
    deadline = time.monotonic() + timeout_s
    while True:
        regs = registrations(spec)
        for k, r in regs.items():
            if r.get("job") != job:
                raise NodeError(f"node {k} registered for job {r.get('job')!r}, this launcher "
                                f"runs {job!r}: give every node the same --job-name")
        if len(regs) == spec.nnodes:
            return regs
        if time.monotonic() > deadline:
            missing = sorted(set(range(spec.nnodes)) - set(regs))
            raise NodeError(f"nodes {missing} did not join {spec.rdv_dir} within {timeout_s} s")
        time.sleep(0.02)


def report_failure(spec: NodeSpec, rank: int, status: str) -> None:
    path = spec.rdv_dir / "failed"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return  # another node failed first
    with os.fdopen(fd, "w") as f:
        json.dump({"node_rank": spec.node_rank, "rank": rank, "status": status}, f)


def peer_failure(spec: NodeSpec) -> dict | None:
    """The first failure reported by another node, if any."""
    try:
        info = json.loads((spec.rdv_dir / "failed").read_text())
    except (FileNotFoundError, ValueError):
        return None
    return info if info.get("node_rank") != spec.node_rank else None


def _combined_status(statuses: list[str | None]) -> str:
    if any(s is None or s == "running" for s in statuses):
        return "running"
    for s in ("aborted", "hung", "failed"):
        if s in statuses:
            return s
    return "completed"


def write_job_ground_truth(spec: NodeSpec) -> None:
    """Rewrites <rdv-dir>/ground_truth.json from every node's own ground
    truth (under a lock: launchers finish at about the same time)."""
    lock_path = spec.rdv_dir / ".ground_truth.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        regs = registrations(spec)
        nodes = []
        for k in range(spec.nnodes):
            reg = regs.get(k)
            gt = None
            if reg:
                try:
                    gt = json.loads((Path(reg["out_dir"]) / "ground_truth.json").read_text())
                except (FileNotFoundError, ValueError):
                    gt = None
            nodes.append((k, reg, gt))
        present = [gt for _, _, gt in nodes if gt]
        if not present:
            return
        first = present[0]
        ranks = sorted((r for gt in present for r in gt["ranks"]), key=lambda r: r["rank"])
        job = {
            "schema": JOB_SCHEMA,
            "job": first["job"],
            "status": _combined_status([gt["status"] if gt else None for _, _, gt in nodes]),
            "flavor": first["flavor"],
            "lang": first["lang"],
            "steps": first["steps"],
            "layout": first["layout"],
            "communicators": first["communicators"],
            "nodes": [{"node_rank": k,
                       "node_name": (reg or {}).get("node_name"),
                       "hostname": (reg or {}).get("hostname"),
                       "launcher_pid": (reg or {}).get("launcher_pid"),
                       "out_dir": (reg or {}).get("out_dir"),
                       "ranks": (reg or {}).get("ranks"),
                       "status": gt["status"] if gt else None,
                       "ground_truth": str(Path(reg["out_dir"]) / "ground_truth.json")
                       if reg else None}
                      for k, reg, gt in nodes],
            "ranks": ranks,
            "faults": [f for gt in present for f in gt["faults"]],
        }
        path = spec.rdv_dir / "ground_truth.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(job, indent=1) + "\n")
        tmp.rename(path)
