"""The host's configuration: every key, its environment fallback and its default, in one place.

Theory of operation: a key is one entry of the C-style configuration (the dict a HostContext,
a LocalServer or a vhost-user server is given; ``--config KEY=VALUE`` on ``apir host serve``;
virglrenderer's `virgl_apir_configure_kv`). `HostContext.get_config` and `config_limit` read
the dict first, then the key's variable in `ENV_FALLBACKS`, then the default. Three keys are
the C's (`apir.load_library.path`, `ggml.library.*`, with the C host's variables); the rest
are apir's own: how the built-in backend library serves (`apir.host.*`) and the bounds on
what one guest can take of the host (time, buffers, connections, blobs, vhost-user objects).
Numeric bounds are read with `parse_limit`: a value that is not a non-negative number is
logged and the default used. The module that applies a key says what it does in detail.
None of these travel on the wire: the codec's constants are the protocol's.
"""

from __future__ import annotations

import logging
import os
from typing import Dict, Mapping, Optional, Union

__all__ = [
    "CONFIG_KEY_LOAD_LIBRARY_PATH",
    "CONFIG_KEY_GGML_LIBRARY_PATH",
    "CONFIG_KEY_GGML_LIBRARY_REG",
    "DEFAULT_GGML_LIBRARY_REG",
    "CONFIG_KEY_BACKEND",
    "CONFIG_KEY_IMPORT_HOST_MEMORY",
    "CONFIG_KEY_N_THREADS",
    "N_THREADS_FREE",
    "CONFIG_KEY_POLL",
    "DEFAULT_POLL",
    "CONFIG_KEY_DEVICE_TYPE",
    "CONFIG_KEY_ASYNC_TRANSFERS",
    "CONFIG_KEY_EXTENSIONS",
    "CONFIG_KEY_USE_COUNTS",
    "CONFIG_KEY_KEPT_GRAPH_BYTES",
    "DEFAULT_KEPT_GRAPH_BYTES",
    "MAX_KEPT_GRAPHS",
    "MAX_EVENTS",
    "CONFIG_KEY_WORK_BUDGET",
    "DEFAULT_WORK_BUDGET",
    "CONFIG_KEY_BUFFER_BUDGET",
    "CONFIG_KEY_MEMORY_LIMIT",
    "CONFIG_KEY_MAX_BUFFERS",
    "DEFAULT_MAX_BUFFERS",
    "CONFIG_KEY_GRAPH_TIME_LIMIT",
    "DEFAULT_GRAPH_TIME_LIMIT_S",
    "CONFIG_KEY_MAX_CONNECTIONS",
    "DEFAULT_MAX_CONNECTIONS",
    "CONFIG_KEY_MAX_CONNECTIONS_PER_PEER",
    "DEFAULT_MAX_CONNECTIONS_PER_PEER",
    "CONFIG_KEY_HELLO_TIMEOUT",
    "DEFAULT_HELLO_TIMEOUT_S",
    "CONFIG_KEY_MESSAGE_TIMEOUT",
    "DEFAULT_MESSAGE_TIMEOUT_S",
    "CONFIG_KEY_MAX_CONTEXT_BYTES",
    "DEFAULT_MAX_CONTEXT_BYTES",
    "CONFIG_KEY_MAX_PEER_BYTES",
    "PEER_BYTES_SHARE",
    "CONFIG_KEY_MAX_HOST_BYTES",
    "HOST_BYTES_SHARE",
    "CONFIG_KEY_LOCAL_SPIN",
    "DEFAULT_LOCAL_SPIN_S",
    "CONFIG_KEY_MAX_BLOBS",
    "DEFAULT_MAX_BLOBS",
    "CONFIG_KEY_VHOST_MAX_CONTEXTS",
    "DEFAULT_VHOST_MAX_CONTEXTS",
    "CONFIG_KEY_VHOST_MAX_RESOURCES",
    "DEFAULT_VHOST_MAX_RESOURCES",
    "CONFIG_KEY_VHOST_MAX_BLOB_BYTES",
    "DEFAULT_VHOST_MAX_BLOB_BYTES",
    "CONFIG_KEY_VHOST_BACKEND_TIMEOUT",
    "DEFAULT_VHOST_BACKEND_TIMEOUT_S",
    "CONFIG_KEY_VHOST_MESSAGE_TIMEOUT",
    "DEFAULT_VHOST_MESSAGE_TIMEOUT_S",
    "CONFIG_KEY_VHOST_MAX_FDS",
    "CONFIG_KEY_VHOST_PROCESS_MAX_FDS",
    "CONFIG_KEY_VHOST_PROCESS_MAX_BLOB_BYTES",
    "CONFIG_KEY_VHOST_MAX_MEM_REGIONS",
    "DEFAULT_VHOST_MAX_MEM_REGIONS",
    "CONFIG_KEY_VHOST_PROCESS_MAX_MEM_REGIONS",
    "DEFAULT_VHOST_PROCESS_MAX_MEM_REGIONS",
    "CONFIG_KEY_VHOST_MAX_MEM_BYTES",
    "DEFAULT_VHOST_MAX_MEM_BYTES",
    "CONFIG_KEY_VHOST_PROCESS_MAX_MEM_BYTES",
    "DEFAULT_VHOST_PROCESS_MAX_MEM_BYTES",
    "CONFIG_KEY_PEER",
    "CONFIG_KEY_PEER_MEMORY_LIMIT",
    "CONFIG_KEY_GRAPH_CHUNK_NODES",
    "DEFAULT_GRAPH_CHUNK_NODES",
    "ENV_FALLBACKS",
    "parse_limit",
    "config_limit",
]

