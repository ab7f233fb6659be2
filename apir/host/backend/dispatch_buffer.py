"""Buffer handlers (C `backend-dispatched-buffer.cpp`).

Arguments and replies are laid out as apir.codec.forward lists them. Every handler takes a
buffer handle first, checked against this context's table.
    get_base     the buffer's virtual base (aligned like the real one)
    set_tensor   bytes [0, size) of the resource go to the tensor at `offset`
    get_tensor   the tensor's bytes from `offset` go to [0, size) of the resource
    cpy_tensor   src into dst; replies whether the buffer could copy
    clear        every byte of the buffer set to `value`
    free_buffer  -
Checks beyond the C: the tensor lies in its buffer and that buffer is the one named;
`offset + size` lies in the tensor (what ggml_backend_tensor_set/get assert) and `size` in
the resource; cpy_tensor's destination has room for the source's bytes.
On a backend with `async_transfers`, a set_tensor that passed these checks into a device
buffer is deferred: its bytes are copied out of the resource before the reply, the device
copy is queued (apir.host.backend.transfers) and lands before the context's next other command.
"""

from __future__ import annotations

import ctypes

from typing import cast

from apir.codec.constants import ApirBackendCommandType as F, ApirExtensionCommandType as X
from apir.codec.wire import Decoder, Encoder
from apir.host.backend.forward import args
from apir.host.backend.seams import HandlerLibrary
from apir.host.errors import BACKEND_RC_OK, Refused


__all__ = ["get_base", "set_tensor", "set_tensor_at", "get_tensor", "cpy_tensor", "clear", "free_buffer"]


def get_base(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    (handle,) = args(dec, F.BUFFER_GET_BASE, lib.checker, lib.host)
    lib.host.forward_replies["buffer_get_base"](enc, lib.buffer(handle).virtual_base)
    return BACKEND_RC_OK


def _transfer(lib: HandlerLibrary, dec: Decoder, function: F, to_tensor: bool) -> None:
    handle, raw, res_id, offset, size = args(dec, function, lib.checker, lib.host)
    _transfer_at(lib, function.c_name, handle, raw, res_id, 0, offset, size, to_tensor)


def set_tensor_at(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    """buffer_set_tensor_at (the ASYNC extension): set_tensor from bytes [at, at + size) of
    the resource, so that posted sets can share one guest window."""
    function = cast(F, X.BUFFER_SET_TENSOR_AT)  # (the table and `args` take both kinds of id)
    handle, raw, res_id, at, offset, size = args(dec, function, lib.checker, lib.host)
    _transfer_at(lib, X.BUFFER_SET_TENSOR_AT.c_name, handle, raw, res_id, at, offset, size, True)
    return BACKEND_RC_OK


def _transfer_at(
    lib: HandlerLibrary, what: str, handle: int, raw, res_id: int, at: int, offset: int, size: int, to_tensor: bool
) -> None:
    g, chk = lib.g, lib.checker
    buf = lib.buffer(handle)
    rec = chk.rpc_tensor(raw)
    tbuf, extent = chk.check_rpc(rec, lib.buffers, what)
    if tbuf is not buf:
        raise Refused(f"{what}: tensor's buffer is not buffer 0x{handle:x}")
    res = lib.shmem(res_id, what)
    if at > res.size or size > res.size - at:
        raise Refused(f"{what}: [{at}, +{size}) exceeds resource {res_id} ({res.size} bytes)")
    if size == 0:
        return
    twin = chk.loose_twin(rec, tbuf)
    t = ctypes.addressof(twin)
    nbytes = g.ggml_nbytes(t)
    if offset + size > nbytes:
        raise Refused(f"{what}: [{offset}, {offset + size}) outside the tensor's {nbytes} bytes")
    if to_tensor:
        transfers = lib.transfers
        if transfers is None or not transfers.upload(tbuf, t, res.address + at, offset, size):
            g.ggml_backend_tensor_set(t, res.address + at, offset, size)
    else:
        g.ggml_backend_tensor_get(t, res.address, offset, size)


def set_tensor(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    _transfer(lib, dec, F.BUFFER_SET_TENSOR, to_tensor=True)
    return BACKEND_RC_OK


def get_tensor(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    _transfer(lib, dec, F.BUFFER_GET_TENSOR, to_tensor=False)
    return BACKEND_RC_OK


def cpy_tensor(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    g, chk = lib.g, lib.checker
    handle, src_raw, dst_raw = args(dec, F.BUFFER_CPY_TENSOR, chk, lib.host)
    buf = lib.buffer(handle)
    src_rec, dst_rec = chk.rpc_tensor(src_raw), chk.rpc_tensor(dst_raw)
    src_buf, _ = chk.check_rpc(src_rec, lib.buffers, "buffer_cpy_tensor src")
    dst_buf, _ = chk.check_rpc(dst_rec, lib.buffers, "buffer_cpy_tensor dst")
    if src_buf is None or dst_buf is None:
        raise Refused("buffer_cpy_tensor: a tensor without a buffer")
    if dst_buf is not buf:
        raise Refused(f"buffer_cpy_tensor: destination is not in buffer 0x{handle:x}")
    src, dst = chk.loose_twin(src_rec, src_buf), chk.loose_twin(dst_rec, dst_buf)
    need = g.ggml_nbytes(ctypes.addressof(src))
    room = dst_buf.size - dst_rec.data
    if need > room:
        raise Refused(f"buffer_cpy_tensor: {need} source bytes, {room} bytes left in the destination buffer")
    copied = bool(g.ggml_backend_buffer_copy_tensor(ctypes.addressof(src), ctypes.addressof(dst)))
    lib.host.forward_replies["buffer_cpy_tensor"](enc, copied)
    return BACKEND_RC_OK


def clear(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    handle, value = args(dec, F.BUFFER_CLEAR, lib.checker, lib.host)
    lib.g.ggml_backend_buffer_clear(lib.buffer(handle).ptr, value)
    return BACKEND_RC_OK


def free_buffer(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    (handle,) = args(dec, F.BUFFER_FREE_BUFFER, lib.checker, lib.host)
    lib.buffer(handle)  # refused when unknown
    lib.free_buffer(handle)
    return BACKEND_RC_OK
