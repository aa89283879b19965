#!/usr/bin/env python3
"""Ring bytes and events/s of a `--pid` recording of a churning target
(2,000 children over 4 s, pinned to CPU 0), without and with pinned pipe
ping-pong storms (STORMS=0,1: how many, on CPUs 0, 1, ...), for two agent
builds interleaved in the same run; one JSON line per run. Ring bytes are
the records consumed per ring times their size (plus the ring's 8-byte
header). Needs root and `cargo xtask build` (the fixtures).

    tests/bench/storm_rings.py NEW_AGENT BASE_AGENT [ROUNDS [AGENT ARGS...]]
"""
import json, os, shutil, subprocess, sys, time, tempfile, signal

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../target/fixtures/workloads")
WL = f"{root}/xpuscope-workload"
CHURN = f"{root}/xpuscope-churn"
# bytes per record in the kernel ring: the record plus the ring's 8-byte header
SIZE = {"sched_switch": 80, "bystander_switch": 80, "sched_waking": 56,
        "sched_wakeup_new": 56, "process_fork": 48, "process_exec": 48,
        "process_exit": 48, "task_rename": 56, "offcpu_stack": 1056}
BYSTANDER = {"bystander_switch"}

def run(agent, storm, extra=()):
    d = tempfile.mkdtemp(prefix="storm-")
    procs = []
    for cpu in range(storm):
        pp = subprocess.Popen([WL, "pingpong", "1000000000", str(cpu)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        pp.stdin.write(b"go\n"); pp.stdin.flush()
        procs.append(pp)
    ch = subprocess.Popen(["taskset", "-c", "0", CHURN, "2000", "4"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    procs.append(ch)
    time.sleep(0.2)
    ag = subprocess.Popen([agent, "attach", "--pid", str(ch.pid), "-o", f"{d}/t.pftrace",
                           "--stats-json", f"{d}/s.json", *extra],
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while True:
        line = ag.stderr.readline()
        if "xpuscope: recording" in line or not line:
            break
    ch.stdin.write(b"go\n"); ch.stdin.flush()
    done = ch.stdout.readline().decode().strip()
    time.sleep(0.3)
    ag.send_signal(signal.SIGINT)
    err = ag.stderr.read()
    ag.wait()
    for p in procs:
        p.kill(); p.wait()
    if not os.path.exists(f"{d}/s.json"):
        shutil.rmtree(d, ignore_errors=True)
        return dict(error=err[-500:])
    s = json.load(open(f"{d}/s.json"))
    shutil.rmtree(d, ignore_errors=True)  # traces of a storm are large
    k = {x["kind"]: (x["consumed"], x["dropped"]) for x in s["per_kind"]}
    sched_b = sum((SIZE[n] + 8) * c for n, (c, _) in k.items() if n in SIZE and n not in BYSTANDER)
    by_b = sum((SIZE[n] + 8) * c for n, (c, _) in k.items() if n in BYSTANDER)
    secs = s["seconds"]
    dropline = [l.strip() for l in err.splitlines() if "dropped:" in l]
    return dict(done=done, secs=secs, events=s["events"], ev_s=s["events"] / secs,
                dropped=s["dropped"], fork=k["process_fork"], exit=k["process_exit"],
                sched_MBps=sched_b / secs / 1e6, bystander_MBps=by_b / secs / 1e6,
                sched_MB=sched_b / 1e6, bystander_MB=by_b / 1e6, trace_MB=s["bytes"] / 1e6,
                cpu=s["agent_cpu_seconds"], rss_MB=s["agent_peak_rss_bytes"] / 1e6, dropline=dropline)

new, base = sys.argv[1], sys.argv[2]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 1
STORMS = [int(x) for x in os.environ.get("STORMS", "0,1,2").split(",")]
extra = sys.argv[4:] if len(sys.argv) > 4 else []
for r in range(rounds):
    for storm in STORMS:
        for name, agent in (("base", base), ("new", new)):
            load = open("/proc/loadavg").read().split()[0]
            res = run(agent, storm, extra)
            res["loadavg"] = load
            print(json.dumps(dict(round=r, agent=name, storm=storm, **res)), flush=True)