log = logging.getLogger(__name__)

# --- the C's keys (virglrenderer src/apir), with the C host's variables ---------------------
CONFIG_KEY_LOAD_LIBRARY_PATH = "apir.load_library.path"  # a backend library (apir.host.library)
CONFIG_KEY_GGML_LIBRARY_PATH = "ggml.library.path"  # the ggml backend library it serves
CONFIG_KEY_GGML_LIBRARY_REG = "ggml.library.reg"  # that library's registration symbol
DEFAULT_GGML_LIBRARY_REG = "ggml_backend_init"

# --- the built-in backend library (apir.host.backend.library) --------------------------------
# the ggml backend spec (apir.ggml.backend_spec: cpu, vulkan[:N], rpc:...) when no
# ggml.library.path is set; default: the CPU device
CONFIG_KEY_BACKEND = "apir.host.backend"
# "1" offers buffer_from_ptr (guest blobs imported as device buffers) on a device that can
# import host memory although its props do not say so (ggml-vulkan: external memory host);
# "0" / "off" offers it on no device (ggml CPU's guests then send tensors as a GPU's do)
CONFIG_KEY_IMPORT_HOST_MEMORY = "apir.host.import_host_memory"
# Threads of a CPU-like backend (one that offers ggml_backend_set_n_threads); default: the
# machine's cores. ggml's own default (GGML_DEFAULT_N_THREADS = 4) oversubscribes small
# hosts, and its spinning worker threads then slow a graph down several times. The value
# N_THREADS_FREE: each graph on the cores other processes leave free at its start.
CONFIG_KEY_N_THREADS = "apir.host.n_threads"
N_THREADS_FREE = "free"
# ggml's polling level (0-100) of the context's threadpool (apir.host.backend.cpu_threadpool):
# how long idle worker threads spin for the next graph
CONFIG_KEY_POLL = "apir.host.poll"
DEFAULT_POLL = 0
# The device type device_get_type reports (cpu, gpu, igpu, accel); default: the device's own.
# A guest takes a remote device of type CPU for its own CPU: llama.cpp then runs everything on
# it as "the CPU backend" and asserts that its input buffers are host memory, which a virtgpu
# buffer is not. A host serving ggml CPU to such a guest presents it as `gpu`.
CONFIG_KEY_DEVICE_TYPE = "apir.host.device_type"
# deferred uploads / batched reads on device memory (apir.host.backend.transfers): on unless 0/off
CONFIG_KEY_ASYNC_TRANSFERS = "apir.host.async_transfers"

