"""Fixture for tests/tests/python_stacks.rs: a training-shaped loop whose
threads go off CPU inside known Python functions, over and over, so an
agent attached to it takes off-CPU stacks while it runs.

Prints its pid, waits for a line on stdin, then for about 3 s: the main
thread runs train_step -> forward -> time.sleep (10 ms); a loader thread
runs loader -> fetch_batch, which waits for a lock another thread holds
most of the time. Then exits.
"""

import sys
import threading
import time

lock = threading.Lock()
stop = threading.Event()


def forward(step):
    time.sleep(0.01)  # MARK forward-sleep


def train_step(step):
    forward(step)  # MARK train_step-call


def fetch_batch():
    with lock:  # MARK fetch-wait
        pass


def loader():
    while not stop.is_set():
        fetch_batch()  # MARK loader-call


def holder():
    while not stop.is_set():
        with lock:
            time.sleep(0.02)
        time.sleep(0.001)


print("pid", threading.get_native_id(), flush=True)
sys.stdin.readline()
threading.Thread(target=holder, daemon=True).start()
threading.Thread(target=loader, daemon=True).start()
end = time.monotonic() + 3.0
step = 0
while time.monotonic() < end:
    train_step(step)
    step += 1
stop.set()
