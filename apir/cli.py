"""The `apir` command: serve a local host, query a device, and whatever other modules add.

Theory of operation: `main` builds one argparse parser whose subcommands come from modules; each
module has ``add_parser(subparsers, parents)`` which adds its parser(s) and sets
``run=<callable(args) -> int>`` as a default. This file's own commands are `apir host serve`,
`apir info` and `apir trace`; other modules join by being named in `SUBCOMMAND_MODULES` (`apir
embed` comes from apir.models.cli_embed). Logging goes through the standard logging module
(``--log-level``, else $APIR_LOG_LEVEL); any failure becomes one line ``apir: error: ...`` on
stderr, naming the path or value at fault.

Exit status (the same for every command): 0 success, 1 a runtime error (no host at that
socket, a build that cannot load, a compute that failed), 2 bad usage (an unknown option, an
empty or impossible value: argparse's errors and `UsageError`), 130 Ctrl-C, 141 when stdout's
reader went away (`| head`), quietly.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import logging
import os
import signal
import sys
import threading
from typing import Optional, Sequence

from apir import __version__
from apir.codec.constants import (
    APIR_PROTOCOL_MAJOR,
    APIR_PROTOCOL_MINOR,
    ApirExtension,
)
from apir.host.config import (
    CONFIG_KEY_BACKEND,
    CONFIG_KEY_GGML_LIBRARY_PATH,
    CONFIG_KEY_GGML_LIBRARY_REG,
    CONFIG_KEY_LOAD_LIBRARY_PATH,
    CONFIG_KEY_N_THREADS,
    ENV_FALLBACKS,
)
from apir.errors import ApirError
from apir.socket_path import SocketPathError, check_connect, check_listen, check_syntax

__all__ = [
    "main",
    "entry",
    "build_parser",
    "SUBCOMMAND_MODULES",
    "host_config_from_args",
    "known_config_keys",
    "add_host_config_arguments",
    "add_device_arguments",
    "device_from_args",
    "UsageError",
    "EXIT_OK",
    "EXIT_ERROR",
    "EXIT_USAGE",
    "socket_arg",
    "node_arg",
]

log = logging.getLogger("apir.cli")  # its module name, also when run as `python -m apir.cli`

# Modules adding subcommands (each with add_parser(subparsers, parents)); this one first.
SUBCOMMAND_MODULES = ["apir.cli", "apir.models.cli_embed", "apir.conformance.cli", "apir.vm.cli"]

_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
ENV_LOG_LEVEL = "APIR_LOG_LEVEL"

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
EXIT_PIPE = 128 + signal.SIGPIPE  # 141: what a shell reports for a command killed by SIGPIPE


class UsageError(ApirError, ValueError):
    """A value the user gave that can never work (not merely one that fails now): exit 2."""


# --- option values -----------------------------------------------------------------------------
def socket_arg(value: str) -> str:
    """argparse `type` of --socket: a possible Unix socket path (not empty, short enough)."""
    try:
        return check_syntax(value)
    except SocketPathError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def node_arg(value: str) -> str:
    """argparse `type` of --drm: a render node path, not empty."""
    if not value:
        raise argparse.ArgumentTypeError("empty render node path (give one such as /dev/dri/renderD128)")
    return value


def threads_arg(value: str) -> str:
    """argparse `type` of a host's --threads: a count of at least 1, or "free"."""
    if value != "free" and not (value.isdigit() and int(value) >= 1):
        raise argparse.ArgumentTypeError(f"{value!r} is not a thread count (a number of at least 1, or free)")
    return value


