"""Round-trip time of a small APIR call (device_get_type) over each local mode.

Prints p50 / p99 in microseconds for:
  - bare socket ping-pong: 16-byte message and 16-byte answer between this process and a
    Python echo process over a Unix socket (the floor any socket transport pays), both pinned:
    on two vCPUs (the baseline of the ratios: a guest's vCPU and a host's device process are
    two) and on one (a wake-up without another vCPU's, often twice as fast),
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
All are open at once and measured in the same run, in interleaved rounds (each row's calls split
into --rounds rounds, each round starting with the next row), so the ratios hold on this machine at
this moment: measured one after the other, a row's p50 moved 11-21 us with the minute. Each
socket host is a process of its own (a server spins after a reply only while it has one
connection). Each p50 is printed with its ratio to the two-vCPU ping-pong (on a machine of one
CPU, the one-vCPU one; targets: socket host <= 2, embedded <= 1.2)
and, when the peer runs, to ggml-rpc's (target <= 1: apir no slower than ggml-rpc). With the peer
the whole run loads the ggml build that has ggml-rpc's client (benchmarks/rpc_peer.py); without
that build the peer is skipped with a note on how to build it.

    python benchmarks/bench_roundtrip.py [--calls N] [--warmup N] [--rounds N] [--no-rpc-peer] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

from apir.guest.client import ApirClient
from apir.local.embedded import EmbeddedDevice
from apir.guest.local import LocalDevice
from apir.local.spin_policy import SAMPLE_S

import rpc_peer

# Targets: p50 over the bare socket ping-pong, and over ggml-rpc's small call.
PING_PONG_TARGET = {"socket": 2.0, "embedded": 1.2}
SETTLE_S = 1.2 * SAMPLE_S
RPC_TARGET = 1.0

_ECHO = r"""
import os, socket, sys
os.sched_setaffinity(0, {int(sys.argv[2])})
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


def time_calls(fn, calls: int, samples: list) -> None:
    """Appends the time of each of `calls` calls of `fn`, in ns, to `samples`."""
    clock = time.perf_counter_ns
    append = samples.append
    for _ in range(calls):
        t0 = clock()
        fn()
        append(clock() - t0)


