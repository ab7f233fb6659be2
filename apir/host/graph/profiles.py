"""Backend profiles: what the host knows about the kernels of one ggml backend.

Theory of operation: every graph a guest sends is checked before compute against what the
kernels that will run it assume (apir.host.graph.shapes). Those facts belong to a backend: the
rule table, the type traits the rules read, the ops ggml-cpu runs on one task, the work buffer
ggml-cpu plans (apir.host.graph.work_plan), whether kernels read tensor memory the host can
address, whether a built graph may be reused and whether copies may be deferred. A profile
names them for one backend, by ggml registration name:

    CPU     ggml-cpu: the rules as written (they mirror ggml-cpu's asserts and loops).
    Vulkan  the CPU's rules AND the device's own supports_op on every node; row ids read into a
            device copy the kernel reads; no work-buffer bound; asynchronous copies.
    RPC     as Vulkan, with synchronous copies.

A backend without a profile is not guessed at: its device answers `supports_op` false and its
graphs are refused. Add a backend: a profile here (and its tests); nothing else in the host
changes. docs/security.md says why the CPU's rules are safe for GPU kernels; docs/design.md
("Host backends") what the audit of each backend found.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Mapping, Optional

from apir.host.graph.shapes import CHECKED_OPS
from apir.host.graph.shapes.base import op_enums, without_cpu_exemptions

__all__ = ["BackendProfile", "CPU", "VULKAN", "RPC", "PROFILES", "profile_for", "ONE_TASK_OPS_CPU"]

# Ops the CPU does not compute (ggml_op_is_empty): their nodes write nothing.
EMPTY_OPS = frozenset(("NONE", "RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE"))
# Ops ggml-cpu's ggml_get_n_tasks gives 1 task (ggml 0.10 and 0.20): a graph of only these runs
# on one thread (cplan.n_threads = the most tasks of any node).
ONE_TASK_OPS_CPU = EMPTY_OPS | {"GET_ROWS", "SET_ROWS", "GET_ROWS_BACK"}


@dataclass(frozen=True)
class BackendProfile:
    """The host's facts about one backend's kernels.

    `name`: the ggml registration name it applies to. `rules`: op name -> shape rule
    (apir.host.graph.shapes; an op without one is refused). `type_traits`: the build facts those
    rules read (`apir.host.graph.shapes.base.op_enums`: ggml-cpu's type traits). `one_task_ops`: ops a rule's
    one-thread kernel may share a graph with (apir.host.graph.build). `plans_work_buffer`: the
    backend allocates ggml-cpu's planned work buffer (apir.host.graph.work_plan bounds it).
    `host_addressable`: kernels read tensor memory at the host address of its buffer, so row
    ids are snapshotted by address and the kernel is pointed at the snapshot; else row ids are
    read through `ggml_backend_tensor_get` and the kernel is pointed at a device copy of the
    snapshot (apir.host.graph.build).
    `device_checks_nodes`: every node must also pass the device's own `supports_op` at
    graph_compute (the backend aborts on a node it has no kernel for).
    `caches_graphs`: the backend's graph_compute leaves the host's ggml_cgraph and tensors as
    built (audited per backend, docs/design.md "Host backends"), so a graph of a structure the
    context computed before reuses its built host graph (apir.host.graph.cache).
    `async_transfers`: uploads into the backend's default-type buffers are deferred and
    row-id reads batched with its set/get_tensor_async (apir.host.backend.transfers; audited per
    backend: ggml-vulkan aborts on any other buffer type).
    `id_writers`: ops whose I32 results are row ids in [0, src0.ne[0]) whatever their inputs
    on this backend's kernels, taken unread by their readers (apir.host.graph.computed_ids)."""

    name: str
    rules: Mapping[str, Callable]
    type_traits: Callable
    one_task_ops: frozenset
    plans_work_buffer: bool
    host_addressable: bool
    device_checks_nodes: bool
    caches_graphs: bool
    async_transfers: bool = False
    id_writers: frozenset = frozenset(("ARGSORT", "TOP_K"))


CPU = BackendProfile(
    "CPU",
    CHECKED_OPS,
    op_enums,
    one_task_ops=ONE_TASK_OPS_CPU,
    plans_work_buffer=True,
    host_addressable=True,
    device_checks_nodes=False,
    caches_graphs=True,
)
# The one-thread rule is a CPU fact; kept for Vulkan and RPC (the CPU's rules only narrow:
# docs/security.md).
# Empty-source exemptions read in ggml-cpu's kernels only (`base.cpu_empty_sources_ok`) are
# dropped: a GPU kernel was not read for them.
VULKAN = BackendProfile(
    "Vulkan",
    without_cpu_exemptions(CHECKED_OPS),
    op_enums,
    one_task_ops=ONE_TASK_OPS_CPU,
    plans_work_buffer=False,
    host_addressable=False,
    device_checks_nodes=True,
    caches_graphs=True,
    async_transfers=True,
    # not TOP_K: its n-ary search (topk_nary_search.comp) counts no value its ordering maps
    # outside [-inf, +inf), so a row of -NaN leaves slots holding the padding's id, ne00
    id_writers=frozenset(("ARGSORT",)),
)
# ggml-rpc's memory is another process's, like a GPU's: the same facts as Vulkan (and its
# server's device may be one).
RPC = replace(VULKAN, name="RPC", async_transfers=False)
PROFILES = {p.name.lower(): p for p in (CPU, VULKAN, RPC)}


def profile_for(reg_name: str) -> Optional[BackendProfile]:
    """The profile of the ggml registration named `reg_name` (``"CPU"``, ``"Vulkan"``,
    ``"RPC"``, or an rpc server's ``"RPC[host:port]"``), or None: a backend the host has no
    facts about, whose device supports nothing."""
    key = reg_name.lower()
    if key.startswith("rpc["):
        key = "rpc"
    return PROFILES.get(key)
