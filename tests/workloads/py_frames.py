"""Fixture for tests/tests/python_frames.rs: threads blocked at known points
of nested Python functions, and one native thread without a Python frame.

Once every thread is blocked and its stack no longer changes, prints one
JSON line: per Python thread, its native tid and its frames innermost first
as the interpreter itself sees them (function = co_qualname where the
version has it, file, line), plus the native thread's tid. Then blocks
until killed.
"""

import ctypes
import json
import sys
import threading
import time

lock = threading.Lock()
# Each worker's step counter (the `step` argument of train_step and below):
# a two-digit int, then what is not a step count (a bool, a negative int).
STEP_OF = {"backward": 2**35 + 3, "all_reduce": True, "deep": -4}
event = threading.Event()
ready = {}


def name_of(code):
    return getattr(code, "co_qualname", code.co_name)


class Model:
    def forward(self, step):
        ready["main"] = threading.get_native_id()
        time.sleep(3600)

    def backward(self, step):
        ready["backward"] = threading.get_native_id()
        with lock:
            pass

    def all_reduce(self, step):
        ready["all_reduce"] = threading.get_native_id()
        event.wait()


def recurse(depth):
    if depth == 0:
        ready["deep"] = threading.get_native_id()
        event.wait()
    else:
        recurse(depth - 1)


def train_step(model, step, phase):
    if phase == "deep":
        recurse(32)
    elif phase == "forward":
        model.forward(step)
    elif phase == "backward":
        model.backward(step)
    else:
        model.all_reduce(step)


def worker(phase):
    train_step(Model(), STEP_OF[phase], phase)


def stacks():
    frames = sys._current_frames()
    out = {}
    for who, tid in ready.items():
        ident = next(t.ident for t in threading.enumerate() if t.native_id == tid)
        f = frames[ident]
        stack = []
        while f is not None:
            stack.append([name_of(f.f_code), f.f_code.co_filename, f.f_lineno])
            f = f.f_back
        out[who] = {"tid": tid, "frames": stack}
    return out


def native_thread():
    """A thread that never runs Python: pthread_create straight into
    libc's sleep(3600). Returns its tid (the one task no Python thread
    state names)."""
    libc = ctypes.CDLL(None)
    before = set(int(t) for t in __import__("os").listdir("/proc/self/task"))
    tid = ctypes.c_ulong()
    sleep = ctypes.cast(libc.sleep, ctypes.c_void_p)
    rc = libc.pthread_create(ctypes.byref(tid), None, sleep, ctypes.c_void_p(3600))
    assert rc == 0, rc
    for _ in range(1000):
        after = set(int(t) for t in __import__("os").listdir("/proc/self/task"))
        new = after - before - {threading.get_native_id()}
        if new:
            return new.pop()
        time.sleep(0.01)
    raise SystemExit("the native thread did not start")


def reporter():
    while len(ready) < 4:
        time.sleep(0.01)
    native = native_thread()
    # The stacks settle once each thread is inside its blocking call.
    last = None
    while True:
        time.sleep(0.1)
        now = stacks()
        if now == last:
            break
        last = now
    print(json.dumps({"threads": now, "native_tid": native}), flush=True)
    # Stay: a thread that exits after its report would leave the thread
    # list while the test reads it two ways, one after the other.
    event.wait()


lock.acquire()
threading.Thread(target=worker, args=("backward",), name="backward").start()
threading.Thread(target=worker, args=("all_reduce",), name="all_reduce").start()
threading.Thread(target=worker, args=("deep",), name="deep").start()
threading.Thread(target=reporter, name="reporter").start()
train_step(Model(), 7, "forward")
