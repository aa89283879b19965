#!/bin/sh
# Boots a private systemd for tests/tests/systemd.rs, as PID 1 of a new pid
# namespace, without touching the host:
#
#   echo $$ > CGROUP/cgroup.procs; exec unshare --pid --mount --uts --ipc \
#       --net --cgroup --fork --kill-child --propagation private -- \
#       private-systemd.sh STAGE
#
# - mounts: private (unshare), so nothing below is seen outside. /etc and
#   /usr/local are overlays whose upper layers are STAGE/etc and
#   STAGE/usr/local (`cargo xtask install --root STAGE`): the installed
#   unit, configuration and binary appear where a real install puts them,
#   and whatever systemd writes there lands in STAGE, never in the host's
#   files. /tmp, /var/tmp, /run, /var/lib, /var/log and /var/cache are
#   fresh tmpfs: this systemd's tmpfiles (never started here anyway) could
#   not empty the host's /tmp.
# - /proc stays the host's: procfs answers in the pid namespace it was
#   mounted in, so the agent under this systemd sees host pids in /proc,
#   the same pids its eBPF programs report.
# - cgroups: the cgroup namespace's root is the fresh cgroup2 directory the
#   test created (the caller moved itself there before unshare), mounted
#   as this systemd's whole hierarchy: it never touches the host's.
# - /dev/console is STAGE/console (PID 1's status and log lines).
# - `container=` tells systemd it is not on bare metal (no clock, hostname
#   or kernel module set-up), and only xpuscope-test.target is started.
#
# With a second argument ROOT (a Debian root with systemd, from
# tests/roots/make-root.sh), that root is the machine instead: an overlay
# with ROOT below and STAGE/root-upper above (what the test placed there
# before the boot, and everything written after), the host's /proc, /sys
# and /dev bound in, fresh tmpfs on /tmp, /var/tmp, /run, /var/log and
# /var/cache, every package in STAGE/root-upper/xpuscope-pkg installed
# with dpkg, and systemd started chrooted into it: a machine with only
# Debian 12 and the package, no toolchain. Its /proc is its pid
# namespace's own; the host's is at /run/host-proc for the agent.
set -eu
stage=$1
root=${2:-}
if [ "$$" != 1 ]; then
    echo "private-systemd.sh: must run as PID 1 of a new pid namespace (see the header)" >&2
    exit 1
fi
if [ -n "$root" ]; then
    m=$stage/merged
    mkdir -p "$m" "$stage/root-upper" "$stage/.work/root"
    : > "$stage/console"
    mount -t overlay overlay \
        -o "lowerdir=$root,upperdir=$stage/root-upper,workdir=$stage/.work/root" "$m"
    mount -t proc proc "$m/proc"
    mount --rbind /sys "$m/sys"
    umount -R -l "$m/sys/fs/cgroup"
    mount -t cgroup2 cgroup2 "$m/sys/fs/cgroup"
    mount --rbind /dev "$m/dev"
    mount --bind "$stage/console" "$m/dev/console"
    for d in tmp var/tmp; do
        mount -t tmpfs -o mode=1777,size=256m tmpfs "$m/$d"
    done
    for d in run var/log var/cache; do
        mount -t tmpfs -o mode=0755,size=256m tmpfs "$m/$d"
    done
    # The host's /proc, for the agent's unit to bind over its own /proc
    # (the test's drop-in): the agent must see the pids its eBPF programs
    # report, as it does under the host's systemd; systemd itself sees
    # its own pid namespace's, as PID 1 does.
    mkdir -p "$m/run/host-proc"
    mount --rbind /proc "$m/run/host-proc"
    for deb in "$m"/xpuscope-pkg/*.deb; do
        [ -e "$deb" ] || continue
        chroot "$m" dpkg -i "/xpuscope-pkg/$(basename "$deb")"
    done
    exec env -i container=xpuscope-test \
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        chroot "$m" /lib/systemd/systemd --unit=xpuscope-test.target --log-target=console \
        --log-level=info --show-status=no
fi
mkdir -p "$stage/etc" "$stage/usr/local" "$stage/.work/etc" "$stage/.work/usr-local"
: > "$stage/console"
mount -t overlay overlay \
    -o "lowerdir=/etc,upperdir=$stage/etc,workdir=$stage/.work/etc" /etc
mount -t overlay overlay \
    -o "lowerdir=/usr/local,upperdir=$stage/usr/local,workdir=$stage/.work/usr-local" /usr/local
mount --bind "$stage/console" /dev/console
# STAGE is usually under /tmp: everything from it is mounted before /tmp is
# replaced.
for d in /tmp /var/tmp; do
    mount -t tmpfs -o mode=1777,size=256m tmpfs "$d"
done
for d in /run /var/lib /var/log /var/cache; do
    mount -t tmpfs -o mode=0755,size=256m tmpfs "$d"
done
umount -R -l /sys/fs/cgroup
mount -t cgroup2 cgroup2 /sys/fs/cgroup
exec env -i container=xpuscope-test \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    /lib/systemd/systemd --unit=xpuscope-test.target --log-target=console \
    --log-level=info --show-status=no
