"""`ApirClient`: the APIR protocol over a `Remote` — HandShake, LoadLibrary, and one typed
method per backend function.

Theory of operation: `ApirClient.connect(device)` builds the Remote (capset, context,
blobs), sends HandShake (our protocol version; records the host's, which shapes
version-dependent replies), then LoadLibrary, turning every failure code into its own
exception (apir.guest.errors). Backend functions are Forward calls whose flags carry the
function id; they live in four mixins named after the C guest's files
(client_device, client_buffer_type, client_buffer, client_backend =
virtgpu-forward-{device,buffer-type,buffer,backend}.cpp) and all go through
`ForwardCaller._call` (client_forward), which encodes and decodes them as the Forward table
(apir.codec.forward) lists them. The extensions beyond APIR 0.2 (client_extensions, and
client_async for posted commands and events) are asked for after LoadLibrary, unless
turned off.

Thread-safe: each call holds the Remote's lock from encoding to the end of decoding.
Nothing here knows which transport the device uses.
"""

from __future__ import annotations

import logging
from typing import Optional, Tuple, cast

from apir.codec.constants import APIR_HANDSHAKE_MAGIC, APIR_PROTOCOL_MAJOR, APIR_PROTOCOL_MINOR, ApirCommandType
from apir.codec.records import GGML_0_20_LIMITS, GgmlLimits
from apir.codec.wire import Decoder, Encoder
from apir.guest.client_async import AsyncCalls
from apir.guest.client_backend import BackendCalls
from apir.guest.client_buffer import BufferCalls
from apir.guest.client_buffer_type import BufferTypeCalls
from apir.guest.client_device import DeviceCalls, DeviceProps
from apir.guest.client_extensions import ExtensionCalls, default_extensions
from apir.guest.device import VirtgpuDevice
from apir.guest.errors import HandshakeError, ReplyError, load_library_error
from apir.guest.remote import Remote

__all__ = ["ApirClient", "DeviceProps"]

log = logging.getLogger(__name__)


class ApirClient(AsyncCalls, ExtensionCalls, DeviceCalls, BufferTypeCalls, BufferCalls, BackendCalls):
    """The APIR client over `remote` (arguments: `ForwardCaller`'s). `host_version` is
    (major, minor) once `handshake()` ran; `negotiated_version` the one version-dependent
    replies are read in."""

    @classmethod
    def connect(
        cls,
        device: VirtgpuDevice,
        *,
        limits: GgmlLimits = GGML_0_20_LIMITS,
        handshake_timeout_s: Optional[float] = None,
        load_library_timeout_s: Optional[float] = None,
        protocol: Tuple[int, int] = (APIR_PROTOCOL_MAJOR, APIR_PROTOCOL_MINOR),
        extensions: Optional[int] = None,
        **remote_options,
    ) -> "ApirClient":
        """Remote(device, **remote_options) + HandShake (as APIR `protocol`) + LoadLibrary
        (the C `create_virtgpu`), then EXT_QUERY for `extensions` (ApirExtension bits;
        default `default_extensions()`; 0 sends nothing beyond APIR 0.2). The device is
        closed again if any step fails."""
        remote = Remote(device, **remote_options)
        try:
            client = cls(remote, limits, protocol)
            client.handshake(handshake_timeout_s)
            client.load_library(load_library_timeout_s)
            wanted = default_extensions() if extensions is None else extensions
            if wanted:
                client.negotiate_extensions(wanted)
        except BaseException:
            remote.close()
            raise
        return client

    def close(self) -> None:
        self.remote.close()

    def __enter__(self) -> "ApirClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the component's own commands ------------------------------------------------------
    def handshake(self, timeout_s: Optional[float] = None) -> Tuple[int, int]:
        """HandShake: sends our (major, minor), returns and records the host's. A major
        mismatch is logged as an error, a minor one as a warning (the C only logs too).
        Raises HandshakeError, ReplyError, ApirTimeout (2 s by default)."""
        major, minor = self.protocol

        def encode(enc: Encoder):
            enc.u32(major)
            enc.u32(minor)

        def decode(ret: int, dec: Decoder) -> Tuple[int, int]:
            if ret != APIR_HANDSHAKE_MAGIC:
                raise HandshakeError(ret)
            version = (dec.u32(), dec.u32())
            if dec.fatal:
                raise ReplyError("HandShake: reply too short for the host version")
            return version

        _, reply = self.remote.call(ApirCommandType.HANDSHAKE, 0, encode, timeout_s, decode)
        version = cast(Tuple[int, int], reply)  # decode's result
        self.host_version = version
        if version[0] != major:
            log.error("APIR host major version %d.%d differs from ours %d.%d", *version, major, minor)
        elif version[1] != minor:
            log.warning("APIR host minor version %d.%d differs from ours %d.%d", *version, major, minor)
        return version

    def load_library(self, timeout_s: Optional[float] = None) -> None:
        """LoadLibrary: asks the host to load and initialize its backend library. Raises the
        LoadLibraryError subclass of the code, ApirTimeout (60 s by default)."""
        ret, _ = self.remote.call(ApirCommandType.LOADLIBRARY, 0, None, timeout_s, lambda ret, dec: None)
        error = load_library_error(ret)
        if error is not None:
            raise error
