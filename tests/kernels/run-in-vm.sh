#!/bin/sh
# Runs COMMAND (a shell command line) as root in a QEMU virtual machine
# booted on Debian's kernel SERIES (made by make-kernel.sh, on first use),
# in this machine's root seen read-only, from the current directory (also
# seen read-only, wherever it is: /tmp is the machine's own), with
# the environment variables named in XPUSCOPE_VM_ENV passed on; exits
# with COMMAND's status. The machine's console (the kernel's messages and
# COMMAND's output) goes to stdout.
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
# network device (the tests use loopback), no display. The tests take
# about a minute in the machine; a guest that stalls (emulated CPUs
# starved on a busy host have shown RCU stalls and soft lockups) fails
# within 10 minutes rather than holding CI for half an hour
# (XPUSCOPE_VM_TIMEOUT, seconds).
timeout "${XPUSCOPE_VM_TIMEOUT:-600}" qemu-system-x86_64 \
    -machine q35 -accel tcg,thread=multi -cpu max -smp 2 -m 6G \
    -nic none -vga none -nographic -no-reboot \
    -kernel "$kernel/vmlinuz" -initrd "$kernel/initrd.img" \
    -append "console=ttyS0 quiet panic=-1 XPUSCOPE_VM_SHARED=$shared XPUSCOPE_VM_CWD=$PWD" \
    -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
    -virtfs "local,path=$PWD,mount_tag=cwd,security_model=none,readonly=on,multidevs=remap" \
    -virtfs "local,path=$shared,mount_tag=shared,security_model=none" </dev/null ||
    { echo "run-in-vm: qemu failed or timed out ($?)" >&2; exit 98; }
if [ ! -f "$shared/rc" ]; then
    echo "run-in-vm: the machine stopped before the command finished" >&2
    exit 99
fi
exit "$(cat "$shared/rc")"
