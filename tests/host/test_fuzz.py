"""Random and mutated command streams: the host never crashes and always keeps serving.

Streams mix valid commands of every kind (templates built like a guest builds them, with this
context's handles) with byte mutations, truncations and extensions of them, and pure random
bytes. After every stream the host must still answer a valid command, and every command whose
header names the reply blob must have been answered.

Case counts: `APIR_FUZZ_EXAMPLES` streams of 1-6 commands by default (1,000; 5-16 s). The
`slow` test (`pytest -m slow tests/host/test_fuzz.py`; skipped otherwise) runs 10,000 streams
(about 35,000 commands; 170-280 s on the shared 2-core machine).
"""

import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from apir.codec.constants import ApirBackendCommandType as Cmd
from apir.codec.wire import Encoder
from apir.host import HostContext
from tests.host.hostkit import DATA_RES, REPLY_RES, Guest, GgmlScratch, RemoteGraph, inline_tensor

EXAMPLES = int(os.environ.get("APIR_FUZZ_EXAMPLES", "1000"))
GRAPH_RES = 3  # the graph lives apart from DATA_RES, which get_tensor overwrites


class World:
    """One guest context, kept across examples, with templates of valid commands."""

    def __init__(self, ggml):
        self.g = ggml
        self.guest = Guest(HostContext(77, {"apir.host.buffer_budget": str(64 << 20)}), data_size=1 << 20)
        self.graph_mem = bytearray(8192)
        self.guest.ctx.add_resource(GRAPH_RES, self.graph_mem)
        self.refresh()

    def refresh(self):
        """(Re)creates the handles the templates use; the stream may have freed them."""
        g, guest = self.g, self.guest
        s = GgmlScratch(g, 16)  # only the bytes of its tensors outlive this call
        self.buft = guest.buffer_type()
        f32 = g.types["F32"]
        a = g.ggml_new_tensor_2d(s.ctx, f32, 8, 4)
        x = g.ggml_new_tensor_2d(s.ctx, f32, 8, 3)
        out = g.ggml_soft_max(s.ctx, g.ggml_add(s.ctx, g.ggml_mul_mat(s.ctx, a, x),
                                                g.ggml_new_tensor_2d(s.ctx, f32, 4, 3)))
        graph = g.ggml_new_graph(s.ctx)
        g.ggml_build_forward_expand(graph, out)
        remote = RemoteGraph(guest, g, s.ctx, graph)
        self.buf, self.graph_wire = remote.handle, remote.wire
        self.rpc_a, self.rpc_x = remote.rpc(a), remote.rpc(x)
        self.inline_mm = inline_tensor(g, g.ggml_mul_mat(s.ctx, a, x))
        remote.close()
        s.close()

    def templates(self):
        self.graph_mem[: len(self.graph_wire)] = self.graph_wire  # a stream may overwrite it
        b, t = self.buf, self.buft
        args = {
            Cmd.DEVICE_SUPPORTS_OP: lambda e: e.blob(self.inline_mm),
            Cmd.DEVICE_BUFFER_FROM_PTR: lambda e: (e.u32(DATA_RES), e.size_t(4096), e.size_t(4096)),
            Cmd.BUFFER_TYPE_GET_NAME: lambda e: e.handle(t),
            Cmd.BUFFER_TYPE_GET_ALIGNMENT: lambda e: e.handle(t),
            Cmd.BUFFER_TYPE_GET_MAX_SIZE: lambda e: e.handle(t),
            Cmd.BUFFER_TYPE_IS_HOST: lambda e: e.handle(t),
            Cmd.BUFFER_TYPE_ALLOC_BUFFER: lambda e: (e.handle(t), e.size_t(4096)),
            Cmd.BUFFER_TYPE_GET_ALLOC_SIZE: lambda e: (e.handle(t), e.blob(self.inline_mm)),
            Cmd.BUFFER_GET_BASE: lambda e: e.handle(b),
            Cmd.BUFFER_SET_TENSOR: lambda e: (e.handle(b), e.blob(self.rpc_a), e.u32(DATA_RES), e.size_t(0), e.size_t(128)),
            Cmd.BUFFER_GET_TENSOR: lambda e: (e.handle(b), e.blob(self.rpc_x), e.u32(DATA_RES), e.size_t(0), e.size_t(96)),
            Cmd.BUFFER_CPY_TENSOR: lambda e: (e.handle(b), e.blob(self.rpc_x), e.blob(self.rpc_a)),
            Cmd.BUFFER_CLEAR: lambda e: (e.handle(b), e.u8(3)),
            Cmd.BUFFER_FREE_BUFFER: lambda e: e.handle(b),
            Cmd.BACKEND_GRAPH_COMPUTE: lambda e: (e.u32(GRAPH_RES), e.size_t(len(self.graph_wire))),
        }
        out = []
        for cmd in Cmd:
            buf = bytearray(4096)
            enc = Encoder(buf)
            enc.u32(2)
            enc.u32(int(cmd))
            enc.u32(REPLY_RES)
            if cmd in args:
                args[cmd](enc)
            out.append(bytes(buf[: enc.written]))
        hs = struct.pack("<IIIII", 0, 0, REPLY_RES, 0, 2)
        return out + [hs, struct.pack("<III", 1, 0, REPLY_RES)]

    def alive(self) -> bool:
        rc, d = self.guest.forward(Cmd.DEVICE_GET_COUNT)
        return rc == 0 and d.i32() >= 1


