"""Faults the simulated job can inject, each turned into rank arguments,
environment variables or launcher actions, and described in the ground truth.

A fault is given on the command line as `KIND:key=value,key=value` or in a
JSON fault file (a list of objects, or {"faults": [...]}) with the same keys
plus "kind". Steps are 0-based; sequence numbers (seq) are 0-based and count
the operations the rank issues on that communicator, the start-up broadcast
included (see sim_layout.collectives_per_step), as the stand-ins count them.

  slow            rank, factor=3, from_step=0      compute kernels take factor x longer
  host_work       rank, ms, from_step=0            the main thread spends ms more CPU time
                                                   on host work every step (host-bound)
  hang            rank, step | comm+seq            stop before that collective (the
                                                   step's DP gradient all-reduce for step=)
  hang_inside     rank, seq (0-based)              STANDIN_*_HANG_AT_SEQ: block inside the
                                                   seq-th collective of each communicator
  delay           rank, ms, step | comm+seq        arrive ms late at that collective
  cpu_contention  rank, from_step=0, threads=2,    a noisy neighbour spinning on rank's CPU
                  duration_ms=0 (until the end)
  cpu_hog         from_step=0, threads=0 (two per  a process spinning on every CPU of the
                  CPU), duration_ms=0, rank=0      job (not pinned): every rank loses alike;
                                                   rank is whose step starts it
  dataloader_stall rank, step, ms                  the loader sleeps ms before batch step
  mem_leak        rank, mb=64, from_step=0,        allocate mb more every step until the
                  device_mem_mb (optional)         device allocator fails (exit 1)
  slow_link       rank, factor=4                   STANDIN_LINK_SLOWDOWN for that rank
  crash           rank, step, signal=SIGABRT       raise the signal at the start of step
  device_error    rank, step, code (flavor's)      device allocations fail with status code
                                                   from that step (not out of memory); the
                                                   rank exits 1
  throttle        rank, mhz, from_step=0           the rank's GPU clock drops to mhz (of 1980)
                                                   with a thermal clock-event reason (the
                                                   stand-in NVML shows it); its kernels take
                                                   1980/mhz x longer. Ascend flavor: its
                                                   NPU's AI Core frequency drops, with no
                                                   reason (the stand-in DCMI shows it)
  xid             rank, code=79, step              the rank's GPU raises Xid code (NVML's
                                                   event set delivers it) at the step's start.
                                                   Ascend flavor: its NPU lists code as a
                                                   DCMI error code (decimal) and its health
                                                   turns to a major alarm
"""

from __future__ import annotations

import json
import signal as _signal
from dataclasses import dataclass, field

KINDS = {
    "slow": {"rank": int, "factor": float, "from_step": int},
    "host_work": {"rank": int, "ms": int, "from_step": int},
    "hang": {"rank": int, "step": int, "comm": str, "seq": int},
    "hang_inside": {"rank": int, "seq": int},
    "delay": {"rank": int, "ms": int, "step": int, "comm": str, "seq": int},
    "cpu_contention": {"rank": int, "from_step": int, "threads": int, "duration_ms": int},
    "cpu_hog": {"rank": int, "from_step": int, "threads": int, "duration_ms": int},
    "dataloader_stall": {"rank": int, "step": int, "ms": int},
    "mem_leak": {"rank": int, "mb": int, "from_step": int, "device_mem_mb": int},
    "slow_link": {"rank": int, "factor": float},
    "crash": {"rank": int, "step": int, "signal": str},
    "device_error": {"rank": int, "step": int, "code": int},
    "throttle": {"rank": int, "mhz": int, "from_step": int},
    "xid": {"rank": int, "code": int, "step": int},
}

# A device error's status when the fault names none: the flavor's "the
# device is gone" (cudaErrorNoDevice, ACL_ERROR_RT_INTERNAL_ERROR).
DEVICE_ERROR_CODE = {"nvidia": 100, "ascend": 507000}

DEFAULTS = {
    "slow": {"factor": 3.0, "from_step": 0},
    "host_work": {"from_step": 0},
    "cpu_contention": {"from_step": 0, "threads": 2, "duration_ms": 0},
    "cpu_hog": {"rank": 0, "from_step": 0, "threads": 0, "duration_ms": 0},
    "mem_leak": {"mb": 64, "from_step": 0},
    "slow_link": {"factor": 4.0},
    "crash": {"signal": "SIGABRT"},
    "throttle": {"from_step": 0},
    # Xid 79: "GPU has fallen off the bus".
    "xid": {"code": 79},
}

REQUIRED = {
    "hang_inside": ["seq"],
    "delay": ["ms"],
    "host_work": ["ms"],
    "dataloader_stall": ["step", "ms"],
    "crash": ["step"],
    "device_error": ["step"],
    "throttle": ["mhz"],
    "xid": ["step"],
}


class FaultError(ValueError):
    pass


@dataclass
class Fault:
    kind: str
    params: dict

    @property
    def rank(self) -> int:
        return self.params["rank"]

    def to_json(self) -> dict:
        return {"kind": self.kind, **self.params}


@dataclass
class RankInjection:
    """What the launcher gives one rank: extra arguments and environment."""

    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


def parse_spec(spec: str) -> Fault:
    kind, _, rest = spec.partition(":")
    params: dict = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise FaultError(f"fault '{spec}': expected key=value, got '{item}'")
        params[key.strip()] = value.strip()
    return make_fault(kind.strip(), params)


