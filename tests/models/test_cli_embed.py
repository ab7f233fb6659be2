"""apir.models.cli_embed: `apir embed` text and JSON output."""

import argparse
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


def test_explicit_socket_without_backend_is_an_error(capsys, minilm):
    # An explicit transport never falls back to local CPU: no host at that path -> exit 2.
    assert cli_embed.run(_args("--socket", "/nonexistent/apir.sock", "hi"), assets=minilm.assets) == 2
    assert "apir embed:" in capsys.readouterr().err


def test_socket_and_drm_exclusive():
    with pytest.raises(SystemExit):
        _args("--socket", "/a", "--drm", "/b", "hi")
