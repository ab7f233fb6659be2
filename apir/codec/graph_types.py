"""What the graph's plain code and its Numba twin share: the buffer table, the parse's result,
the count checks and every error message, so both paths raise the same words.

`apir.codec.graph` re-exports the public names; import them from there.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import numpy as np

from apir.codec.records import GGML_0_20_LIMITS, GgmlLimits, rpc_tensor_dtype
from apir.errors import ApirError

__all__ = ["BufferTable", "GraphError", "ParsedGraph", "graph_size", "GraphWindow", "graph_window"]

_U32 = struct.Struct("<I")
_U64_MASK = 2**64 - 1


class GraphError(ApirError, ValueError):
    """A serialized graph is malformed or hostile; the message says what is wrong."""


class BufferTable:
    """The guest's map of its remote buffers: `ggml_backend_buffer_t` pointer (int) ->
    (host handle u64, base address int). The C guest keeps both in the buffer's context
    (`ggml_backend_remoting_buffer_context`); apir keeps them here for the serializer.

    Thread-safe: `arrays()` returns a consistent snapshot (sorted pointers, handles, bases,
    all int64) that stays valid while other threads register or unregister."""

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict[int, Tuple[int, int]] = {}
        self._arrays = self._build()

    def _build(self):
        ptrs = sorted(self._entries)
        handles = np.array([self._entries[p][0] for p in ptrs], dtype=np.uint64).view(np.int64)
        bases = np.array([self._entries[p][1] for p in ptrs], dtype=np.uint64).view(np.int64)
        return np.array(ptrs, dtype=np.uint64).view(np.int64), handles, bases

    def register(self, buffer_ptr: int, handle: int, base: int) -> None:
        """Adds or replaces the entry of `buffer_ptr` (non-zero)."""
        if not buffer_ptr:
            raise ValueError("buffer pointer must be non-zero")
        with self._lock:
            self._entries[int(buffer_ptr)] = (int(handle), int(base))
            self._arrays = self._build()

    def unregister(self, buffer_ptr: int) -> bool:
        """Removes `buffer_ptr`; returns whether it was registered."""
        with self._lock:
            if self._entries.pop(int(buffer_ptr), None) is None:
                return False
            self._arrays = self._build()
            return True

    def lookup(self, buffer_ptr: int) -> Optional[Tuple[int, int]]:
        """(handle, base) of `buffer_ptr`, or None."""
        return self._entries.get(int(buffer_ptr))

    def arrays(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(pointers sorted, handles, bases) as int64 arrays, for the kernels."""
        return self._arrays

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, buffer_ptr) -> bool:
        return int(buffer_ptr) in self._entries


def graph_size(n_nodes: int, n_tensors: int, limits: GgmlLimits = GGML_0_20_LIMITS) -> int:
    """Bytes of a serialized graph with these counts."""
    return 8 + 8 * n_nodes + rpc_tensor_dtype(limits).itemsize * n_tensors


@dataclass(frozen=True)
class ParsedGraph:
    """A validated graph (host side). Every array is the host's own copy.

    node_ids        u64[n_nodes]     the graph's nodes, in order (guest ids)
    tensors         rpc[n_tensors]   the apir_rpc_tensor records (`rpc_tensor_dtype(limits)`)
    order           int32[n_tensors] indices into `tensors`, each after its srcs and view_src
    node_index      int32[n_nodes]   index into `tensors` of each node
    src_index       int32[n_tensors, max_src]  index of each src, -1 where none
    view_src_index  int32[n_tensors] index of the view source, -1 where none
    size            bytes the graph occupies (trailing bytes after it are ignored, as the C)
    """

    node_ids: np.ndarray
    tensors: np.ndarray
    order: np.ndarray
    node_index: np.ndarray
    src_index: np.ndarray
    view_src_index: np.ndarray
    size: int

    @property
    def n_nodes(self) -> int:
        return len(self.node_ids)

    @property
    def n_tensors(self) -> int:
        return len(self.tensors)


class GraphWindow(NamedTuple):
    """The graph's bytes in the guest's buffer and the counts read from them (`graph_window`)."""

    guest: np.ndarray  # uint8[size]: the graph's bytes where the guest wrote them (no copy)
    n_nodes: int
    n_tensors: int
    size: int  # 4 + 8 n_nodes + 4 + record size * n_tensors


