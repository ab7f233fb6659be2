"""The Numba twin of `apir.codec.atomics` (imported only when `apir.accel.enabled()`): real
atomics, and spins that run without the GIL.

A Numba intrinsic emits LLVM `load atomic i32 ... acquire, align 4` and `store atomic i32 ...
release, align 4` (plain movs on x86-64, ldar/stlr on ARM64), a `fence seq_cst` for
`store_fence_load`, and the CPU's spin-wait hint between loads. The jitted functions run with
the GIL released, so an embedded host serving from another thread of the same process keeps
running while the guest spins; a spin makes all its loads in one call.

`nonzero_u32_callback()` is a C function ``bool f(void *word)`` compiled by Numba: ggml's abort
callback, called after every node, is then one acquire load and never takes the GIL.

Each function takes a 1-d uint8 array and a byte offset, checked by `apir.codec.atomics`.
"""

from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from apir import numba_cache

__all__ = [
    "load_acquire",
    "store_release",
    "spin_until_nonzero",
    "spin_while_equal",
    "store_two",
    "store_fence_load",
    "store_then_spin",
    "nonzero_u32_callback",
]

# Intrinsics and the functions using them live in one file: Numba's on-disk cache of a
# function is invalidated only by changes to its own file (docs/numba-notes.md).
# (in the machine-wide cache folder of apir.numba_cache)
numba_cache.install()
_jit = njit(cache=True, nogil=True)


def _word_pointer(context, builder, arrty, arr, offset):
    """An `i32*` to byte `offset` of a 1-d uint8 array's data."""
    ary = context.make_array(arrty)(context, builder, arr)
    byte_ptr = builder.gep(builder.bitcast(ary.data, ir.IntType(8).as_pointer()), [offset])
    return builder.bitcast(byte_ptr, ir.IntType(32).as_pointer())


@intrinsic
def _load_acquire_intrinsic(typingctx, arr, offset):
    sig = types.uint32(arr, types.intp)

    def codegen(context, builder, signature, args):
        offset = context.cast(builder, args[1], signature.args[1], types.intp)
        ptr = _word_pointer(context, builder, signature.args[0], args[0], offset)
        return builder.load_atomic(ptr, "acquire", 4)

    return sig, codegen


@intrinsic
def _store_release_intrinsic(typingctx, arr, offset, value):
    sig = types.void(arr, types.intp, types.uint32)

    def codegen(context, builder, signature, args):
        offset = context.cast(builder, args[1], signature.args[1], types.intp)
        value = context.cast(builder, args[2], signature.args[2], types.uint32)
        ptr = _word_pointer(context, builder, signature.args[0], args[0], offset)
        builder.store_atomic(value, ptr, "release", 4)
        return context.get_dummy_value()

    return sig, codegen


# The spin-wait hint between loads: it keeps a spinning core from flooding the memory system
# and from starving a sibling hardware thread (which may run the thread being waited for).
# (LLVM intrinsics, not inline asm: Numba's JIT has no asm parser.)
_MACHINE = platform.machine().lower()
_RELAX = {
    "x86_64": ("llvm.x86.sse2.pause", None),
    "amd64": ("llvm.x86.sse2.pause", None),
    "aarch64": ("llvm.aarch64.hint", 1),
    "arm64": ("llvm.aarch64.hint", 1),
}.get(_MACHINE)  # 1: YIELD


@intrinsic
def _fence_seq_cst_intrinsic(typingctx):
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _cpu_relax_intrinsic(typingctx):
    sig = types.void()

    def codegen(context, builder, signature, args):
        if _RELAX is not None:
            name, hint = _RELAX
            argtys = [] if hint is None else [ir.IntType(32)]
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), argtys), name)
            builder.call(fn, [] if hint is None else [ir.Constant(ir.IntType(32), hint)])
        return context.get_dummy_value()

    return sig, codegen


@_jit
def load_acquire(arr, offset):
    return _load_acquire_intrinsic(arr, offset)  # type: ignore[call-arg]  # typingctx: numba passes it


@_jit
def store_release(arr, offset, value):
    _store_release_intrinsic(arr, offset, np.uint32(value))  # type: ignore[call-arg]  # typingctx: numba passes it


@_jit
def spin_until_nonzero(arr, offset, spins):
    value = np.uint32(0)
    for _ in range(spins):
        value = _load_acquire_intrinsic(arr, offset)  # type: ignore[call-arg]  # typingctx: numba passes it
        if value != 0:
            break
        _cpu_relax_intrinsic()
    return value


@_jit
def store_then_spin(arr, offset, value, arr2, offset2, value2, wait_arr, wait_offset, spins, clear, settle):
    _store_release_intrinsic(arr, offset, np.uint32(value))  # type: ignore[call-arg]  # typingctx: numba passes it
    _store_release_intrinsic(arr2, offset2, np.uint32(value2))
    seen = np.uint32(0)
    for _ in range(spins):
        seen = _load_acquire_intrinsic(wait_arr, wait_offset)
        if seen != 0:
            break
        _cpu_relax_intrinsic()
    if clear and seen != 0:
        _store_release_intrinsic(wait_arr, wait_offset, np.uint32(0))
    if seen == 2:
        for _ in range(settle):
            _cpu_relax_intrinsic()
    return seen


@_jit
def store_fence_load(arr, offset, value, load_arr, load_offset):
    _store_release_intrinsic(arr, offset, np.uint32(value))  # type: ignore[call-arg]  # typingctx: numba passes it
    _fence_seq_cst_intrinsic()
    return _load_acquire_intrinsic(load_arr, load_offset)


@_jit
def store_two(arr, offset, value, arr2, offset2, value2):
    _store_release_intrinsic(arr, offset, np.uint32(value))  # type: ignore[call-arg]  # typingctx: numba passes it
    _store_release_intrinsic(arr2, offset2, np.uint32(value2))


@_jit
def spin_while_equal(arr, offset, old, spins):
    value = np.uint32(old)
    for _ in range(spins):
        value = _load_acquire_intrinsic(arr, offset)  # type: ignore[call-arg]  # typingctx: numba passes it
        if value != old:
            break
        _cpu_relax_intrinsic()
    return value


_nonzero_u32_cfunc = None


def nonzero_u32_callback() -> int:
    """The address of a C function ``bool f(void *word)``: whether the u32 at `word` (4-byte
    aligned) is non-zero, by an acquire load; it never takes the GIL. Compiled, or loaded from
    Numba's cache, on the first call (defined here, beside the intrinsic it uses: see the note on
    Numba's cache above)."""
    global _nonzero_u32_cfunc
    if _nonzero_u32_cfunc is None:

        @cfunc(types.boolean(types.voidptr), cache=True)
        def nonzero_u32(word):
            return _load_acquire_intrinsic(carray(word, 4, np.uint8), 0) != 0  # type: ignore[call-arg]  # typingctx: numba passes it

        _nonzero_u32_cfunc = nonzero_u32
    address = _nonzero_u32_cfunc.address
    assert address is not None  # a compiled cfunc always has one
    return address
