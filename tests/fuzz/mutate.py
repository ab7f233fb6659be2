"""Seeded mutations of accepted graphs, and of every other command a guest can send.

Theory of operation: `make_input(rng, seed, env)` turns one `numpy.random.Generator` and
one seed graph into the steps of one input, run on `env` as they are made (a command may
use a handle the previous one returned). The same generator state gives the same steps.

An input is one of:
    graph     the seed graph with 1-6 mutations (below), computed (BACKEND_GRAPH_COMPUTE);
              sometimes its graph size argument is off too
    commands  1-4 commands of the other kinds: set / get / cpy tensor (a mutated record,
              offsets and sizes near the tensor's and the blob's limits), buffer clear /
              free / get_base (handles: real, freed, of a buffer type, unknown), alloc_buffer
              (sizes 0 .. 2^64-1), buffer_from_ptr (blobs, sizes), supports_op and
              get_alloc_size (a mutated node as an inline tensor), the queries; a freed or
              new buffer is then used by the seed graph
    raw       a valid payload with its header or bytes mutated

Graph mutations (one record or the node list each; kinds recorded in the meta): ne (0, 1, +-1, x2,
2^31-1, 2^31, 2^32-1, ...), a zero dimension with a huge other one, an empty tensor (zero elements)
placed at its buffer's end, one dimension huge and another 0 on every tensor sharing it, a tensor
moved to end at its buffer's end (and the fence), nb (0, "negative" 2^32-x, halved, doubled, another
dimension's), a consistent reshape (ne changed and nb recomputed, also on every tensor sharing that
dimension), swapped dims, op_params slots (0, -1, INT32_MAX, INT32_MIN, ..., and float bits of NaN,
+-inf, +-3.4e38, denormals), type, op (any, custom ones included), src links (another tensor, none,
itself, an unknown id), data offset, view_src / view_offs, buffer handle, flags, an unterminated
name, the node list (dropped, duplicated, reversed, unknown ids), the input data (row ids and values
in the buffer image) and raw byte flips of the wire. An input that agrees USE_COUNTS (EXT_QUERY
after setup: `agrees_use_counts`) also has use counts in its records' padding (0, -1, 2^24,
2^31-1, INT32_MIN, ...), in every graph it sends.
"""

from __future__ import annotations

import math
import struct
from typing import List

import numpy as np

from apir.codec.constants import ApirBackendCommandType as Cmd, ApirCommandType, ApirExtension
from apir.host.tensors import CUSTOM_OPS
from tests.fuzz.corpus import Seed, join_wire, record_bytes
from tests.fuzz.inputs import DATA_RES, GRAPH_RES, REPLY_RES, Env, forward, payload

__all__ = ["Mutator", "agrees_use_counts"]

U32 = 1 << 32
U64 = 1 << 64
I32_MAX, I32_MIN = (1 << 31) - 1, -(1 << 31)
_FLOATS = [
    math.nan,
    math.inf,
    -math.inf,
    3.4e38,
    -3.4e38,
    1e-45,
    1e-38,
    0.0,
    -0.0,
    1.0,
    -1.0,
    65504.0,
    1e10,
    2.0**31,
    -(2.0**31),
    0.5,
    1e-10,
]
_INTS = [
    0,
    -1,
    1,
    2,
    3,
    4,
    8,
    16,
    I32_MAX,
    I32_MIN,
    I32_MAX - 1,
    I32_MIN + 1,
    1 << 16,
    1 << 24,
    -(1 << 16),
    1 << 30,
    -(1 << 30),
    255,
    256,
    65535,
]


# Use counts a record's padding says (USE_COUNTS): the host takes max(its own, min(this, 2^24)).
_COUNTS = [0, 1, 2, 3, -1, 1 << 24, (1 << 24) + 1, I32_MAX, I32_MIN]
USE_COUNTS = int(ApirExtension.USE_COUNTS)


def agrees_use_counts(index: int) -> bool:
    """Whether input `index` agrees USE_COUNTS before its commands: the odd ones, so that
    a campaign covers both, and the even ones are the inputs they were before the extension."""
    return index % 2 == 1


