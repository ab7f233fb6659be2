"""The fenced fuzzer in CI: a short seeded corpus faults nothing on this host, and the harness
sees every kind of fault it counts, and inputs that agree USE_COUNTS reach the host with it
(docs/security.md, "Fuzzing").

The corpus: `APIR_FUZZ_CORPUS` inputs (default 1,000) of seed 1 on two child processes, each
input a mutated graph or command sequence on a fresh host context in fenced memory
(tests/fuzz/). About 10-20 s on two cores; the campaign (scripts/fuzz-host.py) runs the
same inputs and millions more.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fuzz.driver import REPO, _child_cmd, _child_env, run_campaign
from tests.fuzz.mutate import agrees_use_counts

CORPUS_SEED = 1
CORPUS_INPUTS = int(os.environ.get("APIR_FUZZ_CORPUS", "1000"))


def _describe(faults):
    return "\n".join(
        f"{f.kind} of input {f.index} ({f.case}): {f.signature}; reproducer {f.reproducer}\n{f.stderr_tail[-1500:]}"
        for f in faults
    )


def test_seeded_corpus_faults_nothing(tmp_path):
    res = run_campaign(CORPUS_SEED, CORPUS_INPUTS, 2, tmp_path, deadline=60, chunk=100)
    assert not res.harness_errors, res.harness_errors
    assert res.seeds > 100  # every op family's cases became seed graphs
    assert res.inputs == CORPUS_INPUTS
    assert res.computed > CORPUS_INPUTS // 10  # the mutations reach ggml, not only the checks
    faults = res.crashes + res.hangs + res.memory
    assert not faults, _describe(faults)
    assert (res.no_reply, res.not_serving, res.host_exceptions) == (0, 0, 0)


def test_use_counts_inputs_agree_it_and_fault_nothing(tmp_path):
    """The inputs that agree USE_COUNTS (the odd ones) send hostile use counts in their
    records' padding: the host agreed it in each of those sessions and in no other (its
    library's `wire_use_counts` at the input's end, reported per input), and answered them all."""
    n = 200
    res = run_campaign(3, n, 2, tmp_path, deadline=60, chunk=50)
    assert not res.harness_errors, res.harness_errors
    assert res.inputs == n
    assert res.use_counts == sum(agrees_use_counts(i) for i in range(n)) == n // 2
    assert res.computed > n // 10
    faults = res.crashes + res.hangs + res.memory
    assert not faults, _describe(faults)
    assert (res.no_reply, res.not_serving, res.host_exceptions) == (0, 0, 0)


def test_harness_sees_each_kind_of_fault(tmp_path):
    """Each fault the harness counts, done on purpose (tests.fuzz.child._selftest): reads
    one byte past a fenced blob, past a fenced host buffer and of a freed host buffer
    (SIGSEGV: the fences work), an abort, and a hang past the deadline. Each costs that
    one input; the others run."""
    res = run_campaign(
        7,
        8,
        2,
        tmp_path,
        deadline=4,
        chunk=4,
        repro_per_signature=1,
        repro_max=1,
        extra_env={"APIR_FUZZ_SELFTEST": "oob@1,buf@2,uaf@3,abort@4,hang@5"},
    )
    assert not res.harness_errors, res.harness_errors
    assert res.inputs == 8
    assert sorted((f.index, f.signal) for f in res.crashes) == [
        (1, "SIGSEGV"),
        (2, "SIGSEGV"),
        (3, "SIGSEGV"),
        (4, "SIGABRT"),
    ]
    assert [(f.index, f.where) for f in res.hangs] == [(5, "fuzz/child.py:_selftest")]
    saved = [f for f in res.crashes + res.hangs if f.reproducer]
    assert len(saved) == 1 and (tmp_path / saved[0].reproducer).is_file()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["crash_count"], summary["hang_count"]) == (4, 1)


REPRODUCERS = sorted((Path(__file__).parent / "reproducers").glob("*.json"))


def test_campaign_reproducers_replay_clean(ggml):
    """Every fault the campaigns found (one reproducer per signature, tests/fuzz/reproducers/:
    their meta says where each came from) is refused or bounded now: replayed on fresh
    fenced hosts, none crashes, hangs, leaves a command unanswered or stops the host."""
    mine = [p for p in REPRODUCERS if json.loads(p.read_text())["meta"].get("ggml") == ggml.version]
    if not mine:
        pytest.skip(f"no reproducer was recorded on ggml {ggml.version}")
    cmd = [sys.executable, "-m", "tests.fuzz.child", "--replay", *map(str, mine)]
    try:
        run = subprocess.run(cmd, env=_child_env(None), cwd=REPO, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        pytest.fail(f"a reproducer hangs the host: {out.splitlines()[-1:]}")
    last = [line for line in run.stdout.splitlines() if line.startswith("replaying")][-1:]
    assert run.returncode == 0, f"{last}: exit {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    assert run.stdout.count("host alive: True, internal exceptions: 0") == len(mine), run.stdout


def test_inputs_are_deterministic_and_replay_alone(tmp_path):
    """Input i of a seed is the same input in any process (the recordings are byte-equal),
    and its recording replays on a fresh host without the generator."""
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    env = _child_env(None)
    procs = [
        subprocess.Popen(
            _child_cmd(CORPUS_SEED, {}, 0, ["--only", "17", "--record", str(p)]),
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for p in paths
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]
    a, b = (p.read_text() for p in paths)
    assert a == b
    rec = json.loads(a)
    assert rec["meta"]["index"] == 17 and rec["steps"]
    assert rec["meta"]["use_counts"] is agrees_use_counts(17) is True  # its EXT_QUERY is a step
    run = subprocess.run(
        _child_cmd(CORPUS_SEED, {}, 0, ["--replay", str(paths[0])]),
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    assert "host alive: True" in run.stdout
    assert "use counts: True" in run.stdout  # the replay agreed USE_COUNTS as the input did


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
