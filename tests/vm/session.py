"""Host-side pieces of a guest session shared by tests/vm's fixtures: the guest's environment,
one boot running guest_program.py's checks. The VM and the device process are apir's own
(apir.vm.machine, apir.vm.host: what `apir vm run` runs)."""

from __future__ import annotations

import json
import shlex
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

from apir.vm import machine
from apir.vm.host import VhostUserHost
from tests.cref import REPO

GUEST_PROGRAM = Path(__file__).with_name("guest_program.py")
# ggml's C guest in the VM (tests/vm/test_c_guest.py): [op, test-backend-ops -p regex], 54 cases
# that each take well under a second on ggml CPU in the guest under TCG
C_GUEST_OPS = [
    ["SCALE", ".*"],
    ["ADD", r"type=f32,ne=\[10,5,4,3\]"],
    ["RMS_NORM", r"ne=\[64,5,4,3\],v=0"],
    ["SOFT_MAX", r"type=f32,ne=\[16,16,1,1\]"],
    # be1 <= 9: the be1=700 case makes the C guest ask for a 616 MiB from-ptr blob, more than
    # this 2 GiB TCG guest gives it (apir_device_buffer_from_ptr aborts)
    ["GET_ROWS", r"type=f32,n=256,m=5,r=4,be1=[1-9],"],
]


def guest_env(work: Path) -> Dict[str, str]:
    """Environment of Python in the guest (and of the host run that warms its Numba cache):
    this clone's apir, Numba's cache in the writable work folder compiled for a generic CPU
    (the guest's TCG CPU is not the host's)."""
    return {"PYTHONPATH": str(REPO), "NUMBA_CPU_NAME": "generic", "NUMBA_CACHE_DIR": str(work / "numba")}


@dataclass
class GuestSession:
    """One boot running guest_program.py's checks: results (its JSON), the VM, the logs."""

    kernel: machine.Kernel
    vm: machine.Vm
    results: dict
    logs: Dict[str, str]
    killed_after_s: Optional[float] = None

    @property
    def timing(self) -> dict:
        return json.loads(next(v for k, v in self.logs.items() if k.startswith("timing")))

    def check(self, name: str):
        """The value of guest check `name`; fails with the guest's traceback if it failed."""
        entry = self.results.get("checks", {}).get(name)
        assert entry is not None, f"guest check {name!r} did not run (VM rc {self.vm.rc})"
        assert entry["ok"], entry.get("trace") or entry.get("error")
        return entry["value"]


def run_guest(prov, kernel, work: Path, checks, *, kill_device: bool, name: str = "vm",
              timeout_s: float = 900, extra_env: Optional[Dict[str, str]] = None) -> GuestSession:
    """Boots `kernel` with a fresh device and runs guest_program.py `checks` in it. With
    `kill_device`, the device is SIGKILLed 2 s after the guest writes work/kill.ready."""
    env = dict(guest_env(work), **(extra_env or {}))
    out = work / "guest.json"
    command = (" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
               + f" {sys.executable} {GUEST_PROGRAM} {out} {' '.join(checks)} > {work}/guest.log 2>&1")
    device = VhostUserHost([work / "vgpu.sock"], work / "device.log").start()
    vm = machine.Vm(prov, kernel, work, command, socket=device.socket, timeout_s=timeout_s, name=name)
    killed = []

    def killer():
        while vm.proc is not None and vm.proc.poll() is None:
            if (work / "kill.ready").exists():
                time.sleep(2)
                killed.append(time.monotonic() - vm.started)
                device.kill()
                return
            time.sleep(0.1)

    try:
        vm.start()
        if kill_device:
            th = threading.Thread(target=killer, daemon=True)
            th.start()
        vm.wait()
    finally:
        vm.kill()
        device.stop()
    results = json.loads(out.read_text()) if out.exists() else {}
    timing = {"boot_s": vm.boot_seconds(), "vm_s": round(vm.seconds, 1), "import_s": results.get("import_seconds"),
              "checks_s": {k: v["seconds"] for k, v in results.get("checks", {}).items()}}
    logs = {f"timing ({name})": json.dumps(timing), f"console ({name})": vm.console}
    for log in ("guest.log", "device.log"):
        p = work / log
        logs[f"{log} ({name})"] = p.read_text(errors="replace")[-20000:] if p.exists() else "(none)"
    return GuestSession(kernel, vm, results, logs, killed[0] if killed else None)
