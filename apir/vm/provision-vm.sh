#!/usr/bin/env bash
# apir/vm/provision-vm.sh [OUTDIR]  (run by `apir vm provision`, apir/vm/provision.py)
#
# What `apir vm run` and tests/vm need to boot real Linux guests against apir's virtio-gpu
# device (docs/vm.md), from Debian packages only, on a Debian 12 (bookworm) host, as root:
#   OUTDIR/trixie/              a debootstrapped trixie tree with QEMU 11.1 from trixie-backports
#                               (bookworm's QEMU 7.2 and bookworm-backports' 10.0 lack the generic
#                               vhost-user-test-device-pci and VHOST_USER_PROTOCOL_F_SHMEM)
#   OUTDIR/qemu                 runs that tree's qemu-system-x86_64 here: QEMU 11.1 needs glibc
#                               2.38 and bookworm has 2.36, so it goes through the tree's own ld.so
#   OUTDIR/kernels/bookworm     linux-image 6.1 (bookworm), `dpkg -x`ed and depmod'ed
#   OUTDIR/kernels/trixie       linux-image 6.12 (trixie)
#   OUTDIR/busybox              busybox-static (the guest's initramfs userland)
#   OUTDIR/versions.env         what was installed (QEMU version, kernel releases)
# OUTDIR defaults to ${APIR_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/apir}/vm/<VM_VERSION>.
#
# Idempotent: every step is skipped when its output exists, OUTDIR/.complete marks a finished
# run, and a file lock (OUTDIR/.lock) keeps two runs (two test processes) from racing.
# About 4-5 minutes on 2 cores with a warm apt mirror; ~700 MiB on disk.
# Needs (".ci/run" installs them): debootstrap busybox-static kmod xz-utils zstd.
set -euo pipefail

VM_VERSION=qemu-11.1
CACHE=${APIR_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/apir}
OUT=${1:-$CACHE/vm/$VM_VERSION}
# the Debian mirror this machine already uses (deb822 or one-line sources)
MIRROR=${APIR_VM_MIRROR:-$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}

missing=()
for tool in debootstrap depmod modprobe xz zstd; do
    command -v "$tool" >/dev/null || missing+=("$tool")
