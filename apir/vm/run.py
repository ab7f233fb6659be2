"""`apir vm run`: a program in VMs whose virtio-gpu is apir's device, its output and status back.

One host process (apir.vm.host) serves one vhost-user socket per VM; each VM (apir.vm.machine)
runs the program with the host's environment, in the host's current folder, on the host's files
(read-only). The program's stdout and stderr reach this process through pipes QEMU writes, and
are copied to ours as they come: as they are for one VM, each line labelled `[vmN] ` for several.
The exit status is the program's (for several VMs the first that is not 0); a VM that ends
without it (a guest that failed to boot) is an error naming the end of its console. However
the run ends (the program's exit, an error, Ctrl-C), the VMs and the host are killed and reaped
and the run's temporary folder (sockets, logs, the VMs' work folders) removed.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, List, Optional, Sequence

from apir.errors import ApirError
from apir.vm import provision
from apir.vm.host import VhostUserHost
from apir.vm.machine import Vm

__all__ = ["RunOptions", "run", "guest_script", "Relay", "VmFailed", "exit_on_termination"]

# host variables meaningless (or wrong) in the guest's shell
_NOT_EXPORTED = {"PWD", "OLDPWD", "SHLVL", "_"}
# Set in the guest unless the host's environment sets them: Numba (apir's kernels) caches what it
# compiles beside the sources or under ~, read-only in the guest, and fails without a cache.
GUEST_DEFAULTS = {"NUMBA_CACHE_DIR": "/tmp/numba-cache"}


class VmFailed(ApirError, RuntimeError):
    """A VM ended without the program's exit status."""


@dataclass
class RunOptions:
    """What `apir vm run` takes besides the program: VM count, guest kernel and size, the
    accelerator (None: machine.default_accel()), the host's options and log file, or `devices`:
    the sockets of running vhost-user devices (`apir host vhost-user`), one per VM, to attach
    to instead of starting a host."""

    vms: int = 1
    devices: Sequence[Path] = ()
    kernel: str = "bookworm"
    memory: str = "2G"
    cpus: int = 2
    accel: Optional[str] = None
    host_args: Sequence[str] = ()
    host_log: Optional[Path] = None
    timeout_s: Optional[float] = None


def guest_script(argv: Sequence[str], env: dict, cwd: str) -> str:
    """The guest's /bin/sh script: `env` exported, `cwd` entered, `argv` exec'd."""
    lines = [
        f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items()) if k not in _NOT_EXPORTED and k.isidentifier()
    ]
    lines.append(f"cd {shlex.quote(cwd)} || exit 125")
    lines.append("exec " + " ".join(shlex.quote(a) for a in argv))
    return "\n".join(lines)


@dataclass
class Relay:
    """Copies what arrives on the pipe `fd` to `out` as it comes, each line prefixed with
    `label` (when there is one); ends at end of file (the writer, QEMU, gone)."""

    fd: int
    out: BinaryIO
    label: bytes = b""
    lock: threading.Lock = field(default_factory=threading.Lock)
    thread: Optional[threading.Thread] = None

    def start(self) -> "Relay":
        self.thread = threading.Thread(target=self._copy, daemon=True, name="apir-vm-relay")
        self.thread.start()
        return self

    def _copy(self) -> None:
        pending = b""
        try:
            while True:
                chunk = os.read(self.fd, 65536)
                if not chunk:
                    break
                if not self.label:
                    self._write(chunk)
                    continue
                pending += chunk
                *lines, pending = pending.split(b"\n")
                if lines:
                    self._write(b"".join(self.label + line + b"\n" for line in lines))
            if pending:
                self._write(self.label + pending + (b"\n" if self.label else b""))
        except (OSError, ValueError):
            pass  # our stdout went away: the program's output has nowhere to go
        finally:
            os.close(self.fd)

    def _write(self, data: bytes) -> None:
        with self.lock:
            self.out.write(data)
            self.out.flush()

    def join(self, timeout_s: float = 10) -> None:
        if self.thread is not None:
            self.thread.join(timeout_s)


def run(argv: Sequence[str], opts: RunOptions, stdout: BinaryIO, stderr: BinaryIO) -> int:
    """Runs `argv` in `opts.vms` VMs (see the module); returns the exit status. Raises
    NotProvisioned, HostFailed, VmFailed; KeyboardInterrupt passes through, after cleaning up."""
    from apir.vm.machine import default_accel

    prov = provision.find()
    kernel = prov.kernel(opts.kernel)
    accel = opts.accel or default_accel()
    tmp = Path(tempfile.mkdtemp(prefix="apir-vm-"))
    host: Optional[VhostUserHost] = None
    vms: List[Vm] = []
    relays: List[Relay] = []
    try:
        if opts.devices:
            sockets = list(opts.devices)
        else:
            host = VhostUserHost([tmp / f"vm{i}.sock" for i in range(1, opts.vms + 1)],
                                 opts.host_log or tmp / "host.log", opts.host_args)  # fmt: skip
            host.start()
            sockets = list(host.sockets)
        names = [f"vm{i}" for i in range(1, len(sockets) + 1)]
        lock = threading.Lock()
        for name, sock in zip(names, sockets):
            env = dict(GUEST_DEFAULTS, **os.environ, APIR_VM_NAME=name)
            label = f"[{name}] ".encode() if len(sockets) > 1 else b""
            pipes = [os.pipe(), os.pipe()]  # (read, write) of stdout, of stderr
            try:
                vm = Vm(prov, kernel, tmp / name, guest_script(argv, env, os.getcwd()), socket=sock,
                        memory=opts.memory, smp=opts.cpus, timeout_s=opts.timeout_s, name=name, accel=accel,
                        stdout=pipes[0][1], stderr=pipes[1][1])  # fmt: skip
                vms.append(vm)
                vm.start()
            except BaseException:
                for r, _ in pipes:
                    os.close(r)
                raise
            finally:
                for _, w in pipes:
                    os.close(w)  # QEMU holds its own copies
            relays += [Relay(pipes[0][0], stdout, label, lock).start(), Relay(pipes[1][0], stderr, label, lock).start()]
        for vm in vms:
            vm.wait()
        for relay in relays:
            relay.join()
        status = 0
        for vm in vms:
            if vm.rc is None:
                tail = "\n".join(vm.console.splitlines()[-20:])
                host_log = f"--- the host's log ends:\n{host.log_tail()}\n" if host is not None else ""
                stderr.write(f"--- {vm.name}'s console ends:\n{tail}\n{host_log}".encode())
                stderr.flush()
                code = vm.proc.returncode if vm.proc else None
                raise VmFailed(f"{vm.name} ended without the program's exit status (QEMU exit {code}; above: "
                               "the end of its console and of the host's log)")  # fmt: skip
            status = status or vm.rc
        return status
    finally:
        with _signals_held():
            for vm in vms:
                vm.kill()
            if host is not None:
                host.stop()
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _signals_held():
    """A second Ctrl-C (or SIGTERM) while cleaning up waits until the cleanup is done."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def exit_on_termination() -> None:
    """SIGTERM and SIGHUP end `run` as Ctrl-C does (cleaning up), with status 128 + the signal."""

    def on_signal(signum, frame):
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, on_signal)
