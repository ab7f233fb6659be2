"""The fuzz campaign's parent: worker processes, deadlines, crash and hang accounting.

Theory of operation: `run_campaign` starts `workers` children (`tests.fuzz.child`) and hands
each chunks of input indices. A child that dies during input I (a signal, an abort, any
exit) is a **crash** of input I; a child that spends longer than `deadline` seconds in one
input is a **hang** (it is killed); an input that raised the child's peak RSS by more than
`rss_limit` is a **memory** fault (the host committed that much for one input). Either way
the child is replaced and carries on at I+1, so one fault costs one input, not the campaign.
Every input that finishes reports whether a command went unanswered, whether the host still
served afterwards, how many internal exceptions the host logged, how many graphs it
computed, and whether it built them with the guest's use counts (USE_COUNTS agreed).

A fault's signature is the signal and where it struck, read from the child's stderr (the
GGML_ASSERT line, the C++ exception, or the innermost Python frame that faulthandler
printed: the ctypes call into ggml), and the op of the seed graph (or the op a mutation gave
the node). For the first `repro_per_signature` faults of each signature the input is re-run
alone with `--record` (a reproducer file in `out_dir/reproducers/`), and the file is then
replayed alone with `--replay`: `Fault.reproduced` says whether the saved file alone faults
the host again.

Inputs are numbered from 0 and depend only on (seed, index), so counts are the same for any
number of workers, and a fault is found again by its index.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

__all__ = ["Fault", "Result", "run_campaign", "signature_of"]

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Fault:
    kind: str  # "crash" or "hang"
    index: int
    case: str
    signal: str
    where: str
    signature: str
    mutations: List[str] = field(default_factory=list)
    reproducer: Optional[str] = None
    reproduced: Optional[bool] = None
    stderr_tail: str = ""


@dataclass
class Result:
    seed: int
    inputs: int = 0  # inputs run to the end or to a fault
    computed: int = 0  # graphs the host accepted and computed
    crashes: List[Fault] = field(default_factory=list)
    hangs: List[Fault] = field(default_factory=list)
    memory: List[Fault] = field(default_factory=list)  # inputs that grew the host's peak RSS past the limit
    oracle: List[Fault] = field(default_factory=list)  # a child's own oracle failed (`b` lines: leaks, ...)
    no_reply: int = 0  # inputs with a command that named the reply blob and got no reply
    not_serving: int = 0  # inputs after which the host did not answer DEVICE_GET_COUNT
    broken: int = 0  # inputs that broke another oracle of the child (a leak, a wrong result)
    host_exceptions: int = 0  # inputs during which the host logged an internal exception
    use_counts: int = 0  # inputs whose graphs the host built with the guest's use counts (USE_COUNTS)
    harness_errors: List[str] = field(default_factory=list)
    seeds: int = 0
    seeds_skipped: int = 0
    workers: int = 0
    seconds: float = 0.0
    restarts: int = 0

    @property
    def signatures(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for f in self.crashes + self.hangs + self.memory + self.oracle:
            out[f.signature] = out.get(f.signature, 0) + 1
        return out

    def summary(self) -> dict:
        d = asdict(self)
        d["crash_count"], d["hang_count"], d["memory_count"] = len(self.crashes), len(self.hangs), len(self.memory)
        d["oracle_count"] = len(self.oracle)
        d["signatures"] = self.signatures
        for f in d["crashes"] + d["hangs"] + d["memory"] + d["oracle"]:
            f["stderr_tail"] = f["stderr_tail"][-1500:]
        return d

    def clean(self) -> bool:
        return not (
            self.crashes
            or self.hangs
            or self.memory
            or self.oracle
            or self.no_reply
            or self.not_serving
            or self.host_exceptions
            or self.broken
            or self.harness_errors
        )


_ASSERT = re.compile(r"([\w./+-]+:\d+): (GGML_ASSERT\(.*?\) failed|GGML_ABORT[^\n]*|[^\n]*fatal error[^\n]*)")
_THROW = re.compile(r"terminate called after throwing an instance of '([^']+)'")
_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\w+)')


def signature_of(sig: str, stderr: str, case: str, mutations=()) -> tuple:
    """(where, signature) of a fault: see the module docstring. The op is the seed's, or
    the one a mutation made the node."""
    where = ""
    m = _ASSERT.search(stderr) or None
    if m:
        where = f"{Path(m.group(1)).name}: {m.group(2)}"
    else:
        m = _THROW.search(stderr)
        if m:
            where = f"throw {m.group(1)}"
    last = max(stderr.rfind("Fatal Python error"), stderr.rfind("Current thread"), stderr.rfind("Thread 0x"))
    frame = next(iter(_FRAME.findall(stderr[max(last, 0) :])), None)
    if frame:
        path = Path(frame[0])
        where = (where + " at " if where else "") + f"{path.parent.name}/{path.name}:{frame[2]}"
    ops = [m[3:] for m in mutations if m.startswith("op=")]
    return where or "?", f"{sig} {where or '?'} [{ops[-1] if ops else _op_of(case)}]"


def _op_of(case: str) -> str:
    """The op of a seed case name ("matrix:ADD_ID-22" -> "ADD_ID")."""
    return case.split(":")[-1].rsplit("-", 1)[0] if case else "?"


def _signame(rc: Optional[int]) -> str:
    if rc is None:
        return "?"
    if rc < 0:
        try:
            return signal.Signals(-rc).name
        except ValueError:
            return f"signal {-rc}"
    return f"exit {rc}"


class _Worker:
    def __init__(self, k: int, cmd: List[str], env: dict, log_dir: Path):
        self.k = k
        self.cmd, self.env = cmd, env
        self.err_path = log_dir / f"worker-{k}.stderr"
        self.proc: Optional[subprocess.Popen] = None
        self.buf = b""
        self.current: Optional[int] = None
        self.case = ""
        self.t0 = 0.0
        self.chunk_end = 0
        self.next = 0
        self.ready = False
        self.err_offset = 0
        self.exiting = False  # it reported a memory fault and exits
        self.mutations: List[str] = []  # of the current input, as last reported

    def start(self) -> None:
        with open(self.err_path, "ab") as err:  # the child keeps its own descriptor
            self.err_offset = err.tell()
            self.proc = subprocess.Popen(
                self.cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=self.env,
                cwd=REPO,
                start_new_session=True,
            )
        self.buf, self.current, self.ready, self.t0 = b"", None, False, time.monotonic()
        self.exiting = False

    def send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def kill(self, dump: bool = False) -> None:
        if dump and self.proc and self.proc.poll() is None:  # faulthandler prints the stacks
            try:
                self.proc.send_signal(signal.SIGUSR1)
                time.sleep(0.3)
            except ProcessLookupError:
                pass
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc:
            self.proc.wait()
            for s in (self.proc.stdin, self.proc.stdout):
                try:
                    s.close()
                except OSError:
                    pass

    def stderr_tail(self) -> str:
        with open(self.err_path, "rb") as fh:
            fh.seek(self.err_offset)
            data = fh.read()
        return data[-8000:].decode(errors="replace")


def _child_cmd(
    seed: int,
    config: dict,
    rlimit_as: int,
    extra: List[str] = (),
    rss_limit: int = 2 << 30,
    child: Optional[List[str]] = None,
) -> List[str]:
    """The child's command line; `child`: its module and own arguments (default the graph
    fuzzer's, `tests.fuzz.child`)."""
    cmd = [
        sys.executable,
        "-m",
        *(child or ["tests.fuzz.child"]),
        "--seed",
        str(seed),
        "--config",
        json.dumps(config),
        "--rss-limit",
        str(rss_limit),
    ]
    if rlimit_as:
        cmd += ["--rlimit-as", str(rlimit_as)]
    return cmd + list(extra)


