"""The extensions beyond APIR 0.2, guest side (docs/protocol.md, "Extensions").

`negotiate_extensions(wanted)` sends EXT_QUERY with the bits the guest has; a 0.2 host answers
APIR_BACKEND_FORWARD_INDEX_INVALID, which means none. `extensions` holds the bits both sides
have (0 before, or without the call: then no byte differs from APIR 0.2) and `device_count`
the devices the host serves this context. `on_device(i)` is this client as device i: its
device functions select device i first (DEVICE_SELECT, only when another one is selected);
buffer and graph commands need no selection (the host finds the device from their handles).
With graph replay, `backend_graph_compute` sends a graph it sent before as GRAPH_RECOMPUTE
of its id (the id of its bytes, up to MAX_KEPT_GRAPHS of them) and the graph itself only
when new or when the host no longer has it (APIR_BACKEND_GRAPH_UNKNOWN).
"""

from __future__ import annotations

import collections
import itertools
import os
from typing import Any, Tuple, cast

from apir.codec.constants import (
    APIR_BACKEND_FORWARD_INDEX_INVALID,
    APIR_BACKEND_GRAPH_UNKNOWN,
    APIR_EXTENSIONS_ALL,
    ApirBackendCommandType,
    ApirExtension,
    ApirExtensionCommandType as X,
)
from apir.guest.client_forward import ForwardCaller
from apir.guest.errors import BackendFunctionError

__all__ = ["ExtensionCalls", "DeviceView", "default_extensions", "ENV_EXTENSIONS", "MAX_KEPT_GRAPHS"]

ENV_EXTENSIONS = "APIR_EXTENSIONS"  # 0 / off: the guest never asks (every byte APIR 0.2's)
MAX_KEPT_GRAPHS = 16  # graph ids the guest remembers (the host keeps at most as many)


def default_extensions() -> int:
    """The bits a guest asks for unless told: all it has, none under APIR_EXTENSIONS=0/off."""
    off = os.environ.get(ENV_EXTENSIONS, "").lower() in ("0", "off", "false", "no")
    return 0 if off else APIR_EXTENSIONS_ALL


class ExtensionCalls(ForwardCaller):
    """Mixed into ApirClient (before BackendCalls, whose graph compute it extends)."""

    extensions = 0  # ApirExtension bits both sides have
    device_count = 1  # devices the host serves this context
    selected_device = 0

    def _ext(self, function: X, *args: Any, **kwargs: Any) -> Tuple[Any, ...]:
        # the Forward table (and so `_call`) takes the extensions' ids as it takes 0.2's
        return self._call(cast(ApirBackendCommandType, function), *args, **kwargs)

    def negotiate_extensions(self, wanted: int = APIR_EXTENSIONS_ALL) -> int:
        """EXT_QUERY: the bits of `wanted` the host has too (0 from an APIR 0.2 host)."""
        try:
            agreed, count = self._ext(X.EXT_QUERY, wanted)
        except BackendFunctionError as exc:
            if exc.function_code != APIR_BACKEND_FORWARD_INDEX_INVALID:
                raise
            agreed, count = 0, 1
        self.extensions = agreed & wanted
        self.device_count = max(1, count) if self.extensions & ApirExtension.DEVICES else 1
        self.selected_device = 0
        self._graph_ids: "collections.OrderedDict[bytes, int]" = collections.OrderedDict()
        self._next_graph_id = itertools.count(1)
        return self.extensions

    def select_device(self, index: int) -> None:
        """DEVICE_SELECT, unless `index` is selected already. Hold `remote.lock` around it and
        the device function it is for."""
        if not 0 <= index < self.device_count:
            raise IndexError(f"device {index} of {self.device_count}")
        if index != self.selected_device:
            self._ext(X.DEVICE_SELECT, index)
            self.selected_device = index

    def on_device(self, index: int) -> "DeviceView":
        if not 0 <= index < self.device_count:
            raise IndexError(f"device {index} of {self.device_count}")
        return DeviceView(self, index)

    def backend_graph_compute(self, graph_bytes) -> int:
        if not self.extensions & ApirExtension.GRAPH_REPLAY:
            return super().backend_graph_compute(graph_bytes)  # type: ignore[misc]
        key = bytes(memoryview(graph_bytes).cast("B"))
        graph_id = self._graph_ids.get(key)
        if graph_id is not None:
            self._graph_ids.move_to_end(key)
            try:
                return self._ext(X.GRAPH_RECOMPUTE, graph_id)[0]
            except BackendFunctionError as exc:
                if exc.function_code != APIR_BACKEND_GRAPH_UNKNOWN:
                    raise
        else:
            graph_id = next(self._next_graph_id)
            self._graph_ids[key] = graph_id
            while len(self._graph_ids) > MAX_KEPT_GRAPHS:
                self._graph_ids.popitem(last=False)
        return self._send_graph(memoryview(key), graph_id)

    def _send_graph(self, graph: memoryview, graph_id: int) -> int:
        remote = self.remote
        if graph.nbytes <= remote.data_size:
            return self._keep(remote.data, graph, graph_id)
        with remote.temporary_blob(graph.nbytes) as blob:
            return self._keep(blob, graph, graph_id)

    def _keep(self, blob, graph: memoryview, graph_id: int) -> int:
        def fill() -> None:
            blob.memory[: graph.nbytes] = graph

        return self._ext(X.GRAPH_COMPUTE_KEEP, graph_id, blob.res_id, graph.nbytes, fill=fill)[0]


class DeviceView:
    """An ApirClient as device `index` of the host's device set: every `device_*` function
    selects the device first, under the Remote's lock; everything else is the client's."""

    def __init__(self, client: ExtensionCalls, index: int):
        self._client = client
        self.device_index = index

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not name.startswith("device_") or not callable(attr):
            return attr
        client, index = self._client, self.device_index

        def on_device(*args: Any, **kwargs: Any) -> Any:
            with client.remote.lock:
                client.select_device(index)
                return attr(*args, **kwargs)

        return on_device

    def __repr__(self) -> str:
        return f"DeviceView(device {self.device_index})"
