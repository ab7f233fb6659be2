"""The C backend library (ggml's libggml-virtgpu-backend.so) as an apir `BackendLibrary`.

Theory of operation: virglrenderer's APIR component dlopens the backend library named by
`apir.load_library.path` and calls three of its symbols. `CLibrary` does the same through
ctypes, so apir's `HostContext` can serve a guest with the C dispatcher instead of the Python one:

    initialize(host)           apir_backend_initialize(ctx_id, &callbacks)
    dispatch(fid, dec, enc)    apir_backend_dispatcher(ctx_id, &callbacks, fid, dec_cur, dec_end,
                                                       enc_cur, enc_end, &enc_cur_after)
    deinit()                   apir_backend_deinit(ctx_id), once the last context is gone

The C keeps its state in process globals and initializes once, so one `_Shared` object per
library file holds it for the whole process and each context gets its own `CLibrary` view onto
it; calls into the C are serialized by one lock. The adapter serves buffer_free_buffer itself
(the C frees without ggml's NULL check), frees a context's own buffers when it closes, and
clears each buffer alloc_buffer returns. The C trusts the guest: hostile bytes can crash the
host, kept on purpose (interoperability, not a hardened host). docs/interop.md gives the
callbacks, each of these choices and why, and the one-ggml-per-process check of `initialize`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
import threading
from pathlib import Path
from typing import Dict, Optional

from apir.codec.constants import (
    ApirBackendCommandType,
    ApirBackendInitializeReturnCode,
    ApirLoadLibraryReturnCode,
)
from apir.host.config import CONFIG_KEY_GGML_LIBRARY_PATH
from apir.codec.wire import Decoder, Encoder
from apir.host.library import LibraryHost, LibraryLoadError

__all__ = ["CLibrary", "c_library_factory", "VirglApirCallbacks"]

log = logging.getLogger(__name__)

# const char *(*get_config)(uint32_t virgl_ctx_id, const char *key): the returned pointer must
# stay valid while the C uses it, so it is declared void * and points into a buffer we keep.
GET_CONFIG = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32, ctypes.c_char_p)
# void *(*get_shmem_ptr)(uint32_t virgl_ctx_id, uint32_t res_id)
GET_SHMEM_PTR = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32)


class VirglApirCallbacks(ctypes.Structure):
    """`struct virgl_apir_callbacks` (backend/backend-virgl-apir.h)."""

    _fields_ = [("get_config", GET_CONFIG), ("get_shmem_ptr", GET_SHMEM_PTR)]


# Globals of the C library that its deinit leaves set: reset after deinit so that a later
# apir_backend_initialize registers the ggml backend again instead of answering ALREADY_INITED.
_C_GLOBALS = ("reg", "dev", "bck")
_RC_SUCCESS = ApirLoadLibraryReturnCode.INIT_BASE_INDEX  # 6 + APIR_BACKEND_INITIALIZE_SUCCESS
# bool apir_untrack_backend_buffer(ggml_backend_buffer_t) (backend/apir_cs_ggml-rpc-back.cpp), C++
_UNTRACK_SYMBOL = "_Z27apir_untrack_backend_bufferP19ggml_backend_buffer"
# Functions whose reply starts with a new buffer handle, and the one the adapter serves itself.
_BUFFER_CREATORS = (ApirBackendCommandType.DEVICE_BUFFER_FROM_PTR, ApirBackendCommandType.BUFFER_TYPE_ALLOC_BUFFER)
_FREE_BUFFER = ApirBackendCommandType.BUFFER_FREE_BUFFER
_ALLOC_BUFFER = ApirBackendCommandType.BUFFER_TYPE_ALLOC_BUFFER
_RC_OK, _RC_ERROR = 0, 1  # what the C handlers return
_U64 = struct.Struct("<Q")


class _Shared:
    """One loaded C backend library: handle, callbacks and the hosts of live contexts."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.cdll = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
        except OSError as exc:
            raise LibraryLoadError(
                ApirLoadLibraryReturnCode.CANNOT_OPEN, f"cannot open the APIR backend library {path!r}: {exc}"
            ) from exc
        try:
            self.initialize_fn = self.cdll.apir_backend_initialize
            self.dispatcher_fn = self.cdll.apir_backend_dispatcher
            self.deinit_fn = self.cdll.apir_backend_deinit
        except AttributeError as exc:
            raise LibraryLoadError(
                ApirLoadLibraryReturnCode.SYMBOL_MISSING, f"{path}: missing APIR backend symbol: {exc}"
            ) from exc
        self.initialize_fn.argtypes = [ctypes.c_uint32, ctypes.POINTER(VirglApirCallbacks)]
        self.initialize_fn.restype = ctypes.c_uint32
        self.dispatcher_fn.argtypes = [
            ctypes.c_uint32,
            ctypes.POINTER(VirglApirCallbacks),
            ctypes.c_uint32,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_void_p),
        ]
        self.dispatcher_fn.restype = ctypes.c_uint32
        self.deinit_fn.argtypes = [ctypes.c_uint32]
        self.deinit_fn.restype = None
        try:
            self.untrack_fn = getattr(self.cdll, _UNTRACK_SYMBOL)
            # resolved through the library's own dependencies: its libggml-base
            self.buffer_free_fn = self.cdll.ggml_backend_buffer_free
            self.buffer_clear_fn = self.cdll.ggml_backend_buffer_clear
        except AttributeError as exc:
            raise LibraryLoadError(
                ApirLoadLibraryReturnCode.SYMBOL_MISSING, f"{path}: missing symbol the adapter needs: {exc}"
            ) from exc
        self.untrack_fn.argtypes = [ctypes.c_void_p]
        self.untrack_fn.restype = ctypes.c_bool
        self.buffer_free_fn.argtypes = [ctypes.c_void_p]
        self.buffer_free_fn.restype = None
        self.buffer_clear_fn.argtypes = [ctypes.c_void_p, ctypes.c_uint8]
        self.buffer_clear_fn.restype = None
        # The libggml-base this library bound to: the first copy the process loaded.
        self.ggml_base = _file_of_symbol(self.cdll, "ggml_backend_buffer_get_base")
        self.lock = threading.RLock()
        self.hosts: Dict[int, LibraryHost] = {}
        self.initialized = False
        self._config_strings: Dict[tuple, ctypes.Array] = {}
        # Kept as attributes: the C holds these function pointers for as long as it runs.
        self._get_config = GET_CONFIG(self._cb_get_config)
        self._get_shmem_ptr = GET_SHMEM_PTR(self._cb_get_shmem_ptr)
        self.callbacks = VirglApirCallbacks(self._get_config, self._get_shmem_ptr)

    # --- callbacks (run on the thread that called into the C, under self.lock) ---------------
    def _cb_get_config(self, ctx_id: int, key: bytes) -> Optional[int]:
        try:
            host = self.hosts.get(ctx_id)
            value = host.get_config(key.decode()) if host is not None else None
            if value is None:
                return None
            buf = ctypes.create_string_buffer(value.encode())
            # The C keeps the pointer (the library path) past the call: keep the buffer alive.
            self._config_strings[(ctx_id, key)] = buf
            return ctypes.addressof(buf)
        except Exception:  # noqa: BLE001 - an exception must not unwind through C frames
            log.exception("get_config(%d, %r) failed", ctx_id, key)
            return None

    def _cb_get_shmem_ptr(self, ctx_id: int, res_id: int) -> Optional[int]:
        try:
            host = self.hosts.get(ctx_id)
            res = host.get_shmem(res_id) if host is not None else None
            if res is None:
                log.error("ctx %d: get_shmem_ptr: unknown resource %d", ctx_id, res_id)
                return None
            return res.address
        except Exception:  # noqa: BLE001
            log.exception("get_shmem_ptr(%d, %d) failed", ctx_id, res_id)
            return None

    def free_buffer(self, handle: int) -> bool:
        """The C buffer_free_buffer with ggml's NULL-safe free; False for an unknown handle.
        Call with self.lock held."""
        if not handle or not self.untrack_fn(handle):
            return False
        self.buffer_free_fn(handle)
        return True

    def reset_globals(self) -> None:
        for name in _C_GLOBALS:
            try:
                ctypes.c_void_p.in_dll(self.cdll, name).value = None
            except ValueError:  # not exported by this build: a re-initialize will fail
                log.warning("%s: global %r not exported; the library cannot be initialized again", self.path, name)


