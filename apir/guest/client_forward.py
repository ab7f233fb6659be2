"""The client's Forward call, which the four backend-function groups share.

`ForwardCaller` holds what every backend function needs: the `Remote`, the record layouts
of the ggml build, our protocol version and the host's. `_call(function, *args)` encodes the
arguments and decodes the reply as `apir.codec.forward.FORWARD` lists them for the
negotiated version; it checks the Forward return code (`forward_error`) and that the reply
held every value the function returns (`ReplyError` otherwise).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from apir.codec.constants import (
    APIR_PROTOCOL_MAJOR,
    APIR_PROTOCOL_MINOR,
    ApirBackendCommandType,
    ApirCommandType,
    ApirForwardReturnCode,
    negotiated_version,
)
from apir.codec.forward import MalformedMessage, TensorLayouts, layouts_between
from apir.codec.records import GGML_0_20_LIMITS, GgmlLimits
from apir.codec.wire import Encoder
from apir.guest.errors import ReplyError, forward_error
from apir.guest.remote import Remote

_FORWARD = int(ApirCommandType.FORWARD)
_SUCCESS = int(ApirForwardReturnCode.BASE_INDEX)  # a Forward return code: the function ran

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
        self._protocol = (protocol[0], protocol[1])
        self.host_version = None

    @property
    def protocol(self) -> Tuple[int, int]:
        return self._protocol

    @property
    def host_version(self) -> Optional[Tuple[int, int]]:
        return self._host_version

    @host_version.setter
    def host_version(self, version: Optional[Tuple[int, int]]) -> None:
        self._host_version = version
        # worked out here, once, rather than on every call
        self._version = self._protocol if version is None else negotiated_version(self._protocol, version)
        self._layouts = layouts_between(self._protocol, self._protocol if version is None else version)

    @property
    def negotiated_version(self) -> Tuple[int, int]:
        """The version both sides shape version-dependent replies by: the lower of ours and
        the host's (apir.codec.constants.negotiated_version); ours before the HandShake."""
        return self._version

    def _call(
        self,
        function: ApirBackendCommandType,
        *args: Any,
        fill: Optional[Callable[[], None]] = None,
        meanwhile: Optional[Callable[[], None]] = None,
    ) -> Tuple[Any, ...]:
        """Backend function `function` with `args` (one per argument in the table); its reply
        values, in the table's order. `fill()` writes the shared memory the call names, under
        the Remote's lock, before the arguments are encoded. `meanwhile`: work done while the
        host runs the call (Remote.call's). Raises the Forward return code's ForwardError
        (`forward_error`), ReplyError when the reply lacks a value, and what Remote.call
        raises (ApirTimeout, DeviceError)."""
        with self.remote.lock:
            return self._forward(function, args, fill, meanwhile)

    def _forward(
        self,
        function: ApirBackendCommandType,
        args: Tuple[Any, ...],
        fill: Optional[Callable[[], None]],
        meanwhile: Optional[Callable[[], None]],
    ) -> Tuple[Any, ...]:
        """`_call`, its arguments positional, under the Remote's lock (the reply Decoder is
        the Remote's until its next call): what an override of `_call` sends with (no keyword
        arguments to pass on, no `super()` on every call)."""
        args_layout, reply_layout = self._layouts[function]
        encode: Optional[Callable[[Encoder], None]] = None
        if fill is not None or args or args_layout.fields:  # (else nothing to write: most queries)

            def encode(enc: Encoder) -> None:
                if fill is not None:
                    fill()
                args_layout.encode(enc, args)

        remote = self.remote
        ret, dec = remote.call(_FORWARD, function, encode, remote.forward_timeout_s, None, meanwhile)
        if ret != _SUCCESS:
            error = forward_error(ret, function)
            if error is not None:
                raise error
        try:
            return reply_layout.decode(dec)  # type: ignore[arg-type]  # (no decode_fn: the Decoder)
        except MalformedMessage as exc:
            raise ReplyError(f"{exc} (reply too short or malformed)") from None
