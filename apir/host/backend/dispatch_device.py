"""Device handlers (C `backend-dispatched-device.cpp`): device 0 of the loaded registration.

Arguments and replies are laid out as apir.codec.forward lists them.
    get_device_count, get_count  the device count of the registration
    supports_op                  True only where ggml's device says yes AND the node passes
                                 its op's shape rule (apir.host.graph.shapes) as far as it can be
                                 checked without data: what graph_compute would refuse is
                                 reported unsupported, so a guest schedules it elsewhere
                                 instead of failing at compute. False for every op on a
                                 backend the host has no profile for (apir.host.graph.profiles)
    get_buffer_type              the buffer type handle (opaque id)
    get_props                    the layout of the version the HandShake negotiated
                                 (apir.codec.constants.negotiated_version): 4 booleans for
                                 an APIR 0.1 guest, 5 for 0.2
    buffer_from_ptr              buffer handle and buffer type handle; both 0
                                 when ggml made no buffer or it does not fit the context's
                                 budget (charged its size like any buffer, apir.host.backend.budget)
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Mapping, Optional

from apir.codec.constants import ApirBackendCommandType as F
from apir.codec.wire import Decoder, Encoder
from apir.ggml.backend_props import get_dev_props
from apir.ggml.layout import tensor_record
from apir.host.backend.forward import args
from apir.host.backend.seams import HandlerLibrary
from apir.host.errors import BACKEND_RC_OK, Refused, log
from apir.host.graph.build import tensor_info
from apir.host.graph.shapes import Rule, node_refusal
from apir.host.tensors import Scratch, inline_twin


__all__ = [
    "get_device_count",
    "get_count",
    "get_name",
    "get_description",
    "get_type",
    "get_memory",
    "supports_op",
    "get_buffer_type",
    "get_props",
    "buffer_from_ptr",
]


def get_device_count(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    lib.host.forward_replies["device_get_device_count"](enc, _device_count(lib))
    return BACKEND_RC_OK


def get_count(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    lib.host.forward_replies["device_get_count"](enc, _device_count(lib))
    return BACKEND_RC_OK


def get_name(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    lib.host.forward_replies["device_get_name"](enc, lib.g.ggml_backend_dev_name(lib.dev))
    return BACKEND_RC_OK


def get_description(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    lib.host.forward_replies["device_get_description"](enc, lib.g.ggml_backend_dev_description(lib.dev))
    return BACKEND_RC_OK


def get_type(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    # the device's own type, unless configured otherwise (apir.host.device_type)
    dev_type = lib.g.ggml_backend_dev_type(lib.dev) if lib.device_type is None else lib.device_type
    lib.host.forward_replies["device_get_type"](enc, dev_type)
    return BACKEND_RC_OK


def get_memory(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    lib.g.ggml_backend_dev_memory(lib.dev, ctypes.byref(free), ctypes.byref(total))
    lib.host.forward_replies["device_get_memory"](enc, free.value, total.value)
    return BACKEND_RC_OK


def supports_op(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    chk = lib.checker
    (inline,) = args(dec, F.DEVICE_SUPPORTS_OP, chk, lib.host)
    with Scratch(lib.g, 2 + chk.limits.max_src) as scratch:
        op = inline_twin(chk, inline, scratch, "device_supports_op")
        _check_required_srcs(lib, op)
        profile = lib.profile  # none: no rules, so nothing is supported (graph.seams.profile_of)
        ok = (
            profile is not None
            and bool(lib.g.ggml_backend_dev_supports_op(lib.dev, op))
            and _rule_accepts(lib, op, profile.rules)
        )
        lib.host.forward_replies["device_supports_op"](enc, ok)
    return BACKEND_RC_OK


def get_buffer_type(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    buft = lib.buft_handle(lib.g.ggml_backend_dev_buffer_type(lib.dev), allocatable=True)
    lib.host.forward_replies["device_get_buffer_type"](enc, buft)
    return BACKEND_RC_OK


def get_props(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    caps = get_dev_props(lib.g, lib.dev)
    caps["buffer_from_host_ptr"] = lib.host_ptr_buffers
    host = lib.host
    fields = host.forward_layouts[F.DEVICE_GET_PROPS][1].fields  # (the reply's, in the negotiated version)
    host.forward_replies["device_get_props"](enc, *(caps.get(field.name, False) for field in fields))
    return BACKEND_RC_OK


def buffer_from_ptr(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    g = lib.g
    res_id, size, max_tensor_size = args(dec, F.DEVICE_BUFFER_FROM_PTR, lib.checker, lib.host)
    res = lib.shmem(res_id, "device_buffer_from_ptr")
    if size == 0 or size > res.size:
        raise Refused(f"device_buffer_from_ptr: size {size} does not fit resource {res_id} ({res.size} bytes)")
    if not lib.host_ptr_buffers:
        raise Refused("device_buffer_from_ptr: the device cannot wrap host memory")
    align = g.ggml_backend_buft_get_alignment(g.ggml_backend_dev_buffer_type(lib.dev))
    if res.address % align:
        raise Refused(f"device_buffer_from_ptr: resource {res_id} is not {align}-byte aligned")
    # an importing GPU wants whole pages (Vulkan: minImportedHostPointerAlignment); the blob
    # is whole pages, so the wrapped size is rounded up within it
    wrap = min(res.size, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE)
    handle = lib.hold_buffer(
        wrap,
        align,
        lambda: g.ggml_backend_dev_buffer_from_host_ptr(lib.dev, res.address, wrap, max_tensor_size),
        res_id=res_id,
    )
    log.debug("ctx %d: device_buffer_from_ptr: resource %d, %d bytes wrapped", lib.host.ctx_id, res_id, wrap)
    buf = lib.buffers.get(handle) if handle else None
    lib.host.forward_replies["device_buffer_from_ptr"](enc, handle, buf.buft_handle if buf is not None else 0)
    return BACKEND_RC_OK


# --- helpers ---------------------------------------------------------------------------------
def _device_count(lib: HandlerLibrary) -> int:
    """The registration's device count, as the C answers; at least 1: ggml-rpc's registration
    enumerates none (its servers' devices hang off per-server registrations), yet the host
    serves one of them."""
    return max(1, lib.g.ggml_backend_reg_dev_count(lib.reg))


# Sources ggml-cpu's supports_op dereferences for these ops (ggml-cpu.cpp), by op name.
_REQUIRED_SRCS = {
    "MUL_MAT": 2,
    "OUT_PROD": 2,
    "IM2COL_BACK": 2,
    "GET_ROWS_BACK": 1,
    "CONV_2D": 1,
    "SOFT_MAX_BACK": 2,
    "SSM_SCAN": 4,
}


def _rule_accepts(lib: HandlerLibrary, t: int, rules: Optional[Mapping[str, Rule]] = None) -> bool:
    """Whether the op's shape rule accepts inline tensor `t` (its twin) and the sources sent
    with it. The inline encoding stops at the first null source, so a later source (e.g.
    soft_max's sinks without a mask) is not seen here; graph_compute still checks it."""
    dtype = lib.g.tensor_dtype
    rec = tensor_record(t, dtype)
    srcs = []
    for i, p in enumerate(int(x) for x in rec["src"]):
        if not p:
            break
        srcs.append(tensor_info(lib, i + 1, tensor_record(p, dtype), None))
    why = node_refusal(tensor_info(lib, 0, rec, None), srcs, lib.op_enums, rules)
    if why is not None:
        log.debug("ctx %d: device_supports_op: false, %s", lib.host.ctx_id, why)
    return why is None


def _check_required_srcs(lib: HandlerLibrary, t: int) -> None:
    """A guest that omits these sources asks about a tensor no ggml constructor builds, and
    ggml's supports_op would read through the missing pointer."""
    rec = tensor_record(t, lib.g.tensor_dtype)
    name = lib.g.op_names.get(int(rec["op"]), "")
    missing = [i for i in range(_REQUIRED_SRCS.get(name, 0)) if not int(rec["src"][i])]
    if missing:
        raise Refused(f"device_supports_op: {name} without src{missing}")
