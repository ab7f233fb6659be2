"""The ASYNC extension, guest side (docs/protocol.md 12.7): posted commands, synchronize, events.

With ASYNC agreed (`posting`), `buffer_set_tensor` of at most POST_WINDOW_SIZE bytes copies
its bytes into the post window (apir.guest.remote) and posts BUFFER_SET_TENSOR_AT;
`buffer_clear` and `buffer_cpy_tensor(..., post=True)` are posted as they are; sets and clears
of a guest-mapped buffer (device_buffer_from_ptr) are not, since the guest reads its memory
directly. Posts go with the next call's EXECBUFFER and nothing waits for them: the host runs a
context's commands in order, so the reply of any waited-for command (every other one) means
they ran, and the window and the count start over. A set that would overflow the window, or a
post past APIR_MAX_POSTED, is sent waited for instead.

A posted command's failure comes back as POSTED_FAILED from the next waited-for command,
which did not run: the client then sends SYNCHRONIZE (which names the failed command), sends
the waited-for command again and raises `PostedCommandError`. `synchronize()` sends
SYNCHRONIZE only when something was posted since the last reply (ggml calls it after every
graph compute). Events (`event_new` ... `event_free`) are waited for.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Set, Tuple, cast

import numpy as np

from apir.codec.constants import (
    APIR_BACKEND_POSTED_FAILED,
    APIR_EXTENSIONS_ALL,
    APIR_FORWARD_POSTED,
    APIR_MAX_POSTED,
    ApirBackendCommandType,
    ApirBackendCommandType as F,
    ApirExtension,
    ApirExtensionCommandType as X,
)
from apir.codec.copy import copy_bytes
from apir.guest.client_forward import ForwardCaller
from apir.guest.client_tensor import rpc_tensor_bytes
from apir.guest.errors import ApirError, BackendFunctionError, PostedCommandError
from apir.guest.remote import POST_WINDOW_SIZE

__all__ = ["AsyncCalls"]

_ALIGN = 16  # each posted set's bytes start at a multiple of this in the window


def _name(function: int) -> str:
    for kind in (ApirBackendCommandType, X):
        try:
            return kind(function).c_name
        except ValueError:
            pass
    return f"function {function:#x}"


class AsyncCalls(ForwardCaller):
    """Mixed into ApirClient, first: its `_call` sees every waited-for command."""

    posting = False  # ASYNC agreed
    _posts: List[str] = []  # what was posted since the last reply, in order
    _post_used = 0  # bytes of the post window taken since the last reply

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._mapped: Set[int] = set()  # device_buffer_from_ptr's buffers: the guest reads them itself

    def negotiate_extensions(self, wanted: int = APIR_EXTENSIONS_ALL) -> int:
        agreed = super().negotiate_extensions(wanted)  # type: ignore[misc]
        self.posting = bool(agreed & ApirExtension.ASYNC)
        self._settled()
        return agreed

    def device_buffer_from_ptr(self, size: int, max_tensor_size: int):
        blob, handle, buft = super().device_buffer_from_ptr(size, max_tensor_size)  # type: ignore[misc]
        self._mapped.add(handle)
        return blob, handle, buft

    def buffer_free_buffer(self, buffer: int) -> None:
        super().buffer_free_buffer(buffer)  # type: ignore[misc]
        self._mapped.discard(buffer)

    def _settled(self) -> None:
        self._posts = []
        self._post_used = 0

    @property
    def in_flight(self) -> int:
        """Commands posted since the last reply."""
        return len(self._posts)

    def _call(
        self,
        function: ApirBackendCommandType,
        *args: Any,
        fill: Optional[Callable[[], None]] = None,
        meanwhile: Optional[Callable[[], None]] = None,
    ) -> Tuple[Any, ...]:
        with self.remote.lock:
            if not self._posts:  # nothing posted since the last reply (never without ASYNC)
                return self._forward(function, args, fill, meanwhile)
            try:
                values = self._forward(function, args, fill, meanwhile)
            except BackendFunctionError as exc:
                if exc.function_code != APIR_BACKEND_POSTED_FAILED:
                    self._settled()
                    raise
                error = self._report()
                try:  # the command itself, now that no failure holds it
                    values = self._forward(function, args, fill, meanwhile)
                except ApirError:
                    if error is None:
                        raise
                if error is not None:
                    try:
                        raise error
                    finally:  # a kept traceback must not pin the reply mapping through this frame
                        del error
            self._settled()
            return values

    def _report(self) -> Optional[PostedCommandError]:
        """SYNCHRONIZE: the failure it reports (None when none), the window freed. The caller
        holds the Remote's lock."""
        _posted, index, function, code = self._forward(cast(ApirBackendCommandType, X.SYNCHRONIZE), (), None, None)
        posts = self._posts
        self._settled()
        if not code:
            return None
        return PostedCommandError(code, _name(function), index, posts[index] if index < len(posts) else None)

    def synchronize(self) -> None:
        """Waits for every posted command (SYNCHRONIZE, when any is in flight); raises the
        first one's PostedCommandError when one failed."""
        if not self.posting:
            return
        with self.remote.lock:
            if not self._posts:
                return
            error = self._report()
        if error is not None:
            try:
                raise error
            finally:
                del error

    def _post(self, function: int, what: str, *args: Any) -> bool:
        """Posts `function` with `args`; False when APIR_MAX_POSTED are in flight (then the
        caller sends it waited for)."""
        if len(self._posts) >= APIR_MAX_POSTED:
            return False
        layout = self._layouts[function][0]
        self.remote.post(int(function) | APIR_FORWARD_POSTED, lambda enc: layout.encode(enc, args))
        self._posts.append(what)
        return True

    # --- the posted functions ------------------------------------------------------------------
    def buffer_set_tensor(self, buffer: int, rpc_tensor, offset: int, data) -> None:
        if self.posting and buffer not in self._mapped:
            src = np.ascontiguousarray(data) if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
            src = src.reshape(-1).view(np.uint8)
            size = src.size
            with self.remote.lock:
                at = self._post_used
                if 0 < size and at + size <= POST_WINDOW_SIZE and len(self._posts) < APIR_MAX_POSTED:
                    window = self.remote.post_window()
                    copy_bytes(np.frombuffer(window.memory, dtype=np.uint8), src, size, dst_offset=at)
                    rpc = rpc_tensor_bytes(rpc_tensor, self.rpc_dtype)
                    what = f"buffer_set_tensor(buffer {buffer:#x}, offset {offset}, {size} bytes)"
                    self._post(X.BUFFER_SET_TENSOR_AT, what, buffer, rpc, window.res_id, at, offset, size)
                    self._post_used = -(-(at + size) // _ALIGN) * _ALIGN
                    return
        super().buffer_set_tensor(buffer, rpc_tensor, offset, data)  # type: ignore[misc]

    def buffer_clear(self, buffer: int, value: int) -> None:
        if self.posting and buffer not in self._mapped:
            with self.remote.lock:
                if self._post(F.BUFFER_CLEAR, f"buffer_clear(buffer {buffer:#x}, {value})", buffer, value):
                    return
        super().buffer_clear(buffer, value)  # type: ignore[misc]

    def buffer_cpy_tensor(self, buffer: int, src_rpc, dst_rpc, post: bool = False) -> bool:
        """As BufferCalls', or with `post` (and ASYNC) posted: True, its failure (the host
        not copying included) reported at the next synchronization point. Post only copies
        the host makes: both tensors in its buffers of one device."""
        if post and self.posting:
            src = rpc_tensor_bytes(src_rpc, self.rpc_dtype)
            dst = rpc_tensor_bytes(dst_rpc, self.rpc_dtype)
            with self.remote.lock:
                if self._post(F.BUFFER_CPY_TENSOR, f"buffer_cpy_tensor(buffer {buffer:#x})", buffer, src, dst):
                    return True
        return super().buffer_cpy_tensor(buffer, src_rpc, dst_rpc)  # type: ignore[misc]

    # --- events ------------------------------------------------------------------------------
    def _event(self, function: X, *args: Any) -> Tuple[Any, ...]:
        return self._call(cast(ApirBackendCommandType, function), *args)

    def event_new(self) -> int:
        """A host event (a handle): recorded work is done once a later waited-for command returns."""
        return self._event(X.EVENT_NEW)[0]

    def event_record(self, event: int) -> None:
        self._event(X.EVENT_RECORD, event)

    def event_wait(self, event: int) -> None:
        self._event(X.EVENT_WAIT, event)

    def event_synchronize(self, event: int) -> None:
        self._event(X.EVENT_SYNCHRONIZE, event)

    def event_free(self, event: int) -> None:
        self._event(X.EVENT_FREE, event)
