"""ggml's backend interface structs (`ggml-backend-impl.h`), declared per ggml build.

Theory of operation: a ggml backend is five C objects — registry, device, buffer type, buffer,
backend (a stream) — each `{iface, parent, context}` with `iface` a table of function
pointers. Their layout is internal to ggml and changes between releases, so it is written here
as data, once per ggml API series (every 0.20.x is "0.20", apir.ggml.features.SERIES), and
`abi_for(g)` returns the set matching the loaded build's series (`g.series`); an unknown
series is refused with `UnsupportedGgmlVersion` rather than guessed.
tests/guest_backend/test_abi.py compiles a C program against each version's headers and checks
every offset and size below.

Function-pointer types use the letters of `apir.ggml.functions.SIGNATURE_LETTERS` (result, ":", arguments):
v void, p pointer, z size_t, b bool, i int / enum, B uint8_t. Strings returned by callbacks are
`p` (an address the owner keeps alive), never `c_char_p`, which ctypes cannot return safely
from a callback.

`ggml_backend_buffer_init` takes `struct ggml_backend_buffer_i` by value, so its argument
types depend on the build too: `Abi.buffer_init(g)` gives it typed with this version's struct.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from apir.codec.constants import ApirBackendCommandType
from apir.codec.forward import FORWARD
from apir.errors import ApirError
from apir.ggml.errors import GgmlLoadError
from apir.ggml.features import SERIES, parse_version, series_name
from apir.ggml.functions import SIGNATURE_LETTERS as _CODES

__all__ = ["Abi", "UnsupportedGgmlVersion", "abi_for", "SUPPORTED_VERSIONS", "IFACE_FIELDS"]

# GGML_BACKEND_API_VERSION 2 interface tables, in C field order (ggml-backend-impl.h of both
# ggml 0.10.1 and 0.20.2: the two headers are identical).
_IFACES_API2: Dict[str, List[Tuple[str, str]]] = {
    "ggml_backend_buffer_type_i": [
        ("get_name", "p:p"),
        ("alloc_buffer", "p:pz"),
        ("get_alignment", "z:p"),
        ("get_max_size", "z:p"),
        ("get_alloc_size", "z:pp"),
        ("is_host", "b:p"),
    ],
    "ggml_backend_buffer_i": [
        ("free_buffer", "v:p"),
        ("get_base", "p:p"),
        ("init_tensor", "i:pp"),
        ("memset_tensor", "v:ppBzz"),
        ("set_tensor", "v:pppzz"),
        ("get_tensor", "v:pppzz"),
        ("set_tensor_2d", "v:pppzzzzz"),
        ("get_tensor_2d", "v:pppzzzzz"),
        ("cpy_tensor", "b:ppp"),
        ("clear", "v:pB"),
        ("reset", "v:p"),
    ],
    "ggml_backend_i": [
        ("get_name", "p:p"),
        ("free", "v:p"),
        ("set_tensor_async", "v:pppzz"),
        ("get_tensor_async", "v:pppzz"),
        ("set_tensor_2d_async", "v:pppzzzzz"),
        ("get_tensor_2d_async", "v:pppzzzzz"),
        ("cpy_tensor_async", "b:pppp"),
        ("synchronize", "v:p"),
        ("graph_plan_create", "p:pp"),
        ("graph_plan_free", "v:pp"),
        ("graph_plan_update", "v:ppp"),
        ("graph_plan_compute", "i:pp"),
        ("graph_compute", "i:pp"),
        ("event_record", "v:pp"),
        ("event_wait", "v:pp"),
        ("graph_optimize", "v:pp"),
    ],
    "ggml_backend_device_i": [
        ("get_name", "p:p"),
        ("get_description", "p:p"),
        ("get_memory", "v:ppp"),
        ("get_type", "i:p"),
        ("get_props", "v:pp"),
        ("init_backend", "p:pp"),
        ("get_buffer_type", "p:p"),
        ("get_host_buffer_type", "p:p"),
        ("buffer_from_host_ptr", "p:ppzz"),
        ("supports_op", "b:pp"),
        ("supports_buft", "b:pp"),
        ("offload_op", "b:pp"),
        ("event_new", "p:p"),
        ("event_free", "v:pp"),
        ("event_synchronize", "v:pp"),
    ],
    "ggml_backend_reg_i": [
        ("get_name", "p:p"),
        ("get_device_count", "z:p"),
        ("get_device", "p:pz"),
        ("get_proc_address", "p:pp"),
    ],
}

# ggml 0.25 (llama-cpp-python 0.3.36's llama.cpp): the same tables, but graph_optimize takes a
# third argument, `struct ggml_backend_graph_optimize_params *` (allocation dependencies).
_IFACES_API2_OPTIMIZE_PARAMS: Dict[str, List[Tuple[str, str]]] = {
    **_IFACES_API2,
    "ggml_backend_i": [
        (name, "v:ppp" if name == "graph_optimize" else sig) for name, sig in _IFACES_API2["ggml_backend_i"]
    ],
}

# Public for the layout test: every iface struct's C name and field names.
IFACE_FIELDS: Dict[str, List[str]] = {k: [f for f, _ in v] for k, v in _IFACES_API2.items()}


@dataclass(frozen=True)
class _Spec:
    backend_api_version: int  # GGML_BACKEND_API_VERSION, written into ggml_backend_reg
    ifaces: Dict[str, List[Tuple[str, str]]]
    caps: Tuple[str, ...]  # struct ggml_backend_dev_caps, all bool


# The interface tables of each API series (apir.ggml.features.SERIES).
_IFACES: Dict[str, Dict[str, List[Tuple[str, str]]]] = {
    "0.10": _IFACES_API2,
    "0.20": _IFACES_API2,
    "0.25": _IFACES_API2_OPTIMIZE_PARAMS,
}


def _spec(series: str) -> _Spec:
    # A build's ggml_backend_dev_caps are what its C guest's device_get_props carries: the
    # booleans of the APIR version its series speaks (tests/guest_backend/test_abi.py checks
    # them against each version's header).
    s = SERIES[series]
    props = FORWARD[ApirBackendCommandType.DEVICE_GET_PROPS].reply_in(s.apir_protocol)
    return _Spec(s.backend_api_version, _IFACES[series], tuple(f.name for f in props))


# The API series whose backend structs are declared here ("0.10", "0.20").
SUPPORTED_VERSIONS = tuple(s for s in SERIES if s in _IFACES)


class UnsupportedGgmlVersion(ApirError, RuntimeError):
    """The loaded ggml's API series has no backend structs declared in apir (see
    `SUPPORTED_VERSIONS`)."""


def _proto(sig: str):
    res, _, args = sig.partition(":")
    # "v" (void, None) is a result type only, so every argument code maps to a ctypes type.
    arg_types: List[Any] = [_CODES[c] for c in args]
    return ctypes.CFUNCTYPE(_CODES[res], *arg_types)


class Abi:
    """The ctypes classes of one ggml API series' backend structs.

    Iface structs: `BufferTypeI`, `BufferI`, `BackendI`, `DeviceI`, `RegI` (fields are
    CFUNCTYPE pointers, NULL when unset; `protos[cname][field]` is each field's CFUNCTYPE).
    Objects: `BufferType`, `Buffer`, `Backend`, `Device`, `Reg`. Properties: `DevCaps`,
    `DevProps`. `structs` maps each C struct name to its class."""

    def __init__(self, series: str, spec: _Spec):
        self.series = series  # the ggml API series, "0.20"
        self.backend_api_version = spec.backend_api_version
        self.protos: Dict[str, Dict[str, object]] = {}
        ifaces = {}
        for cname, fields in spec.ifaces.items():
            self.protos[cname] = {name: _proto(sig) for name, sig in fields}
            ifaces[cname] = type(
                cname, (ctypes.Structure,), {"_fields_": [(n, self.protos[cname][n]) for n, _ in fields]}
            )
        P, Z = ctypes.c_void_p, ctypes.c_size_t
        self.BufferTypeI = ifaces["ggml_backend_buffer_type_i"]
        self.BufferI = ifaces["ggml_backend_buffer_i"]
        self.BackendI = ifaces["ggml_backend_i"]
        self.DeviceI = ifaces["ggml_backend_device_i"]
        self.RegI = ifaces["ggml_backend_reg_i"]

        def struct(cname, fields):
            return type(cname, (ctypes.Structure,), {"_fields_": fields})

        self.BufferType = struct(
            "ggml_backend_buffer_type", [("iface", self.BufferTypeI), ("device", P), ("context", P)]
        )
        self.Buffer = struct(
            "ggml_backend_buffer",
            [("iface", self.BufferI), ("buft", P), ("context", P), ("size", Z), ("usage", ctypes.c_int)],
        )
        self.Backend = struct("ggml_backend", [("guid", P), ("iface", self.BackendI), ("device", P), ("context", P)])
        self.Device = struct("ggml_backend_device", [("iface", self.DeviceI), ("reg", P), ("context", P)])
        self.Reg = struct("ggml_backend_reg", [("api_version", ctypes.c_int), ("iface", self.RegI), ("context", P)])
        self.Event = struct("ggml_backend_event", [("device", P), ("context", P)])
        self.DevCaps = struct("ggml_backend_dev_caps", [(c, ctypes.c_bool) for c in spec.caps])
        self.DevProps = struct(
            "ggml_backend_dev_props",
            [
                ("name", P),
                ("description", P),
                ("memory_free", Z),
                ("memory_total", Z),
                ("type", ctypes.c_int),
                ("device_id", P),
                ("caps", self.DevCaps),
            ],
        )
        # C struct name -> class, for the layout test.
        self.structs = {
            c.__name__: c
            for c in (
                self.BufferTypeI,
                self.BufferI,
                self.BackendI,
                self.DeviceI,
                self.RegI,
                self.BufferType,
                self.Buffer,
                self.Backend,
                self.Device,
                self.Reg,
                self.DevCaps,
                self.DevProps,
            )
        }
        # ggml_backend_buffer_init, typed for this version's BufferI (made on first use)
        self._buffer_init: Optional[Callable[..., Optional[int]]] = None
        self._lock = threading.Lock()

    def buffer_init(self, g):
        """`ggml_backend_buffer_init(buft, iface, context, size) -> ggml_backend_buffer_t`
        (ggml-backend.cpp) with `iface` typed as this version's `BufferI`, passed by value."""
        with self._lock:
            if self._buffer_init is None:
                for cdll in g.cdlls:
                    fn = getattr(cdll, "ggml_backend_buffer_init", None)
                    if fn is not None:
                        proto = ctypes.CFUNCTYPE(
                            ctypes.c_void_p, ctypes.c_void_p, self.BufferI, ctypes.c_void_p, ctypes.c_size_t
                        )
                        self._buffer_init = ctypes.cast(fn, proto)
                        break
                else:
                    raise GgmlLoadError(f"ggml_backend_buffer_init: not in {g.lib_dir}")
            return self._buffer_init


_abis: Dict[str, Abi] = {}
_abis_lock = threading.Lock()


def abi_for(g) -> Abi:
    """The `Abi` of the loaded ggml `g`, by the API series of `g.version` ("0.20" for every
    0.20.x). Raises UnsupportedGgmlVersion."""
    series = series_name(parse_version(g.version))
    with _abis_lock:
        abi = _abis.get(series)
        if abi is None:
            if series not in SUPPORTED_VERSIONS:
                raise UnsupportedGgmlVersion(
                    f"ggml {g.version!r} ({getattr(g, 'lib_dir', '?')}): apir declares the backend structs "
                    f"of ggml-backend-impl.h only for the ggml API series {', '.join(SUPPORTED_VERSIONS)}"
                )
            abi = _abis[series] = Abi(series, _spec(series))
        return abi
