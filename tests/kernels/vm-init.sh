#!/bin/busybox sh
# PID 1 of the kernel-check virtual machine (the initramfs that
# tests/kernels/make-kernel.sh packs): mounts the host's root read-only
# over virtio 9p (tag `hostroot`) with fresh tmpfs over /tmp, /run,
# /var/tmp and /dev/shm, mounts the host's directory $XPUSCOPE_VM_SHARED
# (tag `shared`, writable) and $XPUSCOPE_VM_CWD (tag `cwd`, read-only) at
# their own paths, runs `run.sh` of the shared directory in that
# root, writes its exit status to `rc` beside it and powers off.
# XPUSCOPE_VM_SHARED comes from the kernel command line (the kernel hands
# unknown NAME=VALUE parameters to init as its environment).
/bin/busybox --install -s /bin
export PATH=/bin
mkdir -p /proc /sys /dev /newroot
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
while read -r m; do
    insmod "/modules/$m" || echo "vm-init: insmod $m failed"
done </modules.order
ip link set lo up

fail() {
    echo "vm-init: $*"
    poweroff -f
}
r=/newroot
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=loose,ro hostroot $r ||
    fail "mounting the host's root failed"
mount -t proc proc $r/proc
mount -t sysfs sysfs $r/sys
mount -t devtmpfs devtmpfs $r/dev
mkdir -p $r/dev/shm $r/dev/pts 2>/dev/null
mount -t tmpfs tmpfs $r/dev/shm
mount -t devpts devpts $r/dev/pts
mount -t tracefs tracefs $r/sys/kernel/tracing
mount -t debugfs debugfs $r/sys/kernel/debug
mount -t bpf bpf $r/sys/fs/bpf
mount -t cgroup2 cgroup2 $r/sys/fs/cgroup
for d in tmp run var/tmp; do
    mount -t tmpfs -o mode=1777 tmpfs "$r/$d"
done
# The directory the command runs in (the repository), shared read-only on
# its own and mounted at its path: under /tmp (a fresh clone there), the
# tmpfs above would hide it.
if [ -n "${XPUSCOPE_VM_CWD:-}" ]; then
    mkdir -p "$r$XPUSCOPE_VM_CWD" 2>/dev/null
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=loose,ro cwd \
        "$r$XPUSCOPE_VM_CWD" || fail "mounting $XPUSCOPE_VM_CWD failed"
fi
shared=${XPUSCOPE_VM_SHARED:?no XPUSCOPE_VM_SHARED on the kernel command line}
mkdir -p "$r$shared"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 shared "$r$shared" ||
    fail "mounting the shared directory $shared failed"
# The kernel's symbols, for run-in-vm.sh to name where the CPUs of a
# stalled guest are (Debian ships no System.map), and the heartbeat it
# watches: the guest's clock still moves.
cat /proc/kallsyms >"$r$shared/kallsyms"
while cat /proc/uptime >"$r$shared/heartbeat"; do
    sleep 5
done &
echo "vm-init: running $shared/run.sh on $(uname -r)"
HOME=/root chroot $r /bin/sh "$shared/run.sh"
echo $? >"$r$shared/rc"
sync
poweroff -f
