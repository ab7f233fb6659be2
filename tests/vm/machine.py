"""A small VM runner: boots a Debian guest kernel under QEMU 11.1 (TCG) with a virtio-gpu
device behind vhost-user, runs one shell command in the guest, and keeps its console.

What scripts/provision-vm.sh left in its cache (`Provisioned`): the trixie tree's QEMU
(`qemu` wrapper), kernels/<suite>/ (a `dpkg -x` of linux-image-*, depmod'ed), busybox.

The guest (`Vm`): the kernel's uncompressed vmlinux booted directly through its PVH entry
(Debian's kernels have CONFIG_PVH=y; this skips the xz decompression, slow under TCG), a
busybox initramfs that insmods virtio_pci, 9pnet_virtio, 9p, virtio-gpu and overlay (busybox
insmod ignores module options on the kernel command line, so /init passes them), the host's /
as a read-only 9p root, a tmpfs overlay on /tmp, and one writable 9p work folder at its host
path. The command runs with that folder as cwd; its exit status comes back on the console as
MINIVM-RC=N, then the guest powers off. TCG, not KVM: /dev/kvm on the CI machine is kvm_pvm,
under which stock kernels hang.

Why not virtme-ng: its init spends far longer in udev under TCG than this one takes to reach
userspace (docs/design.md, Measurements).
"""

from __future__ import annotations

import fcntl
import lzma
import os
import subprocess
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parents[2]
PROVISION_SCRIPT = REPO / "scripts" / "provision-vm.sh"
VM_VERSION = "qemu-11.1"  # provision-vm.sh's cache folder name
KERNELS = ("bookworm", "trixie")  # 6.1 and 6.12
MODULES = ("virtio_pci", "9pnet_virtio", "9p", "virtio-gpu", "overlay")
# kernel command-line options the guest's /init hands to insmod (module -> options)
MODULE_OPTIONS = {"drm_kms_helper": "fbdev_emulation=0"}

INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
while read m opts; do
  insmod /mods/$m $opts 2>/dev/null || echo "minivm: insmod $m failed"
done < /modules.order
mkdir -p /newroot
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /newroot ||
  echo "minivm: 9p root failed"
mkdir -p /ovl && mount -t tmpfs ovl /ovl && mkdir -p /ovl/up /ovl/wk
mount -t overlay overlay -o lowerdir=/newroot/tmp,upperdir=/ovl/up,workdir=/ovl/wk /newroot/tmp ||
  echo "minivm: /tmp overlay failed"
WORK=$(cat /work.path)
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 work /newroot$WORK || echo "minivm: 9p work failed"
mount --bind /proc /newroot/proc; mount --bind /sys /newroot/sys; mount --bind /dev /newroot/dev
mount -t tmpfs run /newroot/run 2>/dev/null
echo "minivm: userspace at $(cut -d' ' -f1 /proc/uptime) s"
chroot /newroot /bin/sh -c "cd $WORK && exec /bin/sh $WORK/.minivm-cmd"
echo "MINIVM-RC=$?"
echo "minivm: done at $(cut -d' ' -f1 /proc/uptime) s"
sync
reboot -f
"""


class NotProvisioned(RuntimeError):
    """scripts/provision-vm.sh has not run (or failed); the message says why."""


def cache_dir() -> Path:
    """provision-vm.sh's folder: $APIR_VM_CACHE, else <user cache>/apir/vm/<VM_VERSION>
    (<user cache>: $APIR_CACHE_DIR, else $XDG_CACHE_HOME/apir, else ~/.cache/apir)."""
    if os.environ.get("APIR_VM_CACHE"):
        return Path(os.environ["APIR_VM_CACHE"])
    if os.environ.get("APIR_CACHE_DIR"):
        base = Path(os.environ["APIR_CACHE_DIR"])
    elif os.environ.get("XDG_CACHE_HOME"):
        base = Path(os.environ["XDG_CACHE_HOME"]) / "apir"
    else:
        base = Path.home() / ".cache" / "apir"
    return base / "vm" / VM_VERSION


def provision() -> Path:
    """The provisioned cache folder; runs scripts/provision-vm.sh on first use (minutes, root,
    network). Raises NotProvisioned with the script's last lines when it cannot."""
    out = cache_dir()
    if (out / ".complete").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    log = out / "provision.log"
    with open(log, "w") as fh:
        done = subprocess.run(["bash", str(PROVISION_SCRIPT), str(out)], stdout=fh, stderr=subprocess.STDOUT)
    if done.returncode != 0 or not (out / ".complete").exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise NotProvisioned(f"{PROVISION_SCRIPT.name} failed (exit {done.returncode}); log {log}:\n{tail}")
    return out


