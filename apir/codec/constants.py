"""Protocol constants of APIR, as the C code names them.

Theory of operation: every number that crosses the wire and has a name in the C
(`backend/shared/api_remoting.h`, `apir_backend.h`, `apir_backend.gen.h`,
`include/apir_hw.h`, `virtgpu.h`) has its twin here, as an `IntEnum` where the C has
an enum or a family of #defines, so logs and exceptions can print the C name.
"""

from __future__ import annotations

import enum
import functools
import struct
from typing import Tuple

from apir.codec.virtgpu import VIRTGPU_DRM_CAPSET_APIR, VIRTGPU_DRM_CAPSET_VENUS

__all__ = [
    "APIR_HANDSHAKE_MAGIC",
    "APIR_PROTOCOL_0_1",
    "APIR_PROTOCOL_0_2",
    "APIR_PROTOCOL_VERSIONS",
    "APIR_PROTOCOL_MAJOR",
    "APIR_PROTOCOL_MINOR",
    "VENUS_COMMAND_TYPE_LENGTH",
    "VIRTGPU_DRM_CAPSET_VENUS",
    "VIRTGPU_DRM_CAPSET_APIR",
    "SHMEM_DATA_SIZE",
    "SHMEM_REPLY_SIZE",
    "APIR_HANDSHAKE_MAX_WAIT_S",
    "APIR_LOADLIBRARY_MAX_WAIT_S",
    "ApirCommandType",
    "ApirLoadLibraryReturnCode",
    "ApirForwardReturnCode",
    "ApirBackendInitializeReturnCode",
    "ApirBackendCommandType",
    "APIR_BACKEND_FORWARD_INDEX_INVALID",
    "ApirExtensionCommandType",
    "ApirExtension",
    "APIR_EXTENSIONS_ALL",
    "APIR_BACKEND_GRAPH_UNKNOWN",
    "APIR_FORWARD_POSTED",
    "APIR_BACKEND_POSTED_FAILED",
    "APIR_BACKEND_QUEUE_FULL",
    "APIR_MAX_POSTED",
    "POSTABLE_FUNCTIONS",
    "CapsetApir",
    "negotiated_version",
]

# --- HandShake ---------------------------------------------------------------------------------
APIR_HANDSHAKE_MAGIC = 0xAB1E  # the HandShake's return code when the host accepts

APIR_PROTOCOL_0_1 = (0, 1)  # ggml 0.10.x; device_get_props carries 4 booleans
APIR_PROTOCOL_0_2 = (0, 2)  # ggml 0.20.x; device_get_props adds mmap_support (5 booleans)
APIR_PROTOCOL_VERSIONS = (APIR_PROTOCOL_0_1, APIR_PROTOCOL_0_2)
APIR_PROTOCOL_MAJOR, APIR_PROTOCOL_MINOR = APIR_PROTOCOL_0_2  # what apir speaks by default


def negotiated_version(guest: Tuple[int, int], host: Tuple[int, int]) -> Tuple[int, int]:
    """The (major, minor) both sides shape version-dependent replies by, from the two versions
    the HandShake exchanged: the lower one. The guest's reply layout is fixed by what it was
    built for (the C guest of ggml 0.10 reads 4 device_get_props booleans, of 0.20 five) and a
    host that knows the guest's version answers in it; an older host writes its own, shorter
    layout. A guest version the host does not know is answered in the host's version."""
    return _negotiated(tuple(guest), tuple(host))  # (lists too)


@functools.lru_cache(maxsize=64)
def _negotiated(guest: Tuple[int, ...], host: Tuple[int, ...]) -> Tuple[int, int]:
    # (once per pair of versions: both sides ask on every Forward)
    guest_v, host_v = (int(guest[0]), int(guest[1])), (int(host[0]), int(host[1]))
    if guest_v not in APIR_PROTOCOL_VERSIONS:
        return host_v
    return min(guest_v, host_v)


# --- capsets (virtgpu.h, include/apir_hw.h) -----------------------------------------------------
# VIRTGPU_DRM_CAPSET_VENUS (4), VIRTGPU_DRM_CAPSET_APIR (10): virtgpu vocabulary, declared in
# apir.codec.virtgpu and re-exported here.
# Over the Venus capset the guest adds this to every APIR command type (Venus->APIR transition).
VENUS_COMMAND_TYPE_LENGTH = 331

# Sizes of the guest's two standing blobs (virtgpu.h).
SHMEM_DATA_SIZE = 0x1830000  # 24 MiB + 192 KiB: the data window for tensor transfers and graphs
SHMEM_REPLY_SIZE = 0x4000  # 16 KiB: reply notification word + reply payload

