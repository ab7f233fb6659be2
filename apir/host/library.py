"""What LoadLibrary loads: the backend library protocol and how the component picks one.

Theory of operation: virglrenderer's APIR component dlopens a backend library
(`apir.load_library.path`) and calls three symbols of it; apir mirrors that seam as `BackendLibrary`:

    initialize(host) -> int          apir_backend_initialize(ctx_id, callbacks)
    dispatch(function_id, dec, enc)  apir_backend_dispatcher(ctx_id, callbacks, cmd_type, ...)
    deinit()                         apir_backend_deinit(ctx_id)

and what the component asks of it that the C seam has no symbol for: `cancel_compute(reason)`
(the guest is gone), `forget_resource(res_id)` (a blob is being removed), `buffer_count()`
and `commands_bounded_in_time` (a C library: no-op, None, False). `host` is the `LibraryHost`
the component passes, the twin of `virgl_apir_callbacks`: `get_config(key)`, `get_shmem(res_id)`
(a `Resource`, with its size, where the C gives a bare pointer), `ctx_id`, `guest_version`,
`host_version`, and the `forward_layouts` and `forward_replies` of their version. `initialize`
returns the C's codes: 3/4/5 for a missing configuration, an unopenable library or a missing
symbol, 6 + n for the ggml dispatcher's own code n (6 is success, like 0). Without a
configured library the built-in `apir.host.backend.library.PythonBackendLibrary` serves; a
configured path goes to the `HostContext`'s `library_factory`, by default the C adapter
(apir.host.backend.c_library; docs/interop.md).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Protocol, Tuple, runtime_checkable

from apir.codec.constants import ApirLoadLibraryReturnCode
from apir.codec.forward import Layout
from apir.codec.wire import Decoder, Encoder
from apir.errors import ApirError
from apir.host.resources import Resource

__all__ = ["BackendLibrary", "LibraryHost", "LibraryLoadError", "PostingLibrary"]


class LibraryHost(Protocol):
    """The component as a backend library sees it (`virgl_apir_callbacks` + context)."""

    ctx_id: int
    guest_version: Tuple[int, int]  # (major, minor) the guest sent in HandShake
    host_version: Tuple[int, int]  # (major, minor) of the protocol this host speaks
    # each function's (arguments, reply) Layouts in the version the two negotiated, by id
    forward_layouts: Dict[int, Tuple[Layout, Layout]]
    # each function's reply writer in that version, by C name (apir.codec.forward.reply_writers)
    forward_replies: Dict[str, Callable[..., None]]

    def get_config(self, key: str) -> Optional[str]: ...

    def get_shmem(self, res_id: int) -> Optional[Resource]: ...


class BackendLibrary(Protocol):
    """A loaded backend library of one context (see the module docstring)."""

    def initialize(self, host: LibraryHost) -> int: ...

    def dispatch(self, function_id: int, dec: Decoder, enc: Encoder) -> int: ...

    def deinit(self) -> None: ...

    def cancel_compute(self, reason: str) -> None:
        """Stops the graph compute in flight and refuses later ones; any thread."""
        ...

    def forget_resource(self, res_id: int) -> None:
        """Blob `res_id` is being removed: free what wraps it."""
        ...

    def buffer_count(self) -> Optional[int]:
        """The ggml buffers this context holds, or None when the library cannot tell."""
        ...

    @property
    def commands_bounded_in_time(self) -> bool:
        """Whether a bounded command (one `may_run_long` calls bounded) also ends in bounded
        time: the backend's kernels work in host memory."""
        ...


class LibraryLoadError(ApirError):
    """A backend library could not be loaded; `code` is the LoadLibrary return code."""

    def __init__(self, code: ApirLoadLibraryReturnCode, message: str):
        super().__init__(message)
        self.code = ApirLoadLibraryReturnCode(code)


@runtime_checkable
class PostingLibrary(Protocol):
    """A library that runs posted commands (the ASYNC extension, docs/protocol.md 12.7): the
    component hands it a Forward whose function id has APIR_FORWARD_POSTED while
    `accepts_posted()`, and writes no reply for it."""

    def accepts_posted(self) -> bool: ...

    def post(self, function_id: int, dec: Decoder) -> None: ...
