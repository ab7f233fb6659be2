"""What the backend-function groups (DeviceCalls, BufferTypeCalls, BufferCalls, BackendCalls)
use of the `ApirClient` they are mixed into, declared once for type checkers.

`ApirClient` sets these attributes and defines `_forward`; this class only names their types
(annotations without values: nothing here exists at run time).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple

import numpy as np

if TYPE_CHECKING:
    from apir.guest.remote import Remote

__all__ = ["ClientState"]


class ClientState:
    remote: Remote
    rpc_dtype: np.dtype  # apir_rpc_tensor records of the negotiated limits
    tensor_dtype: np.dtype  # ggml_tensor as sent inline
    protocol: Tuple[int, int]
    host_version: Optional[Tuple[int, int]]
    _forward: Callable[..., Any]  # ApirClient._forward(function, encode_fn, decode_fn, timeout_s)
