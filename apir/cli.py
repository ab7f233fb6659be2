"""The `apir` command: serve a local host, query a device, and whatever other modules add.

Theory of operation: `main` builds one argparse parser whose subcommands come from modules; each
module has ``add_parser(subparsers, parents)`` which adds its parser(s) and sets
``run=<callable(args) -> int>`` as a default. This file's own commands are `apir host serve` and
`apir info`; other modules join by being named in `SUBCOMMAND_MODULES` (`apir embed` comes from
apir.models.cli_embed). Logging goes through the standard logging module (``--log-level``);
any failure becomes one line ``apir: error: ...`` on stderr and a non-zero exit status (1 for an
error, 2 for bad usage, 130 for Ctrl-C).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
import threading
from typing import Optional, Sequence

from apir.codec.constants import (
    CONFIG_KEY_GGML_LIBRARY_PATH,
    CONFIG_KEY_GGML_LIBRARY_REG,
    CONFIG_KEY_LOAD_LIBRARY_PATH,
)

__all__ = ["main", "build_parser", "SUBCOMMAND_MODULES", "host_config_from_args", "add_host_config_arguments",
           "add_device_arguments", "device_from_args"]

log = logging.getLogger("apir.cli")  # its module name, also when run as `python -m apir.cli`

# Modules adding subcommands (each with add_parser(subparsers, parents)); this one first.
SUBCOMMAND_MODULES = ["apir.cli", "apir.models.cli_embed"]

_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


# --- shared options --------------------------------------------------------------------------
def add_host_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The HostContext configuration options (for `host serve` and an embedded host)."""
    group = parser.add_argument_group("host configuration")
    group.add_argument("--ggml-library", metavar="PATH",
                       help=f"ggml backend library the host loads ({CONFIG_KEY_GGML_LIBRARY_PATH}; "
                            "default: the HostContext's, e.g. $APIR_LLAMA_CPP_GGML_LIBRARY_PATH)")
    group.add_argument("--ggml-reg", metavar="SYMBOL",
                       help=f"its registration symbol ({CONFIG_KEY_GGML_LIBRARY_REG}; "
                            "default ggml_backend_init)")
    group.add_argument("--backend-library", metavar="PATH",
                       help=f"APIR backend library ({CONFIG_KEY_LOAD_LIBRARY_PATH})")
    group.add_argument("--config", metavar="KEY=VALUE", action="append", default=[],
                       help="any other HostContext configuration key (repeatable)")


