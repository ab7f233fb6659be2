#!/usr/bin/env bash
# The Debian 12 packages apir's tests need, installed where missing (root; idempotent).
# Used by .ci/run and named in the README's test prerequisites.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
# The C reference build (scripts/build-c-reference.sh) needs a C++ toolchain, CMake, Ninja, bc
# and libdrm; python3-venv gives Debian's python3 its venv module. The VM tests' provisioning
# (apir/vm/provision-vm.sh, run by `apir vm provision`) needs debootstrap, busybox-static, kmod (depmod, modprobe), xz, zstd.
packages=(build-essential cmake ninja-build bc pkg-config libdrm-dev python3-venv
    debootstrap busybox-static kmod xz-utils zstd)
# ggml's Vulkan build (scripts/build-ggml-backends.sh): glslc, SPIR-V headers and the Vulkan
# loader to link; the Vulkan tests run Mesa 25's lavapipe, unpacked by that script, which needs
# these runtime libraries (the ones of bookworm's mesa-vulkan-drivers, without its driver).
packages+=(glslc spirv-headers libvulkan-dev libvulkan1 libllvm15 libz3-4 libdrm2 libdrm-amdgpu1 libelf1
    libexpat1 libzstd1 libx11-xcb1 libxcb-dri3-0 libxcb-present0 libxcb-randr0 libxcb-shm0 libxcb-sync1
    libxcb-xfixes0 libxshmfence1 libwayland-client0)
missing=()
for pkg in "${packages[@]}"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
