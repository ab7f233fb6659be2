"""The local transport's socket wire: fixed-size little-endian messages over a Unix socket.

Theory of operation: without a VM, a host process plays the virtio-gpu kernel driver and the
hypervisor. A guest connects to its Unix stream socket (one connection = one opened render node =
one APIR context) and sends requests that mirror the virtgpu DRM ioctls; the host answers each
request with exactly one reply, in order. Every message is a 16-byte header
``{u32 op; u32 err; u32 len; u32 seq}`` followed by ``len`` payload bytes whose layout is fixed per
op (only GET_CAPS replies and EXECBUFFER requests carry a variable tail). Requests carry err = 0;
a reply's err is 0 or a positive errno, as the ioctl would set it. Blob memory never travels on the
socket: the HELLO reply passes the context's shared memory file with SCM_RIGHTS, and a blob's MAP
offset is its offset in that file. docs/local-transport.md is the reference for a port.

This module only packs and unpacks (no I/O: apir.local.socket_io sends and receives the
messages); it imports nothing from the host or the guest, so both ends share it.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Optional

from apir.errors import ApirError

__all__ = [
    "HEADER",
    "HELLO_MAGIC",
    "WIRE_VERSION",
    "MAX_EXEC_COMMAND",
    "MAX_GET_CAPS",
    "MAX_PAYLOAD",
    "MAX_RING_COMMAND",
    "RING_POSTED",
    "RING_DONE",
    "RING_ERR",
    "RING_POLLING",
    "RING_HEADER",
    "RING_COMMAND",
    "RING_SIZE",
    "Op",
    "REQUEST",
    "REPLY",
    "Header",
    "WireError",
    "ConnectionClosed",
    "DeadlineExceeded",
    "pack_message",
    "unpack_header",
    "fixed_reply",
]

HEADER = struct.Struct("<IIII")  # op, err, len, seq
HELLO_MAGIC = 0x52495041  # the bytes b"APIR" read as a little-endian u32
WIRE_VERSION = 1
# An APIR command is small (the C guest's encoder buffer is 4 KiB); bulk data goes by memory.
MAX_EXEC_COMMAND = 65536
MAX_GET_CAPS = 4096
# A request announcing more than this is a protocol error: the host closes the connection.
MAX_PAYLOAD = 16 + MAX_EXEC_COMMAND


class Op(enum.IntEnum):
    """Message types; each names the virtgpu ioctl it stands for."""

    HELLO = 1  # open(): exchanges versions, passes the shared memory file
    GETPARAM = 2  # DRM_IOCTL_VIRTGPU_GETPARAM
    GET_CAPS = 3  # DRM_IOCTL_VIRTGPU_GET_CAPS
    CONTEXT_INIT = 4  # DRM_IOCTL_VIRTGPU_CONTEXT_INIT
    CREATE_BLOB = 5  # DRM_IOCTL_VIRTGPU_RESOURCE_CREATE_BLOB
    MAP = 6  # DRM_IOCTL_VIRTGPU_MAP
    GEM_CLOSE = 7  # DRM_IOCTL_GEM_CLOSE
    EXECBUFFER = 8  # DRM_IOCTL_VIRTGPU_EXECBUFFER; replied once the command has run
    STAT = 9  # debug: counts of contexts, blobs and ggml buffers (the connection's own by default)
    RING = 10  # sets up the connection's exec ring (below): EXECBUFFERs through shared memory
    KICK = 11  # the host is not polling the exec ring: run what is posted there; replied once run


# Fixed payload layouts (every request has one; EXECBUFFER's is followed by the command).
REQUEST: dict[Op, struct.Struct] = {
    Op.HELLO: struct.Struct("<II"),  # magic, wire_version
    Op.GETPARAM: struct.Struct("<Q"),  # param
    Op.GET_CAPS: struct.Struct("<IIII"),  # cap_set_id, cap_set_ver, size, pad
    Op.CONTEXT_INIT: struct.Struct("<IIQ"),  # capset_id, num_rings, poll_rings_mask
    Op.CREATE_BLOB: struct.Struct("<IIQQ"),  # blob_mem, blob_flags, size, blob_id
    Op.MAP: struct.Struct("<II"),  # bo_handle, pad
    Op.GEM_CLOSE: struct.Struct("<II"),  # bo_handle, pad
    Op.EXECBUFFER: struct.Struct("<IIII"),  # flags, size, ring_idx, pad; then `size` bytes
    Op.STAT: struct.Struct(""),
    Op.RING: struct.Struct(""),
    Op.KICK: struct.Struct(""),
}
# None = no fixed layout (see the op's notes in docs/local-transport.md).
REPLY: dict[Op, Optional[struct.Struct]] = {
    # magic, wire_version, blob_alignment (apir.codec.virtgpu.BLOB_ALIGNMENT), pad; + 1 fd
    Op.HELLO: struct.Struct("<IIII"),
    Op.GETPARAM: struct.Struct("<Q"),  # value
    Op.GET_CAPS: None,  # min(size, capset size) bytes of the capset
    Op.CONTEXT_INIT: struct.Struct(""),
    Op.CREATE_BLOB: struct.Struct("<IIQ"),  # res_handle, bo_handle, size (rounded up)
    Op.MAP: struct.Struct("<Q"),  # offset in the shared memory file
    Op.GEM_CLOSE: struct.Struct(""),
    Op.EXECBUFFER: struct.Struct(""),
    # contexts, blobs, blob_bytes, file_bytes, ggml_buffers (-1: the host cannot count them)
    Op.STAT: struct.Struct("<IIQQq"),
    Op.RING: struct.Struct("<QII"),  # offset in the shared memory file, size, pad
    Op.KICK: struct.Struct(""),
}

# The exec ring: one page of the shared memory file through which a guest posts its EXECBUFFERs
# without a socket message, one command at a time, while the host polls it (docs/local-transport.md,
# "The exec ring"; apir.local.exec_ring reads and writes it). Byte offsets of its u32 words, each
# on a cache line of its own (written by one side each):
RING_POSTED = 0  # guest: the sequence number of the newest command posted (0: none yet)
RING_DONE = 64  # host: the sequence number of the newest command run (or refused)
RING_ERR = 68  # host: 0, or the errno that refused command RING_DONE (stored before it)
RING_POLLING = 128  # host: 1 while it polls RING_POSTED (the guest need not kick), else 0
RING_HEADER = 192  # guest: the command's EXECBUFFER request payload (REQUEST[Op.EXECBUFFER])
RING_COMMAND = 256  # guest: the command's bytes
RING_SIZE = 16384  # one blob-aligned page of the shared memory file
MAX_RING_COMMAND = RING_SIZE - RING_COMMAND  # a longer command goes as an EXECBUFFER message


@dataclass(frozen=True)
class Header:
    """One message header. `err` is a positive errno in a failed reply, else 0."""

    op: int
    err: int
    length: int
    seq: int


class WireError(ApirError):
    """The peer broke the wire format (bad length, bad magic, short message)."""


class ConnectionClosed(WireError):
    """The peer closed the connection (or died) before a whole message arrived."""


class DeadlineExceeded(WireError):
    """The peer did not send (or take) a whole message by the deadline it was given."""


def pack_message(op: int, seq: int, payload: bytes = b"", err: int = 0) -> bytes:
    """Header + payload as one bytes object."""
    return HEADER.pack(op, err, len(payload), seq) + payload


def unpack_header(data: bytes, max_payload: int = MAX_PAYLOAD) -> Header:
    """The header in the HEADER.size bytes `data`. Raises WireError when it announces more than
    `max_payload` payload bytes (the stream cannot be trusted after that)."""
    header = Header(*HEADER.unpack(data))
    if header.length > max_payload:
        raise WireError(f"message of {header.length} bytes exceeds the {max_payload}-byte limit")
    return header


def fixed_reply(op: Op) -> struct.Struct:
    """REPLY[op] for an op whose reply has a fixed layout; ValueError for GET_CAPS (whose reply
    is the capset's bytes)."""
    fmt = REPLY[op]
    if fmt is None:
        raise ValueError(f"{op.name} replies have no fixed layout")
    return fmt
