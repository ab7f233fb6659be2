"""Buffer-type handlers (C `backend-dispatched-buffer-type.cpp`).

Arguments and replies are laid out as apir.codec.forward lists them. Every handler but
is_host reads the buffer type handle first; an id this context did not hand out is refused
(the C casts it to a pointer).
    get_max_size      SIZE_MAX when the type has no limit
    is_host           always false (deprecated; the C answers false and reads nothing)
    alloc_buffer      the buffer handle, 0 when ggml could not allocate, or when the size
                      exceeds the type's max size, or the buffer does not fit the context's
                      budget, the host's memory limit or the context's buffer count
                      (apir.host.backend.budget). The buffer reads as zeros.
    get_alloc_size    the bytes the inline tensor takes in a buffer of this type
"""

from __future__ import annotations


from apir.codec.constants import ApirBackendCommandType as F
from apir.codec.wire import Decoder, Encoder
from apir.host.backend.forward import args
from apir.host.backend.seams import HandlerLibrary
from apir.host.errors import BACKEND_RC_OK, Refused, log
from apir.host.handles import HostBufferType
from apir.host.tensors import Scratch, inline_twin


__all__ = ["get_name", "get_alignment", "get_max_size", "is_host", "alloc_buffer", "get_alloc_size"]


def _buft(lib: HandlerLibrary, dec: Decoder, function: F) -> HostBufferType:
    (handle,) = args(dec, function, lib.checker, lib.host)
    return lib.buft(handle)


def get_name(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    buft = _buft(lib, dec, F.BUFFER_TYPE_GET_NAME)
    lib.host.forward_replies["buffer_type_get_name"](enc, lib.g.ggml_backend_buft_name(buft.ptr))
    return BACKEND_RC_OK


def get_alignment(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    buft = _buft(lib, dec, F.BUFFER_TYPE_GET_ALIGNMENT)
    lib.host.forward_replies["buffer_type_get_alignment"](enc, lib.g.ggml_backend_buft_get_alignment(buft.ptr))
    return BACKEND_RC_OK


def get_max_size(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    buft = _buft(lib, dec, F.BUFFER_TYPE_GET_MAX_SIZE)
    lib.host.forward_replies["buffer_type_get_max_size"](enc, lib.g.ggml_backend_buft_get_max_size(buft.ptr))
    return BACKEND_RC_OK


def is_host(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    lib.host.forward_replies["buffer_type_is_host"](enc, False)
    return BACKEND_RC_OK


def alloc_buffer(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    g = lib.g
    handle, size = args(dec, F.BUFFER_TYPE_ALLOC_BUFFER, lib.checker, lib.host)
    buft = lib.buft(handle)
    if not buft.allocatable:
        raise Refused("buffer_type_alloc_buffer: this buffer type only wraps guest memory")
    max_size = g.ggml_backend_buft_get_max_size(buft.ptr)
    if size > max_size:
        # The C replies a null buffer when ggml cannot allocate; so does apir, also for a
        # size no allocation of this buffer type could satisfy.
        log.warning(
            "ctx %d: buffer_type_alloc_buffer: %d bytes over the type's max size %d", lib.host.ctx_id, size, max_size
        )
        lib.host.forward_replies["buffer_type_alloc_buffer"](enc, 0)
        return BACKEND_RC_OK
    align = g.ggml_backend_buft_get_alignment(buft.ptr)
    buffer = lib.hold_buffer(size, align, lambda: g.ggml_backend_buft_alloc_buffer(buft.ptr, size))
    lib.host.forward_replies["buffer_type_alloc_buffer"](enc, buffer)
    return BACKEND_RC_OK


def get_alloc_size(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    chk = lib.checker
    handle, op = args(dec, F.BUFFER_TYPE_GET_ALLOC_SIZE, chk, lib.host)
    buft = lib.buft(handle)
    with Scratch(lib.g, 2 + chk.limits.max_src) as scratch:
        t = inline_twin(chk, op, scratch, "buffer_type_get_alloc_size")
        lib.host.forward_replies["buffer_type_get_alloc_size"](enc, lib.g.ggml_backend_buft_get_alloc_size(buft.ptr, t))
    return BACKEND_RC_OK
