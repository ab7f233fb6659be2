"""The device group of backend functions (the C guest's virtgpu-forward-device.cpp).

Each method is one Forward, laid out as apir.codec.forward lists it. `device_get_props`
reads the layout of the negotiated version (ForwardCaller.negotiated_version, the lower of
ours and the host's): 4 booleans in APIR 0.1, 5 in 0.2 (mmap_support). Reading the host's
layout instead made a 0.1 guest of a 0.2 host read a 5th slot the host never wrote.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from apir.codec.constants import ApirBackendCommandType as F
from apir.codec.virtgpu import blob_size
from apir.guest.client_forward import ForwardCaller
from apir.guest.client_tensor import inline_tensor_at
from apir.guest.device import Blob

__all__ = ["DeviceProps", "DeviceCalls"]


@dataclass(frozen=True)
class DeviceProps:
    """`ggml_backend_dev_caps` as device_get_props returns it; `mmap_support` is None when
    the negotiated version is APIR 0.1, which does not carry it."""

    async_: bool
    host_buffer: bool
    buffer_from_host_ptr: bool
    events: bool
    mmap_support: Optional[bool]


class DeviceCalls(ForwardCaller):
    """Mixed into ApirClient."""

    def device_get_device_count(self) -> int:
        """The backend registry's device count (function 0, which the C guest never calls)."""
        return self._call(F.DEVICE_GET_DEVICE_COUNT)[0]

    def device_get_count(self) -> int:
        """`apir_device_get_count`: i32."""
        return self._call(F.DEVICE_GET_COUNT)[0]

    def device_get_name(self) -> str:
        """`apir_device_get_name`."""
        return self._call(F.DEVICE_GET_NAME)[0]

    def device_get_description(self) -> str:
        """`apir_device_get_description`."""
        return self._call(F.DEVICE_GET_DESCRIPTION)[0]

    def device_get_type(self) -> int:
        """`apir_device_get_type`: an `enum ggml_backend_dev_type` value."""
        return self._call(F.DEVICE_GET_TYPE)[0]

    def device_get_memory(self) -> Tuple[int, int]:
        """`apir_device_get_memory`: (free, total) in bytes."""
        free, total = self._call(F.DEVICE_GET_MEMORY)
        return free, total

    def device_supports_op(self, tensor_addr: int, buffer_handle: int = 0) -> bool:
        """`apir_device_supports_op`: whether the host device runs the op of the ggml_tensor
        at `tensor_addr` (sent inline with its view_src and srcs; `buffer_handle` is its
        buffer's host handle, if it has a buffer). Raises ValueError (see client_tensor)."""
        return self._call(F.DEVICE_SUPPORTS_OP, inline_tensor_at(tensor_addr, buffer_handle, self.tensor_dtype))[0]

    def device_get_buffer_type(self) -> int:
        """`apir_device_get_buffer_type`: the host handle of the device's buffer type."""
        return self._call(F.DEVICE_GET_BUFFER_TYPE)[0]

    def device_get_props(self) -> DeviceProps:
        """`apir_device_get_props`: 4 booleans (negotiated APIR 0.1) or 5 (0.2)."""
        if self.host_version is None:
            raise RuntimeError("device_get_props before HandShake: the reply layout depends on the negotiated version")
        async_, host_buffer, buffer_from_host_ptr, events, *newer = self._call(F.DEVICE_GET_PROPS)
        mmap_support = newer[0] if newer else None
        return DeviceProps(async_, host_buffer, buffer_from_host_ptr, events, mmap_support)

    def device_buffer_from_ptr(self, size: int, max_tensor_size: int) -> Tuple[Blob, int, int]:
        """`apir_device_buffer_from_ptr`: a new shared blob of `size` bytes (rounded up to
        16 KiB) that the host wraps in a buffer of its device. Returns (blob, buffer host
        handle, buffer type host handle); release the blob with `destroy_blob` after
        `buffer_free_buffer`. The blob is destroyed if the call fails."""
        blob = self.remote.device.create_blob(blob_size(size))
        try:
            buffer, buft = self._call(F.DEVICE_BUFFER_FROM_PTR, blob.res_id, size, max_tensor_size)
        except BaseException:
            self.remote.device.destroy_blob(blob)
            raise
        return blob, buffer, buft

    def destroy_blob(self, blob: Blob) -> None:
        """Releases a blob from `device_buffer_from_ptr`."""
        self.remote.device.destroy_blob(blob)
