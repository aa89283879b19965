#!/bin/sh
# A distribution kernel to boot in a QEMU virtual machine for the kernel
# checks (`cargo xtask test --kernel SERIES`): Ubuntu 22.04's release
# kernel (5.15, the oldest the agent supports), Debian 12's own kernel
# (6.1) or bookworm-backports' (6.12), the kernels fleets run, with an
# initramfs of our own that mounts this machine's root read-only over 9p
# and runs one command (tests/kernels/vm-init.sh).
#
# Idempotent and safe to run from several processes at once (a lock beside
# the directory); made into DIR.tmp and renamed into place when complete.
#
# Usage: make-kernel.sh SERIES [DIR]   (SERIES: 5.15, 6.1 or 6.12; DIR defaults
# to /var/cache/xpuscope-test/kernel-SERIES). Writes DIR/vmlinuz,
# DIR/initrd.img and DIR/release (the kernel's release string).
set -eu
series=$1
dir=${2:-/var/cache/xpuscope-test/kernel-$series}
here=$(cd "$(dirname "$0")" && pwd)
case $series in
    5.15) suite=jammy ;;
    6.1) suite=bookworm ;;
    6.12) suite=bookworm-backports ;;
    *) echo "make-kernel: no kernel series $series (5.15, 6.1, 6.12)" >&2; exit 2 ;;
esac

mkdir -p "$(dirname "$dir")"
exec 9>"$dir.lock"
flock 9
stamp="$suite $(cat "$here/vm-init.sh" "$0" | sha256sum | cut -c1-16)"
if [ -f "$dir/.xpuscope-kernel" ] && [ "$(cat "$dir/.xpuscope-kernel")" = "$stamp" ]; then
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
apt="apt-get -o DPkg::Lock::Timeout=300 -y -q"
# QEMU (TCG emulation: KVM guests hang on the machines this runs on),
# a static busybox for the initramfs, cpio to pack it, kmod's depmod for
# the modules' dependencies.
tools="qemu-system-x86 busybox-static cpio kmod xz-utils zstd curl"
if ! command -v qemu-system-x86_64 >/dev/null || [ ! -x /bin/busybox ] ||
    ! /bin/busybox --list 2>/dev/null | grep -qx insmod || ! command -v cpio >/dev/null ||
    [ ! -x /sbin/depmod ] || ! command -v xz >/dev/null || ! command -v zstd >/dev/null ||
    ! command -v curl >/dev/null; then
    $apt install --no-install-recommends $tools >/dev/null ||
        { $apt update >/dev/null && $apt install --no-install-recommends $tools >/dev/null; }
fi
tmp=$dir.tmp
rm -rf "$tmp"
mkdir -p "$tmp/deb" "$tmp/initramfs"
if [ "$suite" = jammy ]; then
    # Ubuntu 22.04's release kernel and its modules, straight from Ubuntu's
    # archive (its keys are not in this machine's apt): the release pocket
    # never changes, so the packages are named and their SHA-256 pinned here
    # (as the release's Packages index gives them).
    ubuntu=http://archive.ubuntu.com/ubuntu/pool/main/l
    for deb in \
        "linux-signed/linux-image-5.15.0-25-generic_5.15.0-25.25_amd64.deb ad56f8c442a54d4f5ff2dff010d00321d53e32b543f3a92f3ba4e042d20a71da" \
        "linux/linux-modules-5.15.0-25-generic_5.15.0-25.25_amd64.deb d0ba4087d9e1d497925b3481d3531fba6c2a852855f8019d73b0b1385aa4da1f"; do
        path=${deb% *}
        file=$tmp/deb/$(basename "$path")
        curl -fsS --retry 3 --max-time 600 -o "$file" "$ubuntu/$path" ||
            { echo "make-kernel: downloading $ubuntu/$path failed" >&2; exit 1; }
        echo "${deb#* }  $file" | sha256sum -c --quiet - ||
            { echo "make-kernel: $file is not the package pinned here" >&2; exit 1; }
    done
elif [ "$suite" = bookworm-backports ] &&
    ! grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/; then
    # Backports are pinned below the release by Debian's own Release file
    # (NotAutomatic): adding the suite upgrades nothing on this machine.
    cat >/etc/apt/sources.list.d/xpuscope-test-backports.sources <<EOF
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    $apt update >/dev/null
fi
if [ "$suite" != jammy ]; then
    # The suite's current kernel, as its `linux-image-amd64` names it.
    pkg=$(apt-cache depends "linux-image-amd64/$suite" 2>/dev/null |
        awk '/Depends: linux-image-[0-9]/ { print $2; exit }')
    if [ -z "$pkg" ]; then
        $apt update >/dev/null
        pkg=$(apt-cache depends "linux-image-amd64/$suite" |
            awk '/Depends: linux-image-[0-9]/ { print $2; exit }')
    fi
    [ -n "$pkg" ] || { echo "make-kernel: no linux-image-amd64 in $suite" >&2; exit 1; }
    (cd "$tmp/deb" && apt-get download -q "$pkg/$suite" >/dev/null 2>&1) ||
        { echo "make-kernel: downloading $pkg from $suite failed" >&2; exit 1; }
fi
for deb in "$tmp"/deb/*.deb; do
    dpkg-deb -x "$deb" "$tmp/pkg"
done
release=$(ls "$tmp/pkg/lib/modules")
# The package leaves modules.dep to its installation's depmod.
/sbin/depmod -b "$tmp/pkg" "$release"
cp "$tmp/pkg/boot/vmlinuz-$release" "$tmp/vmlinuz"
echo "$release" >"$tmp/release"

# The modules that mount the root over virtio 9p, each after the ones it
# depends on (modules.dep), decompressed (busybox's insmod reads plain
# .ko files; Debian compresses them from 6.12 on).
moddir=$tmp/pkg/lib/modules/$release
ir=$tmp/initramfs
mkdir -p "$ir/bin" "$ir/modules"
: >"$ir/modules.order"
added=" "
add_module() { # a path as modules.dep names it (kernel/...ko[.xz|.zst])
    local file base dep
    file=$(basename "$1")
    base=${file%.xz}
    base=${base%.zst}
    case $added in *" $base "*) return ;; esac
    added="$added$base "
    for dep in $(awk -F: -v m="$1" '$1 == m { print $2 }' "$moddir/modules.dep"); do
        add_module "$dep"
    done
    case $file in
        *.xz) xz -dc "$moddir/$1" >"$ir/modules/$base" ;;
        *.zst) zstd -qdc "$moddir/$1" >"$ir/modules/$base" ;;
        *) cp "$moddir/$1" "$ir/modules/$base" ;;
    esac
    echo "$base" >>"$ir/modules.order"
}
for m in virtio_pci 9pnet_virtio 9p; do
    path=$(awk -F: -v m="$m" '{ n = $1; sub(/.*\//, "", n); sub(/\.ko.*/, "", n); if (n == m) { print $1; exit } }' "$moddir/modules.dep")
    # Built into the kernel when modules.dep does not list it.
    [ -z "$path" ] || add_module "$path"
done
cp /bin/busybox "$ir/bin/busybox"
cp "$here/vm-init.sh" "$ir/init"
chmod +x "$ir/init"
(cd "$ir" && find . | cpio -o -H newc --quiet | gzip -1 >"$tmp/initrd.img")
rm -rf "$tmp/deb" "$tmp/pkg" "$ir"
echo "$stamp" >"$tmp/.xpuscope-kernel"
rm -rf "$dir"
mv "$tmp" "$dir"
