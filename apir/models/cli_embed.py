"""`apir embed "sentence" [...]`: all-MiniLM-L6-v2 sentence embeddings, computed through APIR.

Theory of operation: opens a backend (`apir.models.backends.open_backend`: the embedded APIR
host by default, `--socket PATH` or `--drm NODE` for the other transports), uploads the model's
weights into its buffers (a progress bar on stderr when that is a terminal), embeds the
sentences in padded, masked batches and prints each embedding's first values and the cosine-
similarity matrix; `--json` prints everything (every value, the matrix, token counts, backend,
timings) as one JSON object on stdout. Embeddings are unit-length, so cosine = dot product.

`add_parser(subparsers)` registers the subcommand on an argparse parser; `run(args)` returns
the exit status: 0, or 2 with a message on stderr when the model package or the backend is
missing. `python -m apir.models.cli_embed ...` runs it alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import List, Optional

__all__ = ["add_parser", "run", "main", "DEFAULT_SHOWN"]

DEFAULT_SHOWN = 8  # values of each embedding printed in text mode


def add_parser(subparsers, parents=()) -> argparse.ArgumentParser:
    """Adds `embed` to an `ArgumentParser.add_subparsers()` object (apir.cli's subcommand
    convention: `parents` carries the shared options); sets `run=run`."""
    p = subparsers.add_parser(
        "embed", parents=list(parents), help="sentence embeddings with all-MiniLM-L6-v2 through APIR",
        description="Embed sentences with all-MiniLM-L6-v2 (384 values, unit length) on the host's "
                    "ggml backend through APIR; prints the first values and the cosine-similarity matrix.")
    _configure(p)
    p.set_defaults(run=run)
    return p


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("sentences", nargs="+", metavar="SENTENCE", help="text to embed (one argument each)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--socket", metavar="PATH", help="a local APIR host's Unix socket")
    where.add_argument("--drm", metavar="NODE", help="a virtio-gpu render node, e.g. /dev/dri/renderD128")
    where.add_argument("--local-cpu", action="store_true", help="ggml CPU in this process, not through APIR")
    p.add_argument("--json", action="store_true", help="print everything as one JSON object")
    p.add_argument("--batch-size", type=int, default=32, metavar="N", help="sentences per graph (default 32)")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="threads of a local CPU backend")
    p.add_argument("--show", type=int, default=DEFAULT_SHOWN, metavar="N",
                   help=f"values of each embedding printed (default {DEFAULT_SHOWN})")
    p.add_argument("--no-progress", action="store_true", help="no upload progress bar")


class _ProgressBar:
    """A one-line bar on a terminal stream, redrawn only when it moves a column."""

    WIDTH = 30

    def __init__(self, stream):
        self.stream, self.last = stream, -1

    def __call__(self, done: int, total: int) -> None:
        filled = self.WIDTH * done // max(total, 1)
        if filled == self.last and done != total:
            return
        self.last = filled
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        self.stream.write(f"\rupload weights [{bar}] {done / 1e6:6.1f}/{total / 1e6:.1f} MB")
        if done == total:
            self.stream.write("\n")
        self.stream.flush()


def _open(args):
    from apir.cli import device_from_args
    from apir.models.backends import open_backend, open_local_cpu

    if args.local_cpu:
        return open_local_cpu(args.threads)
    spec, config = device_from_args(args)
    return open_backend(spec, config=config, n_threads=args.threads)


def run(args: argparse.Namespace, assets=None) -> int:
    """Runs `apir embed` for parsed `args`; `assets` (already read model files) skips re-reading."""
    from apir.models.assets import ModelNotInstalled, load_assets
    from apir.models.backends import BackendUnavailable
    from apir.models.minilm import MiniLM, MiniLMError

    try:
        assets = assets or load_assets()
        opened = _open(args)
    except (ModelNotInstalled, BackendUnavailable, ValueError) as exc:
        print(f"apir embed: {exc}", file=sys.stderr)
        return 2
    progress = None
    if not args.no_progress and sys.stderr.isatty():
        progress = _ProgressBar(sys.stderr)
    try:
        t0 = time.perf_counter()
        with MiniLM(backend=opened.backend, buft=opened.buft, assets=assets, progress=progress) as model:
            t1 = time.perf_counter()
            emb = model.embed(args.sentences, batch_size=args.batch_size)
            t2 = time.perf_counter()
            n_tokens = model.tokenize(args.sentences).lengths.tolist()
            upload = (model.upload_bytes, model.upload_seconds)
    except (MiniLMError, ValueError) as exc:
        print(f"apir embed: {exc}", file=sys.stderr)
        return 2
    finally:
        opened.close()
    cosine = emb @ emb.T
    if args.json:
        doc = {
            "model": "sentence-transformers/all-MiniLM-L6-v2", "model_path": str(assets.path),
            "backend": {"transport": opened.transport, "through_apir": opened.through_apir,
                        "fallback": opened.fallback, "description": opened.description},
            "sentences": list(args.sentences), "n_tokens": n_tokens, "dim": int(emb.shape[1]),
            # float32 -> Python float is exact, so these round-trip bit for bit.
            "embeddings": [[float(v) for v in row] for row in emb],
            "cosine": [[float(v) for v in row] for row in cosine],
            "timing_s": {"load_and_upload": t1 - t0, "upload": upload[1], "embed": t2 - t1},
            "upload_bytes": upload[0],
        }
        json.dump(doc, sys.stdout)
        sys.stdout.write("\n")
        return 0
    _print_text(args, opened, emb, cosine, n_tokens, upload, t2 - t1)
    return 0


def _print_text(args, opened, emb, cosine, n_tokens, upload, embed_s) -> None:
    out = sys.stdout
    out.write(f"backend: {opened.description}\n")
    nbytes, secs = upload
    rate = f", {nbytes / secs / 1e6:.0f} MB/s" if secs > 0 else ""
    out.write(f"weights: {nbytes / 1e6:.1f} MB uploaded in {secs:.3f} s{rate}; "
              f"{len(emb)} sentence(s) embedded in {embed_s:.3f} s\n\n")
    shown = max(0, min(args.show, emb.shape[1]))
    out.write(f"embeddings ({emb.shape[1]} values each, first {shown} shown):\n")
    for i, (row, sentence) in enumerate(zip(emb, args.sentences)):
        values = " ".join(f"{v:+.4f}" for v in row[:shown])
        text = sentence if len(sentence) <= 50 else sentence[:47] + "..."
        out.write(f"  [{i}] {values}  ({n_tokens[i]} tokens) {text!r}\n")
    out.write("\ncosine similarity:\n")
    out.write("      " + "".join(f"{f'[{j}]':>7}" for j in range(len(emb))) + "\n")
    for i, row in enumerate(cosine):
        out.write(f"  {f'[{i}]':<4}" + "".join(f"{v:7.3f}" for v in row) + "\n")


def main(argv: Optional[List[str]] = None) -> int:
    """`python -m apir.models.cli_embed SENTENCE ...` (the same options as `apir embed`)."""
    p = argparse.ArgumentParser(prog="apir embed")
    _configure(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
