#!/usr/bin/env bash
# Everything the `kernel` tests (tests/kernel/) need to boot Debian's stock kernel under QEMU:
#   qemu-system-x86, kmod (depmod), busybox-static (virtme-ng's initramfs), make + linux-headers-<abi>-amd64
#   (out-of-tree build of the kernel's sample mdev drivers mtty/mdpy), and under .cache/kernel/ (gitignored):
#   <abi>/root/   linux-image-<abi>-amd64 unpacked with dpkg -x, mtty.ko + mdpy.ko added under extra/, depmod run
#   vng/          a virtualenv with virtme-ng (a test tool, not a gpumode dependency)
#   current       shell variables naming the kernel image, its release and the vng binary (read by the tests)
# Debian rotates the ABI number (6.1.0-NN): the one linux-image-amd64 depends on today is used, and a built
# cache is kept until the metapackage moves on. Safe to run again; quiet unless something fails.
set -euo pipefail
cd "$(dirname "$0")/.."

cache=.cache/kernel
mkdir -p "$cache"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
export DEBIAN_FRONTEND=noninteractive

fail() {
    cat "$log" >&2
    echo "install-kernel-test-deps: $*" >&2
    exit 1
}

if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" -ne 0 ]; then
    if [ -s "$cache/current" ]; then
        exit 0 # installed before (by root); nothing can be checked or updated here
    fi
    echo "install-kernel-test-deps: needs Debian's apt-get, as root" >&2
    exit 1
fi

installed() {
    dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'
}

# The ABI the metapackage points at. apt-cache needs package lists: update once when it knows nothing.
abi_of_meta() {
    apt-cache depends linux-image-amd64 2>/dev/null | sed -n 's/^ *Depends: linux-image-\(.*\)-amd64$/\1/p' | head -n1
}
abi=$(abi_of_meta)
if [ -z "$abi" ]; then
    apt-get update -q >"$log" 2>&1 || fail "apt-get update failed"
    abi=$(abi_of_meta)
fi
[ -n "$abi" ] || fail "cannot tell which kernel linux-image-amd64 depends on"
release="$abi-amd64"

packages=(qemu-system-x86 kmod busybox-static make gcc "linux-headers-$release")
missing=()
for pkg in "${packages[@]}"; do
    installed "$pkg" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
    if ! apt-get install -y -q --no-install-recommends "${missing[@]}" >"$log" 2>&1; then
        # a stale package list names versions the mirror no longer has
        apt-get update -q >>"$log" 2>&1 && apt-get install -y -q --no-install-recommends "${missing[@]}" \
            >>"$log" 2>&1 || fail "installing ${missing[*]} failed"
    fi
fi

for old in "$cache"/*/root; do # an ABI the metapackage has moved on from
    [ -d "$old" ] && [ "$old" != "$cache/$abi/root" ] && rm -rf "$(dirname "$old")"
done
root="$cache/$abi/root"
moddir="$root/lib/modules/$release"
if [ ! -f "$moddir/extra/mtty.ko" ] || [ ! -f "$moddir/modules.dep" ]; then
    work="$cache/$abi/work"
    rm -rf "$root" "$work"
    mkdir -p "$root" "$work"
    (
        cd "$work"
        apt-get download -q "linux-image-$release" linux-source-6.1 >"$log" 2>&1 ||
            fail "downloading linux-image-$release and linux-source-6.1 failed"
    )
    dpkg -x "$work"/linux-image-"$release"_*.deb "$root"
    # Only the sample mdev drivers are needed from the 140 MB source tarball.
    dpkg-deb --fsys-tarfile "$work"/linux-source-6.1_*.deb |
        tar -xO ./usr/src/linux-source-6.1.tar.xz |
        tar -xJ -C "$work" --wildcards 'linux-source-6.1/samples/vfio-mdev/*'
    mkdir -p "$work/mdev"
    cp "$work"/linux-source-6.1/samples/vfio-mdev/{mtty.c,mdpy.c,mdpy-defs.h} "$work/mdev/"
    printf 'obj-m := mtty.o mdpy.o\n' >"$work/mdev/Kbuild"
    make -s -C "/usr/src/linux-headers-$release" M="$PWD/$work/mdev" modules >"$log" 2>&1 ||
        fail "building mtty/mdpy against linux-headers-$release failed"
    mkdir -p "$moddir/extra"
    cp "$work"/mdev/{mtty,mdpy}.ko "$moddir/extra/"
    depmod -b "$root" "$release" >"$log" 2>&1 || fail "depmod for $release failed"
    rm -rf "$work"
fi

if [ ! -x "$cache/vng/bin/vng" ]; then
    python=${PYTHON:-python3}
    "$python" -m venv "$cache/vng" >"$log" 2>&1 || fail "creating $cache/vng failed"
    "$cache/vng/bin/python" -m pip install -q --disable-pip-version-check 'virtme-ng==1.42' >"$log" 2>&1 ||
        fail "installing virtme-ng failed"
fi

cat >"$cache/current.new" <<EOF
GPUMODE_KERNEL_RELEASE=$release
GPUMODE_KERNEL_IMAGE=$PWD/$root/boot/vmlinuz-$release
GPUMODE_KERNEL_VNG=$PWD/$cache/vng/bin/vng
EOF
mv "$cache/current.new" "$cache/current"
