"""Each context on ggml CPU computes with a persistent threadpool of its thread count
(apir.host.backend.cpu_threadpool), freed with the context."""

import dataclasses
import os
import types

from apir.host import HostContext
from apir.host.config import CONFIG_KEY_N_THREADS, CONFIG_KEY_POLL
from apir.host.backend.cpu_threadpool import _params
from tests.host.hostkit import Guest


def _context(**config) -> Guest:
    ctx = HostContext(7)
    for key, value in config.items():
        ctx.set_config(key, value)
    return Guest(ctx)


def test_context_computes_with_a_threadpool_of_its_threads(ggml):
    """A context of n threads holds a pool of n - 1 worker threads (the calling thread is its
    worker 0; ggml 0.20 exports no getter, so the host's count of pooled threads says it),
    freed with the context. (The OS's own thread count is checked by the RLIMIT_NPROC test
    below: other tests' threads come and go in this process.)"""
    from apir.host.backend import cpu_threadpool

    for n in (1, 3):
        before = cpu_threadpool.pooled_threads()
        guest = _context(**{CONFIG_KEY_N_THREADS: str(n)})
        lib = guest.ctx._library
        pool = lib._threadpool
        try:
            assert lib.n_threads == n
            assert pool is not None and pool.pool
            assert cpu_threadpool.pooled_threads() - before == n - 1
        finally:
            guest.close()
        assert pool.pool == 0  # freed with the context
        assert cpu_threadpool.pooled_threads() == before


def test_poll_is_a_config_key_and_a_bad_value_falls_back(ggml):
    for value, poll in (("30", 30), ("1000", 100), ("-5", 0), ("often", 0)):
        params = _params(ggml, 2, min(max(int(value), 0), 100) if value.lstrip("-").isdigit() else 0)
        assert params is not None and (params.n_threads, params.poll) == (2, poll)
        guest = _context(**{CONFIG_KEY_POLL: value})
        try:
            assert guest.ctx._library._threadpool is not None  # a bad value is logged, not fatal
        finally:
            guest.close()


def test_params_follow_the_headers_max_n_threads(ggml):
    """ggml_threadpool_params_init fills the struct as ggml.h lays it out; a header whose
    GGML_MAX_N_THREADS the library does not share gives no params (and no threadpool), and
    the library's writes stay inside the room allocated for them."""
    params = _params(ggml, 5, 0)
    assert params is not None and params.n_threads == 5 and not any(params.cpumask)
    other = types.SimpleNamespace(
        header=dataclasses.replace(ggml.header, max_n_threads=ggml.header.max_n_threads // 2),
        has=ggml.has,
        ggml_threadpool_params_init=ggml.ggml_threadpool_params_init,
    )
    assert _params(other, 5, 0) is None
    none = types.SimpleNamespace(header=dataclasses.replace(ggml.header, max_n_threads=0), has=ggml.has)
    assert _params(none, 5, 0) is None


def test_idle_contexts_hold_no_more_pooled_threads_than_the_bound(ggml, monkeypatch):
    """Each idle context keeps its pool's threads, and ggml_threadpool_new GGML_ASSERTs (the
    host aborts) when the OS refuses a thread: past the host's bound a context gets no pool."""
    from apir.host.backend import cpu_threadpool

    monkeypatch.setenv(cpu_threadpool.ENV_MAX_POOL_THREADS, str(cpu_threadpool.pooled_threads() + 6))
    before = cpu_threadpool.pooled_threads()
    guests = [_context(**{CONFIG_KEY_N_THREADS: "4"}) for _ in range(5)]
    try:
        pools = [g.ctx._library._threadpool for g in guests]
        assert [p is not None for p in pools] == [True, True, False, False, False]
        assert cpu_threadpool.pooled_threads() - before == 6
    finally:
        for g in guests:
            g.close()
    assert cpu_threadpool.pooled_threads() == before


_CHILD = r"""
from apir.host import HostContext
from apir.host.config import CONFIG_KEY_N_THREADS
from tests.host.hostkit import Guest
gs = []
for i in range(40):
    h = HostContext(7 + i)
    h.set_config(CONFIG_KEY_N_THREADS, "4")
    gs.append(Guest(h))
print("held")
"""


def test_contexts_under_a_thread_limit_do_not_abort_the_host(ggml):
    """40 idle contexts of 4 threads under RLIMIT_NPROC 60 (root ignores the limit, so the
    child runs as a uid of its own: RLIMIT_NPROC counts every process of that uid, and tox runs
    this test in several envs at once): before the bound, ggml_threadpool_new's
    GGML_ASSERT(rc == 0) aborted the host."""
    import pytest
    import resource
    import subprocess
    import sys

    if os.getuid() != 0:
        pytest.skip("needs root to run the child as another uid under RLIMIT_NPROC")
    uid = 61000 + os.getpid() % 4000

    def run(code, nproc=None):
        def demote():
            if nproc is not None:
                resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
            os.setgid(uid)
            os.setuid(uid)

        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {k: v for k, v in os.environ.items() if k != "APIR_HOST_MAX_POOL_THREADS"}
        env.update(PYTHONPATH=root, HOME="/tmp", NUMBA_CACHE_DIR=f"/tmp/apir-nproc-{uid}")
        return subprocess.run([sys.executable, "-c", code], preexec_fn=demote, capture_output=True, text=True,
                              env=env, cwd="/tmp", timeout=120)

    try:
        probe = run("import apir.host, tests.host.hostkit")
    except PermissionError as exc:  # an interpreter under /root (pyenv), which others cannot run
        pytest.skip(f"uid {uid} cannot run {sys.executable}: {exc}")
    if probe.returncode != 0:  # a checkout under /root, unreadable to others
        pytest.skip(f"uid {uid} cannot import apir from here: {probe.stderr[-300:]}")
    p = run(_CHILD, nproc=60)
    assert p.returncode == 0 and "held" in p.stdout, p.stderr[-2000:]


_CHILD_AS = """
import resource
from apir.host import HostContext
from apir.host.config import CONFIG_KEY_N_THREADS
from tests.host.hostkit import Guest

warm = Guest(HostContext(1, {CONFIG_KEY_N_THREADS: "1"}))  # everything loaded and first used
with open("/proc/self/statm") as f:
    size = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + (96 << 20), resource.RLIM_INFINITY))
g = Guest(HostContext(2, {CONFIG_KEY_N_THREADS: "64"}))  # 64 stacks of 8 MiB: no room
print("threads", g.ctx._library.n_threads, flush=True)
"""


def test_a_context_with_no_room_for_its_threads_does_not_abort_the_host(ggml):
    """With the address space nearly spent (RLIMIT_AS just above what the process maps),
    LoadLibrary of a 64-thread context: ggml_threadpool_new's GGML_ASSERT on pthread_create
    aborted the process; the host checks first and computes on one thread."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root, APIR_HOST_MAX_POOL_THREADS="1000")  # the pool is tried
    p = subprocess.run([sys.executable, "-c", _CHILD_AS], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "threads 1" in p.stdout
