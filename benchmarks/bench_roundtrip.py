"""Round-trip time of a small APIR call (device_get_type) over each local mode.

Prints p50 / p99 in microseconds for:
  - bare socket ping-pong: 16-byte message and 16-byte answer between this process and a
    Python echo process over a Unix socket (the floor any socket transport pays),
  - device_get_type over the socket transport (a separate `apir host serve` process), with its
    exec ring (commands through shared memory, the default) and without (a socket message each
    way: LocalDevice(exec_ring=False)),
  - device_get_type over the embedded host, as configured by default (exec_wait_s 1 s: the
    command, bounded, runs inline in the calling thread) and with exec_wait_s 0 (every command
    goes to the host thread, a thread of this process, and the guest spins on the notification
    word: the path execbuffer_nowait and the long commands take).
  - the peer, ggml-rpc: ggml_backend_dev_memory of an RPC device, one RPC_CMD_GET_DEVICE_MEMORY
    round trip over loopback TCP to an rpc-server this benchmark starts (benchmarks/rpc_peer.py).
    Of ggml-rpc's commands it is the closest to device_get_type: a query of the device, with no
    buffer or tensor in it, a few bytes each way (4 B request, 16 B answer, 9 + 8 B of headers),
    that the client really sends every time (ggml-rpc answers get_type, name, alignment and
    max_size from its own cache, and get_alloc_size too for all but a few tensors). A buffer on
    the server is held meanwhile, so the connection stays open as in real use. With the peer,
    apir's device_get_memory (the same question, ggml_backend_dev_memory on the host's device)
    is measured too, like for like.
All are measured in the same run, so the ratios hold on this machine at this moment. Each p50 is
printed with its ratio to the ping-pong (targets of issue 15: socket host <= 2, embedded <= 1.2)
and, when the peer runs, to ggml-rpc's (target <= 1: apir no slower than ggml-rpc). With the peer
the whole run loads the ggml build that has ggml-rpc's client (benchmarks/rpc_peer.py); without
that build the peer is skipped with a note on how to build it.

    python benchmarks/bench_roundtrip.py [--calls N] [--warmup N] [--no-rpc-peer] [--json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from apir.guest.client import ApirClient
from apir.local.embedded import EmbeddedDevice
from apir.guest.local import LocalDevice

import rpc_peer

# Targets of issue 15: p50 over the bare socket ping-pong, and over ggml-rpc's small call.
PING_PONG_TARGET = {"socket": 2.0, "embedded": 1.2}
RPC_TARGET = 1.0

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


def bench_socket(tmp: str, calls: int, warmup: int, names=("device_get_type",)) -> tuple[list, list]:
    """[(p50, p99) us] of each ApirClient call in `names`, in turn, over one `apir host serve`:
    with the exec ring (the default), then with every EXECBUFFER a socket message."""
    path = os.path.join(tmp, "apir.sock")
    proc = subprocess.Popen([sys.executable, "-m", "apir.cli", "host", "serve", "--socket", path],
                            stderr=subprocess.DEVNULL)
    try:
        _wait_for_socket(path, proc)
        results = []
        for exec_ring in (True, False):
            with ApirClient.connect(LocalDevice(path, exec_ring=exec_ring)) as client:
                results.append([time_calls(getattr(client, name), calls, warmup) for name in names])
        return results[0], results[1]
    finally:
        proc.terminate()
        proc.wait(10)


def bench_embedded(calls: int, warmup: int, exec_wait_s: float, names=("device_get_type",)) -> list:
    """[(p50, p99) us] of each ApirClient call in `names`, in turn, over one embedded host."""
    with ApirClient.connect(EmbeddedDevice(exec_wait_s=exec_wait_s)) as client:
        return [time_calls(getattr(client, name), calls, warmup) for name in names]


def bench_ggml_rpc(paths: dict, calls: int, warmup: int) -> tuple[float, float]:
    """p50 / p99 us of ggml_backend_dev_memory on ggml-rpc's device of an rpc-server on
    loopback (RPC_CMD_GET_DEVICE_MEMORY), with a 4 KiB buffer held on the server so the client's
    connection stays open (ggml-rpc reconnects when no buffer holds it)."""
    from apir.ggml import load
    from apir.ggml.backend_spec import resolve

    g = load()
    with rpc_peer.RpcServer(paths, threads=1) as server:
        dev = resolve(g, server.spec).devices[0]
        buf = g.ggml_backend_buft_alloc_buffer(g.ggml_backend_dev_buffer_type(dev), 4096)
        if not buf:
            raise RuntimeError("ggml-rpc: ggml_backend_buft_alloc_buffer failed")
        try:
            free, total = ctypes.c_size_t(), ctypes.c_size_t()
            p_free, p_total = ctypes.byref(free), ctypes.byref(total)
            result = time_calls(lambda: g.ggml_backend_dev_memory(dev, p_free, p_total), calls, warmup)
            if total.value == 0:
                raise RuntimeError("ggml-rpc: the server reported no memory (no answer?)")
            return result
        finally:
            g.ggml_backend_buffer_free(buf)  # before the server stops: ggml-rpc aborts on a dead server


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--no-rpc-peer", action="store_true", help="leave ggml-rpc out (and the ggml build it needs)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    paths, skipped = (None, "ggml-rpc peer left out (--no-rpc-peer)") if args.no_rpc_peer else rpc_peer.find_build()
    if paths is not None:
        skipped = rpc_peer.use_build(paths) or ""
        if skipped:
            paths = None
    from apir.ggml import load

    # With the peer, device_get_memory too: the very call ggml-rpc's row makes (like for like).
    names = ("device_get_type", "device_get_memory") if paths is not None else ("device_get_type",)
    n, w = args.calls, args.warmup
    with tempfile.TemporaryDirectory(prefix="apir-bench-") as tmp:
        rows = [("bare socket ping-pong (16 B)", None, bench_ping_pong(tmp, n, w))]
        ring, messages = bench_socket(tmp, n, w, names)
        for mode, label, results in (
            ("socket", "socket host", ring),
            ("socket", "socket, no ring", messages),
            ("embedded", "embedded default (inline)", bench_embedded(n, w, 1.0, names)),
            ("embedded", "embedded host thread (exec_wait_s=0)", bench_embedded(n, w, 0.0, names)),
        ):
            rows += [(f"{name}, {label}", mode, result) for name, result in zip(names, results)]
        if paths is not None:
            rows.append(("ggml-rpc get_device_memory, TCP", None, bench_ggml_rpc(paths, n, w)))
    base = rows[0][2][0]
    rpc = rows[-1][2][0] if paths is not None else None
    res = {"ggml_lib_dir": str(load().lib_dir), "calls": args.calls, "rpc_peer_skipped": skipped or None, "rows": []}
    for name, mode, (p50, p99) in rows:
        row = {"name": name, "p50_us": p50, "p99_us": p99, "p50_over_ping_pong": p50 / base}
        if mode:
            row["ping_pong_target"] = PING_PONG_TARGET[mode]
            if rpc is not None:
                row["p50_over_ggml_rpc"] = p50 / rpc
                row["ggml_rpc_target"] = RPC_TARGET
        res["rows"].append(row)
    if args.json:
        json.dump(res, sys.stdout, indent=1)
        print()
        return 0
    print(f"ggml: {res['ggml_lib_dir']}; {args.calls} calls after {args.warmup} warm-up")
    print(f"{'round trip':56} {'p50 us':>9} {'p99 us':>9} {'/ ping-pong':>12} {'target':>7} "
          f"{'/ ggml-rpc':>11} {'target':>7}")
    for row in res["rows"]:
        line = f"{row['name']:56} {row['p50_us']:9.1f} {row['p99_us']:9.1f} {row['p50_over_ping_pong']:12.2f}"
        if "ping_pong_target" in row:
            line += f" {'<= ' + str(row['ping_pong_target']):>7}"
        if "p50_over_ggml_rpc" in row:
            line += f" {row['p50_over_ggml_rpc']:11.2f} {'<= 1.0':>7}"
        print(line)
    if skipped:
        print(skipped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
