"""A small VM runner: boots a Debian guest kernel under QEMU 11.1 with apir's virtio-gpu device
behind vhost-user, runs one shell command in the guest, and keeps its console.

What `apir vm provision` left in its cache (`Provisioned`, apir.vm.provision): the trixie tree's
QEMU (`qemu` wrapper), kernels/<suite>/ (a `dpkg -x` of linux-image-*, depmod'ed), busybox.

The guest (`Vm`): the kernel's uncompressed vmlinux booted directly through its PVH entry
(Debian's kernels have CONFIG_PVH=y; this skips the xz decompression, slow under TCG), a
busybox initramfs that insmods virtio_pci, 9pnet_virtio, 9p, virtio-gpu and overlay (busybox
insmod ignores module options on the kernel command line, so /init passes them), the host's /
as a read-only 9p root, a tmpfs overlay on /tmp, and one writable 9p work folder at its host
path. The command runs with that folder as cwd, stdin /dev/null, its stdout on the second
serial port and its stderr on the third (raw ttys: the bytes as written), so they reach the host
apart from the console; its exit status comes back on the console as MINIVM-RC=N, then the
guest powers off. KVM only where it runs stock kernels (`default_accel`): /dev/kvm of kvm_pvm
(a PVM host) hangs them, so TCG there.

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
from typing import IO, List, Optional

from apir.errors import ApirError

__all__ = ["NotProvisioned", "Kernel", "Provisioned", "Vm", "cpio", "default_accel", "KERNELS"]

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
stty -F /dev/ttyS1 raw -echo; stty -F /dev/ttyS2 raw -echo
echo "minivm: userspace at $(cut -d' ' -f1 /proc/uptime) s"
chroot /newroot /bin/sh -c "cd $WORK && exec /bin/sh $WORK/.minivm-cmd" </dev/null >/dev/ttyS1 2>/dev/ttyS2
echo "MINIVM-RC=$?"
echo "minivm: done at $(cut -d' ' -f1 /proc/uptime) s"
sync
reboot -f
"""


class NotProvisioned(ApirError, RuntimeError):
    """No QEMU and guest kernels where apir looks for them (or provisioning failed); the
    message says why and what to run."""