_shared: Dict[str, _Shared] = {}
_shared_lock = threading.Lock()


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _file_of_symbol(cdll: ctypes.CDLL, name: str) -> Optional[str]:
    """The shared object that `name`, as `cdll` resolves it, comes from (dladdr), or None."""
    try:
        addr = ctypes.cast(getattr(cdll, name), ctypes.c_void_p).value
    except AttributeError:
        return None
    libc = ctypes.CDLL(None)
    libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    info = _DlInfo()
    if not libc.dladdr(addr, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(info.dli_fname.decode())


def _ggml_mismatch(bound_base: Optional[str], ggml_library: Optional[str]) -> Optional[str]:
    """None when the libggml-base the C library bound to is the one beside the ggml backend
    library it is configured to dlopen (or either is unknown), else a message."""
    if bound_base is None or not ggml_library:
        return None
    sibling = Path(ggml_library).resolve().parent / "libggml-base.so"
    if not sibling.exists() or os.path.samefile(sibling, bound_base):
        return None
    return (
        f"the C backend library bound libggml-base to {bound_base}, but the ggml library "
        f"{ggml_library} belongs to {sibling}: two ggml builds would mix in one process "
        f"(run this host with APIR_GGML_LIB_DIR / APIR_GGML_INCLUDE_DIR set to that build)"
    )


class CLibrary:
    """One context's view of a C backend library (see the module docstring)."""

    def __init__(self, shared: _Shared):
        self._shared = shared
        self._host: Optional[LibraryHost] = None
        self._active = False  # counted in shared.hosts for this context
        self._buffers: set[int] = set()  # buffer handles the C created for this context

    @classmethod
    def open(cls, path: str) -> "CLibrary":
        """Loads (once per process) the backend library at `path`.

        Raises LibraryLoadError: CANNOT_OPEN when dlopen fails, SYMBOL_MISSING when an
        apir_backend_* symbol is absent.
        """
        key = os.path.realpath(path)
        with _shared_lock:
            shared = _shared.get(key)
            if shared is None:
                shared = _Shared(path)
                _shared[key] = shared
        return cls(shared)

    @property
    def path(self) -> str:
        return self._shared.path

    def initialize(self, host: LibraryHost) -> int:
        """`apir_backend_initialize`: 3/4/5, or 6 + APIR_BACKEND_INITIALIZE_* (6 = success).
        Only the first context of the process runs the C initialization; later ones share it
        (and its ggml library, whatever their own configuration names)."""
        sh = self._shared
        with sh.lock:
            if host.ctx_id in sh.hosts and sh.hosts[host.ctx_id] is not host:
                log.error("ctx %d: already served by this C library in this process", host.ctx_id)
                return ApirLoadLibraryReturnCode.HYPERCALL_INITIALIZATION_ERROR
            sh.hosts[host.ctx_id] = host
            self._host = host
            self._active = True
            if sh.initialized:
                return _RC_SUCCESS
            mismatch = _ggml_mismatch(sh.ggml_base, host.get_config(CONFIG_KEY_GGML_LIBRARY_PATH))
            if mismatch is not None:
                log.error("ctx %d: %s", host.ctx_id, mismatch)
                return _RC_SUCCESS + ApirBackendInitializeReturnCode.CANNOT_OPEN_GGML_LIBRARY
            rc = int(sh.initialize_fn(host.ctx_id, ctypes.byref(sh.callbacks)))
            if rc == _RC_SUCCESS:
                sh.initialized = True
            log.info("ctx %d: apir_backend_initialize(%s) = %d", host.ctx_id, sh.path, rc)
            return rc

    def dispatch(self, function_id: int, dec: Decoder, enc: Encoder) -> int:
        """`apir_backend_dispatcher` over the decoder's remaining bytes and the encoder's room.
        Returns the C's code (0 success, 1 failure, 6 invalid function id); the encoder advances
        by what the C wrote. buffer_free_buffer is served here (docs/interop.md says why)."""
        sh = self._shared
        host = self._host
        if host is None or not sh.initialized:
            log.error("Forward to %s before it was initialized", sh.path)
            return _RC_ERROR
        if function_id == _FREE_BUFFER:
            return self._free_buffer(dec, host.ctx_id)
        n_in = dec.end - dec.pos
        # One spare byte: a zero-length ctypes array has no address to give the C.
        cmd = (ctypes.c_char * (n_in + 1)).from_buffer_copy(bytes(dec.buf[dec.pos : dec.end]) + b"\0")
        cmd_addr = ctypes.addressof(cmd)
        start = enc.pos
        room = enc.end - start
        out = (ctypes.c_char * room).from_buffer(enc.buf, start) if room > 0 else ctypes.create_string_buffer(1)
        out_addr = ctypes.addressof(out)
        after = ctypes.c_void_p(out_addr)
        with sh.lock:
            rc = int(
                sh.dispatcher_fn(
                    host.ctx_id,
                    ctypes.byref(sh.callbacks),
                    function_id,
                    cmd_addr,
                    cmd_addr + n_in,
                    out_addr,
                    out_addr + room,
                    ctypes.byref(after),
                )
            )
        written = (after.value or 0) - out_addr
        del out  # drop the export of the reply resource's memory before anyone closes it
        dec.pos = dec.end
        if not 0 <= written <= room:
            log.error("ctx %d: C dispatcher reports %d reply bytes for a %d-byte window", host.ctx_id, written, room)
            enc.fatal = True
            return rc
        enc.pos += written
        if function_id in _BUFFER_CREATORS and rc == _RC_OK and written >= _U64.size:
            handle = _U64.unpack_from(enc.buf, start)[0]
            if handle:
                self._buffers.add(handle)
                if function_id == _ALLOC_BUFFER:
                    with sh.lock:  # the C hands out heap memory as it was left
                        sh.buffer_clear_fn(handle, 0)
        return rc

    def _free_buffer(self, dec: Decoder, ctx_id: int) -> int:
        handle = dec.handle()
        if dec.fatal or not handle:
            log.error("ctx %d: buffer_free_buffer: invalid buffer handle", ctx_id)
            return _RC_ERROR
        with self._shared.lock:
            if not self._shared.free_buffer(handle):
                log.warning("ctx %d: buffer_free_buffer: unknown buffer %#x", ctx_id, handle)
                return _RC_ERROR
        self._buffers.discard(handle)
        return _RC_OK

    def deinit(self) -> None:
        """Frees this context's buffers and drops the context; the last one runs
        `apir_backend_deinit` and resets the C globals so the library can initialize again."""
        sh = self._shared
        with sh.lock:
            host = self._host
            if not self._active or host is None:  # _active: initialize set _host
                return
            self._active = False
            ctx_id = host.ctx_id
            sh.hosts.pop(ctx_id, None)
            # This context's leftovers (another context may have freed one: untrack says so).
            freed = sum(sh.free_buffer(h) for h in self._buffers)
            if freed:
                log.info("ctx %d: freed %d buffer(s) the guest left", ctx_id, freed)
            self._buffers.clear()
            if sh.hosts or not sh.initialized:
                return
            sh.deinit_fn(ctx_id)
            sh.reset_globals()
            sh.initialized = False
            log.info("ctx %d: apir_backend_deinit(%s)", ctx_id, sh.path)

    # What the component asks beyond the C seam, which has no symbol for it: a compute in the
    # C cannot be stopped, its buffers over a blob are its own to free, and it counts nothing.
    def cancel_compute(self, reason: str) -> None:
        pass

    def forget_resource(self, res_id: int) -> None:
        pass

    def buffer_count(self) -> Optional[int]:
        return None

    @property
    def commands_bounded_in_time(self) -> bool:
        return False  # a library of unknown kind: its copies may wait on a device


def c_library_factory(path: str) -> CLibrary:
    """A `library_factory` for `HostContext` (its default): every configured path is a C
    backend library. Raises LibraryLoadError: CANNOT_OPEN when dlopen fails, SYMBOL_MISSING
    when an apir_backend_* symbol is absent."""
    return CLibrary.open(str(Path(path)))
