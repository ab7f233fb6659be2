"""The build helper thread (apir.host.graph.build_helper) beside a graph's first build: the same
host graph as one thread builds, the same refusals, its errors raised to the caller, and the
caller gone from build_graph_parts only after the helper is done with the scratch."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from apir.codec.graph import parse_graph
from apir.host.graph import build_helper
from apir.host.graph import build as hg
from apir.host.errors import Refused
from apir.host.tensors import Scratch
from tests.host.hostilekit import host_tensors
from tests.host.hostkit import GgmlScratch, RemoteGraph, add_chain

_ROOT = Path(__file__).resolve().parents[2]

needs_two_cpus = pytest.mark.skipif(build_helper.helper_cpus() < 2, reason="one CPU: no build helper")


@pytest.fixture
def chain(guest, ggml):
    """(lib, wire) of a graph of 2,101 tensors (2,100 ADD nodes): over the size at which the
    helper takes part by default."""
    s = GgmlScratch(ggml, 3000)  # (room for the tensors, and for a cgraph of 4,096 nodes)
    remote = RemoteGraph(guest, ggml, s.ctx, add_chain(ggml, s.ctx, 2100, 4096))
    yield guest.ctx._library, remote.wire
    remote.close()
    s.close()


def _parse(lib, wire):
    g = lib.g
    return parse_graph(wire, limits=g.limits, op_count=g.op_count, type_valid=lib.checker.valid_types)


def _made(lib, parsed):
    """The host tensors build_graph_parts makes of `parsed` (hostilekit.host_tensors)."""
    with Scratch(lib.g, len(parsed.tensors), max(len(parsed.node_index), 1)) as scratch:
        built = hg.build_graph_parts(lib, parsed, scratch, hg.lib_op_enums(lib))
        return host_tensors(lib.checker.tensor_dtype, built.host)


def test_beside_runs_on_another_thread_or_not_at_all(monkeypatch):
    if build_helper.helper_cpus() >= 2:
        job = build_helper.beside(threading.get_ident)
        assert job is not None and job.result(timeout=10) != threading.get_ident()
    monkeypatch.setattr(build_helper, "enabled", False)
    assert build_helper.beside(threading.get_ident) is None
    monkeypatch.setattr(build_helper, "enabled", True)
    monkeypatch.setattr(build_helper, "helper_cpus", lambda: 1)
    assert build_helper.beside(threading.get_ident) is None


@needs_two_cpus
def test_a_large_graph_is_built_beside_as_on_one_thread(chain, monkeypatch):
    lib, wire = chain
    assert len(_parse(lib, wire).tensors) >= hg._BESIDE_MIN_TENSORS
    threads = []
    make = hg._create_tensors
    monkeypatch.setattr(hg, "_create_tensors", lambda *a: threads.append(threading.get_ident()) or make(*a))
    beside = _made(lib, _parse(lib, wire))
    monkeypatch.setattr(build_helper, "enabled", False)
    alone = _made(lib, _parse(lib, wire))
    assert threads[0] != threading.get_ident() and threads[1] == threading.get_ident()
    assert beside == alone
    assert len(alone) == 2101 and alone[-1][4][:2] == (2099, 0)  # the last ADD: the one before, and x


@needs_two_cpus
def test_a_refusal_waits_for_the_helper_to_leave_the_scratch(chain, monkeypatch):
    """A node's refusal comes while the helper still writes the host tensors: the build
    raises only after it is done (the caller frees the scratch next)."""
    lib, wire = chain
    parsed = _parse(lib, wire)
    parsed.tensors["ne"][len(parsed.tensors) - 1, 0] = 7  # the last ADD's result: 7 wide, its sources 8
    done = []
    make = hg._create_tensors

    def slow(*args):
        time.sleep(0.3)
        out = make(*args)
        done.append(True)
        return out

    monkeypatch.setattr(hg, "_create_tensors", slow)
    with Scratch(lib.g, len(parsed.tensors), len(parsed.node_index)) as scratch:
        with pytest.raises(Refused, match=f"node {len(parsed.tensors) - 1}"):
            hg.build_graph_parts(lib, parsed, scratch, hg.lib_op_enums(lib))
        assert done == [True]


@needs_two_cpus
@pytest.mark.parametrize("where", ["_check_records", "_create_tensors"])
def test_an_error_on_the_helper_is_raised_to_the_caller(chain, where, monkeypatch):
    lib, wire = chain

    def fail(*args):
        assert threading.current_thread().name.startswith("apir-build-helper")
        raise MemoryError(f"no room in {where}")

    monkeypatch.setattr(hg, where, fail)
    parsed = _parse(lib, wire)
    with Scratch(lib.g, len(parsed.tensors), len(parsed.node_index)) as scratch:
        with pytest.raises(MemoryError, match=where):
            hg.build_graph_parts(lib, parsed, scratch, hg.lib_op_enums(lib))
    monkeypatch.undo()
    assert len(_made(lib, _parse(lib, wire))) == 2101  # the helper still serves the next build


_FORK_CHILD = r"""
import os, sys, threading
from apir.host.graph import build_helper

assert build_helper.beside(threading.get_ident).result(timeout=10) != threading.get_ident()
pid = os.fork()
if pid == 0:  # the parent's helper thread is not in this process: a new one must answer
    job = build_helper.beside(os.getpid)
    os._exit(0 if job is not None and job.result(timeout=10) == os.getpid() else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@needs_two_cpus
def test_a_forked_child_gets_its_own_helper():
    env = dict(os.environ, PYTHONPATH=str(_ROOT))
    done = subprocess.run([sys.executable, "-c", _FORK_CHILD], env=env, cwd=_ROOT, timeout=120, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()


def test_rule_groups_are_the_callers_while_records_are_the_helpers(chain, monkeypatch):
    """The order the build keeps with the helper: the rules see the record checks' answer
    (a record refused before any node), as on one thread."""
    lib, wire = chain
    parsed = _parse(lib, wire)
    parsed.tensors["data"][5] = np.iinfo(np.uint64).max - 3  # tensor 5's data far past its buffer
    parsed.tensors["ne"][len(parsed.tensors) - 1, 0] = 7  # and a node refused by its rule
    errors = []
    for enabled in (True, False):
        monkeypatch.setattr(build_helper, "enabled", enabled)
        with Scratch(lib.g, len(parsed.tensors), len(parsed.node_index)) as scratch:
            with pytest.raises(Refused) as exc:
                hg.build_graph_parts(lib, parsed, scratch, hg.lib_op_enums(lib))
            errors.append(str(exc.value))
    assert errors[0] == errors[1] and "5" in errors[0]
