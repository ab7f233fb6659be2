"""What a transport needs of an APIR context: the seam between the component and the devices.

Theory of operation: a transport (apir.host.local.kernel, apir.local.embedded,
apir.host.vhost_user) makes one context per guest context through a `ContextFactory` and
drives it through `ApirContext`: blobs in (`add_resource`), EXECBUFFER payloads through
`submit`, `close` at the end. `apir.host.component.context.HostContext` is the context; a
test's stand-in may implement only `ApirContext`. The optional parts, each a protocol a
transport checks (isinstance; `conforms` on a hot path) before it uses them: `Cancellable` (stop a compute in flight
when the guest is gone), `BufferCounting` (ggml buffers held, for the server's counts),
`BoundedInTime` (whether bounded commands also end in bounded time on this backend) and
`DeferredNotification` (the embedded device stores the reply notification itself).

Nothing here imports the context, so the tracer and the transports can name these types
without importing what they describe.
"""

from __future__ import annotations

import mmap
from typing import Any, Callable, Dict, Optional, Protocol, Tuple, Union, runtime_checkable

from apir.codec.atomics import Word

__all__ = [
    "ApirContext",
    "BoundedInTime",
    "BufferCounting",
    "Cancellable",
    "ContextFactory",
    "DeferredNotification",
    "conforms",
]


class ApirContext(Protocol):
    """What a transport's kernel stand-in needs of an APIR context (see the module)."""

    def add_resource(self, res_id: int, memory: mmap.mmap) -> None: ...

    def remove_resource(self, res_id: int) -> None: ...

    def submit(self, command: Union[bytes, memoryview]) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class Cancellable(Protocol):
    """A context whose graph compute in flight can be stopped from any thread
    (`HostContext.cancel_compute`)."""

    def cancel_compute(self, reason: str) -> None: ...


@runtime_checkable
class BufferCounting(Protocol):
    """A context that can tell how many ggml buffers it holds (None: its backend library
    cannot)."""

    def buffer_count(self) -> Optional[int]: ...


@runtime_checkable
class BoundedInTime(Protocol):
    """A context that says whether the commands `may_run_long` calls bounded also end in
    bounded time on its backend (`HostContext.commands_bounded_in_time`)."""

    commands_bounded_in_time: bool


@runtime_checkable
class DeferredNotification(Protocol):
    """A context that can leave its reply notification store to the caller of `submit`
    (`HostContext.defer_notification` / `take_notification`: the embedded device's host
    thread makes the store from its doorbell spin)."""

    defer_notification: bool

    def take_notification(self) -> Optional[Tuple[Word, int]]: ...


# (ctx_id, capset_id, config) -> a new context; config: the host's keys (apir.host.config)
ContextFactory = Callable[[int, int, Optional[dict]], ApirContext]


_CONFORMS: Dict[Tuple[type, Any], bool] = {}


def conforms(ctx: object, protocol: Any) -> bool:
    """`isinstance(ctx, protocol)` for the protocols above, answered once per class of
    context: a protocol's isinstance walks its members on every call (tens of microseconds,
    more than a small command costs), and the embedded device asks on every command. A class
    conforms or not as a whole: its instances set the same attributes. (Where mypy must see the
    narrowed type, the caller casts.)"""
    key = (type(ctx), protocol)
    answer = _CONFORMS.get(key)
    if answer is None:
        answer = _CONFORMS[key] = isinstance(ctx, protocol)
    return answer
