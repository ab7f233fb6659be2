"""The client's Forward call, which the four backend-function groups share.

`ForwardCaller` holds what every backend function needs: the `Remote`, the record layouts
of the ggml build, our protocol version and the host's. `_call(function, *args)` encodes the
arguments and decodes the reply as `apir.codec.forward.FORWARD` lists them for the
negotiated version; `_forward` is the call beneath it, with the caller's own encode and
decode functions. Both check the Forward return code (`forward_error`) and that the reply
held every value the function returns (`ReplyError` otherwise).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from apir.codec.constants import (
    APIR_PROTOCOL_MAJOR,
    APIR_PROTOCOL_MINOR,
    ApirBackendCommandType,
    ApirCommandType,
    negotiated_version,
)
from apir.codec.forward import FORWARD, MalformedMessage, TensorLayouts, decode_reply, encode_args
from apir.codec.records import GGML_0_20_LIMITS, GgmlLimits
from apir.codec.wire import Decoder, Encoder
from apir.guest.errors import ReplyError, forward_error
from apir.guest.remote import Remote

__all__ = ["ForwardCaller"]


class ForwardCaller:
    """`limits`: the ggml build's GGML_MAX_* (shapes rpc tensors and inline tensors; default
    ggml 0.20.2's). `protocol`: the version we speak (and send in the HandShake).
    `host_version` is (major, minor) once the HandShake ran."""

    def __init__(
        self,
        remote: Remote,
        limits: GgmlLimits = GGML_0_20_LIMITS,
        protocol: Tuple[int, int] = (APIR_PROTOCOL_MAJOR, APIR_PROTOCOL_MINOR),
    ):
        self.remote = remote
        self.layouts = TensorLayouts.of(limits)
        self.rpc_dtype = self.layouts.rpc_tensor
        self.tensor_dtype = self.layouts.ggml_tensor
        self.protocol = protocol
        self.host_version: Optional[Tuple[int, int]] = None

    @property
    def negotiated_version(self) -> Tuple[int, int]:
        """The version both sides shape version-dependent replies by: the lower of ours and
        the host's (apir.codec.constants.negotiated_version); ours before the HandShake."""
        if self.host_version is None:
            return (self.protocol[0], self.protocol[1])
        return negotiated_version(self.protocol, self.host_version)

    def _call(
        self,
        function: ApirBackendCommandType,
        *args: Any,
        fill: Optional[Callable[[], None]] = None,
        meanwhile: Optional[Callable[[], None]] = None,
    ) -> Tuple[Any, ...]:
        """Backend function `function` with `args` (one per argument in the table); its reply
        values, in the table's order. `fill()` writes the shared memory the call names, under
        the Remote's lock, before the arguments are encoded. Raises what `_forward` raises."""
        entry = FORWARD[function]
        version = self.negotiated_version

        def encode(enc: Encoder) -> None:
            if fill is not None:
                fill()
            encode_args(enc, entry, version, args)

        def decode(dec: Decoder) -> Tuple[Any, ...]:
            try:
                return decode_reply(dec, entry, version)
            except MalformedMessage as exc:
                raise ReplyError(f"{exc} (reply too short or malformed)") from None

        return self._forward(function, encode, decode, meanwhile=meanwhile)

    def _forward(
        self,
        function: ApirBackendCommandType,
        encode_fn: Optional[Callable[[Encoder], None]],
        decode_fn: Optional[Callable[[Decoder], Any]],
        timeout_s: Optional[float] = None,
        meanwhile: Optional[Callable[[], None]] = None,
    ) -> Any:
        """One backend function call; returns decode_fn's result (None without one). `meanwhile`: work done
        while the host runs the call (Remote.call's). Raises ForwardError subclasses,
        ReplyError, ApirTimeout."""

        def decode(ret: int, dec: Decoder):
            error = forward_error(ret, function)
            if error is not None:
                raise error
            if decode_fn is None:
                return None
            value = decode_fn(dec)
            if dec.fatal:
                raise ReplyError(f"{ApirBackendCommandType(function).c_name}: reply too short or malformed")
            return value

        _, value = self.remote.call(ApirCommandType.FORWARD, function, encode_fn, timeout_s, decode, meanwhile)
        return value
