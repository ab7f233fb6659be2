"""`apir embed [SENTENCE ...] [-f FILE]`: all-MiniLM-L6-v2 sentence embeddings, computed through APIR.

Theory of operation: gathers the sentences (arguments; `-` or `-f -` reads stdin, `-f FILE` a
file, one sentence per line, blank lines skipped), opens a backend
(`apir.models.backends.open_backend`: the embedded APIR host by default, `--socket PATH` or
`--drm NODE` for the other transports), uploads the model's weights into its buffers, embeds
the sentences in padded, masked batches and writes them in the `--format` asked for:

  table  (default) each embedding's first values, and the cosine-similarity matrix when asked
         (`--similarity`) or small (at most SIMILARITY_AUTO_MAX sentences);
  json   one JSON object: every value, token counts, backend, timings (and the matrix, as above);
  jsonl  one JSON object per sentence: index, sentence, n_tokens, truncated, embedding;
  npy    the (n, 384) float32 matrix as a NumPy .npy file (`-o FILE`, not to a terminal).

Embeddings are unit-length, so cosine = dot product. Warnings (a sentence cut at the model's
256 tokens, an empty one) and progress bars go to stderr. jsonl is written as it is computed;
Ctrl-C stops after the batches in progress (WINDOW_BATCHES) and writes the sentences done.
Exit status (apir.cli's convention): 0, 1 when the model, the backend or the compute fails,
2 for bad usage, 130 Ctrl-C. `add_parser(subparsers)` registers the subcommand; `run(args)`.
"""

from __future__ import annotations

import argparse
import errno
import io
import json
import os
import signal
import sys
import threading
import time
from typing import IO, Any, List, Optional

import numpy as np

from apir.errors import ApirError

__all__ = ["add_parser", "run", "main", "read_sentences", "DEFAULT_SHOWN", "SIMILARITY_AUTO_MAX", "FORMATS"]

DEFAULT_SHOWN = 8  # values of each embedding printed in the table
SIMILARITY_AUTO_MAX = 10  # the cosine matrix is shown unasked up to this many sentences
FORMATS = ("table", "json", "jsonl", "npy")
EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130  # apir.cli's convention


class _Usage(Exception):
    """Bad usage found after parsing (exit 2)."""


def add_parser(subparsers, parents=()) -> argparse.ArgumentParser:
    """Adds `embed` to an `ArgumentParser.add_subparsers()` object (apir.cli's subcommand
    convention: `parents` carries the shared options); sets `run=run`."""
    p = subparsers.add_parser(
        "embed",
        parents=list(parents),
        help="sentence embeddings with all-MiniLM-L6-v2 through APIR",
        description="Embed sentences with all-MiniLM-L6-v2 (384 values, unit length) on the host's "
        "ggml backend through APIR.",
        epilog="Exit status: 0 success, 1 runtime error, 2 bad usage.",
    )
    _configure(p)
    p.set_defaults(run=run)
    return p


