"""The extensions beyond APIR 0.2 (docs/protocol.md, "Extensions"): a context's device set.

Theory of operation: `ExtendedLibrary` is the built-in `BackendLibrary`: the
`PythonBackendLibrary` of device 0, holding one more per further device the host serves
(`apir.host.backend` "cpu,vulkan:0": one per item, apir.ggml.backend_spec.split_specs), all
sharing one handle counter and address space, so a buffer or buffer-type handle names its
device. Until a guest agrees on extensions with
EXT_QUERY, every command goes to device 0 and every byte is APIR 0.2's; an extension function
is then answered APIR_BACKEND_FORWARD_INDEX_INVALID, as a 0.2 host answers it (and always
with `apir.host.extensions=off`). With the devices extension agreed, device functions (0-9)
go to the device DEVICE_SELECT chose, buffer-type and buffer functions (10-21) to the device
owning the handle they name first, a graph to the device of its first record's buffer (the
device's own parse refuses a handle of another). With graph replay, GRAPH_COMPUTE_KEEP keeps
a copy of the graph's bytes under the guest's id, GRAPH_RECOMPUTE computes it again (bounded:
MAX_KEPT_GRAPHS and `apir.host.kept_graph_bytes` per context, least recently used evicted;
an unknown id answers APIR_BACKEND_GRAPH_UNKNOWN and the guest sends the graph). With
ASYNC, `post` runs a posted command (no reply; a failure is kept as the pending error, later
posts skipped, past APIR_MAX_POSTED since the last waited-for command refused), and a
waited-for command answers APIR_BACKEND_POSTED_FAILED while an error is pending; SYNCHRONIZE
reports and clears it; events are handles whose work is done in order (docs/protocol.md 12.7).
With USE_COUNTS, each device builds graphs with the guest's use counts (`wire_use_counts`).
"""

from __future__ import annotations

import collections
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from apir.codec.constants import (
    APIR_BACKEND_FORWARD_INDEX_INVALID,
    APIR_BACKEND_GRAPH_UNKNOWN,
    APIR_BACKEND_POSTED_FAILED,
    APIR_BACKEND_QUEUE_FULL,
    APIR_EXTENSIONS_ALL,
    APIR_MAX_POSTED,
    POSTABLE_FUNCTIONS,
    ApirForwardReturnCode,
    ApirBackendCommandType as F,
    ApirExtension,
    ApirExtensionCommandType as X,
    ApirLoadLibraryReturnCode as LoadRc,
)
from apir.codec.forward import MalformedMessage
from apir.codec.records import rpc_tensor_dtype
from apir.codec.wire import Decoder, Encoder
from apir.host.backend import dispatcher
from apir.host.backend.dispatch_backend import compute_graph, graph_bytes
from apir.host.backend.dispatch_buffer import set_tensor_at
from apir.host.backend.library import PythonBackendLibrary
from apir.host.config import (
    CONFIG_KEY_BACKEND,
    CONFIG_KEY_EXTENSIONS,
    CONFIG_KEY_GGML_LIBRARY_PATH,
    CONFIG_KEY_KEPT_GRAPH_BYTES,
    DEFAULT_KEPT_GRAPH_BYTES,
    MAX_EVENTS,
    MAX_KEPT_GRAPHS,
    parse_limit,
)
from apir.host.handles import HandleTable
from apir.host.errors import BACKEND_RC_ERROR, BACKEND_RC_OK, Refused, log
from apir.host.library import LibraryHost

__all__ = ["ExtendedLibrary"]

_N_FUNCTIONS = len(F)
_DEVICE_FUNCTIONS = range(int(F.DEVICE_GET_DEVICE_COUNT), int(F.DEVICE_BUFFER_FROM_PTR) + 1)
_HANDLE_FUNCTIONS = range(int(F.BUFFER_TYPE_GET_NAME), int(F.BUFFER_FREE_BUFFER) + 1)
_GRAPH_COMPUTE = int(F.BACKEND_GRAPH_COMPUTE)
_CPY_TENSOR = int(F.BUFFER_CPY_TENSOR)
_BASE = int(ApirForwardReturnCode.BASE_INDEX)
_ASYNC_FUNCTIONS = frozenset(
    int(f)
    for f in (
        X.SYNCHRONIZE,
        X.EVENT_NEW,
        X.EVENT_RECORD,
        X.EVENT_WAIT,
        X.EVENT_SYNCHRONIZE,
        X.EVENT_FREE,
        X.BUFFER_SET_TENSOR_AT,
    )
)
# A waited-for command that answers a pending error neither: the query and the report itself
_NOT_HELD_BY_ERROR = frozenset([int(X.EXT_QUERY), int(X.SYNCHRONIZE)])
# The ApirExtension bits as plain ints: `agreed` is tested on every command, and `&` with an IntFlag
# is a Python-level call that builds a new flag
_DEVICES = int(ApirExtension.DEVICES)
_GRAPH_REPLAY = int(ApirExtension.GRAPH_REPLAY)
_ASYNC = int(ApirExtension.ASYNC)
_USE_COUNTS = int(ApirExtension.USE_COUNTS)


