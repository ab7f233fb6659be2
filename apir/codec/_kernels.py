"""Every Numba kernel of the codec, behind one JIT helper.

Theory of operation: the hot paths (serializing a ggml_cgraph straight out of ggml's structs,
validating a graph the guest sent, bulk copies) work on raw memory. Typed loads and stores
(`load_u8/u32/i32/i64`, `store_u8/u32/i64`, `load_i64_at` / `store_i64_at`: alignment 1,
addresses as int64) and three block operations (`memmove`, `memcopy`, `memzero`) are plain
Python functions over ctypes; inside jitted code a `numba.extending.overload` swaps each for an `intrinsic` that
emits an LLVM `inttoptr` + load/store (or llvm.memmove/memcpy/memset). So every kernel here is
also a working plain-Python function: `kernel.py_func` is its twin, and tests compare the two.

Rules kept throughout (docs/numba-notes.md says why):
- addresses and 64-bit values are int64 (mixing uint64 and int64 would promote to float64);
- work arrays are fixed-size arguments; a kernel that runs out of room returns a negative
  code and the caller retries with double the size (never grow arrays inside a hot loop);
- kernels return error codes instead of raising, with details in a small `info` array.

Nothing here checks addresses: the callers pass only memory they own (the guest its own ggml
context; the host a private copy of the guest's bytes). The host's own kernels live in
apir.host.graph.kernels, built on these primitives.
"""

from __future__ import annotations

import ctypes
import secrets

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload, register_jitable

from apir import numba_cache

__all__ = [
    "jit",
    "load_u8",
    "load_u32",
    "load_i32",
    "load_i64",
    "load_i64_at",
    "store_i64_at",
    "store_u8",
    "store_u32",
    "store_i64",
    "memmove",
    "memcopy",
    "memzero",
    "memmove_kernel",
    "serialize_graph_kernel",
    "serialize_tensor_kernel",
    "parse_graph_kernel",
    "TABLE_KEY",
    "TL_FIELDS",
    "RL_FIELDS",
    "LIM_FIELDS",
    "SER_OUT_FULL",
    "SER_SET_FULL",
    "SER_NARROW",
    "SER_UNKNOWN_BUFFER",
    "SER_DATA_NO_BUFFER",
    "PARSE_ZERO_ID",
    "PARSE_DUP_ID",
    "PARSE_BAD_TYPE",
    "PARSE_BAD_OP",
    "PARSE_NAME",
    "PARSE_UNKNOWN_SRC",
    "PARSE_UNKNOWN_VIEW_SRC",
    "PARSE_UNKNOWN_NODE",
    "PARSE_CYCLE",
]


numba_cache.install()


def jit(fn):
    """The one JIT helper: nopython, cached on disk (one cache per machine,
    apir.numba_cache), GIL released while it runs."""
    return numba.njit(cache=True, nogil=True)(fn)


# Helpers the kernels share: compiled into their callers when jitted, plain Python otherwise,
# so a kernel's `.py_func` runs no compiled code at all.
helper = register_jitable


# --- raw memory: Python twins (ctypes) and their jitted intrinsics ------------------------------


def load_u8(addr):
    return ctypes.c_uint8.from_address(int(addr)).value


def load_u32(addr):
    return ctypes.c_uint32.from_address(int(addr)).value


def load_i32(addr):
    return ctypes.c_int32.from_address(int(addr)).value


def load_i64(addr):
    return ctypes.c_int64.from_address(int(addr)).value


def load_i64_at(addr, index):
    """The int64 at `addr + 8 * index`: word `index` of an int64 array at `addr`, any
    alignment. In a loop over `index` LLVM sees consecutive words (a `getelementptr`, where
    `load_i64(addr + 8 * index)` is an `inttoptr` per word) and vectorizes it: the record
    comparisons of the graph cache ran in 0.25-0.28 ms against 0.40-0.49 ms."""
    return load_i64(int(addr) + 8 * int(index))


def store_i64_at(addr, index, value):
    """Stores `value` as word `index` of an int64 array at `addr` (load_i64_at's store)."""
    store_i64(int(addr) + 8 * int(index), value)


def store_u8(addr, value):
    ctypes.c_uint8.from_address(int(addr)).value = int(value) & 0xFF


