"""The guest's exceptions: a class per thing that can go wrong, under apir's one root
`ApirError` (apir.errors, re-exported here).

Theory of operation: the C guest aborts the process on every failure (GGML_ABORT); apir
raises instead, and the class says whose fault it is and what to fix:

- the device (transport) layer: `DeviceError` (`DeviceNotFound`, `MissingCapability`,
  `IoctlError` with the node, request and errno);
- the wait: `ApirTimeout` when the host does not answer within the call's limit;
- HandShake: `HandshakeError`;
- LoadLibrary: `LoadLibraryError` and one subclass per return code of api_remoting.h,
  `BackendInitializeError` and one subclass per `apir_backend_initialize` code
  (apir_backend.h) carried as INIT_BASE_INDEX + n;
- Forward: `ForwardError` for the component's own codes (no backend loaded, host timeout,
  stream sync), `BackendFunctionError` when the backend function returned non-zero;
- `ReplyError` when a reply is shorter than what the function must return.

`load_library_error(code)` and `forward_error(code, function)` map a return code to its
exception, so the client has one place that knows the taxonomy.
"""

from __future__ import annotations

import enum
from typing import Dict, Optional, Type

from apir.codec.constants import (
    ApirBackendCommandType,
    ApirExtensionCommandType,
    ApirBackendInitializeReturnCode,
    ApirForwardReturnCode,
    ApirLoadLibraryReturnCode,
)
from apir.errors import ApirError

__all__ = [
    "ApirError",
    "DeviceError",
    "DeviceNotFound",
    "MissingCapability",
    "IoctlError",
    "ApirTimeout",
    "HandshakeError",
    "ReplyError",
    "LoadLibraryError",
    "LoadLibraryHypercallError",
    "LibraryAlreadyLoaded",
    "LoadLibraryConfigMissing",
    "LoadLibraryCannotOpen",
    "LoadLibrarySymbolMissing",
    "BackendInitializeError",
    "BackendCannotOpenBackendLibrary",
    "BackendCannotOpenGgmlLibrary",
    "BackendMissingBackendSymbols",
    "BackendMissingGgmlSymbols",
    "BackendFailed",
    "BackendRegFailed",
    "BackendAlreadyInited",
    "BackendNoDevice",
    "BackendInitFailed",
    "ForwardError",
    "NoDispatchFunction",
    "HostForwardTimeout",
    "FailedToSyncStreams",
    "BackendFunctionError",
    "PostedCommandError",
    "load_library_error",
    "forward_error",
]


# --- device / transport -------------------------------------------------------------------
class DeviceError(ApirError):
    """The virtgpu device (kernel driver or another transport) failed or is unusable."""


class DeviceNotFound(DeviceError):
    """No render node whose driver is virtio_gpu (or the given node is not one)."""


class MissingCapability(DeviceError):
    """The device lacks something APIR needs. `node` names the device, `capability` the
    feature (e.g. "blob resources", "context init", "capset 10 (APIR)")."""

    def __init__(self, node: str, capability: str, detail: str = ""):
        self.node = node
        self.capability = capability
        msg = f"{node}: the virtgpu device does not offer {capability}"
        super().__init__(msg + (f" ({detail})" if detail else ""))


class IoctlError(DeviceError):
    """An ioctl failed: `node`, `request` (the C name), `errno`."""

    def __init__(self, node: str, request: str, errno: int, strerror: str):
        self.node = node
        self.request = request
        self.errno = errno
        super().__init__(f"{node}: {request} failed: [errno {errno}] {strerror}")


# --- the wait -------------------------------------------------------------------------------
class ApirTimeout(ApirError):
    """The host did not store the reply notification within `limit_s` seconds."""

    def __init__(self, command: str, limit_s: float):
        self.command = command
        self.limit_s = limit_s
        super().__init__(f"{command}: no reply from the APIR host within {limit_s:g} s")


class HandshakeError(ApirError):
    """HandShake returned `code` instead of the magic 0xab1e."""

    def __init__(self, code: int):
        self.code = code
        super().__init__(f"HandShake refused by the host (code {code}, expected 0xab1e)")


class ReplyError(ApirError):
    """A reply is shorter than the values the function returns (a confused or hostile host)."""


# --- LoadLibrary ------------------------------------------------------------------------------
class LoadLibraryError(ApirError):
    """LoadLibrary failed; `code` is the raw return code."""

    reason = "the host could not load the APIR backend library"

    def __init__(self, code: int, detail: str = ""):
        self.code = code
        super().__init__(f"LoadLibrary: {self.reason} (code {code}{', ' + detail if detail else ''})")


