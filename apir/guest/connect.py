"""Picks the guest's virtgpu device from what the user gave: a socket, a DRM node, or neither.

Theory of operation: every entry point (the `apir` CLI, the ggml backend, the models, tests)
calls `open_device` with the user's choice, so "no option" means the same everywhere: an embedded
host in this process (apir.local.embedded), which works on a fresh machine with no VM and no
server. A socket path selects a host process (apir.guest.local); a DRM node a real virtio-gpu
render node (apir.guest.drm).
"""

from __future__ import annotations

from typing import Optional

from apir.guest.device import VirtgpuDevice

__all__ = ["open_device", "open_client", "device_kind"]


def device_kind(socket: Optional[str] = None, drm: Optional[str] = None) -> str:
    """"socket", "drm" or "embedded": which device `open_device` would open.
    Raises ValueError when both are given."""
    if socket and drm:
        raise ValueError("give a socket or a DRM node, not both")
    return "socket" if socket else "drm" if drm else "embedded"


def open_device(socket: Optional[str] = None, drm: Optional[str] = None,
                config: Optional[dict] = None, **options) -> VirtgpuDevice:
    """The device for (socket, drm): `LocalDevice(socket)`, `DrmDevice(drm)`, or, with neither,
    `EmbeddedDevice(config)`. `config` (HostContext configuration: ``ggml.library.path``,
    ``ggml.library.reg``) only applies to the embedded host; other hosts are configured where
    they run. `options` go to the device's constructor (timeouts). Raises ValueError for both,
    `apir.guest.errors.DeviceError` when the device cannot be opened."""
    kind = device_kind(socket, drm)
    if kind == "socket":
        from apir.guest.local import LocalDevice

        return LocalDevice(socket, **options)
    if kind == "drm":
        from apir.guest.drm import DrmDevice

        return DrmDevice(drm, **options)
    from apir.local.embedded import EmbeddedDevice

    return EmbeddedDevice(config=config, **options)


def open_client(socket: Optional[str] = None, drm: Optional[str] = None,
                config: Optional[dict] = None, device_options: Optional[dict] = None,
                **client_options):
    """`ApirClient.connect(open_device(...))`: the device, its Remote, HandShake and
    LoadLibrary done. `client_options` go to `ApirClient.connect` (timeouts, limits, Remote
    options). Raises what open_device and ApirClient.connect raise."""
    from apir.guest.client import ApirClient

    device = open_device(socket, drm, config, **(device_options or {}))
    try:
        return ApirClient.connect(device, **client_options)
    except BaseException:
        device.close()  # connect closes it on failure too; closing twice is harmless
        raise
