#!/bin/sh
# A Debian unstable root standing in for a training job's container image:
# another glibc, another CPython (3.14), none of the host's files. The
# container tests (tests/tests/other_root.rs) run the fixtures inside it.
#
# Idempotent and safe to run from several processes at once (a lock beside
# the root): the root is made once, into DIR.tmp, and renamed into place
# when complete, so DIR is always whole. `cargo xtask test` starts it in
# the background while it builds; the tests call it too and wait for it.
#
# Usage: make-sid-root.sh [DIR]   (default /var/cache/xpuscope-test/sid)
set -eu
dir=${1:-/var/cache/xpuscope-test/sid}
# What the root holds; a change makes a new root.
packages=python3.14
mirror=http://deb.debian.org/debian

mkdir -p "$(dirname "$dir")"
exec 9>"$dir.lock"
flock 9
if [ -f "$dir/.xpuscope-root" ] && [ "$(cat "$dir/.xpuscope-root")" = "$packages" ]; then
    exit 0
fi
if ! command -v debootstrap >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends debootstrap >/dev/null ||
        { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends debootstrap >/dev/null; }
fi
# The tests mount /proc inside the root for chrooted processes.
for d in "$dir" "$dir.tmp"; do
    if grep -q " $d/proc " /proc/self/mounts; then umount -l "$d/proc"; fi
done
rm -rf --one-file-system "$dir.tmp"
if ! debootstrap --variant=minbase --include="$packages" sid "$dir.tmp" "$mirror" >"$dir.log" 2>&1; then
    echo "make-sid-root: debootstrap of Debian unstable into $dir.tmp failed; its log:" >&2
    tail -20 "$dir.log" >&2
    exit 1
fi
echo "$packages" >"$dir.tmp/.xpuscope-root"
rm -rf --one-file-system "$dir"
mv "$dir.tmp" "$dir"
