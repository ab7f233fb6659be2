"""The host's buffer_type_alloc_buffer: time per allocation by size, and as held buffers grow.

Theory of operation: drives one built-in HostContext directly (no transport) with Forward
commands, as a guest would: `by size` allocates and frees a buffer of each size many times
and prints the median wall time of the allocation command (what zeroing a fresh buffer
costs shows here); `by count` keeps allocating 4 KiB buffers without freeing and prints the
median time of the allocations made around each count (a cost that grows with the count
shows a scan over the held buffers). Sizes in bytes, times in microseconds.

Run: PYTHONPATH=. python benchmarks/bench_host_alloc.py [--repeat N] [--count N] [--json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import struct
import time

from apir.codec.constants import ApirBackendCommandType as Fn, ApirCommandType
from apir.host.component.context import HostContext

REPLY_RES = 1
SIZES = (0, 4096, 1 << 20, 16 << 20, 64 << 20, 256 << 20)


class Driver:
    def __init__(self, config: dict):
        self.ctx = HostContext(1, config)
        self.reply = mmap.mmap(-1, 16384)
        self.ctx.add_resource(REPLY_RES, self.reply)
        assert self.command(ApirCommandType.HANDSHAKE, 0, struct.pack("<II", 0, 2)) == 0xAB1E
        assert self.command(ApirCommandType.LOADLIBRARY, 0, b"") == 0
        self.buft = self.forward(Fn.DEVICE_GET_BUFFER_TYPE, b"")

    def command(self, cmd_type: int, flags: int, args: bytes) -> int:
        self.ctx.submit(struct.pack("<III", cmd_type, flags, REPLY_RES) + args)
        return struct.unpack_from("<I", self.reply, 0)[0] - 1

    def forward(self, fn: int, args: bytes) -> int:
        assert self.command(ApirCommandType.FORWARD, int(fn), args) == 4
        return struct.unpack_from("<Q", self.reply, 4)[0]

    def alloc(self, size: int) -> int:
        return self.forward(Fn.BUFFER_TYPE_ALLOC_BUFFER, struct.pack("<QQ", self.buft, size))

    def free(self, handle: int) -> None:
        self.forward(Fn.BUFFER_FREE_BUFFER, struct.pack("<Q", handle))


def by_size(d: Driver, repeat: int) -> dict:
    out = {}
    for size in SIZES:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            h = d.alloc(size)
            times.append(time.perf_counter() - t0)
            assert h, f"no buffer of {size} bytes"
            d.free(h)
        out[size] = statistics.median(times) * 1e6
    return out


def by_count(d: Driver, count: int, window: int = 50) -> dict:
    out, times, held = {}, [], []
    marks = sorted({0, count // 8, count // 4, count // 2, count - window})
    for i in range(count):
        t0 = time.perf_counter()
        h = d.alloc(4096)
        times.append(time.perf_counter() - t0)
        if not h:
            out["refused_at"] = i
            break
        held.append(h)
    for m in marks:
        if m + window <= len(times):
            out[m] = statistics.median(times[m:m + window]) * 1e6
    for h in held:
        d.free(h)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--count", type=int, default=4000)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    # a limit above what this benchmark holds: it measures speed, not the limits
    config = {"apir.host.buffer_budget": str(1 << 40), "apir.host.memory_limit": str(1 << 40),
              "apir.host.max_buffers": str(args.count + 1)}
    d = Driver(config)
    result = {"by_size_us": by_size(d, args.repeat), "by_count_us": by_count(d, args.count)}
    d.ctx.close()
    if args.json:
        print(json.dumps(result))
    else:
        for size, us in result["by_size_us"].items():
            print(f"alloc {size:>11} bytes: {us:10.1f} us")
        for n, us in result["by_count_us"].items():
            print(f"alloc with {n:>6} held: {us:10.1f} us" if n != "refused_at" else f"refused at {us}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
