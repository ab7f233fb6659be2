"""apir's Python API: open an APIR device, compute ggml graphs on it, embed sentences through it.

    import apir
    with apir.open("embedded") as dev:        # or "unix:/tmp/apir.sock", "drm:/dev/dri/renderD128"
        g = dev.ggml                           # libggml's functions (apir.ggml), the build in use
        ...                                    # build a graph with g.ggml_*, in dev.context()
        dev.alloc_tensors(ctx); dev.set(a, array); dev.compute(graph); dev.get(out)
    vectors = apir.embed(["A sentence."])      # all-MiniLM-L6-v2, (n, 384) float32, through APIR

A `Device` is apir's ggml backend (apir.guest.backend.ApirBackend) over an APIR client: the
guest half in this process, the host wherever the device string says (`open`). Graphs
are built with the ggml functions of `dev.ggml` (ctypes over libggml-python's libraries) and
run with ggml's own allocator and `ggml_backend_graph_compute` on the host's buffers. `embed`
is `apir.models.minilm.embed` on such a device: the code `apir embed` runs. Nothing here is
imported until used, so `import apir` stays light (no numpy, no Numba).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator, List, Mapping, Optional, Sequence, Union

from apir.errors import ApirError

if TYPE_CHECKING:
    import numpy as np

    from apir.ggml import Ggml
    from apir.models.backends import OpenedBackend

__all__ = ["Device", "DeviceError", "embed", "open"]


class DeviceError(ApirError, ValueError):
    """A device string or option apir does not accept; for a device string, the message names
    the accepted forms."""


class Device:
    """An open APIR device and apir's ggml backend on it. Made by `apir.open`; a context
    manager (or `close()`) frees what it allocated, the backend and the connection.

    Attributes: `spec` (the device string), `kind` ("embedded", "socket", "drm"),
    `description` (one line: the host's device and where it runs), `ggml` (the `apir.ggml.Ggml`
    build: every ggml function apir declares, e.g. `ggml.ggml_mul_mat`, and `ggml.types`),
    `backend` (ggml_backend_t), `buffer_type` (ggml_backend_buffer_type_t), `host_version`.
    Pointers are ints, valid until `close()`.
    """

    def __init__(self, spec: str, opened: "OpenedBackend"):
        assert opened.apir is not None  # apir.open opens through APIR only
        self.spec = spec
        self.kind = opened.transport
        self.description = opened.description
        self._opened = opened
        self._apir = opened.apir
        self.ggml: Ggml = opened.apir.g
        self.backend: int = opened.backend
        self.buffer_type: int = opened.buft
        self.host_version = tuple(opened.apir.client.host_version)
        self._buffers: List[int] = []
        self.closed = False

    def _check_open(self) -> None:
        if self.closed:
            raise DeviceError(f"device {self.spec!r} is closed")

    @contextlib.contextmanager
    def context(self, n_tensors: int = 64, graph_size: int = 2048) -> Iterator[int]:
        """A ggml context (`ggml_context *`, int) for `n_tensors` tensors and one graph of up to
        `graph_size` nodes, metadata only (no_alloc: `alloc_tensors` puts the data on the
        host); freed on exit."""
        from apir.ggml import InitParams

        g = self.ggml
        mem = g.ggml_tensor_overhead() * n_tensors + g.ggml_graph_overhead_custom(graph_size, False)
        ctx = g.ggml_init(InitParams(mem, None, True))
        if not ctx:
            raise ApirError("ggml_init failed")
        try:
            yield ctx
        finally:
            g.ggml_free(ctx)

    def alloc_tensors(self, ctx: int) -> int:
        """Allocates every tensor of `ctx` that has no data yet in one buffer of this device
        (`ggml_backend_alloc_ctx_tensors_from_buft`), freed by `close()`; the buffer (int)."""
        self._check_open()
        buf = self.ggml.ggml_backend_alloc_ctx_tensors_from_buft(ctx, self.buffer_type)
        if not buf:
            raise ApirError(f"cannot allocate the tensors of context {ctx:#x} on {self.description}")
        self._buffers.append(buf)
        return buf

    def set(self, tensor: int, array: "np.ndarray") -> None:
        """Writes `array` (the tensor's dtype and element count) into `tensor` on the host."""
        from apir.guest.backend import tensor_set

        self._check_open()
        tensor_set(self.ggml, tensor, array)

    def get(self, tensor: int) -> "np.ndarray":
        """The data of `tensor`, read from the host (numpy order: shape = reversed ne)."""
        from apir.guest.backend import tensor_get

        self._check_open()
        return tensor_get(self.ggml, tensor)

    def compute(self, graph: int) -> None:
        """`ggml_backend_graph_compute` on the host. Raises apir.guest.backend's
        GraphComputeError (a status other than success) or BackendCallbackError."""
        self._check_open()
        self._apir.graph_compute(graph, self.backend)

    def close(self) -> None:
        """Frees the buffers of `alloc_tensors`, the backend and the device. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for buf in self._buffers:
            self.ggml.ggml_backend_buffer_free(buf)
        self._buffers.clear()
        self._opened.close()

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<apir.Device {self.spec!r}{' closed' if self.closed else ''}: {self.description}>"


def _host_config(spec: str, kind: str, backend: Optional[str], config: Optional[Mapping[str, str]]) -> Optional[dict]:
    """The embedded host's configuration; other hosts are configured where they run."""
    from apir.host import config as host_config

    if not backend and not config:
        return None
    if kind != "embedded":
        raise DeviceError(f"device {spec!r}: backend= and config= configure an embedded host; give them to its host")
    known = sorted(getattr(host_config, n) for n in dir(host_config) if n.startswith("CONFIG_KEY_"))
    out = dict(config or {})
    for key in out:
        if key not in known:
            raise DeviceError(f"config key {key!r}: not a host configuration key (known: {', '.join(known)})")
    if backend:
        _check_backend(backend)
        out[host_config.CONFIG_KEY_BACKEND] = backend
    return out


def _check_backend(spec: str) -> None:
    """Refuses, before the host starts, a ggml backend the loaded build cannot serve, saying
    what is missing (the build, a driver, a device: docs/gpu.md)."""
    from apir.ggml import backend_spec, load

    try:
        backend_spec.check_usable(load(), spec)
    except backend_spec.BackendSpecError as exc:
        raise DeviceError(f"backend {spec!r}: {exc}") from None


def open(  # apir.open, as gzip.open: the module's entry point (no use of the builtin here)
    device: str = "embedded", *, backend: Optional[str] = None, config: Optional[Mapping[str, str]] = None
) -> Device:
    """Opens the APIR device `device` names and apir's ggml backend on it.

    device:  ``embedded`` (a host in this process, on ggml CPU unless `backend` says),
             ``unix:PATH`` (an `apir host serve --socket PATH` host) or ``drm[:NODE]`` (a
             virtio-gpu render node in a VM, default the first one).
    backend: the embedded host's ggml backend: ``cpu``, ``vulkan[:N]``, ``rpc:HOST:PORT``.
    config:  other embedded-host configuration keys (apir.host.config), e.g.
             ``{"apir.host.n_threads": "2"}``.

    Raises DeviceError (a bad device string; an unknown key; a backend the loaded ggml cannot
    serve, naming what is missing; backend/config for a host that is not embedded) and
    apir.models.backends.BackendUnavailable (the device or its host cannot be reached; the
    message says why).
    """
    from apir.devices import parse_spec
    from apir.models.backends import open_apir

    try:
        kind = parse_spec(device).kind
    except ValueError as exc:
        raise DeviceError(str(exc)) from None
    return Device(device, open_apir(device, _host_config(device, kind, backend, config)))


def embed(sentences: Sequence[str], device: Union[str, Device] = "embedded", *, batch_size: int = 32) -> "np.ndarray":
    """all-MiniLM-L6-v2 embeddings of `sentences` computed through APIR on `device` (a device
    string as for `open`, or an open `Device`, which stays open): (len(sentences), 384)
    float32, unit-length rows. Uploads the model's weights each call (about 90 MB); for many
    calls keep an `apir.models.MiniLM(dev.backend, dev.buffer_type)`.

    Raises apir.models.ModelNotInstalled (its message has the install command), DeviceError,
    BackendUnavailable, apir.models.MiniLMError (a failed compute)."""
    from apir.models.minilm import embed as embed_on

    if isinstance(sentences, str):
        raise TypeError("embed() takes a sequence of sentences, not one string")
    if isinstance(device, Device):
        device._check_open()
        return embed_on(sentences, device.backend, device.buffer_type, batch_size)
    with open(device) as dev:
        return embed_on(sentences, dev.backend, dev.buffer_type, batch_size)
