"""Which ggml backend a workload runs on: the seam between apir.models and apir.guest.

Theory of operation: workloads take a `ggml_backend_t` and a buffer type and never ask where
they are. `open_backend(device=None)` picks one for the `apir embed` command and the
benchmarks: through APIR (the guest ggml backend, `apir.guest.backend`) over the device an
apir.devices spec names (``unix:PATH``: a local host's Unix socket, ``drm:NODE``: a virtio-gpu
render node, ...), or over the embedded host by default. If the embedded host cannot start,
the default falls back to ggml's CPU backend in this process and says so
(`OpenedBackend.fallback`, `.description`); a named device raises BackendUnavailable instead of
quietly computing somewhere else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from apir.errors import ApirError
from apir.ggml import load as load_ggml

if TYPE_CHECKING:
    from apir.guest.backend import ApirBackend

__all__ = ["OpenedBackend", "BackendUnavailable", "open_apir", "open_backend", "open_local_cpu", "open_local_device"]


class BackendUnavailable(ApirError, RuntimeError):
    """The requested APIR transport cannot be opened (not built yet, no device, no host)."""


@dataclass
class OpenedBackend:
    """A ggml backend ready for a workload.

    backend:     `ggml_backend_t` (int).
    buft:        the buffer type to allocate weights and compute buffers in.
    transport:   "embedded", "socket", "drm" (through APIR), "local-cpu" or "local" (no APIR).
    description: one line for people: device name and where it runs.
    fallback:    True when APIR was the default choice but local ggml CPU stands in for it.
    apir:        the guest backend object when through APIR (its devices, client, host
                 version, graph_compute raising apir errors); None otherwise.
    """

    backend: int
    buft: int
    transport: str
    description: str
    fallback: bool = False
    apir: Optional["ApirBackend"] = None
    _close: Optional[Callable[[], None]] = field(default=None, repr=False)

    @property
    def through_apir(self) -> bool:
        return self.transport not in ("local-cpu", "local")

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
    return OpenedBackend(
        backend,
        g.ggml_backend_get_default_buffer_type(backend),
        "local-cpu",
        desc,
        fallback=fallback_reason is not None,
        _close=lambda: g.ggml_backend_free(backend),
    )


def open_local_device(spec: str, n_threads: Optional[int] = None) -> OpenedBackend:
    """The ggml device an apir.ggml.backend_spec names (``cpu``, ``vulkan:0``, ``rpc:HOST:PORT``:
    its first device), in this process, not through APIR: the baseline a remote run on the same
    backend is compared with. A CPU device gets `n_threads` (default min(4, cores)). Raises
    BackendUnavailable."""
    import ctypes

    from apir.ggml.backend_spec import BackendSpecError, resolve

    g = load_ggml()
    try:
        dev = resolve(g, spec).devices[0]
    except BackendSpecError as exc:
        raise BackendUnavailable(str(exc)) from exc
    backend = g.ggml_backend_dev_init(dev, None)
    if not backend:
        raise BackendUnavailable(f"{spec}: ggml_backend_dev_init failed")
    reg = g.ggml_backend_dev_backend_reg(dev)
    fn_ptr = g.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_set_n_threads")
    threads = ""
    if fn_ptr:
        n = n_threads or min(4, os.cpu_count() or 1)
        ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int)(fn_ptr)(backend, n)
        threads = f", {n} threads"
    name = g.ggml_backend_dev_name(dev).decode()
    desc = f"{name} ({g.ggml_backend_dev_description(dev).decode()}; local ggml {g.version}{threads}, not through APIR)"
    return OpenedBackend(
        backend,
        g.ggml_backend_dev_buffer_type(dev),
        "local",
        desc,
        _close=lambda: g.ggml_backend_free(backend),
    )


def open_apir(
    device: Optional[str], config: Optional[dict] = None, device_options: Optional[dict] = None
) -> OpenedBackend:
    """The APIR guest backend (apir.guest.backend) over the device `device` names (an
    apir.devices spec; None: the embedded host), whose host, if embedded, gets `config`;
    `device_options` go to the device's constructor (apir.devices.open_device).
    Raises ValueError for a bad spec, BackendUnavailable when the device or the host cannot be
    reached."""
    from apir.devices import open_client, parse_spec
    from apir.guest.backend import ApirBackend

    spec = parse_spec(device)
    transport = spec.kind
    try:
        client = open_client(device, config=config, device_options=device_options)
    except (ApirError, OSError) as exc:
        raise BackendUnavailable(f"cannot open the APIR {transport} device: {exc}") from exc
    try:
        apir_backend = ApirBackend(client)
    except BaseException:
        client.close()
        raise
    g = apir_backend.g
    name = g.ggml_backend_dev_name(apir_backend.device).decode()
    description = f"{name} through APIR {'.'.join(map(str, client.host_version))} ({spec.where})"

    def close() -> None:
        apir_backend.close()
        client.close()

    return OpenedBackend(
        apir_backend.backend, apir_backend.buffer_type, transport, description, apir=apir_backend, _close=close
    )


def open_backend(
    device: Optional[str] = None,
    allow_fallback: bool = True,
    n_threads: Optional[int] = None,
    config: Optional[dict] = None,
    device_options: Optional[dict] = None,
) -> OpenedBackend:
    """The backend for `apir embed`: through APIR over the device `device` names (an
    apir.devices spec: ``unix:PATH``, ``drm:NODE``, ``embedded``, ...) or, with None, the
    embedded host, configured by `config` (HostContext configuration; `device_options`: the
    device constructor's, e.g. an embedded host's `context_factory`). When no device is named,
    the APIR backend is missing and `allow_fallback`, ggml's local CPU backend is returned
    flagged `fallback=True`. Raises ValueError (a bad spec), BackendUnavailable."""
    try:
        return open_apir(device, config, device_options)
    except BackendUnavailable as exc:
        if device is not None or not allow_fallback:
            raise
        return open_local_cpu(n_threads, fallback_reason=str(exc))