def parse_file(path: str) -> list[Fault]:
    with open(path) as f:
        data = json.load(f)
    items = data.get("faults", []) if isinstance(data, dict) else data
    faults = []
    for item in items:
        item = dict(item)
        kind = item.pop("kind", None)
        if kind is None:
            raise FaultError(f"{path}: a fault without 'kind': {item}")
        faults.append(make_fault(kind, item))
    return faults


def make_fault(kind: str, raw: dict) -> Fault:
    if kind not in KINDS:
        raise FaultError(f"unknown fault kind '{kind}' (known: {', '.join(KINDS)})")
    types = KINDS[kind]
    params = dict(DEFAULTS.get(kind, {}))
    for key, value in raw.items():
        if key not in types:
            raise FaultError(f"fault {kind}: unknown key '{key}' (known: {', '.join(types)})")
        try:
            params[key] = types[key](value)
        except (TypeError, ValueError) as e:
            raise FaultError(f"fault {kind}: bad {key}={value!r}: {e}") from None
    if "rank" not in params:
        raise FaultError(f"fault {kind}: 'rank' is required")
    for key in REQUIRED.get(kind, []):
        if key not in params:
            raise FaultError(f"fault {kind}: '{key}' is required")
    if kind in ("hang", "delay"):
        by_step = "step" in params
        by_seq = "comm" in params and "seq" in params
        if by_step == by_seq:
            raise FaultError(f"fault {kind}: give either step= or comm= and seq=")
    if kind == "throttle" and not 0 < params["mhz"] < 1980:
        raise FaultError(f"fault throttle: mhz={params['mhz']} outside 1..1979")
    if kind == "crash":
        params["signal_number"] = signal_number(params["signal"])
    return Fault(kind, params)


def signal_number(name: str) -> int:
    if name.isdigit():
        return int(name)
    name = name.upper()
    if not name.startswith("SIG"):
        name = "SIG" + name
    try:
        return int(getattr(_signal, name))
    except AttributeError:
        raise FaultError(f"unknown signal '{name}'") from None


def validate(faults: list[Fault], world_size: int, comm_names: set[str], steps: int) -> None:
    for f in faults:
        if not 0 <= f.rank < world_size:
            raise FaultError(f"fault {f.kind}: rank {f.rank} outside 0..{world_size - 1}")
        comm = f.params.get("comm")
        if comm is not None and comm not in comm_names:
            raise FaultError(f"fault {f.kind}: no communicator '{comm}' "
                             f"(have: {', '.join(sorted(comm_names))})")
        step = f.params.get("step", f.params.get("from_step"))
        if step is not None and not 0 <= step < max(steps, 1):
            raise FaultError(f"fault {f.kind}: step {step} outside 0..{steps - 1}")


def injections(faults: list[Fault], flavor: str) -> dict[int, RankInjection]:
    """Rank arguments and environment for every rank some fault touches."""
    prefix = "STANDIN_NCCL" if flavor == "nvidia" else "STANDIN_HCCL"
    out: dict[int, RankInjection] = {}
    for f in faults:
        inj = out.setdefault(f.rank, RankInjection())
        p = f.params
        if f.kind == "slow":
            inj.args += ["--slow", f"{p['factor']}@{p['from_step']}"]
        elif f.kind == "host_work":
            inj.args += ["--host-work", f"{p['ms']}@{p['from_step']}"]
        elif f.kind == "hang":
            if "step" in p:
                inj.args += ["--hang-step", str(p["step"])]
            else:
                inj.args += ["--hang", f"{p['comm']}@{p['seq']}"]
        elif f.kind == "hang_inside":
            inj.env[f"{prefix}_HANG_AT_SEQ"] = str(p["seq"])
            inj.args += ["--hang-inside", str(p["seq"])]
        elif f.kind == "delay":
            if "step" in p:
                inj.args += ["--delay-step", f"{p['ms']}@{p['step']}"]
            else:
                inj.args += ["--delay", f"{p['ms']}@{p['comm']}@{p['seq']}"]
        elif f.kind == "dataloader_stall":
            inj.args += ["--stall", f"{p['ms']}@{p['step']}"]
        elif f.kind == "mem_leak":
            inj.args += ["--leak", f"{p['mb']}@{p['from_step']}"]
            if "device_mem_mb" in p:
                inj.env["STANDIN_DEVICE_MEM_BYTES"] = str(p["device_mem_mb"] << 20)
        elif f.kind == "slow_link":
            inj.env["STANDIN_LINK_SLOWDOWN"] = str(p["factor"])
        elif f.kind == "crash":
            inj.args += ["--crash", f"{p['signal_number']}@{p['step']}"]
        elif f.kind == "device_error":
            code = p.get("code") or DEVICE_ERROR_CODE[flavor]
            inj.args += ["--device-error", f"{code}@{p['step']}"]
        elif f.kind == "throttle":
            inj.args += ["--throttle", f"{p['mhz']}@{p['from_step']}"]
        elif f.kind == "xid":
            inj.args += ["--xid", f"{p['code']}@{p['step']}"]
        # cpu_contention is the launcher's doing (a noisy neighbour process).
    return out


# The kind of the rank's own {"event":"fault"} line for each fault kind.
EVENT_KIND = {
    "slow": "slow",
    "host_work": "host_work",
    "hang": "hang",
    "hang_inside": "hang_inside",
    "delay": "delay",
    "dataloader_stall": "dataloader_stall",
    "mem_leak": "mem_leak",
    "crash": "crash",
    "device_error": "device_error",
    "throttle": "throttle",
    "xid": "xid",
}
