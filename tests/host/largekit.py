"""What the large-graph tests (test_graph_build_large_hostile.py, test_rule_groups_hostile.py,
test_graph_cache_structure_hostile.py) share: a
guest graph of 2,200 tensors laid out for a hostkit Guest with ggml CPU's answer
(`LargeRemote`), a build's outcome comparable across builds and paths (`build_outcome`: the
refusal, or the host tensors it made), and the wire of a long chain of nodes (`chain_wire`)."""

from __future__ import annotations

import ctypes
import struct

import numpy as np

from apir.codec.constants import ApirBackendCommandType as Cmd
from apir.codec.graph import parse_graph
from apir.codec.records import rpc_tensor_dtype
from apir.host import HostContext
from apir.host.graph import build as hg
from apir.host.config import CONFIG_KEY_N_THREADS
from apir.host.tensors import Scratch
from tests.host.hostkit import DATA_RES, GgmlScratch, Guest, RemoteGraph, cpu_compute

__all__ = [
    "LAYERS",
    "layers_graph",
    "LargeRemote",
    "one_thread_guest",
    "parse",
    "graph_scratch",
    "block_tensors",
    "build_outcome",
    "chain_wire",
]

LAYERS = 540  # 4 tensors a layer (5 every 20th): 2,200 tensors


def layers_graph(g, ctx, layers: int = LAYERS, seed: int = 0):
    """h = tanh(W h + emb[ids_l]) for `layers` layers, ids_l a view of 3 rows of one I32 input
    (GET_ROWS: row ids the rules read, snapshots the kernel reads) every 20th layer, of a
    view of `emb` the others (so the layers share one rule group), W shared. Returns
    (graph, [(input, bytes)], output)."""
    f32, i32 = g.types["F32"], g.types["I32"]
    rng = np.random.default_rng(seed)
    w = g.ggml_new_tensor_2d(ctx, f32, 8, 8)
    x = g.ggml_new_tensor_2d(ctx, f32, 8, 3)
    emb = g.ggml_new_tensor_2d(ctx, f32, 8, 10)
    ids = g.ggml_new_tensor_1d(ctx, i32, 3 * layers)
    inputs = [w, x, emb, ids]
    for t in inputs:
        g.ggml_set_input(t)
    data = [
        (rng.standard_normal(64) * 0.3).astype(np.float32).tobytes(),
        rng.standard_normal(24).astype(np.float32).tobytes(),
        rng.standard_normal(80).astype(np.float32).tobytes(),
        rng.integers(0, 10, 3 * layers).astype(np.int32).tobytes(),
    ]
    h = x
    for layer in range(layers):
        if layer % 20 == 0:
            add = g.ggml_get_rows(ctx, emb, g.ggml_view_1d(ctx, ids, 3, 12 * layer))
        else:
            add = g.ggml_view_2d(ctx, emb, 8, 3, 32, 32 * (layer % 7))
        h = g.ggml_tanh(ctx, g.ggml_add(ctx, g.ggml_mul_mat(ctx, w, h), add))
    g.ggml_set_output(h)
    graph = g.ggml_new_graph_custom(ctx, 4096, False)
    g.ggml_build_forward_expand(graph, h)
    return graph, list(zip(inputs, data)), h


class LargeRemote:
    """A `layers_graph` graph laid out for `guest` (its inputs set in the host buffer), and ggml
    CPU's answer."""

    def __init__(self, guest: Guest, g, layers: int = LAYERS, seed: int = 0):
        self.g, self.guest, self.layers, self.seed = g, guest, layers, seed
        self.s = GgmlScratch(g, 6 * layers + 64)
        graph, inputs, self.y = layers_graph(g, self.s.ctx, layers, seed)
        self.ids = inputs[-1][0]
        self.expect = self.cpu()
        self.remote = RemoteGraph(guest, g, self.s.ctx, graph)
        for t, d in inputs:
            assert guest.set_tensor(self.remote.handle, self.remote.rpc(t), d) == 0
        self.wire = self.remote.wire

    def cpu(self, ids: bytes = None) -> bytes:
        """ggml CPU's answer (with the row ids `ids`, if given)."""
        g = self.g
        s = GgmlScratch(g, 6 * self.layers + 64)
        try:
            graph, inputs, y = layers_graph(g, s.ctx, self.layers, self.seed)
            if ids is not None:
                inputs[-1] = (inputs[-1][0], ids)
            return cpu_compute(g, s.ctx, graph, inputs, y, n_threads=1)
        finally:
            s.close()

    def set_ids(self, ids: bytes) -> None:
        """The guest writes new row ids into the host buffer."""
        assert self.guest.set_tensor(self.remote.handle, self.remote.rpc(self.ids), ids) == 0

    def compute(self, wire: bytes = None):
        """(rc, status or None, output bytes) of graph_compute of `wire` (default: the graph)."""
        wire = self.wire if wire is None else wire
        guest = self.guest
        guest.data[: len(wire)] = wire
        rc, dec = guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(wire))))
        status = dec.i32() if rc == 0 else None
        rc2, out = guest.get_tensor(self.remote.handle, self.remote.rpc(self.y), self.g.ggml_nbytes(self.y))
        assert rc2 == 0
        return rc, status, out

    def close(self):
        self.remote.close()
        self.s.close()


