"""ggml's test-backend-ops, in test mode, on the virtgpu device served by apir's host.

Theory of operation: test-backend-ops (built with the C reference) lists every ggml backend device;
with the shim preloaded its ggml-virtgpu device is apir's host behind a Unix socket, named
"[virtgpu] CPU" (the C guest prefixes the host device's name). `-b` picks that device, `-o` an
op, and every test case is computed on it and on ggml CPU (the reference implementation) and
compared. The same binary with `-b CPU` gives the counts on ggml CPU directly.

Each op runs in its own test-backend-ops process. The C guest aborts the whole process when a
backend function fails (GGML_ABORT in REMOTE_CALL), so one refused or crashed case would hide all
the cases after it: when a run ends early, the op's remaining cases (known from the CPU run) are
run again, many to a process (`-o` takes a list of full case names), and the case that was
running when a process ended counts as failed ("crashed"). The suite lists some cases twice
(TOP_K, OUT_PROD, MUL_MAT): a case is resumed while it was seen fewer times than on CPU.
Only the cases that passed on CPU are resumed: the others need not pass through apir, and each
would cost a process (the C guest aborts on every case the host refuses).

Console lines look like ``  OP(params): OK`` / ``FAIL`` / ``not supported [...]`` /
``skipping large tensors for speed``; `parse` turns them into [(case, status)] (a suite may
list the same case twice; each run counts).
"""

from __future__ import annotations

import re
import subprocess
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

OK, FAIL, NOT_SUPPORTED, SKIPPED, CRASHED = "ok", "fail", "not supported", "skipped", "crashed"
VIRTGPU_DEVICE = "[virtgpu] CPU"
_CASE = re.compile(r"^  ([A-Z][A-Z0-9_]*)\((.*)\): (.*)$")
_PARTIAL = re.compile(r"^  ([A-Z][A-Z0-9_]*)\((.*)\): ?$")


def parse(stdout: str) -> List[Tuple[str, str]]:
    """[("OP(params)", status)] from test-backend-ops' console output; a line that has a case
    but no status (the process died computing it) is CRASHED."""
    cases: List[Tuple[str, str]] = []
    lines = stdout.splitlines()
    for line in lines:
        m = _CASE.match(line)
        if m and m.group(3).strip():
            status = m.group(3)
            if "not supported" in status:
                value = NOT_SUPPORTED
            elif "skipping" in status:
                value = SKIPPED
            elif "FAIL" in status:
                value = FAIL
            elif "OK" in status:
                value = OK
            else:  # a case whose status line was cut by the process's death
                value = CRASHED
            cases.append((f"{m.group(1)}({m.group(2)})", value))
            continue
        m = _PARTIAL.match(line)
        if m:
            cases.append((f"{m.group(1)}({m.group(2)})", CRASHED))
    return cases


def list_ops(test_backend_ops: str) -> List[str]:
    out = subprocess.run([test_backend_ops, "--list-ops"], capture_output=True, text=True, check=True).stdout
    return [line.strip() for line in out.splitlines()[1:] if line.strip()]