def store_u32(addr, value):
    ctypes.c_uint32.from_address(int(addr)).value = int(value) & 0xFFFFFFFF


def store_i64(addr, value):
    ctypes.c_int64.from_address(int(addr)).value = int(value)


def memmove(dst, src, size):
    """Copies `size` bytes from address `src` to address `dst` (regions may overlap)."""
    ctypes.memmove(int(dst), int(src), int(size))


def memcopy(dst, src, size):
    """Copies `size` bytes from address `src` to address `dst` (regions must not overlap)."""
    ctypes.memmove(int(dst), int(src), int(size))


def memzero(dst, size):
    """Zeroes `size` bytes at address `dst`."""
    ctypes.memset(int(dst), 0, int(size))


def _ptr(builder, addr, bits):
    return builder.inttoptr(addr, ir.IntType(bits).as_pointer())


def _make_load(nbits, is_signed):
    """An intrinsic loading an `nbits` integer at an address, widened to int64 (zero- or
    sign-extended) so kernels compute in one integer type."""

    @intrinsic
    def _load(typingctx, addr):
        if not isinstance(addr, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            a = context.cast(builder, args[0], sig.args[0], types.int64)
            value = builder.load(_ptr(builder, a, nbits), align=1)
            if nbits == 64:
                return value
            return builder.sext(value, ir.IntType(64)) if is_signed else builder.zext(value, ir.IntType(64))

        return types.int64(addr), codegen

    return _load


def _make_store(nbits):
    """An intrinsic storing the low `nbits` of an integer at an address."""

    @intrinsic
    def _store(typingctx, addr, value):
        if not (isinstance(addr, types.Integer) and isinstance(value, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            a = context.cast(builder, args[0], sig.args[0], types.int64)
            v = context.cast(builder, args[1], sig.args[1], types.int64)
            if nbits != 64:
                v = builder.trunc(v, ir.IntType(nbits))
            builder.store(v, _ptr(builder, a, nbits), align=1)
            return context.get_dummy_value()

        return types.void(addr, value), codegen

    return _store


_i_load_u8 = _make_load(8, False)
_i_load_u32 = _make_load(32, False)
_i_load_i32 = _make_load(32, True)
_i_load_i64 = _make_load(64, True)
_i_store_u8 = _make_store(8)
_i_store_u32 = _make_store(32)
_i_store_i64 = _make_store(64)


@intrinsic
def _i_load_i64_at(typingctx, addr, index):
    # word `index` of an int64 array at `addr`: a getelementptr, whose consecutive indices
    # LLVM can vectorize (an inttoptr per address it cannot), alignment 1 as every load here
    if not (isinstance(addr, types.Integer) and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        a = context.cast(builder, args[0], sig.args[0], types.int64)
        k = context.cast(builder, args[1], sig.args[1], types.int64)
        word = builder.gep(_ptr(builder, a, 64), [k])
        return builder.load(word, align=1)

    return types.int64(addr, index), codegen


@intrinsic
def _i_store_i64_at(typingctx, addr, index, value):
    if not all(isinstance(t, types.Integer) for t in (addr, index, value)):
        return None

    def codegen(context, builder, sig, args):
        a = context.cast(builder, args[0], sig.args[0], types.int64)
        k = context.cast(builder, args[1], sig.args[1], types.int64)
        v = context.cast(builder, args[2], sig.args[2], types.int64)
        builder.store(v, builder.gep(_ptr(builder, a, 64), [k]), align=1)
        return context.get_dummy_value()

    return types.void(addr, index, value), codegen


def _make_block_copy(llvm_name):
    """An intrinsic copying `size` bytes from address `src` to address `dst` with LLVM's
    `llvm_name` ("llvm.memmove": the ranges may overlap; "llvm.memcpy": they may not). A
    block copy, not a loop of 8-byte stores: LLVM turns such a loop over computed addresses
    into AVX-512 scatters, which cost more than the copy (4x the serializer's time)."""

    @intrinsic
    def _copy(typingctx, dst, src, size):
        if not all(isinstance(t, types.Integer) for t in (dst, src, size)):
            return None

        def codegen(context, builder, sig, args):
            d = context.cast(builder, args[0], sig.args[0], types.int64)
            s = context.cast(builder, args[1], sig.args[1], types.int64)
            n = context.cast(builder, args[2], sig.args[2], types.int64)
            i8p = ir.IntType(8).as_pointer()
            fn = builder.module.declare_intrinsic(llvm_name, [i8p, i8p, ir.IntType(64)])
            builder.call(fn, [builder.inttoptr(d, i8p), builder.inttoptr(s, i8p), n, ir.Constant(ir.IntType(1), 0)])
            return context.get_dummy_value()

        return types.void(dst, src, size), codegen

    return _copy


_i_memmove = _make_block_copy("llvm.memmove")
_i_memcopy = _make_block_copy("llvm.memcpy")


@intrinsic
def _i_memzero(typingctx, dst, size):
    # llvm.memset, for the same reason as _make_block_copy
    if not all(isinstance(t, types.Integer) for t in (dst, size)):
        return None

    def codegen(context, builder, sig, args):
        d = context.cast(builder, args[0], sig.args[0], types.int64)
        n = context.cast(builder, args[1], sig.args[1], types.int64)
        i8p = ir.IntType(8).as_pointer()
        fn = builder.module.declare_intrinsic("llvm.memset", [i8p, ir.IntType(64)])
        builder.call(fn, [builder.inttoptr(d, i8p), ir.Constant(ir.IntType(8), 0), n, ir.Constant(ir.IntType(1), 0)])
        return context.get_dummy_value()

    return types.void(dst, size), codegen


@overload(load_u8)
def _ol_load_u8(addr):
    return lambda addr: _i_load_u8(addr)


@overload(load_u32)
def _ol_load_u32(addr):
    return lambda addr: _i_load_u32(addr)


@overload(load_i32)
def _ol_load_i32(addr):
    return lambda addr: _i_load_i32(addr)


@overload(load_i64)
def _ol_load_i64(addr):
    return lambda addr: _i_load_i64(addr)


@overload(load_i64_at)
def _ol_load_i64_at(addr, index):
    return lambda addr, index: _i_load_i64_at(addr, index)  # type: ignore[call-arg]  # typingctx


@overload(store_i64_at)
def _ol_store_i64_at(addr, index, value):
    return lambda addr, index, value: _i_store_i64_at(addr, index, value)  # type: ignore[call-arg]  # typingctx


@overload(store_u8)
def _ol_store_u8(addr, value):
    return lambda addr, value: _i_store_u8(addr, value)


@overload(store_u32)
def _ol_store_u32(addr, value):
    return lambda addr, value: _i_store_u32(addr, value)


@overload(store_i64)
def _ol_store_i64(addr, value):
    return lambda addr, value: _i_store_i64(addr, value)


@overload(memmove)
def _ol_memmove(dst, src, size):
    return lambda dst, src, size: _i_memmove(dst, src, size)


@overload(memcopy)
def _ol_memcopy(dst, src, size):
    return lambda dst, src, size: _i_memcopy(dst, src, size)


@overload(memzero)
def _ol_memzero(dst, size):
    return lambda dst, size: _i_memzero(dst, size)  # type: ignore[call-arg]  # typingctx: numba passes it


@jit
def memmove_kernel(dst, src, size):
    """`memmove` with the GIL released: for large copies from Python threads."""
    memmove(dst, src, size)


# --- layout tables passed to the kernels ----------------------------------------------------------
# Byte offsets of ggml_tensor (tl) and apir_rpc_tensor (rl) fields, in this order; rl has two
# more entries: the record size and the `padding` offset. lim holds ggml's GGML_MAX_* sizes.
TL_FIELDS = ("type", "buffer", "ne", "nb", "op", "op_params", "flags", "src", "view_src", "view_offs", "data", "name")
RL_FIELDS = ("id",) + TL_FIELDS + ("padding",)
LIM_FIELDS = ("max_dims", "max_src", "n_op_params", "max_name")
(T_TYPE, T_BUFFER, T_NE, T_NB, T_OP, T_OP_PARAMS, T_FLAGS, T_SRC, T_VIEW_SRC, T_VIEW_OFFS, T_DATA, T_NAME) = range(12)
(
    R_ID,
    R_TYPE,
    R_BUFFER,
    R_NE,
    R_NB,
    R_OP,
    R_OP_PARAMS,
    R_FLAGS,
    R_SRC,
    R_VIEW_SRC,
    R_VIEW_OFFS,
    R_DATA,
    R_NAME,
    R_PADDING,
    R_SIZE,
) = range(15)
L_MAX_DIMS, L_MAX_SRC, L_N_OP_PARAMS, L_MAX_NAME = range(4)

# --- serializer (guest): ggml_cgraph in memory -> wire bytes ---------------------------------------
SER_OUT_FULL = -1  # the output array is too small: retry with double
SER_SET_FULL = -2  # the visited set / stack are too small: retry with double
SER_NARROW = -3  # info = (tensor address, 0 for ne / 1 for nb, dim, value)
SER_UNKNOWN_BUFFER = -4  # info = (tensor address, buffer pointer)
SER_DATA_NO_BUFFER = -5  # info = (tensor address, data pointer)

_U32_MAX = 0xFFFFFFFF
_SER_BATCH = 64  # tensors whose records serialize_graph_kernel writes in one call
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: Fibonacci hashing


@helper
def _slot(key, mask):
    # Multiplicative hash; (k * G) >> 32 has the same low bits whether the product wraps at
    # 64 bits (jitted) or not (Python), so both twins probe the same slots.
    return ((key * _GOLDEN) >> 32) & mask


_LOW62 = (1 << 62) - 1

# The multiplier of the hash tables whose keys the guest writes (tensor ids, record fields,
# rule groups): odd, below 2**62, drawn per process and passed to the kernels (a global would
# be compiled into the on-disk cache), so a guest cannot aim its keys at one probe chain (each
# insert would then compare against all before it: quadratic). `_slot` stays for the guest's
# own table of its tensor addresses (serialize_graph_kernel).
TABLE_KEY = secrets.randbits(61) << 1 | 1


@helper
def _mix(h, x, key):
    # h (in [0, 2**62)) with the int64 word x folded in. A slot is a hash's low bits, and the
    # low bits of a product never see the bits above them: without the folds (high bits
    # xored down, before and after each multiply by `key`), records differing only in a
    # word's high half (ne[1], nb[1], op_params[0]) or handles differing only in high bits
    # would all land in one slot. (Arithmetic shifts in both twins: Python's >> floors too.)
    # x's top two bits enter after the first multiply: cut with the product's (as they were
    # when x was xored in whole), they made x, ~x and x ^ (2**62 | 2**30) hash alike under
    # every key, and a guest flipping so each free word of its records (op_params) put 4**k
    # records in one probe chain. Now only a key-dependent pair of words collides.
    v = h ^ (x & _LOW62)
    v = ((v ^ (v >> 32)) * key) & _LOW62
    v = ((v ^ (v >> 29) ^ ((x >> 62) & 3)) * key) & _LOW62
    return v ^ (v >> 32)


@helper
def _set_insert(keys, key):
    """Inserts non-zero `key` into the open-addressing set `keys` (0 = empty, size a power
    of two). Returns 1 if inserted, 0 if present."""
    mask = keys.shape[0] - 1
    i = _slot(key, mask)
    while True:
        k = keys[i]
        if k == key:
            return 0
        if k == 0:
            keys[i] = key
            return 1
        i = (i + 1) & mask


@helper
def _layout_values(tl, rl, lim):
    """The layout arrays as tuples (12, 15 and 4 entries: TL_FIELDS, RL_FIELDS + size, LIM_FIELDS).
    A kernel reads its offsets from these: tuple entries are values the compiler keeps in
    registers, where array entries would be reloaded after every raw store (which might alias)."""
    t_off = (tl[0], tl[1], tl[2], tl[3], tl[4], tl[5], tl[6], tl[7], tl[8], tl[9], tl[10], tl[11])
    r_head = (rl[0], rl[1], rl[2], rl[3], rl[4], rl[5], rl[6], rl[7])
    r_off = r_head + (rl[8], rl[9], rl[10], rl[11], rl[12], rl[13], rl[14])
    sizes = (lim[0], lim[1], lim[2], lim[3])
    return t_off, r_off, sizes


@helper
def _write_records(tensors, n, dst, tl, rl, lim, buf_ptrs, buf_handles, buf_bases, info):
    """Writes the apir_rpc_tensor of each ggml_tensor at address tensors[0..n) to consecutive
    records from address `dst` (the C `apir_serialize_tensor`), every byte defined: holes and
    name tails zeroed. Returns 0 or a SER_* error with details in `info`.

    One loop over all tensors, calling no helper that takes an array: per tensor, a call (or
    even an inlined one) passing arrays reference-counts them, which cost more than the record."""
    t_off, r_off, sizes = _layout_values(tl, rl, lim)
    rec = r_off[R_SIZE]
    for i in range(n):
        t = tensors[i]
        r = dst + rec * i
        memzero(r, rec)
        store_i64(r + r_off[R_ID], t)
        store_u32(r + r_off[R_TYPE], load_u32(t + t_off[T_TYPE]))
        buf = load_i64(t + t_off[T_BUFFER])
        base = 0
        if buf != 0:
            # binary search of the sorted buffer pointers
            lo = 0
            hi = buf_ptrs.shape[0]
            while lo < hi:
                mid = (lo + hi) >> 1
                if buf_ptrs[mid] < buf:
                    lo = mid + 1
                else:
                    hi = mid
            b = lo if lo < buf_ptrs.shape[0] and buf_ptrs[lo] == buf else -1
            if b < 0:
                info[0] = t
                info[1] = buf
                return SER_UNKNOWN_BUFFER
            store_i64(r + r_off[R_BUFFER], buf_handles[b])
            base = buf_bases[b]
        for d in range(sizes[L_MAX_DIMS]):
            ne = load_i64(t + t_off[T_NE] + 8 * d)
            nb = load_i64(t + t_off[T_NB] + 8 * d)  # size_t: >= 2**63 reads negative
            if ((ne | nb) >> 32) != 0:  # either is negative or above u32
                _narrow_info(t, t_off, sizes, info)
                return SER_NARROW
            store_u32(r + r_off[R_NE] + 4 * d, ne)
            store_u32(r + r_off[R_NB] + 4 * d, nb)
        store_u32(r + r_off[R_OP], load_u32(t + t_off[T_OP]))
        memcopy(r + r_off[R_OP_PARAMS], t + t_off[T_OP_PARAMS], 4 * sizes[L_N_OP_PARAMS])
        store_u32(r + r_off[R_FLAGS], load_u32(t + t_off[T_FLAGS]))
        memcopy(r + r_off[R_SRC], t + t_off[T_SRC], 8 * sizes[L_MAX_SRC])
        store_i64(r + r_off[R_VIEW_SRC], load_i64(t + t_off[T_VIEW_SRC]))
        store_i64(r + r_off[R_VIEW_OFFS], load_i64(t + t_off[T_VIEW_OFFS]))
        data = load_i64(t + t_off[T_DATA])
        if data != 0:
            if buf == 0:
                info[0] = t
                info[1] = data
                return SER_DATA_NO_BUFFER
            data -= base
        store_i64(r + r_off[R_DATA], data)
        _copy_name(t + t_off[T_NAME], r + r_off[R_NAME], sizes[L_MAX_NAME])
    return 0


@helper
def _narrow_info(t, t_off, sizes, info):
    """Fills `info` for SER_NARROW: (tensor, 0 for ne / 1 for nb, dim, value)."""
    for d in range(sizes[L_MAX_DIMS]):
        ne = load_i64(t + t_off[T_NE] + 8 * d)
        nb = load_i64(t + t_off[T_NB] + 8 * d)
        if ne < 0 or ne > _U32_MAX or nb < 0 or nb > _U32_MAX:
            info[0] = t
            info[1] = 0 if (ne < 0 or ne > _U32_MAX) else 1
            info[2] = d
            info[3] = ne if info[1] == 0 else nb
            return


_ONES = 0x0101010101010101
_HIGHS = -0x7F7F7F7F7F7F7F80  # 0x8080808080808080 as int64
_LOW7 = 0x00FFFFFFFFFFFFFF  # the low 7 bytes of a word


@helper
def _first_nul(addr, n):
    """The index of the first NUL among the `n` bytes at `addr`, or `n` when there is none:
    8 bytes at a time (`_copy_name`'s test for a zero byte in a word), then byte by byte
    from the word that holds one. Reads none of the bytes past the `n`."""
    k = 0
    while k + 8 <= n:
        v = load_i64(addr + k)
        if (v - _ONES) & ~v & _HIGHS:
            break
        k += 8
    while k < n:
        if load_u8(addr + k) == 0:
            return k
        k += 1
    return n


@helper
def _copy_name(src, dst, max_name):
    """snprintf(dst, max_name, "%s", src) into zeroed `dst`: at most max_name - 1 bytes, then
    NUL (already 0). Whole 8-byte words: `m = (v - 0x01..) & ~v & 0x80..` is non-zero exactly
    when one of v's bytes is 0, and its lowest set bit is the first NUL's 0x80, so
    `(lowest >> 7) - 1` keeps the bytes before it; the last word's last byte is the
    terminator. Byte by byte when max_name is not a multiple of 8."""
    if max_name % 8 == 0:
        n_words = max_name >> 3
        for w in range(n_words):
            v = load_i64(src + 8 * w)
            if w == n_words - 1:
                v &= _LOW7
            m = (v - _ONES) & ~v & _HIGHS
            if m == 0:
                store_i64(dst + 8 * w, v)
                continue
            lowest = m & -m
            keep = _LOW7 if lowest < 0 else (lowest >> 7) - 1  # < 0: the NUL is byte 7 (bit 63)
            store_i64(dst + 8 * w, v & keep)
            return
        return
    c = 0
    while c < max_name - 1:
        ch = load_u8(src + c)
        if ch == 0:
            break
        store_u8(dst + c, ch)
        c += 1


@jit
def serialize_tensor_kernel(t, dst, tl, rl, lim, buf_ptrs, buf_handles, buf_bases, info):
    """One tensor's apir_rpc_tensor at `dst` (used by guest set/get_tensor): see
    `_write_records`. Returns 0 or a SER_* error with details in `info`."""
    one = np.empty(1, dtype=np.int64)
    one[0] = t
    return _write_records(one, 1, dst, tl, rl, lim, buf_ptrs, buf_handles, buf_bases, info)


@jit
def serialize_graph_kernel(
    nodes_addr,
    n_nodes,
    tl,
    rl,
    lim,
    buf_ptrs,
    buf_handles,
    buf_bases,
    out_addr,
    out_size,
    set_keys,
    stack_t,
    stack_k,
    info,
):
    """Serializes the cgraph whose node pointer array is at `nodes_addr` into `out_size`
    bytes at `out_addr`: ``u32 n_nodes | u64 ids[n_nodes] | u32 n_tensors | records``.

    Tensors are visited as the C `apir_add_tensor` does: src[0..max_src), then view_src,
    then the tensor itself, each once. `set_keys` (zeroed, size a power of two) is the
    visited set; `stack_t`/`stack_k` (same size) the explicit DFS stack. The visited tensors'
    records are written by `_write_records`, _SER_BATCH tensors per call, while their structs
    are still in cache (a call per tensor took 2x the whole kernel). Returns the number of
    bytes written, or a SER_* error (SER_OUT_FULL / SER_SET_FULL: retry with double)."""
    rec = rl[R_SIZE]
    max_src = lim[L_MAX_SRC]
    src_at = tl[T_SRC]
    view_src_at = tl[T_VIEW_SRC]
    if 8 + 8 * n_nodes > out_size:
        return SER_OUT_FULL
    cap_tensors = (out_size - 8 - 8 * n_nodes) // rec
    tensors_at = out_addr + 8 + 8 * n_nodes
    batch = np.empty(_SER_BATCH, dtype=np.int64)
    n_batch = 0
    max_fill = set_keys.shape[0] // 2
    n_seen = 0
    n_tensors = 0
    store_u32(out_addr, n_nodes)
    for i in range(n_nodes):
        root = load_i64(nodes_addr + 8 * i)
        store_i64(out_addr + 4 + 8 * i, root)
        if root == 0 or _set_insert(set_keys, root) == 0:
            continue
        n_seen += 1
        if n_seen > max_fill:
            return SER_SET_FULL
        sp = 0
        stack_t[0] = root
        stack_k[0] = 0
        while sp >= 0:
            t = stack_t[sp]
            k = stack_k[sp]
            # the next unvisited child (src[k..], then view_src) in one scan: most slots are 0
            child = 0
            while k <= max_src:
                c = load_i64(t + src_at + 8 * k) if k < max_src else load_i64(t + view_src_at)
                k += 1
                if c != 0 and _set_insert(set_keys, c) == 1:
                    child = c
                    break
            if child != 0:
                n_seen += 1
                if n_seen > max_fill:
                    return SER_SET_FULL
                stack_k[sp] = k
                sp += 1
                stack_t[sp] = child
                stack_k[sp] = 0
                continue
            if n_tensors + n_batch == cap_tensors:
                return SER_OUT_FULL
            batch[n_batch] = t
            n_batch += 1
            sp -= 1
            if n_batch == _SER_BATCH:
                dst = tensors_at + rec * n_tensors
                err = _write_records(batch, n_batch, dst, tl, rl, lim, buf_ptrs, buf_handles, buf_bases, info)
                if err != 0:
                    return err
                n_tensors += n_batch
                n_batch = 0
    dst = tensors_at + rec * n_tensors
    err = _write_records(batch, n_batch, dst, tl, rl, lim, buf_ptrs, buf_handles, buf_bases, info)
    if err != 0:
        return err
    n_tensors += n_batch
    store_u32(tensors_at - 4, n_tensors)
    return 8 + 8 * n_nodes + rec * n_tensors


# --- validating parser (host): wire bytes -> indices -------------------------------------------------
PARSE_ZERO_ID = -1  # info = (tensor index,)
PARSE_DUP_ID = -2  # info = (tensor index, id)
PARSE_BAD_TYPE = -3  # info = (tensor index, type)
PARSE_BAD_OP = -4  # info = (tensor index, op)
PARSE_NAME = -5  # info = (tensor index,)
PARSE_UNKNOWN_SRC = -6  # info = (tensor index, src slot, id)
PARSE_UNKNOWN_VIEW_SRC = -7  # info = (tensor index, id)
PARSE_UNKNOWN_NODE = -8  # info = (node index, id)
PARSE_CYCLE = -9  # info = (tensor index,)


@helper
def _map_find(keys, vals, key, hkey):
    mask = keys.shape[0] - 1
    i = _mix(0, key, hkey) & mask
    while True:
        k = keys[i]
        if k == key:
            return vals[i]
        if k == 0:
            return -1
        i = (i + 1) & mask


_LATER = -2  # parse_graph_kernel: a source not found among the tensors before its own (yet)


@helper
def _find_id(map_keys, map_vals, key, hkey, ids_at, rec, guess, n):
    # The index of the tensor whose id is `key` (-1: none), tensor `guess` tried first (a
    # source is most often the tensor just before, a node the tensor after the node before:
    # the order ggml_graph and the C's serializer list them in), then the map. Ids are
    # unique (checked), so a matching guess is the answer; `ids_at`: tensor 0's id.
    if 0 <= guess < n and load_i64(ids_at + rec * guess) == key:
        return guess
    return _map_find(map_keys, map_vals, key, hkey)


@jit
def parse_graph_kernel(
    src,
    addr,
    n_nodes,
    n_tensors,
    rl,
    lim,
    op_count,
    type_valid,
    node_index,
    src_index,
    view_src_index,
    order,
    map_keys,
    map_vals,
    state,
    stack_t,
    stack_k,
    info,
    hkey,
):
    """Copies a graph from `src` (the guest's bytes, counts already checked against their
    size) to `addr` (the host's private copy: ids at addr + 4, records at addr + 8 + 8 *
    n_nodes), validates the copy and fills the index arrays. Each record is copied just
    before it is checked, so it is read from the guest once and checked in cache; the copy
    is complete only when the graph is valid. `map_keys` (zeroed, a power of two >= 2 *
    n_tensors) / `map_vals` map ids to tensor indices, slots hashed with multiplier `hkey`
    (TABLE_KEY: the ids are the guest's); `state` (zeroed int8), `stack_t` / `stack_k`
    (int32, n_tensors) are the cycle check's DFS. Returns 0 or a PARSE_* error with details
    in `info`."""
    rec = rl[R_SIZE]
    max_src = lim[L_MAX_SRC]
    max_name = lim[L_MAX_NAME]
    tensors_at = addr + 8 + 8 * n_nodes
    n_types = type_valid.shape[0]
    mask = map_keys.shape[0] - 1
    sources_first = True  # every src and view_src listed before its tensor (the C's order)
    later = False  # a src or view_src not among the tensors before its own
    ids_at = tensors_at + rl[R_ID]
    memcopy(addr, src, 8 + 8 * n_nodes)
    for i in range(n_tensors):
        r = tensors_at + rec * i
        memcopy(r, src + 8 + 8 * n_nodes + rec * i, rec)
        tid = load_i64(r + rl[R_ID])
        if tid == 0:
            info[0] = i
            return PARSE_ZERO_ID
        j = _mix(0, tid, hkey) & mask
        while True:
            k = map_keys[j]
            if k == tid:
                info[0] = i
                info[1] = tid
                return PARSE_DUP_ID
            if k == 0:
                map_keys[j] = tid
                map_vals[j] = i
                break
            j = (j + 1) & mask
        ty = load_u32(r + rl[R_TYPE])
        if ty >= n_types or not type_valid[ty]:
            info[0] = i
            info[1] = ty
            return PARSE_BAD_TYPE
        op = load_u32(r + rl[R_OP])
        if op >= op_count:
            info[0] = i
            info[1] = op
            return PARSE_BAD_OP
        if _first_nul(r + rl[R_NAME], max_name) == max_name:
            info[0] = i
            return PARSE_NAME
        # Sources listed before the tensor (the C's order) are found now, while its record is
        # in cache (the map holds tensors 0..i); any other waits for the pass below.
        for s in range(max_src):
            sid = load_i64(r + rl[R_SRC] + 8 * s)
            idx = -1
            if sid != 0:
                idx = _find_id(map_keys, map_vals, sid, hkey, ids_at, rec, i - 1, i)
                if idx < 0:
                    idx = _LATER
                    later = True
                elif idx == i:
                    sources_first = False
            src_index[i, s] = idx
        vid = load_i64(r + rl[R_VIEW_SRC])
        idx = -1
        if vid != 0:
            idx = _find_id(map_keys, map_vals, vid, hkey, ids_at, rec, i - 1, i)
            if idx < 0:
                idx = _LATER
                later = True
            elif idx == i:
                sources_first = False
        view_src_index[i] = idx
    # Sources listed after their tensor, or not at all: in tensor order, as the errors go.
    for i in range(n_tensors if later else 0):
        r = tensors_at + rec * i
        for s in range(max_src):
            if src_index[i, s] == _LATER:
                sid = load_i64(r + rl[R_SRC] + 8 * s)
                idx = _map_find(map_keys, map_vals, sid, hkey)
                if idx < 0:
                    info[0] = i
                    info[1] = s
                    info[2] = sid
                    return PARSE_UNKNOWN_SRC
                sources_first = sources_first and idx < i
                src_index[i, s] = idx
        if view_src_index[i] == _LATER:
            vid = load_i64(r + rl[R_VIEW_SRC])
            idx = _map_find(map_keys, map_vals, vid, hkey)
            if idx < 0:
                info[0] = i
                info[1] = vid
                return PARSE_UNKNOWN_VIEW_SRC
            sources_first = sources_first and idx < i
            view_src_index[i] = idx
    idx = -1
    for i in range(n_nodes):
        nid = load_i64(addr + 4 + 8 * i)
        guess = idx + 1
        idx = -1
        if nid != 0:
            idx = _find_id(map_keys, map_vals, nid, hkey, ids_at, rec, guess, n_tensors)
        if idx < 0:
            info[0] = i
            info[1] = nid
            return PARSE_UNKNOWN_NODE
        node_index[i] = idx
    if sources_first:
        # No cycle can exist, and the search below would give the tensors' own order: it
        # would meet every source already finished (a third of the kernel's time, saved).
        for i in range(n_tensors):
            order[i] = i
        return 0
    # Depth-first post-order over src and view_src edges; a grey tensor met again is a cycle.
    n_done = 0
    for root in range(n_tensors):
        if state[root] != 0:
            continue
        state[root] = 1
        sp = 0
        stack_t[0] = root
        stack_k[0] = 0
        while sp >= 0:
            t = stack_t[sp]
            k = stack_k[sp]
            if k <= max_src:
                stack_k[sp] = k + 1
                c = src_index[t, k] if k < max_src else view_src_index[t]
                if c >= 0:
                    if state[c] == 1:
                        info[0] = t
                        return PARSE_CYCLE
                    if state[c] == 0:
                        state[c] = 1
                        sp += 1
                        stack_t[sp] = c
                        stack_k[sp] = 0
                continue
            state[t] = 2
            order[n_done] = t
            n_done += 1
            sp -= 1
    return 0