@dataclass
class Kernel:
    """A provisioned guest kernel: kernels/<suite> in the cache."""

    suite: str
    root: Path

    @property
    def release(self) -> str:
        return next((self.root / "lib" / "modules").iterdir()).name

    def _locked(self):
        lock = open(self.root.parent / f".{self.suite}.lock", "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
        return lock

    def vmlinux(self) -> Path:
        """The uncompressed ELF kernel, cut out of boot/vmlinuz-* once and cached."""
        out = self.root / "vmlinux"
        with self._locked():
            if not out.exists():
                data = (self.root / "boot" / f"vmlinuz-{self.release}").read_bytes()
                out.with_suffix(".tmp").write_bytes(_decompress_vmlinux(data))
                os.replace(out.with_suffix(".tmp"), out)
        return out

    def initrd(self, busybox: Path) -> Path:
        """The per-kernel part of the initramfs (busybox + MODULES and their dependencies,
        uncompressed, in load order), built once and cached."""
        out = self.root / "minivm-initrd.cpio"
        with self._locked():
            if not out.exists():
                files = {"bin/busybox": (0o100755, busybox.read_bytes())}
                order = []
                for mod in MODULES:
                    deps = subprocess.run(
                        ["modprobe", "-d", str(self.root), "-S", self.release, "--show-depends", mod],
                        check=True, capture_output=True, text=True).stdout.splitlines()
                    for line in deps:
                        parts = line.split()
                        if parts[0] != "insmod":
                            continue  # built in
                        src = Path(parts[1])
                        name = src.name[:-3] if src.name.endswith(".xz") else src.name
                        if name in order:
                            continue
                        data = src.read_bytes()
                        files[f"mods/{name}"] = (0o100644, lzma.decompress(data) if src.name.endswith(".xz") else data)
                        order.append(name)
                lines = [f"{n} {MODULE_OPTIONS.get(n[:-3].replace('-', '_'), '')}".rstrip() for n in order]
                files["modules.order"] = (0o100644, ("\n".join(lines) + "\n").encode())
                dirs = ["bin", "proc", "sys", "dev", "mods", "newroot"]
                out.with_suffix(".tmp").write_bytes(cpio(dirs, files))
                os.replace(out.with_suffix(".tmp"), out)
        return out


def _decompress_vmlinux(data: bytes) -> bytes:
    for magic, how in ((b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"\x1f\x8b\x08", "gzip")):
        start = data.find(magic)
        while start >= 0:
            try:
                if how == "xz":
                    elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data[start:])
                elif how == "gzip":
                    elf = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data[start:])
                else:
                    elf = subprocess.run(["zstd", "-dc"], input=data[start:], capture_output=True).stdout
            except (lzma.LZMAError, zlib.error):
                elf = b""
            if elf[:4] == b"\x7fELF":
                return elf
            start = data.find(magic, start + 1)
    raise NotProvisioned("no compressed ELF kernel found in the vmlinuz")


def cpio(dirs: List[str], files: dict) -> bytes:
    """A newc cpio archive: `dirs` (mode 755) then `files` {name: (mode, bytes)}."""
    out = bytearray()
    entries = [(d, 0o40755, b"") for d in dirs] + [(n, m, b) for n, (m, b) in files.items()] + [("TRAILER!!!", 0, b"")]
    for ino, (name, mode, data) in enumerate(entries, 1):
        nb = name.encode() + b"\0"
        fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nb), 0)
        out += b"070701" + "".join(f"{v:08x}" for v in fields).encode() + nb
        out += b"\0" * (-(110 + len(nb)) % 4)
        out += data + b"\0" * (-len(data) % 4)
    return bytes(out)


