"""`apir vm run` and `apir vm provision` (docs/vm.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from apir.cli import UsageError, add_host_config_arguments, host_config_from_args

__all__ = ["add_parser"]

# The device as `apir vm run` starts it: the Venus capset offered too (llama.cpp's ggml-virtgpu
# asks for it; APIR is served on both) and presented as a GPU (llama.cpp takes a remote device
# of type CPU for its own CPU); --config apir.host.device_type=... overrides the type.
DEVICE_ARGS = ("--venus",)
DEVICE_TYPE_KEY = "apir.host.device_type"


def host_args(args: argparse.Namespace) -> list:
    """The `apir host vhost-user` options of add_host_config_arguments' values (checked here
    first: a bad one is a usage error before anything starts)."""
    host_config_from_args(args)
    out = list(DEVICE_ARGS)
    for option, value in (
        ("--backend", args.backend),
        ("--ggml-library", args.ggml_library),
        ("--ggml-reg", args.ggml_reg),
        ("--backend-library", args.backend_library),
        ("--threads", args.threads),
    ):
        if value:
            out += [option, value]
    if not any(item.startswith(DEVICE_TYPE_KEY + "=") for item in args.config):
        out += ["--config", f"{DEVICE_TYPE_KEY}=gpu"]
    for item in args.config:
        out += ["--config", item]
    if args.host_log_level:
        out += ["--log-level", args.host_log_level]
    return out


def run_vm_run(args: argparse.Namespace) -> int:
    from apir.vm.run import RunOptions, exit_on_termination, run

    argv = list(args.program)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise UsageError("give the program to run after --: apir vm run [OPTIONS] -- PROGRAM [ARGS...]")
    if args.vms < 1:
        raise UsageError(f"--vms {args.vms}: give at least 1")
    devices = [Path(d) for d in args.device or ()]
    if devices and args.vms not in (1, len(devices)):
        raise UsageError(f"--vms {args.vms} with {len(devices)} --device: give one --device per VM")
    for device in devices:
        if not device.is_socket():
            raise UsageError(f"--device {device}: no socket there (start `apir host vhost-user --socket {device}`)")
    opts = RunOptions(
        vms=len(devices) or args.vms,
        devices=devices,
        kernel=args.kernel,
        memory=args.memory,
        cpus=args.cpus,
        accel=None if args.accel == "auto" else args.accel,
        host_args=host_args(args),
        host_log=Path(args.host_log) if args.host_log else None,
        timeout_s=args.timeout,
    )
    sys.stdout.flush()
    sys.stderr.flush()
    exit_on_termination()
    return run(argv, opts, sys.stdout.buffer, sys.stderr.buffer)


def run_vm_provision(args: argparse.Namespace) -> int:
    from apir.vm.provision import cache_dir, provision

    out = Path(args.dir) if args.dir else cache_dir()
    prov = provision(out)
    print(f"apir: VM provisioned in {prov.root}", file=sys.stderr)
    return 0


def add_parser(subparsers, parents) -> None:
    vm = subparsers.add_parser("vm", help="run programs in VMs on apir's virtio-gpu device (docs/vm.md)")
    vm_sub = vm.add_subparsers(dest="vm_command", metavar="COMMAND", required=True)
    run = vm_sub.add_parser(
        "run",
        parents=parents,
        help="run a program in a VM whose virtio-gpu is apir's device; its output and exit status come back",
        description="Run PROGRAM in a VM (QEMU 11.1; KVM where it can, else TCG) whose virtio-gpu is apir's "
        "vhost-user device on the host's ggml backend. The guest sees the host's files read-only (its / over "
        "9p; /tmp writable, discarded) and runs in the current folder with this environment. The program's "
        "stdout and stderr are streamed; the exit status is the program's (130 on Ctrl-C).",
        epilog="Provision once first: `apir vm provision` (root; docs/vm.md).",
    )
    run.add_argument("--vms", type=int, default=1, metavar="N", help="N VMs at once, one host process (default 1)")
    run.add_argument("--kernel", choices=("bookworm", "trixie"), default="bookworm", help="guest kernel")
    run.add_argument("--memory", default="2G", metavar="SIZE", help="guest memory per VM (QEMU -m; default 2G)")
    run.add_argument("--cpus", type=int, default=2, metavar="N", help="guest CPUs per VM (default 2)")
    run.add_argument("--accel", choices=("auto", "kvm", "tcg"), default="auto", help="QEMU accelerator")
    run.add_argument("--timeout", type=float, metavar="SECONDS", help="kill a VM running longer (default: none)")
    run.add_argument(
        "--device",
        action="append",
        metavar="SOCKET",
        help="attach to the running vhost-user device at SOCKET (apir host vhost-user) instead of starting a "
        "host; once per VM (the host options below are then the running host's business)",
    )
    run.add_argument("--host-log", metavar="FILE", help="keep the host's log in FILE (default: discarded)")
    run.add_argument(
        "--host-log-level",
        choices=("debug", "info", "warning", "error", "critical"),
        help="the host's --log-level (default warning)",
    )
    add_host_config_arguments(run)
    run.add_argument("program", nargs=argparse.REMAINDER, metavar="-- PROGRAM [ARGS...]")
    run.set_defaults(run=run_vm_run)

    prov = vm_sub.add_parser(
        "provision",
        parents=parents,
        help="fetch QEMU 11.1 and guest kernels once (root, Debian 12)",
        description="Provision DIR (default: the cache `apir vm run` reads) with QEMU 11.1 and guest kernels, "
        "from Debian packages (root; a few minutes, ~900 MiB). Idempotent.",
    )
    prov.add_argument("dir", nargs="?", metavar="DIR", help="the cache folder (default: ~/.cache/apir/vm/qemu-11.1)")
    prov.set_defaults(run=run_vm_provision)
