"""The built-in backend library: ggml's backend, run from Python, with per-context tables.

Theory of operation: the twin of ggml's `libggml-virtgpu-backend.so` (`backend.cpp`,
`backend-dispatched.cpp`), as a `BackendLibrary`. `initialize` picks the ggml backend: with
`ggml.library.path` configured, that shared library's registration symbol (`ggml.library.reg`,
default `ggml_backend_init`) and its device 0, like the C; else the device `apir.host.backend`
names in the loaded ggml's registry (apir.ggml.backend_spec; a host on several rpc servers
spreads its contexts over their devices in turn); else the CPU device. That device serves every
command; one `ggml_backend_t` runs the graphs, checked with the rules of the backend's profile
(apir.host.graph.profiles; a backend without one computes nothing).

Unlike the C, whose buffer list is process-wide, everything a guest can name lives in this
object, one per context: buffer types and buffers by opaque id (`apir.host.handles`), each
buffer with its virtual base; `deinit` frees exactly these buffers. Every buffer is charged to
the budgets (apir.host.backend.budget), and a buffer ggml allocates is cleared to zeros before
the guest can read it. Graphs run under the context's abort flag (apir.host.backend.
compute_abort). On a profile with `async_transfers` uploads into device buffers are deferred
and flushed before any other command (apir.host.backend.transfers); buffers are freed only
after a flush. docs/design.md ("Host backends") has the whole picture.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
from typing import Callable, Dict, Optional, Tuple

from apir.codec.constants import (
    ApirBackendInitializeReturnCode as InitRc,
    ApirLoadLibraryReturnCode as LoadRc,
)
from apir.host.config import (
    CONFIG_KEY_ASYNC_TRANSFERS,
    CONFIG_KEY_BACKEND,
    CONFIG_KEY_DEVICE_TYPE,
    CONFIG_KEY_GGML_LIBRARY_PATH,
    CONFIG_KEY_GGML_LIBRARY_REG,
    CONFIG_KEY_GRAPH_CHUNK_NODES,
    CONFIG_KEY_GRAPH_TIME_LIMIT,
    CONFIG_KEY_IMPORT_HOST_MEMORY,
    CONFIG_KEY_N_THREADS,
    CONFIG_KEY_USE_COUNTS,
    CONFIG_KEY_POLL,
    DEFAULT_GGML_LIBRARY_REG,
    DEFAULT_GRAPH_CHUNK_NODES,
    DEFAULT_GRAPH_TIME_LIMIT_S,
    DEFAULT_POLL,
    N_THREADS_FREE,
    parse_limit,
)
from apir.codec.wire import Decoder, Encoder
from apir.ggml import GgmlLoadError, load as load_ggml
from apir.ggml.lib import Ggml
from apir.host.backend import dispatcher
from apir.host.backend.budget import BufferBudget, BufferLimits, buffer_charge
from apir.host.backend.compute_abort import ComputeAbort
from apir.host.backend.cpu_threadpool import CpuThreadpool, threads_fit
from apir.host.errors import Refused, log
from apir.host.graph.cache import GraphCache
from apir.host.handles import HandleTable, HostBuffer, HostBufferType, VirtualAddressSpace, new_tables
from apir.host.library import LibraryHost
from apir.host.resources import Resource
from apir.ggml.backend_props import get_dev_props
from apir.ggml.backend_spec import BackendSpecError, resolve as resolve_backend
from apir.host.graph.profiles import BackendProfile, profile_for
from apir.host.graph.shapes.base import OpEnums, op_enums
from apir.host.tensors import TensorChecker
from apir.host.backend.transfers import DeviceTransfers
from apir.local.spin_policy import free_cores

__all__ = ["PythonBackendLibrary", "device_types"]

_IMPORT_PROBE_SIZE = 1 << 16  # bytes of the host-memory import probe (a multiple of any page size)
_next_context = itertools.count()  # spreads contexts over the devices of a multi-device spec


class PythonBackendLibrary:
    """A `BackendLibrary` running the 23 backend functions in Python over ggml."""

    def __init__(self, device: Optional[int] = None, shared_with: Optional["PythonBackendLibrary"] = None) -> None:
        # the ggml_backend_dev_t to serve instead of the one configuration names (a device of
        # a context's device set, apir.host.backend.extensions)
        self._fixed_dev = device
        # set by initialize; read through the properties below, which refuse before it
        self._host: Optional[LibraryHost] = None
        self._g: Optional[Ggml] = None
        self._checker: Optional[TensorChecker] = None
        self._budget: Optional[BufferBudget] = None
        # ggml_backend_reg_t, ggml_backend_dev_t, ggml_backend_t (None before initialize and
        # after deinit)
        self.reg: Optional[int] = None
        self._dev: Optional[int] = None
        self._backend: Optional[int] = None
        self._ggml_cdll: Optional[ctypes.CDLL] = None
        self._op_enums: Optional[OpEnums] = None  # op_enums's, once
        self.profile: Optional[BackendProfile] = None  # None: a backend the host has no rules for
        self.backend_name = ""  # the ggml registration's name ("CPU", "Vulkan", "RPC", ...)
        # whether device_buffer_from_ptr wraps guest blobs (the device's buffer_from_host_ptr
        # cap, or an import probe under apir.host.import_host_memory)
        self.host_ptr_buffers = False
        # (ggml_backend_buffer_t, size) of the device buffer the checked row ids are copied into
        # on a backend whose kernels read device memory (apir.host.graph.build); kept between graphs
        self._ids_buffer: Optional[Tuple[int, int]] = None
        # deferred uploads and batched reads of device memory (apir.host.backend.transfers), on a
        # profile with async_transfers; None: every copy synchronous
        self.transfers: Optional[DeviceTransfers] = None
        # one id counter and address space with `shared_with`: handles and bases name one
        # device's buffer among all of a context's devices
        self.bufts, self.buffers = new_tables() if shared_with is None else shared_with.new_tables()
        self.vspace: VirtualAddressSpace = VirtualAddressSpace() if shared_with is None else shared_with.vspace
        self._abort: Optional[ComputeAbort] = None  # graph time limit and cancellation
        # threads the backend computes with (0: never set, ggml's default), at most with
        # N_THREADS_FREE; the work-size bound plans with this count (apir.host.graph.work_plan),
        # which bounds the plan of fewer
        self.n_threads = 0
        # with N_THREADS_FREE: ggml_backend_set_n_threads and the count set now (else None)
        self._free_threads: Optional[Callable[[int, int], None]] = None
        self._threads_now = 0
        self._threadpool: Optional[CpuThreadpool] = None  # attached to the backend, freed after it
        # checked, built graphs reused when the same graph structure comes again
        self.graph_cache = GraphCache()
        # enum ggml_backend_dev_type value device_get_type reports instead of the device's own
        # (config apir.host.device_type), or None
        self.device_type: Optional[int] = None
        # whether built graphs carry use counts (apir.ggml.cgraph), so the backend fuses ops as
        # it does locally (config apir.host.use_counts)
        self.use_counts = False
        # whether those counts are raised to the guest's, from its records (the USE_COUNTS
        # extension: set by apir.host.backend.extensions)
        self.wire_use_counts = False

    # --- what initialize set ---------------------------------------------------------------
    @property
    def ctx_id(self) -> int:
        """The context's id, for log lines (0 before initialize)."""
        return self._host.ctx_id if self._host is not None else 0

    @property
    def host(self) -> LibraryHost:
        """The component that initialized this library. Refused before initialize."""
        if self._host is None:
            raise Refused("the backend library is not initialized")
        return self._host

    @property
    def g(self) -> Ggml:
        """The loaded ggml. Refused before initialize."""
        if self._g is None:
            raise Refused("the backend library is not initialized")
        return self._g

    @property
    def checker(self) -> TensorChecker:
        """The guest-tensor checker of this ggml build. Refused before initialize."""
        if self._checker is None:
            raise Refused("the backend library is not initialized")
        return self._checker

    @property
    def dev(self) -> int:
        """The `ggml_backend_dev_t` serving every command. Refused before initialize."""
        if self._dev is None:
            raise Refused("the backend library is not initialized")
        return self._dev

    @property
    def backend(self) -> int:
        """The `ggml_backend_t` running the graphs. Refused before initialize."""
        if self._backend is None:
            raise Refused("the backend library is not initialized")
        return self._backend

    @property
    def op_enums(self) -> OpEnums:
        """The op numbers the shape rules read, of this library's ggml (computed once)."""
        if self._op_enums is None:
            self._op_enums = op_enums(self.g)
        return self._op_enums

    @property
    def abort(self) -> ComputeAbort:
        """The graph time limit and cancellation (apir.host.backend.compute_abort). Refused before
        initialize."""
        if self._abort is None:
            raise Refused("the backend library is not initialized")
        return self._abort

    @property
    def budget(self) -> BufferBudget:
        """The context's buffer budget (apir.host.backend.budget). Refused before initialize."""
        if self._budget is None:
            raise Refused("the backend library is not initialized")
        return self._budget

    # --- BackendLibrary -------------------------------------------------------------------
    def initialize(self, host: LibraryHost) -> int:
        """`apir_backend_initialize`: LoadLibrary codes 3/4/5, else 6 + APIR_BACKEND_INITIALIZE_*."""
        if self.reg is not None:
            return LoadRc.INIT_BASE_INDEX + InitRc.ALREADY_INITED
        self._host = host
        try:
            self._g = g = load_ggml()
        except GgmlLoadError as exc:
            log.error("ctx %d: cannot load ggml: %s", host.ctx_id, exc)
            return LoadRc.CANNOT_OPEN
        path = host.get_config(CONFIG_KEY_GGML_LIBRARY_PATH)
        spec = host.get_config(CONFIG_KEY_BACKEND)
        dev = None
        if self._fixed_dev is not None:
            dev = self._fixed_dev
            reg = g.ggml_backend_dev_backend_reg(dev)
        elif path is None and spec:
            try:
                choice = resolve_backend(g, spec)
            except BackendSpecError as exc:
                log.error("ctx %d: backend %r: %s", host.ctx_id, spec, exc)
                return LoadRc.INIT_BASE_INDEX + InitRc.NO_DEVICE
            k = next(_next_context) % len(choice.devices)
            dev = choice.devices[k]
            reg = g.ggml_backend_dev_backend_reg(dev)
        elif path is None:
            dev = g.ggml_backend_dev_by_type(g.header.dev_types["CPU"])
            if not dev:
                log.error("ctx %d: ggml has no CPU device", host.ctx_id)
                return LoadRc.INIT_BASE_INDEX + InitRc.NO_DEVICE
            reg = g.ggml_backend_dev_backend_reg(dev)
        else:
            symbol = host.get_config(CONFIG_KEY_GGML_LIBRARY_REG) or DEFAULT_GGML_LIBRARY_REG
            try:
                self._ggml_cdll = ctypes.CDLL(path)
            except OSError as exc:
                log.error("ctx %d: cannot open the ggml backend library: %s", host.ctx_id, exc)
                return LoadRc.CANNOT_OPEN
            try:
                reg_fn = getattr(self._ggml_cdll, symbol)
            except AttributeError:
                log.error("ctx %d: %s has no registration symbol %r", host.ctx_id, path, symbol)
                return LoadRc.SYMBOL_MISSING
            reg_fn.restype, reg_fn.argtypes = ctypes.c_void_p, []
            reg = reg_fn()
        if not reg:
            log.error("ctx %d: ggml backend registration failed", host.ctx_id)
            return LoadRc.INIT_BASE_INDEX + InitRc.BACKEND_REG_FAILED
        if dev is None:
            if g.ggml_backend_reg_dev_count(reg) == 0:
                log.error("ctx %d: ggml backend %s has no device", host.ctx_id, g.ggml_backend_reg_name(reg))
                return LoadRc.INIT_BASE_INDEX + InitRc.NO_DEVICE
            dev = g.ggml_backend_reg_dev_get(reg, 0)
        if not dev:
            return LoadRc.INIT_BASE_INDEX + InitRc.NO_DEVICE
        backend = g.ggml_backend_dev_init(dev, None)
        if not backend:
            log.error("ctx %d: ggml backend initialization failed", host.ctx_id)
            return LoadRc.INIT_BASE_INDEX + InitRc.BACKEND_INIT_FAILED
        self.reg, self._dev, self._backend = reg, dev, backend
        self.backend_name = g.ggml_backend_reg_name(reg).decode()
        self.host_ptr_buffers = self._host_ptr_buffers(host)
        self.profile = profile_for(self.backend_name)
        if self.profile is None:
            log.warning(
                "ctx %d: no profile of ggml backend %s (apir.host.graph.profiles): "
                "it supports no op and computes no graph",
                host.ctx_id,
                self.backend_name,
            )
        log.info(
            "ctx %d: serving on %s (%s), backend %s",
            host.ctx_id,
            g.ggml_backend_dev_name(dev).decode(),
            g.ggml_backend_dev_description(dev).decode(),
            self.backend_name,
        )
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        g.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        self._budget = BufferBudget(BufferLimits.from_config(host.get_config, total.value, host.ctx_id))
        self._set_n_threads(host)
        rc = self._set_device_type(host)
        if rc is not None:
            return rc
        time_limit_s = parse_limit(
            host.get_config(CONFIG_KEY_GRAPH_TIME_LIMIT), CONFIG_KEY_GRAPH_TIME_LIMIT, DEFAULT_GRAPH_TIME_LIMIT_S
        )
        chunk_nodes = parse_limit(
            host.get_config(CONFIG_KEY_GRAPH_CHUNK_NODES), CONFIG_KEY_GRAPH_CHUNK_NODES, DEFAULT_GRAPH_CHUNK_NODES
        )
        self._abort = ComputeAbort(
            g, reg, backend, time_limit_s, name=f"ctx {host.ctx_id}", chunk_nodes=int(chunk_nodes)
        )
        self._checker = TensorChecker(g)
        self.use_counts = (host.get_config(CONFIG_KEY_USE_COUNTS) or "").lower() not in ("0", "off", "false", "no")
        # config apir.host.async_transfers (env APIR_HOST_ASYNC_TRANSFERS) = 0 / off: every
        # copy synchronous. Where the device's buffers are host-visible (ggml-vulkan maps them
        # where it can: lavapipe, resizable BAR) a synchronous set is a plain memcpy and the
        # deferral costs a copy more (apir.host.backend.transfers): measure both on a given GPU.
        off = (host.get_config(CONFIG_KEY_ASYNC_TRANSFERS) or "").lower() in ("0", "off", "false", "no")
        if self.profile is not None and self.profile.async_transfers and not off:
            self.transfers = DeviceTransfers(g, backend, dev)
        return LoadRc.INIT_BASE_INDEX + InitRc.SUCCESS

    def _host_ptr_buffers(self, host: LibraryHost) -> bool:
        """The device's `buffer_from_host_ptr` cap; else, under config
        `apir.host.import_host_memory=1`, whether it imports a page-aligned probe mapping
        (ggml-vulkan implements buffer_from_host_ptr with VK_EXT_external_memory_host but its
        props say false: the import fails on devices without the extension); never under
        `apir.host.import_host_memory=0`."""
        g = self.g
        setting = (host.get_config(CONFIG_KEY_IMPORT_HOST_MEMORY) or "").lower()
        if setting in ("0", "false", "off", "no"):
            return False
        if get_dev_props(g, self.dev).get("buffer_from_host_ptr", False):
            return True
        if setting not in ("1", "true", "on", "yes"):
            return False
        probe = mmap.mmap(-1, _IMPORT_PROBE_SIZE)
        try:
            addr = ctypes.addressof(ctypes.c_char.from_buffer(probe))
            buf = g.ggml_backend_dev_buffer_from_host_ptr(self.dev, addr, _IMPORT_PROBE_SIZE, _IMPORT_PROBE_SIZE)
            if buf:
                g.ggml_backend_buffer_free(buf)
        finally:
            try:
                probe.close()
            except BufferError:  # pragma: no cover - the from_buffer view is gone by now
                pass
        log.info("ctx %d: host memory import %s", host.ctx_id, "works" if buf else "refused by the device")
        return bool(buf)

    def ids_buffer(self, size: int) -> int:
        """A device buffer (the device's own type) of at least `size` bytes for the checked row
        ids of one graph (apir.host.graph.build), kept and grown between graphs: allocating device
        memory per graph costs more than the graph on a GPU. 0 when ggml cannot allocate.
        Not charged to the budget: at most the bytes of the graph's buffers (IdReads)."""
        g = self.g
        if self._ids_buffer is not None and self._ids_buffer[1] >= size:
            return self._ids_buffer[0]
        if self._ids_buffer is not None:
            g.ggml_backend_buffer_free(self._ids_buffer[0])
            self._ids_buffer = None
        size = max(size, 1 << 16)
        buf = g.ggml_backend_buft_alloc_buffer(g.ggml_backend_dev_buffer_type(self.dev), size)
        if buf:
            self._ids_buffer = (buf, size)
        return buf or 0

    def _set_n_threads(self, host: LibraryHost) -> None:
        """`ggml_backend_set_n_threads` through the registry (ggml's way to find it for any
        backend that has threads), with config `apir.host.n_threads` or the core count
        (N_THREADS_FREE: the core count, lowered per graph by set_graph_threads); and a
        threadpool of that many threads where the registry offers one (apir.host.backend.cpu_threadpool,
        config `apir.host.poll`)."""
        fn_ptr = self.g.ggml_backend_reg_get_proc_address(self.reg, b"ggml_backend_set_n_threads")
        if not fn_ptr:
            return
        value = host.get_config(CONFIG_KEY_N_THREADS)
        try:
            n_threads = int(value) if value and value != N_THREADS_FREE else (os.cpu_count() or 1)
        except ValueError:
            log.error("ctx %d: %s=%r is not a number", host.ctx_id, CONFIG_KEY_N_THREADS, value)
            n_threads = os.cpu_count() or 1
        set_n_threads = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int)(fn_ptr)
        self.n_threads = self._threads_now = max(1, n_threads)
        if not threads_fit(self.n_threads - 1):  # ggml would abort the host on pthread_create
            log.error("ctx %d: no room for %d threads' stacks: computing on 1", host.ctx_id, self.n_threads)
            self.n_threads = self._threads_now = 1
        if value == N_THREADS_FREE:
            self._free_threads = set_n_threads
        free = " (each graph on the free ones among them)" if value == N_THREADS_FREE else ""
        log.info("ctx %d: computing on %d threads%s", host.ctx_id, self.n_threads, free)
        set_n_threads(self.backend, self.n_threads)
        value = host.get_config(CONFIG_KEY_POLL)
        try:
            poll = int(value) if value else DEFAULT_POLL
        except ValueError:
            log.error("ctx %d: %s=%r is not a number", host.ctx_id, CONFIG_KEY_POLL, value)
            poll = DEFAULT_POLL
        reg = self.reg
        assert reg is not None  # set by initialize before this
        self._threadpool = CpuThreadpool.attach(self.g, reg, self.backend, self.n_threads, min(max(poll, 0), 100))

    def set_graph_threads(self) -> None:
        """With `apir.host.n_threads` N_THREADS_FREE, sets the next graph's threads: no more
        than the cores other processes' runnable threads leave free now
        (apir.local.spin_policy.free_cores). ggml's workers meet at a spinning barrier after
        every node, so one sharing its core holds up the rest until it runs again (docs/design.md,
        Measurements). Opt-in (`apir embed` asks for it): a few ops' bytes depend on the count
        (CROSS_ENTROPY_LOSS sums per thread), MiniLM's do not."""
        if self._free_threads is None or self.n_threads == 1:
            return
        n = min(self.n_threads, free_cores())
        if n != self._threads_now:
            self._free_threads(self.backend, n)
            self._threads_now = n

    def _set_device_type(self, host: LibraryHost) -> Optional[int]:
        """Config `apir.host.device_type`: the type device_get_type reports. An unknown name fails
        initialization (INIT_BASE_INDEX + BACKEND_INIT_FAILED) rather than being ignored."""
        value = host.get_config(CONFIG_KEY_DEVICE_TYPE)
        if not value:
            return None
        types = device_types(self.g)
        if value.upper() not in types:
            log.error("ctx %d: %s=%r is none of %s", host.ctx_id, CONFIG_KEY_DEVICE_TYPE, value, sorted(types))
            return LoadRc.INIT_BASE_INDEX + InitRc.BACKEND_INIT_FAILED
        self.device_type = types[value.upper()]
        return None

    def flush_transfers(self) -> None:
        """Every deferred upload in device memory (apir.host.backend.transfers); nothing without."""
        if self.transfers is not None:
            self.transfers.flush()

    def dispatch(self, function_id: int, dec: Decoder, enc: Encoder) -> int:
        return dispatcher.dispatch(self, function_id, dec, enc)

    def cancel_compute(self, reason: str) -> None:
        """Stops the graph compute in flight, if any, and refuses later ones (GGML_STATUS_ABORTED):
        the context is going away. Any thread (no lock: the compute holds the context's)."""
        abort = self._abort
        if abort is not None:
            abort.cancel(reason)

    def deinit(self) -> None:
        """`apir_backend_deinit`, for this context only: frees its buffers and its backend."""
        self.cancel_compute("the context is destroyed")
        if self.transfers is not None:  # queued copies land before their buffers are freed
            self.transfers.close()
            self.transfers = None
        self.graph_cache.clear()
        for handle, _ in self.buffers.items():
            self.free_buffer(handle)
        if self._ids_buffer is not None and self._g is not None:
            self._g.ggml_backend_buffer_free(self._ids_buffer[0])
            self._ids_buffer = None
        if self._backend and self._g is not None:
            self._g.ggml_backend_free(self._backend)
        if self._threadpool is not None:  # after the backend, which points at it
            self._threadpool.close()
            self._threadpool = None
        self._backend = self._dev = self.reg = None

    def buffer_count(self) -> Optional[int]:
        return len(self.buffers)

    @property
    def commands_bounded_in_time(self) -> bool:
        """Only on a backend whose kernels work in host memory (a profile's host_addressable:
        ggml-cpu): a GPU's or ggml-rpc's copies wait on a device or a server that may never
        answer."""
        return self.profile is not None and self.profile.host_addressable

    def forget_resource(self, res_id: int) -> None:
        """The hypervisor is removing blob `res_id`: free the buffers that wrap it."""
        for handle, buf in self.buffers.items():
            if buf.res_id == res_id:
                log.warning("ctx %d: resource %d removed under buffer 0x%x: buffer freed", self.ctx_id, res_id, handle)
                self.free_buffer(handle)

    # --- tables -----------------------------------------------------------------------------
    def new_tables(self) -> Tuple[HandleTable[HostBufferType], HandleTable[HostBuffer]]:
        """Buffer-type and buffer tables drawing ids from this library's counter."""
        return self.bufts.sibling(), self.buffers.sibling()

    def buft_handle(self, ptr: int, allocatable: bool) -> int:
        """The id of buffer type `ptr` in this context, registering it on first use."""
        for handle, buft in self.bufts.items():
            if buft.ptr == ptr:
                return handle
        return self.bufts.add(HostBufferType(ptr, allocatable))

    def buft(self, handle: int) -> HostBufferType:
        buft = self.bufts.get(handle)
        if buft is None:
            raise Refused(f"unknown buffer type handle 0x{handle:x}")
        return buft

    def buffer(self, handle: int) -> HostBuffer:
        buf = self.buffers.get(handle)
        if buf is None:
            raise Refused(f"unknown buffer handle 0x{handle:x}")
        return buf

    def hold_buffer(
        self, size: int, align: int, make: Callable[[], Optional[int]], res_id: Optional[int] = None
    ) -> int:
        """Makes a ggml buffer of `size` bytes with `make()` (returns a ggml_backend_buffer_t
        or NULL) if it fits this context's budget (apir.host.backend.budget, charged before `make`
        runs), and registers it. `res_id`: the blob it wraps (buffer_from_ptr). Returns its
        id, or 0 when it does not fit or ggml made none (logged). A buffer ggml allocated is
        cleared to zeros: its memory may hold what an earlier buffer, of any context, left."""
        ctx_id = self.host.ctx_id
        charge = buffer_charge(size, align)
        why = self.budget.take(charge)
        if why is not None:
            log.warning("ctx %d: no buffer of %d bytes: %s", ctx_id, size, why)
            return 0
        try:
            ptr = make()
        except BaseException:
            self.budget.give(charge)
            raise
        if not ptr:
            self.budget.give(charge)
            log.warning("ctx %d: ggml made no buffer of %d bytes", ctx_id, size)
            return 0
        try:
            actual = buffer_charge(self.g.ggml_backend_buffer_get_size(ptr), align)
            if actual > charge:
                why = self.budget.grow(actual - charge)
                if why is not None:
                    log.warning("ctx %d: no buffer of %d bytes: %s", ctx_id, size, why)
                    self.g.ggml_backend_buffer_free(ptr)
                    self.budget.give(charge)
                    return 0
                charge = actual
            if res_id is None:
                self.g.ggml_backend_buffer_clear(ptr, 0)
            return self._add_buffer(ptr, res_id, charge)
        except BaseException:
            # a refusal while registering (e.g. no virtual base left) frees what was made, so
            # neither the ggml buffer nor its charge outlives the failed command
            self.g.ggml_backend_buffer_free(ptr)
            self.budget.give(charge)
            raise

    def _add_buffer(self, ptr: int, res_id: Optional[int], charge: int) -> int:
        """Registers a ggml buffer this context now owns; returns its id."""
        g = self.g
        buft_ptr = g.ggml_backend_buffer_get_type(ptr)
        size = g.ggml_backend_buffer_get_size(ptr)
        base = g.ggml_backend_buffer_get_base(ptr) or 0
        align = g.ggml_backend_buft_get_alignment(buft_ptr)
        buft_handle = self.buft_handle(buft_ptr, allocatable=res_id is None)
        return self.buffers.add(
            HostBuffer(ptr, base, size, self.vspace.reserve(size, align), buft_handle, res_id, charge)
        )

    def free_buffer(self, handle: int) -> None:
        self.flush_transfers()  # no queued copy into a freed buffer
        buf = self.buffers.pop(handle)
        if buf is not None:
            self.graph_cache.drop_buffer(buf)
            self.g.ggml_backend_buffer_free(buf.ptr)
            self.budget.give(buf.charge)

    def shmem(self, res_id: int, what: str) -> Resource:
        res = self.host.get_shmem(res_id)
        if res is None:
            raise Refused(f"{what}: unknown shared-memory resource {res_id}")
        return res


def device_types(g: Ggml) -> Dict[str, int]:
    """`enum ggml_backend_dev_type` of build `g` ({"CPU": 0, "GPU": 1, ...}), from its
    ggml-backend.h."""
    from apir.ggml.header import parse_enum

    return parse_enum(
        (g.include_dir / "ggml-backend.h").read_text(), "ggml_backend_dev_type", "GGML_BACKEND_DEVICE_TYPE_"
    )
