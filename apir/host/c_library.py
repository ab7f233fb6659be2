"""The C backend library (ggml's libggml-virtgpu-backend.so) as an apir `BackendLibrary`.

Theory of operation: virglrenderer's APIR component dlopens the backend library named by
`apir.load_library.path` and calls three of its symbols. `CLibrary` does the same through
ctypes, so apir's `HostContext` (HandShake, resources, reply word) can serve a guest with the C
dispatcher instead of the Python one:

    initialize(host)           apir_backend_initialize(ctx_id, &callbacks)
    dispatch(fid, dec, enc)    apir_backend_dispatcher(ctx_id, &callbacks, fid, dec_cur, dec_end,
                                                       enc_cur, enc_end, &enc_cur_after)
    deinit()                   apir_backend_deinit(ctx_id), once the last context is gone

The callbacks are `virgl_apir_callbacks` (backend-virgl-apir.h): `get_config(ctx_id, key)`
answers from the `LibraryHost` of that ctx_id (its key/value table, then the environment), and
`get_shmem_ptr(ctx_id, res_id)` returns the address of that context's blob, or NULL.

The command bytes after the 12-byte header are copied into a private buffer (the C decoder
takes a `char *`); the C encoder writes straight into the reply resource, between the encoder's
position and its end, and the encoder is advanced by what the C reports in `enc_cur_after`.

The C library keeps its state in process globals (`reg`, `dev`, `bck`, the tracked buffer list),
initializes once (a second `apir_backend_initialize` answers ALREADY_INITED) and its deinit
frees the buffers of every context. So one `_Shared` object per library file holds the handle
and the initialization result for the whole process; every context gets its own `CLibrary`
view onto it; the C deinit runs when the last context that initialized it is closed, and the
globals are then reset so a later context can initialize again. Calls into the library are
serialized by one lock: nothing in the C is thread-safe.

Two ggml builds in one process do not mix: libggml-virtgpu-backend.so needs `libggml-base.so.0`
and binds to whichever copy the process loaded first, while the ggml backend library it dlopens
(`ggml.library.path`) brings its own. Run the C library in a process whose only ggml is the C
build's (e.g. `APIR_GGML_LIB_DIR` / `APIR_GGML_INCLUDE_DIR` pointing at a build-c-reference.sh
output, as docs/interop.md shows); `CLibrary.open` refuses a library that resolved
`libggml-base` to another file than the one `apir.ggml` already loaded.

Unlike apir's own dispatcher the C code trusts the guest: hostile bytes can crash the host
process. That is the C's behaviour, kept on purpose; use it for interoperability, not as a
hardened host.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import Dict, Optional

from apir.codec.constants import ApirLoadLibraryReturnCode
from apir.codec.wire import Decoder, Encoder
from apir.host.library import LibraryHost, LibraryLoadError

__all__ = ["CLibrary", "c_library_factory", "VirglApirCallbacks"]

log = logging.getLogger("apir.host.c_library")

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


class _Shared:
    """One loaded C backend library: handle, callbacks and the hosts of live contexts."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.cdll = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
        except OSError as exc:
            raise LibraryLoadError(ApirLoadLibraryReturnCode.CANNOT_OPEN,
                                   f"cannot open the APIR backend library {path!r}: {exc}") from exc
        try:
            self.initialize_fn = self.cdll.apir_backend_initialize
            self.dispatcher_fn = self.cdll.apir_backend_dispatcher
            self.deinit_fn = self.cdll.apir_backend_deinit
        except AttributeError as exc:
            raise LibraryLoadError(ApirLoadLibraryReturnCode.SYMBOL_MISSING,
                                   f"{path}: missing APIR backend symbol: {exc}") from exc
        self.initialize_fn.argtypes = [ctypes.c_uint32, ctypes.POINTER(VirglApirCallbacks)]
        self.initialize_fn.restype = ctypes.c_uint32
        self.dispatcher_fn.argtypes = [ctypes.c_uint32, ctypes.POINTER(VirglApirCallbacks), ctypes.c_uint32,
                                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.POINTER(ctypes.c_void_p)]
        self.dispatcher_fn.restype = ctypes.c_uint32
        self.deinit_fn.argtypes = [ctypes.c_uint32]
        self.deinit_fn.restype = None
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

    def reset_globals(self) -> None:
        for name in _C_GLOBALS:
            try:
                ctypes.c_void_p.in_dll(self.cdll, name).value = None
            except ValueError:  # not exported by this build: a re-initialize will fail
                log.warning("%s: global %r not exported; the library cannot be initialized again",
                            self.path, name)


_shared: Dict[str, _Shared] = {}
_shared_lock = threading.Lock()


