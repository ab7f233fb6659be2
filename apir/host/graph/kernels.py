"""The host's Numba kernels: accelerations of apir.host.graph's checks and builds.

Theory of operation: each kernel here does, on whole arrays or on raw memory, one step the
host takes on a graph the guest sent: its structure key and the same-bytes match of the
graph cache (apir.host.graph.cache), grouping the tensors whose shape rules see equal inputs
(apir.host.graph.rule_memo), the record checks and the first write over each range of bytes
(apir.host.graph.build), and writing the host tensors and adding the nodes through ggml's
functions called by address. They build on the codec's primitives (typed loads and stores,
block copies, the one JIT helper; apir.codec._kernels' module docstring says how), and keep
its rules: int64 addresses, fixed work arrays, error codes rather than exceptions.

This module imports Numba: only the accelerated path imports it (`apir.accel.enabled()`);
each kernel's `.py_func` is its plain-Python twin, and tests hold the two equal.

The kernels that compare a graph where it lies in the guest's shared memory with a cached
one (`record_match_kernel`, `records_match_kernel`, `records_moved_kernel`,
`ids_moved_kernel`, `ids_link_kernel`) read no byte past the cached graph's size, and their
answer is all that is used. The other kernels read only memory the host owns.
"""

from __future__ import annotations

import ctypes

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

# The codec's primitives, in one place (the only import of them here).
from apir.codec._kernels import (
    TABLE_KEY,
    _LOW62,
    _first_nul,
    _mix,
    helper,
    jit,
    load_i64,
    load_i64_at,
    load_u8,
    load_u32,
    memcopy,
    memzero,
    store_i64,
    store_i64_at,
    store_u8,
    store_u32,
)

__all__ = [
    "TABLE_KEY",
    "record_key_kernel",
    "name_lens_kernel",
    "record_match_kernel",
    "records_match_kernel",
    "ids_link_kernel",
    "ids_moved_kernel",
    "ID_MOVED_MAX",
    "MOVED_SAME",
    "MOVED_IDS_DIFFER",
    "MOVED_DIFFERENT",
    "records_moved_kernel",
    "rule_group_kernel",
    "group_sizes_kernel",
    "call_ptr_ptr_i32_i64",
    "call_void_ptr_ptr",
    "new_tensors_kernel",
    "add_nodes_kernel",
    "use_counts_kernel",
    "write_tensors_kernel",
    "record_fields_kernel",
    "record_bounds_kernel",
    "graph_writes_kernel",
    "first_overlap_kernel",
    "copy_written_kernel",
]


# --- calls of C functions by address ------------------------------------------------------------
# (the address is an argument, never a constant of the compiled code, so the on-disk cache
# stays valid in every process; the C signatures are the ggml functions the host calls in bulk)


def call_ptr_ptr_i32_i64(fn, a, b, c):
    """`void *fn(void *a, int32_t b, int64_t c)` (ggml_new_tensor_1d), its result as an int."""
    f = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64)(int(fn))
    return f(int(a), int(b), int(c)) or 0


def call_void_ptr_ptr(fn, a, b):
    """`void fn(void *a, void *b)` (ggml_graph_add_node)."""
    ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(int(fn))(int(a), int(b))


@intrinsic
def _i_call_ptr_ptr_i32_i64(typingctx, fn, a, b, c):
    if not all(isinstance(t, types.Integer) for t in (fn, a, b, c)):
        return None

    def codegen(context, builder, sig, args):
        i64, i32, i8p = ir.IntType(64), ir.IntType(32), ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(i8p, [i8p, i32, i64])
        f, x, y, z = (context.cast(builder, v, t, types.int64) for v, t in zip(args, sig.args))
        ret = builder.call(builder.inttoptr(f, fnty.as_pointer()), [builder.inttoptr(x, i8p), builder.trunc(y, i32), z])
        return builder.ptrtoint(ret, i64)

    return types.int64(fn, a, b, c), codegen


@intrinsic
def _i_call_void_ptr_ptr(typingctx, fn, a, b):
    if not all(isinstance(t, types.Integer) for t in (fn, a, b)):
        return None

    def codegen(context, builder, sig, args):
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i8p])
        f, x, y = (context.cast(builder, v, t, types.int64) for v, t in zip(args, sig.args))
        builder.call(builder.inttoptr(f, fnty.as_pointer()), [builder.inttoptr(x, i8p), builder.inttoptr(y, i8p)])
        return context.get_dummy_value()

    return types.void(fn, a, b), codegen


@overload(call_ptr_ptr_i32_i64)
def _ol_call_ptr_ptr_i32_i64(fn, a, b, c):
    return lambda fn, a, b, c: _i_call_ptr_ptr_i32_i64(fn, a, b, c)  # type: ignore[call-arg]  # typingctx