class LoadLibraryHypercallError(LoadLibraryError):
    reason = "hypercall initialization error"


class LibraryAlreadyLoaded(LoadLibraryError):
    reason = "a backend library is already loaded in this context"


class LoadLibraryConfigMissing(LoadLibraryError):
    reason = (
        "the hypervisor did not configure the backend library path "
        "(apir.load_library.path / VIRGL_APIR_BACKEND_LIBRARY)"
    )


class LoadLibraryCannotOpen(LoadLibraryError):
    reason = "the host could not open the backend library"


class LoadLibrarySymbolMissing(LoadLibraryError):
    reason = "the backend library lacks the apir_backend_* symbols"


def _name(codes: Type[enum.IntEnum], value: int) -> str:
    try:
        return codes(value).name
    except ValueError:
        return "unknown"


class BackendInitializeError(LoadLibraryError):
    """The backend library loaded, but its `apir_backend_initialize` returned `init_code`, a
    LoadLibrary code of its own: below INIT_BASE_INDEX it could not load the ggml backend
    library (`ggml_load_code`: ENV_VAR_MISSING, CANNOT_OPEN, SYMBOL_MISSING), else it carries
    backend_dispatch_initialize's APIR_BACKEND_INITIALIZE_* code as INIT_BASE_INDEX + n
    (`backend_code` = n). The C guest reads the code the same way (virtgpu.cpp,
    create_virtgpu's LoadLibrary error path)."""

    reason = "the backend library failed to initialize"

    def __init__(self, code: int, init_code: int):
        self.init_code = init_code
        base = ApirLoadLibraryReturnCode.INIT_BASE_INDEX
        self.ggml_load_code: Optional[int] = None
        self.backend_code: Optional[int] = None
        if init_code < base:
            self.ggml_load_code = init_code
            detail = f"apir_backend_initialize returned {init_code} ({_name(ApirLoadLibraryReturnCode, init_code)})"
        else:
            n = self.backend_code = init_code - base
            name = _name(ApirBackendInitializeReturnCode, n)
            detail = f"apir_backend_initialize returned {init_code}: {base} + {n} ({name})"
        super().__init__(code, detail)


class BackendGgmlLibraryError(BackendInitializeError):
    reason = "the backend library could not load the ggml backend library (ggml.library.path / .reg)"


class BackendCannotOpenBackendLibrary(BackendInitializeError):
    reason = "the backend could not open its own library"


class BackendCannotOpenGgmlLibrary(BackendInitializeError):
    reason = "the backend could not open the ggml backend library (ggml.library.path)"


class BackendMissingBackendSymbols(BackendInitializeError):
    reason = "the backend library lacks symbols"


class BackendMissingGgmlSymbols(BackendInitializeError):
    reason = "the ggml backend library lacks its registration symbol (ggml.library.reg)"


class BackendFailed(BackendInitializeError):
    reason = "the ggml backend failed"


class BackendRegFailed(BackendInitializeError):
    reason = "the ggml backend registration failed"


class BackendAlreadyInited(BackendInitializeError):
    reason = "the backend is already initialized"


class BackendNoDevice(BackendInitializeError):
    reason = "the ggml backend has no device"


class BackendInitFailed(BackendInitializeError):
    reason = "the ggml backend's init failed"


# Keyed by int: the codes come off the wire as plain ints (IntEnum members hash alike).
_LOAD_LIBRARY: Dict[int, Type[LoadLibraryError]] = {
    ApirLoadLibraryReturnCode.HYPERCALL_INITIALIZATION_ERROR: LoadLibraryHypercallError,
    ApirLoadLibraryReturnCode.ALREADY_LOADED: LibraryAlreadyLoaded,
    ApirLoadLibraryReturnCode.ENV_VAR_MISSING: LoadLibraryConfigMissing,
    ApirLoadLibraryReturnCode.CANNOT_OPEN: LoadLibraryCannotOpen,
    ApirLoadLibraryReturnCode.SYMBOL_MISSING: LoadLibrarySymbolMissing,
}
# apir_backend_initialize's codes below INIT_BASE_INDEX: it could not load the ggml library
_GGML_LOAD = frozenset(
    int(c)
    for c in (
        ApirLoadLibraryReturnCode.ENV_VAR_MISSING,
        ApirLoadLibraryReturnCode.CANNOT_OPEN,
        ApirLoadLibraryReturnCode.SYMBOL_MISSING,
    )
)
# ... and at or above it, INIT_BASE_INDEX + backend_dispatch_initialize's code:
_BACKEND_INIT: Dict[int, Type[BackendInitializeError]] = {
    ApirBackendInitializeReturnCode.CANNOT_OPEN_BACKEND_LIBRARY: BackendCannotOpenBackendLibrary,
    ApirBackendInitializeReturnCode.CANNOT_OPEN_GGML_LIBRARY: BackendCannotOpenGgmlLibrary,
    ApirBackendInitializeReturnCode.MISSING_BACKEND_SYMBOLS: BackendMissingBackendSymbols,
    ApirBackendInitializeReturnCode.MISSING_GGML_SYMBOLS: BackendMissingGgmlSymbols,
    ApirBackendInitializeReturnCode.BACKEND_FAILED: BackendFailed,
    ApirBackendInitializeReturnCode.BACKEND_REG_FAILED: BackendRegFailed,
    ApirBackendInitializeReturnCode.ALREADY_INITED: BackendAlreadyInited,
    ApirBackendInitializeReturnCode.NO_DEVICE: BackendNoDevice,
    ApirBackendInitializeReturnCode.BACKEND_INIT_FAILED: BackendInitFailed,
}


