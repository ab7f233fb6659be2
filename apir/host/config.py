"""apir's liveness bounds: how long a graph may run, and what one guest may hold of the socket
host's connections and descriptors. Their keys, defaults and how a value is read.

Theory of operation: each bound is a key of the C-style configuration (the dict a HostContext or
a LocalServer is given, ``--config KEY=VALUE`` on ``apir host serve``), with an environment
variable as fallback, like the C's keys (apir.host.component.context.CONFIG_ENV_FALLBACKS includes these):

    apir.host.graph_time_limit_s  (APIR_HOST_GRAPH_TIME_LIMIT_S)  default 300 s
        Wall time one backend_graph_compute may run before ggml's abort callback stops it (the
        guest gets GGML_STATUS_ABORTED). 300 s is the guest's own Forward limit
        (apir.guest.remote.DEFAULT_FORWARD_TIMEOUT_S): a graph running longer has no one
        waiting for it. 0 disables the bound. ggml looks at the callback between nodes, so a
        single node runs to its end (the shape rules bound one node's work).
    apir.local.max_connections    (APIR_LOCAL_MAX_CONNECTIONS)    default 32
        Connections one socket host serves at once (HELLO or not); more are closed at once.
    apir.local.hello_timeout_s    (APIR_LOCAL_HELLO_TIMEOUT_S)    default 10 s
        How long a new connection may take to send its HELLO before the host hangs up.
    apir.local.spin_s             (APIR_LOCAL_SPIN_S)             default 200 us
        How long a connection thread polls its socket for the guest's next request after a
        reply, before it blocks (apir.host.local.server); only while spinning pays
        (apir.local.spin_policy) and no other guest is connected. 0: block at once. A bound
        on spinning, not on the guest.
    apir.local.max_blobs          (APIR_LOCAL_MAX_BLOBS)          default 1024
        Blobs one context may hold at once (CREATE_BLOB past it: ENOSPC). With the default
        connection limit, at most 32,768 blob mappings: half of Linux's default
        vm.max_map_count, so guests cannot use up the host process's mappings either.
    apir.vhost.max_contexts       (APIR_VHOST_MAX_CONTEXTS)       default 64
    apir.vhost.max_resources      (APIR_VHOST_MAX_RESOURCES)      default 4096
    apir.vhost.max_blob_bytes     (APIR_VHOST_MAX_BLOB_BYTES)     default 16 GiB
        What one VM can make the vhost-user device (apir.host.vhost_user) hold: virtio-gpu
        contexts, resources, and bytes of HOST3D blobs (memfds) at once. Past a bound the
        command gets VIRTIO_GPU_RESP_ERR_OUT_OF_MEMORY.
    apir.vhost.backend_timeout_s  (APIR_VHOST_BACKEND_TIMEOUT_S)  default 10 s
        How long the device waits for QEMU's ack of a SHMEM_MAP / SHMEM_UNMAP; past it the
        RESOURCE_MAP_BLOB fails (VIRTIO_GPU_RESP_ERR_UNSPEC).

A value that is not a number, or is negative, is logged and the default is used instead.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping, Optional, Union

from apir.codec.constants import (
    CONFIG_KEY_GRAPH_TIME_LIMIT,
    CONFIG_KEY_HELLO_TIMEOUT,
    CONFIG_KEY_LOCAL_SPIN,
    CONFIG_KEY_MAX_BLOBS,
    CONFIG_KEY_MAX_CONNECTIONS,
    CONFIG_KEY_VHOST_BACKEND_TIMEOUT,
    CONFIG_KEY_VHOST_MAX_BLOB_BYTES,
    CONFIG_KEY_VHOST_MAX_CONTEXTS,
    CONFIG_KEY_VHOST_MAX_RESOURCES,
    ENV_GRAPH_TIME_LIMIT,
    ENV_HELLO_TIMEOUT,
    ENV_LOCAL_SPIN,
    ENV_MAX_BLOBS,
    ENV_MAX_CONNECTIONS,
    ENV_VHOST_BACKEND_TIMEOUT,
    ENV_VHOST_MAX_BLOB_BYTES,
    ENV_VHOST_MAX_CONTEXTS,
    ENV_VHOST_MAX_RESOURCES,
)

__all__ = [
    "LIMIT_ENV_FALLBACKS",
    "DEFAULT_GRAPH_TIME_LIMIT_S",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_HELLO_TIMEOUT_S",
    "DEFAULT_LOCAL_SPIN_S",
    "DEFAULT_MAX_BLOBS",
    "DEFAULT_VHOST_MAX_CONTEXTS",
    "DEFAULT_VHOST_MAX_RESOURCES",
    "DEFAULT_VHOST_MAX_BLOB_BYTES",
    "DEFAULT_VHOST_BACKEND_TIMEOUT_S",
    "parse_limit",
    "config_limit",
]

log = logging.getLogger(__name__)

DEFAULT_GRAPH_TIME_LIMIT_S = 300.0
DEFAULT_MAX_CONNECTIONS = 32
DEFAULT_HELLO_TIMEOUT_S = 10.0
DEFAULT_MAX_BLOBS = 1024
DEFAULT_LOCAL_SPIN_S = 200e-6
DEFAULT_VHOST_MAX_CONTEXTS = 64
DEFAULT_VHOST_MAX_RESOURCES = 4096
DEFAULT_VHOST_MAX_BLOB_BYTES = 16 << 30
DEFAULT_VHOST_BACKEND_TIMEOUT_S = 10.0

LIMIT_ENV_FALLBACKS = {
    CONFIG_KEY_GRAPH_TIME_LIMIT: ENV_GRAPH_TIME_LIMIT,
    CONFIG_KEY_MAX_CONNECTIONS: ENV_MAX_CONNECTIONS,
    CONFIG_KEY_HELLO_TIMEOUT: ENV_HELLO_TIMEOUT,
    CONFIG_KEY_MAX_BLOBS: ENV_MAX_BLOBS,
    CONFIG_KEY_LOCAL_SPIN: ENV_LOCAL_SPIN,
    CONFIG_KEY_VHOST_MAX_CONTEXTS: ENV_VHOST_MAX_CONTEXTS,
    CONFIG_KEY_VHOST_MAX_RESOURCES: ENV_VHOST_MAX_RESOURCES,
    CONFIG_KEY_VHOST_MAX_BLOB_BYTES: ENV_VHOST_MAX_BLOB_BYTES,
    CONFIG_KEY_VHOST_BACKEND_TIMEOUT: ENV_VHOST_BACKEND_TIMEOUT,
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
    if value is None and key in LIMIT_ENV_FALLBACKS:
        value = os.environ.get(LIMIT_ENV_FALLBACKS[key])
    return parse_limit(None if value is None else str(value), key, default)
