"""apir.models.cli_embed: `apir embed` text and JSON output."""

import argparse
import io
import json

import numpy as np
import pytest

from apir.models import cli_embed

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby."]


def _args(*argv):
    parser = argparse.ArgumentParser(prog="apir")
    cli_embed.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["embed", *argv])


def test_json_has_everything(capsys, minilm):
    args = _args("--json", "--local-cpu", *SENTENCES)
    assert args.run is cli_embed.run
    assert cli_embed.run(args, assets=minilm.assets) == 0
    doc = json.loads(capsys.readouterr().out)
    emb = np.array(doc["embeddings"], np.float64)
    assert emb.shape == (3, 384) and doc["dim"] == 384 and doc["sentences"] == SENTENCES
    # float32 values round-trip exactly through the JSON floats.
    assert np.array_equal(emb.astype(np.float32), minilm.embed(SENTENCES))
    np.testing.assert_allclose(doc["cosine"], emb @ emb.T, atol=1e-6)
    assert doc["n_tokens"] == [8, 11, 9]
    assert doc["backend"]["transport"] == "local-cpu" and doc["backend"]["through_apir"] is False
    assert doc["upload_bytes"] == minilm.assets.n_weight_bytes


def test_a_closed_stdout_is_left_to_main(capsys, minilm, monkeypatch):
    """`apir embed ... | head`: the BrokenPipeError reaches apir.cli.main, which ends quietly
    (exit 141), instead of an "apir: error: None: Broken pipe" line."""

    class ClosedPipe(io.StringIO):
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("sys.stdout", ClosedPipe())
    with pytest.raises(BrokenPipeError):
        cli_embed.run(_args("--format", "jsonl", "--local-cpu", *SENTENCES), assets=minilm.assets)
    assert "error" not in capsys.readouterr().err


def test_npy_into_a_closed_pipe_ends_quietly(minilm, tmp_path):
    """`apir embed --format npy ... | head -c 20`: exit 141 and nothing on stderr, as for the
    text formats (np.save into the pipe raised a bare OSError, "n requested and 0 written",
    and a large write could return short with the error lost). 600 sentences: 900 KB, more
    than a pipe holds."""
    import subprocess
    import sys

    listing = tmp_path / "s.txt"
    listing.write_text("".join(f"sentence {i}\n" for i in range(600)))
    cmd = [sys.executable, "-m", "apir", "embed", "--local-cpu", "--no-progress", "--format", "npy", "-f", str(listing)]
    run = subprocess.run(
        f"{' '.join(cmd)} | head -c 20 >/dev/null; exit ${{PIPESTATUS[0]}}",
        shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=300,
    )
    assert (run.returncode, run.stderr) == (141, ""), run.stderr


def test_text_output(capsys, minilm):
    assert cli_embed.run(_args("--local-cpu", "--show", "3", *SENTENCES), assets=minilm.assets) == 0
    out = capsys.readouterr().out
    emb = minilm.embed(SENTENCES)
    assert "not through APIR" in out
    first = " ".join(f"{v:+.4f}" for v in emb[0, :3])
    assert f"[0] {first}  (8 tokens)" in out
    cos = emb @ emb.T
    row1 = [line for line in out.splitlines() if line.startswith("  [1] ") and "tokens" not in line][0]
    np.testing.assert_allclose([float(x) for x in row1.split()[1:]], cos[1], atol=6e-4)


def test_text_columns_stay_aligned_past_ten_sentences(capsys, minilm):
    sentences = [f"sentence {i}" for i in range(12)]
    assert cli_embed.run(_args("--local-cpu", "--show", "2", "--similarity", *sentences), assets=minilm.assets) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if "tokens)" in line]
    assert len(rows) == 12 and len({row.index(" (") for row in rows}) == 1  # values end in one column
    header = next(i for i, line in enumerate(lines) if line.startswith("cosine similarity"))
    table = lines[header + 1 : header + 14]
    assert len({len(line) for line in table}) == 1  # the header and every row, [0] to [11]


def test_explicit_socket_without_backend_is_an_error(capsys, minilm):
    # An explicit transport never falls back to local CPU: no host at that path -> a runtime
    # error (exit 1, apir.cli's convention), the path named.
    assert cli_embed.run(_args("--socket", "/nonexistent/apir.sock", "hi"), assets=minilm.assets) == 1
    err = capsys.readouterr().err
    assert err.startswith("apir: error: /nonexistent/apir.sock: no such socket")


def test_socket_and_drm_exclusive():
    with pytest.raises(SystemExit):
        _args("--socket", "/a", "--drm", "/b", "hi")


