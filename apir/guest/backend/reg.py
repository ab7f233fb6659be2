"""The backend registry (`ggml_backend_reg`) and what the guest asks the host once at start.

Theory of operation: twin of the C guest's ggml-backend-reg.cpp. `fetch_remote_info` is its
`apir_initialize`: one round of calls whose answers cannot change for the life of the host
context (device count, name, description, type, memory, props, the buffer type's handle,
name, alignment and max size), cached so ggml's frequent getters cost no remote call. The
registry's iface then only reads that cache: name "ggml-virtgpu", `device_count` devices,
no proc addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

from apir.guest.client_device import DeviceProps

__all__ = ["RemoteInfo", "fetch_remote_info", "build_reg", "REG_NAME", "NAME_PREFIX"]

REG_NAME = "ggml-virtgpu"  # GGML_VIRTGPU_NAME
NAME_PREFIX = "[virtgpu] "  # the C prefixes remote device and buffer type names with this


@dataclass(frozen=True)
class RemoteInfo:
    """The C `virtgpu::cached_device_info` and `cached_buffer_type`. Sizes in bytes."""

    device_count: int
    name: str  # NAME_PREFIX + the host device's name
    description: str
    type: int  # enum ggml_backend_dev_type
    memory_free: int
    memory_total: int
    props: DeviceProps  # async_, host_buffer, buffer_from_host_ptr, events, mmap_support
    buft_handle: int
    buft_name: str  # NAME_PREFIX + the host buffer type's name
    alignment: int
    max_size: int


def fetch_remote_info(client) -> RemoteInfo:
    """Ask the host everything the registry caches (C `apir_initialize`). Raises the
    client's ApirError when a call fails (the C aborts there)."""
    free, total = client.device_get_memory()
    buft = client.device_get_buffer_type()
    return RemoteInfo(
        device_count=int(client.device_get_count()),
        name=NAME_PREFIX + client.device_get_name(),
        description=client.device_get_description(),
        type=int(client.device_get_type()),
        memory_free=int(free),
        memory_total=int(total),
        props=client.device_get_props(),
        buft_handle=int(buft),
        buft_name=NAME_PREFIX + client.buffer_type_get_name(buft),
        alignment=int(client.buffer_type_get_alignment(buft)),
        max_size=int(client.buffer_type_get_max_size(buft)),
    )


def build_reg(owner):
    """The `ggml_backend_reg` struct of `owner` (an ApirBackend): a Python-owned ctypes
    instance that ggml never frees. Its iface reads `owner.info` and `owner.devices`."""
    abi, cb = owner.abi, owner.callbacks
    name = cb.cstring(REG_NAME)

    def get_device(reg, index):
        ptrs = owner.devices
        if index >= len(ptrs):  # the C asserts; ggml only asks below get_device_count
            raise IndexError(f"device {index} of {len(ptrs)}")
        return ptrs[index]

    iface = cb.iface(
        abi.RegI,
        abi.protos["ggml_backend_reg_i"],
        {
            "get_name": (lambda reg: name, None),
            "get_device_count": (lambda reg: len(owner.devices), 0),
            "get_device": (get_device, None),
        },
        "reg",
    )
    return cb.keep(abi.Reg(api_version=abi.backend_api_version, iface=iface, context=None))
