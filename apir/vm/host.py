"""The hypervisor's half of a VM run: one `apir host vhost-user` process serving one socket per
VM, started in a session of its own (a terminal's Ctrl-C reaches the command that started it,
which then stops it) and on the same apir as this process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from apir.errors import ApirError

__all__ = ["VhostUserHost", "HostFailed", "host_command"]

# the folder holding this apir package: put first on the host's PYTHONPATH
_APIR_ROOT = str(Path(__file__).resolve().parents[2])


class HostFailed(ApirError, RuntimeError):
    """The host process ended or did not listen; the message holds the end of its log."""


def host_command(sockets: Sequence[Path], args: Sequence[str] = ()) -> List[str]:
    """`apir host vhost-user` on `sockets`, with the further options `args` (--venus, --config ...)."""
    cmd = [sys.executable, "-m", "apir", "host", "vhost-user"]
    for path in sockets:
        cmd += ["--socket", str(path)]
    return cmd + list(args)


@dataclass
class VhostUserHost:
    """One host process serving `sockets` (with the options `args`); its output goes to `log`."""

    sockets: Sequence[Path]
    log: Path
    args: Sequence[str] = ()
    proc: Optional[subprocess.Popen] = field(default=None, repr=False)

    @property
    def socket(self) -> Path:
        """The first socket (the only one of a single VM)."""
        return Path(self.sockets[0])

    def start(self, env: Optional[Dict[str, str]] = None, timeout_s: float = 60) -> "VhostUserHost":
        """Starts the process (this environment, plus `env`) and waits until every socket listens."""
        for path in self.sockets:
            Path(path).unlink(missing_ok=True)
        path_env = os.pathsep.join(p for p in (_APIR_ROOT, os.environ.get("PYTHONPATH")) if p)
        with open(self.log, "wb") as fh:
            self.proc = subprocess.Popen(
                host_command(self.sockets, self.args),
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=dict(os.environ, **(env or {}), PYTHONPATH=path_env),
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while not all(Path(p).exists() for p in self.sockets):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise HostFailed(f"the vhost-user host did not listen on {', '.join(map(str, self.sockets))}:\n"
                                 f"{self.log_tail()}")  # fmt: skip
            time.sleep(0.05)
        return self

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL, then reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def stop(self, timeout_s: float = 10) -> None:
        """SIGTERM (the host closes its sockets and frees every VM's state), SIGKILL if it
        has not ended after `timeout_s`."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
