"""apir.codec.atomics_accel: the LLVM orderings its Numba intrinsics emit (the plain path's
behaviour, shared with this twin, is tests/codec/test_atomics.py's)."""

import numpy as np
import pytest

from apir import accel

pytestmark = pytest.mark.skipif(not accel.enabled(), reason="apir.accel is off: no Numba twin")


def _ir(name, *args):
    """LLVM IR of a fresh, uncached compile of the Numba twin `name` (cached code cannot be
    inspected)."""
    import numba

    from apir.codec import atomics_accel

    fresh = numba.njit(getattr(atomics_accel, name).py_func)
    fresh(*args)
    return "\n".join(fresh.inspect_llvm().values())


def test_llvm_orderings_are_acquire_and_release():
    """ARM64 correctness rests on these orderings (LLVM lowers them to ldar / stlr)."""
    arr = np.zeros(16, np.uint8)
    load_lines = [l for l in _ir("load_acquire", arr, 0).splitlines() if "load atomic" in l]
    assert load_lines and all("acquire, align 4" in l and "i32" in l for l in load_lines)
    spin_lines = [l for l in _ir("spin_until_nonzero", arr, 0, 1).splitlines() if "load atomic" in l]
    assert spin_lines and all("acquire" in l for l in spin_lines)
    store_lines = [l for l in _ir("store_release", arr, 0, 1).splitlines() if "store atomic" in l]
    assert store_lines and all("release, align 4" in l and "i32" in l for l in store_lines)


def test_store_then_spin_orderings():
    arr = np.zeros(16, np.uint8)
    ir = _ir("store_then_spin", arr, 0, 1, arr, 4, 2, arr, 8, 1, True, 0).splitlines()
    stores = [l for l in ir if "store atomic" in l]
    loads = [l for l in ir if "load atomic" in l]
    assert len(stores) >= 3 and all("release, align 4" in l for l in stores)
    assert loads and all("acquire, align 4" in l for l in loads)


def test_store_then_load_has_a_full_fence_between():
    """The exec ring's notification suppression rests on this: store (release), a seq_cst
    fence (mfence on x86-64, dmb ish on ARM64), then the load (acquire); without the fence x86
    may let the load pass the store."""
    arr = np.zeros(16, np.uint8)
    ir = [l.strip() for l in _ir("store_fence_load", arr, 0, 1, arr, 8).splitlines()]
    ops = [l for l in ir if l.startswith(("store atomic", "fence ")) or "= load atomic" in l]
    kinds = ["store" if "store atomic" in l else "fence" if l.startswith("fence") else "load" for l in ops]
    # the function's own body comes first (later fences are the wrapper's reference counting)
    assert kinds[:3] == ["store", "fence", "load"], ops
    assert "release" in ops[0] and ops[1] == "fence seq_cst" and "acquire" in ops[2]
    two = [l for l in _ir("store_two", arr, 0, 1, arr, 8, 2).splitlines() if "store atomic" in l]
    assert len(two) == 2 and all("release, align 4" in l for l in two)
    spin = [l for l in _ir("spin_while_equal", arr, 0, np.uint32(0), 1).splitlines() if "load atomic" in l]
    assert spin and all("acquire" in l for l in spin)
