"""Tensor uploads and downloads through APIR against memcpy, in one run (no assertions).

Theory of operation: for each transport (the embedded host; `apir host serve` over a Unix
socket) and each buffer kind, a buffer of --mib MiB is allocated through the APIR guest
backend (apir.guest.backend) and one tensor filling it is written with ggml_backend_tensor_set
and read back with ggml_backend_tensor_get, end to end (ggml's calls, the guest backend's
callbacks, the transport, the host's copies):

  copying    buffer_type_alloc_buffer: bytes travel through the client's windows in
             8 MiB chunks (Remote.transfer_chunk), one buffer_set_tensor / get_tensor each,
             and the host copies them between the window and its buffer: two copies per
             byte, overlapped (the guest copies chunk k+1 into the other window while the
             host takes chunk k; downloads the mirror image), so on two free cores the
             figure is bounded by two concurrent memcpys, not by two in a row (50%).
             Target: >= 45% of memcpy's throughput.
  zero-copy  device_buffer_from_ptr: the buffer is a shared blob mapped in the guest too;
             ggml's call is one memmove into the mapping. Target: >= 90% of memcpy.

The baseline is a memcpy (ctypes.memmove) of the same number of bytes between two NumPy
arrays, timed between the transfers so drift on a shared machine hits both alike. For
reference, a memcpy into a shared mapping (MAP_SHARED, as the blobs are) is printed too: NumPy's
large arrays get transparent huge pages (madvise), while shared memory gets them only when
/sys/kernel/mm/transparent_hugepage/shmem_enabled allows (on this machine: never), and 4 KiB
pages make a copy into a blob slower than the NumPy-to-NumPy memcpy. Every
figure is the best of --rounds, after one warm-up transfer (first-touch page faults on the
host side are not what is measured). The bytes read back are compared with those written.

Run: PYTHONPATH=. python benchmarks/bench_transfer.py [--mib N] [--rounds N] [--json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_roundtrip import _wait_for_socket  # noqa: E402

import apir.ggml  # noqa: E402
from apir.devices import open_client  # noqa: E402
from apir.ggml import InitParams  # noqa: E402
from apir.guest.backend import ApirBackend  # noqa: E402

TARGETS = {"copying": 0.45, "zero-copy": 0.90}


def _best(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(device, zero_copy: bool, size: int, rounds: int, src: np.ndarray, dst: np.ndarray, memcpy):
    """(set s, get s, memcpy s, identical) for one transport and buffer kind."""
    g = apir.ggml.load()
    client = open_client(device)
    try:
        backend = ApirBackend(client, g, zero_copy=zero_copy)
        ctx = g.ggml_init(InitParams(g.ggml_tensor_overhead() * 4, None, True))
        buf = 0
        try:
            t = g.ggml_new_tensor_1d(ctx, g.types["I8"], size)
            buf = g.ggml_backend_buft_alloc_buffer(backend.buffer_type, size)
            if not buf:
                raise MemoryError(f"no remote buffer of {size} bytes")
            assert g.ggml_backend_tensor_alloc(buf, t, g.ggml_backend_buffer_get_base(buf)) == 0
            put = lambda: g.ggml_backend_tensor_set(t, src.ctypes.data, 0, size)  # noqa: E731
            get = lambda: g.ggml_backend_tensor_get(t, dst.ctypes.data, 0, size)  # noqa: E731
            put()
            get()  # warm-up: the host's pages and the window faulted in
            best = {"set": float("inf"), "get": float("inf"), "memcpy": float("inf")}
            for _ in range(rounds):
                for name, fn in (("set", put), ("memcpy", memcpy), ("get", get), ("memcpy", memcpy)):
                    best[name] = min(best[name], _best(fn, 1))
            dst[:] = 0
            get()
            same = bool(np.array_equal(src, dst))
        finally:
            if buf:
                g.ggml_backend_buffer_free(buf)
            g.ggml_free(ctx)
            backend.close()
    finally:
        client.close()
    return best["set"], best["get"], best["memcpy"], same


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256, help="transfer size in MiB (default 256: > 24 MiB, chunked)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    size = args.mib << 20
    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros(size, np.uint8)
    scratch = np.zeros(size, np.uint8)

    def memcpy():
        ctypes.memmove(scratch.ctypes.data, src.ctypes.data, size)

    memcpy()
    shared = mmap.mmap(-1, size, mmap.MAP_SHARED)
    shared_addr = ctypes.addressof(ctypes.c_char.from_buffer(shared))

    def memcpy_shared():
        ctypes.memmove(shared_addr, src.ctypes.data, size)

    memcpy_shared()
    shm_s = min(_best(memcpy_shared, 1) for _ in range(args.rounds))
    rows = []
    with tempfile.TemporaryDirectory(prefix="apir-bench-") as tmp:
        path = os.path.join(tmp, "apir.sock")
        proc = subprocess.Popen(
            [sys.executable, "-m", "apir.cli", "host", "serve", "--socket", path], stderr=subprocess.DEVNULL
        )
        try:
            _wait_for_socket(path, proc)
            for transport, device in (("embedded", None), ("socket", f"unix:{path}")):
                for kind in ("copying", "zero-copy"):
                    put, get, base, same = measure(device, kind == "zero-copy", size, args.rounds, src, dst, memcpy)
                    rows.append(
                        {
                            "transport": transport,
                            "kind": kind,
                            "set_GBps": size / put / 1e9,
                            "get_GBps": size / get / 1e9,
                            "memcpy_GBps": size / base / 1e9,
                            "set_of_memcpy": base / put,
                            "get_of_memcpy": base / get,
                            "target": TARGETS[kind],
                            "identical": same,
                        }
                    )
        finally:
            proc.terminate()
            proc.wait(10)
    shm_gbps = size / shm_s / 1e9
    if args.json:
        json.dump({"mib": args.mib, "memcpy_into_shared_GBps": shm_gbps, "rows": rows}, sys.stdout, indent=1)
        print()
        return 0
    print(f"tensor transfers of {args.mib} MiB, best of {args.rounds}, against memcpy of the same bytes")
    print(f"{'':22}{'set GB/s':>9}{'get GB/s':>9}{'memcpy':>8}{'set/memcpy':>11}{'get/memcpy':>11}  target")
    for r in rows:
        name = f"{r['transport']} {r['kind']}"
        flag = "" if r["identical"] else "  BYTES DIFFER"
        print(
            f"{name:22}{r['set_GBps']:9.2f}{r['get_GBps']:9.2f}{r['memcpy_GBps']:8.2f}"
            f"{r['set_of_memcpy'] * 100:10.0f}%{r['get_of_memcpy'] * 100:10.0f}%  >= {r['target'] * 100:.0f}%{flag}"
        )
    thp = "?"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            thp = f.read().strip()
    except OSError:
        pass
    print(f"(memcpy into a MAP_SHARED mapping: {shm_gbps:.2f} GB/s; shmem huge pages: {thp})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
