"""The backend group of backend functions (virtgpu-forward-backend.cpp).

`backend_graph_compute` sends a serialized cgraph (`apir.codec.graph.serialize_graph`'s
bytes: u32 n_nodes, u64 node ids, u32 n_tensors, rpc tensors) through the data window, or
through a temporary blob when it does not fit (as the C does), and returns the host's
`ggml_status`.
"""

from __future__ import annotations

from apir.codec.constants import ApirBackendCommandType as F
from apir.guest.client_forward import ForwardCaller

__all__ = ["BackendCalls"]


class BackendCalls(ForwardCaller):
    """Mixed into ApirClient."""

    def backend_graph_compute(self, graph_bytes) -> int:
        """`apir_backend_graph_compute`: runs the graph on the host; returns its
        `enum ggml_status` (0 success)."""
        graph = memoryview(graph_bytes).cast("B")
        remote = self.remote
        if graph.nbytes <= remote.data_size:
            return self._graph_compute(remote.data, graph)
        with remote.temporary_blob(graph.nbytes) as blob:
            return self._graph_compute(blob, graph)

    def _graph_compute(self, blob, graph: memoryview) -> int:
        def fill() -> None:
            blob.memory[: graph.nbytes] = graph  # slice assignment: no lasting export of the mapping

        return self._call(F.BACKEND_GRAPH_COMPUTE, blob.res_id, graph.nbytes, fill=fill)[0]