# Guest-side wait limits of the C (virtgpu.cpp), in seconds.
APIR_HANDSHAKE_MAX_WAIT_S = 2.0
APIR_LOADLIBRARY_MAX_WAIT_S = 60.0


class ApirCommandType(enum.IntEnum):
    """The first u32 of every command (api_remoting.h `ApirCommandType`)."""

    HANDSHAKE = 0
    LOADLIBRARY = 1
    FORWARD = 2

    @property
    def c_name(self) -> str:
        return {0: "HandShake", 1: "LoadLibrary", 2: "Forward"}[self.value]


class ApirLoadLibraryReturnCode(enum.IntEnum):
    """LoadLibrary's return code (api_remoting.h). Codes >= INIT_BASE_INDEX carry the backend
    library's `apir_backend_initialize` return code n as INIT_BASE_INDEX + n; n is itself one
    of these codes: ENV_VAR_MISSING / CANNOT_OPEN / SYMBOL_MISSING for the ggml backend library,
    or INIT_BASE_INDEX + an ApirBackendInitializeReturnCode (backend.cpp; virtgpu.cpp reads a
    failure so)."""

    SUCCESS = 0
    HYPERCALL_INITIALIZATION_ERROR = 1
    ALREADY_LOADED = 2
    ENV_VAR_MISSING = 3
    CANNOT_OPEN = 4
    SYMBOL_MISSING = 5
    INIT_BASE_INDEX = 6


class ApirForwardReturnCode(enum.IntEnum):
    """Forward's return code (api_remoting.h). Codes >= BASE_INDEX carry the backend
    function's own return code n as BASE_INDEX + n."""

    SUCCESS = 0
    NO_DISPATCH_FCT = 1
    TIMEOUT = 2
    FAILED_TO_SYNC_STREAMS = 3
    BASE_INDEX = 4


class ApirBackendInitializeReturnCode(enum.IntEnum):
    """`apir_backend_initialize`'s return code (apir_backend.h APIR_BACKEND_INITIALIZE_*)."""

    SUCCESS = 0
    CANNOT_OPEN_BACKEND_LIBRARY = 1
    CANNOT_OPEN_GGML_LIBRARY = 2
    MISSING_BACKEND_SYMBOLS = 3
    MISSING_GGML_SYMBOLS = 4
    BACKEND_FAILED = 5
    BACKEND_REG_FAILED = 6
    ALREADY_INITED = 7
    NO_DEVICE = 8
    BACKEND_INIT_FAILED = 9


# The dispatcher's return code for a function id out of range (apir_backend.h).
APIR_BACKEND_FORWARD_INDEX_INVALID = 6


class ApirBackendCommandType(enum.IntEnum):
    """Forward's flags: which backend function to run (apir_backend.gen.h).

    `c_name` gives the name the C logs (`apir_dispatch_command_name`)."""

    # device
    DEVICE_GET_DEVICE_COUNT = 0
    DEVICE_GET_COUNT = 1
    DEVICE_GET_NAME = 2
    DEVICE_GET_DESCRIPTION = 3
    DEVICE_GET_TYPE = 4
    DEVICE_GET_MEMORY = 5
    DEVICE_SUPPORTS_OP = 6
    DEVICE_GET_BUFFER_TYPE = 7
    DEVICE_GET_PROPS = 8
    DEVICE_BUFFER_FROM_PTR = 9
    # buffer type
    BUFFER_TYPE_GET_NAME = 10
    BUFFER_TYPE_GET_ALIGNMENT = 11
    BUFFER_TYPE_GET_MAX_SIZE = 12
    BUFFER_TYPE_IS_HOST = 13  # deprecated in the C guest, still served
    BUFFER_TYPE_ALLOC_BUFFER = 14
    BUFFER_TYPE_GET_ALLOC_SIZE = 15
    # buffer
    BUFFER_GET_BASE = 16
    BUFFER_SET_TENSOR = 17
    BUFFER_GET_TENSOR = 18
    BUFFER_CPY_TENSOR = 19
    BUFFER_CLEAR = 20
    BUFFER_FREE_BUFFER = 21
    # backend
    BACKEND_GRAPH_COMPUTE = 22

    @property
    def c_name(self) -> str:
        return self.name.lower()


assert len(ApirBackendCommandType) == 23  # APIR_BACKEND_DISPATCH_TABLE_COUNT