def _child_env(extra_env: Optional[dict]) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONFAULTHANDLER", "1")
    env.setdefault("GGML_NO_BACKTRACE", "1")  # ggml's abort would attach gdb for seconds; faulthandler says where
    env.update(extra_env or {})
    return env


def run_campaign(
    seed: int,
    n: int,
    workers: int,
    out_dir,
    *,
    start: int = 0,
    deadline: float = 20.0,
    chunk: int = 250,
    config: Optional[dict] = None,
    rlimit_as: int = 0,
    repro_per_signature: int = 3,
    repro_max: int = 40,
    extra_env: Optional[dict] = None,
    startup_deadline: float = 300.0,
    max_seconds: float = 0.0,
    rss_limit: int = 2 << 30,
    progress=None,
    child: Optional[List[str]] = None,
) -> Result:
    """Runs inputs [start, start+n) of `seed` on `workers` children; see the module
    docstring. `max_seconds` (0: none) stops handing out chunks after that long: the
    result then counts fewer inputs. Writes `out_dir/summary.json`, worker stderr logs
    and reproducers. `child`: the child's module and its own arguments (default the graph
    fuzzer's; tests.fuzz.wire_child runs the others)."""
    out = Path(out_dir)
    (out / "reproducers").mkdir(parents=True, exist_ok=True)
    config = dict(config or {})
    env = _child_env(extra_env)
    cache = str(out / f"seeds-{os.getpid()}.pickle")  # this campaign's: its code, its ggml
    if os.path.exists(cache):
        os.unlink(cache)
    cmd = _child_cmd(seed, config, rlimit_as, ["--seeds-cache", cache], rss_limit=rss_limit, child=child)
    res = Result(seed=seed, workers=workers)
    t_start = time.monotonic()
    todo = list(range(start, start + n, chunk))
    stop = start + n
    pool = [_Worker(k, cmd, env, out) for k in range(min(workers, max(len(todo), 1)))]
    for w in pool:
        w.start()

    def assign(w: _Worker) -> bool:
        if w.next < w.chunk_end:  # the rest of a chunk cut short by a fault
            a, b = w.next, w.chunk_end
        elif todo:
            a = todo.pop(0)
            b = min(a + chunk, stop)
        else:
            return False
        w.next, w.chunk_end = a, b
        w.send(f"run {a} {b}\n")
        return True

    def fault(w: _Worker, kind: str, rc: Optional[int]) -> None:
        i = w.current
        tail = w.stderr_tail()
        sig = "deadline" if kind == "hang" else _signame(rc)
        where, signature = signature_of(sig, tail, w.case, w.mutations)
        f = Fault(kind, i, w.case, sig, where, signature, mutations=list(w.mutations), stderr_tail=tail)
        (res.crashes if kind == "crash" else res.hangs).append(f)
        res.inputs += 1
        w.next = i + 1
        res.restarts += 1
        w.start()

    live = set(pool)
    while live:
        fds = {w.proc.stdout.fileno(): w for w in live}
        ready, _, _ = select.select(list(fds), [], [], 0.25)
        now = time.monotonic()
        for fd in ready:
            w = fds[fd]
            data = os.read(fd, 1 << 16)
            if not data:  # the child exited
                rc = w.proc.wait()
                w.kill()
                if w.current is not None:
                    fault(w, "crash", rc)
                elif w.exiting:
                    res.restarts += 1
                    w.start()
                elif not w.ready or w.next < w.chunk_end:
                    res.harness_errors.append(
                        f"worker {w.k} exited ({_signame(rc)}) outside an input: {w.stderr_tail()[-500:]}"
                    )
                    if len(res.harness_errors) > 5:
                        live.discard(w)
                        continue
                    w.start()
                else:
                    live.discard(w)
                continue
            w.buf += data
            *lines, w.buf = w.buf.split(b"\n")
            for raw in lines:
                parts = raw.decode(errors="replace").split(" ", 2)
                tag = parts[0]
                if tag == "s":
                    w.current, w.case, w.t0 = int(parts[1]), parts[2] if len(parts) > 2 else "", now
                    w.mutations = []
                elif tag == "k":
                    try:
                        w.mutations = json.loads(parts[2])
                    except (IndexError, ValueError):
                        pass
                elif tag == "d":
                    _, i, rest = parts
                    no_reply, alive, exc, computed, *more = (int(x) for x in rest.split())
                    broken, use_counts = (more + [0, 0])[:2]
                    res.inputs += 1
                    res.computed += computed
                    res.no_reply += no_reply > 0
                    res.not_serving += not alive
                    res.host_exceptions += exc > 0
                    res.broken += bool(broken)
                    res.use_counts += bool(use_counts)
                    w.current, w.next = None, int(i) + 1
                elif tag == "m":
                    i, grown = (int(x) for x in parts[1:3])
                    res.memory.append(
                        Fault(
                            "memory",
                            i,
                            w.case,
                            "rss",
                            f"peak RSS +{grown >> 20} MiB",
                            signature_of("memory", "", w.case, w.mutations)[1],
                            mutations=list(w.mutations),
                        )
                    )
                    w.exiting = True
                elif tag == "r":  # the child leaves after this chunk, to start afresh: no fault
                    w.exiting = True
                elif tag == "b":  # b I KIND DETAIL: the child's own oracle failed in input I
                    i, rest = parts[1], parts[2] if len(parts) > 2 else "?"
                    kind = rest.split(" ", 1)[0]
                    res.oracle.append(
                        Fault(
                            "oracle",
                            int(i),
                            w.case,
                            kind,
                            rest[:300],
                            f"oracle {kind} [{w.case.split(':')[0]}]",
                            mutations=list(w.mutations),
                        )
                    )
                elif tag == "e":
                    res.inputs += 1
                    res.harness_errors.append(f"input {parts[1]}: {parts[2] if len(parts) > 2 else ''}")
                    w.current, w.next = None, int(parts[1]) + 1
                elif tag == "ready":
                    w.ready = True
                    res.seeds, res.seeds_skipped = int(parts[1]), int(parts[2].split()[0])
                    if not assign(w):
                        w.send("quit\n")
                elif tag == "ok":
                    if not assign(w):
                        w.send("quit\n")
        for w in list(live):
            limit = deadline if w.ready else startup_deadline
            if (w.current is not None or not w.ready) and now - w.t0 > limit:
                w.kill(dump=True)
                if w.current is not None:
                    fault(w, "hang", None)
                else:
                    res.harness_errors.append(f"worker {w.k} did not start within {limit} s")
                    live.discard(w)
        if max_seconds and now - t_start > max_seconds:
            todo.clear()
            for w in live:
                w.chunk_end = min(w.chunk_end, w.next)  # no rest of a cut chunk either
        if progress:
            progress(res, time.monotonic() - t_start)
    res.seconds = time.monotonic() - t_start
    _reproduce(
        res,
        seed,
        config,
        rlimit_as,
        env,
        out,
        deadline,
        repro_per_signature,
        repro_max,
        workers,
        ["--seeds-cache", cache],
        child,
    )
    if os.path.exists(cache):
        os.unlink(cache)
    (out / "summary.json").write_text(json.dumps(res.summary(), indent=1))
    return res


