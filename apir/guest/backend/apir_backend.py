"""`ApirBackend`: the five ggml backend objects over one `ApirClient`, and their lifetime.

Theory of operation: building an ApirBackend asks the host what the registry caches
(reg.py), then makes, as Python-owned ctypes structs, one registry, `device_count` devices,
one buffer type per device and one backend (stream) on device 0. Their ifaces are ctypes
callbacks into the client (device.py, buffer_type.py, buffer.py, stream.py). Buffers are
ggml-owned structs; this object maps each buffer's address to its `RemoteBuffer` and keeps the
`BufferTable` the graph serializer reads (one table per ApirBackend, i.e. per host context,
since handles are per context).

The registry is not added to ggml's global list (`ggml_backend_register`): that list cannot
forget an entry, and these structs die with this object. Use the pointers directly.

Lifetime: `close()` frees the backend it made. Buffers and backends still alive then (say a
gallocr not freed yet) keep every struct and callback alive in a module-level list for the
life of the process, so a later `ggml_backend_buffer_free` still lands on live code (and
still frees the host buffer). Pointers handed out must not be used otherwise after `close()`.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional

from apir.errors import ApirError
from apir.ggml import load as load_ggml
from apir.guest.backend.abi import abi_for
from apir.guest.backend.buffer import BufferOps, RemoteBuffer, build_buffer_iface
from apir.guest.backend.buffer_type import build_buffer_type, build_buffer_type_iface
from apir.guest.backend.callbacks import CallbackTable, clear_errors, raise_errors
from apir.guest.backend.device import build_device, build_device_iface
from apir.guest.backend.reg import build_reg, fetch_remote_info
from apir.guest.backend.stream import build_backend_iface, new_backend

__all__ = ["ApirBackend", "BackendInitError", "GraphComputeError"]

log = logging.getLogger(__name__)

# ApirBackends closed while ggml still held some of their buffers or backends: kept for the
# life of the process (a few small structs each), since C may call them at any time.
_retired: List["ApirBackend"] = []
_retired_lock = threading.Lock()


class BackendInitError(ApirError, RuntimeError):
    """The backend cannot be built: the host offers no device, or the zero-copy path was
    required but the host does not offer it."""


class GraphComputeError(ApirError, RuntimeError):
    """`ggml_backend_graph_compute` returned a status other than GGML_STATUS_SUCCESS."""

    def __init__(self, status: int, text: str):
        super().__init__(f"graph compute failed: {text} ({status})")
        self.status = status


@dataclass
class _Device:
    index: int
    struct: object  # abi.Device
    ptr: int
    buffer_type: object  # abi.BufferType
    buffer_type_ptr: int


class ApirBackend:
    """ggml's registry / device / buffer type / backend for the host behind `client`.

    Attributes (ints, C pointers usable with apir.ggml functions):
      `reg` (ggml_backend_reg_t), `device` (device 0, ggml_backend_dev_t), `devices` (all),
      `buffer_type` (device 0's ggml_backend_buffer_type_t), `backend` (ggml_backend_t on
      device 0, made here and freed by `close`).

    Arguments: `client` an ApirClient (apir.guest.client) whose HandShake and LoadLibrary are
    done; `g` the apir.ggml build (default `apir.ggml.load()`); `zero_copy` None to use the
    guest-mapped buffers when the host offers buffer_from_host_ptr (as the C), False never,
    True to require them; `remote_supports_op` True to ask the host in supports_op (the C
    answers true locally).

    Raises UnsupportedGgmlVersion (unknown ggml build), BackendInitError, and the client's
    errors from the start-up calls."""

    def __init__(self, client, g=None, *, zero_copy: Optional[bool] = None, remote_supports_op: bool = False):
        if g is None:
            g = load_ggml()
        from apir.codec.graph import BufferTable

        self.g = g
        self.abi = abi_for(g)
        self.client = client
        self.remote_supports_op = remote_supports_op
        self.callbacks = CallbackTable()
        self.buffer_table = BufferTable()
        self._lock = threading.Lock()
        self._buffers: Dict[int, RemoteBuffer] = {}
        self._backends: Dict[int, object] = {}
        self.closed = False

        self.info = fetch_remote_info(client)
        if self.info.device_count < 1:
            raise BackendInitError(f"the host reports {self.info.device_count} devices")
        offered = bool(self.info.props.buffer_from_host_ptr)
        if zero_copy and not offered:
            raise BackendInitError("zero_copy=True but the host does not offer buffer_from_host_ptr")
        self.zero_copy = offered if zero_copy is None else bool(zero_copy)

        self._reg = build_reg(self)
        self.reg = ctypes.addressof(self._reg)
        self.buffer_ops = BufferOps(self)
        self.buffer_iface = build_buffer_iface(self)
        self._backend_iface = build_backend_iface(self)
        dev_iface = build_device_iface(self)
        buft_iface = build_buffer_type_iface(self)
        self._devices: Dict[int, _Device] = {}
        self.devices: List[int] = []
        for i in range(self.info.device_count):
            dev = build_device(self, dev_iface, self.reg)
            dev_ptr = ctypes.addressof(dev)
            buft = build_buffer_type(self, buft_iface, dev_ptr)
            self._devices[dev_ptr] = _Device(i, dev, dev_ptr, buft, ctypes.addressof(buft))
            self.devices.append(dev_ptr)
        self.device = self.devices[0]
        self.buffer_type = self._devices[self.device].buffer_type_ptr
        self.backend = self.init_backend(self.device)

    # --- lookups for the callbacks ------------------------------------------------------------
    def device_record(self, dev_ptr: int) -> _Device:
        return self._devices[dev_ptr]

    def buffer(self, buf: int) -> RemoteBuffer:
        """The RemoteBuffer of ggml buffer `buf`; KeyError when it is not this backend's."""
        with self._lock:
            return self._buffers[buf]

    def has_buffer(self, buf: int) -> bool:
        with self._lock:
            return buf in self._buffers

    def add_buffer(self, rb: RemoteBuffer) -> None:
        with self._lock:
            self._buffers[rb.ptr] = rb
            self.buffer_table.register(rb.ptr, rb.host_handle, rb.base)

    def remove_buffer(self, buf: int) -> RemoteBuffer:
        with self._lock:
            rb = self._buffers.pop(buf)
            self.buffer_table.unregister(buf)
        return rb

    def release_blob(self, blob) -> None:
        """Unmap and destroy a guest-mapped blob (None: nothing)."""
        if blob is not None:
            self.client.destroy_blob(blob)

    def init_backend(self, dev_ptr: int) -> int:
        """A new ggml_backend_t on device `dev_ptr` (ggml_backend_dev_init's callback)."""
        self.device_record(dev_ptr)  # KeyError for a foreign device
        backend = new_backend(self, self._backend_iface, dev_ptr)
        ptr = ctypes.addressof(backend)
        with self._lock:
            self._backends[ptr] = backend
        return ptr

    def forget_backend(self, backend_ptr: int) -> None:
        with self._lock:
            # Dropping the struct here is safe: ggml_backend_free does nothing after iface.free.
            self._backends.pop(backend_ptr)

    # --- API ----------------------------------------------------------------------------------
    @property
    def live_buffers(self) -> int:
        with self._lock:
            return len(self._buffers)

    def graph_compute(self, cgraph: int, backend: Optional[int] = None) -> None:
        """`ggml_backend_graph_compute(backend or self.backend, cgraph)`; raises
        BackendCallbackError when a callback failed, GraphComputeError on a status != 0."""
        clear_errors()
        status = self.g.ggml_backend_graph_compute(backend or self.backend, cgraph)
        raise_errors("ggml_backend_graph_compute")
        if status != 0:
            text = self.g.ggml_status_to_string(status)
            raise GraphComputeError(status, text.decode() if text else "unknown status")

    def close(self) -> None:
        """Free the backend made at construction. Idempotent; does not close the client."""
        if self.closed:
            return
        self.closed = True
        if self.backend:
            self.g.ggml_backend_free(self.backend)
        with self._lock:
            live = len(self._buffers) + len(self._backends)
        if live:
            log.warning(
                "ApirBackend closed with %d buffer(s)/backend(s) still alive in ggml; "
                "keeping its callbacks until they are freed",
                live,
            )
            with _retired_lock:
                _retired.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
