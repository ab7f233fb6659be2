"""Remote buffers (`ggml_backend_buffer`), twin of the C guest's ggml-backend-buffer.cpp and
of `ggml_backend_remoting_buffer_type_alloc_buffer`.

Theory of operation: a buffer lives on the host, named by the host's handle (u64). ggml owns
the `ggml_backend_buffer` struct; apir keeps a `RemoteBuffer` per struct address and registers
(address, handle, base) in the backend's `BufferTable`, which the graph serializer uses to turn
`tensor->buffer` into a handle and `tensor->data` into an offset. Two kinds, chosen at
allocation like the C:
- host-only (`buffer_type_alloc_buffer`): the base is the host's address, asked once with
  `buffer_get_base` and only used for offsets; tensor data moves with `buffer_set_tensor` /
  `buffer_get_tensor` through the client's data window.
- guest-mapped (`device_buffer_from_ptr`, when the host offers buffer_from_host_ptr): a shared
  blob mapped here too, so the base is the mapping's address and tensor data is copied in and
  out with `apir.codec.copy.copy_bytes`, which checks each copy against the mapping's bounds
  (the C trusts ggml's asserts); zero-copy for the host.

`cpy_tensor` answers false (ggml then copies through the guest) when the source is not one of
this backend's buffers. `memset_tensor`, NULL in the C, is a memset in the mapping or a
`buffer_set_tensor` of repeated bytes.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional

from apir.codec.copy import RawMemory, copy_bytes

__all__ = ["RemoteBuffer", "BufferOps", "alloc_buffer", "build_buffer_iface", "memory_address", "tensor_field"]


@dataclass
class RemoteBuffer:
    """apir's side of one `ggml_backend_buffer_t` (the C `ggml_backend_remoting_buffer_context`)."""

    ptr: int  # the ggml_backend_buffer struct's address
    host_handle: int  # apir_buffer_host_handle_t
    base: int  # guest address tensor offsets are taken from (host's base, or the mapping's)
    size: int  # bytes
    blob: Optional[object] = None  # the guest-mapped blob (device_buffer_from_ptr), else None

    @property
    def is_from_ptr(self) -> bool:
        return self.blob is not None


def memory_address(memory) -> int:
    """Address of the first byte of a writable buffer (an mmap), without keeping an export
    on it (so the mmap can still be closed)."""
    view = (ctypes.c_char * 1).from_buffer(memory)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def tensor_field(g, tensor: int, name: str) -> int:
    """A pointer-sized field ("data", "buffer") of the ggml_tensor at `tensor`."""
    return ctypes.c_void_p.from_address(tensor + g.tensor_dtype.fields[name][1]).value or 0


def alloc_buffer(owner, buft: int, size: int) -> int:
    """A new remote buffer of `size` bytes with buffer type `buft`; returns the
    ggml_backend_buffer_t (int). Raises on failure (the callback turns that into NULL)."""
    client, info = owner.client, owner.info
    blob = None
    if owner.zero_copy:
        blob, handle, _buft = client.device_buffer_from_ptr(size, size)
    else:
        handle = client.buffer_type_alloc_buffer(info.buft_handle, size)
    if not handle:
        owner.release_blob(blob)
        raise MemoryError(f"the host could not allocate a buffer of {size} bytes")
    try:
        if blob is not None:
            if len(blob.memory) < size:
                raise RuntimeError(f"device_buffer_from_ptr: blob of {len(blob.memory)} bytes for {size}")
            base = memory_address(blob.memory)
        else:
            # The C asks lazily in get_base; ggml asks right after allocating anyway, and
            # asking here lets a failure become a NULL buffer instead of an abort in get_base.
            base = client.buffer_get_base(handle)
        ptr = owner.abi.buffer_init(owner.g)(buft, owner.buffer_iface, None, size)
        if not ptr:
            raise MemoryError("ggml_backend_buffer_init returned NULL")
    except BaseException:
        try:
            client.buffer_free_buffer(handle)
        finally:
            owner.release_blob(blob)
        raise
    owner.add_buffer(RemoteBuffer(ptr, int(handle), int(base), size, blob))
    return ptr


def _bytes_at(address: int, size: int) -> memoryview:
    """A writable byte ("B") view of C memory ggml handed us, valid for the callback's duration."""
    return memoryview((ctypes.c_ubyte * size).from_address(address)).cast("B")


