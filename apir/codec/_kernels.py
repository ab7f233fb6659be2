"""Every Numba kernel of the codec, behind one JIT helper.

Theory of operation: the hot paths (serializing a ggml_cgraph straight out of ggml's structs,
validating a graph the guest sent, bulk copies) work on raw memory. Four tiny typed loads and
three stores (`load_u8/u32/i32/i64`, `store_u8/u32/i64`, all alignment 1, addresses as int64;
`load_i64_at` / `store_i64_at` read and write word k of an int64 array at an address, for loops
LLVM may vectorize)
and three block operations (`memmove`, `memcopy`, `memzero`) are plain Python functions over
ctypes; inside jitted code a `numba.extending.overload` swaps each for an `intrinsic` that
emits an LLVM `inttoptr` + load/store (or llvm.memmove/memcpy/memset). So every kernel here is
also a working plain-Python function: `kernel.py_func` is its twin, and tests compare the two.

Rules kept throughout (docs/numba-notes.md says why):
- addresses and 64-bit values are int64 (mixing uint64 and int64 would promote to float64);
- work arrays are fixed-size arguments; a kernel that runs out of room returns a negative
  code and the caller retries with double the size (never grow arrays inside a hot loop);
- kernels return error codes instead of raising, with details in a small `info` array.

Nothing here checks addresses: the callers pass only memory they own (the guest its own ggml
context; the host a private copy of the guest's bytes). A bad address crashes the process.
One exception, with arrays rather than addresses: the kernels that compare a graph where it
lies in the guest's shared memory with a cached one (`record_match_kernel`,
`records_match_kernel`, `records_moved_kernel`, `ids_moved_kernel`, `ids_link_kernel`, for
apir.host.graph.cache.GraphCache.take_same) read no byte past the cached graph's size, and
their answer is all that is used.
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
    "TABLE_KEY",
    "call_ptr_ptr_i32_i64",
    "call_void_ptr_ptr",
    "new_tensors_kernel",
    "add_nodes_kernel",
    "write_tensors_kernel",
    "record_fields_kernel",
    "record_bounds_kernel",
    "graph_writes_kernel",
    "first_overlap_kernel",
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
    and the probe on each tensor of a model's repeated layers: 0.70 against 0.40 ms on a
    10k-node graph). Returns the number of groups."""
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
    Returns the number of groups. (numpy's `rep == arange` and bincount: 60 us a 10k graph.)"""
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
    only. Returns 0."""
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
    its extent (TensorChecker.extent), data offset, view_offs, the index of its buffer
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
def first_overlap_kernel(w_buf, w_lo, w_hi, w_pos, q_buf, q_lo, q_hi, out, direct_max):
    """`out[q]` = the least `w_pos[w]` over the writes w whose bytes [w_lo, w_hi) overlap
    query q's [q_lo, q_hi) in the same buffer (`w_buf[w] == q_buf[q]`, `w_lo < q_hi` and
    `q_lo < w_hi`: an empty range overlaps one that strictly contains its offset), or -1 where
    none does. All int64, positions >= 0. A sweep: the writes in (buffer, lo) order enter a
    segment tree of least positions over their (buffer, hi) order while their lo is below the
    query's hi (queries in (buffer, hi) order); a query takes the least over its buffer's
    writes whose hi is above its lo. O((W + Q) log W), where comparing every pair is
    quadratic in a graph of many row-id readers; at most `direct_max` pairs (a graph's few
    readers: the sweep's sorts would cost more) are compared one by one. Returns 0."""
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