# --- shared options --------------------------------------------------------------------------
def add_host_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The HostContext configuration options (for `host serve` and an embedded host)."""
    group = parser.add_argument_group("host configuration")
    group.add_argument(
        "--backend",
        metavar="SPEC",
        help="the ggml backend the host computes on, found through ggml's backend registry: cpu (default), "
        "vulkan[:N], NAME[:N] (any backend of the loaded ggml), rpc:HOST:PORT[,HOST:PORT...] (ggml-rpc "
        f"servers; {CONFIG_KEY_BACKEND}), or a path to a ggml backend library (the same as --ggml-library)",
    )
    group.add_argument(
        "--ggml-library",
        metavar="PATH",
        help=f"ggml backend library the host loads ({CONFIG_KEY_GGML_LIBRARY_PATH}; default: "
        f"${ENV_FALLBACKS[CONFIG_KEY_GGML_LIBRARY_PATH]}, the C host's variable, else the CPU device of "
        "the ggml apir loads)",
    )
    group.add_argument(
        "--ggml-reg",
        metavar="SYMBOL",
        help=f"its registration symbol ({CONFIG_KEY_GGML_LIBRARY_REG}; default ggml_backend_init)",
    )
    group.add_argument(
        "--backend-library", metavar="PATH", help=f"APIR backend library ({CONFIG_KEY_LOAD_LIBRARY_PATH})"
    )
    group.add_argument(
        "--threads",
        metavar="N",
        type=threads_arg,
        help="threads of a CPU backend (apir.host.n_threads): a count, or free: each graph on the cores "
        "other processes leave free as it starts, faster where guests share the host's cores; "
        "default: all the machine's cores",
    )
    group.add_argument(
        "--config",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="any other HostContext configuration key (repeatable; an unknown key is refused, the known ones named)",
    )


def known_config_keys() -> list:
    """The HostContext configuration keys `--config` accepts, sorted: every CONFIG_KEY_* of
    apir.host.config, where all of them are."""
    from apir.host import config

    return sorted(getattr(config, name) for name in dir(config) if name.startswith("CONFIG_KEY_"))


def host_config_from_args(args: argparse.Namespace) -> Optional[dict]:
    """The HostContext config dict from add_host_config_arguments' options (None if empty).
    Raises UsageError for a --config without '=' or of a key no part of the host reads."""
    config: dict = {}
    known = known_config_keys() if args.config else []
    for item in args.config:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--config expects KEY=VALUE, got {item!r}")
        if key not in known:
            raise UsageError(f"--config {key}: not a host configuration key (known: {', '.join(known)})")
        config[key] = value
    if getattr(args, "threads", None):
        config[CONFIG_KEY_N_THREADS] = args.threads
    backend = getattr(args, "backend", None)
    if backend:
        # a path is a library (the C host's key); anything else a registry spec
        config[CONFIG_KEY_GGML_LIBRARY_PATH if "/" in backend else CONFIG_KEY_BACKEND] = backend
    for key, value in (
        (CONFIG_KEY_GGML_LIBRARY_PATH, args.ggml_library),
        (CONFIG_KEY_GGML_LIBRARY_REG, args.ggml_reg),
        (CONFIG_KEY_LOAD_LIBRARY_PATH, args.backend_library),
    ):
        if value:
            config[key] = value
    return config or None


def check_host_backend(config: Optional[dict]) -> None:
    """Refuse, before a host starts serving, a --backend / --ggml-library it could not serve:
    a library path that is no file, a spec ggml's registry of the loaded build does not have, a
    ggml-rpc server that does not answer. Otherwise the first guest would see the failure, as a
    LoadLibrary error code. Raises UsageError naming the value."""
    if not config:
        return
    path = config.get(CONFIG_KEY_GGML_LIBRARY_PATH)
    if path and not os.path.isfile(path):
        raise UsageError(f"ggml backend library {path!r}: no such file")
    spec = config.get(CONFIG_KEY_BACKEND)
    if not spec:
        return
    from apir.ggml import backend_spec, load

    try:
        backend_spec.check_usable(load(), spec)  # (several: a device set, docs/protocol.md section 12)
    except backend_spec.BackendSpecError as exc:
        raise UsageError(f"--backend {spec}: {exc}") from exc


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """--socket / --drm (neither: an embedded host) plus the embedded host's configuration."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--socket", metavar="PATH", type=socket_arg, help="talk to `apir host serve` at this socket")
    where.add_argument(
        "--drm", metavar="NODE", type=node_arg, help="talk to a virtio-gpu render node (/dev/dri/renderD128)"
    )
    add_host_config_arguments(parser)


def device_from_args(args: argparse.Namespace) -> tuple[Optional[str], Optional[dict]]:
    """(device spec, host configuration) of a command's options, for apir.devices: the spec of
    --socket / --drm (apir.devices.device_spec; None for neither: the default device) and,
    where the command has the host configuration options, their config (else None). Every
    command opens its device this way."""
    from apir.devices import device_spec

    spec = device_spec(getattr(args, "socket", None), getattr(args, "drm", None))
    config = host_config_from_args(args) if hasattr(args, "config") else None
    return spec, config


