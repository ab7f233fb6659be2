"""apir.models.bert_graph: the graph's structure, and its numbers on a second, random BERT."""

import collections
import dataclasses

import numpy as np
import pytest

from apir.ggml import InitParams
from apir.models.assets import Assets, TokenBatch
from apir.models.bert_graph import GRAPH_SIZE, build_graph, weight_ne
from tests.models import reference
from tests.models.reference import tiny_weights


def test_small_random_bert_matches_reference(assets):
    # Another shape through the same graph: 2 layers, hidden 64, 4 heads of 16, random weights,
    # token types 0 and 1, a batch padded from 1 to 40 tokens.
    from apir.models.minilm import MiniLM

    cfg = dataclasses.replace(assets.config, hidden_size=64, num_attention_heads=4, intermediate_size=96,
                              num_hidden_layers=2, vocab_size=50, max_position_embeddings=40)
    rng = np.random.default_rng(6)
    w = tiny_weights(rng, 64, 96, 2, 50, 40)
    lengths = [40, 7, 1, 23]
    ids, type_ids, mask = (np.zeros((4, 40), np.int32) for _ in range(3))
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(1, 50, n)
        type_ids[i, :n] = rng.integers(0, 2, n)
        mask[i, :n] = 1
    with MiniLM(assets=Assets(assets.path, cfg, assets.pooling, w, assets.tokenizer)) as model:
        got = model.embed_tokens(TokenBatch(ids, type_ids, mask))
    w64 = {k: v.astype(np.float64) for k, v in w.items()}
    for i, n in enumerate(lengths):
        ref = reference.sentence_embedding(w64, cfg, ids[i, :n], type_ids[i, :n])
        np.testing.assert_allclose(got[i], ref, atol=1e-4, err_msg=f"sentence {i}, {n} tokens")


@pytest.fixture
def graph_ctx(ggml):
    ctx = ggml.ggml_init(InitParams(ggml.ggml_tensor_overhead() * (GRAPH_SIZE + 200)
                                    + ggml.ggml_graph_overhead_custom(GRAPH_SIZE, False), None, True))
    yield ctx
    ggml.ggml_free(ctx)


def _weight_tensors(ggml, ctx, assets):
    import ctypes

    out = {}
    for name, arr in assets.weights.items():
        ne = weight_ne(arr.shape)
        out[name] = ggml.ggml_new_tensor(ctx, ggml.types["F32"], len(ne), (ctypes.c_int64 * len(ne))(*ne))
    return out


def test_graph_ops(ggml, graph_ctx, assets):
    w = _weight_tensors(ggml, graph_ctx, assets)
    bg = build_graph(ggml, graph_ctx, w, assets.config, 3, 17)
    n = ggml.ggml_graph_n_nodes(bg.graph)
    ops = collections.Counter(ggml.ggml_op_desc(ggml.ggml_graph_node(bg.graph, i)).decode() for i in range(n))
    layers = assets.config.num_hidden_layers
    assert ops["GELU_ERF"] == layers and ops["GELU"] == 0  # exact GELU, not the tanh approximation
    assert ops["SOFT_MAX"] == layers and ops["NORM"] == 2 * layers + 1
    # per layer 6 linear maps + QK^T + (softmax)V; one more for pooling
    assert ops["MUL_MAT"] == 8 * layers + 1 and ops["L2_NORM"] == 1 and ops["GET_ROWS"] == 3
    assert ggml.ggml_graph_node(bg.graph, -1) == bg.output
    assert ggml.ggml_get_name(bg.output) == b"sentence_embedding"
    assert ggml.ggml_nelements(bg.output) == 3 * assets.config.hidden_size


@pytest.mark.parametrize("n_seq,n_tokens", [(1, 0), (0, 5), (1, 513)])
def test_bad_sizes_rejected(ggml, graph_ctx, assets, n_seq, n_tokens):
    w = _weight_tensors(ggml, graph_ctx, assets)
    with pytest.raises(ValueError):
        build_graph(ggml, graph_ctx, w, assets.config, n_seq, n_tokens)


def test_weight_ne_reverses_shape():
    assert weight_ne((1536, 384)) == (384, 1536) and weight_ne((384,)) == (384,)
