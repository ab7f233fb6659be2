"""Buffer-type functions against ggml CPU's own answers."""

from apir.codec.constants import ApirBackendCommandType as Cmd
from tests.host.hostkit import GgmlScratch, inline_tensor


def _buft(ggml):
    return ggml.ggml_backend_dev_buffer_type(ggml.ggml_backend_dev_by_type(0))


def test_name_alignment_max_size_is_host(guest, ggml):
    h, buft = guest.buffer_type(), _buft(ggml)
    rc, d = guest.forward(Cmd.BUFFER_TYPE_GET_NAME, lambda e: e.handle(h))
    assert rc == 0 and d.string() == ggml.ggml_backend_buft_name(buft).decode()
    rc, d = guest.forward(Cmd.BUFFER_TYPE_GET_ALIGNMENT, lambda e: e.handle(h))
    assert rc == 0 and d.size_t() == ggml.ggml_backend_buft_get_alignment(buft)
    rc, d = guest.forward(Cmd.BUFFER_TYPE_GET_MAX_SIZE, lambda e: e.handle(h))
    assert rc == 0 and d.size_t() == ggml.ggml_backend_buft_get_max_size(buft)
    guest.reply[4:8] = b"\x07\x07\x07\x07"
    rc, d = guest.forward(Cmd.BUFFER_TYPE_IS_HOST, lambda e: e.handle(h))
    assert rc == 0 and d.u32() == 0  # deprecated: the C always answers false


def test_alloc_buffer_and_null_on_impossible_size(guest, ggml):
    h = guest.buffer_type()
    rc, d = guest.forward(Cmd.BUFFER_TYPE_ALLOC_BUFFER, lambda e: (e.handle(h), e.size_t(4096)))
    assert rc == 0
    buffer = d.handle()
    assert buffer and buffer != h
    rc, d = guest.forward(Cmd.BUFFER_TYPE_ALLOC_BUFFER, lambda e: (e.handle(h), e.size_t(1 << 62)))
    assert rc == 0 and d.handle() == 0


def test_get_alloc_size(guest, ggml):
    h = guest.buffer_type()
    s = GgmlScratch(ggml)
    for t in (ggml.ggml_new_tensor_2d(s.ctx, ggml.types["F32"], 33, 7),
              ggml.ggml_new_tensor_2d(s.ctx, ggml.types["Q4_0"], 64, 3),
              ggml.ggml_transpose(s.ctx, ggml.ggml_new_tensor_2d(s.ctx, ggml.types["F16"], 5, 9))):
        rc, d = guest.forward(Cmd.BUFFER_TYPE_GET_ALLOC_SIZE,
                              lambda e, t=t: (e.handle(h), e.blob(inline_tensor(ggml, t))))
        assert rc == 0 and d.size_t() == ggml.ggml_backend_buft_get_alloc_size(_buft(ggml), t)
    s.close()


def test_buffer_budget(ggml):
    from apir.host import HostContext
    from tests.host.hostkit import Guest

    g = Guest(HostContext(30, {"apir.host.buffer_budget": "10000"}))
    h = g.buffer_type()
    first = g.forward(Cmd.BUFFER_TYPE_ALLOC_BUFFER, lambda e: (e.handle(h), e.size_t(6000)))[1].handle()
    assert first
    assert g.forward(Cmd.BUFFER_TYPE_ALLOC_BUFFER, lambda e: (e.handle(h), e.size_t(6000)))[1].handle() == 0
    assert g.forward(Cmd.BUFFER_FREE_BUFFER, lambda e: e.handle(first))[0] == 0
    assert g.forward(Cmd.BUFFER_TYPE_ALLOC_BUFFER, lambda e: (e.handle(h), e.size_t(6000)))[1].handle()
    g.close()
