"""Buffer handlers (C `backend-dispatched-buffer.cpp`).

Every handler takes a u64 buffer handle first, checked against this context's table.
    get_base     reply uintptr: the buffer's virtual base (aligned like the real one)
    set_tensor   apir_rpc_tensor, u32 res_id, size_t offset, size_t size: bytes [0, size) of
                 the resource go to the tensor at `offset`
    get_tensor   same arguments; the tensor's bytes go to [0, size) of the resource
    cpy_tensor   apir_rpc_tensor src, dst; reply bool (whether the buffer could copy)
    clear        u8 value (in a 4-byte slot)
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

from apir.codec.wire import Decoder, Encoder
from apir.host.backend.seams import HandlerLibrary
from apir.host.errors import BACKEND_RC_OK, Refused
from apir.host.handles import HostBuffer


__all__ = ["get_base", "set_tensor", "get_tensor", "cpy_tensor", "clear", "free_buffer"]


def _buffer(lib: HandlerLibrary, dec: Decoder, what: str) -> tuple[int, HostBuffer]:
    handle = dec.handle()
    if dec.fatal:
        raise Refused(f"{what}: truncated arguments")
    return handle, lib.buffer(handle)


def get_base(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    _, buf = _buffer(lib, dec, "buffer_get_base")
    enc.uintptr(buf.virtual_base)
    return BACKEND_RC_OK


def _transfer(lib: HandlerLibrary, dec: Decoder, what: str, to_tensor: bool) -> None:
    g, chk = lib.g, lib.checker
    handle, buf = _buffer(lib, dec, what)
    rec = chk.rpc_record(dec, what)
    res_id, offset, size = dec.u32(), dec.size_t(), dec.size_t()
    if dec.fatal:
        raise Refused(f"{what}: truncated arguments")
    tbuf, extent = chk.check_rpc(rec, lib.buffers, what)
    if tbuf is not buf:
        raise Refused(f"{what}: tensor's buffer is not buffer 0x{handle:x}")
    res = lib.shmem(res_id, what)
    if size > res.size:
        raise Refused(f"{what}: size {size} exceeds resource {res_id} ({res.size} bytes)")
    if size == 0:
        return
    twin = chk.loose_twin(rec, tbuf)
    t = ctypes.addressof(twin)
    nbytes = g.ggml_nbytes(t)
    if offset + size > nbytes:
        raise Refused(f"{what}: [{offset}, {offset + size}) outside the tensor's {nbytes} bytes")
    if to_tensor:
        transfers = lib.transfers
        if transfers is None or not transfers.upload(tbuf, t, res.address, offset, size):
            g.ggml_backend_tensor_set(t, res.address, offset, size)
    else:
        g.ggml_backend_tensor_get(t, res.address, offset, size)


def set_tensor(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    _transfer(lib, dec, "buffer_set_tensor", to_tensor=True)
    return BACKEND_RC_OK


def get_tensor(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    _transfer(lib, dec, "buffer_get_tensor", to_tensor=False)
    return BACKEND_RC_OK


def cpy_tensor(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    g, chk = lib.g, lib.checker
    handle, buf = _buffer(lib, dec, "buffer_cpy_tensor")
    src_rec = chk.rpc_record(dec, "buffer_cpy_tensor src")
    dst_rec = chk.rpc_record(dec, "buffer_cpy_tensor dst")
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
    enc.bool(g.ggml_backend_buffer_copy_tensor(ctypes.addressof(src), ctypes.addressof(dst)))
    return BACKEND_RC_OK


def clear(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    _, buf = _buffer(lib, dec, "buffer_clear")
    value = dec.u8()
    if dec.fatal:
        raise Refused("buffer_clear: truncated arguments")
    lib.g.ggml_backend_buffer_clear(buf.ptr, value)
    return BACKEND_RC_OK


def free_buffer(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    handle, _ = _buffer(lib, dec, "buffer_free_buffer")
    lib.free_buffer(handle)
    return BACKEND_RC_OK