def add_trace_argument(parser: argparse.ArgumentParser) -> None:
    """--trace FILE for a command that can run its host in this process (the embedded device)."""
    parser.add_argument(
        "--trace",
        metavar="FILE",
        help="record each command the embedded host serves to FILE (`apir trace FILE` prints it; "
        "a socket host traces with `apir host serve --trace`)",
    )


def embedded_trace(args: argparse.Namespace, spec: Optional[str]):
    """(trace or None, device options) for --trace: a `CommandTrace` set as the tracer of the
    embedded host's context. Raises UsageError when the device is not the embedded one (that
    host runs elsewhere), OSError (naming the file) when it cannot be written."""
    if not getattr(args, "trace", None):
        return None, None
    from apir.devices import parse_spec
    from apir.host.local.kernel import default_context_factory
    from apir.host.component.trace import CommandTrace, traced_context_factory

    if parse_spec(spec).kind != "embedded":
        raise UsageError(
            "--trace records a host this process runs (the embedded one); for a socket host "
            "give --trace to `apir host serve`"
        )
    trace = CommandTrace(args.trace)
    return trace, {"context_factory": traced_context_factory(default_context_factory, trace)}


def raise_open_files_limit() -> None:
    """The soft RLIMIT_NOFILE up to the hard one, as a server that holds descriptors for many
    guests does: the host's descriptor bounds per guest and in all are shares of the soft
    limit (apir.host.config), and Debian's default soft limit, 1024, would leave a VM 256."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:  # (a container may refuse it: the soft limit stays)
            logging.getLogger("apir").warning("could not raise the open files limit to %s: %s", hard, exc)


def stop_on_signals() -> threading.Event:
    """An event that SIGTERM and SIGINT set: a host command serves until it is set."""
    stop = threading.Event()

    def on_signal(signum, frame):
        log.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop


# --- apir host serve -------------------------------------------------------------------------
def run_host_serve(args: argparse.Namespace) -> int:
    from apir.host.local.kernel import default_context_factory
    from apir.host.local.server import LocalServer
    from apir.host.component.trace import CommandTrace, traced_context_factory

    check_listen(args.socket)
    config = host_config_from_args(args)
    check_host_backend(config)
    raise_open_files_limit()
    trace = CommandTrace(args.trace) if args.trace else None
    factory = traced_context_factory(default_context_factory, trace) if trace else default_context_factory
    try:
        server = LocalServer(
            args.socket,
            config=config,
            context_factory=factory,
            max_context_bytes=None if args.max_context_mib is None else args.max_context_mib << 20,
            socket_mode=args.socket_mode,
            stat_host_wide=args.stat_host_wide,
        )
    except BaseException:
        if trace:
            trace.close()
        raise
    stop = stop_on_signals()
    server.start()
    traced = f", tracing commands to {args.trace}" if trace else ""
    print(f"apir: serving on {server.path}{traced}", file=sys.stderr, flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.close()
        if trace:
            trace.close()
    return 0


# --- apir host vhost-user ------------------------------------------------------------------
def size_arg(text: str) -> int:
    """argparse `type` of a byte count: decimal, or with a K/M/G suffix (powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    scale = units.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale > 1 else text
    if not digits.isdigit() or int(digits) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (a positive number of bytes, or with K, M or G)")
    return int(digits) * scale


def write_vhost_stats(path: str, servers) -> None:
    """Writes what each socket's VM holds now to `path` as JSON, atomically (a reader never
    sees half a file): {"sockets": {socket: {"contexts", "blobs", "blob_bytes",
    "closing_contexts", "ggml_buffers", "sessions_served", "connected"}}}."""
    import dataclasses

    stats = {}
    for server in servers:
        # the session count first: a session counted has left the counts read after it (read
        # the other way round, a session ending in between was counted with its contexts)
        served, connected = server.sessions_served, server.session is not None
        entry = dataclasses.asdict(server.counts())
        entry["sessions_served"] = served
        entry["connected"] = connected
        stats[server.path] = entry
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"sockets": stats}, fh)
    os.replace(tmp, path)


