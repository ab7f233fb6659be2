"""A ggml backend device named by a short spec, found through ggml's own backend registry.

Theory of operation: ggml registers every backend it was built with (`ggml_backend_reg_*`,
ggml-backend-reg.cpp): a registration ("CPU", "Vulkan", "RPC", ...) has devices, and a device
makes backends and buffer types. So choosing a backend needs no per-backend code: a name finds
the registration (`ggml_backend_reg_by_name`, case-insensitive), an index its device. ggml-rpc's
registration enumerates no devices: its servers are added with the function it hands out by
name (`ggml_backend_rpc_add_server`), each becoming a registration with the server's devices.

Specs (`apir host serve --backend SPEC`, config key `apir.host.backend`):
    cpu                           ggml's CPU device (`ggml_backend_dev_by_type(CPU)`)
    NAME[:N]                      device N (default 0) of registration NAME: vulkan, vulkan:1,...
    rpc:HOST:PORT[,HOST:PORT...]  ggml-rpc servers, every device of each, in order
    SPEC,SPEC[,...]               several devices (`split_specs`; two servers as two devices:
                                  rpc:H:P,rpc:H:P): the first serves every guest, all of them
                                  a guest with the devices extension
A path to a ggml backend library is not a spec: it goes to `ggml.library.path`
(apir.host.backend.library). ggml-rpc aborts its client process when a server does not answer,
also while adding one, so `resolve` first connects to each server itself and refuses one it
cannot reach (docs/design.md, "Host backends").

A registration can be missing although its code is in the build: ggml-vulkan registers nothing
when the Vulkan loader finds no driver. `backend_library(name)` tells the two apart (the
build's `libggml-NAME.so`, loaded with libggml) so an error can name the cause.

Errors: `BackendSpecError` (a bad spec, an unknown registration or device, an unreachable server).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import List, Optional, Tuple

from apir.errors import ApirError
from apir.ggml.lib import Ggml

__all__ = [
    "BackendSpecError",
    "BackendChoice",
    "backend_library",
    "check_usable",
    "missing_backend_hint",
    "parse_spec",
    "split_specs",
    "resolve",
]
RPC_CONNECT_TIMEOUT_S = 5.0


class BackendSpecError(ApirError, ValueError):
    """A backend spec that names nothing this ggml build (or network) has."""


@dataclass(frozen=True)
class ParsedSpec:
    """`kind` "cpu", "rpc" or "reg"; `name` the registration's name; `index` the device (reg);
    `endpoints` HOST:PORT strings (rpc)."""

    kind: str
    name: str = ""
    index: int = 0
    endpoints: Tuple[str, ...] = ()


@dataclass(frozen=True)
class BackendChoice:
    """What a spec resolved to: `devices` (ggml_backend_dev_t, at least one) and the
    registration of each (`regs`, same order)."""

    spec: str
    devices: List[int]
    regs: List[int]


def parse_spec(spec: str) -> ParsedSpec:
    """The parts of `spec` (see the module docstring). Raises BackendSpecError."""
    text = spec.strip()
    if not text:
        raise BackendSpecError("empty backend spec")
    head, sep, rest = text.partition(":")
    if head.lower() == "cpu" and not sep:
        return ParsedSpec("cpu", "CPU")
    if head.lower() == "rpc":
        endpoints = tuple(e.strip() for e in rest.split(",")) if sep else ()
        if not endpoints or any(not _endpoint_ok(e) for e in endpoints):
            raise BackendSpecError(f"{spec!r}: expected rpc:HOST:PORT[,HOST:PORT...]")
        return ParsedSpec("rpc", "RPC", endpoints=endpoints)
    if "/" in text:
        raise BackendSpecError(f"{spec!r}: a library path goes to ggml.library.path, not a backend spec")
    index = 0
    if sep:
        if not rest.isdigit():
            raise BackendSpecError(f"{spec!r}: expected NAME[:DEVICE_INDEX]")
        index = int(rest)
    return ParsedSpec("reg", head, index=index)


def split_specs(spec: str) -> List[str]:
    """The device specs of a comma-separated list ("cpu,vulkan:0,rpc:H:P,rpc:H:P": the devices
    a host serves to a guest with the devices extension). An rpc spec takes every item after it
    up to the next "rpc:" (one spec of several servers, whose contexts the host spreads over
    them), so rpc specs come last."""
    pieces: List[str] = []
    for item in (item.strip() for item in spec.split(",")):
        if pieces and pieces[-1].lower().startswith("rpc:") and not item.lower().startswith("rpc:"):
            pieces[-1] += "," + item
        else:
            pieces.append(item)
    return pieces


def _endpoint_ok(endpoint: str) -> bool:
    host, sep, port = endpoint.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def check_reachable(endpoint: str, timeout: float = RPC_CONNECT_TIMEOUT_S) -> None:
    """Connects to ggml-rpc server `endpoint` (HOST:PORT) and hangs up. Raises
    BackendSpecError when nothing listens there."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as exc:
        raise BackendSpecError(f"ggml-rpc server {endpoint} not reachable: {exc}") from exc


