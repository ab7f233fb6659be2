"""What the graph path reads of the context's backend library: `GraphLibrary`.

Theory of operation: parse -> check -> build -> compute (build, cache, work_plan) reads the
context's state through this protocol alone; `apir.host.backend.library.PythonBackendLibrary`
implements it, and the handlers' own protocol (apir.host.backend.seams.HandlerLibrary)
extends it. Defined here, below the backend, so the graph path names its caller's type
without importing the backend.

A backend the host has no profile for (no rules: apir.host.graph.profiles) computes no
graph: `profile_of` is where that is decided, for every path a graph may take (built,
rechecked from the cache, planned); supports_op answers false there.
"""

from __future__ import annotations

import ctypes
from typing import List, Optional, Protocol, Sequence, Tuple

from apir.ggml.lib import Ggml
from apir.host.errors import Refused
from apir.host.graph.profiles import BackendProfile
from apir.host.graph.shapes.base import OpEnums
from apir.host.handles import HandleTable, HostBuffer
from apir.host.library import LibraryHost
from apir.host.tensors import TensorChecker

__all__ = ["DeviceReads", "GraphLibrary", "profile_of"]


class DeviceReads(Protocol):
    """Batched reads of device memory (apir.host.backend.transfers.DeviceTransfers)."""

    def eligible(self, buf: HostBuffer) -> bool: ...

    def read(self, reads: Sequence[Tuple[int, int]]) -> List[ctypes.Array]: ...


class GraphLibrary(Protocol):
    """The context's backend library as the graph path reads it."""

    @property
    def g(self) -> Ggml: ...

    @property
    def checker(self) -> TensorChecker: ...

    @property
    def host(self) -> LibraryHost: ...

    @property
    def dev(self) -> int:
        """The `ggml_backend_dev_t` the graph's nodes are checked against."""
        ...

    @property
    def backend(self) -> int:
        """The `ggml_backend_t` that computes the graph."""
        ...

    @property
    def backend_name(self) -> str: ...

    @property
    def profile(self) -> Optional[BackendProfile]:
        """The backend's rules; None for a backend the host has none for (read it with
        `profile_of`)."""
        ...

    @property
    def op_enums(self) -> OpEnums: ...

    @property
    def use_counts(self) -> bool:
        """Whether built graphs carry ggml's use counts (apir.ggml.cgraph), so the backend
        fuses ops as it does locally."""
        ...

    @property
    def wire_use_counts(self) -> bool:
        """Whether those counts are raised to the guest's own, from its records (USE_COUNTS)."""
        ...

    @property
    def n_threads(self) -> int:
        """The threads the backend computes with (0: ggml's default)."""
        ...

    @property
    def buffers(self) -> HandleTable[HostBuffer]: ...

    @property
    def transfers(self) -> Optional[DeviceReads]:
        """Batched device reads, on a profile with async_transfers; else None."""
        ...

    def ids_buffer(self, size: int) -> int:
        """A device buffer of at least `size` bytes for a graph's checked row ids, kept
        between graphs; 0 when ggml cannot allocate one."""
        ...


def profile_of(lib: GraphLibrary) -> BackendProfile:
    """The profile `lib`'s graphs are checked and run with. Refused for a backend the host
    has no profile of: with no rules nothing is checked, so nothing computes."""
    profile = lib.profile
    if profile is None:
        raise Refused(
            f"the host has no profile of ggml backend {lib.backend_name!r} "
            "(apir.host.graph.profiles): it computes no graph there"
        )
    return profile