def test_sentences_from_arguments_stdin_and_files(tmp_path):
    f = tmp_path / "s.txt"
    f.write_text("first line\n\n   \nsecond line\r\n")
    stdin = io.StringIO("from stdin\n\nagain\n")
    got = cli_embed.read_sentences(["arg one", "-", "", "-"], [str(f), "-"], stdin)
    # Arguments as given (the empty one too), stdin once, files' blank lines skipped.
    assert got == ["arg one", "from stdin", "again", "", "first line", "second line"]
    with pytest.raises(FileNotFoundError) as exc:
        cli_embed.read_sentences([], [str(tmp_path / "missing.txt")], io.StringIO())
    assert exc.value.filename == str(tmp_path / "missing.txt")


def test_file_and_stdin_input_embed_the_lines(capsys, monkeypatch, tmp_path, minilm):
    f = tmp_path / "s.txt"
    f.write_text(SENTENCES[0] + "\n\n" + SENTENCES[1] + "\n")
    monkeypatch.setattr("sys.stdin", io.StringIO(SENTENCES[2] + "\n"))
    assert cli_embed.run(_args("--local-cpu", "--format", "jsonl", "-f", str(f), "-f", "-"),
                         assets=minilm.assets) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["sentence"] for r in rows] == SENTENCES and [r["index"] for r in rows] == [0, 1, 2]
    assert np.array_equal(np.array([r["embedding"] for r in rows], np.float32), minilm.embed(SENTENCES))
    assert [r["n_tokens"] for r in rows] == [8, 11, 9] and not any(r["truncated"] for r in rows)


def test_npy_output(capsys, tmp_path, minilm):
    out = tmp_path / "emb"  # no .npy suffix: written under the name given
    assert cli_embed.run(_args("--local-cpu", "--format", "npy", "-o", str(out), *SENTENCES),
                         assets=minilm.assets) == 0
    emb = np.load(out)
    assert emb.dtype == np.float32 and np.array_equal(emb, minilm.embed(SENTENCES))
    assert capsys.readouterr().out == ""


def test_warns_on_truncation_and_empty_sentences(capsys, minilm):
    long = "word " * 300  # 300 tokens + [CLS] [SEP]: more than 256
    assert cli_embed.run(_args("--local-cpu", "--json", "short", "", long), assets=minilm.assets) == 0
    captured = capsys.readouterr()
    warnings = captured.err.strip().splitlines()
    assert len(warnings) == 2, captured.err
    assert warnings[0].startswith("apir: warning: sentence [1] '' is empty")
    assert warnings[1].startswith("apir: warning: sentence [2] 'word word") and "more than 256 tokens" in warnings[1]
    doc = json.loads(captured.out)
    assert doc["truncated"] == [False, False, True] and doc["n_tokens"][2] == 256


def test_similarity_only_when_small_or_asked(capsys, minilm):
    many = [f"sentence number {i}" for i in range(cli_embed.SIMILARITY_AUTO_MAX + 1)]
    assert cli_embed.run(_args("--local-cpu", *many), assets=minilm.assets) == 0
    out = capsys.readouterr().out
    limit = cli_embed.SIMILARITY_AUTO_MAX
    assert f"cosine similarity: not shown for {len(many)} sentences, more than {limit} (--similarity" in out
    assert cli_embed.run(_args("--local-cpu", "--json", *many), assets=minilm.assets) == 0
    assert "cosine" not in json.loads(capsys.readouterr().out)
    assert cli_embed.run(_args("--local-cpu", "--json", "--similarity", *many), assets=minilm.assets) == 0
    cosine = np.array(json.loads(capsys.readouterr().out)["cosine"])
    assert cosine.shape == (len(many), len(many))
    assert cli_embed.run(_args("--local-cpu", "--no-similarity", *SENTENCES), assets=minilm.assets) == 0
    # (the flag, not the sentence count, is why: SENTENCES are few enough to show it)
    assert "cosine similarity: not shown (--no-similarity)" in capsys.readouterr().out


def test_usage_errors_exit_2(capsys, minilm, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("\n\n"))
    assert cli_embed.run(_args("--local-cpu", "-"), assets=minilm.assets) == 2  # stdin had only blank lines
    assert capsys.readouterr().err.startswith("apir: error: nothing to embed")
    assert cli_embed.run(_args("--local-cpu", "--batch-size", "0", "x"), assets=minilm.assets) == 2
    assert "--batch-size 0" in capsys.readouterr().err
    for option, value in (("--threads", "-1"), ("--threads", "0"), ("--show", "-2")):
        assert cli_embed.run(_args("--local-cpu", option, value, "x"), assets=minilm.assets) == 2
        assert capsys.readouterr().err.startswith(f"apir: error: {option} {value}: must be at least")
    with pytest.raises(SystemExit) as exc:
        _args("--socket", "", "x")
    assert exc.value.code == 2