# The extensions beyond APIR 0.2 (apir.host.backend.extensions, docs/protocol.md "Extensions"):
# offered to a guest that asks unless 0 / off; off, the host answers every byte as APIR 0.2's
CONFIG_KEY_EXTENSIONS = "apir.host.extensions"
# Use counts in each built graph (apir.ggml.cgraph), so backends fuse ops as they do locally:
# on unless 0 / off
CONFIG_KEY_USE_COUNTS = "apir.host.use_counts"

# --- what one guest can make the host hold (decimal integers) --------------------------------
# bytes of the graphs a context keeps for graph replay (GRAPH_COMPUTE_KEEP), and how many
CONFIG_KEY_KEPT_GRAPH_BYTES = "apir.host.kept_graph_bytes"
DEFAULT_KEPT_GRAPH_BYTES = 64 << 20
MAX_KEPT_GRAPHS = 16
# events a context holds at once (EVENT_NEW, the ASYNC extension)
MAX_EVENTS = 64
# bytes of the CPU backend's planned work buffer per graph (apir.host.graph.work_plan)
CONFIG_KEY_WORK_BUDGET = "apir.host.work_budget"
DEFAULT_WORK_BUDGET = 1 << 30
# apir.host.backend.budget: bytes of ggml buffers per context and per host process (defaults:
# shares of the device's memory), and ggml buffers (handles) per context
CONFIG_KEY_BUFFER_BUDGET = "apir.host.buffer_budget"
CONFIG_KEY_MEMORY_LIMIT = "apir.host.memory_limit"
CONFIG_KEY_MAX_BUFFERS = "apir.host.max_buffers"
DEFAULT_MAX_BUFFERS = 4096
# bytes of ggml buffers all contexts of one peer hold together (default: half the device's
# total memory, what one context may hold), so that one guest's several contexts cannot take
# the whole process pool (apir.host.memory_limit) from the others
CONFIG_KEY_PEER_MEMORY_LIMIT = "apir.host.peer_memory_limit"
# Who a context belongs to: the transport sets it in the configuration it creates a context
# with (a VM's vhost-user front-end, a socket host's peer); contexts of one peer share its
# bounds. Unset: the context is a peer of its own. Never read from the environment.
CONFIG_KEY_PEER = "apir.host.peer"

