"""What a backend function's handler reads of the context's library: `HandlerLibrary`.

Theory of operation: the dispatcher passes each handler (dispatch_device, _buffer_type,
_buffer, _backend) the context's library as a `HandlerLibrary`: the graph path's
`GraphLibrary` (apir.host.graph.seams) plus the tables, budgets and controls the other
functions use. `PythonBackendLibrary` implements it; the handlers import this module, not
the library, which imports the dispatcher that imports them.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

from apir.host.backend.compute_abort import ComputeAbort
from apir.host.backend.transfers import DeviceTransfers
from apir.host.graph.cache import GraphCache
from apir.host.graph.seams import GraphLibrary
from apir.host.handles import HostBuffer, HostBufferType
from apir.host.resources import Resource

__all__ = ["HandlerLibrary"]


class HandlerLibrary(GraphLibrary, Protocol):
    """The context's backend library as the handlers read it."""

    @property
    def ctx_id(self) -> int: ...

    @property
    def reg(self) -> Optional[int]:
        """The `ggml_backend_reg_t` of the served device."""
        ...

    @property
    def device_type(self) -> Optional[int]:
        """The type device_get_type reports instead of the device's own, or None."""
        ...

    @property
    def host_ptr_buffers(self) -> bool:
        """Whether device_buffer_from_ptr wraps guest blobs."""
        ...

    @property
    def transfers(self) -> Optional[DeviceTransfers]: ...

    @property
    def graph_cache(self) -> GraphCache: ...

    @property
    def abort(self) -> ComputeAbort: ...

    def shmem(self, res_id: int, what: str) -> Resource:
        """Blob `res_id` of the context; Refused (naming `what`) when unknown."""
        ...

    def buffer(self, handle: int) -> HostBuffer:
        """Refused for an unknown handle."""
        ...

    def buft(self, handle: int) -> HostBufferType:
        """Refused for an unknown handle."""
        ...

    def buft_handle(self, ptr: int, allocatable: bool) -> int: ...

    def hold_buffer(
        self, size: int, align: int, make: Callable[[], Optional[int]], res_id: Optional[int] = None
    ) -> int: ...

    def free_buffer(self, handle: int) -> None: ...

    def flush_transfers(self) -> None: ...

    def set_graph_threads(self) -> None: ...
