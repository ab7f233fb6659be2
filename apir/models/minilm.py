"""all-MiniLM-L6-v2 sentence embeddings on any ggml backend.

Theory of operation: `MiniLM(backend, buft)` reads the model files (`apir.models.assets`),
creates one ggml tensor per weight in a no_alloc context, allocates them all in buffers of the
buffer type `buft` (`ggml_backend_alloc_ctx_tensors_from_buft`) and uploads them with
`ggml_backend_tensor_set` in chunks, reporting progress. `embed(sentences)` tokenizes, sorts the
sentences by length and splits them into batches (less padding per batch), and for each batch
builds the graph of `apir.models.bert_graph` for its (sentences, padded length), allocates it
with a `ggml_gallocr` on `buft`, sets the inputs (ids, positions, attention mask, mean-pool
weights), runs `ggml_backend_graph_compute` on `backend` and reads back the pooled, L2-normalized
[384, B] output. Pooling and normalization happen in the graph; numpy only builds the inputs.

The backend is a parameter: ggml's CPU backend (the default, created and owned here), or a
guest backend whose buffers live on an APIR host. Nothing here knows which; a remote-vs-local
comparison is two `MiniLM` objects on two backends and `np.array_equal` of their `embed`.

Errors: ModelNotInstalled (apir.models.assets) when the model package is missing;
MiniLMError when ggml cannot allocate or a compute fails.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Callable, Dict, Iterable, Optional, Sequence

import numpy as np

from apir.errors import ApirError
from apir.ggml import InitParams
from apir.ggml import load as load_ggml
from apir.models.assets import Assets, TokenBatch, load_assets
from apir.models.bert_graph import GRAPH_SIZE, BertGraph, build_graph, weight_ne

__all__ = ["MiniLM", "MiniLMError", "Progress", "embed", "UPLOAD_CHUNK"]

# ggml_backend_tensor_set per chunk so a progress bar moves through the 47 MB word embeddings.
UPLOAD_CHUNK = 4 << 20

Progress = Callable[[int, int], None]  # (bytes uploaded so far, total bytes)


class MiniLMError(ApirError, RuntimeError):
    """ggml refused an allocation, or a graph compute returned a status other than success."""


def _ptr(arr: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(arr.ctypes.data)


class MiniLM:
    """The model's weights resident on one ggml backend, ready to embed sentences.

    backend:   a `ggml_backend_t` (int); None creates ggml's CPU backend (owned and freed here).
    buft:      the `ggml_backend_buffer_type_t` for weights and compute buffers; None means
               `ggml_backend_get_default_buffer_type(backend)`.
    assets:    the model files already read (`load_assets()`); None reads them.
    progress:  called as progress(done_bytes, total_bytes) during the weight upload.
    n_threads: threads of the CPU backend this object creates (default: min(4, cores)).

    Attributes after construction: `upload_bytes`, `upload_seconds` (the tensor_set calls only);
    after each batch, `last_timing` (seconds: build, alloc, set_inputs, compute, get).
    Use as a context manager or call `close()`; the weights' buffer is freed then.
    """

    def __init__(
        self,
        backend: Optional[int] = None,
        buft: Optional[int] = None,
        assets: Optional[Assets] = None,
        progress: Optional[Progress] = None,
        n_threads: Optional[int] = None,
        ggml=None,
    ):
        self.g = g = ggml or load_ggml()
        self.assets = assets or load_assets()
        self.config = self.assets.config
        self._owns_backend = backend is None
        self._wctx = self._wbuf = self._galloc = None
        if backend is None:
            backend = g.ggml_backend_cpu_init()
            if not backend:
                raise MiniLMError("ggml_backend_cpu_init failed")
            g.ggml_backend_cpu_set_n_threads(backend, n_threads or min(4, os.cpu_count() or 1))
        self.backend = backend
        try:
            self.buft = buft or g.ggml_backend_get_default_buffer_type(backend)
            self.weights: Dict[str, int] = {}
            self._alloc_weights()
            self.upload_bytes = self.assets.n_weight_bytes
            self.upload_seconds = self._upload(progress)
            self._galloc = g.ggml_gallocr_new(self.buft)
            if not self._galloc:
                raise MiniLMError("ggml_gallocr_new failed")
        except BaseException:
            self.close()
            raise
        self.last_timing: Dict[str, float] = {}

    # -- weights -------------------------------------------------------------------------------

    def _alloc_weights(self) -> None:
        g = self.g
        arrays = self.assets.weights
        params = InitParams(g.ggml_tensor_overhead() * len(arrays), None, True)
        self._wctx = g.ggml_init(params)
        if not self._wctx:
            raise MiniLMError("ggml_init failed for the weights context")
        f32 = g.types["F32"]
        for name, arr in arrays.items():
            ne = weight_ne(arr.shape)
            t = g.ggml_new_tensor(self._wctx, f32, len(ne), (ctypes.c_int64 * len(ne))(*ne))
            g.ggml_set_name(t, name.encode())
            self.weights[name] = t
        self._wbuf = g.ggml_backend_alloc_ctx_tensors_from_buft(self._wctx, self.buft)
        if not self._wbuf:
            name = g.ggml_backend_buft_name(self.buft).decode()
            raise MiniLMError(f"cannot allocate {self.assets.n_weight_bytes} bytes of weights in {name}")

    def _upload(self, progress: Optional[Progress]) -> float:
        g = self.g
        total, done, spent = self.assets.n_weight_bytes, 0, 0.0
        if progress:
            progress(0, total)
        for name, arr in self.assets.weights.items():
            t, base = self.weights[name], arr.ctypes.data
            for off in range(0, arr.nbytes, UPLOAD_CHUNK):
                size = min(UPLOAD_CHUNK, arr.nbytes - off)
                t0 = time.perf_counter()
                g.ggml_backend_tensor_set(t, ctypes.c_void_p(base + off), off, size)
                spent += time.perf_counter() - t0
                done += size
                if progress:
                    progress(done, total)
        g.ggml_backend_synchronize(self.backend)
        return spent

    # -- one batch -----------------------------------------------------------------------------

    def embed_tokens(self, batch: TokenBatch) -> np.ndarray:
        """Embeddings (n_sentences, hidden) float32 of one padded batch, in one graph compute.
        Raises MiniLMError, ValueError (a batch longer than the position table, an empty row)."""
        g = self.g
        B, T = batch.ids.shape
        if (batch.lengths < 1).any():
            raise ValueError("every sentence of a batch needs at least one unmasked token")
        t0 = time.perf_counter()
        ctx = g.ggml_init(
            InitParams(
                g.ggml_tensor_overhead() * GRAPH_SIZE + g.ggml_graph_overhead_custom(GRAPH_SIZE, False), None, True
            )
        )
        if not ctx:
            raise MiniLMError("ggml_init failed for the graph context")
        try:
            bg = build_graph(g, ctx, self.weights, self.config, B, T)
            t1 = time.perf_counter()
            if not g.ggml_gallocr_alloc_graph(self._galloc, bg.graph):
                raise MiniLMError(f"ggml_gallocr_alloc_graph failed for {B} sentences x {T} tokens")
            t2 = time.perf_counter()
            self._set_inputs(bg, batch)
            t3 = time.perf_counter()
            status = g.ggml_backend_graph_compute(self.backend, bg.graph)
            if status != 0:
                raise MiniLMError(f"ggml_backend_graph_compute returned status {status}")
            t4 = time.perf_counter()
            out = np.empty((B, self.config.hidden_size), np.float32)
            g.ggml_backend_tensor_get(bg.output, _ptr(out), 0, out.nbytes)
            t5 = time.perf_counter()
        finally:
            g.ggml_free(ctx)
        self.last_timing = {
            "build": t1 - t0,
            "alloc": t2 - t1,
            "set_inputs": t3 - t2,
            "compute": t4 - t3,
            "get": t5 - t4,
        }
        return out

    def _set_inputs(self, bg: BertGraph, batch: TokenBatch) -> None:
        g = self.g
        B, T = batch.ids.shape
        mask = batch.mask.astype(bool)
        # Each sentence's key mask, repeated for every query row: numpy (B, 1, T_query, T_key).
        kq_mask = np.where(mask[:, None, None, :], np.float32(0), np.float32(-np.inf))
        kq_mask = np.ascontiguousarray(np.broadcast_to(kq_mask, (B, 1, T, T)), np.float32)
        pool = (batch.mask / batch.lengths[:, None]).astype(np.float32).reshape(B, 1, T)
        for t, arr in (
            (bg.inputs.ids, np.ascontiguousarray(batch.ids, np.int32)),
            (bg.inputs.type_ids, np.ascontiguousarray(batch.type_ids, np.int32)),
            (bg.inputs.pos, np.arange(T, dtype=np.int32)),
            (bg.inputs.kq_mask, kq_mask),
            (bg.inputs.pool, pool),
        ):
            g.ggml_backend_tensor_set(t, _ptr(arr), 0, arr.nbytes)

    # -- sentences -----------------------------------------------------------------------------

    def tokenize(self, sentences: Sequence[str]) -> TokenBatch:
        """The padded batch of all `sentences` (truncated at max_seq_length tokens)."""
        return self.assets.tokenizer.encode(sentences)

    def batches(self, tokens: TokenBatch, batch_size: int) -> Iterable[tuple]:
        """(indices, TokenBatch) pairs: sentences sorted by length, longest first, `batch_size` per
        batch, each padded only to its own longest sentence."""
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        lengths = tokens.lengths
        order = np.argsort(-lengths, kind="stable")
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            T = int(lengths[idx].max())
            yield idx, TokenBatch(tokens.ids[idx, :T], tokens.type_ids[idx, :T], tokens.mask[idx, :T])

    def embed(self, sentences: Sequence[str], batch_size: int = 32) -> np.ndarray:
        """Sentence embeddings (len(sentences), 384) float32, L2-normalized (unit rows)."""
        tokens = self.tokenize(sentences)
        out = np.empty((len(tokens.ids), self.config.hidden_size), np.float32)
        for idx, batch in self.batches(tokens, batch_size):
            out[idx] = self.embed_tokens(batch)
        return out

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Frees the compute allocator, the weights' buffer and context, and an owned backend."""
        g = self.g
        if self._galloc:
            g.ggml_gallocr_free(self._galloc)
            self._galloc = None
        if self._wbuf:
            g.ggml_backend_buffer_free(self._wbuf)
            self._wbuf = None
        if self._wctx:
            g.ggml_free(self._wctx)
            self._wctx = None
        if self._owns_backend and self.backend:
            g.ggml_backend_free(self.backend)
            self.backend = None

    def __enter__(self) -> "MiniLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def embed(
    sentences: Sequence[str], backend: Optional[int] = None, buft: Optional[int] = None, batch_size: int = 32
) -> np.ndarray:
    """One-shot `MiniLM(backend, buft).embed(sentences)`: (n_sentences, 384) float32, unit rows.
    backend None = ggml's CPU backend in this process, not through APIR (`apir.embed` runs this
    on an APIR device). Loads and uploads the weights each call; keep a `MiniLM` for repeated
    use."""
    with MiniLM(backend=backend, buft=buft) as model:
        return model.embed(sentences, batch_size=batch_size)