def run_host_vhost_user(args: argparse.Namespace) -> int:
    from apir.codec.virtgpu import VIRTGPU_DRM_CAPSET_APIR, VIRTGPU_DRM_CAPSET_VENUS
    from apir.host.local.kernel import default_context_factory
    from apir.host.component.trace import CommandTrace, traced_context_factory
    from apir.host.vhost_user import VhostUserServer

    # Imported now, not at the first CTX_CREATE: importing it then would eat into the time the
    # guest gives the HandShake that follows.
    import apir.host.component.context  # noqa: F401

    for path in args.socket:
        check_listen(path)
    if args.shm_size % os.sysconf("SC_PAGE_SIZE"):
        raise UsageError(f"--shm-size {args.shm_size} is not a multiple of the page size")
    config = host_config_from_args(args)
    check_host_backend(config)
    raise_open_files_limit()
    capsets = (VIRTGPU_DRM_CAPSET_APIR, VIRTGPU_DRM_CAPSET_VENUS) if args.venus else (VIRTGPU_DRM_CAPSET_APIR,)
    trace = CommandTrace(args.trace) if args.trace else None
    factory = traced_context_factory(default_context_factory, trace) if trace else default_context_factory
    servers = []
    try:
        for path in args.socket:
            servers.append(
                VhostUserServer(
                    path,
                    config=config,
                    context_factory=factory,
                    capsets=capsets,
                    shm_size=args.shm_size,
                    socket_mode=args.socket_mode,
                )
            )
    except BaseException:
        for server in servers:
            server.close()
        if trace:
            trace.close()
        raise
    stop = stop_on_signals()
    for server in servers:
        server.start()
    traced = f", tracing commands to {args.trace}" if trace else ""
    where = ", ".join(args.socket)
    print(f"apir: virtio-gpu vhost-user device on {where}{traced}", file=sys.stderr, flush=True)
    try:
        while not stop.wait(0.5):
            if args.stats:
                write_vhost_stats(args.stats, servers)
    finally:
        for server in servers:
            server.close()
        if trace:
            trace.close()
    return 0


# --- apir trace ------------------------------------------------------------------------------
def run_trace(args: argparse.Namespace) -> int:
    from apir.host.component.trace import format_trace, read_trace

    print(format_trace(read_trace(args.file), commands=not args.summary))
    return 0


def _octal_mode(text: str) -> int:
    """A permission mode in octal (600, 0600, 0o600)."""
    try:
        mode = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an octal mode") from None
    if not 0 <= mode <= 0o777:
        raise argparse.ArgumentTypeError(f"{text!r} is not a permission mode (0 to 0777)")
    return mode


# --- apir info -------------------------------------------------------------------------------
SIZE_MAX = (1 << 64) - 1  # what a buffer type without a size limit answers (C's SIZE_MAX)


def gather_info(client) -> dict:
    """What `apir info` reports, from a connected `ApirClient`."""
    free, total = client.device_get_memory()
    buft = client.device_get_buffer_type()
    dev_type = client.device_get_type()
    return {
        "device": {
            "name": client.device_get_name(),
            "description": client.device_get_description(),
            "type": dev_type,
            "type_name": device_type_name(dev_type),
            "memory_free": free,
            "memory_total": total,
        },
        "buffer_type": {
            "name": client.buffer_type_get_name(buft),
            "alignment": client.buffer_type_get_alignment(buft),
            "max_size": client.buffer_type_get_max_size(buft),
        },
    }


def device_type_name(value: int) -> Optional[str]:
    """The name of an `enum ggml_backend_dev_type` value ("CPU", "GPU", "IGPU", "ACCEL"), read
    from the loaded ggml build's ggml-backend.h; None when that header or the value is missing."""
    from apir.ggml import GgmlLoadError, load

    try:
        names = load().header.dev_types
    except (OSError, GgmlLoadError):
        return None
    return {v: k for k, v in names.items()}.get(value)


def run_info(args: argparse.Namespace) -> int:
    from apir.devices import open_client, parse_spec

    spec, config = device_from_args(args)
    device = parse_spec(spec)
    if device.kind == "embedded" and config and config.get(CONFIG_KEY_BACKEND):
        # what LoadLibrary would answer with a code alone; a runtime error, as that one
        try:
            check_host_backend({CONFIG_KEY_BACKEND: config[CONFIG_KEY_BACKEND]})
        except UsageError as exc:
            raise ApirError(str(exc)) from exc
    trace, device_options = embedded_trace(args, spec)
    if args.socket:
        check_connect(args.socket)
    try:
        with open_client(spec, config=config, device_options=device_options) as client:
            info: dict = {"transport": device.kind, "node": device.node, "where": device.where}
            info["protocol"] = {
                "guest": "%d.%d" % tuple(client.protocol),
                "host": "%d.%d" % tuple(client.host_version),
                "capset": client.remote.capset_id,
                # the extensions both sides agreed on (docs/protocol.md section 12)
                "extensions": [str(bit.name).lower() for bit in ApirExtension if client.extensions & bit],
                "devices": client.device_count,
            }
            info.update(gather_info(client))
    finally:
        if trace:
            trace.close()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_info(info))
    return 0


