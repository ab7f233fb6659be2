"""`apir conformance`: checks a host and apir's guest encoder against its vectors (data/*.json).

    apir conformance [--vectors PATH ...] [--host-only | --guest-only] [-v]
                     [--socket PATH | host configuration options (--backend-library ...)]

The host checked is apir's own, embedded in this process (its Python dispatcher, or with
--backend-library the C host library libggml-virtgpu-backend.so through apir's component and
apir.host.backend.c_library; run that with APIR_GGML_LIB_DIR set to the C build's ggml, docs/interop.md),
or any host serving apir's local transport at --socket. The guest checked is apir's encoder
(apir.guest.ApirClient). One line per vector (PASS / FAIL with the first differing field /
SKIP), then the counts; exit status 1 when any vector failed.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import List, Union

__all__ = ["add_parser", "format_report", "run"]


def add_parser(subparsers, parents=()) -> argparse.ArgumentParser:
    from apir.cli import add_host_config_arguments

    p = subparsers.add_parser(
        "conformance",
        parents=list(parents),
        help="check a host and apir's guest encoder against the conformance vectors",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--vectors",
        action="append",
        metavar="PATH",
        help="vector file or folder (repeatable; default the ones shipped in apir/conformance/data/)",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--host-only", action="store_true", help="check the host only")
    which.add_argument("--guest-only", action="store_true", help="check apir's guest encoder only")
    p.add_argument("--socket", metavar="PATH", help="check the host serving the local transport at PATH")
    p.add_argument("-v", "--verbose", action="store_true", help="list passing and skipped vectors too")
    add_host_config_arguments(p)
    p.set_defaults(run=run)
    return p


def format_report(title: str, results, verbose: bool) -> List[str]:
    lines = [f"== {title}"]
    for r in results:
        status = "SKIP" if r.skipped else ("PASS" if r.ok else "FAIL")
        if status == "FAIL" or verbose:
            lines.append(f"{status} {r.file} {r.session} {r.step}" + (f": {r.detail}" if r.detail else ""))
    passed = sum(r.ok and not r.skipped for r in results)
    failed = sum(not r.ok for r in results)
    skipped = sum(r.skipped for r in results)
    lines.append(f"{title}: {passed} passed, {failed} failed, {skipped} skipped")
    return lines


def run(args: argparse.Namespace) -> int:
    from apir.cli import host_config_from_args
    from apir.conformance.vectors import default_vector_dir, load_all

    if getattr(args, "log_level", None) is None:
        # the error vectors make every host log its refusals, and a 0.1 session's guest warns
        # about the host's 0.2: expected, so not shown
        logging.getLogger("apir.host").setLevel(logging.CRITICAL)
        logging.getLogger("apir.guest").setLevel(logging.ERROR)
    files = load_all(args.vectors or [default_vector_dir()])
    if not files:
        raise FileNotFoundError("no vector files found")
    failed = 0
    if not args.guest_only:
        from apir.conformance.host import EmbeddedTarget, SocketTarget, check_host

        config = host_config_from_args(args)
        target: Union[EmbeddedTarget, SocketTarget]
        if args.socket:
            target, title = SocketTarget(args.socket), f"host at {args.socket}"
        else:
            target = EmbeddedTarget(config)
            title = "host: embedded apir" + (
                " with " + config.get("apir.load_library.path", "")
                if config and "apir.load_library.path" in config
                else ""
            )
        results = check_host(target, files)
        print("\n".join(format_report(title, results, args.verbose)), flush=True)
        failed += sum(not r.ok for r in results)
    if not args.host_only:
        from apir.conformance.guest import check_guest

        results = check_guest(files)
        print("\n".join(format_report("guest: apir's encoder", results, args.verbose)), flush=True)
        failed += sum(not r.ok for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    from apir.cli import main

    sys.exit(main(["conformance", *sys.argv[1:]]))
