#!/usr/bin/env python3
"""Where a stalled guest's CPUs are: asks QEMU's monitor (a Unix socket)
for every CPU's registers a few times, a second apart, and prints each
CPU's instruction pointer with the kernel symbol it falls in (from the
guest's /proc/kallsyms, copied out at boot), whether it is halted and its
flags (interrupts enabled: 0x200); then sends the guest an NMI, which its
kernel (booted with `unknown_nmi_panic panic_print=0x40`) answers with
every CPU's stack on the console. run-in-vm.sh calls it when the guest's
heartbeat stopped, before it stops the machine.

Usage: vm-where.py MONITOR_SOCKET KALLSYMS
"""
import bisect
import re
import socket
import sys
import time


def read_symbols(path):
    addrs, names = [], []
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[1].lower() in "tw":
                    addrs.append(int(parts[0], 16))
                    names.append(parts[2])
    except OSError as e:
        print(f"vm-where: no symbols ({e})")
    order = sorted(range(len(addrs)), key=addrs.__getitem__)
    return [addrs[i] for i in order], [names[i] for i in order]


def symbol(addrs, names, ip):
    i = bisect.bisect_right(addrs, ip) - 1
    if i < 0 or ip - addrs[i] > 1 << 20:
        return "?"
    return f"{names[i]}+{ip - addrs[i]:#x}"


def ask(sock_path, command):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(sock_path)
    out = b""
    s.sendall(command.encode() + b"\n")
    end = time.time() + 3
    while time.time() < end:
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            break
        if not chunk:
            break
        out += chunk
        if out.count(b"(qemu)") >= 2:
            break
    s.close()
    return out.decode(errors="replace")


def main():
    sock_path, kallsyms = sys.argv[1], sys.argv[2]
    addrs, names = read_symbols(kallsyms)
    for sample in range(3):
        try:
            text = ask(sock_path, "info registers -a")
        except OSError as e:
            print(f"vm-where: the monitor did not answer ({e})")
            return
        cpus = re.split(r"\nCPU#(\d+)", "\n" + text)
        for n, regs in zip(cpus[1::2], cpus[2::2]):
            rip = re.search(r"RIP=([0-9a-f]+)", regs)
            flags = re.search(r"RFL=([0-9a-f]+)", regs)
            halted = re.search(r"HLT=(\d)", regs)
            if rip:
                ip = int(rip.group(1), 16)
                print(
                    f"vm-where: sample {sample} cpu {n}: rip {ip:#x} {symbol(addrs, names, ip)}"
                    f" rflags {flags.group(1) if flags else '?'}"
                    f" halted {halted.group(1) if halted else '?'}"
                )
        time.sleep(1)
    try:
        ask(sock_path, "nmi")
    except OSError as e:
        print(f"vm-where: no NMI sent ({e})")
    # The guest prints its stacks on the console meanwhile.
    time.sleep(10)


if __name__ == "__main__":
    main()