@pytest.fixture(scope="module")
def world(ggml):
    w = World(ggml)
    yield w
    w.guest.close()


def _mutate(data: bytes, ops) -> bytes:
    out = bytearray(data)
    for kind, pos, value in ops:
        if kind == 0 and out:
            out[pos % len(out)] = value
        elif kind == 1:
            out = out[: pos % (len(out) + 1)]
        elif kind == 2:
            out += bytes([value]) * (pos % 64)
        elif kind == 3 and len(out) >= 8:  # a plausible 8-byte value: small, huge, or a handle
            p = (pos % (len(out) - 7)) & ~3
            out[p: p + 8] = struct.pack("<Q", [0, 1, value, 1 << 63, (1 << 64) - 1, 4096][value % 6])
    return bytes(out)


mutation = st.tuples(st.integers(0, 3), st.integers(0, 1 << 16), st.integers(0, 255))
command = st.one_of(
    st.tuples(st.just("template"), st.integers(0, 24), st.lists(mutation, max_size=4)),
    st.tuples(st.just("random"), st.binary(max_size=96), st.just(None)),
)


def _run(world, stream):
    templates = world.templates()
    guest = world.guest
    for kind, a, b in stream:
        if kind == "template":
            payload = _mutate(templates[a % len(templates)], b)
        else:
            payload = a
        rc = guest.raw(payload)
        if len(payload) >= 12 and struct.unpack_from("<I", payload, 8)[0] == REPLY_RES:
            assert rc is not None, "a command naming the reply blob got no reply"
    assert world.alive()
    if world.guest.ctx._library is None:  # a mutated LoadLibrary cannot unload: stays loaded
        raise AssertionError("backend library lost")
    if world.buf not in world.guest.ctx._library.buffers:
        world.refresh()


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(command, min_size=1, max_size=6))
def test_random_and_mutated_streams(world, stream):
    _run(world, stream)


@pytest.mark.slow
@settings(max_examples=10_000, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(command, min_size=1, max_size=6))
def test_random_and_mutated_streams_10k(world, stream):
    _run(world, stream)


def test_templates_are_valid(world):
    """The unmutated templates are accepted: the fuzz starts from real commands."""
    templates = world.templates()
    free_id = int(Cmd.BUFFER_FREE_BUFFER)
    for i, payload in enumerate(templates):
        if i == free_id:
            continue
        rc = world.guest.raw(payload)
        assert rc in (4, 0xAB1E, 2), (i, rc)  # Forward ok, HandShake magic, already loaded