def check_usable(g: Ggml, spec: str) -> None:
    """Refuses, before a host starts, a backend spec (a device list too: `split_specs`) that
    build `g` cannot serve: BackendSpecError naming what is missing (`missing_backend_hint`).
    ggml-rpc servers are only probed (`check_reachable`): resolving them would add them to this
    process's registry."""
    for item in split_specs(spec):
        try:
            parsed = parse_spec(item)
            if parsed.kind == "rpc":
                for endpoint in parsed.endpoints:
                    check_reachable(endpoint)
            else:
                resolve(g, item)
        except BackendSpecError as exc:
            raise BackendSpecError(f"{exc}{missing_backend_hint(g, item)}") from exc


def resolve(g: Ggml, spec: str) -> BackendChoice:
    """The devices `spec` names in build `g`'s registry. Raises BackendSpecError."""
    p = parse_spec(spec)
    if p.kind == "cpu":
        dev = g.ggml_backend_dev_by_type(g.header.dev_types["CPU"])
        if not dev:
            raise BackendSpecError("this ggml has no CPU device")
        return BackendChoice(spec, [dev], [g.ggml_backend_dev_backend_reg(dev)])
    reg = g.ggml_backend_reg_by_name(p.name.encode())
    if not reg:
        names = [g.ggml_backend_reg_name(g.ggml_backend_reg_get(i)).decode() for i in range(g.ggml_backend_reg_count())]
        raise BackendSpecError(f"{spec!r}: this ggml has no backend {p.name!r} (it has {', '.join(names)})")
    if p.kind == "rpc":
        return _resolve_rpc(g, spec, reg, p.endpoints)
    n = g.ggml_backend_reg_dev_count(reg)
    if p.index >= n:
        raise BackendSpecError(f"{spec!r}: backend {p.name} has {n} device(s)")
    return BackendChoice(spec, [g.ggml_backend_reg_dev_get(reg, p.index)], [reg])


def _resolve_rpc(g: Ggml, spec: str, reg: int, endpoints: Tuple[str, ...]) -> BackendChoice:
    import ctypes

    fn_ptr = g.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server")
    if not fn_ptr:
        raise BackendSpecError("the RPC backend of this ggml has no ggml_backend_rpc_add_server")
    add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(fn_ptr)
    devices, regs = [], []
    for endpoint in endpoints:
        check_reachable(endpoint)
        server_reg = add_server(endpoint.encode())
        if not server_reg:
            raise BackendSpecError(f"ggml-rpc server {endpoint}: ggml_backend_rpc_add_server failed")
        for i in range(g.ggml_backend_reg_dev_count(server_reg)):
            devices.append(g.ggml_backend_reg_dev_get(server_reg, i))
            regs.append(server_reg)
    if not devices:
        raise BackendSpecError(f"{spec!r}: the servers offer no device")
    return BackendChoice(spec, devices, regs)


def backend_library(name: str, maps: str = "/proc/self/maps") -> Optional[str]:
    """The path of the ggml backend library of registration `name` (``libggml-vulkan.so...``
    for "Vulkan") that this process has loaded, or None: whether the loaded ggml has that
    backend's code, whatever its registry says. `maps`: the process's memory map file."""
    prefix = f"libggml-{name.lower()}.so"
    try:
        with open(maps) as f:
            for line in f:
                fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
                if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith(prefix):
                    return fields[5].strip()
    except OSError:
        pass
    return None


def missing_backend_hint(g: Ggml, spec: str) -> str:
    """What to do about a spec build `g` cannot serve, to append to its error ("" when there is
    no advice): a build without that backend names the build that has it; ggml-vulkan without a
    driver or a device names what is missing (docs/gpu.md)."""
    try:
        parsed = parse_spec(spec)
    except BackendSpecError:
        return ""
    if parsed.kind != "reg":
        return ""
    vulkan = parsed.name.lower() == "vulkan"
    reg = g.ggml_backend_reg_by_name(parsed.name.encode())
    if not reg:
        library = backend_library(parsed.name)
        if library and vulkan:
            return (
                f"; the ggml build apir loaded has ggml-vulkan ({library}), but the Vulkan loader found no "
                "driver: install the GPU's Vulkan driver (ICD) or point VK_ICD_FILENAMES at its JSON file; "
                "`vulkaninfo --summary` lists what the loader sees (docs/gpu.md)"
            )
        if library:
            return f"; the ggml build apir loaded has {library}, but it registered no {parsed.name} backend"
        return (
            f"; the ggml build apir loaded ({g.lib_dir}) has no {parsed.name} device: "
            "scripts/build-ggml-backends.sh builds one with Vulkan and RPC, selected with "
            'APIR_GGML_LIB_DIR (README.md, "Which device the host computes on"; docs/gpu.md)'
        )
    if vulkan and g.ggml_backend_reg_dev_count(reg) == 0:
        return (
            "; the Vulkan driver shows ggml-vulkan no device it takes: none, or only CPU ones (llvmpipe), which "
            "ggml-vulkan skips unless GGML_VK_VISIBLE_DEVICES names them; `vulkaninfo --summary` lists the "
            "devices (docs/gpu.md)"
        )
    return ""
