"""Workloads built on a ggml backend: all-MiniLM-L6-v2 sentence embeddings.

`MiniLM(backend, buft).embed(sentences)` and the one-shot `embed(sentences)` return a
(n_sentences, 384) float32 array of unit-length embeddings; see `apir.models.minilm`. The
one-shot `embed` runs on the backend given (default: local ggml CPU); `apir.embed` is the same
through APIR.
"""

from apir.models.assets import INSTALL_COMMAND, ModelNotInstalled
from apir.models.minilm import MiniLM, MiniLMError, embed

__all__ = ["INSTALL_COMMAND", "MiniLM", "MiniLMError", "ModelNotInstalled", "embed"]