def graph_window(buf, start: int, end: Optional[int], limits: GgmlLimits) -> GraphWindow:
    """Reads n_nodes and n_tensors from ``buf[start:end]`` and checks that the bytes they claim
    lie inside it. Raises GraphError when they do not."""
    view = memoryview(buf)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    total = len(view)
    if end is None:
        end = total
    if not 0 <= start <= end <= total:
        raise GraphError(f"graph window [{start}, {end}) outside a {total}-byte buffer")
    size = end - start
    if size < 4:
        raise GraphError(f"graph of {size} bytes: no room for n_nodes")
    n_nodes = _U32.unpack(view[start : start + 4])[0]
    need = 4 + 8 * n_nodes + 4
    if need > size:
        raise GraphError(f"n_nodes = {n_nodes} needs {need} bytes, the graph has {size}")
    n_tensors = _U32.unpack(view[start + need - 4 : start + need])[0]
    need += rpc_tensor_dtype(limits).itemsize * n_tensors
    if need > size:
        raise GraphError(f"n_tensors = {n_tensors} needs {need} bytes, the graph has {size}")
    return GraphWindow(np.frombuffer(view, dtype=np.uint8, count=need, offset=start), n_nodes, n_tensors, need)


def write_counts(data: np.ndarray, n_nodes: int, n_tensors: int) -> None:
    """Writes the counts the parse used into its copy of the graph: the guest may have
    rewritten them in its buffer since they were read."""
    _U32.pack_into(data.data, 0, n_nodes)
    _U32.pack_into(data.data, 4 + 8 * n_nodes, n_tensors)


# --- the errors both paths raise ---------------------------------------------------------------
# Serialization: ValueError naming the tensor (the guest's own graph is wrong, not hostile).


def _tensor_desc(g, addr: int) -> str:
    try:
        name = g.ggml_get_name(addr)
        name = name.decode(errors="replace") if name else ""
    except Exception:  # pragma: no cover - a build without ggml_get_name
        name = "?"
    return f"tensor {addr:#x} ({name!r})"


def narrow_error(g, tensor: int, field: str, dim: int, value: int) -> ValueError:
    return ValueError(f"{_tensor_desc(g, tensor)}: {field}[{dim}] = {value & _U64_MASK} does not fit the wire's u32")


def unknown_buffer_error(g, tensor: int, buffer: int) -> ValueError:
    return ValueError(f"{_tensor_desc(g, tensor)}: buffer {buffer & _U64_MASK:#x} is not a registered remote buffer")


def data_no_buffer_error(g, tensor: int, data: int) -> ValueError:
    return ValueError(f"{_tensor_desc(g, tensor)}: has data {data & _U64_MASK:#x} but no buffer")


# Parse: GraphError naming the record (index) and the value at fault. Ids are u64 on the wire.


def zero_id_error(i: int) -> GraphError:
    return GraphError(f"tensor {i}: id is 0")


def dup_id_error(i: int, tid: int) -> GraphError:
    return GraphError(f"tensor {i}: id {tid & _U64_MASK:#x} appears twice")


def bad_type_error(i: int, type_: int) -> GraphError:
    return GraphError(f"tensor {i}: type {type_} is not a ggml type of this build")


def bad_op_error(i: int, op: int) -> GraphError:
    return GraphError(f"tensor {i}: op {op} is out of range")


def name_error(i: int) -> GraphError:
    return GraphError(f"tensor {i}: name is not NUL-terminated")


def unknown_src_error(i: int, slot: int, sid: int) -> GraphError:
    return GraphError(f"tensor {i}: src[{slot}] = {sid & _U64_MASK:#x} is not among the tensors")


def unknown_view_src_error(i: int, vid: int) -> GraphError:
    return GraphError(f"tensor {i}: view_src {vid & _U64_MASK:#x} is not among the tensors")


def unknown_node_error(i: int, nid: int) -> GraphError:
    return GraphError(f"node {i}: id {nid & _U64_MASK:#x} is not among the tensors")


def cycle_error(i: int) -> GraphError:
    return GraphError(f"tensor {i}: its sources form a cycle")
