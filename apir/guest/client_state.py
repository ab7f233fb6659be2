"""What the backend-function groups (DeviceCalls, BufferTypeCalls, BufferCalls, BackendCalls)
use of the `ApirClient` they are mixed into, declared once for type checkers.

`ApirClient` sets these attributes and defines `_forward`; this class only names their types
(annotations without values: nothing here exists at run time).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Tuple, TypeVar, overload

import numpy as np

from apir.codec.constants import ApirBackendCommandType
from apir.codec.wire import Decoder, Encoder

if TYPE_CHECKING:
    from apir.guest.remote import Remote

__all__ = ["ClientState"]

T = TypeVar("T")


class ClientState:
    remote: Remote
    rpc_dtype: np.dtype  # apir_rpc_tensor records of the negotiated limits
    tensor_dtype: np.dtype  # ggml_tensor as sent inline
    protocol: Tuple[int, int]
    host_version: Optional[Tuple[int, int]]

    if TYPE_CHECKING:  # ApirClient._forward: a call returns what its decode_fn returns

        @overload
        def _forward(
            self,
            function: ApirBackendCommandType,
            encode_fn: Optional[Callable[[Encoder], None]],
            decode_fn: Callable[[Decoder], T],
            timeout_s: Optional[float] = None,
            meanwhile: Optional[Callable[[], None]] = None,
        ) -> T: ...

        @overload
        def _forward(
            self,
            function: ApirBackendCommandType,
            encode_fn: Optional[Callable[[Encoder], None]],
            decode_fn: None,
            timeout_s: Optional[float] = None,
            meanwhile: Optional[Callable[[], None]] = None,
        ) -> None: ...

        def _forward(
            self,
            function: ApirBackendCommandType,
            encode_fn: Optional[Callable[[Encoder], None]],
            decode_fn: Optional[Callable[[Decoder], T]],
            timeout_s: Optional[float] = None,
            meanwhile: Optional[Callable[[], None]] = None,
        ) -> Optional[T]: ...
