#!/bin/sh
# A Debian root standing in for a container image or another machine:
# Debian unstable's (another glibc, another CPython: 3.14) for the container
# tests (`xpuscope_tests::roots::sid`), Debian 12's for the package test
# (`xpuscope_tests::roots::bookworm`).
#
# Idempotent and safe to run from several processes at once (a lock beside
# the root): the root is made once, into DIR.tmp, and renamed into place
# when complete, so DIR is always whole. `cargo xtask test` starts both in
# the background while it builds; the tests call it too and wait for it.
#
# Usage: make-root.sh NAME [DIR]   (NAME: sid or bookworm; DIR defaults to
# /var/cache/xpuscope-test/NAME)
set -eu
name=$1
dir=${2:-/var/cache/xpuscope-test/$name}
# What each root holds (debootstrap's minbase variant and these packages);
# a change makes a new root.
case $name in
    sid) suite=sid packages=python3.14 ;;
    bookworm) suite=bookworm packages=systemd,procps ;;
    *) echo "make-root: no root named $name (sid, bookworm)" >&2; exit 2 ;;
esac
mirror=http://deb.debian.org/debian

mkdir -p "$(dirname "$dir")"
exec 9>"$dir.lock"
flock 9
if [ -f "$dir/.xpuscope-root" ] && [ "$(cat "$dir/.xpuscope-root")" = "$suite $packages" ]; then
    exit 0
fi
if ! command -v debootstrap >/dev/null; then
    # The other root's maker (and a test) may be installing too: apt waits
    # for dpkg's lock rather than failing.
    export DEBIAN_FRONTEND=noninteractive
    apt="apt-get -o DPkg::Lock::Timeout=300 -y -q"
    $apt install --no-install-recommends debootstrap >/dev/null ||
        { $apt update >/dev/null && $apt install --no-install-recommends debootstrap >/dev/null; }
fi
# The tests mount /proc inside the root for chrooted processes.
for d in "$dir" "$dir.tmp"; do
    if grep -q " $d/proc " /proc/self/mounts; then umount -l "$d/proc"; fi
done
rm -rf --one-file-system "$dir.tmp"
if ! debootstrap --variant=minbase --include="$packages" "$suite" "$dir.tmp" "$mirror" >"$dir.log" 2>&1; then
    echo "make-root: debootstrap of Debian $suite into $dir.tmp failed; its log:" >&2
    tail -20 "$dir.log" >&2
    exit 1
fi
echo "$suite $packages" >"$dir.tmp/.xpuscope-root"
rm -rf --one-file-system "$dir"
mv "$dir.tmp" "$dir"
