"""The protocol fuzzers in CI: the socket host's framing, the vhost-user device's messages and
virtqueues, and several guests racing on one host (docs/security.md, "Fuzzing").

Each runs a short seeded corpus (`APIR_FUZZ_PROTOCOL_INPUTS` scales it; a few hundred inputs
by default, each a hostile peer and then a fresh well-behaved one) and must find nothing; the
harness must see each kind of fault it counts; inputs are the same bytes in every process and
replay alone; and every saved reproducer (tests/fuzz/reproducers/{socket,vhost,guests}/)
replays clean, or fails as its entry in KNOWN says (strict xfail: once fixed, the entry goes).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fuzz.driver import REPO, _child_cmd, _child_env, run_campaign

SCALE = float(os.environ.get("APIR_FUZZ_PROTOCOL_INPUTS", "1"))
CORPUS = {"socket": 400, "vhost": 150, "guests": 150}
REPRODUCERS = Path(__file__).parent / "reproducers"

# Reproducers of faults not fixed yet: file name -> why it fails (the owner's to fix).
KNOWN: dict = {}


def _child(fuzzer):
    return ["tests.fuzz.wire_child", "--fuzzer", fuzzer]


def _describe(res):
    faults = res.crashes + res.hangs + res.memory + res.oracle
    return "\n".join(
        f"{f.kind} of input {f.index} ({f.case}): {f.signature}: {f.where}\n{f.stderr_tail[-1500:]}" for f in faults
    )


@pytest.mark.fuzz
@pytest.mark.parametrize("fuzzer", sorted(CORPUS))
def test_seeded_corpus_finds_nothing(fuzzer, tmp_path):
    n = max(1, int(CORPUS[fuzzer] * SCALE))
    res = run_campaign(1, n, 2, tmp_path, deadline=120, chunk=max(1, n // 4), child=_child(fuzzer))
    assert not res.harness_errors, res.harness_errors
    assert res.inputs == n
    assert res.computed > n // 2  # the inputs reach the host's commands, not only its framing
    assert not (res.crashes or res.hangs or res.memory or res.oracle), _describe(res)
    assert (res.no_reply, res.not_serving, res.host_exceptions, res.broken) == (0, 0, 0, 0)


def test_harness_sees_each_kind_of_fault(tmp_path):
    """Done on purpose by the child (APIR_FUZZ_SELFTEST): an abort, a hang, a descriptor left
    open, an internal exception logged. Each costs its input only; a reproducer of the first
    is saved and, replayed without the self-test, runs clean."""
    res = run_campaign(
        3,
        6,
        2,
        tmp_path,
        deadline=10,
        chunk=3,
        repro_per_signature=1,
        repro_max=1,  # the abort's (a hang's would take its deadline again)
        child=_child("socket"),
        extra_env={"APIR_FUZZ_SELFTEST": "abort@1,hang@2,leak@3,error@4"},
    )
    assert not res.harness_errors, res.harness_errors
    assert res.inputs == 6
    assert [(f.index, f.signal) for f in res.crashes] == [(1, "SIGABRT")]
    assert [f.index for f in res.hangs] == [2]
    assert sorted((f.index, f.signal) for f in res.oracle) == [(3, "fd-leak"), (4, "internal-exception")]
    assert res.host_exceptions == 1 and res.broken == 2
    saved = [f for f in res.crashes + res.hangs + res.oracle if f.reproducer]
    assert [f.index for f in saved] == [1] and (tmp_path / saved[0].reproducer).is_file()
    assert saved[0].reproduced is False


def test_a_child_started_afresh_loses_no_input(tmp_path):
    """A child past its memory mark leaves after its chunk (here after every chunk): the driver
    starts another, which carries on, and that is no fault."""
    res = run_campaign(1, 12, 1, tmp_path, chunk=4, child=_child("socket"), extra_env={"APIR_FUZZ_RECYCLE_RSS": "1"})
    assert (res.inputs, res.restarts, res.harness_errors) == (12, 3, [])
    assert res.clean()


@pytest.mark.parametrize("fuzzer", sorted(CORPUS))
def test_inputs_are_deterministic_and_replay_alone(fuzzer, tmp_path):
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    env = _child_env(None)
    for p in paths:
        run = subprocess.run(
            _child_cmd(5, {}, 0, ["--only", "11", "--record", str(p)], child=_child(fuzzer)),
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-2000:]
    a, b = (p.read_text() for p in paths)
    assert a == b
    rec = json.loads(a)
    assert rec["fuzzer"] == fuzzer and rec["meta"]["index"] == 11 and rec["steps"]
    run = subprocess.run(
        _child_cmd(0, {}, 0, ["--replay", str(paths[0])], child=_child(fuzzer)),
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    assert "fresh peer served: True" in run.stdout


def test_ids_a_guest_is_given_reveal_nothing_of_the_others(tmp_path):
    """After each input's guests left, a fresh guest making the same calls is given the same
    resource ids and buffer handles as the first one was (tests.fuzz.guests, APIR_FUZZ_GUEST_IDS).
    Fails where resource ids are numbered per process, not per guest."""
    res = run_campaign(
        1,
        4,
        1,
        tmp_path,
        deadline=120,
        chunk=4,
        repro_max=0,
        child=_child("guests"),
        extra_env={"APIR_FUZZ_GUEST_IDS": "1"},
    )
    assert not res.harness_errors, res.harness_errors
    assert res.inputs == 4
    assert not res.oracle, _describe(res)


def _reproducers():
    return sorted(p for d in CORPUS for p in (REPRODUCERS / d).glob("*.json"))


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(
            p,
            id=f"{p.parent.name}/{p.name}",
            marks=[pytest.mark.xfail(strict=True, reason=KNOWN[p.name])] if p.name in KNOWN else [],
        )
        for p in _reproducers()
    ],
)
def test_reproducer_replays_clean(path):
    """A saved input (a fault found, or a path worth keeping) on a fresh host process: no
    crash, hang, unanswered request, leak or internal exception, and a fresh peer served."""
    fuzzer = json.loads(path.read_text())["fuzzer"]
    cmd = [sys.executable, "-m", "tests.fuzz.wire_child", "--fuzzer", fuzzer, "--replay", str(path)]
    try:
        run = subprocess.run(cmd, env=_child_env(None), cwd=REPO, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{path.name} hangs the host")
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    assert "fresh peer served: True" in run.stdout and "failures: []" in run.stdout, run.stdout


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