def human_size(n: int) -> str:
    """`n` bytes for people: "512 bytes", "1.5 KiB", "15.6 GiB"; SIZE_MAX is "unlimited"."""
    if n >= SIZE_MAX:
        return "unlimited"
    if n < 1024:
        return f"{n} bytes"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        value /= 1024
        if value < 1024 or unit == "EiB":
            break
    return f"{value:.1f} {unit}"


_CAPSETS = {10: "APIR", 4: "Venus"}  # virtio-gpu capset ids apir speaks (apir.guest.remote)


def format_info(info: dict) -> str:
    """`apir info`'s text: enum values named, sizes for people (the JSON keeps the numbers)."""
    d, b, p = info["device"], info["buffer_type"], info["protocol"]
    dev_type = f"{d['type_name']} (ggml_backend_dev_type {d['type']})" if d.get("type_name") else str(d["type"])
    capset = f"{_CAPSETS[p['capset']]} capset {p['capset']}" if p["capset"] in _CAPSETS else f"capset {p['capset']}"
    lines = [
        f"transport:          {info['where']}",
        f"APIR protocol:      guest {p['guest']}, host {p['host']} ({capset}), HandShake ok",
        f"extensions:         {', '.join(p.get('extensions') or ['none'])} ({p.get('devices', 1)} device(s))",
        f"served by:          {d['name']} ({d['description']})",
        f"device:             {d['name']}",
        f"description:        {d['description']}",
        f"type:               {dev_type}",
        f"memory:             {human_size(d['memory_free'])} free of {human_size(d['memory_total'])}",
        f"buffer type:        {b['name']}",
        f"  alignment:        {b['alignment']} bytes",
        f"  max buffer size:  {human_size(b['max_size'])}",
    ]
    return "\n".join(lines)