done
dpkg -s busybox-static >/dev/null 2>&1 || missing+=("busybox-static")
if [ ${#missing[@]} -gt 0 ]; then
    echo "provision-vm.sh: missing ${missing[*]} (apt-get install debootstrap busybox-static kmod xz-utils zstd)" >&2
    exit 2
fi
[ "$(id -u)" = 0 ] || { echo "provision-vm.sh: needs root (debootstrap, chroot)" >&2; exit 2; }

mkdir -p "$OUT"
exec 9>"$OUT/.lock"
flock 9
if [ -f "$OUT/.complete" ]; then
    echo "provisioned: $OUT"
    exit 0
fi

# 1. QEMU 11.1 in a trixie tree
T=$OUT/trixie
if [ ! -x "$T/usr/bin/qemu-system-x86_64" ]; then
    if [ ! -x "$T/usr/bin/apt-get" ]; then
        rm -rf "$T"
        debootstrap --variant=minbase trixie "$T" "$MIRROR"
    fi
    echo "deb $MIRROR trixie-backports main" >"$T/etc/apt/sources.list.d/backports.list"
    mount -t proc proc "$T/proc"
    trap 'umount "$T/proc" 2>/dev/null || true' EXIT
    chroot "$T" apt-get update -q
    chroot "$T" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        -t trixie-backports qemu-system-x86
    chroot "$T" apt-get clean
    umount "$T/proc"
    trap - EXIT
fi
cat >"$OUT/qemu.tmp" <<EOF
#!/bin/sh
# trixie-backports' QEMU through the trixie tree's ld.so and libraries (written by provision-vm.sh)
T=$T
export QEMU_MODULE_DIR=\$T/usr/lib/x86_64-linux-gnu/qemu
exec "\$T/lib64/ld-linux-x86-64.so.2" --library-path "\$T/lib/x86_64-linux-gnu:\$T/usr/lib/x86_64-linux-gnu" \\
    "\$T/usr/bin/qemu-system-x86_64" -L "\$T/usr/share/qemu" -L "\$T/usr/share/seabios" "\$@"
EOF
chmod +x "$OUT/qemu.tmp"
mv "$OUT/qemu.tmp" "$OUT/qemu"
QEMU_VERSION=$("$OUT/qemu" --version | head -1)
"$OUT/qemu" -device help | grep -q '"vhost-user-test-device-pci"' || {
    echo "provision-vm.sh: $QEMU_VERSION has no vhost-user-test-device-pci" >&2
    exit 1
}

# 2. guest kernels. A private apt configuration reaches trixie without touching the host's sources.
A=$OUT/apt
mkdir -p "$A"/lists/partial "$A"/cache/archives/partial "$A"/etc/preferences.d "$OUT/kernels"
apt_conf() {  # $1: suite
    mkdir -p "$A/$1/lists/partial"
    echo "deb $MIRROR $1 main" >"$A/$1.list"
    cat >"$A/$1.conf" <<EOF
Dir::Etc::sourcelist "$A/$1.list";
Dir::Etc::sourceparts "/nonexistent";
Dir::Etc::preferencesparts "$A/etc/preferences.d";
Dir::State::lists "$A/$1/lists";
Dir::Cache "$A/cache";
Dir::State::status "/var/lib/dpkg/status";
APT::Sandbox::User "root";
EOF
    APT_CONFIG=$A/$1.conf apt-get update -q >/dev/null
}
fetch_kernel() {  # $1: suite (bookworm, trixie): linux-image-amd64's dependency, unpacked
    local suite=$1 pkg dir
    [ -e "$OUT/kernels/$suite" ] && return
    apt_conf "$suite"
    pkg=$(APT_CONFIG=$A/$suite.conf apt-cache depends linux-image-amd64 |
        awk '/Depends: linux-image-[0-9]/{print $2; exit}')
    [ -n "$pkg" ] || { echo "provision-vm.sh: no linux-image in $suite" >&2; exit 1; }
    dir=$OUT/kernels/$pkg
    rm -rf "$dir" "$OUT/kernels/$pkg".deb.d
    mkdir -p "$OUT/kernels/$pkg.deb.d"
    (cd "$OUT/kernels/$pkg.deb.d" && APT_CONFIG=$A/$suite.conf apt-get download -q "$pkg" 2>&1 | grep -v unsandboxed || true)
    mkdir -p "$dir.tmp"
    dpkg -x "$OUT/kernels/$pkg.deb.d"/*.deb "$dir.tmp"
    rm -rf "$OUT/kernels/$pkg.deb.d"
    # merged-/usr kernels put their modules under usr/lib/modules
    [ -d "$dir.tmp/lib/modules" ] || ln -s usr/lib "$dir.tmp/lib"
    depmod -b "$dir.tmp" "$(ls "$dir.tmp/lib/modules")"
    mv "$dir.tmp" "$dir"
    ln -sfn "$pkg" "$OUT/kernels/$suite"
    echo "kernel $suite: $dir"
}
fetch_kernel bookworm
fetch_kernel trixie

# 3. busybox-static for the initramfs (a copy, so the cache does not depend on the host's)
cp /bin/busybox "$OUT/busybox.tmp"
mv "$OUT/busybox.tmp" "$OUT/busybox"

{
    echo "QEMU=$QEMU_VERSION"
    for k in bookworm trixie; do
        echo "KERNEL_$k=$(ls "$OUT/kernels/$k/lib/modules")"
    done
} >"$OUT/versions.env"
touch "$OUT/.complete"
cat "$OUT/versions.env"
echo "provisioned: $OUT"