@overload(call_void_ptr_ptr)
def _ol_call_void_ptr_ptr(fn, a, b):
    return lambda fn, a, b: _i_call_void_ptr_ptr(fn, a, b)  # type: ignore[call-arg]  # typingctx


# --- structure keys of parsed records ----------------------------------------------------------


@jit
def record_key_kernel(rows, mask, name_at, name_len, out):
    """`out` (n * record size bytes, uint8) = the records `rows` (n x record size, uint8,
    C-contiguous) with each byte ANDed with `mask` (0x00 or 0xFF per byte offset), and in
    each record the `name_len` name bytes at `name_at` after the first NUL zeroed (a name
    without a NUL is kept whole). Masked 8 bytes at a time, then each name cut after its
    NUL; returns 0."""
    n, size = rows.shape
    words = size // 8
    word_mask = np.zeros(words, np.int64)
    for b in range(8 * words):
        word_mask[b // 8] |= np.int64(mask[b]) << (8 * (b % 8))
    src, dst = rows.ctypes.data, out.ctypes.data
    for r in range(n):
        a = src + r * size
        o = dst + r * size
        for w in range(words):
            store_i64_at(o, w, load_i64_at(a, w) & word_mask[w])
        for b in range(8 * words, size):
            store_u8(o + b, load_u8(a + b) & mask[b])
        b = _first_nul(a + name_at, name_len)
        if b < name_len:
            memzero(o + name_at + b + 1, name_len - b - 1)
    return 0


@jit
def name_lens_kernel(rows, name_at, name_len, out):
    """`out[r]` (int64[n]) = the bytes of record r's name (`name_len` bytes at `name_at` in
    row r of `rows`, n x record size, uint8, C-contiguous) before its first NUL, or
    `name_len` - 1 for a name without one (compared whole, NUL slot included). Returns 0."""
    n, size = rows.shape
    base = rows.ctypes.data
    for r in range(n):
        out[r] = min(_first_nul(base + r * size + name_at, name_len), name_len - 1)
    return 0


@jit
def record_match_kernel(new, size, old, old_size, head, rec_size, word_mask, name_at, name_lens):
    """Whether the `size` bytes at address `new` (a graph as the guest sent it; may be
    longer, the rest not read) hold what the `old_size` bytes at address `old` hold: `head`
    header bytes, then records of `rec_size` bytes as `record_key_kernel` writes them (`head`
    and `rec_size` multiples of 8). Equal: the header; in each record every byte under
    `word_mask` (int64 per 8 bytes of a record, its bytes 0x00 or 0xFF, 0x00 over the name);
    and record r's name (at `name_at`) over its first `name_lens[r] + 1` bytes, up to and
    including its first NUL (the rest not compared; `name_lens` is the old graph's, not
    read from `new`). Compared 8 bytes at a time, at any alignment."""
    if size < old_size:
        return False
    for w in range(head // 8):
        if load_i64_at(new, w) != load_i64_at(old, w):
            return False
    return _records_match(new, old, head, rec_size, word_mask, name_at, name_lens, 0, (old_size - head) // rec_size)


@jit
def records_match_kernel(new, old, head, rec_size, word_mask, name_at, name_lens, lo, hi):
    """record_match_kernel's comparison of records [`lo`, `hi`) only (the caller compared
    the sizes, and compares the header and the other records): one part of a large graph's
    records, compared on another thread."""
    return _records_match(new, old, head, rec_size, word_mask, name_at, name_lens, lo, hi)


@helper
def _bytes_diff(a, b, n):
    # non-zero where the `n` bytes at `a` and at `b` differ: 8 at a time, then one by one
    diff = 0
    for w in range(n // 8):
        diff |= load_i64_at(a, w) ^ load_i64_at(b, w)
    k = n - n % 8
    while k < n:
        diff |= load_u8(a + k) ^ load_u8(b + k)
        k += 1
    return diff


@helper
def _records_match(new, old, head, rec_size, word_mask, name_at, name_lens, lo, hi):
    words = rec_size // 8
    for r in range(lo, hi):
        a = new + head + r * rec_size
        b = old + head + r * rec_size
        diff = 0
        for w in range(words):
            diff |= (load_i64_at(a, w) ^ load_i64_at(b, w)) & word_mask[w]
        diff |= _bytes_diff(a + name_at, b + name_at, name_lens[r] + 1)
        if diff:
            return False
    return True


# The ids records_moved_kernel moves: those below this, moved by less than it, add up to
# the same int64 in the jitted kernel and in its Python twin (no wrap to tell apart)
ID_MOVED_MAX = 1 << 62


# records_moved_kernel's answers
MOVED_SAME = 0  # every record the old one, its ids moved
MOVED_IDS_DIFFER = 1  # a record differs from the old one in its ids only: not moved, maybe linked
MOVED_DIFFERENT = 2  # a record differs outside its ids: no graph of the same structure


@jit
def records_moved_kernel(new, old, head, rec_size, word_mask, link_mask, moves, name_at, name_lens, delta, lo, hi):
    """Compares records [`lo`, `hi`) as `records_match_kernel` does under `word_mask`, their
    ids moved by `delta`: each word where `moves` (int64 per word of a record: -1 at `id`,
    `src[]`, `view_src`, else 0) is -1 holds 0 where the old one does, else the old one plus
    `delta`. The ids of the same graph built by a ggml context at another address. The caller
    has checked that every old id is in [1, ID_MOVED_MAX), that |`delta`| < ID_MOVED_MAX and
    that the least old id plus `delta` is above 0: moved by one constant, the ids stay
    non-zero and unique, and every link stays, so parse_graph_kernel finds the old graph's
    index arrays. Returns MOVED_SAME, or at the first record that differs MOVED_DIFFERENT
    (under `link_mask`, its ids left out) or MOVED_IDS_DIFFER (in its ids only)."""
    words = rec_size // 8
    for r in range(lo, hi):
        a = new + head + r * rec_size
        b = old + head + r * rec_size
        diff = 0
        for w in range(words):
            o = load_i64_at(b, w)
            diff |= (load_i64_at(a, w) ^ (o + (delta & moves[w] if o != 0 else 0))) & word_mask[w]
        diff |= _bytes_diff(a + name_at, b + name_at, name_lens[r] + 1)
        if diff:  # (which: compared again without the ids, this record only)
            if _records_match(new, old, head, rec_size, link_mask, name_at, name_lens, r, r + 1):
                return MOVED_IDS_DIFFER
            return MOVED_DIFFERENT
    return MOVED_SAME


@jit
def ids_moved_kernel(new, old, n, delta):
    """Whether each of the `n` int64 ids at address `new` is the one at `old` plus `delta`
    (a graph's node ids; records_moved_kernel's rule and preconditions)."""
    for k in range(n):
        if load_i64_at(new, k) != load_i64_at(old, k) + delta:
            return False
    return True


@jit
def ids_link_kernel(new, head, rec_size, id_at, src_at, view_src_at, node_index, src_index, view_src_index, hkey):
    """Whether the ids of the graph at address `new` (`head` header bytes, then records of
    `rec_size` bytes with `id`, `src[]` and `view_src` at those offsets; n = len(src_index)
    records read, none past them) link its tensors as the index arrays of another graph's
    parse say (`node_index`: int32[n_nodes]; `src_index`: int32[n, max_src]; `view_src_index`:
    int32[n]; -1 for none; each other index in [0, n)): every id non-zero and unique (an
    open-addressing set keyed by `hkey`, TABLE_KEY), each node id the id of the tensor its
    index names, each src and view_src 0 where the index is -1, else the id of that tensor.
    Exactly when this holds, parse_graph_kernel finds these index arrays from these ids.
    Each word is read from `new` once (the ids into a private array first)."""
    n = src_index.shape[0]
    cap = 2
    while cap < 2 * n:
        cap *= 2
    table = np.zeros(cap, np.int64)
    mask = cap - 1
    # each id read from the guest once: a guest rewriting one between reads could otherwise
    # pass the set with one value and the links with another
    ids = np.empty(n, np.int64)
    for i in range(n):
        tid = load_i64(new + head + id_at + rec_size * i)
        ids[i] = tid
        if tid == 0:
            return False
        j = _mix(0, tid, hkey) & mask
        while True:
            k = table[j]
            if k == tid:
                return False
            if k == 0:
                table[j] = tid
                break
            j = (j + 1) & mask
    for k in range(node_index.shape[0]):
        if load_i64(new + 4 + 8 * k) != ids[node_index[k]]:
            return False
    max_src = src_index.shape[1]
    for i in range(n):
        r = new + head + rec_size * i
        for s in range(max_src + 1):
            j = src_index[i, s] if s < max_src else view_src_index[i]
            at = r + src_at + 8 * s if s < max_src else r + view_src_at
            if load_i64(at) != (0 if j < 0 else ids[j]):
                return False
    return True


# --- tensors whose shape rules see the same inputs ---------------------------------------------


_M32 = (1 << 32) - 1


@helper
def _lane_seeds(n, key):
    """2 * `n` secret 32-bit seeds, a pair per lane of `_nh` (derived from the secret `key`)."""
    seeds = np.empty(2 * n, np.int64)
    for k in range(2 * n):
        seeds[k] = _mix(k + 1, 0, key) & _M32
    return seeds


@helper
def _nh(x, seeds, k):
    # Lane k of an NH sum (UMAC's hash, RFC 4418's L1-HASH): the two 32-bit halves of the
    # int64 word x, each plus its lane's secret seed mod 2**32, multiplied (exact: below
    # 2**64), the product's low 62 bits. For two rows that differ, their sums of lanes agree
    # with probability at most 2**-30 over the seeds, so a guest that does not know them can
    # neither aim rows at one probe chain nor make rows collide by swapping words; one
    # multiply a word, where two keyed folds (_mix) cost twice the time.
    # (int(): in the Python twin, numpy scalars would overflow)
    a = ((int(x) & _M32) + int(seeds[2 * k])) & _M32
    b = (((int(x) >> 32) & _M32) + int(seeds[2 * k + 1])) & _M32
    return (a * b) & _LOW62


@helper
def _row_hash(words, keep, mask, seeds, r, key):
    # The compared words (`keep`: word indices; `mask`: their masks) summed as NH lanes, one
    # lane per position, and the sum mixed once for the slot.
    h = 0
    for k in range(keep.shape[0]):
        h = (h + _nh(words[r, keep[k]] & mask[k], seeds, k)) & _LOW62
    return _mix(h, 0, key)


@helper
def _same_row(words, keep, mask, a, b):
    for k in range(keep.shape[0]):
        w = keep[k]
        if (words[a, w] ^ words[b, w]) & mask[k]:
            return False
    return True


@helper
def _src_code(src_index, i, k):
    """What src slot k of tensor i is, apart from the source's record: -1 none, -2 the
    tensor itself, else the first slot of i's row holding the same tensor."""
    s = src_index[i, k]
    if s < 0:
        return -1
    if s == i:
        return -2
    for q in range(k):
        if src_index[i, q] == s:
            return q
    return k


@helper
def _same_inputs(tclass, src_index, codes, a, b):
    if tclass[a] != tclass[b]:
        return False
    for k in range(src_index.shape[1]):
        ca = codes[a, k]
        if ca != codes[b, k]:
            return False
        if ca >= 0 and tclass[src_index[a, k]] != tclass[src_index[b, k]]:
            return False
    return True


@jit
def rule_group_kernel(words, keep, mask, src_index, out_rep, key):
    """`out_rep[i]` (int32[n]) = the first tensor whose shape rule sees what tensor i's sees:
    the same bytes under `mask` (int64[k]: the fields rules read, in the words `keep`,
    int64[k]) in its record `words[i]` (int64[n, w]: the records, 8 bytes a word, read in
    place) and in the record of each source, and the same source slots holding none, itself,
    or one tensor twice (`src_index`, int32[n, max_src]). Exact comparisons decide; hashes
    (keyed by `key`: TABLE_KEY) only find candidates, once the tensor after the last one
    matched is not alike (a guess that costs one comparison when wrong, and saves the hash
    and the probe on each tensor of a model's repeated layers). Returns the number of groups."""
    n = words.shape[0]
    slots = src_index.shape[1]
    cap = 16
    while cap < 2 * n:
        cap *= 2
    slot_mask = cap - 1
    seeds = _lane_seeds(keep.shape[0] + slots + 1, key)
    tclass = np.empty(n, np.int32)
    table = np.full(cap, -1, np.int32)
    # 1. tensors with the same masked record share a class: the first of them. The tensor
    # after the last one matched is tried first (a model's layers repeat in order: the
    # tensor after the one like tensor i - 1 is most often like tensor i), then the table.
    seen = -1  # the tensor tensor i - 1 was found equal to (or itself)
    for i in range(n):
        c = seen + 1
        if c < i and _same_row(words, keep, mask, c, i):
            tclass[i] = tclass[c]
            seen = c
            continue
        s = _row_hash(words, keep, mask, seeds, i, key) & slot_mask
        while True:
            r = table[s]
            if r < 0:
                table[s] = i
                tclass[i] = i
                break
            if _same_row(words, keep, mask, r, i):
                tclass[i] = r
                break
            s = (s + 1) & slot_mask
        seen = tclass[i]
    # 2. tensors with the same class, source slots and source classes share a group
    codes = np.empty(src_index.shape, np.int32)
    table[:] = -1
    lanes = keep.shape[0]
    groups = 0
    seen = -1  # as in 1: the tensor tensor i - 1 was found alike
    for i in range(n):
        # (slots after the last source hold none: the count of slots before it says so, and
        # leaves them out of the hash; _same_inputs compares every slot. One lane per slot,
        # as _row_hash's; a lane's value packs the slot's code and its source's class.)
        last = slots
        while last > 0 and src_index[i, last - 1] < 0:
            last -= 1
        for k in range(last, slots):
            codes[i, k] = -1
        for k in range(last):
            codes[i, k] = _src_code(src_index, i, k)
        c = seen + 1
        if c < i and _same_inputs(tclass, src_index, codes, c, i):
            out_rep[i] = out_rep[c]
            seen = c
            continue
        h = _nh(int(tclass[i]) * 65536 + last, seeds, lanes)
        for k in range(last):
            cls = int(tclass[src_index[i, k]]) if codes[i, k] >= 0 else -1
            h = (h + _nh((cls + 1) * 65536 + codes[i, k] + 2, seeds, lanes + 1 + k)) & _LOW62
        s = _mix(h, 0, key) & slot_mask
        while True:
            r = table[s]
            if r < 0:
                table[s] = i
                out_rep[i] = i
                groups += 1
                break
            if _same_inputs(tclass, src_index, codes, r, i):
                out_rep[i] = r
                break
            s = (s + 1) & slot_mask
        seen = out_rep[i]
    return groups


@jit
def group_sizes_kernel(rep, out_reps, out_sizes):
    """For `rep` (int32[n]: rule_group_kernel's answer, each tensor's representative, which
    is at or before it): `out_reps` (int32[n]) starts with the representatives in index
    order, and `out_sizes[r]` (int32[n], zeroed by the caller) = the members of r's group.
    Returns the number of groups (rule_memo.check_nodes' plain path: numpy's `rep == arange`
    and bincount)."""
    groups = 0
    for i in range(rep.shape[0]):
        r = rep[i]
        if r == i:
            out_reps[groups] = i
            groups += 1
        out_sizes[r] += 1
    return groups


@helper
def _load_wide(addr, width):
    # an unsigned wire field of `width` bytes (4 or 8); one of 8 at or past 2**63 reads < 0
    return load_u32(addr) if width == 4 else load_i64(addr)


# --- host tensors and graph nodes, created in bulk ---------------------------------------------


@jit
def new_tensors_kernel(new_tensor_1d, ctx, order, type_, ne0, out):
    """For each tensor i of `order` (int64), in that order: `out[i]` = ggml_new_tensor_1d(ctx,
    type_[i], ne0[i]) (its address; `new_tensor_1d` the function's). Returns 0, or -1 - i
    where ggml returned NULL (the context is full)."""
    for k in range(order.size):
        i = order[k]
        t = call_ptr_ptr_i32_i64(new_tensor_1d, ctx, type_[i], ne0[i])
        if t == 0:
            return -1 - i
        out[i] = t
    return 0


@jit
def add_nodes_kernel(add_node, graph, nodes, host):
    """ggml_graph_add_node(graph, host[j]) for each j of `nodes` (int64), in order
    (`add_node` the function's address). Returns 0."""
    for k in range(nodes.size):
        call_void_ptr_ptr(add_node, graph, host[nodes[k]])
    return 0


@jit
def use_counts_kernel(host_at, node_index, uses, used, table, counts):
    """apir.ggml.cgraph.write_hash_set, as ggml_hash_insert does it: each node's key at the
    first free slot from its home, (key >> 4) % size, on. The set is empty and larger than the
    nodes (fill_use_counts checks both), so every walk ends. Returns 0."""
    size = table.size
    for k in range(node_index.size):
        key = host_at[node_index[k]]
        i = np.int64((key >> np.uint64(4)) % np.uint64(size))
        while used[i >> 5] >> np.uint32(i & 31) & np.uint32(1):
            i = (i + 1) % size
        used[i >> 5] |= np.uint32(1) << np.uint32(i & 31)
        table[i] = key
        counts[i] = uses[node_index[k]]
    return 0


@helper
def _write_tensor(a, r, off, roff, width):
    # the fields of zeroed tensor `a` copied from the record at `r` (write_tensors_kernel)
    if width == 4:  # (the test outside the loop: 4 straight-line widenings each)
        for d in range(4):
            store_i64(a + off[0] + 8 * d, load_u32(r + roff[0] + 4 * d))
            store_i64(a + off[1] + 8 * d, load_u32(r + roff[1] + 4 * d))
    else:
        for d in range(4):
            store_i64(a + off[0] + 8 * d, load_i64(r + roff[0] + 8 * d))
            store_i64(a + off[1] + 8 * d, load_i64(r + roff[1] + 8 * d))
    store_u32(a + off[2], load_u32(r + roff[2]))
    memcopy(a + off[3], r + roff[3], 4 * roff[7])
    store_u32(a + off[4], load_u32(r + roff[4]))
    memcopy(a + off[5], r + roff[5], _first_nul(r + roff[5], roff[8]))


@jit
def write_tensors_kernel(
    base,
    stride,
    off,
    rows,
    size,
    roff,
    width,
    type_,
    handle_of,
    buffers,
    bases,
    offsets,
    src,
    view_src,
    host,
    uses,
):
    """The host twin of each apir_rpc_tensor record i (records at address `rows`, `size`
    bytes each, a copy the host owns) written whole at `base` + i * `stride` (room for a
    struct ggml_tensor of `stride` bytes each), its address into `host[i]` (int64[n]): the
    struct zeroed, as ggml_new_tensor leaves a fresh one, then type (`type_[i]`), and the
    fields copied from the record and stored. `off` (int64[12]): the offsets in struct
    ggml_tensor of ne, nb, op, op_params, flags, name, buffer, data, src, view_src, view_offs
    and type (8-byte ne, nb and pointers); `roff` (int64[9]): the records' offsets of ne, nb,
    op, op_params, flags, name, view_offs and the counts of op_params entries and name bytes;
    `width`: the bytes of a record's ne / nb entry (4 or 8). Copied: ne, nb (widened), op,
    op_params, flags (4 bytes each), the name up to its first NUL (the rest stays zero, as
    ggml_set_name leaves it). Stored: buffer and data (`buffers[h]`, `bases[h]` +
    `offsets[i]` for handle h = `handle_of[i]`); src (int32[n, S]) and view_src (int32[n])
    tensor indices, as the twins' addresses (the absent ones stay NULL); view_offs for views
    only. Counts in `uses` (int32[n], zeroed) the source slots naming each tensor, on the way
    (apir.ggml.cgraph.source_uses). Returns 0."""
    for i in range(host.size):
        a = base + i * stride
        host[i] = a
        memzero(a, stride)
        store_u32(a + off[11], type_[i])
        r = rows + i * size
        _write_tensor(a, r, off, roff, width)
        h = handle_of[i]
        store_i64(a + off[6], buffers[h])
        store_i64(a + off[7], bases[h] + offsets[i])
        for s in range(src.shape[1]):
            j = int(src[i, s])  # (int: in the twin, an int32 times the address would overflow)
            if j >= 0:
                store_i64(a + off[8] + 8 * s, base + j * stride)
                uses[j] += 1
        v = int(view_src[i])
        if v >= 0:
            store_i64(a + off[9], base + v * stride)
            store_i64(a + off[10], load_i64(r + roff[6]))
    return 0


# --- the host's checks of a parsed graph's records, on whole arrays ----------------------------

_FAST_LIMIT = float(1 << 60)  # bound on every intermediate of the extent arithmetic: int64 exact
_VALUE_MAX = 1 << 62  # a wire value the host takes as it is (as apir.host.tensors' _NE_MAX)


@jit
def record_fields_kernel(
    rows,
    n,
    size,
    off,
    width,
    name_len,
    valid,
    custom,
    type_size,
    blck_size,
    extents,
    offsets,
    voffs,
    ops,
    handle_of,
    spans,
    handles,
    key,
):
    """The per-record checks of apir.host.graph.build._check_records on the n apir_rpc_tensor
    records at address `rows` (`size` bytes each; a copy the host owns): a valid type
    (`valid`, uint8 per type), an op below len(`custom`) that is not custom (`custom`, uint8
    per op), ne and nb below 2**62 with ne[0] a multiple of the type's block, a NUL in the
    name, every extent intermediate below 2**60 (float bound, then exact), data and view_offs
    below 2**62. `off` (int64[8]): the records' offsets of type, op, ne, nb, name, data,
    view_offs and buffer; `width`: the bytes of one ne / nb entry (4 or 8). Fills per record
    its extent (TensorChecker.extent), data offset, view_offs, op, the index of its buffer
    handle in `handles` (each handle once, in order of first use, as int64 bit patterns) and
    its span in float (`spans`: apir.host.graph.shapes.base.span_nbytes, a 0 dimension taken as 1).
    `key`: the multiplier of the handles' hash table (TABLE_KEY). Returns the number of
    handles, or -1 when any record fails a check or leaves the range (the caller then checks
    record by record)."""
    cap = 16
    while cap < 2 * n:
        cap *= 2
    table = np.full(cap, -1, np.int64)
    n_handles = 0
    for i in range(n):
        r = rows + i * size
        ty = load_u32(r + off[0])
        op = load_u32(r + off[1])
        if ty >= valid.size or valid[ty] == 0 or op >= custom.size or custom[op] != 0:
            return -1
        ops[i] = op
        ts = type_size[ty]
        blck = blck_size[ty]
        ne0 = _load_wide(r + off[2], width)
        nb0 = _load_wide(r + off[3], width)
        if ne0 < 0 or nb0 < 0 or ne0 >= _VALUE_MAX or nb0 >= _VALUE_MAX:
            return -1
        # (blck 1, the float types: no division, the costliest step of a record)
        blocks0 = ne0 if blck == 1 else ne0 // blck
        if blck != 1 and ne0 % blck != 0:
            return -1
        bound = float(ne0) * (float(nb0) + float(ts)) + float(nb0)
        blocks = float(max(ne0, 1)) if blck == 1 else np.ceil(float(max(ne0, 1)) / float(blck))
        span = blocks * float(ts)
        empty = ne0 == 0
        rest = 0
        for d in range(1, 4):
            ne = _load_wide(r + off[2] + d * width, width)
            nb = _load_wide(r + off[3] + d * width, width)
            if ne < 0 or nb < 0 or ne >= _VALUE_MAX or nb >= _VALUE_MAX:
                return -1
            bound += float(ne) * float(nb) + float(nb)
            span *= float(max(ne, 1))
            empty = empty or ne == 0
            rest += (ne - 1) * nb
        spans[i] = span
        if bound >= _FAST_LIMIT:
            return -1
        if _first_nul(r + off[4], name_len) == name_len:
            return -1
        row = max(blocks0 * ts, (blocks0 - 1) * nb0 + ts)
        if blck > 1:
            row = max(row, blocks0 * nb0)
        extents[i] = 0 if empty else row + rest
        data = load_i64(r + off[5])
        vo = load_i64(r + off[6])
        if data < 0 or vo < 0 or data >= _VALUE_MAX or vo >= _VALUE_MAX:
            return -1
        offsets[i] = data
        voffs[i] = vo
        h = load_i64(r + off[7])
        if n_handles and h == handles[handle_of[i - 1]]:  # (most records: the buffer before's)
            handle_of[i] = handle_of[i - 1]
            continue
        s = _mix(0, h, key) & (cap - 1)
        while True:
            k = table[s]
            if k < 0:
                table[s] = n_handles
                handles[n_handles] = h
                handle_of[i] = n_handles
                n_handles += 1
                break
            if handles[k] == h:
                handle_of[i] = k
                break
            s = (s + 1) & (cap - 1)
    return n_handles


@jit
def record_bounds_kernel(extents, offsets, voffs, handle_of, sizes, ident, view_src, spans, suspects):
    """The rest of _check_records: each record's data + extent within its buffer's size
    (`sizes`, per handle) and each view (`view_src` >= 0) in the same buffer as its source
    (`ident`, per handle: the same number for handles of one buffer), at the source's data +
    view_offs, its extent inside the source's. And the records whose span (`spans`, float)
    is near or over their buffer's size, in `suspects` (int64[n], in index order), for
    apir.host.graph.build._check_spans to check exactly. Returns how many suspects, or -1 when any
    check fails."""
    n_suspects = 0
    for i in range(extents.size):
        size = sizes[handle_of[i]]
        if offsets[i] + extents[i] > size:
            return -1
        if spans[i] > float(size) * (1 - 1e-9):
            suspects[n_suspects] = i
            n_suspects += 1
        v = view_src[i]
        if v >= 0:
            if ident[handle_of[i]] != ident[handle_of[v]] or offsets[i] != offsets[v] + voffs[i]:
                return -1
            if voffs[i] + extents[i] > extents[v]:
                return -1
    return n_suspects


# --- the first write over each range of bytes ---------------------------------------------------


@jit
def graph_writes_kernel(nodes, ops, empty, opt_step, src_index, buf, offsets, extents, w_buf, w_lo, w_hi, w_pos):
    """The writes a graph makes, for first_overlap_kernel: for the node at each position p of
    `nodes` (int64 tensor indices) whose op (`ops`, per tensor) writes (`empty[op]` False:
    ggml_op_is_empty), the node itself, and if its op updates its sources in place
    (`opt_step[op]`: OPT_STEP_*) each source (`src_index`, int32[n, S], -1 none). A write of
    tensor t at position p is stored as buffer `buf[t]`, bytes [offsets[t], offsets[t] +
    extents[t]) and p in `w_buf`, `w_lo`, `w_hi`, `w_pos` (int64, room for len(nodes) * (1 +
    S)). One pass where numpy took ten over the whole graph. Returns the number of writes."""
    m = 0
    for p in range(nodes.size):
        j = nodes[p]
        op = ops[j]
        if empty[op]:
            continue
        w_buf[m], w_lo[m], w_hi[m], w_pos[m] = buf[j], offsets[j], offsets[j] + extents[j], p
        m += 1
        if opt_step[op]:
            for k in range(src_index.shape[1]):
                t = src_index[j, k]
                if t >= 0:
                    w_buf[m], w_lo[m], w_hi[m], w_pos[m] = buf[t], offsets[t], offsets[t] + extents[t], p
                    m += 1
    return m


@jit
def copy_written_kernel(nodes, ops, empty, opt_step, src_index, view_src, copied, views):
    """apir.host.graph.build's `_copy_written_plain` in one pass over the nodes: (tensor,
    node) of the first write into a tensor `copied` marks (or with `views` into a view of
    one), the nodes' own writes before the sources an OPT_STEP_* updates; (-1, -1) where
    none is."""
    step_t, step_j = -1, -1  # (the first source written: the answer if no node writes itself there)
    for p in range(nodes.size):
        j = nodes[p]
        op = ops[j]
        if not empty[op]:
            v = view_src[j]
            if copied[j] or (views and v >= 0 and copied[v]):
                return j, j
        if opt_step[op] and step_t < 0:
            for k in range(src_index.shape[1]):
                t = src_index[j, k]
                if t < 0:
                    continue
                v = view_src[t]
                if copied[t] or (views and v >= 0 and copied[v]):
                    step_t, step_j = t, j
                    break
    return step_t, step_j


@jit
def first_overlap_kernel(w_buf, w_lo, w_hi, w_pos, q_buf, q_lo, q_hi, out, direct_max):
    """`out[q]` = the least `w_pos[w]` over the writes w whose bytes [w_lo, w_hi) overlap
    query q's [q_lo, q_hi) in the same buffer (`w_buf[w] == q_buf[q]`, `w_lo < q_hi` and
    `q_lo < w_hi`: an empty range overlaps one that strictly contains its offset), or -1 where
    none does. All int64, positions >= 0. A sweep: the writes in (buffer, lo) order enter a
    segment tree of least positions over their (buffer, hi) order while their lo is below the
    query's hi (queries in (buffer, hi) order); a query takes the least over its buffer's
    writes whose hi is above its lo. O((W + Q) log W), where comparing every pair is
    quadratic in a graph of many row-id readers; at most `direct_max` pairs (a graph's few
    readers: the sweep's sorts would cost more) are compared one by one. Returns 0. The plain
    twin is apir.host.graph.overlap.first_overlap."""
    nw = w_lo.size
    nq = q_lo.size
    big = np.int64(1) << 62
    if nw * nq <= direct_max:
        for q in range(nq):
            least = big
            for w in range(nw):
                if w_buf[w] == q_buf[q] and w_lo[w] < q_hi[q] and q_lo[q] < w_hi[w]:
                    least = min(least, w_pos[w])
            out[q] = least if least < big else -1
        return 0
    # writes by (buffer, hi): each one's rank, and the sorted buffers and his for the searches
    by_hi = np.argsort(w_hi, kind="mergesort")
    by_hi = by_hi[np.argsort(w_buf[by_hi], kind="mergesort")]
    rank = np.empty(nw, np.int64)
    sb = np.empty(nw, np.int64)
    sh = np.empty(nw, np.int64)
    for r in range(nw):
        w = by_hi[r]
        rank[w] = r
        sb[r] = w_buf[w]
        sh[r] = w_hi[w]
    # writes by (buffer, lo): the order they enter in; queries by (buffer, hi)
    by_lo = np.argsort(w_lo, kind="mergesort")
    by_lo = by_lo[np.argsort(w_buf[by_lo], kind="mergesort")]
    qs = np.argsort(q_hi, kind="mergesort")
    qs = qs[np.argsort(q_buf[qs], kind="mergesort")]
    size = 1
    while size < max(nw, 1):
        size *= 2
    tree = np.full(2 * size, big, np.int64)
    e = 0
    for t in range(nq):
        q = qs[t]
        b, hi = q_buf[q], q_hi[q]
        while e < nw:
            w = by_lo[e]
            if w_buf[w] > b or (w_buf[w] == b and w_lo[w] >= hi):
                break
            p = rank[w] + size
            tree[p] = min(tree[p], w_pos[w])
            p //= 2
            while p >= 1:
                tree[p] = min(tree[2 * p], tree[2 * p + 1])
                p //= 2
            e += 1
        # this buffer's writes with hi > the query's lo: ranks [start, stop)
        start = np.searchsorted(sb, b, side="left")
        stop = np.searchsorted(sb, b, side="right")
        start += np.searchsorted(sh[start:stop], q_lo[q], side="right")
        least = big
        lo_, hi_ = start + size, stop + size
        while lo_ < hi_:
            if lo_ & 1:
                least = min(least, tree[lo_])
                lo_ += 1
            if hi_ & 1:
                hi_ -= 1
                least = min(least, tree[hi_])
            lo_ //= 2
            hi_ //= 2
        out[q] = least if least < big else -1
    return 0