def interleaved(rows: list, calls: int, warmup: int, rounds: int) -> list:
    """[(p50, p99) us] of each (label, fn, cpus) of `rows`: `warmup` calls of each, then
    `rounds` rounds of calls // rounds calls of each, every round starting with the next row.
    A row with `cpus` runs its calls in a thread of its own pinned there (so that this thread,
    and the hosts' threads the scheduler placed beside it, stay where they are). All rows are
    open at once and measured in the same minutes, so drift on a shared machine (this VM's
    small calls took 11-21 us from one minute to the next) hits each alike and the ratios
    hold."""

    def run(k: int, n: int, samples: list) -> None:
        _, fn, cpus = rows[k]
        if cpus is None:
            time_calls(fn, n, samples)
            return

        def pinned():
            os.sched_setaffinity(0, cpus)  # (0: this thread)
            time_calls(fn, n, samples)

        thread = threading.Thread(target=pinned)
        thread.start()
        thread.join()

    for k in range(len(rows)):
        run(k, warmup, [])
    samples: list = [[] for _ in rows]
    per_round = max(1, calls // rounds)
    for r in range(rounds):
        for k in list(range(r % len(rows), len(rows))) + list(range(r % len(rows))):
            # Each round starts after a pause longer than the spin policy's sampling period
            # (apir.local.spin_policy): a sample taken while the row before ran (a ping-pong
            # pinned to one vCPU: three runnable threads on two cores) would keep a host from
            # spinning for up to SAMPLE_S, half a round, which no steady run of calls sees.
            time.sleep(SETTLE_S)
            run(k, per_round, samples[k])
    return [percentiles(s) for s in samples]


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


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def ping_pong(stack: contextlib.ExitStack, tmp: str, echo_cpu: int):
    """A 16-byte ping-pong with a Python echo process, which runs on CPU `echo_cpu`, over a
    Unix socket: the call."""
    path = os.path.join(tmp, f"echo-{echo_cpu}.sock")
    proc = subprocess.Popen([sys.executable, "-c", _ECHO, path, str(echo_cpu)], stdout=subprocess.PIPE)
    stack.callback(_kill, proc)
    proc.stdout.readline()
    sock = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
    sock.connect(path)
    msg = bytes(16)

    def ping():
        sock.sendall(msg)
        sock.recv(16)

    return ping


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(10)


def socket_client(stack: contextlib.ExitStack, tmp: str, exec_ring: bool) -> ApirClient:
    """An ApirClient over an `apir host serve` of its own (a server with one connection spins
    after each reply; with two it would not), with or without the exec ring."""
    path = os.path.join(tmp, f"apir-{int(exec_ring)}.sock")
    proc = subprocess.Popen([sys.executable, "-m", "apir.cli", "host", "serve", "--socket", path],
                            stderr=subprocess.DEVNULL)
    stack.callback(_stop, proc)
    _wait_for_socket(path, proc)
    return stack.enter_context(ApirClient.connect(LocalDevice(path, exec_ring=exec_ring)))


def ggml_rpc_call(stack: contextlib.ExitStack, paths: dict):
    """ggml_backend_dev_memory on ggml-rpc's device of an rpc-server on loopback
    (RPC_CMD_GET_DEVICE_MEMORY), with a 4 KiB buffer held on the server so the client's
    connection stays open (ggml-rpc reconnects when no buffer holds it): the call."""
    from apir.ggml import load
    from apir.ggml.backend_spec import resolve

    g = load()
    server = stack.enter_context(rpc_peer.RpcServer(paths, threads=1))
    dev = resolve(g, server.spec).devices[0]
    buf = g.ggml_backend_buft_alloc_buffer(g.ggml_backend_dev_buffer_type(dev), 4096)
    if not buf:
        raise RuntimeError("ggml-rpc: ggml_backend_buft_alloc_buffer failed")
    stack.callback(g.ggml_backend_buffer_free, buf)  # before the server stops: ggml-rpc aborts on a dead server
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    p_free, p_total = ctypes.byref(free), ctypes.byref(total)

    g.ggml_backend_dev_memory(dev, p_free, p_total)
    if total.value == 0:
        raise RuntimeError("ggml-rpc: the server reported no memory (no answer?)")
    return lambda: g.ggml_backend_dev_memory(dev, p_free, p_total)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=10, help="rounds the calls of each row are split into")
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
    with tempfile.TemporaryDirectory(prefix="apir-bench-") as tmp, contextlib.ExitStack() as stack:
        # The ping-pong's two processes pinned: on one vCPU it took 7.6-10.2 us here, on two
        # 17.4-20.3 (a wake-up on the other vCPU), and left to the scheduler 17-19 in most runs
        # and 7-11 in some. The baseline is the two-vCPU figure: the guest's vCPU and the host's
        # device process, and the scheduler's usual choice; the one-vCPU figure is shown beside.
        cpus = sorted(os.sched_getaffinity(0))
        here, there = cpus[0], cpus[-1]
        calls = []
        if there != here:
            calls.append(("bare socket ping-pong, two vCPUs (16 B)", None, ping_pong(stack, tmp, there), {here}))
        calls.append(("bare socket ping-pong, one vCPU (16 B)", None, ping_pong(stack, tmp, here), {here}))
        for mode, label, client in (
            ("socket", "socket host", socket_client(stack, tmp, exec_ring=True)),
            ("socket", "socket, no ring", socket_client(stack, tmp, exec_ring=False)),
            ("embedded", "embedded default (inline)",
             stack.enter_context(ApirClient.connect(EmbeddedDevice(exec_wait_s=1.0)))),
            ("embedded", "embedded host thread (exec_wait_s=0)",
             stack.enter_context(ApirClient.connect(EmbeddedDevice(exec_wait_s=0.0)))),
        ):
            calls += [(f"{name}, {label}", mode, getattr(client, name), None) for name in names]
        if paths is not None:
            calls.append(("ggml-rpc get_device_memory, TCP", None, ggml_rpc_call(stack, paths), None))
        results = interleaved([(label, fn, pin) for label, _, fn, pin in calls], args.calls, args.warmup,
                              args.rounds)
    rows = [(label, mode, result) for (label, mode, _, _), result in zip(calls, results)]
    base = rows[0][2][0]
    rpc = rows[-1][2][0] if paths is not None else None
    res = {"ggml_lib_dir": str(load().lib_dir), "calls": args.calls, "rounds": args.rounds,
           "rpc_peer_skipped": skipped or None, "rows": []}
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
    print(f"ggml: {res['ggml_lib_dir']}; {args.calls} calls of each after {args.warmup} warm-up, "
          f"in {args.rounds} interleaved rounds")
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