# --- extensions beyond APIR 0.2 (docs/protocol.md, "Extensions") ----------------------------
class ApirExtensionCommandType(enum.IntEnum):
    """Forward function ids of the extensions: far above the 0.2 table, so an APIR 0.2 host
    answers them APIR_BACKEND_FORWARD_INDEX_INVALID and a later upstream function id does not
    collide with them. Only EXT_QUERY may be sent before the extensions were agreed."""

    EXT_QUERY = 0x100
    DEVICE_SELECT = 0x101
    GRAPH_COMPUTE_KEEP = 0x102
    GRAPH_RECOMPUTE = 0x103
    SYNCHRONIZE = 0x104
    EVENT_NEW = 0x105
    EVENT_RECORD = 0x106
    EVENT_WAIT = 0x107
    EVENT_SYNCHRONIZE = 0x108
    EVENT_FREE = 0x109
    BUFFER_SET_TENSOR_AT = 0x10A

    @property
    def c_name(self) -> str:
        return self.name.lower()


class ApirExtension(enum.IntFlag):
    """The bits of EXT_QUERY's masks."""

    DEVICES = 1 << 0  # several host devices: DEVICE_SELECT, handles and graphs name their device
    GRAPH_REPLAY = 1 << 1  # GRAPH_COMPUTE_KEEP / GRAPH_RECOMPUTE
    ASYNC = 1 << 2  # posted commands, SYNCHRONIZE, events
    USE_COUNTS = 1 << 3  # a graph record's `padding`: the tensor's use count in the guest's cgraph


# A use count from the wire above this is taken as this (docs/protocol.md 12.5): counts only
# compare with uses inside the graph, so any count above those fuses the same
APIR_WIRE_USE_COUNT_MAX = 1 << 24


APIR_EXTENSIONS_ALL = int(
    ApirExtension.DEVICES | ApirExtension.GRAPH_REPLAY | ApirExtension.ASYNC | ApirExtension.USE_COUNTS
)

# GRAPH_RECOMPUTE's function return code (Forward: 4 + 7 = 11) when the host holds no graph of
# that id (never kept, evicted, or its buffers freed): the guest sends the graph again.
APIR_BACKEND_GRAPH_UNKNOWN = 7


# ASYNC (docs/protocol.md 12.7). A Forward whose function id has this bit is posted: run in
# order, no reply written; its failure is answered at the next waited-for command.
APIR_FORWARD_POSTED = 1 << 31
# The functions that may be posted: they return nothing the guest needs (cpy_tensor's
# `copied` false is the posted command's failure).
POSTABLE_FUNCTIONS = frozenset(
    int(f)
    for f in (
        ApirBackendCommandType.BUFFER_SET_TENSOR,
        ApirBackendCommandType.BUFFER_CPY_TENSOR,
        ApirBackendCommandType.BUFFER_CLEAR,
        ApirExtensionCommandType.BUFFER_SET_TENSOR_AT,
    )
)
# A waited-for command's function return code (Forward: 4 + 8 = 12) while a posted command's
# failure is pending: the command did not run; SYNCHRONIZE tells which posted command failed.
APIR_BACKEND_POSTED_FAILED = 8
# A posted command's failure code (Forward 4 + 9 = 13) past APIR_MAX_POSTED since the last
# waited-for command: it is not run.
APIR_BACKEND_QUEUE_FULL = 9
APIR_MAX_POSTED = 256  # posted commands between two waited-for ones


class CapsetApir:
    """`struct virgl_renderer_capset_apir` (include/apir_hw.h): 24 bytes,
    ``u32 apir_version; u32 supports_blob_resources; u32 reserved[4]``."""

    STRUCT = struct.Struct("<II4I")
    SIZE = STRUCT.size  # 24

    def __init__(self, apir_version: int, supports_blob_resources: bool):
        self.apir_version = apir_version
        self.supports_blob_resources = bool(supports_blob_resources)

    def pack(self) -> bytes:
        return self.STRUCT.pack(self.apir_version, int(self.supports_blob_resources), 0, 0, 0, 0)

    @classmethod
    def unpack(cls, data: bytes) -> "CapsetApir":
        """Raises ValueError when `data` is shorter than 24 bytes."""
        if len(data) < cls.SIZE:
            raise ValueError(f"capset APIR is {cls.SIZE} bytes, got {len(data)}")
        version, blob, *_ = cls.STRUCT.unpack_from(data)
        return cls(version, bool(blob))

    def __repr__(self) -> str:
        return f"CapsetApir(apir_version={self.apir_version}, supports_blob_resources={self.supports_blob_resources})"