# --- liveness bounds: time and descriptors one guest can take --------------------------------
# Wall time one backend_graph_compute may run before ggml's abort callback stops it (the guest
# gets GGML_STATUS_ABORTED): the guest's own Forward limit (apir.guest.remote), past which no
# one waits for it. 0 disables the bound. ggml looks between nodes: a node runs to its end.
CONFIG_KEY_GRAPH_TIME_LIMIT = "apir.host.graph_time_limit_s"
DEFAULT_GRAPH_TIME_LIMIT_S = 300.0
# Nodes per cgraph where the backend has no abort callback (ggml-vulkan, ggml-rpc): the graph is
# computed in ranges of this many nodes, the time limit and cancellation checked between them
# (apir.host.backend.compute_abort; the cost: benchmarks/bench_compute_chunks.py). 0: whole
# graphs, with no time limit nor cancellation on such a backend.
CONFIG_KEY_GRAPH_CHUNK_NODES = "apir.host.graph_chunk_nodes"
DEFAULT_GRAPH_CHUNK_NODES = 256
# Connections one socket host serves at once (HELLO or not), and of those, connections of one
# peer (a user id: apir.host.local.peers); more are closed at once. The socket file's default
# mode (0600) lets one user connect: the per-peer bound is then that user's number of guests.
CONFIG_KEY_MAX_CONNECTIONS = "apir.local.max_connections"
DEFAULT_MAX_CONNECTIONS = 32
CONFIG_KEY_MAX_CONNECTIONS_PER_PEER = "apir.local.max_connections_per_peer"
DEFAULT_MAX_CONNECTIONS_PER_PEER = 16
# Seconds a new connection may take to send its whole HELLO before the host hangs up (a
# deadline, not a bound on each read: a HELLO trickled a byte at a time is cut off too).
CONFIG_KEY_HELLO_TIMEOUT = "apir.local.hello_timeout_s"
DEFAULT_HELLO_TIMEOUT_S = 10.0
# Seconds a guest may take to send the rest of a message once its first bytes are in, and to
# take a reply the host could not send at once; past it the host hangs up. Between messages
# a guest may idle as long as it likes.
CONFIG_KEY_MESSAGE_TIMEOUT = "apir.local.message_timeout_s"
DEFAULT_MESSAGE_TIMEOUT_S = 10.0
# Bytes of shared memory files (the socket host's blob memory: apir.host.local.memfile) one
# context, one peer and the whole socket host hold; a file's size counts (it never shrinks).
# Past a bound, CREATE_BLOB (and RING) get ENOMEM. Per peer and in all the defaults are shares
# (numerator, denominator) of the machine's physical memory: one peer, with several contexts,
# cannot take it all, and all of them together leave the host room of its own.
CONFIG_KEY_MAX_CONTEXT_BYTES = "apir.local.max_context_bytes"
DEFAULT_MAX_CONTEXT_BYTES = 1 << 36
CONFIG_KEY_MAX_PEER_BYTES = "apir.local.max_peer_bytes"
PEER_BYTES_SHARE = (1, 2)
CONFIG_KEY_MAX_HOST_BYTES = "apir.local.max_host_bytes"
HOST_BYTES_SHARE = (3, 4)
# Seconds a connection thread polls its socket for the guest's next request after a reply,
# before it blocks (apir.host.local.server), while spinning pays (apir.local.spin_policy) and no
# other guest is connected. 0: block at once. A bound on spinning, not on the guest.
CONFIG_KEY_LOCAL_SPIN = "apir.local.spin_s"
DEFAULT_LOCAL_SPIN_S = 200e-6
# Blobs one context may hold at once (CREATE_BLOB past it: ENOSPC). With the default connection
# limit, at most 32,768 blob mappings: half of Linux's default vm.max_map_count.
CONFIG_KEY_MAX_BLOBS = "apir.local.max_blobs"
DEFAULT_MAX_BLOBS = 1024
# What one VM can make the vhost-user device (apir.host.vhost_user) hold: virtio-gpu contexts,
# resources, and bytes of HOST3D blobs at once; past a bound, VIRTIO_GPU_RESP_ERR_OUT_OF_MEMORY.
CONFIG_KEY_VHOST_MAX_CONTEXTS = "apir.vhost.max_contexts"
DEFAULT_VHOST_MAX_CONTEXTS = 64
CONFIG_KEY_VHOST_MAX_RESOURCES = "apir.vhost.max_resources"
DEFAULT_VHOST_MAX_RESOURCES = 4096
CONFIG_KEY_VHOST_MAX_BLOB_BYTES = "apir.vhost.max_blob_bytes"
DEFAULT_VHOST_MAX_BLOB_BYTES = 16 << 30
# Seconds the device waits for QEMU's ack of a SHMEM_MAP / SHMEM_UNMAP; past it the
# RESOURCE_MAP_BLOB fails (VIRTIO_GPU_RESP_ERR_UNSPEC).
CONFIG_KEY_VHOST_BACKEND_TIMEOUT = "apir.vhost.backend_timeout_s"
DEFAULT_VHOST_BACKEND_TIMEOUT_S = 10.0
# Seconds a front-end has to finish a message once its first byte came (header, payload and
# descriptors): a deadline for the whole message, not a timeout per recv; past it the
# session ends. Waiting for the next message is not bounded (an idle VM sends none).
CONFIG_KEY_VHOST_MESSAGE_TIMEOUT = "apir.vhost.message_timeout_s"
DEFAULT_VHOST_MESSAGE_TIMEOUT_S = 10.0
# Descriptors the vhost-user devices hold (HOST3D blobs' memfds and the mappings' copies,
# guest memory regions read through a descriptor): per VM and for all VMs of the process
# together. Defaults: a quarter and a half of RLIMIT_NOFILE's soft limit at start
# (apir.host.vhost_user.process_limits), the rest left to sockets, eventfds and libraries.
CONFIG_KEY_VHOST_MAX_FDS = "apir.vhost.max_fds"
CONFIG_KEY_VHOST_PROCESS_MAX_FDS = "apir.vhost.process_max_fds"
# Bytes of HOST3D blobs all VMs of the process hold together; default: physical memory.
CONFIG_KEY_VHOST_PROCESS_MAX_BLOB_BYTES = "apir.vhost.process_max_blob_bytes"
# A front-end's memory table (SET_MEM_TABLE / ADD_MEM_REG): regions and their bytes, per VM
# and for all VMs together. A region is mapped (address space) or read through a descriptor;
# sparse memfds cost no memory, so the bytes bound address space, not RAM. Past one: that
# front-end's message refused (REPLY_ACK status), logged.
CONFIG_KEY_VHOST_MAX_MEM_REGIONS = "apir.vhost.max_mem_regions"
DEFAULT_VHOST_MAX_MEM_REGIONS = 509  # VHOST_USER_MAX_RAM_SLOTS, what GET_MAX_MEM_SLOTS answers
CONFIG_KEY_VHOST_PROCESS_MAX_MEM_REGIONS = "apir.vhost.process_max_mem_regions"
DEFAULT_VHOST_PROCESS_MAX_MEM_REGIONS = 4096
CONFIG_KEY_VHOST_MAX_MEM_BYTES = "apir.vhost.max_mem_bytes"
DEFAULT_VHOST_MAX_MEM_BYTES = 1 << 40  # 1 TiB
CONFIG_KEY_VHOST_PROCESS_MAX_MEM_BYTES = "apir.vhost.process_max_mem_bytes"
DEFAULT_VHOST_PROCESS_MAX_MEM_BYTES = 16 << 40  # 16 TiB of x86-64's 128 TiB of user addresses

