"""The seed graphs: every case of the host's shape-rule tests, laid out as a guest would.

Theory of operation: the op tests (tests/host/test_shapes_*.py) each list `Case`s, one small
graph per op family variant, built with ggml's own constructors (tests/host/shapekit.py).
`build_seeds` builds each through a throw-away host context: the graph's wire records, its
node list and the image of the one host buffer it lives in (inputs written). Only seeds
that this host computes unmutated are kept, so every mutation starts from an accepted graph.
A case this ggml build cannot construct (a missing constructor, a ggml >= 0.20 case on 0.10)
is skipped. Tensor ids are renumbered (`_canonical_ids`) so that seeds, and so inputs, are
the same bytes in every process.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import pickle
import struct
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from apir.codec.records import rpc_tensor_dtype

__all__ = ["Seed", "build_seeds", "load_or_build_seeds", "record_bytes", "CASE_MODULES", "split_wire", "join_wire"]

# The shape-rule test files whose CASES seed the corpus: tests/host/shapes/test_<rule module>.py.
CASE_MODULES = tuple(
    f"tests.host.shapes.test_{m}"
    for m in ("attention", "backward", "conv", "elementwise", "layout", "matrix", "rope", "tensor_ops")
)


@dataclass
class Seed:
    """One accepted graph: `nodes` (u64 ids), `recs` (apir_rpc_tensor records), the image
    of its host buffer, the buffer handle its records name, and its tensors' op names."""

    name: str
    nodes: np.ndarray
    recs: np.ndarray
    image: bytes
    handle: int
    op_names: Tuple[str, ...] = ()


def split_wire(wire: bytes, dtype: np.dtype) -> Tuple[np.ndarray, np.ndarray]:
    """(nodes, records) of a serialized graph (u32 n_nodes, u64 nodes[], u32 n, records)."""
    (n_nodes,) = struct.unpack_from("<I", wire, 0)
    nodes = np.frombuffer(wire, "<u8", n_nodes, 4).copy()
    recs = np.frombuffer(wire, dtype, offset=4 + 8 * n_nodes + 4).copy()
    return nodes, recs


def record_bytes(recs: np.ndarray) -> bytes:
    """The records' bytes with the holes between fields zero: numpy copies structured
    arrays field by field, so a copy's holes hold whatever the allocation held, and an
    input must be the same bytes in every process."""
    out = np.zeros(len(recs), dtype=recs.dtype)
    for name in recs.dtype.names:
        out[name] = recs[name]
    return out.tobytes()


def join_wire(nodes: np.ndarray, recs: np.ndarray) -> bytes:
    return (
        struct.pack("<I", len(nodes))
        + nodes.astype("<u8").tobytes()
        + struct.pack("<I", len(recs))
        + record_bytes(recs)
    )


def _canonical_ids(nodes: np.ndarray, recs: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Ids renumbered 0x1000, 0x1100, ... in record order: the guest's tensor addresses
    differ from process to process, and an input must be the same bytes in every one."""
    table = {int(i): 0x1000 + 0x100 * k for k, i in enumerate(recs["id"])}
    table[0] = 0

    def remap(a):
        return np.array([table.get(int(x), x) for x in a.reshape(-1)], dtype=np.uint64).reshape(a.shape)

    recs = recs.copy()
    for f in ("id", "src", "view_src"):
        recs[f] = remap(recs[f])
    return remap(nodes), recs


def load_or_build_seeds(g, guest_factory, cache: Optional[str]) -> Tuple[List[Seed], List[str]]:
    """`build_seeds`, kept in the file `cache` (a pickle this harness wrote) so that a
    replacement child process starts in a fraction of the time."""
    if cache and os.path.exists(cache):
        with open(cache, "rb") as fh:
            return pickle.load(fh)
    out = build_seeds(g, guest_factory)
    if cache:
        tmp = f"{cache}.{os.getpid()}.tmp"
        with open(tmp, "wb") as fh:
            pickle.dump(out, fh)
        os.replace(tmp, cache)
    return out


def _cases(g):
    """(name, case) of every module's cases this ggml build is meant to run."""
    from apir.host.graph.shapes import op_enums

    old = op_enums(g).version < (0, 20, 0)
    out = []
    for module in CASE_MODULES:
        mod = importlib.import_module(module)
        mod_name = module.rsplit(".", 1)[-1].removeprefix("test_")
        cases = list(mod.CASES)
        if not old:
            cases += [c for c in getattr(mod, "CASES_020", []) if c not in cases]
        for i, case in enumerate(cases):
            out.append((f"{mod_name}:{case.id if case.name else f'{case.op}-{i}'}", case))
    return out


def build_seeds(g, guest_factory) -> Tuple[List[Seed], List[str]]:
    """The seeds of this build, and the names of the cases skipped (and why).
    `guest_factory()` gives a fresh `tests.host.hostkit.Guest` (closed after each case)."""
    from tests.host.shapekit import Remote

    dtype = rpc_tensor_dtype(g.limits)
    seeds, skipped = [], []
    for name, case in _cases(g):
        guest = guest_factory()
        r = None
        try:
            try:
                r = Remote(guest, g, case)
            except BaseException as exc:  # noqa: BLE001 - pytest.skip raises a BaseException
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                skipped.append(f"{name}: cannot build ({type(exc).__name__}: {exc})")
                continue
            buf = guest.ctx._library.buffers.get(r.remote.handle)
            image = ctypes.string_at(buf.base, buf.size)
            rc, dec = r.compute()
            if rc != 0 or dec.i32() != 0:
                skipped.append(f"{name}: this host refuses it unmutated")
                continue
            nodes, recs = _canonical_ids(*split_wire(r.remote.wire, dtype))
            ops = tuple(g.op_names[int(op)] for op in recs["op"])
            seeds.append(Seed(name, nodes, recs, image, r.remote.handle, ops))
        finally:
            if r is not None:
                r.close()
            guest.close()
    return seeds, skipped
