"""The ground-truth file of a simulated job (schema xpuscope-sim-ground-truth/1).

Written by the launcher when the ranks have started (status "running", pids
known, so an agent can attach) and again when the job has ended. Everything a
test needs to grade a diagnosis: the world layout and communicators, the pids
and CPUs, what was injected where and when (the ranks' own fault events,
CLOCK_BOOTTIME and REALTIME ns), what the fault should cause, and how every
rank ended. See README.md for the field list.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import sim_faults
from sim_layout import collectives_per_step

# Stand-in default device memory when STANDIN_DEVICE_MEM_BYTES is not set.
DEFAULT_DEVICE_MEM = {"nvidia": 80 << 30, "ascend": 64 << 30}


def read_events(path: Path) -> list[dict]:
    events = []
    try:
        with open(path, "rb") as f:
            for line in f:
                try:
                    events.append(json.loads(line))
                except ValueError:
                    pass  # a line cut by a kill
    except FileNotFoundError:
        pass
    return events


def signal_name(num: int | None) -> str | None:
    if num is None:
        return None
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"SIG{num}"


def rank_summary(job, rp, coord, events: list[dict], base_env: dict) -> dict:
    steps = [e for e in events if e.get("event") == "step"]
    begun = [e["step"] for e in events if e.get("event") == "step_begin"]
    first = lambda kind: next((e for e in events if e.get("event") == kind), None)  # noqa: E731
    ready, start, done = first("ready"), first("start"), first("done")
    exit_info = None
    if rp.proc is not None and rp.exit_clock is not None:
        rc = rp.proc.returncode
        sig = -rc if rc is not None and rc < 0 else None
        exit_info = {
            "returncode": rc,
            "exit_code": rc if rc is not None and rc >= 0 else None,
            "signal": sig,
            "signal_name": signal_name(sig),
            "status": rp.status,
            "killed_by_launcher": rp.killed_by_launcher,
            **rp.exit_clock,
        }
    return {
        "rank": rp.rank,
        "local_rank": rp.local_rank,
        "pid": rp.proc.pid if rp.proc else None,
        "cpu": rp.cpu,
        "tp_rank": coord.tp_rank,
        "dp_rank": coord.dp_rank,
        "pp_stage": coord.pp_stage,
        "comms": [c.name for c in job.layout.comms_of(rp.rank)],
        "status": rp.status,
        "exit": exit_info,
        "steps_completed": len(steps),
        "last_step_completed": steps[-1]["step"] if steps else None,
        "last_step_begun": max(begun) if begun else None,
        "ready": {k: ready[k] for k in ("boot_ns", "real_ns", "mem_bytes")} if ready else None,
        # Kernel launches of the completed steps: through the runtime
        # (cudaLaunchKernel), straight through the driver (cuLaunchKernel,
        # cuLaunchKernelEx) and CUDA graphs (cuGraphLaunch).
        "launches": {kind: sum(s.get(f"{kind}_launches", 0) for s in steps)
                     for kind in ("runtime", "driver", "graph")},
        # Bytes the expandable segment had mapped at the end of each
        # completed step (0 without --expandable-segments).
        "segment_bytes": [s.get("segment_bytes", 0) for s in steps],
        "start": {k: start[k] for k in ("boot_ns", "real_ns")} if start else None,
        "done": {k: done[k] for k in ("boot_ns", "real_ns")} if done else None,
        "step_log": rp.step_log.name,
        "log": rp.log.name,
        "activity_log": rp.activity_log.name if rp.activity_log else None,
        "argv": rp.argv,
        "env": {k: v for k, v in rp.env_extra.items()
                if k in ("RANK", "LOCAL_RANK") or base_env.get(k) != v},
    }


def fault_truth(job, fault: sim_faults.Fault, events_by_rank: dict[int, list[dict]],
                ranks: list[dict]) -> dict:
    p = fault.params
    r = fault.rank
    out = {"kind": fault.kind, **p}
    injected = [e for e in events_by_rank.get(r, [])
                if e.get("event") == "fault" and e.get("kind") == sim_faults.EVENT_KIND.get(fault.kind)]
    expected: dict = {}
    if fault.kind == "slow":
        expected = {"slowed_rank": r, "compute_factor": p["factor"], "from_step": p["from_step"],
                    "note": "the rank's kernel_ns grows by factor; every rank's step time "
                            "grows through the collectives, peers wait in them"}
    elif fault.kind == "host_work":
        expected = {"host_bound_rank": r, "extra_host_ms": p["ms"], "from_step": p["from_step"],
                    "note": "the rank's host_ns grows by ms; it arrives last at the "
                            "collectives, its peers wait in them"}
    elif fault.kind == "throttle":
        # DCMI gives no reason for a lowered NPU frequency.
        reason = "sw_thermal_slowdown" if job.args.flavor == "nvidia" else None
        expected = {"throttled_rank": r, "gpu": r % len(job.local_ranks), "sm_mhz": p["mhz"],
                    "max_sm_mhz": 1980, "reason": reason,
                    "compute_factor": 1980 / p["mhz"], "from_step": p["from_step"],
                    "note": "the rank's GPU clock drops (a thermal clock event) and its "
                            "kernels slow in proportion; peers wait in the collectives"}
    elif fault.kind == "xid":
        # On an NPU the code is a DCMI error code it lists, its health a
        # major alarm.
        expected = {"rank": r, "gpu": r % len(job.local_ranks), "xid": p["code"], "step": p["step"],
                    "device": "GPU" if job.args.flavor == "nvidia" else "NPU"}
    elif fault.kind in ("hang", "delay"):
        if "step" in p:
            dp = job.layout.dp_comm_of(r)
            if dp is not None:
                ops = collectives_per_step(job.layout, dp, job.args.microbatches)
                expected = {"comm": dp.name, "seq": ops["init"] + p["step"] * ops["per_step"],
                            "op": "all_reduce", "step": p["step"]}
            else:
                expected = {"comm": None, "step": p["step"]}
        else:
            expected = {"comm": p["comm"], "seq": p["seq"]}
        comm = expected.get("comm")
        if comm:
            expected["waiting_ranks"] = [m for m in job.layout.comm(comm).members if m != r]
        if fault.kind == "delay":
            expected["delay_ms"] = p["ms"]
    elif fault.kind == "hang_inside":
        expected = {"seq_0based": p["seq"],
                    "env": f"STANDIN_{'NCCL' if job.args.flavor == 'nvidia' else 'HCCL'}_HANG_AT_SEQ"}
    elif fault.kind == "dataloader_stall":
        expected = {"step": p["step"], "stall_ms": p["ms"], "thread": "dataloader",
                    "note": "hidden in part by the prefetch queue (prefetch batches ahead)"}
    elif fault.kind == "mem_leak":
        cap = (p.get("device_mem_mb", 0) << 20) or ((job.args.device_mem_mb or 0) << 20) \
              or DEFAULT_DEVICE_MEM[job.args.flavor]
        mine = next((x for x in ranks if x["rank"] == r), {})
        baseline = (mine.get("ready") or {}).get("mem_bytes")
        leak = p["mb"] << 20
        expected = {"capacity_bytes": cap, "baseline_bytes": baseline, "leak_bytes_per_step": leak}
        if baseline is not None:
            expected["oom_step"] = p["from_step"] + (cap - baseline) // leak
        expected["exit_code"] = 1
        injected += [e for e in events_by_rank.get(r, []) if e.get("event") == "oom"]
    elif fault.kind == "slow_link":
        comms = job.layout.comms_of(r)
        expected = {"factor": p["factor"], "env": "STANDIN_LINK_SLOWDOWN",
                    "affected_comms": [c.name for c in comms], "from": "process start"}
        init = next((e for e in events_by_rank.get(r, []) if e.get("event") == "init"), None)
        if init:
            injected = [{"event": "fault", "kind": "slow_link", "step": 0,
                         "boot_ns": init["boot_ns"], "real_ns": init["real_ns"]}]
    elif fault.kind == "device_error":
        expected = {"step": p["step"], "code": p.get("code") or sim_faults.DEVICE_ERROR_CODE[job.args.flavor],
                    "exit_code": 1}
        injected += [e for e in events_by_rank.get(r, []) if e.get("event") == "device_error"]
    elif fault.kind == "crash":
        expected = {"step": p["step"], "signal": p["signal_number"],
                    "signal_name": signal_name(p["signal_number"])}
    elif fault.kind == "cpu_contention":
        n = next(n for n in job.neighbours if n.fault is fault)
        on_cpu = [rp.rank for rp in job.ranks if rp.cpu is not None and rp.cpu == n.cpu]
        expected = {"cpu": n.cpu, "ranks_on_cpu": on_cpu, "threads": p["threads"]}
        if n.proc is not None:
            injected = [{"event": "fault", "kind": "cpu_contention", "step": n.trigger_step,
                         "neighbour_pid": n.proc.pid, **n.started,
                         "stopped": n.stopped}]
    elif fault.kind == "cpu_hog":
        n = next(n for n in job.neighbours if n.fault is fault)
        expected = {"cpus": job.cpus, "ranks": sorted(rp.rank for rp in job.ranks),
                    "threads": p["threads"] or 2 * len(job.cpus)}
        if n.proc is not None:
            injected = [{"event": "fault", "kind": "cpu_hog", "step": n.trigger_step,
                         "neighbour_pid": n.proc.pid, **n.started,
                         "stopped": n.stopped}]
    out["injected"] = injected
    out["expected"] = expected
    return out


def ground_truth(job) -> dict:
    a = job.args
    events_by_rank = {rp.rank: read_events(rp.step_log) for rp in job.ranks}
    coords = {c.rank: c for c in job.layout.ranks}
    base_env = job.base_env()
    ranks = [rank_summary(job, rp, coords[rp.rank], events_by_rank[rp.rank], base_env)
             for rp in job.ranks]
    end = job.end_clock
    return {
        "schema": "xpuscope-sim-ground-truth/1",
        "job": job.job,
        "status": job.status,
        "flavor": a.flavor,
        "lang": a.lang,
        "real_libs": a.real_libs,
        "steps": a.steps,
        "out_dir": str(job.out),
        "layout": job.layout.to_json(),
        "workload": {name.replace("-", "_"): getattr(a, name.replace("-", "_"))
                     for name in ("microbatches", "layers", "kernel-us", "opt-kernels",
                                  "opt-kernel-us", "host-us", "loader-us", "prefetch",
                                  "grad-mb", "act-kb")} | {"bw_gbps": a.bw_gbps,
                                                           "device_mem_mb": a.device_mem_mb},
        "activity": {"api_records": a.activity_api, "log": a.activity_log},
        "nvml_dir": str(job.nvml_dir) if a.flavor == "nvidia" else None,
        "dcmi_dir": str(job.dcmi_dir) if a.flavor == "ascend" else None,
        "driver": {"expandable_segments": a.expandable_segments,
                   "driver_launches": a.driver_launches},
        "communicators": [
            {"name": c.name, "kind": c.kind, "size": len(c.members), "members": c.members,
             "collectives": collectives_per_step(job.layout, c, a.microbatches)}
            for c in job.layout.comms
        ],
        "ranks": ranks,
        "faults": [fault_truth(job, f, events_by_rank, ranks) for f in job.local_faults()],
        "node": job.node.to_json(job.layout.world_size),
        "clock": {
            "launch": job.launch_clock,
            "end": end,
            "duration_s": (end["boot_ns"] - job.launch_clock["boot_ns"]) / 1e9 if end else None,
        },
        "timeout_s": a.timeout,
        "hang": job.hang,
        "first_failure": job.first_failure,
        "env": base_env,
    }
