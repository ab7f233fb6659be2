"""The compute-time work-size bound: ggml's planned work buffer checked before any compute.

Theory of operation: the CPU backend's `ggml_backend_cpu_graph_compute` (ggml-cpu.cpp) calls
`ggml_graph_plan` and then allocates the planned work buffer with `new uint8_t[work_size]`;
a size the machine cannot give throws `std::bad_alloc` through C, and the host process
aborts (SIGABRT), taking every other guest with it. The plan is a pure function of the graph
and the thread count, so `check_work_size` runs the same `ggml_graph_plan` on the checked
host graph with the backend's thread count first and refuses the graph (`Refused`) when the
planned `work_size` exceeds the context's work budget. Only then is the graph computed.

The budget is `apir.host.work_budget` (bytes, apir.host.config `CONFIG_KEY_WORK_BUDGET`),
default `DEFAULT_WORK_BUDGET` (1 GiB); a value that is not a number means 0 (every graph that
plans a work buffer is refused), as for `apir.host.buffer_budget`. Only a CPU backend
(`ggml_backend_is_cpu`, and a profile whose `plans_work_buffer` says so) plans this way;
another backend (Vulkan, RPC, a configured `ggml.library.path`) allocates its own scratch, and
no bound is applied here. docs/security.md says what this bound covers beyond the shape rules,
why the default leaves room for real models, and why a varying thread count keeps it sound.
"""

from __future__ import annotations

from typing import Dict, Optional

from apir.host.config import CONFIG_KEY_WORK_BUDGET, DEFAULT_WORK_BUDGET
from apir.host.errors import Refused, log
from apir.host.graph.seams import GraphLibrary, profile_of


__all__ = [
    "check_work_size",
    "planned_work_size",
    "work_budget",
]


def planned_work_size(g, graph: int, n_threads: int) -> int:
    """Bytes of work buffer the CPU backend will allocate for `graph` (a host cgraph whose
    nodes passed the rules) on `n_threads` threads (0: ggml's default, as a CPU backend whose
    thread count was never set): `ggml_graph_plan(graph, n_threads, NULL).work_size`."""
    return int(g.ggml_graph_plan(graph, n_threads, None).work_size)


def work_budget(lib: GraphLibrary) -> int:
    """The context's work budget in bytes: config `apir.host.work_budget`, else
    `DEFAULT_WORK_BUDGET`."""
    value = lib.host.get_config(CONFIG_KEY_WORK_BUDGET)
    if value is None:
        return DEFAULT_WORK_BUDGET
    try:
        return int(value)
    except ValueError:
        log.error("%s=%r is not a number", CONFIG_KEY_WORK_BUDGET, value)
        return 0


def check_work_size(lib: GraphLibrary, graph: int, planned: Optional[Dict[int, int]] = None) -> int | None:
    """Refuses `graph` when the CPU backend of dispatcher `lib` would plan more work buffer
    for it than `work_budget(lib)` (its failed allocation would abort the host); returns the
    planned size (None for a backend that is not the CPU's). `planned`: the sizes planned for
    this very host graph before, by thread count (a cached graph's; filled here), since the
    plan depends on nothing else. Raises Refused."""
    g = lib.g
    if not profile_of(lib).plans_work_buffer or not g.ggml_backend_is_cpu(lib.backend):
        return None
    n_threads = lib.n_threads
    size = planned.get(n_threads) if planned is not None else None
    if size is None:
        size = planned_work_size(g, graph, n_threads)
        if planned is not None:
            planned[n_threads] = size
    budget = work_budget(lib)
    if size > budget:
        why = (
            f"ggml plans a {size}-byte work buffer, over the "
            f"context's work budget of {budget} bytes ({CONFIG_KEY_WORK_BUDGET})"
        )
        raise Refused(f"backend_graph_compute: {why}", reason=why, rule=f"{__name__}.check_work_size")
    return size