def _same_ggml_base(cdll: ctypes.CDLL) -> Optional[str]:
    """None when `cdll` resolves ggml to the build `apir.ggml` loaded (or none is loaded yet),
    else a message naming the mismatch."""
    from apir.ggml import lib as ggml_lib

    loaded = list(ggml_lib._loaded.values())
    if not loaded:
        return None
    name = "ggml_backend_buffer_get_base"
    try:
        theirs = ctypes.cast(getattr(cdll, name), ctypes.c_void_p).value
    except AttributeError:
        return f"it does not resolve {name}"
    for g in loaded:
        ours = ctypes.cast(getattr(g.cdlls[0], name), ctypes.c_void_p).value
        if ours == theirs:
            return None
    return (f"it binds libggml-base to another copy than apir's ggml ({loaded[0].lib_dir}); "
            f"set APIR_GGML_LIB_DIR / APIR_GGML_INCLUDE_DIR to the C library's ggml build")


class CLibrary:
    """One context's view of a C backend library (see the module docstring)."""

    def __init__(self, shared: _Shared):
        self._shared = shared
        self._host: Optional[LibraryHost] = None
        self._active = False  # counted in shared.hosts for this context

    @classmethod
    def open(cls, path: str) -> "CLibrary":
        """Loads (once per process) the backend library at `path`.

        Raises LibraryLoadError: CANNOT_OPEN when dlopen fails or the library would mix ggml
        builds in this process, SYMBOL_MISSING when an apir_backend_* symbol is absent.
        """
        key = os.path.realpath(path)
        with _shared_lock:
            shared = _shared.get(key)
            if shared is None:
                shared = _Shared(path)
                mismatch = _same_ggml_base(shared.cdll)
                if mismatch is not None:
                    raise LibraryLoadError(ApirLoadLibraryReturnCode.CANNOT_OPEN,
                                           f"{path}: refusing to mix two ggml builds: {mismatch}")
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
            rc = int(sh.initialize_fn(host.ctx_id, ctypes.byref(sh.callbacks)))
            if rc == _RC_SUCCESS:
                sh.initialized = True
            log.info("ctx %d: apir_backend_initialize(%s) = %d", host.ctx_id, sh.path, rc)
            return rc

    def dispatch(self, function_id: int, dec: Decoder, enc: Encoder) -> int:
        """`apir_backend_dispatcher` over the decoder's remaining bytes and the encoder's room.
        Returns the C's code (0 success, 1 failure, 6 invalid function id); the encoder advances
        by what the C wrote."""
        sh = self._shared
        host = self._host
        if host is None or not sh.initialized:
            log.error("Forward to %s before it was initialized", sh.path)
            return 1
        n_in = dec.end - dec.pos
        # One spare byte: a zero-length ctypes array has no address to give the C.
        cmd = (ctypes.c_char * (n_in + 1)).from_buffer_copy(bytes(dec.buf[dec.pos:dec.end]) + b"\0")
        cmd_addr = ctypes.addressof(cmd)
        room = enc.end - enc.pos
        out = (ctypes.c_char * room).from_buffer(enc.buf, enc.pos) if room > 0 else ctypes.create_string_buffer(1)
        out_addr = ctypes.addressof(out)
        after = ctypes.c_void_p(out_addr)
        with sh.lock:
            rc = int(sh.dispatcher_fn(host.ctx_id, ctypes.byref(sh.callbacks), function_id,
                                      cmd_addr, cmd_addr + n_in, out_addr, out_addr + room, ctypes.byref(after)))
        written = (after.value or 0) - out_addr
        del out  # drop the export of the reply resource's memory before anyone closes it
        dec.pos = dec.end
        if not 0 <= written <= room:
            log.error("ctx %d: C dispatcher reports %d reply bytes for a %d-byte window",
                      host.ctx_id, written, room)
            enc.fatal = True
            return rc
        enc.pos += written
        return rc

    def deinit(self) -> None:
        """Drops this context; the last one runs `apir_backend_deinit` (which frees every
        buffer the C tracks) and resets the C globals so the library can initialize again."""
        sh = self._shared
        with sh.lock:
            if not self._active:
                return
            self._active = False
            ctx_id = self._host.ctx_id
            sh.hosts.pop(ctx_id, None)
            if sh.hosts or not sh.initialized:
                return
            sh.deinit_fn(ctx_id)
            sh.reset_globals()
            sh.initialized = False
            log.info("ctx %d: apir_backend_deinit(%s)", ctx_id, sh.path)


def c_library_factory(path: str) -> CLibrary:
    """A `library_factory` for `HostContext`: every configured path is a C backend library."""
    return CLibrary.open(str(Path(path)))
