"""The handlers' side of the Forward table (apir.codec.forward).

`args` decodes a command's arguments as the table lists them, in the version the HandShake
negotiated (the host's `forward_layouts`); a command that ends before its last argument is
refused (`Refused`: the function's BACKEND_RC_ERROR, as any other malformed argument). A
handler writes its reply with the host's writer of that version, by the function's C name:
`lib.host.forward_replies["device_get_type"](enc, type)`, one call (the writers are made once
per HandShake). What the values may be is each handler's own check.
"""

from __future__ import annotations

from typing import Any, Tuple

from apir.codec.constants import ApirBackendCommandType
from apir.codec.forward import MalformedMessage
from apir.codec.wire import Decoder
from apir.host.errors import Refused
from apir.host.library import LibraryHost
from apir.host.tensors import TensorChecker

__all__ = ["args"]


def args(dec: Decoder, function: ApirBackendCommandType, chk: TensorChecker, host: LibraryHost) -> Tuple[Any, ...]:
    """The arguments of `function`, one value per field of the table. Raises Refused."""
    try:
        return host.forward_layouts[function][0].decode(dec, chk.layouts)
    except MalformedMessage as exc:
        raise Refused(str(exc)) from None
