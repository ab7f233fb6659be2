"""Which virtgpu device to open, from one spec string: the device registry every entry point uses.

Theory of operation: a device is named by a spec, ``SCHEME`` or ``SCHEME:ARGUMENT``, and opened
by `open_device(spec)`, so "which device" means the same for the `apir` CLI, the models, the
benchmarks and the tests. The schemes apir knows, with their kind (the short name `apir info`
and `apir embed` report as the transport):

    embedded    (kind embedded) a host in this process, on a thread of its own
                (apir.local.embedded.EmbeddedDevice); the default: works on a fresh machine
                with no VM and no server
    unix:PATH   (kind socket) an apir host process serving the Unix socket PATH
                (`apir host serve`; apir.guest.local.LocalDevice)
    drm:NODE    (kind drm) a virtio-gpu render node, e.g. /dev/dri/renderD128
                (apir.guest.drm.DrmDevice); ``drm`` alone: the first one

A new device (vhost-user, ...) is one module implementing `apir.guest.device.VirtgpuDevice`
plus one `register_device` call, below or in its own module (docs/design.md, "Adding a
device"). This module is outside apir.guest because the embedded device runs the host: it is
where the halves meet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

from apir.guest.device import VirtgpuDevice

__all__ = [
    "DeviceSpec",
    "DeviceScheme",
    "DEFAULT_SPEC",
    "register_device",
    "parse_spec",
    "accepted_forms",
    "device_spec",
    "device_kind",
    "open_device",
    "open_client",
]

DEFAULT_SPEC = "embedded"

# opener(argument or None, host configuration or None, constructor options) -> device
DeviceOpener = Callable[[Optional[str], Optional[dict], dict], VirtgpuDevice]


@dataclass(frozen=True)
class DeviceScheme:
    """One registered kind of device: its spec scheme, the kind name reported to people, how
    it opens, and whether its spec needs an argument (True), takes none (False) or may have
    one (None)."""

    scheme: str
    kind: str
    opener: DeviceOpener
    argument: Optional[bool]
    where: Callable[[Optional[str]], str]  # one line for people: where the host runs


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed spec: its scheme (registered), its argument (a path, or None) and the spec."""

    scheme: DeviceScheme
    argument: Optional[str]
    text: str

    @property
    def kind(self) -> str:
        return self.scheme.kind

    @property
    def node(self) -> str:
        """The argument (socket path, render node), or the scheme when there is none."""
        return self.argument or self.scheme.scheme

    @property
    def where(self) -> str:
        return self.scheme.where(self.argument)


_SCHEMES: Dict[str, DeviceScheme] = {}


def register_device(
    scheme: str, kind: str, opener: DeviceOpener, *, argument: Optional[bool], where: Callable[[Optional[str]], str]
) -> None:
    """Adds the device scheme `scheme` (``vhost-user``, ...): `opener(argument, config,
    options)` returns an open `VirtgpuDevice` or raises `apir.guest.errors.DeviceError`.
    Raises ValueError when the scheme is taken."""
    if scheme in _SCHEMES:
        raise ValueError(f"device scheme {scheme!r} is registered already")
    _SCHEMES[scheme] = DeviceScheme(scheme, kind, opener, argument, where)


def parse_spec(spec: Optional[str] = None) -> DeviceSpec:
    """The `DeviceSpec` of `spec` (None: DEFAULT_SPEC). Raises ValueError for an unknown
    scheme, a missing argument or an argument the scheme does not take."""
    text = DEFAULT_SPEC if spec is None else spec
    name, sep, after = text.partition(":")
    argument: Optional[str] = after if sep else None
    scheme = _SCHEMES.get(name)
    if scheme is None:
        raise ValueError(f"unknown device {text!r} (known: {accepted_forms()})")
    if scheme.argument and not argument:
        raise ValueError(f"device {text!r}: {name} needs a path ({name}:PATH; known: {accepted_forms()})")
    if scheme.argument is False and sep:
        raise ValueError(f"device {text!r}: {name} takes no argument (known: {accepted_forms()})")
    return DeviceSpec(scheme, argument or None, text)


def accepted_forms() -> str:
    """The registered specs for people: ``embedded, unix:PATH, drm[:PATH]``."""
    forms = {True: ":PATH", None: "[:PATH]", False: ""}
    return ", ".join(s.scheme + forms[s.argument] for s in _SCHEMES.values())


def device_spec(socket: Optional[str] = None, drm: Optional[str] = None) -> Optional[str]:
    """The spec of the CLI's options: ``unix:SOCKET``, ``drm:NODE`` or, with neither, None
    (nothing chosen: the default device). Raises ValueError when both are given."""
    if socket and drm:
        raise ValueError("give a socket or a DRM node, not both")
    return f"unix:{socket}" if socket else f"drm:{drm}" if drm else None


def device_kind(spec: Optional[str] = None) -> str:
    """The kind of device `spec` names ("embedded", "socket", "drm", ...). Raises ValueError
    as parse_spec."""
    return parse_spec(spec).kind


def open_device(spec: Optional[str] = None, config: Optional[dict] = None, **options) -> VirtgpuDevice:
    """The device `spec` names (None: the embedded host), open. `config` (HostContext
    configuration: ``ggml.library.path``, ``ggml.library.reg``, ...) only applies to a host
    this process runs (embedded); other hosts are configured where they run. `options` go to
    the device's constructor (timeouts). Raises ValueError for a bad spec,
    `apir.guest.errors.DeviceError` when the device cannot be opened."""
    parsed = parse_spec(spec)
    return parsed.scheme.opener(parsed.argument, config, options)


def open_client(
    spec: Optional[str] = None, config: Optional[dict] = None, device_options: Optional[dict] = None, **client_options
):
    """`ApirClient.connect(open_device(spec, config, **device_options))`: the device, its
    Remote, HandShake and LoadLibrary done. `client_options` go to `ApirClient.connect`
    (timeouts, limits, Remote options). Raises what open_device and ApirClient.connect raise."""
    from apir.guest.client import ApirClient  # may load the codec's Numba twins: on use only

    device = open_device(spec, config, **(device_options or {}))
    try:
        return ApirClient.connect(device, **client_options)
    except BaseException:
        device.close()  # connect closes it on failure too; closing twice is harmless
        raise


# --- the devices apir has ------------------------------------------------------------------------
# Each module is imported when its device is opened, so naming a device loads only its code.
def _open_embedded(argument: Optional[str], config: Optional[dict], options: dict) -> VirtgpuDevice:
    from apir.local.embedded import EmbeddedDevice

    return EmbeddedDevice(config=config, **options)


def _open_unix(argument: Optional[str], config: Optional[dict], options: dict) -> VirtgpuDevice:
    from apir.guest.local import LocalDevice

    assert argument is not None  # parse_spec: "unix" needs a path
    return LocalDevice(argument, **options)


def _open_drm(argument: Optional[str], config: Optional[dict], options: dict) -> VirtgpuDevice:
    from apir.guest.drm import DrmDevice

    return DrmDevice(argument, **options)


register_device("embedded", "embedded", _open_embedded, argument=False, where=lambda _: "embedded host in this process")
register_device("unix", "socket", _open_unix, argument=True, where=lambda path: f"host at {path}")
register_device("drm", "drm", _open_drm, argument=None, where=lambda node: f"virtio-gpu node {node or '(first found)'}")