def default_accel() -> str:
    """ "kvm" where /dev/kvm can be used and is a stock KVM (kvm_intel / kvm_amd), else "tcg"."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK) or os.path.exists("/sys/module/kvm_pvm"):
        return "tcg"
    if os.path.exists("/sys/module/kvm_intel") or os.path.exists("/sys/module/kvm_amd"):
        return "kvm"
    return "tcg"


@dataclass
class Kernel:
    """A provisioned guest kernel: kernels/<suite> in the cache."""

    suite: str
    root: Path

    @property
    def release(self) -> str:
        return next((self.root / "lib" / "modules").iterdir()).name

    def _locked(self) -> IO:
        lock = open(self.root.parent / f".{self.suite}.lock", "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
        return lock

    def vmlinux(self) -> Path:
        """The uncompressed ELF kernel, cut out of boot/vmlinuz-* once and cached (by
        provisioning: a user without write access to the cache only reads it)."""
        out = self.root / "vmlinux"
        if out.exists():
            return out
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
        if out.exists():
            return out
        with self._locked():
            if not out.exists():
                out.with_suffix(".tmp").write_bytes(self._initrd_bytes(busybox))
                os.replace(out.with_suffix(".tmp"), out)
        return out

    def _initrd_bytes(self, busybox: Path) -> bytes:
        files = {"bin/busybox": (0o100755, busybox.read_bytes())}
        order: List[str] = []
        for mod in MODULES:
            deps = subprocess.run(
                ["modprobe", "-d", str(self.root), "-S", self.release, "--show-depends", mod],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.splitlines()
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
        return cpio(["bin", "proc", "sys", "dev", "mods", "newroot"], files)


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
    """The cache `apir vm provision` filled."""

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
    run in the guest with cwd `work`. Console output lands in work/console-NAME.log; the
    command's stdout and stderr on the descriptors `stdout` / `stderr` (QEMU writes them),
    else in work/NAME.stdout / NAME.stderr. `timeout_s` None: no time limit."""

    prov: Provisioned
    kernel: Kernel
    work: Path
    command: str
    socket: Optional[Path] = None
    memory: str = "2G"
    smp: int = 2
    timeout_s: Optional[float] = 600.0
    name: str = "vm"
    accel: str = "tcg"
    stdout: Optional[int] = None
    stderr: Optional[int] = None
    proc: Optional[subprocess.Popen] = field(default=None, repr=False)
    started: float = 0.0
    seconds: float = 0.0
    console: str = ""
    rc: Optional[int] = None

    @property
    def console_path(self) -> Path:
        return self.work / f"console-{self.name}.log"

    def _port(self, fd: Optional[int], suffix: str) -> str:
        # QEMU opens the descriptor it inherited through its /dev/fd name
        return f"/dev/fd/{fd}" if fd is not None else str(self.work / f"{self.name}.{suffix}")

    def qemu_command(self, initrd: Path) -> List[str]:
        append = "console=ttyS0 panic=-1 quiet loglevel=3 rdinit=/init drm_kms_helper.fbdev_emulation=0"
        cpu = "host" if self.accel == "kvm" else "max"
        cmd = [str(self.prov.qemu), "-nodefaults", "-nographic", "-no-reboot", "-M", "q35", "-accel", self.accel,
               "-cpu", cpu, "-smp", str(self.smp), "-m", self.memory,
               # vhost-user needs the guest RAM in a shared file the device can map
               "-object", f"memory-backend-memfd,id=mem,size={self.memory},share=on", "-machine", "memory-backend=mem",
               "-bios", str(self.prov.root / "trixie" / "usr" / "share" / "qemu" / "qboot.rom"),
               "-serial", "stdio",
               "-chardev", f"file,id=out,path={self._port(self.stdout, 'stdout')}", "-serial", "chardev:out",
               "-chardev", f"file,id=err,path={self._port(self.stderr, 'stderr')}", "-serial", "chardev:err",
               "-kernel", str(self.kernel.vmlinux()), "-initrd", str(initrd), "-append", append,
               "-fsdev", "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap",
               "-device", "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot",
               "-fsdev", f"local,id=work,path={self.work},security_model=none,multidevs=remap",
               "-device", "virtio-9p-pci,fsdev=work,mount_tag=work"]  # fmt: skip
        if self.socket is not None:
            # the generic vhost-user device as virtio-gpu (id 16): controlq + cursorq, 16-byte config
            device = "vhost-user-test-device-pci,chardev=vgpu,virtio-id=16,num_vqs=2,config_size=16"
            cmd += ["-chardev", f"socket,id=vgpu,path={self.socket}", "-device", device]
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
        fds = tuple(fd for fd in (self.stdout, self.stderr) if fd is not None)
        self.proc = subprocess.Popen(
            self.qemu_command(self._initrd),
            stdin=subprocess.DEVNULL,
            stdout=self._console,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=fds,
        )
        return self

    def wait(self) -> "Vm":
        """Waits for the guest to power off (kills QEMU at timeout_s after start); sets
        console, rc (the command's status, None when it never reported) and seconds."""
        assert self.proc is not None
        timeout = None if self.timeout_s is None else max(1.0, self.timeout_s - (time.monotonic() - self.started))
        timed_out = False
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            self.proc.kill()
            self.proc.wait()
        self.seconds = time.monotonic() - self.started
        self._console.close()
        self._initrd.unlink(missing_ok=True)
        self.console = self.console_path.read_text(errors="replace")
        for line in self.console.splitlines():
            if line.startswith("MINIVM-RC="):
                self.rc = int(line.split("=", 1)[1])
        if timed_out:
            self.console += f"\nminivm: killed at the {self.timeout_s:.0f} s timeout\n"
        return self

    def kill(self) -> None:
        """Kills QEMU (if running) and reaps it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if getattr(self, "_initrd", None) is not None:
            self._initrd.unlink(missing_ok=True)

    def boot_seconds(self) -> Optional[float]:
        """Guest uptime when /init reached the command (from the console)."""
        for line in self.console.splitlines():
            if line.startswith("minivm: userspace at "):
                return float(line.split()[3])
        return None
