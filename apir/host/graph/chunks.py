"""A built graph's nodes as consecutive cgraphs of at most N nodes each.

For a backend that cannot stop a compute (no abort callback: ggml-vulkan, ggml-rpc), the host
computes a graph one range of nodes at a time and looks at its abort flag between them
(apir.host.backend.compute_abort). Each range is a cgraph of its own, made with
ggml_new_graph_custom and ggml_graph_add_node in a ggml context of the chunks' own, the same
host tensors as the whole graph's, in the same order: a node reads what the nodes before it
wrote to memory, whichever cgraph they were in. Each range shares the whole graph's hash set
and use counts (apir.ggml.cgraph.share_use_counts, as ggml_graph_view does), so a backend
fuses within a range where it would in the whole graph, and never across a range's end.
"""

from __future__ import annotations

from typing import List

from apir.ggml.cgraph import share_use_counts
from apir.ggml.lib import InitParams

__all__ = ["GraphChunks"]


class GraphChunks:
    """cgraphs over the nodes of cgraph `graph` in ranges of `chunk_nodes`: `graphs`, in
    order; `nbytes`: their context's size. `close` frees it. Made once per built graph (the
    graph cache keeps them with it), so its ggml calls, two a node, are not per compute."""

    def __init__(self, g, graph: int, chunk_nodes: int):
        self.g = g
        n = g.ggml_graph_n_nodes(graph)
        step = max(1, chunk_nodes)
        ranges = [(i, min(i + step, n)) for i in range(0, n, step)]
        self.nbytes = 1024 + sum(g.ggml_graph_overhead_custom(e - s, False) for s, e in ranges)
        self.ctx = g.ggml_init(InitParams(self.nbytes, None, True))
        if not self.ctx:
            raise MemoryError(f"ggml_init of a {self.nbytes}-byte context failed")
        self.graphs: List[int] = []
        for s, e in ranges:  # (the context was sized for exactly these: no ggml assert)
            chunk = g.ggml_new_graph_custom(self.ctx, e - s, False)
            for i in range(s, e):
                g.ggml_graph_add_node(chunk, g.ggml_graph_node(graph, i))
            share_use_counts(g, chunk, graph)
            self.graphs.append(chunk)

    def close(self) -> None:
        if self.ctx:
            self.g.ggml_free(self.ctx)
            self.ctx = None
        self.graphs = []