def _configure(p: argparse.ArgumentParser) -> None:
    from apir.cli import add_trace_argument, node_arg, socket_arg

    p.add_argument(
        "sentences",
        nargs="*",
        metavar="SENTENCE",
        help="text to embed, one argument each; - reads stdin, one sentence per line",
    )
    p.add_argument(
        "-f",
        "--file",
        action="append",
        default=[],
        metavar="FILE",
        help="read sentences from FILE, one per line, blank lines skipped (- is stdin; repeatable)",
    )
    p.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="leave out (with a warning) input lines that are not UTF-8; by default the first one is an error",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--socket", metavar="PATH", type=socket_arg, help="a local APIR host's Unix socket")
    where.add_argument(
        "--drm", metavar="NODE", type=node_arg, help="a virtio-gpu render node, e.g. /dev/dri/renderD128"
    )
    where.add_argument("--local-cpu", action="store_true", help="ggml CPU in this process, not through APIR")
    p.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="output: table (default), json (one object), jsonl (one line per sentence), "
        "npy (NumPy file of the embeddings)",
    )
    p.add_argument("--json", action="store_true", help="the same as --format json")
    p.add_argument("-o", "--output", metavar="FILE", help="write the output to FILE instead of stdout")
    sim = p.add_mutually_exclusive_group()
    sim.add_argument(
        "--similarity",
        action="store_true",
        default=None,
        help=f"show the cosine-similarity matrix (table, json; by default only for up to "
        f"{SIMILARITY_AUTO_MAX} sentences)",
    )
    sim.add_argument("--no-similarity", action="store_false", dest="similarity", help="never show it")
    p.set_defaults(similarity=None)
    p.add_argument("--batch-size", type=int, default=32, metavar="N", help="sentences per graph (default 32)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="threads of a CPU backend in this process (the embedded host, --local-cpu); default: "
        "for the embedded host the cores other processes leave free as each graph starts, "
        "min(4, cores) for --local-cpu",
    )
    p.add_argument(
        "--show",
        type=int,
        default=DEFAULT_SHOWN,
        metavar="N",
        help=f"values of each embedding printed in the table (default {DEFAULT_SHOWN})",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    add_trace_argument(p)


# --- input -------------------------------------------------------------------------------------
class InputError(ApirError, ValueError):
    """A line of the input that is not UTF-8 (the message names the file and line)."""


def read_sentences(
    arguments: List[str], files: List[str], stdin: IO[str], skip_bad_lines: bool = False, warn=None
) -> List[str]:
    """The sentences, in order: each argument (`-`: stdin's lines), then each file's lines
    (`-`: stdin). Lines lose their line end and are skipped when blank; arguments are kept as
    given. Stdin is read once (as bytes where it has them). A line that is not UTF-8 raises
    InputError naming its file and line, or with `skip_bad_lines` is left out, `warn(message)`
    told. Raises OSError (naming the file)."""
    out: List[str] = []
    stdin_lines: Optional[List[str]] = None

    def decoded(where: str, raw: List[bytes], numbered: bool = True) -> List[str]:
        lines = []
        for number, line in enumerate(raw, 1):
            try:
                lines.append(line.decode("utf-8"))
            except UnicodeDecodeError as exc:
                place = f"{where} line {number}" if numbered else where
                bad = f"{place}: not UTF-8 (its byte {exc.start + 1} is {line[exc.start]:#04x})"
                if not skip_bad_lines:
                    raise InputError(f"{bad}; --skip-bad-lines leaves such lines out") from None
                if warn:
                    warn(f"{bad}: skipped")
        return lines

    def lines_of(name: str) -> List[str]:
        nonlocal stdin_lines
        if name == "-":
            if stdin_lines is None:
                binary = getattr(stdin, "buffer", None)
                if binary is not None:
                    stdin_lines = decoded("stdin", binary.read().splitlines())
                else:  # an already decoded stream
                    raw = [text.encode("utf-8", "surrogateescape") for text in stdin.read().splitlines()]
                    stdin_lines = decoded("stdin", raw)
                return stdin_lines
            return []
        with open(name, "rb") as fh:
            return decoded(name, fh.read().splitlines())

    for number, arg in enumerate(arguments, 1):
        if arg == "-":
            out.extend(line for line in lines_of("-") if line.strip())
        else:
            # (an argument that is not UTF-8 reaches Python as lone surrogates)
            out.extend(decoded(f"argument {number}", [arg.encode("utf-8", "surrogateescape")], False))
    for name in files:
        out.extend(line for line in lines_of(name) if line.strip())
    return out


def _warn(message: str) -> None:
    print(f"apir: warning: {message}", file=sys.stderr)


def _label(i: int, sentence: str) -> str:
    text = sentence if len(sentence) <= 40 else sentence[:37] + "..."
    return f"sentence [{i}] {text!r}"


# --- progress ----------------------------------------------------------------------------------
class _ProgressBar:
    """A one-line bar on a terminal stream, redrawn only when it moves a column."""

    WIDTH = 30

    def __init__(self, stream, label: str, unit: str, scale: float = 1.0, fmt: str = "{:.0f}"):
        self.stream, self.last = stream, -1
        self.label, self.unit, self.scale, self.fmt = label, unit, scale, fmt

    def __call__(self, done: int, total: int) -> None:
        filled = self.WIDTH * done // max(total, 1)
        if filled == self.last and done != total:
            return
        self.last = filled
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        d, t = self.fmt.format(done / self.scale), self.fmt.format(total / self.scale)
        self.stream.write(f"\r{self.label} [{bar}] {d}/{t} {self.unit}")
        if done == total:
            self.stream.write("\n")
        self.stream.flush()


# --- run ---------------------------------------------------------------------------------------
def _open(args):
    """(OpenedBackend, the --trace CommandTrace or None). Raises UsageError (--trace without
    an embedded host), BackendUnavailable, ValueError."""
    from apir.cli import UsageError, device_from_args, embedded_trace
    from apir.devices import device_kind
    from apir.host.config import CONFIG_KEY_N_THREADS, N_THREADS_FREE
    from apir.models.backends import open_backend, open_local_cpu

    if args.local_cpu:
        if args.trace:
            raise UsageError("--trace records an APIR host's commands; --local-cpu runs none")
        return open_local_cpu(args.threads), None
    spec, config = device_from_args(args)
    if device_kind(spec) == "embedded":
        # without --threads, each graph on the cores other processes leave free at its start:
        # MiniLM's embeddings do not depend on the count (bit-identical on 1, 2 and 3 threads)
        config = {**(config or {}), CONFIG_KEY_N_THREADS: str(args.threads or N_THREADS_FREE)}
    trace, device_options = embedded_trace(args, spec)
    if args.socket:
        from apir.socket_path import check_connect

        check_connect(args.socket)
    try:
        return open_backend(spec, config=config, n_threads=args.threads, device_options=device_options), trace
    except BaseException:
        if trace:
            trace.close()
        raise


# Sentences are embedded in windows of this many batches, in input order (within one, sorted
# by length: less padding), so that a prefix of the input is done after each window: jsonl
# streams it, and Ctrl-C keeps it.
WINDOW_BATCHES = 4


def _embed(model, sentences: List[str], batch_size: int, progress, stop=None, on_rows=None) -> np.ndarray:
    """`model.embed`, batch by batch, so that `progress(done, total)` can follow it; window by
    window (WINDOW_BATCHES), `on_rows(start, end)` told of each finished one, and none begun
    once `stop()` is true. Returns the embeddings of the sentences done (a prefix)."""
    from apir.models.assets import TokenBatch

    tokens = model.tokenize(sentences)
    out = np.empty((len(sentences), model.config.hidden_size), np.float32)
    done = end = 0
    window = batch_size * WINDOW_BATCHES
    for start in range(0, len(sentences), window):
        if stop is not None and stop():
            break
        end = min(len(sentences), start + window)
        part = TokenBatch(tokens.ids[start:end], tokens.type_ids[start:end], tokens.mask[start:end])
        for idx, batch in model.batches(part, batch_size):
            out[start + idx] = model.embed_tokens(batch)
            done += len(idx)
            if progress:
                progress(done, len(sentences))
        if on_rows:
            on_rows(start, end, out)
    return out[:end]


class _Interrupt:
    """While entered, Ctrl-C (SIGINT) only asks the embedding to stop after the window in
    progress: a KeyboardInterrupt inside ggml's compute (a callback of the APIR backend) would
    fail the graph and lose every result. A second Ctrl-C interrupts at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None  # the SIGINT handler before, while entered

    def _on_sigint(self, signum, frame) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, self._previous)

    def __enter__(self) -> "_Interrupt":
        previous = signal.getsignal(signal.SIGINT)
        # (not where SIGINT is ignored, as for a background job, nor off the main thread)
        if previous is not signal.SIG_IGN and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _jsonl_rows(out, start: int, end: int, sentences, emb, n_tokens, truncated) -> None:
    for i in range(start, end):
        row = {"index": i, "sentence": sentences[i], "n_tokens": n_tokens[i], "truncated": truncated[i]}
        row["embedding"] = [float(v) for v in emb[i]]
        json.dump(row, out)
        out.write("\n")
    out.flush()


def run(args: argparse.Namespace, assets=None) -> int:
    """Runs `apir embed` for parsed `args`; `assets` (already read model files) skips re-reading.
    Returns the exit status (0, 1 runtime error, 2 bad usage), the reason on stderr."""
    try:
        return _run(args, assets)
    except _Usage as exc:
        print(f"apir: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _check_usage(args: argparse.Namespace, sentences: List[str]) -> str:
    if args.json and args.format not in (None, "json"):
        raise _Usage(f"--json and --format {args.format} contradict each other: give one")
    fmt = "json" if args.json else args.format or "table"
    if not sentences:
        read = ["stdin" if name == "-" else name for name in args.file + [a for a in args.sentences if a == "-"]]
        if read:
            raise _Usage(f"nothing to embed: {', '.join(dict.fromkeys(read))} had no line that is not blank")
        raise _Usage("nothing to embed: give sentences as arguments, - for stdin, or -f FILE")
    if args.batch_size < 1:
        raise _Usage(f"--batch-size {args.batch_size}: must be at least 1")
    if args.threads is not None and args.threads < 1:
        raise _Usage(f"--threads {args.threads}: must be at least 1")
    if args.show < 0:
        raise _Usage(f"--show {args.show}: must be at least 0")
    if fmt == "npy" and not args.output and sys.stdout.isatty():
        raise _Usage("--format npy writes binary: give -o FILE.npy or redirect stdout")
    return fmt


def _check_output(args: argparse.Namespace) -> None:
    """-o before any work: an OSError naming the path where it could not be written; a _Usage
    where it names an -f input (it would be overwritten)."""
    path = args.output
    if not path:
        return
    for name in args.file:
        if name != "-" and os.path.exists(name) and os.path.exists(path) and os.path.samefile(name, path):
            raise _Usage(f"-o {path} is the input file -f {name}; give another output file")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise OSError(errno.ENOENT, f"its folder {folder} {what}", path)
    if os.path.isdir(path):
        raise OSError(errno.EISDIR, "is a folder", path)
    target = path if os.path.exists(path) else folder
    if not os.access(target, os.W_OK):
        read_only = os.statvfs(target).f_flag & os.ST_RDONLY
        which = "its folder is" if target == folder else "is"
        why = "on a read-only file system" if read_only else f"{which} not writable"
        raise OSError(errno.EACCES, f"cannot write there ({why})", path)


def _run(args: argparse.Namespace, assets) -> int:
    try:
        _check_output(args)
    except OSError as exc:
        print(f"apir: error: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return EXIT_ERROR
    try:
        sentences = read_sentences(args.sentences, args.file, sys.stdin, args.skip_bad_lines, _warn)
    except OSError as exc:
        print(f"apir: error: {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_ERROR
    except InputError as exc:
        print(f"apir: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    fmt = _check_usage(args, sentences)
    for i, sentence in enumerate(sentences):
        if not sentence.strip():
            _warn(f"{_label(i, sentence)} is empty: its embedding is that of [CLS] [SEP] alone")
    with _Interrupt() as interrupt:  # from here on, Ctrl-C keeps what is done
        return _compute(args, fmt, sentences, assets, interrupt)


def _compute(args: argparse.Namespace, fmt: str, sentences: List[str], assets, interrupt: "_Interrupt") -> int:
    from apir.cli import UsageError
    from apir.models.assets import ModelNotInstalled, load_assets
    from apir.models.backends import BackendUnavailable
    from apir.models.minilm import MiniLM, MiniLMError

    try:
        assets = assets or load_assets()
        opened, trace = _open(args)
    except UsageError as exc:
        raise _Usage(str(exc)) from None
    except (ModelNotInstalled, BackendUnavailable, ValueError) as exc:
        print(f"apir: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    max_tokens = assets.tokenizer.max_length
    for i, cut in enumerate(assets.tokenizer.truncated(sentences)):
        if cut:
            _warn(
                f"{_label(i, sentences[i])} has more than {max_tokens} tokens; only its first {max_tokens} are embedded"
            )
    tty = not args.no_progress and sys.stderr.isatty()
    upload_bar = _ProgressBar(sys.stderr, "upload weights", "MB", 1e6, "{:.1f}") if tty else None
    n_batches = -(-len(sentences) // args.batch_size)
    embed_bar = _ProgressBar(sys.stderr, "embed", "sentences") if tty and n_batches > 1 else None
    n_tokens = assets.tokenizer.encode(sentences).lengths.tolist()
    truncated = assets.tokenizer.truncated(sentences)
    # jsonl is written as it is computed (what Ctrl-C leaves is kept); the others at the end
    stream = (open(args.output, "w", encoding="utf-8") if args.output else sys.stdout) if fmt == "jsonl" else None

    def on_rows(start: int, end: int, emb: np.ndarray) -> None:
        if stream is not None:
            _jsonl_rows(stream, start, end, sentences, emb, n_tokens, truncated)

    try:
        t0 = time.perf_counter()
        with MiniLM(backend=opened.backend, buft=opened.buft, assets=assets, progress=upload_bar) as model:
            t1 = time.perf_counter()
            emb = _embed(model, sentences, args.batch_size, embed_bar, lambda: interrupt.requested, on_rows)
            t2 = time.perf_counter()
            upload = (model.upload_bytes, model.upload_seconds)
    except (MiniLMError, ValueError) as exc:
        print(f"apir: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        opened.close()
        if trace:
            trace.close()
        if stream is not None and stream is not sys.stdout:
            stream.close()
    total, done = len(sentences), len(emb)
    sentences, n_tokens, truncated = sentences[:done], n_tokens[:done], truncated[:done]
    show_sim = args.similarity if args.similarity is not None else done <= SIMILARITY_AUTO_MAX
    cosine = emb @ emb.T if show_sim else None
    try:
        if fmt != "jsonl" and done:
            _write(args, fmt, sentences, emb, cosine, n_tokens, truncated, opened, assets, upload, (t1 - t0, t2 - t1))
    except BrokenPipeError:
        raise  # stdout's reader went away (`apir embed ... | head`): apir.cli.main ends quietly
    except OSError as exc:
        print(f"apir: error: {exc.filename or args.output}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_ERROR
    if done < total:
        kept = f"the first {done} of {total} sentences embedded, written to {args.output or 'stdout'}"
        print(f"apir: interrupted: {kept if done else 'before any sentence was embedded'}", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def _write(args, fmt, sentences, emb, cosine, n_tokens, truncated, opened, assets, upload, times) -> None:
    if fmt == "npy":
        if args.output:
            with open(args.output, "wb") as fh:  # the name as given (np.save(name) would add .npy)
                np.save(fh, emb)
        else:
            # np.save straight to a pipe whose reader went away raises a bare OSError ("n
            # requested and 0 written"), not BrokenPipeError; and a large write there may
            # return short, with the error only on the next write: written until all is
            buf = io.BytesIO()
            np.save(buf, emb)
            rest = buf.getbuffer()
            while len(rest):
                rest = rest[sys.stdout.buffer.write(rest) :]
            sys.stdout.buffer.flush()
        return
    out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    try:
        if fmt == "json":
            doc = {
                "model": "sentence-transformers/all-MiniLM-L6-v2",
                "model_path": str(assets.path),
                "backend": {
                    "transport": opened.transport,
                    "through_apir": opened.through_apir,
                    "fallback": opened.fallback,
                    "description": opened.description,
                },
                "sentences": list(sentences),
                "n_tokens": n_tokens,
                "truncated": truncated,
                "dim": int(emb.shape[1]),
                # float32 -> Python float is exact, so these round-trip bit for bit.
                "embeddings": [[float(v) for v in row] for row in emb],
                "timing_s": {"load_and_upload": times[0], "upload": upload[1], "embed": times[1]},
                "upload_bytes": upload[0],
            }
            if cosine is not None:
                doc["cosine"] = [[float(v) for v in row] for row in cosine]
            json.dump(doc, out)
            out.write("\n")
        else:
            _print_table(out, args, opened, sentences, emb, cosine, n_tokens, upload, times[1])
    finally:
        if out is not sys.stdout:
            out.close()


def _print_table(out, args, opened, sentences, emb, cosine, n_tokens, upload, embed_s) -> None:
    out.write(f"backend: {opened.description}\n")
    nbytes, secs = upload
    rate = f", {nbytes / secs / 1e6:.0f} MB/s" if secs > 0 else ""
    out.write(
        f"weights: {nbytes / 1e6:.1f} MB uploaded in {secs:.3f} s{rate}; "
        f"{len(emb)} sentence(s) embedded in {embed_s:.3f} s\n\n"
    )
    shown = max(0, min(args.show, emb.shape[1]))
    out.write(f"embeddings ({emb.shape[1]} values each, first {shown} shown):\n")
    label = len(f"[{len(emb) - 1}]")  # (the widest index label: the columns stay aligned past [9])
    for i, (row, sentence) in enumerate(zip(emb, sentences)):
        values = " ".join(f"{v:+.4f}" for v in row[:shown])
        text = sentence if len(sentence) <= 50 else sentence[:47] + "..."
        out.write(f"  {f'[{i}]':<{label}} {values}  ({n_tokens[i]} tokens) {text!r}\n")
    if cosine is None:
        if args.similarity is False:
            out.write("\ncosine similarity: not shown (--no-similarity)\n")
        else:
            out.write(
                f"\ncosine similarity: not shown for {len(emb)} sentences, more than {SIMILARITY_AUTO_MAX} "
                "(--similarity shows it)\n"
            )
        return
    out.write("\ncosine similarity:\n")
    label = max(label + 1, 4)
    out.write("  " + " " * label + "".join(f"{f'[{j}]':>7}" for j in range(len(emb))) + "\n")
    for i, row in enumerate(cosine):
        out.write(f"  {f'[{i}]':<{label}}" + "".join(f"{v:7.3f}" for v in row) + "\n")


def main(argv: Optional[List[str]] = None) -> int:
    """`python -m apir.models.cli_embed SENTENCE ...` (the same options as `apir embed`)."""
    p = argparse.ArgumentParser(prog="apir embed")
    _configure(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
