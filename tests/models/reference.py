"""An independent numpy all-MiniLM-L6-v2, the oracle for apir.models' ggml graph.

Written from the published architecture (BERT, Devlin et al. 2018; the Hugging Face
`BertModel` layer names; sentence-transformers' mean pooling and Normalize modules), not from
apir.models.bert_graph: numpy's (tokens, features) row-major layout, float64 throughout, one
sentence at a time with no padding, so no attention mask is involved at all.

    x = LayerNorm(word[ids] + position[0..T-1] + token_type[type_ids])
    per layer (post-LN):
        q, k, v = x Wq^T + bq, ...; split into heads of d = hidden / heads
        a = concat_h softmax(q_h k_h^T / sqrt(d)) v_h
        x = LayerNorm(x + a Wo^T + bo)
        x = LayerNorm(x + gelu(x Wi^T + bi) Wo2^T + bo2)      gelu(z) = z/2 (1 + erf(z / sqrt 2))
    e = mean over tokens of x;  e / max(||e||, 1e-12)
"""

from __future__ import annotations

import math

import numpy as np

_erf = np.frompyfunc(math.erf, 1, 1)


def gelu(z: np.ndarray) -> np.ndarray:
    return 0.5 * z * (1.0 + _erf(z / math.sqrt(2.0)).astype(np.float64))


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)  # biased, as torch.nn.LayerNorm
    return (x - mu) / np.sqrt(var + eps) * weight + bias


def softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def encode(weights: dict, config, ids, type_ids=None) -> np.ndarray:
    """Token states (T, hidden) float64 of one unpadded sentence given its token ids."""
    W = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    ids = np.asarray(ids)
    T = len(ids)
    type_ids = np.zeros(T, int) if type_ids is None else np.asarray(type_ids)
    n_heads = config.num_attention_heads
    d = config.hidden_size // n_heads
    eps = config.layer_norm_eps

    def lin(x, name):
        return x @ W[name + ".weight"].T + W[name + ".bias"]

    def ln(x, name):
        return layer_norm(x, W[name + ".weight"], W[name + ".bias"], eps)

    x = (W["embeddings.word_embeddings.weight"][ids] + W["embeddings.position_embeddings.weight"][:T]
         + W["embeddings.token_type_embeddings.weight"][type_ids])
    x = ln(x, "embeddings.LayerNorm")
    for i in range(config.num_hidden_layers):
        p = f"encoder.layer.{i}."

        def heads(z):  # (T, hidden) -> (heads, T, d)
            return z.reshape(T, n_heads, d).transpose(1, 0, 2)

        q = heads(lin(x, p + "attention.self.query"))
        k = heads(lin(x, p + "attention.self.key"))
        v = heads(lin(x, p + "attention.self.value"))
        a = softmax(q @ k.transpose(0, 2, 1) / math.sqrt(d)) @ v  # (heads, T, d)
        a = a.transpose(1, 0, 2).reshape(T, n_heads * d)
        x = ln(x + lin(a, p + "attention.output.dense"), p + "attention.output.LayerNorm")
        h = gelu(lin(x, p + "intermediate.dense"))
        x = ln(x + lin(h, p + "output.dense"), p + "output.LayerNorm")
    return x


def sentence_embedding(weights: dict, config, ids, type_ids=None) -> np.ndarray:
    """The normalized mean-pooled embedding (hidden,) float64 of one unpadded sentence."""
    e = encode(weights, config, ids, type_ids).mean(axis=0)
    return e / max(np.linalg.norm(e), 1e-12)


def tiny_weights(rng, hidden, inter, layers, vocab, positions):
    """Random BERT weights (normal, sigma 0.5) of the given sizes, by their HuggingFace names:
    a second, small BERT for the graph tests."""
    shapes = {"embeddings.word_embeddings.weight": (vocab, hidden),
              "embeddings.position_embeddings.weight": (positions, hidden),
              "embeddings.token_type_embeddings.weight": (2, hidden),
              "embeddings.LayerNorm.weight": (hidden,), "embeddings.LayerNorm.bias": (hidden,)}
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            shapes[p + name + ".weight"] = (hidden, hidden)
            shapes[p + name + ".bias"] = (hidden,)
        shapes.update({p + "intermediate.dense.weight": (inter, hidden), p + "intermediate.dense.bias": (inter,),
                       p + "output.dense.weight": (hidden, inter), p + "output.dense.bias": (hidden,)})
        for name in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes[p + name + ".weight"] = (hidden,)
            shapes[p + name + ".bias"] = (hidden,)
    return {k: rng.normal(0, 0.5, s).astype(np.float32) for k, s in shapes.items()}