def _checked_span(g, rb: RemoteBuffer, tensor: int, offset: int, size: int) -> int:
    """Address of `size` bytes at `offset` into the tensor's data, inside `rb`'s mapping."""
    addr = tensor_field(g, tensor, "data") + offset
    if addr < rb.base or addr + size > rb.base + rb.size:
        raise ValueError(f"tensor 0x{tensor:x}: [{addr:#x}, +{size}) is outside its buffer [{rb.base:#x}, +{rb.size})")
    return addr


def _copy_in_mapping(g, rb: RemoteBuffer, tensor: int, offset: int, data: int, size: int, to_tensor: bool) -> None:
    """`size` bytes between `data` and byte `offset` of the tensor's data in `rb`'s mapping
    (into the tensor where `to_tensor`): copy_bytes checks the range lies in the mapping."""
    mapping, at = RawMemory(rb.base, rb.size), tensor_field(g, tensor, "data") + offset - rb.base
    if to_tensor:
        copy_bytes(mapping, RawMemory(data or 0, size), size, dst_offset=at)
    else:
        copy_bytes(RawMemory(data or 0, size), mapping, size, src_offset=at)


class BufferOps:
    """The buffer functions of `owner`'s buffers as Python callables (the buffer iface's
    callbacks, and the backend's async entries, call them). Before the guest touches a
    guest-mapped buffer's memory itself, the commands it posted are waited for
    (`client.synchronize`): one of them may still write or read that memory."""

    def __init__(self, owner):
        from apir.codec.graph import rpc_tensor_from_ggml

        self.owner = owner
        g = self.g = owner.g
        self._rpc = lambda tensor: rpc_tensor_from_ggml(g, tensor, owner.buffer_table)
        sync = getattr(owner.client, "synchronize", None)  # (ASYNC; a no-op with nothing posted)
        self._settle = sync if sync is not None else (lambda: None)

    def free_buffer(self, buf):
        owner = self.owner
        rb = owner.remove_buffer(buf)
        try:
            owner.client.buffer_free_buffer(rb.host_handle)
        finally:
            owner.release_blob(rb.blob)

    def set_tensor(self, buf, tensor, data, offset, size):
        rb = self.owner.buffer(buf)
        if rb.is_from_ptr:
            self._settle()
            _copy_in_mapping(self.g, rb, tensor, offset, data, size, to_tensor=True)
        else:
            self.owner.client.buffer_set_tensor(rb.host_handle, self._rpc(tensor), offset, _bytes_at(data, size))

    def get_tensor(self, buf, tensor, data, offset, size):
        rb = self.owner.buffer(buf)
        if rb.is_from_ptr:
            self._settle()
            _copy_in_mapping(self.g, rb, tensor, offset, data, size, to_tensor=False)
        else:
            self.owner.client.buffer_get_tensor(rb.host_handle, self._rpc(tensor), offset, _bytes_at(data, size))

    def memset_tensor(self, buf, tensor, value, offset, size):
        rb = self.owner.buffer(buf)
        if rb.is_from_ptr:
            self._settle()
            ctypes.memset(_checked_span(self.g, rb, tensor, offset, size), value, size)
        else:
            self.owner.client.buffer_set_tensor(rb.host_handle, self._rpc(tensor), offset, bytes([value]) * size)

    def cpy_tensor(self, buf, src, dst, post: bool = False):
        owner = self.owner
        rb = owner.buffer(buf)
        if not owner.has_buffer(tensor_field(self.g, src, "buffer")):
            return False
        client, src_rpc, dst_rpc = owner.client, self._rpc(src), self._rpc(dst)
        if post:
            return bool(client.buffer_cpy_tensor(rb.host_handle, src_rpc, dst_rpc, post=True))
        return bool(client.buffer_cpy_tensor(rb.host_handle, src_rpc, dst_rpc))

    def clear(self, buf, value):
        self.owner.client.buffer_clear(self.owner.buffer(buf).host_handle, value)


def build_buffer_iface(owner):
    """The `ggml_backend_buffer_i` shared by all of `owner`'s buffers (over `owner.buffer_ops`)."""
    abi, cb, ops = owner.abi, owner.callbacks, owner.buffer_ops
    return cb.iface(
        abi.BufferI,
        abi.protos["ggml_backend_buffer_i"],
        {
            "free_buffer": (ops.free_buffer, None),
            "get_base": (lambda buf: owner.buffer(buf).base, None),
            "memset_tensor": (ops.memset_tensor, None),
            "set_tensor": (ops.set_tensor, None),
            "get_tensor": (ops.get_tensor, None),
            "cpy_tensor": (lambda buf, src, dst: ops.cpy_tensor(buf, src, dst), False),
            "clear": (ops.clear, None),
        },
        "buffer",
    )
