"""Several guests racing on one host process: the multi-guest fuzzer.

The target is a `LocalServer` (socket host, real HostContexts) and two `VhostUserServer`s in
the fuzzer's child; an input is 2-4 guests, each an `ApirClient` over the socket host, over
an `EmbeddedDevice` (a HostContext of the same process), or over a VM's virtio-gpu driver on
one of the vhost-user devices (tests/vhost_user's fake QEMU and driver), each on a thread of
its own, started together and
running its own script with random pauses between calls: allocate, write, read, clear, free,
compute a graph, touch another guest's buffer handle, leave (closing, or dropping its
connection, at times in the middle of a compute).

Each guest writes only its own 8-byte tag, repeated, so its data is recognisable anywhere.
The oracle: every read of a guest's own live buffer gives what it wrote (or cleared); no read
of any kind (its own buffers, freshly allocated ones, another guest's handle) shows another
guest's tag; each graph's result equals numpy's on the same float32 inputs (z = (x + y) * x,
exact); a call on a guest's own live buffer is never refused; with APIR_FUZZ_GUEST_IDS=1, the
fresh guest of every check (the same calls each time) is given the same resource ids and
buffer handles each time, whatever the guests before it did. After every guest left, a fresh
guest is served and the host holds no context, blob or ggml buffer; no descriptor or thread is
left. Timing comes from the input too, but threads race: a reproducer replays the same calls
and pauses, not necessarily the same interleaving.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Dict, List

import numpy as np

from tests.fuzz.protokit import Outcome, Target, settle

SIZES = [4096, 8192, 65536, 1 << 20]
N_COMPUTE = [64, 1024, 1 << 16, 1 << 20]  # elements of x, y and z; the largest take a while


def _pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


VHOST_VMS = 2  # vhost-user sockets, one VM each at a time


class _VhostGuestDevice:
    """A VM's virtio-gpu driver on a fresh fake QEMU (tests/vhost_user): the guest's device.
    `drop` is QEMU going away at once (the VM killed)."""

    def __init__(self, path: str):
        from tests.vhost_user.frontend import FakeFrontend
        from tests.vhost_user.guest_driver import FrontendDriver

        self.fe = FakeFrontend.connect(path)
        self.driver = FrontendDriver(self.fe)
        self.closed = False

    def __getattr__(self, name):  # the VirtgpuDevice seam: the driver's
        return getattr(self.driver, name)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.driver.close()
        except (OSError, TimeoutError):
            pass
        finally:
            self.fe.close()

    def drop(self) -> None:
        self.closed = True
        self.fe.close()


def _script(rng, kind: str) -> List[dict]:
    ops: List[dict] = [{"op": "alloc", "size": _pick(rng, SIZES)}]
    for _ in range(int(rng.integers(2, 12))):
        r = rng.random()
        if r < 0.18:
            ops.append({"op": "alloc", "size": _pick(rng, SIZES)})
        elif r < 0.38:
            ops.append(
                {"op": "write", "buf": int(rng.integers(4)), "at": float(rng.random()), "len": float(rng.random())}
            )
        elif r < 0.55:
            ops.append(
                {"op": "read", "buf": int(rng.integers(4)), "at": float(rng.random()), "len": float(rng.random())}
            )
        elif r < 0.6:
            ops.append({"op": "clear", "buf": int(rng.integers(4)), "value": int(rng.integers(256))})
        elif r < 0.7:
            ops.append({"op": "free", "buf": int(rng.integers(4))})
        elif r < 0.85:
            ops.append({"op": "compute", "n": _pick(rng, N_COMPUTE), "data": int(rng.integers(1 << 31))})
        else:
            ops.append(
                {"op": "foreign", "what": _pick(rng, ["read", "read", "free", "clear"]), "buf": int(rng.integers(4))}
            )
        if rng.random() < 0.5:
            ops[-1]["pause"] = float(rng.choice([0.0, 0.001, 0.005, 0.02]))
    end = _pick(rng, ["close", "close", "drop", "drop-computing"])
    if kind != "socket" and end == "drop-computing":
        end = "drop"
    ops.append({"op": end, "delay": float(rng.choice([0.0, 0.002, 0.02, 0.1]))})
    return ops


class _Guest:
    """One guest's client, its buffers and what it expects in them."""

    def __init__(
        self,
        k: int,
        spec: dict,
        path: str,
        config: dict,
        g,
        shared: Dict[int, List[int]],
        out: Outcome,
        lock: threading.Lock,
    ):
        self.k, self.spec, self.g = k, spec, g
        self.tag = bytes.fromhex(spec["tag"])
        self.others = [bytes.fromhex(t) for t in spec["others"]]
        self.shared, self.out, self.lock = shared, out, lock
        self.buffers: List[dict] = []  # {"handle", "size", "model": bytearray, "known": bytearray}; None once freed
        self.names: set = set()  # every buffer handle this guest was given
        self.ids: List[tuple] = []  # every id the host gave it (resources, buffers), in order
        self.path, self.config = path, config
        self.dev = None
        self.client = None

    def fail(self, what: str) -> None:
        with self.lock:
            self.out.broken.append(f"{what} (guest {self.k}, {self.spec['kind']})")

    def connect(self) -> None:
        from apir.guest.client import ApirClient

        if self.spec["kind"] == "socket":
            from apir.guest.local import LocalDevice

            self.dev = LocalDevice(self.path, connect_timeout_s=30)
        elif self.spec["kind"] == "vhost":
            self.dev = _VhostGuestDevice(self.spec["vm_path"])
        else:
            from apir.local.embedded import EmbeddedDevice

            self.dev = EmbeddedDevice(config=self.config, host_spin_s=0)
        self.client = ApirClient.connect(self.dev, data_size=65536)
        self.buft = self.client.device_get_buffer_type()
        if self.spec["kind"] == "socket":
            self.ids += [("res", r) for r in sorted(self.dev.blobs)]

    # --- raw bytes of a buffer --------------------------------------------------------------
    def _rpc(self, handle: int, size: int):
        """A record of the whole buffer as F32 (`data` is an offset in the buffer)."""
        rec = np.zeros(1, dtype=self.client.rpc_dtype)[0]
        n = size // 4
        rec["type"] = self.g.types["F32"]
        rec["buffer"] = handle
        rec["ne"] = [n, 1, 1, 1]
        rec["nb"] = [4, 4 * n, 4 * n, 4 * n]
        rec["data"] = 0
        return rec

    def _foreign(self, data: bytes, what: str) -> None:
        for t in self.others:
            if t in data:
                self.fail(f"cross-guest {what} shows another guest's tag {t.hex()}")
                return

    def _range(self, b: dict, op: dict):
        at = int(op["at"] * b["size"]) & ~3
        n = max(4, int(op["len"] * (b["size"] - at)) & ~3)
        return at, min(n, b["size"] - at)

    def run_op(self, op: dict) -> bool:
        """Runs one call; False once the guest has left."""
        from apir.errors import ApirError

        c, kind = self.client, op["op"]
        live = [b for b in self.buffers if b is not None]
        try:
            if kind == "alloc":
                handle = c.buffer_type_alloc_buffer(self.buft, op["size"])
                if handle:
                    b = {"handle": handle, "size": op["size"]}
                    fresh = bytearray(min(op["size"], 65536))
                    c.buffer_get_tensor(handle, self._rpc(handle, op["size"]), 0, fresh)
                    self._foreign(bytes(fresh), "a fresh buffer")
                    b["model"], b["known"] = bytearray(op["size"]), bytearray(op["size"])
                    self.buffers.append(b)
                    self.names.add(handle)
                    self.ids.append(("buffer", handle))
                    with self.lock:
                        self.shared.setdefault(self.k, []).append(handle)
            elif kind in ("write", "read", "clear", "free") and live:
                b = live[op["buf"] % len(live)]
                rpc = self._rpc(b["handle"], b["size"])
                if kind == "write":
                    at, n = self._range(b, op)
                    data = (self.tag * (n // 8 + 2))[(at % 8) : (at % 8) + n]  # aligned as in the model
                    c.buffer_set_tensor(b["handle"], rpc, at, data)
                    b["model"][at : at + n], b["known"][at : at + n] = data, b"\1" * n
                elif kind == "read":
                    at, n = self._range(b, op)
                    got = bytearray(n)
                    c.buffer_get_tensor(b["handle"], rpc, at, got)
                    self._foreign(bytes(got), "a read of its own buffer")
                    known = np.frombuffer(b["known"], np.uint8)[at : at + n].astype(bool)
                    want = np.frombuffer(b["model"], np.uint8)[at : at + n]
                    bad = np.flatnonzero(known & (np.frombuffer(got, np.uint8) != want))
                    if bad.size:
                        self.fail(f"wrong-result read of its buffer: {bad.size} bytes differ, first at {at + bad[0]}")
                elif kind == "clear":
                    c.buffer_clear(b["handle"], op["value"])
                    b["model"][:] = bytes([op["value"]]) * b["size"]
                    b["known"][:] = b"\1" * b["size"]
                else:
                    c.buffer_free_buffer(b["handle"])
                    self.buffers[self.buffers.index(b)] = None
            elif kind == "compute":
                self.compute(op["n"], op["data"])
            elif kind == "foreign":
                self.foreign(op)
            elif kind in ("close", "drop", "drop-computing"):
                self.leave(kind, op["delay"])
                return False
        except ApirError as exc:
            if kind != "foreign":
                self.fail(f"refused {kind} on its own live state: {type(exc).__name__}: {exc}")
            return True
        if op.get("pause"):
            time.sleep(op["pause"])
        return True

    def foreign(self, op: dict) -> None:
        """A call on another guest's handle: refused, or about a buffer of this guest's own
        (names are per guest), never the other's data."""
        from apir.errors import ApirError

        with self.lock:
            theirs = [h for k, hs in self.shared.items() if k != self.k for h in hs]
        if not theirs:
            return
        handle = theirs[op["buf"] % len(theirs)]
        if handle in self.names:
            return  # a name of this guest's own too: the call would be about its own buffer
        c = self.client
        try:
            if op["what"] == "read":
                got = bytearray(4096)
                c.buffer_get_tensor(handle, self._rpc(handle, 4096), 0, got)
                self._foreign(bytes(got), "a read through another guest's handle")
            elif op["what"] == "free":
                c.buffer_free_buffer(handle)
            else:
                c.buffer_clear(handle, 0xA5)
                # (posted, under ASYNC: its refusal comes at the next synchronization point,
                # which must be this call's, not the next call on the guest's own state)
                c.synchronize()
        except ApirError:
            pass  # refused: as it should be

    def compute(self, n: int, seed: int) -> None:
        from apir.guest.errors import DeviceError
        from tests.host.hostkit import GgmlScratch, RemoteGraph

        g = self.g
        rng = np.random.default_rng(seed)
        x = rng.standard_normal(n).astype(np.float32)
        y = rng.standard_normal(n).astype(np.float32)
        scratch = GgmlScratch(g, 8)
        remote = None
        try:
            f32 = g.types["F32"]
            tx = g.ggml_new_tensor_1d(scratch.ctx, f32, n)
            ty = g.ggml_new_tensor_1d(scratch.ctx, f32, n)
            tz = g.ggml_mul(scratch.ctx, g.ggml_add(scratch.ctx, tx, ty), tx)
            graph = g.ggml_new_graph(scratch.ctx)
            g.ggml_build_forward_expand(graph, tz)
            remote = RemoteGraph(self, g, scratch.ctx, graph)
            c = self.client
            c.buffer_set_tensor(remote.handle, remote.rpc(tx), 0, x)
            c.buffer_set_tensor(remote.handle, remote.rpc(ty), 0, y)
            status = c.backend_graph_compute(remote.wire)
            if status != 0:
                self.fail(f"wrong-result graph of {n} elements: status {status}")
                return
            z = np.empty(n, np.float32)
            c.buffer_get_tensor(remote.handle, remote.rpc(tz), 0, z)
            want = (x + y) * x
            if not np.array_equal(z.view(np.uint32), want.view(np.uint32)):
                bad = int(np.flatnonzero(z.view(np.uint32) != want.view(np.uint32))[0])
                self.fail(f"wrong-result z[{bad}] = {z[bad]!r}, numpy {want[bad]!r} ({n} elements)")
            with self.lock:
                self.out.computed += 1
            c.buffer_free_buffer(remote.handle)
        except DeviceError:
            raise
        finally:
            if remote is not None:
                remote.close()
            scratch.close()

    def alloc(self, size: int) -> int:  # RemoteGraph's guest interface
        handle = self.client.buffer_type_alloc_buffer(self.buft, size)
        self.names.add(handle)
        if not handle:
            from apir.errors import ApirError

            raise ApirError(f"graph buffer of {size} bytes refused")
        return handle

    def leave(self, how: str, delay: float) -> None:
        from apir.errors import ApirError

        if how == "close":
            time.sleep(delay)
            self.client.close()
        elif how == "drop":
            time.sleep(delay)
            self._drop()
        else:  # drop while a graph computes: the host must cancel it and free everything
            timer = threading.Timer(delay, self._drop)
            timer.start()
            try:
                self.compute(1 << 20, 7)
            except ApirError:
                pass
            timer.join()
            self.client = None

    def _drop(self) -> None:
        dev = self.dev
        if self.spec["kind"] == "vhost":
            dev.drop()
            return
        if self.spec["kind"] == "socket":
            try:
                dev.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        dev.close()

    def run(self, barrier: threading.Barrier) -> None:
        from apir.errors import ApirError

        try:
            self.connect()
        except (ApirError, OSError, TimeoutError) as exc:
            self.fail(f"refused-connect {type(exc).__name__}: {exc}")
            return
        try:
            barrier.wait(30)
        except threading.BrokenBarrierError:
            pass
        try:
            for op in self.spec["ops"]:
                if not self.run_op(op):
                    return
            self.client.close()
        except (ApirError, TimeoutError) as exc:  # (the fake QEMU's waits raise TimeoutError)
            self.fail(f"lost {type(exc).__name__}: {exc}")
        finally:
            if self.dev is not None:
                try:
                    self.dev.close()
                except (ApirError, OSError, TimeoutError):
                    pass


class GuestsTarget(Target):
    name = "guests"

    def __init__(self, config: dict, workdir: str):
        import apir.ggml
        from apir.host.local.server import LocalServer

        self.g = apir.ggml.load()
        self.config = config
        # Names a guest is given must reveal nothing of other guests: the fresh guest of every
        # check, the same calls each time, must be given the same ids each time (opt-in: a host
        # that numbers resources per process fails it on every input).
        self.check_ids = os.environ.get("APIR_FUZZ_GUEST_IDS") == "1"
        self.ids_alone = None
        self.path = os.path.join(workdir, "host.sock")
        self.server = LocalServer(self.path, config=config).start()
        from apir.host.vhost_user import VhostUserServer

        self.vm_paths = [os.path.join(workdir, f"vgpu-{k}.sock") for k in range(VHOST_VMS)]
        self.vms = [VhostUserServer(p, config=config, shm_size=64 << 20).start() for p in self.vm_paths]

    def generate(self, rng):
        n = int(rng.choice([2, 2, 3, 4]))
        kinds = [_pick(rng, ["socket", "socket", "embedded", "vhost"]) for _ in range(n)]
        while kinds.count("vhost") > VHOST_VMS:
            kinds[kinds.index("vhost")] = "socket"
        tags = []
        while len(tags) < n:
            t = rng.bytes(8)
            if len(set(t)) >= 6 and t not in tags:  # distinctive: never all one byte, as a clear writes
                tags.append(t)
        vm = iter(range(VHOST_VMS))
        steps = [
            {
                "op": "guest",
                "kind": kinds[k],
                "vm": next(vm) if kinds[k] == "vhost" else None,
                "tag": tags[k].hex(),
                "others": [t.hex() for t in tags if t != tags[k]],
                "start": float(rng.choice([0.0, 0.0, 0.005, 0.05])),
                "ops": _script(rng, kinds[k]),
            }
            for k in range(n)
        ]
        return f"{n}-{'+'.join(sorted(set(kinds)))}", steps

    def run(self, steps):
        out, lock, shared = Outcome(), threading.Lock(), {}
        steps = [dict(s, vm_path=self.vm_paths[s["vm"]]) if s.get("vm") is not None else s for s in steps]
        guests = [_Guest(k, s, self.path, self.config, self.g, shared, out, lock) for k, s in enumerate(steps)]
        barrier = threading.Barrier(len(guests))
        threads = [threading.Thread(target=gu.run, args=(barrier,), name=f"fuzz-guest-{gu.k}") for gu in guests]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
            if t.is_alive():
                out.broken.append(f"guest-hang {t.name} still running after 120 s")
        return out

    def check(self):
        """A fresh guest computes correctly; then the host holds nothing."""
        out = Outcome()
        spec = {
            "kind": "socket",
            "tag": "0123456789abcdef",
            "others": [],
            "ops": [
                {"op": "alloc", "size": 8192},
                {"op": "write", "buf": 0, "at": 0.0, "len": 1.0},
                {"op": "read", "buf": 0, "at": 0.0, "len": 1.0},
                {"op": "compute", "n": 64, "data": 1},
                {"op": "close", "delay": 0.0},
            ],
        }
        guest = _Guest(0, spec, self.path, self.config, self.g, {}, out, threading.Lock())
        guest.run(threading.Barrier(1))
        failures = [f"not-serving {b}" for b in out.broken]
        alive = not out.broken and out.computed == 1
        if self.check_ids and alive:
            if self.ids_alone is None:
                self.ids_alone = guest.ids
            elif guest.ids != self.ids_alone:
                failures.append(f"id-leak a fresh guest was given {guest.ids}, not {self.ids_alone} as before")
        if not settle(lambda: self.server.stats().as_tuple() == (0, 0, 0, 0, 0) and not self.server._conns, 15):
            failures.append(f"held-after-leaving {self.server.stats()} with {len(self.server._conns)} connections")
        if not settle(lambda: all(vm.session is None for vm in self.vms), 15):
            failures.append("held-after-leaving a VM's vhost-user session did not end")
        return alive, failures

    def close(self):
        self.server.close()
        for vm in self.vms:
            vm.close()