@dataclass
class Provisioned:
    """The cache provision-vm.sh filled."""

    root: Path

    @property
    def qemu(self) -> Path:
        return self.root / "qemu"

    @property
    def busybox(self) -> Path:
        return self.root / "busybox"

    def kernel(self, suite: str) -> Kernel:
        path = self.root / "kernels" / suite
        if not path.exists():
            raise NotProvisioned(f"no {suite} kernel in {self.root / 'kernels'}")
        return Kernel(suite, path.resolve())


@dataclass
class Vm:
    """One guest boot: `start()`, then `wait()`. `socket` is the vhost-user socket of the
    virtio-gpu device (a server must listen there before start); `command` is a /bin/sh line
    run in the guest with cwd `work`. Console output lands in work/console.log."""

    prov: Provisioned
    kernel: Kernel
    work: Path
    command: str
    socket: Optional[Path] = None
    memory: str = "2G"
    smp: int = 2
    timeout_s: float = 600.0
    name: str = "vm"
    proc: Optional[subprocess.Popen] = field(default=None, repr=False)
    started: float = 0.0
    seconds: float = 0.0
    console: str = ""
    rc: Optional[int] = None

    @property
    def console_path(self) -> Path:
        return self.work / f"console-{self.name}.log"

    def qemu_command(self, initrd: Path) -> List[str]:
        append = "console=ttyS0 panic=-1 quiet loglevel=3 rdinit=/init drm_kms_helper.fbdev_emulation=0"
        cmd = [str(self.prov.qemu), "-nodefaults", "-nographic", "-no-reboot", "-M", "q35", "-accel", "tcg",
               "-cpu", "max", "-smp", str(self.smp), "-m", self.memory,
               # vhost-user needs the guest RAM in a shared file the device can map
               "-object", f"memory-backend-memfd,id=mem,size={self.memory},share=on", "-machine", "memory-backend=mem",
               "-bios", str(self.prov.root / "trixie" / "usr" / "share" / "qemu" / "qboot.rom"),
               "-serial", "stdio", "-kernel", str(self.kernel.vmlinux()), "-initrd", str(initrd), "-append", append,
               "-fsdev", "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap",
               "-device", "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot",
               "-fsdev", f"local,id=work,path={self.work},security_model=none,multidevs=remap",
               "-device", "virtio-9p-pci,fsdev=work,mount_tag=work"]
        if self.socket is not None:
            # the generic vhost-user device as virtio-gpu (id 16): controlq + cursorq, 16-byte config
            cmd += ["-chardev", f"socket,id=vgpu,path={self.socket}",
                    "-device", "vhost-user-test-device-pci,chardev=vgpu,virtio-id=16,num_vqs=2,config_size=16"]
        return cmd

    def start(self) -> "Vm":
        self.work.mkdir(parents=True, exist_ok=True)
        (self.work / ".minivm-cmd").write_text(self.command + "\n")
        base = self.kernel.initrd(self.prov.busybox)
        # the per-run part: /init and the work path, appended as a second cpio (the kernel unpacks both)
        extra = cpio([], {"init": (0o100755, INIT.encode()), "work.path": (0o100644, f"{self.work}\n".encode())})
        fd, initrd = tempfile.mkstemp(prefix=f"apir-{self.name}-", suffix=".cpio")
        with os.fdopen(fd, "wb") as f:
            f.write(base.read_bytes() + extra)
        self._initrd = Path(initrd)
        self._console = open(self.console_path, "wb")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.qemu_command(self._initrd), stdin=subprocess.DEVNULL,
                                     stdout=self._console, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait(self) -> "Vm":
        """Waits for the guest to power off (kills QEMU at timeout_s after start); sets
        console, rc (the command's status, None when it never reported) and seconds."""
        assert self.proc is not None
        try:
            self.proc.wait(timeout=max(1.0, self.timeout_s - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.seconds = time.monotonic() - self.started
        self._console.close()
        self._initrd.unlink(missing_ok=True)
        self.console = self.console_path.read_text(errors="replace")
        for line in self.console.splitlines():
            if line.startswith("MINIVM-RC="):
                self.rc = int(line.split("=", 1)[1])
        if self.proc.returncode == -9:
            self.console += f"\nminivm: killed at the {self.timeout_s:.0f} s timeout\n"
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def boot_seconds(self) -> Optional[float]:
        """Guest uptime when /init reached the command (from the console)."""
        for line in self.console.splitlines():
            if line.startswith("minivm: userspace at "):
                return float(line.split()[3])
        return None