def load_library_error(code: int) -> Optional[LoadLibraryError]:
    """The exception for LoadLibrary return `code`, or None for success."""
    if code == ApirLoadLibraryReturnCode.SUCCESS:
        return None
    base = ApirLoadLibraryReturnCode.INIT_BASE_INDEX
    if code >= base:
        init_code = code - base  # apir_backend_initialize's own LoadLibrary code
        if init_code in _GGML_LOAD:
            return BackendGgmlLibraryError(code, init_code)
        return _BACKEND_INIT.get(init_code - base, BackendInitializeError)(code, init_code)
    return _LOAD_LIBRARY.get(code, LoadLibraryError)(code)


# --- Forward ----------------------------------------------------------------------------------
class ForwardError(ApirError):
    """Forward of backend function `function` failed with the component's `code`."""

    reason = "the host could not forward the call"

    def __init__(self, code: int, function: str):
        self.code = code
        self.function = function
        super().__init__(f"{function}: {self.reason} (Forward code {code})")


class NoDispatchFunction(ForwardError):
    reason = "no backend library is loaded (LoadLibrary first)"


class HostForwardTimeout(ForwardError):
    reason = "the host timed out"


class FailedToSyncStreams(ForwardError):
    reason = "the host failed to synchronize its streams"


class BackendFunctionError(ForwardError):
    """The backend function ran and returned `function_code` != 0 (bad handle, bad
    arguments, function id out of range: APIR_BACKEND_FORWARD_INDEX_INVALID)."""

    reason = "the backend function failed"

    def __init__(self, code: int, function: str):
        self.function_code = code - ApirForwardReturnCode.BASE_INDEX
        super().__init__(code, function)
        self.args = (f"{function}: backend function returned {self.function_code}",)


class PostedCommandError(BackendFunctionError):
    """A posted command (the ASYNC extension) failed: reported at the next synchronization
    point. `function` names it, `code` is the Forward return code it would have had waited
    for, `index` its place among the commands posted since the waited-for one before it, and
    `posted` what the guest sent there (None when the guest does not know)."""

    def __init__(self, code: int, function: str, index: int, posted: Optional[str] = None):
        super().__init__(code, function)
        self.index = index
        self.posted = posted
        what = posted or function
        self.args = (f"posted command #{index}, {what}, failed: backend function returned {self.function_code}",)


_BASE_INDEX = int(ApirForwardReturnCode.BASE_INDEX)
_FORWARD: Dict[int, Type[ForwardError]] = {
    ApirForwardReturnCode.NO_DISPATCH_FCT: NoDispatchFunction,
    ApirForwardReturnCode.TIMEOUT: HostForwardTimeout,
    ApirForwardReturnCode.FAILED_TO_SYNC_STREAMS: FailedToSyncStreams,
}


def forward_error(code: int, function: int) -> Optional[ForwardError]:
    """The exception for Forward return `code` of backend function id `function`, or None
    when the function succeeded (code == BASE_INDEX)."""
    if code == _BASE_INDEX:  # the common case first: no enum lookups
        return None
    try:
        name = ApirBackendCommandType(function).c_name
    except ValueError:
        try:
            name = ApirExtensionCommandType(function).c_name
        except ValueError:
            name = f"backend function {function}"
    if code > ApirForwardReturnCode.BASE_INDEX:
        return BackendFunctionError(code, name)
    return _FORWARD.get(code, ForwardError)(code, name)