def host_config_from_args(args: argparse.Namespace) -> Optional[dict]:
    """The HostContext config dict from add_host_config_arguments' options (None if empty).
    Raises ValueError for a --config without '='."""
    config: dict = {}
    for item in args.config:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--config expects KEY=VALUE, got {item!r}")
        config[key] = value
    for key, value in ((CONFIG_KEY_GGML_LIBRARY_PATH, args.ggml_library),
                       (CONFIG_KEY_GGML_LIBRARY_REG, args.ggml_reg),
                       (CONFIG_KEY_LOAD_LIBRARY_PATH, args.backend_library)):
        if value:
            config[key] = value
    return config or None


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """--socket / --drm (neither: an embedded host) plus the embedded host's configuration."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--socket", metavar="PATH", help="talk to `apir host serve` at this socket")
    where.add_argument("--drm", metavar="NODE", help="talk to a virtio-gpu render node (/dev/dri/renderD128)")
    add_host_config_arguments(parser)


def device_from_args(args: argparse.Namespace) -> tuple[Optional[str], Optional[dict]]:
    """(device spec, host configuration) of a command's options, for apir.devices: the spec of
    --socket / --drm (apir.devices.device_spec; None for neither: the default device) and, where the command has the host
    configuration options, their config (else None). Every command opens its device this way."""
    from apir.devices import device_spec

    spec = device_spec(getattr(args, "socket", None), getattr(args, "drm", None))
    config = host_config_from_args(args) if hasattr(args, "config") else None
    return spec, config


# --- apir host serve -------------------------------------------------------------------------
def run_host_serve(args: argparse.Namespace) -> int:
    from apir.host.local_server import LocalServer

    server = LocalServer(args.socket, config=host_config_from_args(args),
                         max_context_bytes=args.max_context_mib << 20)
    stop = threading.Event()

    def on_signal(signum, frame):
        log.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.start()
    print(f"apir: serving on {server.path}", file=sys.stderr, flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.close()
    return 0


# --- apir info -------------------------------------------------------------------------------
def gather_info(client) -> dict:
    """What `apir info` reports, from a connected `ApirClient`."""
    free, total = client.device_get_memory()
    buft = client.device_get_buffer_type()
    return {
        "device": {
            "name": client.device_get_name(),
            "description": client.device_get_description(),
            "type": client.device_get_type(),
            "memory_free": free,
            "memory_total": total,
        },
        "buffer_type": {
            "name": client.buffer_type_get_name(buft),
            "alignment": client.buffer_type_get_alignment(buft),
            "max_size": client.buffer_type_get_max_size(buft),
        },
    }


def run_info(args: argparse.Namespace) -> int:
    from apir.devices import open_client, parse_spec

    spec, config = device_from_args(args)
    device = parse_spec(spec)
    with open_client(spec, config=config) as client:
        info = {"transport": device.kind, "node": device.node}
        info["protocol"] = {
            "guest": "%d.%d" % tuple(client.protocol),
            "host": "%d.%d" % tuple(client.host_version),
            "capset": client.remote.capset_id,
        }
        info.update(gather_info(client))
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_info(info))
    return 0


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def format_info(info: dict) -> str:
    d, b, p = info["device"], info["buffer_type"], info["protocol"]
    lines = [
        f"transport:          {info['transport']} ({info['node']})",
        f"APIR protocol:      guest {p['guest']}, host {p['host']} (capset {p['capset']}), HandShake ok",
        f"device:             {d['name']}",
        f"description:        {d['description']}",
        f"type:               {d['type']}",
        f"memory:             {_mib(d['memory_free'])} free of {_mib(d['memory_total'])}",
        f"buffer type:        {b['name']}",
        f"  alignment:        {b['alignment']} bytes",
        f"  max size:         {b['max_size']} bytes",
    ]
    return "\n".join(lines)


# --- registration ------------------------------------------------------------------------------
def add_parser(subparsers, parents) -> None:
    """This module's commands: `host serve` and `info`."""
    host = subparsers.add_parser("host", help="run the host side")
    host_sub = host.add_subparsers(dest="host_command", metavar="COMMAND", required=True)
    serve = host_sub.add_parser("serve", parents=parents,
                                help="serve guests on a Unix socket (kernel driver + hypervisor stand-in)")
    serve.add_argument("--socket", metavar="PATH", required=True, help="Unix socket to listen on")
    serve.add_argument("--max-context-mib", type=int, default=1 << 16, metavar="MIB",
                       help="shared memory limit of one guest context (default %(default)s MiB)")
    add_host_config_arguments(serve)
    serve.set_defaults(run=run_host_serve)

    info = subparsers.add_parser("info", parents=parents,
                                 help="HandShake with a host and describe its device and buffer type")
    add_device_arguments(info)
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(run=run_info)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", choices=_LOG_LEVELS, default=argparse.SUPPRESS,
                        help="logging level (default warning)")
    parser = argparse.ArgumentParser(prog="apir", parents=[common],
                                     description="API Remoting (APIR) for ggml, in Python.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMAND_MODULES:
        module = sys.modules[__name__] if name == __name__ else importlib.import_module(name)
        module.add_parser(subparsers, [common])
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = getattr(args, "log_level", None) or os.environ.get("APIR_LOG_LEVEL", "warning")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("apir: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # one clear line, the traceback only at debug level
        log.debug("failed", exc_info=True)
        print(f"apir: error: {_one_line(exc)}", file=sys.stderr)
        return 1


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, OSError) and exc.filename and str(exc.filename) not in text:
        text += f": {exc.filename}"
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