# The environment variable each key falls back to when the configuration does not set it.
ENV_FALLBACKS: Dict[str, str] = {
    CONFIG_KEY_LOAD_LIBRARY_PATH: "VIRGL_APIR_BACKEND_LIBRARY",
    CONFIG_KEY_GGML_LIBRARY_PATH: "APIR_LLAMA_CPP_GGML_LIBRARY_PATH",
    CONFIG_KEY_GGML_LIBRARY_REG: "APIR_LLAMA_CPP_GGML_LIBRARY_REG",
    CONFIG_KEY_ASYNC_TRANSFERS: "APIR_HOST_ASYNC_TRANSFERS",
    CONFIG_KEY_EXTENSIONS: "APIR_HOST_EXTENSIONS",
    CONFIG_KEY_USE_COUNTS: "APIR_HOST_USE_COUNTS",
    CONFIG_KEY_KEPT_GRAPH_BYTES: "APIR_HOST_KEPT_GRAPH_BYTES",
    CONFIG_KEY_BUFFER_BUDGET: "APIR_HOST_BUFFER_BUDGET",
    CONFIG_KEY_MEMORY_LIMIT: "APIR_HOST_MEMORY_LIMIT",
    CONFIG_KEY_MAX_BUFFERS: "APIR_HOST_MAX_BUFFERS",
    CONFIG_KEY_GRAPH_TIME_LIMIT: "APIR_HOST_GRAPH_TIME_LIMIT_S",
    CONFIG_KEY_GRAPH_CHUNK_NODES: "APIR_HOST_GRAPH_CHUNK_NODES",
    CONFIG_KEY_MAX_CONNECTIONS: "APIR_LOCAL_MAX_CONNECTIONS",
    CONFIG_KEY_MAX_CONNECTIONS_PER_PEER: "APIR_LOCAL_MAX_CONNECTIONS_PER_PEER",
    CONFIG_KEY_HELLO_TIMEOUT: "APIR_LOCAL_HELLO_TIMEOUT_S",
    CONFIG_KEY_MESSAGE_TIMEOUT: "APIR_LOCAL_MESSAGE_TIMEOUT_S",
    CONFIG_KEY_MAX_CONTEXT_BYTES: "APIR_LOCAL_MAX_CONTEXT_BYTES",
    CONFIG_KEY_MAX_PEER_BYTES: "APIR_LOCAL_MAX_PEER_BYTES",
    CONFIG_KEY_MAX_HOST_BYTES: "APIR_LOCAL_MAX_HOST_BYTES",
    CONFIG_KEY_LOCAL_SPIN: "APIR_LOCAL_SPIN_S",
    CONFIG_KEY_MAX_BLOBS: "APIR_LOCAL_MAX_BLOBS",
    CONFIG_KEY_VHOST_MAX_CONTEXTS: "APIR_VHOST_MAX_CONTEXTS",
    CONFIG_KEY_VHOST_MAX_RESOURCES: "APIR_VHOST_MAX_RESOURCES",
    CONFIG_KEY_VHOST_MAX_BLOB_BYTES: "APIR_VHOST_MAX_BLOB_BYTES",
    CONFIG_KEY_VHOST_BACKEND_TIMEOUT: "APIR_VHOST_BACKEND_TIMEOUT_S",
    CONFIG_KEY_VHOST_MESSAGE_TIMEOUT: "APIR_VHOST_MESSAGE_TIMEOUT_S",
    CONFIG_KEY_VHOST_MAX_FDS: "APIR_VHOST_MAX_FDS",
    CONFIG_KEY_VHOST_PROCESS_MAX_FDS: "APIR_VHOST_PROCESS_MAX_FDS",
    CONFIG_KEY_VHOST_PROCESS_MAX_BLOB_BYTES: "APIR_VHOST_PROCESS_MAX_BLOB_BYTES",
    CONFIG_KEY_VHOST_MAX_MEM_REGIONS: "APIR_VHOST_MAX_MEM_REGIONS",
    CONFIG_KEY_VHOST_PROCESS_MAX_MEM_REGIONS: "APIR_VHOST_PROCESS_MAX_MEM_REGIONS",
    CONFIG_KEY_VHOST_MAX_MEM_BYTES: "APIR_VHOST_MAX_MEM_BYTES",
    CONFIG_KEY_VHOST_PROCESS_MAX_MEM_BYTES: "APIR_VHOST_PROCESS_MAX_MEM_BYTES",
    CONFIG_KEY_PEER_MEMORY_LIMIT: "APIR_HOST_PEER_MEMORY_LIMIT",
}

Number = Union[int, float]


def parse_limit(value: Optional[str], key: str, default: Number) -> Number:
    """`value` (a configuration string, or None when unset) as a number of `default`'s type
    (int or float); `default` when unset, or, logged, when not a non-negative number."""
    if value is None:
        return default
    try:
        number = type(default)(value)
    except (TypeError, ValueError):
        number = -1
    if number < 0 or number != number:  # negative, or NaN
        log.error("%s=%r is not a non-negative number: using the default %s", key, value, default)
        return default
    return number


def config_limit(config: Optional[Mapping[str, str]], key: str, default: Number) -> Number:
    """The bound `key` from `config` (a C-style key/value dict, may be None), else from its
    environment variable, else `default` (see `parse_limit`)."""
    value = (config or {}).get(key)
    if value is None and key in ENV_FALLBACKS:
        value = os.environ.get(ENV_FALLBACKS[key])
    return parse_limit(None if value is None else str(value), key, default)
