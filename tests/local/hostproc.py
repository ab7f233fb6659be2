"""A separate `apir host serve` process for tests: start it, wait for its socket, kill it."""

import os
import signal
import socket
import subprocess
import sys
import time


class HostProcess:
    """`python -m apir.cli host serve --socket PATH` in a child process (its own session, so
    it can be stopped and killed on its own)."""

    def __init__(self, path, *extra_args, log_level="info"):
        self.path = str(path)
        self.log_path = self.path + ".log"
        self._log = open(self.log_path, "wb")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "apir.cli", "host", "serve", "--socket", self.path,
             "--log-level", log_level, *extra_args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._wait_ready()

    def _wait_ready(self, timeout_s=30.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"apir host exited with {self.proc.returncode}: {self.log()}")
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                    probe.connect(self.path)
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"apir host did not listen on {self.path}: {self.log()}")

    def log(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def signal(self, signum):
        self.proc.send_signal(signum)

    def pause(self, timeout_s=10.0):
        """SIGSTOP, and return once the host has really stopped. kill() only queues the signal:
        the thread that takes it stops the others, and until it gets a CPU (a loaded machine)
        the host keeps serving. The parent learns of the stop from waitpid(WUNTRACED)."""
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.proc.pid, os.WUNTRACED | os.WNOHANG)
            if pid and os.WIFSTOPPED(status):
                return
            if pid:
                raise RuntimeError(f"apir host ended while being paused (status {status:#x})")
            time.sleep(0.005)
        raise RuntimeError(f"apir host did not stop within {timeout_s:g} s")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