def parse(lib, wire):
    g = lib.g
    return parse_graph(wire, limits=g.limits, op_count=g.op_count, type_valid=lib.checker.valid_types)


def graph_scratch(lib, parsed) -> Scratch:
    return hg.graph_scratch(lib, parsed)


def block_tensors(lib, built) -> bytes:
    """hostilekit.host_tensors of a build, at once: the tensors read as one array (side by side
    in one block as write_tensors_kernel makes them, else gathered one by one), their src and
    view_src as indices, the data of row ids (a new copy each build) zeroed."""
    dtype, host = lib.checker.tensor_dtype, built.host
    copied = [info.index for info in built.infos.made() if info.snapshot is not None]
    n = len(host)
    if n == 0:
        return b""
    size = dtype.itemsize
    if (np.diff(host) == size).all():
        block = np.frombuffer((ctypes.c_char * (n * size)).from_address(int(host[0])), dtype).copy()
    else:  # (made one by one in a ggml_context)
        block = np.concatenate([np.frombuffer((ctypes.c_char * size).from_address(a), dtype) for a in host.tolist()])
    order = np.argsort(host)
    for name in ("src", "view_src"):
        p = block[name].astype(np.int64)
        at = order[np.clip(np.searchsorted(host[order], p), 0, n - 1)]
        block[name] = np.where(p != 0, at, -1).astype(np.uint64)
    block["data"][copied] = 0
    # (the fields only: a copy of a dtype with holes leaves the holes as they were, anything)
    fields = ("type", "ne", "nb", "op", "op_params", "flags", "name", "buffer", "data", "view_offs", "src", "view_src",
              "extra")
    return b"".join(block[f].tobytes() for f in fields)


def build_outcome(lib, parsed):
    """("built", host tensors) or (error type name, message) of build_graph_parts."""
    with graph_scratch(lib, parsed) as scratch:
        try:
            built = hg.build_graph_parts(lib, parsed, scratch, lib.op_enums)
        except Exception as exc:  # noqa: BLE001 - compared across builds
            return type(exc).__name__, str(exc)
        return "built", block_tensors(lib, built)


def one_thread_guest(ctx_id: int = 7) -> Guest:
    """A hostkit Guest (4 MiB of data blob: room for a large graph's wire) whose context
    computes on one thread: two contexts computing at once on a loaded machine of 2 cores
    would otherwise spin ggml's thread barriers for seconds."""
    ctx = HostContext(ctx_id)
    ctx.set_config(CONFIG_KEY_N_THREADS, "1")
    return Guest(ctx, data_size=4 << 20)


def chain_wire(g, n: int) -> bytes:
    """The bytes of a graph of `n` tensors with no data (records only: for what compares or
    groups them, not for a build), each the src of the next, every one but the first a node,
    tensor i named "t<i>" (its NUL at byte len("t<i>") of the name)."""
    rpc = rpc_tensor_dtype(g.limits)
    recs = np.zeros(n, rpc)
    recs["id"] = np.arange(1, n + 1) * 16
    recs["type"] = int(np.flatnonzero(g.valid_types)[0])
    recs["ne"], recs["nb"] = [1, 1, 1, 1], [4, 4, 4, 4]
    recs["src"][1:, 0] = recs["id"][:-1]
    names = recs["name"].view(np.uint8).reshape(n, -1)
    for i in range(n):
        name = f"t{i}".encode()
        names[i, : len(name)] = list(name)
    nodes = recs["id"][1:]
    return struct.pack("<I", len(nodes)) + nodes.astype("<u8").tobytes() + struct.pack("<I", n) + recs.tobytes()
