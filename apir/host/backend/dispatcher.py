"""The backend dispatcher: function id -> handler (`backend-dispatched.gen.h`'s table).

Theory of operation: Forward's flags name one of the 23 backend functions. `dispatch` runs
its handler with the library state, a Decoder over the command's arguments and an Encoder
over the reply payload, and returns the function's return code (Forward adds 4). An id out of
range returns APIR_BACKEND_FORWARD_INDEX_INVALID, like the C. This is the single entry where
guest input is turned into codes: a `Refused` (or any bug) inside a handler becomes
BACKEND_RC_ERROR and one log line, never an exception.

Each handler is `handler(lib, dec, enc) -> int`, in the module named after its C group.

Before every function other than buffer_set_tensor, the context's deferred uploads are
flushed (apir.host.backend.transfers): any command may read, free or depend on device memory.
"""

from __future__ import annotations

from typing import Callable, Dict, List

from apir.codec.constants import APIR_BACKEND_FORWARD_INDEX_INVALID, ApirBackendCommandType as Cmd
from apir.codec.wire import Decoder, Encoder
from apir.host.backend import dispatch_backend, dispatch_buffer, dispatch_buffer_type, dispatch_device
from apir.host.backend.seams import HandlerLibrary
from apir.host.errors import BACKEND_RC_ERROR, Refused, log


__all__ = ["dispatch", "DISPATCH_TABLE", "Handler"]

# A backend function's handler: (this context's library, the arguments, the reply payload) ->
# the function's return code (BACKEND_RC_OK, BACKEND_RC_ERROR; raising Refused is the same as
# the latter). One per function id, in dispatch_device / _buffer_type / _buffer / _backend.
Handler = Callable[[HandlerLibrary, Decoder, Encoder], int]

_SET_TENSOR = int(Cmd.BUFFER_SET_TENSOR)  # the one function whose uploads may stay queued
_BY_ID: Dict[Cmd, Handler] = {
    Cmd.DEVICE_GET_DEVICE_COUNT: dispatch_device.get_device_count,
    Cmd.DEVICE_GET_COUNT: dispatch_device.get_count,
    Cmd.DEVICE_GET_NAME: dispatch_device.get_name,
    Cmd.DEVICE_GET_DESCRIPTION: dispatch_device.get_description,
    Cmd.DEVICE_GET_TYPE: dispatch_device.get_type,
    Cmd.DEVICE_GET_MEMORY: dispatch_device.get_memory,
    Cmd.DEVICE_SUPPORTS_OP: dispatch_device.supports_op,
    Cmd.DEVICE_GET_BUFFER_TYPE: dispatch_device.get_buffer_type,
    Cmd.DEVICE_GET_PROPS: dispatch_device.get_props,
    Cmd.DEVICE_BUFFER_FROM_PTR: dispatch_device.buffer_from_ptr,
    Cmd.BUFFER_TYPE_GET_NAME: dispatch_buffer_type.get_name,
    Cmd.BUFFER_TYPE_GET_ALIGNMENT: dispatch_buffer_type.get_alignment,
    Cmd.BUFFER_TYPE_GET_MAX_SIZE: dispatch_buffer_type.get_max_size,
    Cmd.BUFFER_TYPE_IS_HOST: dispatch_buffer_type.is_host,
    Cmd.BUFFER_TYPE_ALLOC_BUFFER: dispatch_buffer_type.alloc_buffer,
    Cmd.BUFFER_TYPE_GET_ALLOC_SIZE: dispatch_buffer_type.get_alloc_size,
    Cmd.BUFFER_GET_BASE: dispatch_buffer.get_base,
    Cmd.BUFFER_SET_TENSOR: dispatch_buffer.set_tensor,
    Cmd.BUFFER_GET_TENSOR: dispatch_buffer.get_tensor,
    Cmd.BUFFER_CPY_TENSOR: dispatch_buffer.cpy_tensor,
    Cmd.BUFFER_CLEAR: dispatch_buffer.clear,
    Cmd.BUFFER_FREE_BUFFER: dispatch_buffer.free_buffer,
    Cmd.BACKEND_GRAPH_COMPUTE: dispatch_backend.graph_compute,
}
# Indexed by function id; every id of ApirBackendCommandType has a handler.
DISPATCH_TABLE: List[Handler] = [_BY_ID[cmd] for cmd in Cmd]


def dispatch(lib: HandlerLibrary, function_id: int, dec: Decoder, enc: Encoder) -> int:
    """`apir_backend_dispatcher`: runs backend function `function_id`; its return code."""
    if not 0 <= function_id < len(DISPATCH_TABLE):
        log.error("ctx %d: invalid backend function id %d (>= %d)", lib.ctx_id, function_id, len(DISPATCH_TABLE))
        return APIR_BACKEND_FORWARD_INDEX_INVALID
    try:
        if function_id != _SET_TENSOR:
            lib.flush_transfers()
        return DISPATCH_TABLE[function_id](lib, dec, enc)
    except Refused as exc:
        # (the Refused rides on the record too: its fields for whoever watches the log)
        log.warning("ctx %d: %s refused: %s", lib.ctx_id, Cmd(function_id).c_name, exc, extra={"refusal": exc})
    except Exception:  # noqa: BLE001 - a host bug is this command's failure, not the host's
        log.exception("ctx %d: %s failed", lib.ctx_id, Cmd(function_id).c_name)
    return BACKEND_RC_ERROR
