"""tests/interop/backend_ops.run_op's resumption after a test-backend-ops process ended early,
against a fake test-backend-ops (a Python script printing its console lines): the suite lists
some cases twice (TOP_K, OUT_PROD, MUL_MAT in ggml 0.20), and every run of a case that passed
directly must be run through apir too."""

import os
import stat
import sys
import textwrap

import pytest

from tests.interop import backend_ops as bo

# The fake suite: T(a=2) is listed twice, as test-backend-ops lists some cases. On DIRECT, T(a=3)
# is not supported; on APIR (the C guest aborting when the host refuses a graph) T(a=3) aborts the
# process, and on APIR_BAD T(a=4) aborts too although it passed directly.
FAKE = textwrap.dedent(
    """\
    import os, re, sys
    CASES = ["T(a=1)", "T(a=2)", "T(a=3)", "T(a=2)", "T(a=4)", "T(a=5)"]
    args = sys.argv[1:]
    dev, filt = args[args.index("-b") + 1], args[args.index("-o") + 1]
    names = re.findall(r"[A-Z_]+\\([^)]*\\)", filt) if "(" in filt else None
    log = os.environ.get("FAKE_LOG")
    if log:
        open(log, "a").write(filt + "\\n")
    for case in CASES:
        if names is not None and case not in names:
            continue
        if case == "T(a=3)" and dev == "DIRECT":
            print(f"  {case}: not supported [DIRECT] ", flush=True)
            continue
        if (case == "T(a=3)" and dev != "DIRECT") or (case == "T(a=4)" and dev == "APIR_BAD"):
            sys.stdout.flush()
            os.abort()
        print(f"  {case}: OK", flush=True)
    """
)


@pytest.fixture
def fake_tbo(tmp_path):
    path = tmp_path / "test-backend-ops"
    path.write_text(f"#!{sys.executable}\n" + FAKE)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_resume_runs_every_repeat_of_a_case(fake_tbo):
    direct = bo.run_op(fake_tbo, "T", "DIRECT", max_resume=0)
    assert direct.passed_runs() == ["T(a=1)", "T(a=2)", "T(a=2)", "T(a=4)", "T(a=5)"]
    apir = bo.run_op(fake_tbo, "T", "APIR", expected=direct.passed_runs())
    # the first process ends at T(a=3), after the first T(a=2): the second is resumed too
    assert sorted(apir.cases) == sorted((c, bo.OK) for c in direct.passed_runs())
    assert bo.regressions({"T": direct}, {"T": apir}) == []
    assert apir.processes == 2  # the resumed cases in one process


def test_resume_blames_the_case_that_ended_a_process_and_goes_on(fake_tbo, tmp_path):
    log = tmp_path / "filters"
    os.environ["FAKE_LOG"] = str(log)
    try:
        direct = bo.run_op(fake_tbo, "T", "DIRECT", max_resume=0)
        apir = bo.run_op(fake_tbo, "T", "APIR_BAD", expected=direct.passed_runs())
    finally:
        del os.environ["FAKE_LOG"]
    assert apir.status_of("T(a=4)") == bo.CRASHED
    assert apir.status_of("T(a=5)") == bo.OK
    assert apir.count(bo.OK) == 4 and apir.count(bo.CRASHED) == 1
    assert bo.regressions({"T": direct}, {"T": apir}) == ["T(a=4): CPU ok, apir crashed"]
    # (the direct run, the first run through apir) the resumed names in one filter, then what
    # followed the aborting case
    assert log.read_text().splitlines()[2:] == ["T(a=2),T(a=4),T(a=5)", "T(a=5)"]


def test_resume_filters_stay_under_the_argument_limit():
    names = [f"OP(p={i:05d}{'x' * 90})" for i in range(3000)]
    chunks = bo.resume_filters(names, 2)
    assert [n for c in chunks for n in c] == names
    assert all(len(",".join(c)) < 100_000 for c in chunks)
    assert len(chunks) >= 3  # 300,000 characters do not fit two
    assert bo.resume_filters(names[:10], 4) == [names[0:3], names[3:6], names[6:9], names[9:10]]