def test_batch_progress_follows_each_batch(minilm):
    calls = []
    sentences = [f"sentence {i}" for i in range(5)]
    emb = cli_embed._embed(minilm, sentences, 2, lambda done, total: calls.append((done, total)))
    assert calls == [(2, 5), (4, 5), (5, 5)]
    assert np.array_equal(emb, minilm.embed(sentences, batch_size=2))


def test_progress_bar_draws_on_its_stream():
    stream = io.StringIO()
    bar = cli_embed._ProgressBar(stream, "embed", "sentences")
    bar(0, 4)
    bar(4, 4)
    assert stream.getvalue() == ("\rembed [" + "-" * 30 + "] 0/4 sentences"
                                 "\rembed [" + "#" * 30 + "] 4/4 sentences\n")


@pytest.mark.parametrize("argv,threads", [((), "free"), (("--threads", "3"), "3")])
def test_the_embedded_host_computes_on_the_free_cores_or_threads(capsys, minilm, monkeypatch, argv, threads):
    """The embedded host gets apir.host.n_threads: --threads, else "free" (each graph on the
    cores other processes leave free, one here); the embeddings are the same bytes."""
    from apir.host.backend import library as backend_library
    from apir.models import backends

    configs = []
    real_open = backends.open_backend

    def open_backend(spec, config=None, **kw):
        configs.append(config)
        return real_open(spec, config=config, **kw)

    monkeypatch.setattr(backend_library, "free_cores", lambda: 1)
    monkeypatch.setattr(backends, "open_backend", open_backend)
    assert cli_embed.run(_args("--json", *argv, *SENTENCES), assets=minilm.assets) == 0
    doc = json.loads(capsys.readouterr().out)
    assert configs == [{"apir.host.n_threads": threads}]
    assert doc["backend"]["transport"] == "embedded" and doc["backend"]["through_apir"] is True
    assert np.array_equal(np.array(doc["embeddings"], np.float32), minilm.embed(SENTENCES))


def test_output_is_checked_before_any_work(capsys, minilm, monkeypatch, tmp_path):
    """-o that cannot be written fails at once, naming the path (it used to fail after the
    compute); -o naming an -f input is refused instead of overwriting it."""
    monkeypatch.setattr(cli_embed, "_open", lambda args: pytest.fail("a backend was opened"))
    missing = tmp_path / "no" / "out.jsonl"
    assert cli_embed.run(_args("--local-cpu", "-o", str(missing), "x"), assets=minilm.assets) == 1
    assert capsys.readouterr().err == f"apir: error: {missing}: its folder {missing.parent} does not exist\n"
    assert cli_embed.run(_args("--local-cpu", "-o", str(tmp_path), "x"), assets=minilm.assets) == 1
    assert capsys.readouterr().err == f"apir: error: {tmp_path}: is a folder\n"
    listing = tmp_path / "s.txt"
    listing.write_text("one\ntwo\n")
    same = tmp_path / "." / "s.txt"
    assert cli_embed.run(_args("--local-cpu", "-f", str(listing), "-o", str(same)), assets=minilm.assets) == 2
    assert capsys.readouterr().err == f"apir: error: -o {same} is the input file -f {listing}; give another output file\n"
    assert listing.read_text() == "one\ntwo\n"
    read_only = tmp_path / "ro"
    read_only.mkdir()
    real_access = cli_embed.os.access
    monkeypatch.setattr(cli_embed.os, "access", lambda p, mode: p != str(read_only) and real_access(p, mode))
    out = read_only / "out.npy"
    assert cli_embed.run(_args("--local-cpu", "--format", "npy", "-o", str(out), "x"), assets=minilm.assets) == 1
    assert capsys.readouterr().err == f"apir: error: {out}: cannot write there (its folder is not writable)\n"


