"""Which ggml backend a workload runs on: the seam between apir.models and apir.guest.

Theory of operation: workloads take a `ggml_backend_t` and a buffer type and never ask where
they are. `open_backend(socket=None, drm=None)` picks one for the `apir embed` command and the
benchmark: through APIR (the guest ggml backend, `apir.guest.backend`) over the embedded host
by default, a local host's Unix socket (`socket`) or a virtio-gpu render node (`drm`). Until
that guest backend exists in this build, the default falls back to ggml's CPU backend in this
process and says so (`OpenedBackend.fallback`, `.description`); an explicit `socket` or `drm`
raises BackendUnavailable instead of quietly computing somewhere else.

`_open_apir` is the one function to wire to apir.guest.backend: it must return an
`OpenedBackend` whose `close` frees what it opened.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Optional

from apir.ggml import load as load_ggml

__all__ = ["OpenedBackend", "BackendUnavailable", "open_backend", "open_local_cpu"]


class BackendUnavailable(RuntimeError):
    """The requested APIR transport cannot be opened (not built yet, no device, no host)."""


@dataclass
class OpenedBackend:
    """A ggml backend ready for a workload.

    backend:     `ggml_backend_t` (int).
    buft:        the buffer type to allocate weights and compute buffers in.
    transport:   "embedded", "socket", "drm" (through APIR) or "local-cpu" (no APIR).
    description: one line for people: device name and where it runs.
    fallback:    True when APIR was the default choice but local ggml CPU stands in for it.
    """

    backend: int
    buft: int
    transport: str
    description: str
    fallback: bool = False
    _close: Optional[Callable[[], None]] = field(default=None, repr=False)

    @property
    def through_apir(self) -> bool:
        return self.transport != "local-cpu"

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None

    def __enter__(self) -> "OpenedBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_local_cpu(n_threads: Optional[int] = None, fallback_reason: Optional[str] = None) -> OpenedBackend:
    """ggml's CPU backend in this process (`ggml_backend_cpu_init`), `n_threads` threads (default:
    min(4, cores)). With `fallback_reason`, the result is flagged as standing in for APIR."""
    g = load_ggml()
    backend = g.ggml_backend_cpu_init()
    if not backend:
        raise BackendUnavailable("ggml_backend_cpu_init failed")
    threads = n_threads or min(4, os.cpu_count() or 1)
    g.ggml_backend_cpu_set_n_threads(backend, threads)
    desc = f"{g.ggml_backend_name(backend).decode()} (local ggml {g.version}, {threads} threads, not through APIR)"
    if fallback_reason:
        desc += f" -- FALLBACK: {fallback_reason}"
    return OpenedBackend(backend, g.ggml_backend_get_default_buffer_type(backend), "local-cpu", desc,
                         fallback=fallback_reason is not None, _close=lambda: g.ggml_backend_free(backend))


def _open_apir(socket: Optional[str], drm: Optional[str]) -> OpenedBackend:
    """The APIR guest backend over the chosen transport. Raises BackendUnavailable."""
    try:
        from apir.guest import backend as guest_backend  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailable("the APIR guest ggml backend (apir.guest.backend) is not in this build yet") from exc
    # Wire here: open the device (EmbeddedDevice / LocalDevice(socket) / DrmDevice(drm)), build
    # the guest backend on it and return OpenedBackend(backend, buft, transport, description,
    # _close=...). Until then this says so rather than guess at an interface still being written.
    raise BackendUnavailable("apir.guest.backend exists but apir.models.backends._open_apir is not wired to it yet")


def open_backend(socket: Optional[str] = None, drm: Optional[str] = None,
                 allow_fallback: bool = True, n_threads: Optional[int] = None) -> OpenedBackend:
    """The backend for `apir embed`: through APIR over a Unix socket (`socket`, a path), a render
    node (`drm`, e.g. /dev/dri/renderD128) or, with neither, the embedded host. When neither is
    given, the APIR backend is missing and `allow_fallback`, ggml's local CPU backend is returned
    flagged `fallback=True`. Raises ValueError (both given), BackendUnavailable."""
    if socket and drm:
        raise ValueError("give --socket or --drm, not both")
    try:
        return _open_apir(socket, drm)
    except BackendUnavailable as exc:
        if socket or drm or not allow_fallback:
            raise
        return open_local_cpu(n_threads, fallback_reason=str(exc))
