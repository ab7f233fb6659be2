"""Round-trip time of a small APIR call (device_get_type) over each local mode.

Prints p50 / p99 in microseconds for:
  - bare socket ping-pong: 16-byte message and 16-byte answer between this process and a
    Python echo process over a Unix socket (the floor any socket transport pays),
  - device_get_type over the socket transport (a separate `apir host serve` process),
  - device_get_type over the embedded host (a thread of this process), with execbuffer
    returning at once (the guest spins on the notification word) and waiting for completion.
All are measured in the same run, so the ratios hold on this machine at this moment.

    python benchmarks/bench_roundtrip.py [--calls N] [--warmup N]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

from apir.guest.client import ApirClient
from apir.local.embedded import EmbeddedDevice
from apir.guest.local import LocalDevice

_ECHO = r"""
import socket, sys
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(sys.argv[1]); srv.listen(1)
print("ready", flush=True)
conn, _ = srv.accept()
while True:
    data = conn.recv(16)
    if not data:
        break
    conn.sendall(data)
"""


def percentiles(samples_ns: list) -> tuple[float, float]:
    s = sorted(samples_ns)
    return s[len(s) // 2] / 1e3, s[min(len(s) - 1, int(len(s) * 0.99))] / 1e3


def time_calls(fn, calls: int, warmup: int) -> tuple[float, float]:
    for _ in range(warmup):
        fn()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(calls):
        t0 = clock()
        fn()
        samples.append(clock() - t0)
    return percentiles(samples)


def _wait_for_socket(path: str, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        if os.path.exists(path):
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                    probe.connect(path)
                return
            except OSError:
                pass
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {path} after {timeout_s} s")


def bench_ping_pong(tmp: str, calls: int, warmup: int) -> tuple[float, float]:
    path = os.path.join(tmp, "echo.sock")
    proc = subprocess.Popen([sys.executable, "-c", _ECHO, path], stdout=subprocess.PIPE)
    try:
        proc.stdout.readline()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(path)
            msg = bytes(16)

            def ping():
                sock.sendall(msg)
                sock.recv(16)

            return time_calls(ping, calls, warmup)
    finally:
        proc.kill()
        proc.wait()


def bench_socket(tmp: str, calls: int, warmup: int) -> tuple[float, float]:
    path = os.path.join(tmp, "apir.sock")
    proc = subprocess.Popen([sys.executable, "-m", "apir.cli", "host", "serve", "--socket", path],
                            stderr=subprocess.DEVNULL)
    try:
        _wait_for_socket(path, proc)
        with ApirClient.connect(LocalDevice(path)) as client:
            return time_calls(client.device_get_type, calls, warmup)
    finally:
        proc.terminate()
        proc.wait(10)


def bench_embedded(calls: int, warmup: int, exec_wait_s: float) -> tuple[float, float]:
    with ApirClient.connect(EmbeddedDevice(exec_wait_s=exec_wait_s)) as client:
        return time_calls(client.device_get_type, calls, warmup)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=500)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="apir-bench-") as tmp:
        rows = [
            ("bare socket ping-pong (16 B)", bench_ping_pong(tmp, args.calls, args.warmup)),
            ("device_get_type, socket host", bench_socket(tmp, args.calls, args.warmup)),
            ("device_get_type, embedded (spin)", bench_embedded(args.calls, args.warmup, 0.0)),
            ("device_get_type, embedded (wait)", bench_embedded(args.calls, args.warmup, 1.0)),
        ]
    base = rows[0][1][0]
    print(f"{'round trip':36} {'p50 us':>9} {'p99 us':>9} {'p50 / ping-pong':>16}")
    for name, (p50, p99) in rows:
        print(f"{name:36} {p50:9.1f} {p99:9.1f} {p50 / base:16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