def _reproduce(
    res: Result,
    seed: int,
    config: dict,
    rlimit_as: int,
    env: dict,
    out: Path,
    deadline: float,
    per_signature: int,
    most: int,
    workers: int,
    extra: List[str],
    child: Optional[List[str]] = None,
) -> None:
    """Saves and checks a reproducer for the first faults of each signature."""
    done: Dict[str, int] = {}
    chosen = []
    for f in res.crashes + res.hangs + res.memory + res.oracle:
        if done.get(f.signature, 0) >= per_signature or len(chosen) >= most:
            continue
        done[f.signature] = done.get(f.signature, 0) + 1
        chosen.append(f)

    def one(f: Fault) -> None:
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{f.kind}-{f.signal}-{f.case}")[:80]
        path = out / "reproducers" / f"{slug}-s{seed}-i{f.index}.json"
        record = _child_cmd(
            seed, config, rlimit_as, ["--only", str(f.index), "--record", str(path)] + extra, child=child
        )
        _run_alone(record, env, deadline + 30)
        if not path.exists():
            return
        f.reproducer = str(path.relative_to(out))
        if f.kind == "memory":
            return
        replay = _child_cmd(seed, config, rlimit_as, ["--replay", str(path)], child=child)
        rc, _ = _run_alone(replay, env, deadline + 30)
        if f.kind == "oracle":  # the file alone fails the oracle again (exit 1), without crashing
            f.reproduced = rc == 1
        else:
            f.reproduced = rc is None if f.kind == "hang" else (rc is not None and rc not in (0, 1))

    with ThreadPoolExecutor(max(1, workers)) as pool:
        list(pool.map(one, chosen))


def _run_alone(cmd: List[str], env: dict, timeout: float):
    """(return code or None on timeout, stderr) of one child run."""
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=REPO,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=timeout)
        return proc.returncode, err.decode(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None, ""
