"""Buffer-type handlers (C `backend-dispatched-buffer-type.cpp`).

Every handler but is_host takes a u64 buffer type handle first; an id this context did not
hand out is refused (the C casts it to a pointer). Replies:
    get_name          string
    get_alignment     size_t
    get_max_size      size_t (SIZE_MAX when the type has no limit)
    is_host           bool, always false (deprecated; the C answers false and reads nothing)
    alloc_buffer      argument size_t size; reply u64 buffer handle, 0 when ggml could not
                      allocate, or when the size exceeds the type's max size, or the buffer
                      does not fit the context's budget, the host's memory limit or the
                      context's buffer count (apir.host.backend.budget). The buffer reads as zeros.
    get_alloc_size    argument: an inline tensor; reply size_t
"""

from __future__ import annotations


from apir.codec.wire import Decoder, Encoder
from apir.host.backend.seams import HandlerLibrary
from apir.host.errors import BACKEND_RC_OK, Refused, log
from apir.host.handles import HostBufferType
from apir.host.tensors import Scratch, decode_inline_tensor


__all__ = ["get_name", "get_alignment", "get_max_size", "is_host", "alloc_buffer", "get_alloc_size"]


def _buft(lib: HandlerLibrary, dec: Decoder, what: str) -> HostBufferType:
    handle = dec.handle()
    if dec.fatal:
        raise Refused(f"{what}: truncated arguments")
    return lib.buft(handle)


def get_name(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    buft = _buft(lib, dec, "buffer_type_get_name")
    enc.string(lib.g.ggml_backend_buft_name(buft.ptr))
    return BACKEND_RC_OK


def get_alignment(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    buft = _buft(lib, dec, "buffer_type_get_alignment")
    enc.size_t(lib.g.ggml_backend_buft_get_alignment(buft.ptr))
    return BACKEND_RC_OK


def get_max_size(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    buft = _buft(lib, dec, "buffer_type_get_max_size")
    enc.size_t(lib.g.ggml_backend_buft_get_max_size(buft.ptr))
    return BACKEND_RC_OK


def is_host(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    enc.bool(False)
    return BACKEND_RC_OK


def alloc_buffer(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    g = lib.g
    buft = _buft(lib, dec, "buffer_type_alloc_buffer")
    size = dec.size_t()
    if dec.fatal:
        raise Refused("buffer_type_alloc_buffer: truncated arguments")
    if not buft.allocatable:
        raise Refused("buffer_type_alloc_buffer: this buffer type only wraps guest memory")
    max_size = g.ggml_backend_buft_get_max_size(buft.ptr)
    if size > max_size:
        # The C replies a null buffer when ggml cannot allocate; so does apir, also for a
        # size no allocation of this buffer type could satisfy.
        log.warning(
            "ctx %d: buffer_type_alloc_buffer: %d bytes over the type's max size %d", lib.host.ctx_id, size, max_size
        )
        enc.handle(0)
        return BACKEND_RC_OK
    align = g.ggml_backend_buft_get_alignment(buft.ptr)
    enc.handle(lib.hold_buffer(size, align, lambda: g.ggml_backend_buft_alloc_buffer(buft.ptr, size)))
    return BACKEND_RC_OK


def get_alloc_size(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    buft = _buft(lib, dec, "buffer_type_get_alloc_size")
    chk = lib.checker
    with Scratch(lib.g, 2 + chk.limits.max_src) as scratch:
        t = decode_inline_tensor(chk, dec, scratch, "buffer_type_get_alloc_size")
        enc.size_t(lib.g.ggml_backend_buft_get_alloc_size(buft.ptr, t))
    return BACKEND_RC_OK