def test_input_that_is_not_utf8_names_file_and_line_or_is_skipped(capsys, minilm, monkeypatch, tmp_path):
    """A Latin-1 file or stdin: an error naming the file and line, nothing computed (it was a
    codec error without either, or tokenizers' "TextEncodeInput must be Union[...]" from
    stdin); --skip-bad-lines leaves the line out with a warning and embeds the rest."""
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(b"A man is eating food.\ncaf\xe9\nThe sky is blue today.\n")
    opened = []
    real_open = cli_embed._open
    monkeypatch.setattr(cli_embed, "_open", lambda args: opened.append(1) or real_open(args))
    assert cli_embed.run(_args("--local-cpu", "-f", str(latin1)), assets=minilm.assets) == 1
    assert capsys.readouterr().err == (
        f"apir: error: {latin1} line 2: not UTF-8 (its byte 4 is 0xe9); --skip-bad-lines leaves such lines out\n")
    stdin = io.TextIOWrapper(io.BytesIO(b"caf\xe9\n"), encoding="utf-8", errors="surrogateescape")
    monkeypatch.setattr("sys.stdin", stdin)
    assert cli_embed.run(_args("--local-cpu", "-"), assets=minilm.assets) == 1
    assert capsys.readouterr().err.startswith("apir: error: stdin line 1: not UTF-8 (its byte 4 is 0xe9)")
    assert opened == []
    args = _args("--local-cpu", "--skip-bad-lines", "--format", "jsonl", "-f", str(latin1))
    assert cli_embed.run(args, assets=minilm.assets) == 0
    captured = capsys.readouterr()
    assert captured.err == f"apir: warning: {latin1} line 2: not UTF-8 (its byte 4 is 0xe9): skipped\n"
    rows = [json.loads(line) for line in captured.out.splitlines()]
    assert [r["sentence"] for r in rows] == ["A man is eating food.", "The sky is blue today."]


def test_json_and_another_format_contradict(capsys, minilm):
    assert cli_embed.run(_args("--local-cpu", "--json", "--format", "jsonl", "x"), assets=minilm.assets) == 2
    assert capsys.readouterr().err == "apir: error: --json and --format jsonl contradict each other: give one\n"
    assert cli_embed.run(_args("--local-cpu", "--json", "--format", "json", "x"), assets=minilm.assets) == 0
    assert json.loads(capsys.readouterr().out)["sentences"] == ["x"]


def test_an_empty_input_file_is_named(capsys, minilm, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    assert cli_embed.run(_args("--local-cpu", "-f", str(empty)), assets=minilm.assets) == 2
    assert capsys.readouterr().err == f"apir: error: nothing to embed: {empty} had no line that is not blank\n"


def test_ctrl_c_exits_130_and_keeps_the_streamed_jsonl(minilm, tmp_path):
    """SIGINT once the first rows are out: exit 130, every row written so far complete and in
    order, one line on stderr saying how many; no KeyboardInterrupt nor a failed graph_compute
    (it used to exit 1 with both, and leave no file)."""
    import signal
    import subprocess
    import sys
    import time

    sentences = [f"sentence number {i} about many things" for i in range(3000)]
    listing = tmp_path / "s.txt"
    listing.write_text("".join(s + "\n" for s in sentences))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "apir", "embed", "--no-progress", "--batch-size", "8", "--format", "jsonl",
           "-f", str(listing), "-o", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while proc.poll() is None and not (out.exists() and b"\n" in out.read_bytes()):
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert 0 < len(rows) < len(sentences)
    assert proc.returncode == 130, err
    assert err == f"apir: interrupted: the first {len(rows)} of {len(sentences)} sentences embedded, written to {out}\n"
    assert [r["index"] for r in rows] == list(range(len(rows)))
    assert [r["sentence"] for r in rows] == sentences[: len(rows)]
    np.testing.assert_allclose(rows[-1]["embedding"], minilm.embed([sentences[len(rows) - 1]])[0], atol=1e-5)


def test_ctrl_c_keeps_the_windows_done_in_every_format(capsys, minilm, monkeypatch, tmp_path):
    """Interrupted after its first window, `--format npy -o` holds that window's embeddings."""
    real_embed = cli_embed._embed

    def interrupted_after_one_window(model, sentences, batch_size, progress, stop, on_rows):
        windows = []
        return real_embed(model, sentences, batch_size, progress, lambda: bool(windows),
                          lambda *window: (windows.append(window), on_rows(*window)))

    monkeypatch.setattr(cli_embed, "_embed", interrupted_after_one_window)
    sentences = [f"sentence {i}" for i in range(20)]
    out = tmp_path / "emb.npy"
    args = _args("--local-cpu", "--batch-size", "2", "--format", "npy", "-o", str(out), *sentences)
    assert cli_embed.run(args, assets=minilm.assets) == 130
    done = 2 * cli_embed.WINDOW_BATCHES
    assert capsys.readouterr().err == f"apir: interrupted: the first {done} of 20 sentences embedded, written to {out}\n"
    assert np.array_equal(np.load(out), minilm.embed(sentences[:done], batch_size=2))