def _off(value: Optional[str]) -> bool:
    return (value or "").lower() in ("0", "off", "false", "no")


class ExtendedLibrary(PythonBackendLibrary):
    """Device 0's library, with the context's other devices (`devices`, this one first) and
    the extensions' state."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: List[PythonBackendLibrary] = [self]
        self.offered = 0  # ApirExtension bits this host offers (0: APIR 0.2 only)
        self.agreed = 0  # bits EXT_QUERY agreed on
        self.selected = 0  # DEVICE_SELECT's device
        self._routed = False  # devices agreed, and several: a 0.2 function runs where `_route` says
        self._kept: "collections.OrderedDict[int, Tuple[int, np.ndarray]]" = collections.OrderedDict()
        self._kept_bytes = 0
        self._kept_limit = DEFAULT_KEPT_GRAPH_BYTES
        self._spec = ""
        # ASYNC: posted commands since the last waited-for one; the first failure among
        # them, (index, function id, Forward return code), until SYNCHRONIZE reports it
        self._posted = 0
        self._posted_error: Optional[Tuple[int, int, int]] = None
        self._cpy_reply = bytearray(16)  # a posted cpy_tensor's `copied`, read here
        # event handle -> device index, from the context's one handle counter
        self.events: HandleTable[int] = self.buffers.sibling()
        self._handlers: Dict[int, Callable[[Decoder, Encoder], int]] = {
            int(X.EXT_QUERY): self._ext_query,
            int(X.DEVICE_SELECT): self._device_select,
            int(X.GRAPH_COMPUTE_KEEP): self._graph_compute_keep,
            int(X.GRAPH_RECOMPUTE): self._graph_recompute,
            int(X.SYNCHRONIZE): self._synchronize,
            int(X.EVENT_NEW): self._event_new,
            int(X.EVENT_RECORD): self._event_use,
            int(X.EVENT_WAIT): self._event_use,
            int(X.EVENT_SYNCHRONIZE): self._event_use,
            int(X.EVENT_FREE): self._event_free,
            int(X.BUFFER_SET_TENSOR_AT): self._set_tensor_at,
        }

    # --- BackendLibrary -------------------------------------------------------------------
    def initialize(self, host: LibraryHost) -> int:
        self.offered = 0 if _off(host.get_config(CONFIG_KEY_EXTENSIONS)) else APIR_EXTENSIONS_ALL
        self._kept_limit = int(
            parse_limit(
                host.get_config(CONFIG_KEY_KEPT_GRAPH_BYTES), CONFIG_KEY_KEPT_GRAPH_BYTES, DEFAULT_KEPT_GRAPH_BYTES
            )
        )
        devs = self._device_set(host)
        if devs is None:  # one device, chosen as configured
            return super().initialize(host)
        if isinstance(devs, int):
            return devs
        self._fixed_dev = devs[0]
        self.devices = [self] + [PythonBackendLibrary(d, shared_with=self) for d in devs[1:]]
        for i, lib in enumerate(self.devices):
            rc = super().initialize(host) if lib is self else lib.initialize(host)
            if rc != LoadRc.INIT_BASE_INDEX:
                log.error("ctx %d: device %d of %r failed to initialize (%d)", host.ctx_id, i, self._spec, rc)
                return rc
        return LoadRc.INIT_BASE_INDEX

    def _device_set(self, host: LibraryHost):
        """The ggml devices of a several-device `apir.host.backend`; None for one device; an
        initialize code when the spec names nothing."""
        from apir.ggml import GgmlLoadError, load as load_ggml
        from apir.ggml.backend_spec import BackendSpecError, resolve, split_specs

        self._spec = spec = host.get_config(CONFIG_KEY_BACKEND) or ""
        if host.get_config(CONFIG_KEY_GGML_LIBRARY_PATH) is not None or len(split_specs(spec)) < 2:
            return None
        try:
            g = load_ggml()
            return [dev for item in split_specs(spec) for dev in resolve(g, item).devices]
        except (GgmlLoadError, BackendSpecError) as exc:
            from apir.codec.constants import ApirBackendInitializeReturnCode as InitRc

            log.error("ctx %d: backend %r: %s", host.ctx_id, spec, exc)
            return LoadRc.INIT_BASE_INDEX + InitRc.NO_DEVICE

    def dispatch(self, function_id: int, dec: Decoder, enc: Encoder) -> int:
        """A waited-for command: with ASYNC, a synchronization point (docs/protocol.md 12.7)."""
        if self.agreed & _ASYNC and function_id not in _NOT_HELD_BY_ERROR:
            if self._posted_error is not None:
                return APIR_BACKEND_POSTED_FAILED  # not run: the guest asks SYNCHRONIZE which failed
            self._posted = 0
        if function_id < _N_FUNCTIONS and not self._routed:  # a 0.2 function, on this device
            return dispatcher.dispatch(self, function_id, dec, enc)
        return self._run(function_id, dec, enc)

    # --- ASYNC: posted commands ----------------------------------------------------------
    def accepts_posted(self) -> bool:
        return bool(self.agreed & _ASYNC)

    def post(self, function_id: int, dec: Decoder) -> None:
        """Runs posted command `function_id` (its arguments in `dec`), writing no reply: a
        failure becomes the pending error unless one is pending already; while one is, or
        past APIR_MAX_POSTED since the last waited-for command, the command is not run."""
        index = self._posted
        self._posted += 1
        if self._posted_error is not None:
            return
        if index >= APIR_MAX_POSTED:
            self._fail_posted(index, function_id, APIR_BACKEND_QUEUE_FULL)
            return
        if function_id not in POSTABLE_FUNCTIONS:
            self._fail_posted(index, function_id, APIR_BACKEND_FORWARD_INDEX_INVALID)
            return
        enc = Encoder(self._cpy_reply)
        rc = self._run(function_id, dec, enc)
        if rc == BACKEND_RC_OK and function_id == _CPY_TENSOR and not self._cpy_reply[0]:
            rc = BACKEND_RC_ERROR  # not copied: the guest posts only copies the host makes
        if rc != BACKEND_RC_OK:
            self._fail_posted(index, function_id, rc)

    def _fail_posted(self, index: int, function_id: int, rc: int) -> None:
        log.warning("ctx %d: posted command #%d (function %#x) failed: %d", self.ctx_id, index, function_id, rc)
        self._posted_error = (index, function_id, _BASE + rc)

    def _run(self, function_id: int, dec: Decoder, enc: Encoder) -> int:
        if 0 <= function_id < _N_FUNCTIONS:  # a 0.2 function: the handler, on its device's library
            lib = self._route(function_id, dec) if self._routed else self
            return dispatcher.dispatch(lib, function_id, dec, enc)
        handler = self._handlers.get(function_id)
        if handler is None or not self._may_call(function_id):
            return super().dispatch(function_id, dec, enc)  # (out of range: INDEX_INVALID, logged)
        try:
            if function_id != X.BUFFER_SET_TENSOR_AT:  # (a set may be deferred behind others)
                for lib in self.devices:  # any command may depend on device memory
                    lib.flush_transfers()
            return handler(dec, enc)
        except Refused as exc:
            log.warning("ctx %d: %s refused: %s", self.ctx_id, X(function_id).c_name, exc, extra={"refusal": exc})
        except Exception:  # noqa: BLE001 - a host bug is this command's failure, not the host's
            log.exception("ctx %d: %s failed", self.ctx_id, X(function_id).c_name)
        return BACKEND_RC_ERROR

    def _may_call(self, function_id: int) -> bool:
        if not self.offered:
            return False
        if function_id == X.EXT_QUERY:
            return True
        if function_id == X.DEVICE_SELECT:
            bit = _DEVICES
        elif function_id in _ASYNC_FUNCTIONS:
            bit = _ASYNC
        else:
            bit = _GRAPH_REPLAY
        return bool(self.agreed & bit)

    def deinit(self) -> None:
        self._forget_async()
        self._forget_all()
        for lib in self.devices[1:]:
            lib.deinit()
        super().deinit()

    def cancel_compute(self, reason: str) -> None:
        for lib in self.devices[1:]:
            lib.cancel_compute(reason)
        super().cancel_compute(reason)

    def forget_resource(self, res_id: int) -> None:
        for lib in self.devices[1:]:
            lib.forget_resource(res_id)
        super().forget_resource(res_id)

    def buffer_count(self) -> Optional[int]:
        return sum(len(lib.buffers) for lib in self.devices)

    @property
    def commands_bounded_in_time(self) -> bool:
        own = super().commands_bounded_in_time
        return own and all(lib.commands_bounded_in_time for lib in self.devices[1:])

    # --- routing -------------------------------------------------------------------------------
    def _route(self, function_id: int, dec: Decoder) -> PythonBackendLibrary:
        """The device a 0.2 function runs on (see the module docstring), with the devices
        extension agreed."""
        devices = self.devices
        selected = devices[self.selected]
        if function_id in _DEVICE_FUNCTIONS:
            return selected
        peek = Decoder(dec.buf, dec.pos, dec.end)
        if function_id in _HANDLE_FUNCTIONS:
            handle = peek.u64()
        else:  # backend_graph_compute: its res_id and size, then the graph
            res_id, size = peek.u32(), peek.u64()
            handle = 0 if peek.fatal else self._graph_buffer(res_id, size)
        if not peek.fatal:
            for lib in devices:
                if handle in lib.buffers or handle in lib.bufts:
                    return lib
        return selected

    def _graph_buffer(self, res_id: int, size: int, memory=None) -> int:
        """The buffer handle of the first record of the serialized graph in bytes [0, size) of
        resource `res_id` (or `memory`) that has one; 0 when none or unreadable (the device's
        own parse then refuses what is wrong)."""
        if memory is None:
            res = self.host.get_shmem(res_id)
            if res is None or not 0 < size <= res.size:
                return 0
            memory = res.memory
        data = np.frombuffer(memory, dtype=np.uint8, count=size)
        if size < 4:
            return 0
        n_nodes = int(data[:4].view(np.uint32)[0])
        at = 4 + 8 * n_nodes
        if at + 4 > size:
            return 0
        n_tensors = int(data[at : at + 4].view(np.uint32)[0])
        dtype = rpc_tensor_dtype(self.g.limits)
        n_tensors = min(n_tensors, (size - at - 4) // dtype.itemsize)
        records = np.frombuffer(memory, dtype=dtype, count=n_tensors, offset=at + 4)
        buffers = records["buffer"][records["buffer"] != 0]
        return int(buffers[0]) if len(buffers) else 0

    # --- the extension functions -----------------------------------------------------------
    def _args(self, dec: Decoder, function: X) -> Tuple[int, ...]:
        try:
            return self.host.forward_layouts[function][0].decode(dec)
        except MalformedMessage as exc:
            raise Refused(str(exc)) from None

    def _ext_query(self, dec: Decoder, enc: Encoder) -> int:
        (guest,) = self._args(dec, X.EXT_QUERY)
        self.agreed = guest & self.offered
        self._routed = bool(self.agreed & _DEVICES) and len(self.devices) > 1
        if not self.agreed & _DEVICES:
            self.selected = 0
        if not self.agreed & _GRAPH_REPLAY:
            self._forget_all()
        if not self.agreed & _ASYNC:
            self._forget_async()
        counts = bool(self.agreed & _USE_COUNTS)
        for lib in self.devices:
            if lib.wire_use_counts != counts:  # (built graphs hold the counts of the old rule)
                lib.graph_cache.clear()
                lib.wire_use_counts = counts
        count = len(self.devices) if self.agreed & _DEVICES else 1
        log.info("ctx %d: extensions 0x%x agreed (guest 0x%x), %d device(s)", self.ctx_id, self.agreed, guest, count)
        self.host.forward_replies["ext_query"](enc, self.agreed, count)
        return BACKEND_RC_OK

    def _device_select(self, dec: Decoder, enc: Encoder) -> int:
        (device,) = self._args(dec, X.DEVICE_SELECT)
        if device >= len(self.devices):
            raise Refused(f"device_select: device {device} of {len(self.devices)}")
        self.selected = device
        return BACKEND_RC_OK

    def _graph_compute_keep(self, dec: Decoder, enc: Encoder) -> int:
        graph_id, res_id, size = self._args(dec, X.GRAPH_COMPUTE_KEEP)
        self._forget(graph_id)
        # the copy is both what computes now and what is kept: the guest's later writes to
        # its memory change neither
        copy = np.array(np.frombuffer(graph_bytes(self, res_id, size), dtype=np.uint8, count=size))
        device = self._graph_device(copy, size)
        status = compute_graph(self.devices[device], copy, size)
        if size <= self._kept_limit:
            while self._kept and (len(self._kept) >= MAX_KEPT_GRAPHS or self._kept_bytes + size > self._kept_limit):
                self._forget(next(iter(self._kept)))
            # host memory like a buffer's: within the peer's and the process's pools (apir.host.backend
            # .budget), or not kept (the guest then sends the graph again)
            budget = self.budget
            lim = budget.limits
            why = budget.host.take(size, lim.host_bytes, lim.peer, lim.peer_bytes)
            if why is None:
                self._kept[graph_id] = (device, copy)
                self._kept_bytes += size
            else:
                log.info("ctx %d: graph %d not kept: %s", self.ctx_id, graph_id, why)
        self.host.forward_replies["graph_compute_keep"](enc, status)
        return BACKEND_RC_OK

    def _graph_recompute(self, dec: Decoder, enc: Encoder) -> int:
        (graph_id,) = self._args(dec, X.GRAPH_RECOMPUTE)
        kept = self._kept.get(graph_id)
        if kept is None:
            return APIR_BACKEND_GRAPH_UNKNOWN
        self._kept.move_to_end(graph_id)
        device, copy = kept
        try:
            status = compute_graph(self.devices[device], copy, len(copy))
        except Refused:
            self._forget(graph_id)  # (say, a buffer of it freed since): not replayed again
            raise
        self.host.forward_replies["graph_recompute"](enc, status)
        return BACKEND_RC_OK

    def _graph_device(self, memory, size: int) -> int:
        if not self._routed:
            return 0
        handle = self._graph_buffer(0, size, memory)
        for i, lib in enumerate(self.devices):
            if handle in lib.buffers:
                return i
        return self.selected

    def _forget(self, graph_id: int) -> None:
        kept = self._kept.pop(graph_id, None)
        if kept is not None:
            self._kept_bytes -= len(kept[1])
            self.budget.host.give(len(kept[1]), self.budget.limits.peer)

    def _forget_all(self) -> None:
        for graph_id in list(self._kept):
            self._forget(graph_id)

    # --- ASYNC: synchronize and events -------------------------------------------------------
    # Every command of a context runs in order, and each flushes the devices' deferred
    # uploads first (`_run`), so work before an event record is done when the record runs:
    # an event needs no ggml event, only a handle to check.
    def _forget_async(self) -> None:
        self._posted = 0
        self._posted_error = None
        for handle, _ in self.events.items():
            self.events.pop(handle)

    def _synchronize(self, dec: Decoder, enc: Encoder) -> int:
        self._args(dec, X.SYNCHRONIZE)
        index, function, code = self._posted_error or (0, 0, 0)
        self.host.forward_replies["synchronize"](enc, min(self._posted, 0xFFFFFFFF), index, function, code)
        self._posted = 0
        self._posted_error = None
        return BACKEND_RC_OK

    def _event_new(self, dec: Decoder, enc: Encoder) -> int:
        self._args(dec, X.EVENT_NEW)
        if len(self.events) >= MAX_EVENTS:
            raise Refused(f"event_new: {MAX_EVENTS} events held already")
        self.host.forward_replies["event_new"](enc, self.events.add(self.selected))
        return BACKEND_RC_OK

    def _event_use(self, dec: Decoder, enc: Encoder) -> int:
        # event_record / event_wait / event_synchronize: the same argument, one check
        (event,) = self._args(dec, X.EVENT_RECORD)
        if self.events.get(event) is None:
            raise Refused(f"unknown event {event:#x}")
        return BACKEND_RC_OK

    def _event_free(self, dec: Decoder, enc: Encoder) -> int:
        (event,) = self._args(dec, X.EVENT_FREE)
        if self.events.pop(event) is None:
            raise Refused(f"unknown event {event:#x}")
        return BACKEND_RC_OK

    def _set_tensor_at(self, dec: Decoder, enc: Encoder) -> int:
        # on the device owning the buffer named first (as the 0.2 buffer functions)
        peek = Decoder(dec.buf, dec.pos, dec.end)
        handle = peek.u64()
        lib = next((lib for lib in self.devices if handle in lib.buffers), self)
        return set_tensor_at(lib, dec, enc)