# --- registration ------------------------------------------------------------------------------
def add_parser(subparsers, parents) -> None:
    """This module's commands: `host serve` and `info`."""
    host = subparsers.add_parser("host", help="run the host side")
    host_sub = host.add_subparsers(dest="host_command", metavar="COMMAND", required=True)
    serve = host_sub.add_parser(
        "serve", parents=parents, help="serve guests on a Unix socket (kernel driver + hypervisor stand-in)"
    )
    serve.add_argument("--socket", metavar="PATH", type=socket_arg, required=True, help="Unix socket to listen on")
    serve.add_argument(
        "--trace",
        metavar="FILE",
        help="record each command (type, backend function, sizes, status, host time; "
        "no tensor data) to FILE as JSON lines; `apir trace FILE` prints it",
    )
    serve.add_argument(
        "--max-context-mib",
        type=int,
        default=None,
        metavar="MIB",
        help="shared memory limit of one guest context (default: apir.local.max_context_bytes, 65536 MiB)",
    )
    serve.add_argument(
        "--socket-mode",
        type=_octal_mode,
        default=0o600,
        metavar="OCTAL",
        help="permission bits of the socket file, whatever the umask (default 0600)",
    )
    serve.add_argument(
        "--stat-host-wide",
        action="store_true",
        help="STAT answers any guest with counts over all guests (tests, debugging; default: each guest's own)",
    )
    add_host_config_arguments(serve)
    serve.set_defaults(run=run_host_serve)

    vhost = host_sub.add_parser(
        "vhost-user",
        parents=parents,
        help="serve VMs: a virtio-gpu device for QEMU's vhost-user-test-device-pci (docs/vm.md)",
    )
    vhost.add_argument(
        "--socket",
        metavar="PATH",
        type=socket_arg,
        action="append",
        required=True,
        help="vhost-user socket QEMU connects to (its -chardev socket,path=PATH); repeat for one VM per socket",
    )
    vhost.add_argument(
        "--shm-size",
        type=size_arg,
        default=1 << 30,
        metavar="BYTES",
        help="size of the host-visible region blobs are mapped into (K/M/G suffixes; default 1G)",
    )
    vhost.add_argument("--venus", action="store_true", help="offer the Venus capset (4) besides APIR (10)")
    vhost.add_argument(
        "--trace",
        metavar="FILE",
        help="record each APIR command (as `apir host serve --trace`) to FILE; `apir trace FILE` prints it",
    )
    vhost.add_argument(
        "--stats",
        metavar="FILE",
        help="keep FILE updated (every 0.5 s, as JSON) with what each socket's VM holds: contexts, "
        "blobs, blob bytes, ggml buffers, front-ends served (for tests and monitoring)",
    )
    vhost.add_argument(
        "--socket-mode",
        type=_octal_mode,
        default=0o600,
        metavar="OCTAL",
        help="permission bits of the socket file, whatever the umask (default 0600)",
    )
    add_host_config_arguments(vhost)
    vhost.set_defaults(run=run_host_vhost_user)

    trace = subparsers.add_parser(
        "trace",
        parents=parents,
        help="print a command trace (`apir host serve --trace FILE`) and its per-function summary",
        description="Print a command trace (`apir host serve --trace FILE`) and its per-function summary.",
    )
    trace.add_argument("file", metavar="FILE", help="the trace file")
    trace.add_argument("--summary", action="store_true", help="only the per-function summary")
    trace.set_defaults(run=run_trace)

    info = subparsers.add_parser(
        "info",
        parents=parents,
        help="HandShake with a host and describe its device and buffer type",
        description="HandShake with a host and describe its device and buffer type.",
    )
    add_device_arguments(info)
    add_trace_argument(info)
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(run=run_info)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--log-level", choices=_LOG_LEVELS, default=argparse.SUPPRESS, help="logging level (default warning)"
    )
    parser = argparse.ArgumentParser(
        prog="apir",
        parents=[common],
        description="API Remoting (APIR) for ggml, in Python.",
        epilog="Exit status: 0 success, 1 runtime error, 2 bad usage. Environment variables: docs/environment.md.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"apir {__version__} (APIR protocol {APIR_PROTOCOL_MAJOR}.{APIR_PROTOCOL_MINOR})",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMAND_MODULES:
        module = sys.modules[__name__] if name == __name__ else importlib.import_module(name)
        module.add_parser(subparsers, [common])
    return parser


def _parse(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """`parser.parse_args`, but an unknown option is reported with the usage of the command
    it was given to (`apir embed --model x`), not the top-level one."""
    _mark_subparsers(parser)
    args, extras = parser.parse_known_args(argv)
    if extras:
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def _mark_subparsers(parser: argparse.ArgumentParser) -> None:
    """Each (nested) subcommand's parser as its own default `_parser` (the innermost wins)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.set_defaults(_parser=sub)
                _mark_subparsers(sub)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = _parse(parser, argv)
    level = getattr(args, "log_level", None) or os.environ.get(ENV_LOG_LEVEL) or "warning"
    if level.lower() not in _LOG_LEVELS:
        print(f"apir: error: ${ENV_LOG_LEVEL}={level!r}: expected one of {', '.join(_LOG_LEVELS)}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _announce_compiles()
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("apir: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of stdout went away (`apir trace FILE | head`): stop quietly, as a command
        # killed by SIGPIPE would, and keep Python from reporting the unflushed stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE
    except UsageError as exc:
        print(f"apir: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # one clear line, the traceback only at debug level
        log.debug("failed", exc_info=True)
        print(f"apir: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_ERROR


def _announce_compiles() -> None:
    """A line on stderr when apir's Numba kernels compile (a cold cache: seconds of silence
    otherwise); nothing once they are cached."""
    try:
        from apir import numba_cache
    except ImportError:  # (no Numba: nothing compiles)
        return

    def notice() -> None:
        where = numba_cache.cache_root()
        print(f"apir: compiling kernels on first use (a one-time wait; cached in {where})", file=sys.stderr, flush=True)

    numba_cache.announce_first_compile(notice)


def entry() -> int:
    """The `apir` program (the `apir` script, `python -m apir`): `main()`, then a quick end.

    What main leaves alive (numba's typing registries alone are ~110k objects) is frozen out of
    the cyclic GC: the interpreter's teardown would otherwise run full collections over all of
    it, a sizeable part of a short `apir embed`. Only the end of a process may do this (a
    frozen object in a cycle is never collected; tests call main itself)."""
    status = main()
    gc.freeze()
    return status


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, OSError) and exc.filename and str(exc.filename) not in text:
        text += f": {exc.filename}"
    return " ".join(text.split())


if __name__ == "__main__":
    # `python -m apir.cli`: run the imported module's entry, not this __main__ copy's, so that
    # the commands and main share one set of classes (UsageError).
    from apir.cli import entry as _entry

    sys.exit(_entry())