def _fbits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


_FLOAT_BITS = [_fbits(x) for x in _FLOATS]


def _i32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - U32 if v >= 1 << 31 else v


class Mutator:
    """Mutations for one ggml build (its types, op count and type sizes)."""

    def __init__(self, g):
        self.g = g
        self.types = sorted(g.type_names)
        self.type_size = {t: int(g.ggml_type_size(t)) for t in self.types}
        self.blck = {t: int(g.ggml_blck_size(t)) for t in self.types}
        self.op_count = g.op_count
        self.custom = [g.ops[n] for n in CUSTOM_OPS if n in g.ops]
        self.tensor_dtype = g.tensor_dtype
        self.max_src = g.limits.max_src
        self.graph_kinds = [
            (self.m_ne, 10),
            (self.m_zero_dim, 6),
            (self.m_empty, 8),
            (self.m_huge_empty, 4),
            (self.m_tail, 5),
            (self.m_nb, 8),
            (self.m_reshape, 10),
            (self.m_swap_dims, 4),
            (self.m_op_param, 14),
            (self.m_type, 5),
            (self.m_op, 5),
            (self.m_src, 6),
            (self.m_data, 5),
            (self.m_view, 3),
            (self.m_buffer, 3),
            (self.m_flags, 1),
            (self.m_name, 1),
            (self.m_nodes, 4),
            (self.m_image, 6),
        ]
        w = np.array([k[1] for k in self.graph_kinds], dtype=float)
        self.graph_p = w / w.sum()

    # --- helpers ---------------------------------------------------------------------------
    @staticmethod
    def _pick(rng, values):
        return values[int(rng.integers(len(values)))]

    def _tensor(self, rng, recs, nodes_only=False) -> int:
        n = len(recs)
        if nodes_only or rng.random() < 0.5:
            nodes = np.nonzero(recs["op"] != 0)[0]
            if len(nodes):
                return int(nodes[int(rng.integers(len(nodes)))])
        return int(rng.integers(n))

    def _ts(self, recs, t) -> int:
        return self.type_size.get(int(recs["type"][t]), 4)

    # --- graph record mutations: each changes recs (and ctx) in place, returns its kind ----
    def m_ne(self, rng, ctx, t):
        recs = ctx["recs"]
        d = int(rng.integers(4))
        cur = int(recs["ne"][t][d])
        v = self._pick(
            rng,
            [
                0,
                0,
                0,
                1,
                2,
                3,
                cur - 1,
                cur + 1,
                cur * 2,
                I32_MAX,
                1 << 31,
                U32 - 1,
                1 << 20,
                1 << 16,
                int(rng.integers(0, 65)),
            ],
        )
        recs["ne"][t][d] = v % U32
        return f"ne[{d}]={v % U32}"

    def m_zero_dim(self, rng, ctx, t):
        recs = ctx["recs"]
        d0, d1 = (int(x) for x in rng.choice(4, 2, replace=False))
        big = self._pick(rng, [1 << 20, I32_MAX, U32 - 1, 1 << 30, 1 << 16, 4096])
        recs["ne"][t][d0] = 0
        recs["ne"][t][d1] = big
        return f"ne[{d0}]=0,ne[{d1}]={big}"

    def m_empty(self, rng, ctx, t):
        """A tensor of zero elements (its extent 0 passes any bounds check), placed at the
        end of its buffer or kept, sometimes with huge other dimensions: what a kernel
        reads through its other dimensions or its readers' shapes then lies past the end."""
        recs = ctx["recs"]
        d = int(rng.integers(4))
        old = int(recs["ne"][t][d])
        targets = [t]
        if rng.random() < 0.3:
            targets = [int(i) for i in np.nonzero(recs["ne"][:, d] == old)[0]]
        for i in targets:
            recs["ne"][i][d] = 0
        kind = f"empty[{d}]x{len(targets)}"
        if rng.random() < 0.3:
            d1 = (d + 1 + int(rng.integers(3))) % 4
            recs["ne"][t][d1] = self._pick(rng, [1 << 20, I32_MAX, U32 - 1, 1 << 16, 4096])
            kind += f",ne[{d1}]={int(recs['ne'][t][d1])}"
        if rng.random() < 0.7:
            recs["data"][t] = ctx["buf_size"] - self._pick(rng, [0, 0, 0, 4, 32, 64])
            kind += ",at-end"
        return kind

    def m_huge_empty(self, rng, ctx, t):
        """One dimension made huge on every tensor that shares it (so the rules' shape
        arithmetic still agrees) and another made 0 on the same tensors (so their extents
        are 0 and pass the bounds checks): what ggml sizes from the huge one is then planned
        for tensors that hold nothing."""
        recs = ctx["recs"]
        d, z = (int(x) for x in rng.choice(4, 2, replace=False))
        old = int(recs["ne"][t][d])
        big = self._pick(rng, [1 << 20, 1 << 24, 1 << 30, I32_MAX, U32 - 1])
        targets = np.nonzero(recs["ne"][:, d] == old)[0]
        recs["ne"][targets, d] = big
        recs["ne"][targets, z] = 0
        for i in targets:
            self._contiguous(recs, int(i))
        return f"huge[{d}]={big},zero[{z}]x{len(targets)}"

    def _extent(self, recs, t) -> int:
        ty = int(recs["type"][t])
        ts, bl = self.type_size.get(ty, 4), self.blck.get(ty, 1)
        ne = [int(x) for x in recs["ne"][t]]
        nb = [int(x) for x in recs["nb"][t]]
        if min(ne) == 0:
            return 0
        return (ne[0] // max(bl, 1) - 1) * nb[0] + ts + sum((ne[k] - 1) * nb[k] for k in range(1, 4))

    def m_tail(self, rng, ctx, t):
        """A tensor moved to end exactly at its buffer's end (and the fence): a kernel that
        reads past its extent faults."""
        recs = ctx["recs"]
        end = ctx["buf_size"] - self._extent(recs, t)
        if end < 0:
            return "tail-none"
        recs["data"][t] = end // 4 * 4 if rng.random() < 0.8 else end
        return "tail"

    def m_nb(self, rng, ctx, t):
        recs = ctx["recs"]
        d = int(rng.integers(4))
        cur = int(recs["nb"][t][d])
        ts = self._ts(recs, t)
        v = self._pick(
            rng,
            [
                0,
                U32 - ts,
                U32 - max(cur, 1),
                cur * 2,
                cur // 2,
                1,
                ts,
                I32_MAX,
                U32 - 1,
                int(recs["nb"][t][int(rng.integers(4))]),
                cur + ts,
            ],
        )
        recs["nb"][t][d] = v % U32
        return f"nb[{d}]={v % U32}"

    def _contiguous(self, recs, t) -> None:
        ty = int(recs["type"][t])
        ts, bl = self.type_size.get(ty, 4), self.blck.get(ty, 1)
        ne = [int(x) for x in recs["ne"][t]]
        nb = [ts, ts * (ne[0] // max(bl, 1))]
        nb += [nb[1] * ne[1], nb[1] * ne[1] * ne[2]]
        recs["nb"][t] = [x % U32 for x in nb]

    def m_reshape(self, rng, ctx, t):
        recs = ctx["recs"]
        d = int(rng.integers(4))
        old = int(recs["ne"][t][d])
        new = self._pick(rng, [0, 1, old + 1, max(old - 1, 0), old * 2, int(rng.integers(1, 65)), old + 32])
        targets = [t]
        if rng.random() < 0.6:
            targets = [int(i) for i in np.nonzero(recs["ne"][:, d] == old)[0]]
        for i in targets:
            recs["ne"][i][d] = new % U32
            if d == 0 and self.blck.get(int(recs["type"][i]), 1) > 1:
                recs["ne"][i][d] = (new // 32 * 32) % U32
            self._contiguous(recs, i)
        return f"reshape[{d}]{old}->{new}x{len(targets)}"

    def m_swap_dims(self, rng, ctx, t):
        recs = ctx["recs"]
        a, b = (int(x) for x in rng.choice(4, 2, replace=False))
        for f in ("ne", "nb"):
            row = recs[f][t].copy()
            row[a], row[b] = row[b], row[a]
            recs[f][t] = row
        return f"swap{a}{b}"

    def m_op_param(self, rng, ctx, t):
        recs = ctx["recs"]
        n = recs["op_params"].shape[1]
        k = int(rng.integers(8)) if rng.random() < 0.8 else int(rng.integers(n))
        cur = int(recs["op_params"][t][k])
        r = rng.random()
        if r < 0.45:
            v = self._pick(rng, _INTS)
        elif r < 0.75:
            v = self._pick(rng, _FLOAT_BITS)
        elif r < 0.95:
            v = self._pick(rng, [cur + 1, cur - 1, cur * 2, -cur, cur + 1000, cur * 1000])
        else:
            v = int(rng.integers(0, U32))
        recs["op_params"][t][k] = _i32(v)
        return f"op_params[{k}]={_i32(v)}"

    def m_type(self, rng, ctx, t):
        recs = ctx["recs"]
        v = self._pick(rng, self.types) if rng.random() < 0.9 else self._pick(rng, [self.g.type_count, 4, U32 - 1])
        recs["type"][t] = v
        return f"type={v}"

    def m_op(self, rng, ctx, t):
        recs = ctx["recs"]
        t = self._tensor(rng, recs, nodes_only=True)
        v = int(rng.integers(self.op_count)) if rng.random() < 0.95 or not self.custom else self._pick(rng, self.custom)
        recs["op"][t] = v
        return f"op={self.g.op_names.get(v, v)}"

    def m_src(self, rng, ctx, t):
        recs = ctx["recs"]
        t = self._tensor(rng, recs, nodes_only=True)
        srcs = recs["src"][t]
        present = int(np.count_nonzero(srcs))
        j = int(rng.integers(min(present + 1, self.max_src)))
        ids = recs["id"]
        v = self._pick(
            rng,
            [int(ids[int(rng.integers(len(ids)))]), 0, int(ids[t]), 0xDEADBEEF, int(ids[int(rng.integers(len(ids)))])],
        )
        recs["src"][t][j] = v
        return f"src[{j}]"

    def m_data(self, rng, ctx, t):
        recs = ctx["recs"]
        cur = int(recs["data"][t])
        ts = self._ts(recs, t)
        size = ctx["buf_size"]
        v = self._pick(
            rng,
            [
                cur + ts,
                cur - ts,
                0,
                size - 1,
                size,
                size - ts,
                1 << 40,
                U64 - 1,
                cur + 1,
                cur + 4096,
                int(rng.integers(0, max(size, 1))),
            ],
        )
        recs["data"][t] = v % U64
        return "data"

    def m_view(self, rng, ctx, t):
        recs = ctx["recs"]
        ids = recs["id"]
        if rng.random() < 0.5:
            recs["view_src"][t] = self._pick(rng, [0, int(ids[int(rng.integers(len(ids)))])])
        recs["view_offs"][t] = (
            self._pick(rng, [0, 4, 64, ctx["buf_size"], U64 - 4, int(recs["view_offs"][t]) + 4]) % U64
        )
        return "view"

    def m_buffer(self, rng, ctx, t):
        recs = ctx["recs"]
        v = self._pick(rng, [0] + ctx["other_handles"] + [ctx["buft"], 0xFFFF, ctx["handle"] + 100])
        recs["buffer"][t] = v
        return "buffer"

    def m_flags(self, rng, ctx, t):
        ctx["recs"]["flags"][t] = _i32(int(rng.integers(0, U32)))
        return "flags"

    def m_name(self, rng, ctx, t):
        recs = ctx["recs"]
        recs["name"][t] = [b"A"] * recs["name"].shape[1]
        return "name"

    def m_nodes(self, rng, ctx, t):
        nodes = ctx["nodes"]
        ids = ctx["recs"]["id"]
        kind = int(rng.integers(6))
        if kind == 0 and len(nodes) > 1:
            nodes = np.delete(nodes, int(rng.integers(len(nodes))))
        elif kind == 1:
            nodes = np.append(nodes, nodes[int(rng.integers(len(nodes)))]) if len(nodes) else nodes
        elif kind == 2:
            nodes = nodes[::-1].copy()
        elif kind == 3:
            nodes = np.append(nodes, ids[int(rng.integers(len(ids)))])
        elif kind == 4:
            nodes = np.append(nodes, np.uint64(0x1234))
        else:
            nodes = nodes[:0]
        ctx["nodes"] = nodes.astype(np.uint64)
        return f"nodes{kind}"

    def m_image(self, rng, ctx, t):
        """Input data: values written over a source's first bytes in the buffer image."""
        recs, image = ctx["recs"], ctx["image"]
        off = int(recs["data"][t])
        n = int(rng.integers(1, 9))
        if off + 8 * n > len(image):
            return "image-none"
        vals = [self._pick(rng, [-1, I32_MAX, I32_MIN, 1 << 20, 7, 0, U32 - 1]) for _ in range(n)]
        if int(recs["type"][t]) == self.g.types.get("I64"):
            data = struct.pack(f"<{n}q", *vals)
        elif rng.random() < 0.5:
            data = struct.pack(f"<{n}i", *(_i32(v) for v in vals))
        else:
            data = struct.pack(f"<{n}f", *(self._pick(rng, _FLOATS) for _ in range(n)))
        image[off : off + len(data)] = data
        return "image"

    def m_counts(self, rng, ctx):
        """Use counts in the padding of one record, of the nodes' or of every record's
        (read only with USE_COUNTS agreed): hostile values, and sometimes any int32."""
        recs = ctx["recs"]
        r = rng.random()
        if r < 0.5:
            targets = [self._tensor(rng, recs)]
        elif r < 0.75:
            targets = [int(i) for i in np.nonzero(recs["op"] != self.g.ops["NONE"])[0]]
        else:
            targets = list(range(len(recs)))
        for t in targets:
            v = self._pick(rng, _COUNTS) if rng.random() < 0.9 else int(rng.integers(I32_MIN, I32_MAX + 1))
            recs["padding"][t] = np.frombuffer(struct.pack("<i", v), "S1")
        return f"counts x{len(targets)}"

    def mutate_graph(self, rng, ctx) -> List[str]:
        kinds = []
        n = 1 + min(int(rng.geometric(0.5)) - 1, 5)
        for _ in range(n):
            fn = self.graph_kinds[int(rng.choice(len(self.graph_kinds), p=self.graph_p))][0]
            kinds.append(fn(rng, ctx, self._tensor(rng, ctx["recs"])))
        return kinds

    # --- inline tensors (supports_op, get_alloc_size) --------------------------------------
    def inline(self, rng, recs, t, handle) -> bytes:
        """`apir_encode_ggml_tensor_inline` of record t and its sources, from the records."""
        dt = self.tensor_dtype
        index = {int(i): k for k, i in enumerate(recs["id"])}

        def struct_of(k) -> np.ndarray:
            s = np.zeros(1, dtype=dt)
            for f in ("type", "op", "op_params", "flags", "name"):
                s[f] = recs[f][k]
            s["ne"] = recs["ne"][k].astype(np.int64)
            s["nb"] = recs["nb"][k].astype(np.uint64)
            s["buffer"] = 0x1000 if int(recs["buffer"][k]) else 0
            s["data"] = (0x2000 + int(recs["data"][k])) % U64 if int(recs["buffer"][k]) else 0
            s["src"] = [0x3000 + i if int(x) else 0 for i, x in enumerate(recs["src"][k])]
            s["view_src"] = 0x4000 if int(recs["view_src"][k]) else 0
            s["view_offs"] = recs["view_offs"][k]
            if rng.random() < 0.2:  # 64-bit ne the records cannot carry
                d = int(rng.integers(4))
                s["ne"][0][d] = self._pick(rng, [-1, 1 << 62, -(1 << 63), 1 << 40, 1 << 32])
            return s

        head = struct_of(t)
        out = head.tobytes()
        if int(head["buffer"][0]):
            out += struct.pack("<Q", handle)
        if int(head["view_src"][0]):
            v = index.get(int(recs["view_src"][t]), t)
            out += struct_of(v).tobytes()
        for sid in recs["src"][t]:
            if not int(sid):
                break
            out += struct_of(index.get(int(sid), t)).tobytes()
        if rng.random() < 0.1:
            out = out[: int(rng.integers(len(out) + 1))]
        return out

    # --- inputs ---------------------------------------------------------------------------
    def make_input(self, rng, seed: Seed, env: Env, use_counts: bool = False) -> dict:
        """Runs one input on `env` (setup done here); returns its meta (kinds of mutation).
        `use_counts`: the input agrees USE_COUNTS first and its records' padding says use counts."""
        image = bytearray(seed.image)
        images = [image]
        second = rng.random() < 0.15
        if second:  # another buffer of this context, its bytes a marker
            images.append(bytes([0xA5]) * 4096)
        kind = self._pick(rng, ["graph"] * 13 + ["commands"] * 5 + ["raw"] * 2)
        recs = seed.recs.copy()
        ctx = {
            "recs": recs,
            "nodes": seed.nodes.copy(),
            "image": image,
            "buf_size": len(image),
            "handle": 0,
            "other_handles": [],
            "buft": env.buft,
        }
        kinds: List[str] = []
        # kept current: a crash may come at any step
        env.rec.meta.update(case=seed.name, kind=kind, mutations=kinds, use_counts=use_counts)
        if kind == "graph":
            # mutate before setup: the image mutation goes into what setup writes; handles
            # are filled in after
            pre = self.mutate_graph(rng, ctx)
            kinds += pre
        if use_counts:  # (every graph of the input uses these records)
            kinds.append(self.m_counts(rng, ctx))
        handles = env.alloc([bytes(i) for i in images])
        if use_counts and not env.agree(USE_COUNTS) & USE_COUNTS:
            raise RuntimeError("the host did not agree USE_COUNTS")
        ctx["handle"], ctx["other_handles"] = handles[0], handles[1:]
        recs = ctx["recs"]
        recs["buffer"][recs["buffer"] == seed.handle] = handles[0]
        if kind == "graph":
            # buffer mutations of the kinds above named handle 0 / placeholders: redo after setup
            if any(k == "buffer" for k in kinds):
                self.m_buffer(rng, ctx, self._tensor(rng, recs))
            self._compute(rng, ctx, env)
        elif kind == "commands":
            for _ in range(int(rng.integers(1, 5))):
                kinds.append(self._command(rng, ctx, env))
        else:
            kinds.append(self._raw(rng, ctx, env))
        return {"kind": kind, "mutations": kinds, "ops": sorted(set(seed.op_names))}

    def _compute(self, rng, ctx, env: Env, recs=None) -> None:
        wire = join_wire(ctx["nodes"], ctx["recs"] if recs is None else recs)
        if rng.random() < 0.03:
            wire = self._flip(rng, wire)
        env.write(GRAPH_RES, wire)
        size = len(wire)
        if rng.random() < 0.05:
            size = self._pick(rng, [0, size - 1, size + 8, 1 << 63, size - 300])
        env.submit(forward(Cmd.BACKEND_GRAPH_COMPUTE, struct.pack("<IQ", GRAPH_RES, size % U64)))

    @staticmethod
    def _flip(rng, data: bytes) -> bytes:
        out = bytearray(data)
        for _ in range(int(rng.integers(1, 5))):
            if out:
                out[int(rng.integers(len(out)))] = int(rng.integers(256))
        return bytes(out)

    def _handle(self, rng, ctx) -> int:
        return self._pick(
            rng, [ctx["handle"]] * 6 + ctx["other_handles"] + [ctx["buft"], 0, ctx["handle"] + 50, U64 - 1]
        )

    def _rec(self, rng, ctx) -> np.ndarray:
        """One tensor record of the seed, maybe mutated (a one-record ctx)."""
        recs = ctx["recs"]
        t = int(rng.integers(len(recs)))
        one = {
            "recs": recs[t : t + 1].copy(),
            "nodes": ctx["nodes"],
            "image": bytearray(),
            "buf_size": ctx["buf_size"],
            "handle": ctx["handle"],
            "other_handles": ctx["other_handles"],
            "buft": ctx["buft"],
        }
        if rng.random() < 0.7:
            fn = self._pick(
                rng,
                [
                    self.m_ne,
                    self.m_nb,
                    self.m_data,
                    self.m_type,
                    self.m_buffer,
                    self.m_zero_dim,
                    self.m_swap_dims,
                    self.m_reshape,
                    self.m_op,
                ],
            )
            fn(rng, one, 0)
        return one["recs"]

    def _nbytes(self, rec) -> int:
        ty = int(rec["type"][0])
        ts, bl = self.type_size.get(ty, 4), self.blck.get(ty, 1)
        return int(rec["ne"][0][0]) // max(bl, 1) * ts * int(np.prod(rec["ne"][0][1:].astype(np.float64)))

    def _command(self, rng, ctx, env: Env) -> str:
        which = int(rng.integers(12))
        h = self._handle(rng, ctx)
        if which in (0, 1):  # set / get tensor
            rec = self._rec(rng, ctx)
            n = self._nbytes(rec)
            res = self._pick(rng, [DATA_RES] * 6 + [GRAPH_RES, REPLY_RES, 77])
            off = self._pick(rng, [0, 0, 1, n, max(n - 4, 0), U64 - 4, 1 << 63, 4096])
            size = self._pick(
                rng, [n, n, n + 1, 1, 0, 256 << 10, (256 << 10) + 1, U64 - 1, max(n - off, 0) if off < U64 // 2 else 1]
            )
            if which == 0:
                env.write(DATA_RES, rng.integers(0, 256, 256, dtype=np.uint8).tobytes())
            cmd = Cmd.BUFFER_SET_TENSOR if which == 0 else Cmd.BUFFER_GET_TENSOR
            env.submit(
                forward(cmd, struct.pack("<Q", h) + record_bytes(rec) + struct.pack("<IQQ", res, off % U64, size % U64))
            )
            return cmd.name
        if which == 2:  # cpy_tensor
            env.submit(
                forward(
                    Cmd.BUFFER_CPY_TENSOR,
                    struct.pack("<Q", h) + record_bytes(self._rec(rng, ctx)) + record_bytes(self._rec(rng, ctx)),
                )
            )
            return "BUFFER_CPY_TENSOR"
        if which == 3:
            env.submit(forward(Cmd.BUFFER_CLEAR, struct.pack("<QI", h, int(rng.integers(256)))))
            return "BUFFER_CLEAR"
        if which == 4:  # free, then use
            env.submit(forward(Cmd.BUFFER_FREE_BUFFER, struct.pack("<Q", h)))
            if rng.random() < 0.7:
                self._compute(rng, ctx, env)
            return "BUFFER_FREE_BUFFER+use"
        if which == 5:  # alloc, then maybe put the graph in it
            buft = self._pick(rng, [ctx["buft"]] * 4 + [ctx["handle"], 0, U64 - 1, ctx["buft"] + 1])
            size = self._pick(
                rng,
                [
                    0,
                    1,
                    31,
                    4096,
                    ctx["buf_size"],
                    ctx["buf_size"] - 1,
                    1 << 30,
                    1 << 40,
                    1 << 63,
                    U64 - 1,
                    (1 << 20) + 3,
                ],
            )
            rc, reply = env.submit(forward(Cmd.BUFFER_TYPE_ALLOC_BUFFER, struct.pack("<QQ", buft, size % U64)))
            new = struct.unpack_from("<Q", reply, 0)[0] if rc == 4 else 0
            if new and rng.random() < 0.7:
                recs = ctx["recs"].copy()
                recs["buffer"][recs["buffer"] == ctx["handle"]] = new
                self._compute(rng, ctx, env, recs)
            return f"BUFFER_TYPE_ALLOC_BUFFER({size % U64})"
        if which == 6:  # buffer_from_ptr over a blob, then the graph in it
            res = self._pick(rng, [DATA_RES] * 4 + [GRAPH_RES, REPLY_RES, 99])
            size = self._pick(rng, [ctx["buf_size"], 256 << 10, (256 << 10) + 1, 0, 1, U64 - 1, 4096])
            mts = self._pick(rng, [size, 0, U64 - 1, 64])
            rc, reply = env.submit(forward(Cmd.DEVICE_BUFFER_FROM_PTR, struct.pack("<IQQ", res, size % U64, mts % U64)))
            new = struct.unpack_from("<Q", reply, 0)[0] if rc == 4 else 0
            if new and rng.random() < 0.8:
                env.write(DATA_RES, bytes(ctx["image"]))
                recs = ctx["recs"].copy()
                recs["buffer"][recs["buffer"] == ctx["handle"]] = new
                self._compute(rng, ctx, env, recs)
            return "DEVICE_BUFFER_FROM_PTR"
        if which in (7, 8):  # an inline node
            recs = ctx["recs"].copy()
            one = {**ctx, "recs": recs}
            self.mutate_graph(rng, one)
            t = self._tensor(rng, recs, nodes_only=True)
            raw = self.inline(rng, recs, t, h)
            if which == 7:
                env.submit(forward(Cmd.DEVICE_SUPPORTS_OP, raw))
                return "DEVICE_SUPPORTS_OP"
            env.submit(forward(Cmd.BUFFER_TYPE_GET_ALLOC_SIZE, struct.pack("<Q", ctx["buft"]) + raw))
            return "BUFFER_TYPE_GET_ALLOC_SIZE"
        if which == 9:
            cmd = self._pick(
                rng,
                [
                    Cmd.BUFFER_GET_BASE,
                    Cmd.BUFFER_TYPE_GET_NAME,
                    Cmd.BUFFER_TYPE_GET_ALIGNMENT,
                    Cmd.BUFFER_TYPE_GET_MAX_SIZE,
                    Cmd.BUFFER_TYPE_IS_HOST,
                ],
            )
            env.submit(forward(cmd, struct.pack("<Q", self._pick(rng, [h, ctx["buft"]]))))
            return cmd.name
        if which == 10:
            cmd = self._pick(rng, list(Cmd))
            env.submit(forward(cmd))
            return f"{cmd.name}()"
        self._compute(rng, ctx, env)
        return "graph"

    def _raw(self, rng, ctx, env: Env) -> str:
        which = int(rng.integers(4))
        if which == 0:
            cmd = payload(
                int(rng.integers(0, 8)) if rng.random() < 0.5 else int(rng.integers(0, U32)),
                int(rng.integers(0, 40)),
                b"",
                self._pick(rng, [REPLY_RES] * 3 + [DATA_RES, 0, 9]),
            )
            body = rng.integers(0, 256, int(rng.integers(0, 64)), dtype=np.uint8).tobytes()
            env.submit(cmd + body)
            return "raw-header"
        if which == 1:
            env.submit(
                payload(int(ApirCommandType.HANDSHAKE), 0, struct.pack("<II", *(int(x) for x in rng.integers(0, 4, 2))))
            )
            return "handshake"
        if which == 2:
            cmd = forward(
                Cmd.BUFFER_SET_TENSOR,
                struct.pack("<Q", ctx["handle"]) + record_bytes(ctx["recs"][:1]) + struct.pack("<IQQ", DATA_RES, 0, 16),
            )
            env.submit(self._flip(rng, cmd)[: int(rng.integers(len(cmd) + 1))])
            return "raw-set"
        wire = join_wire(ctx["nodes"], ctx["recs"])
        env.write(GRAPH_RES, self._flip(rng, wire)[: int(rng.integers(len(wire) + 1))])
        env.submit(forward(Cmd.BACKEND_GRAPH_COMPUTE, struct.pack("<IQ", GRAPH_RES, len(wire))))
        return "raw-graph"