@dataclass
class OpRun:
    """One op on one device: [(case, status)], wall seconds, and how many processes it took."""

    op: str
    cases: List[Tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    processes: int = 0
    notes: List[str] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(1 for _, s in self.cases if s == status)

    def names(self) -> List[str]:
        """The distinct case names, in order."""
        return list(dict.fromkeys(c for c, _ in self.cases))

    def passed(self) -> List[str]:
        """The distinct names of the cases that passed, in order."""
        ok = {c for c, s in self.cases if s == OK}
        return [c for c in self.names() if c in ok]

    def passed_runs(self) -> List[str]:
        """The name of every run that passed, in order (a case the suite lists twice, twice)."""
        return [c for c, s in self.cases if s == OK]

    def status_of(self, case: str) -> Optional[str]:
        """OK if any run of `case` passed, else the last status seen, else None."""
        seen = [s for c, s in self.cases if c == case]
        return OK if OK in seen else (seen[-1] if seen else None)


def run_cases(test_backend_ops: str, device: str, filters: str, env: Optional[dict],
              timeout: float, params: Optional[str] = None) -> tuple:
    """One test-backend-ops process (`-o filters`, `-p params` regex); (cases, returncode,
    stderr tail)."""
    cmd = [test_backend_ops, "test", "-b", device, "-o", filters] + (["-p", params] if params else [])
    try:
        p = subprocess.run(cmd, env=env,
                           capture_output=True, text=True, timeout=timeout)
        return parse(p.stdout), p.returncode, p.stderr[-2000:]
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return parse(out), None, "timeout"


def run_op(test_backend_ops: str, op: str, device: str, env: Optional[dict] = None,
           expected: Iterable[str] = (), timeout: float = 600.0, max_resume: int = 10_000,
           params: Optional[str] = None, deadline: Optional[float] = None,
           resume_jobs: int = 1) -> OpRun:
    """All cases of `op` (those whose parameters match the regex `params`, if given) on
    `device`. `expected`: the op's case names from the CPU run, a name once per run of it
    (`OpRun.passed_runs`: the suite lists some cases twice), used to resume after the process
    ended early: each name seen fewer times than expected is re-run (all its runs, replacing
    the ones seen), many names to a process (`resume_filters`), `resume_jobs` processes at a
    time, until `deadline` (time.monotonic()) if given. A resumed process that ends early
    blames the first of its names it did not print (CRASHED) and the rest go on."""
    run = OpRun(op)
    t0 = time.monotonic()
    cases, rc, err = run_cases(test_backend_ops, device, op, env, timeout, params)
    run.processes += 1
    run.cases.extend(cases)
    if rc != 0:
        run.notes.append(f"{op}: process ended with {rc} ({_last_line(err)})")
        need, seen = Counter(expected), Counter(c for c, _ in run.cases)
        short = [c for c in need if seen[c] < need[c]]
        remaining = short[:max_resume]
        run.cases = [(c, s) for c, s in run.cases if c not in set(remaining)]

        def resume(chunk: List[str]):
            got: List[Tuple[str, str]] = []
            notes: List[str] = []
            processes = 0
            while chunk:
                if deadline is not None and time.monotonic() > deadline:
                    break
                cases, rc, err = run_cases(test_backend_ops, device, ",".join(chunk), env, timeout)
                processes += 1
                printed = {c for c, _ in cases}
                got.extend(cases)
                left = [c for c in chunk if c not in printed]
                if rc == 0:  # a name the filter ran no case of
                    got.extend((c, CRASHED) for c in left)
                    chunk = []
                elif left:
                    got.append((left[0], CRASHED))
                    notes.append(f"{left[0]}: process ended with {rc} ({_last_line(err)})")
                    chunk = left[1:]
                else:
                    notes.append(f"{op}: a resumed process ended with {rc} after its last case")
                    chunk = []
            return got, notes, processes, len(chunk)

        skipped = 0
        with ThreadPoolExecutor(max_workers=max(1, resume_jobs)) as pool:
            for got, notes, processes, left in pool.map(resume, resume_filters(remaining, resume_jobs)):
                run.cases.extend(got)
                run.notes.extend(notes)
                run.processes += processes
                skipped += left
        if skipped:
            run.notes.append(f"{op}: deadline passed, {skipped} cases not resumed")
        if len(short) > len(remaining):
            run.notes.append(f"{op}: {len(short) - len(remaining)} cases not resumed")
    run.seconds = time.monotonic() - t0
    return run


# test-backend-ops' -o filter is one argument: Linux caps one at 128 KiB (MAX_ARG_STRLEN)
_FILTER_CHARS = 100_000


def resume_filters(names: List[str], parts: int = 1) -> List[List[str]]:
    """`names` in order, cut into about `parts` runs of names whose comma-joined `-o` filter
    (test-backend-ops matches_filter: `OP(params)` entries) stays under 100,000 characters."""
    per = max(1, -(-len(names) // max(1, parts)))
    chunks: List[List[str]] = []
    cur: List[str] = []
    size = 0
    for name in names:
        if cur and (len(cur) >= per or size + len(name) + 1 > _FILTER_CHARS):
            chunks.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += len(name) + 1
    if cur:
        chunks.append(cur)
    return chunks


def _last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    for ln in lines:
        if "ggml-virtgpu" in ln and ("failed" in ln or "error" in ln.lower()):
            return ln.strip()[:200]
    return lines[-1].strip()[:200] if lines else ""


def summarize(runs: Dict[str, OpRun]) -> Dict[str, int]:
    total = {OK: 0, FAIL: 0, NOT_SUPPORTED: 0, SKIPPED: 0, CRASHED: 0}
    for r in runs.values():
        for _, s in r.cases:
            total[s] += 1
    return total


def regressions(cpu: Dict[str, OpRun], apir: Dict[str, OpRun]) -> List[str]:
    """Cases that pass on ggml CPU directly but not through apir."""
    bad = []
    for op, r in cpu.items():
        other = apir.get(op, OpRun(op))
        for case in r.names():
            if r.status_of(case) == OK and other.status_of(case) != OK:
                bad.append(f"{case}: CPU ok, apir {other.status_of(case) or 'missing'}")
    return bad


def default_paths_env(version: str) -> Path:
    from tests import cref

    cref.build(version)
    return cref.cache_dir() / version / "build" / "paths.env"
