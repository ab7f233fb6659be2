"""Where apir finds QEMU 11.1 and the guest kernels, and the one command that puts them there.

`apir vm provision [DIR]` runs provision-vm.sh (beside this module; root, Debian packages only:
a debootstrapped trixie tree with QEMU 11.1 from trixie-backports, Debian's bookworm and trixie
kernels, busybox), then cuts each kernel's vmlinux and builds its initramfs, so that later runs
only read the cache (a user other than the one who provisioned can boot from it). Idempotent: a
provisioned cache is left as it is. `find()` returns the cache or raises NotProvisioned naming
the exact command to run.

The cache: $APIR_VM_CACHE, else <apir cache>/vm/qemu-11.1, where <apir cache> is
$APIR_CACHE_DIR, else $XDG_CACHE_HOME/apir, else ~/.cache/apir.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import IO, Optional

from apir.vm.machine import KERNELS, NotProvisioned, Provisioned

__all__ = ["VM_VERSION", "SCRIPT", "cache_dir", "find", "provision", "provision_command"]

VM_VERSION = "qemu-11.1"  # the cache folder's name
SCRIPT = Path(__file__).with_name("provision-vm.sh")
ENV_VM_CACHE = "APIR_VM_CACHE"


def cache_dir() -> Path:
    """The provisioned cache's folder (see the module)."""
    if os.environ.get(ENV_VM_CACHE):
        return Path(os.environ[ENV_VM_CACHE])
    if os.environ.get("APIR_CACHE_DIR"):
        base = Path(os.environ["APIR_CACHE_DIR"])
    elif os.environ.get("XDG_CACHE_HOME"):
        base = Path(os.environ["XDG_CACHE_HOME"]) / "apir"
    else:
        base = Path.home() / ".cache" / "apir"
    return base / "vm" / VM_VERSION


def provision_command(out: Optional[Path] = None) -> str:
    """The command line that provisions `out` (default: cache_dir()), as this user would type
    it: with sudo when not root, the folder named (sudo's HOME is root's)."""
    out = out or cache_dir()
    words = [sys.executable, "-m", "apir", "vm", "provision", str(out)]
    if os.geteuid() != 0:
        words.insert(0, "sudo")
    return " ".join(shlex.quote(w) for w in words)


def find(out: Optional[Path] = None) -> Provisioned:
    """The provisioned cache; NotProvisioned (naming the command to run) when there is none."""
    out = out or cache_dir()
    if not (out / ".complete").exists():
        raise NotProvisioned(
            f"no VM provisioned in {out} (QEMU 11.1 and guest kernels): run `{provision_command(out)}` "
            "once (root, Debian 12, a few minutes; docs/vm.md)"
        )
    return Provisioned(out)


def provision(out: Optional[Path] = None, log: Optional[IO] = None) -> Provisioned:
    """Provisions `out` (default: cache_dir()) if it is not yet, writing the script's output to
    `log` (default: this process's stdout and stderr). Raises NotProvisioned when the script
    fails (with the end of its log, when there is one)."""
    out = out or cache_dir()
    if not (out / ".complete").exists():
        out.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["bash", str(SCRIPT), str(out)], stdout=log, stderr=subprocess.STDOUT if log else None)
        if done.returncode != 0 or not (out / ".complete").exists():
            tail = ""
            if log is not None and getattr(log, "name", None):
                log.flush()
                tail = ":\n" + "\n".join(Path(log.name).read_text(errors="replace").splitlines()[-15:])
            raise NotProvisioned(f"{SCRIPT.name} failed (exit {done.returncode}){tail}")
    prov = Provisioned(out)
    for suite in KERNELS:
        kernel = prov.kernel(suite)
        kernel.vmlinux()
        kernel.initrd(prov.busybox)
    return prov
