"""apir.host.graph.kernels: the host's accelerated path gives the plain path's answers.

The same inputs run on a fresh host context twice, once with the Numba kernels and once
with `apir.accel.enabled()` False (as under APIR_ACCEL=0): every command's return code,
every refusal's fields (message, node, op, reason, rule), the data blob and each host
buffer's bytes after the input must be equal. The inputs are hostile: the fuzzer's
reproducers (tests/fuzz/reproducers/, each a crash or hang the fuzzer once found) and the
first inputs of the CI corpus's seed (tests/fuzz: mutated graphs and command sequences).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from apir import accel
from apir.host.errors import log as host_log
from tests.fuzz.inputs import Env, Fences, Recording

_REPRODUCERS = sorted((Path(__file__).resolve().parents[1] / "fuzz" / "reproducers").glob("*.json"))
_CORPUS_SEED, _CORPUS_INPUTS = 1, 300
_CONFIG = {  # (as the fuzz child's: one ggml thread, a bounded budget and graph time)
    "apir.host.n_threads": "1",
    "apir.host.buffer_budget": str(256 << 20),
    "apir.host.graph_time_limit_s": "5",
}


class _Refusals(logging.Handler):
    """The fields of each refusal the host logs (apir.host.backend.dispatcher)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.seen: list = []

    def emit(self, record: logging.LogRecord) -> None:
        exc = getattr(record, "refusal", None)
        if exc is not None:
            self.seen.append((str(exc), exc.node, exc.op, exc.reason, exc.rule))


@pytest.fixture(scope="module")
def fences():
    return Fences()


def _outcome(fences: Fences, rec: Recording) -> tuple:
    """What the host answered to `rec`'s steps on a fresh context: each command's return code,
    the refusals, the data blob and each host buffer (None once freed), whether the host
    answers after it, and how many graphs it computed."""
    refusals = _Refusals()
    host_log.addHandler(refusals)
    env = Env(fences, rec.config, rec.graph_size, meta=rec.meta)
    try:
        handles = env.alloc(rec.images)
        rcs = []
        for kind, res, data in rec.steps:
            if kind == "blob":
                env.write(res, data)
            else:
                rcs.append(env.submit(data)[0])
        lib = env.ctx._library
        buffers = []
        for h in handles:
            b = lib.buffers.get(h)
            buffers.append(None if b is None else ctypes.string_at(b.base, b.size))
        return rcs, refusals.seen, bytes(env.data), buffers, env.alive(), env.computed
    finally:
        env.close()
        host_log.removeHandler(refusals)


def _on_both_paths(fences: Fences, rec: Recording, monkeypatch) -> tuple:
    fast = _outcome(fences, rec)
    with monkeypatch.context() as m:
        m.setattr(accel, "enabled", lambda: False)
        plain = _outcome(fences, rec)
    return fast, plain


@pytest.fixture
def kernels_on():
    if not accel.enabled():
        pytest.skip("the kernels are off in this process (APIR_ACCEL=0 or no Numba)")


@pytest.mark.parametrize("path", _REPRODUCERS, ids=[p.stem for p in _REPRODUCERS])
def test_reproducers_alike_on_both_paths(ggml, fences, path, kernels_on, monkeypatch):
    rec = Recording.from_json(path.read_text())
    if json.loads(path.read_text())["meta"].get("ggml") != ggml.version:
        pytest.skip(f"recorded on ggml {rec.meta.get('ggml')}")
    fast, plain = _on_both_paths(fences, rec, monkeypatch)
    assert fast[4] and plain[4]  # (the host answers after the input)
    assert fast == plain


@pytest.fixture(scope="module")
def corpus(ggml, tmp_path_factory):
    """The fuzzer's seed graphs and its mutator."""
    from apir.host import HostContext
    from tests.fuzz.corpus import load_or_build_seeds
    from tests.fuzz.mutate import Mutator
    from tests.host.hostkit import Guest

    cache = str(tmp_path_factory.mktemp("fuzz") / "seeds.pickle")
    seeds, _ = load_or_build_seeds(ggml, lambda: Guest(HostContext(900, dict(_CONFIG))), cache)
    return seeds, Mutator(ggml)


def test_corpus_inputs_alike_on_both_paths(ggml, fences, corpus, kernels_on, monkeypatch):
    """The CI corpus's first inputs (input i as the fuzz child makes it), each recorded on
    the accelerated path and replayed on the plain one. Some are refused, some computed."""
    seeds, mutator = corpus
    refused = computed = 0
    for i in range(_CORPUS_INPUTS):
        rng = np.random.default_rng([_CORPUS_SEED, i])
        seed = seeds[int(rng.integers(len(seeds)))]
        env = Env(fences, dict(_CONFIG), 4096, meta={"ggml": ggml.version, "index": i})
        try:
            mutator.make_input(rng, seed, env)
        finally:
            env.close()
        fast, plain = _on_both_paths(fences, env.rec, monkeypatch)
        assert fast == plain, (i, seed.name, fast[:2], plain[:2])
        refused += bool(fast[1])
        computed += fast[5]
    assert refused > _CORPUS_INPUTS // 2 and computed > 10, (refused, computed)


def test_the_plain_host_imports_no_host_kernel():
    """With APIR_ACCEL=0 the host's graph modules and its dispatcher run without importing
    apir.host.graph.kernels (nor, through it, Numba for the host's part)."""
    code = (
        "import sys; import apir.host.backend.dispatcher, apir.host.graph.build, apir.host.graph.cache, "
        "apir.host.graph.rule_memo; print('apir.host.graph.kernels' in sys.modules)"
    )
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, APIR_ACCEL="0", PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False"]


@pytest.mark.parametrize("twin", [False, True], ids=["jitted", "py_func"])
def test_copy_written_kernel_finds_the_plain_search_s_write(kernels_on, twin):
    """copy_written_kernel (and its Python twin) against apir.host.graph.build's
    `_copy_written_plain` on random graphs: nodes in any order, ops that write nothing or
    update their sources in place, views of the copied tensors counted or not, the ops int64
    side by side (as the build passes them: its records check's `ops`)."""
    from apir.host.graph import build as hg
    from apir.host.graph.kernels import copy_written_kernel

    kernel = copy_written_kernel.py_func if twin else copy_written_kernel
    rng = np.random.default_rng(33)
    seen = {"none": 0, "node": 0, "source": 0}
    for trial in range(300 if twin else 3000):
        n, n_ops, max_src = int(rng.integers(1, 30)), 6, 3
        ops = rng.integers(0, n_ops, n).astype(np.int64)
        empty, opt_step = rng.random(n_ops) < 0.3, rng.random(n_ops) < 0.3
        src = np.where(rng.random((n, max_src)) < 0.5, rng.integers(0, n, (n, max_src)), -1).astype(np.int32)
        view_src = np.where(rng.random(n) < 0.3, rng.integers(0, n, n), -1).astype(np.int32)
        nodes = rng.permutation(n)[: int(rng.integers(0, n + 1))].astype(np.int64)
        copied = rng.random(n) < 0.1
        args = (nodes, ops, empty, opt_step, src, view_src, copied, bool(rng.integers(2)))
        want = hg._copy_written_plain(*args)
        got = tuple(int(x) for x in kernel(*args))
        assert got == want, (trial, got, want)
        seen["none" if want[0] < 0 else "node" if want[0] == want[1] else "source"] += 1
    assert min(seen.values()) > 10, seen
