"""Fixture for tests/tests/python_stacks.rs: a flood of code objects.

Makes tens of thousands of distinct functions (each its own code object,
from `exec` of generated source) and gives each a long line table. The
tables are one bytes object shared by every function, so this process
stays small, while an agent that keeps a copy of each code object's table
would hold gigabytes. Each function is called once and goes off CPU inside
it (a short sleep), so an agent that takes a stack at every switch reads
each one's code object.

Arguments: how many functions, the line table's length in bytes.
Prints its pid, waits for a line on stdin, runs every function once, then
exits.
"""

import sys
import threading
import time

count = int(sys.argv[1])
table_len = int(sys.argv[2])

BATCH = 1000
functions = []
for start in range(0, count, BATCH):
    source = "".join(
        f"def flood_{i}():\n    _sleep(0.0001)\n"
        for i in range(start, min(start + BATCH, count))
    )
    scope = {"_sleep": time.sleep}
    exec(compile(source, "flood.py", "exec"), scope)
    functions.extend(v for k, v in scope.items() if k.startswith("flood_"))

# Every body is the same, so every function's own table is the same bytes;
# padded with "no location" entries (0xff: 8 code units each) past the end
# of the code, which no lookup of a real instruction reaches.
own = functions[0].__code__.co_linetable
table = own + b"\xff" * max(0, table_len - len(own))
for f in functions:
    f.__code__ = f.__code__.replace(co_linetable=table)

print("pid", threading.get_native_id(), flush=True)
sys.stdin.readline()
for f in functions:
    f()
