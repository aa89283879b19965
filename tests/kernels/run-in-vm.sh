#!/bin/sh
# Runs COMMAND (a shell command line) as root in a QEMU virtual machine
# booted on the distribution kernel SERIES (made by make-kernel.sh, on first use),
# in this machine's root seen read-only, from the current directory (also
# seen read-only, wherever it is: /tmp is the machine's own), with
# the environment variables named in XPUSCOPE_VM_ENV passed on; exits
# with COMMAND's status, or 96 when the guest stalled (see below). The
# machine's console (the kernel's messages and COMMAND's output) goes to
# stdout.
#
# TCG emulation, not KVM (KVM guests hang on the machines this runs on):
# code runs several times slower than on the host.
#
# Usage: run-in-vm.sh SERIES COMMAND
set -eu
series=$1
command=$2
here=$(cd "$(dirname "$0")" && pwd)
kernel=${XPUSCOPE_KERNEL_DIR:-/var/cache/xpuscope-test/kernel-$series}
sh "$here/make-kernel.sh" "$series" "$kernel"

shared=$(mktemp -d /tmp/xpuscope-vm.XXXXXX)
trap 'rm -rf "$shared"' EXIT
{
    echo "export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    echo "cd '$PWD' || exit 97"
    for name in ${XPUSCOPE_VM_ENV:-}; do
        eval "value=\${$name-}"
        printf "export %s='%s'\n" "$name" "$(printf %s "$value" | sed "s/'/'\\\\''/g")"
    done
    echo "$command"
} >"$shared/run.sh"

# Two CPUs as CI has, memory for the job and the agent's rings; no
# network device (the tests use loopback), no display.
#
# Both emulated CPUs run on one host thread (`thread=single`), not one
# each. With a thread each, a guest stopped for good now and then: one
# CPU spun in smp_call_function_many_cond (text_poke_bp: a tracepoint's
# static call being patched as the agent's links closed) waiting for the
# other, which looped with interrupts off at the very site being patched,
# its clock stopped: code modified by one emulated CPU while the other
# runs it. On one thread the CPUs take turns. The checks took 58-61 s with
# a thread each and take about 50 s so (this machine's 2 CPUs, nothing
# else running).
#
# Two bounds. The guest writes a heartbeat into the shared directory
# every few seconds (vm-init.sh). Should a guest still stop for good (as
# above, about one run of the checks in ten with a thread per CPU; the
# same checks passed when run again), a guest whose heartbeat is
# XPUSCOPE_VM_STALL seconds old (120) is stopped and reported as stalled
# (exit 96), so the caller can tell that from a failed command and run it
# again. Before it is stopped, vm-where.py prints where its CPUs are, and
# the guest's kernel every CPU's stack (an NMI it panics on). And the
# whole run is bounded by XPUSCOPE_VM_TIMEOUT seconds (600: the tests
# take about a minute in the machine).
stall=${XPUSCOPE_VM_STALL:-120}
heartbeat="$shared/heartbeat"
: >"$heartbeat"
timeout "${XPUSCOPE_VM_TIMEOUT:-600}" qemu-system-x86_64 \
    -machine q35 -accel tcg,thread=single -cpu max -smp 2 -m 6G \
    -nic none -vga none -nographic -no-reboot \
    -kernel "$kernel/vmlinuz" -initrd "$kernel/initrd.img" \
    -append "console=ttyS0 quiet panic=-1 unknown_nmi_panic panic_print=0x40 XPUSCOPE_VM_SHARED=$shared XPUSCOPE_VM_CWD=$PWD" \
    -monitor "unix:$shared/monitor,server=on,wait=off" \
    -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
    -virtfs "local,path=$PWD,mount_tag=cwd,security_model=none,readonly=on,multidevs=remap" \
    -virtfs "local,path=$shared,mount_tag=shared,security_model=none" </dev/null &
qemu=$!
(
    while sleep 5 && kill -0 "$qemu" 2>/dev/null; do
        age=$(($(date +%s) - $(stat -c %Y "$heartbeat")))
        if [ "$age" -gt "$stall" ]; then
            : >"$shared/stalled"
            echo "run-in-vm: no heartbeat from the guest for $age s; where its CPUs are:" >&2
            python3 "$here/vm-where.py" "$shared/monitor" "$shared/kallsyms" >&2 || true
            kill "$qemu"
            exit
        fi
    done
) &
watchdog=$!
status=0
wait "$qemu" || status=$?
kill "$watchdog" 2>/dev/null || true
wait "$watchdog" 2>/dev/null || true
if [ -f "$shared/stalled" ]; then
    echo "run-in-vm: the guest stalled: no heartbeat for over $stall s" >&2
    exit 96
fi
if [ "$status" != 0 ]; then
    echo "run-in-vm: qemu failed or timed out ($status)" >&2
    exit 98
fi
if [ ! -f "$shared/rc" ]; then
    echo "run-in-vm: the machine stopped before the command finished" >&2
    exit 99
fi
exit "$(cat "$shared/rc")"
