"""The `apir` command: info over embedded and socket, one-line errors, registration."""

import gc
import json
import os
import re
import socket
import subprocess
import sys

import pytest

import apir
import apir.ggml
import apir.cli
from apir.cli import build_parser, human_size, main
from tests.local.hostproc import HostProcess
from tests.local.localkit import run_cli


def expected_cpu():
    g = apir.ggml.load()
    cpu = g.ggml_backend_dev_by_type(0)
    return g.ggml_backend_dev_name(cpu).decode(), g.ggml_backend_dev_description(cpu).decode()


def test_info_embedded_and_socket(tmp_path, capsys):
    name, description = expected_cpu()
    assert main(["info", "--json"]) == 0
    embedded = json.loads(capsys.readouterr().out)
    assert embedded["transport"] == "embedded"
    assert embedded["protocol"] == {"guest": "0.2", "host": "0.2", "capset": 10,
                                    "extensions": ["devices", "graph_replay", "async", "use_counts"], "devices": 1}
    assert (embedded["device"]["name"], embedded["device"]["description"]) == (name, description)
    assert embedded["buffer_type"]["alignment"] > 0
    host = HostProcess(tmp_path / "apir.sock")
    try:
        r = run_cli("info", "--json", "--socket", host.path)
        assert r.returncode == 0, r.stderr
        over_socket = json.loads(r.stdout)
        assert over_socket["transport"] == "socket"
        assert over_socket["device"]["name"] == name
        assert over_socket["buffer_type"] == embedded["buffer_type"]
        text = run_cli("info", "--socket", host.path).stdout
        assert "HandShake ok" in text and name in text
    finally:
        host.stop()
    assert "context 1 on capset 10" in host.log()


def test_errors_are_one_line_and_nonzero(tmp_path):
    stale = tmp_path / "stale.sock"  # a socket file nobody listens on (a dead host's leftover)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()
    r = run_cli("info", "--socket", str(stale))
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"apir: error: local:{stale}: no apir host is serving there")
    assert run_cli("info", "--socket", "a", "--drm", "b").returncode == 2


def _error(r, code):
    """The one `apir: error:` line of a run that exited with `code`."""
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    return r.stderr.strip().splitlines()[-1]


def test_socket_paths_are_checked_and_named(tmp_path):
    # Empty: a usage error (it used to mean "embedded" for info and "serving on " for serve).
    assert "argument --socket: empty socket path" in _error(run_cli("info", "--socket", ""), 2)
    assert "argument --socket: empty socket path" in _error(run_cli("host", "serve", "--socket", ""), 2)
    assert "argument --drm: empty render node path" in _error(run_cli("info", "--drm", ""), 2)
    long = str(tmp_path / ("x" * 120))
    assert f"{long}: {len(long)} bytes, longer than a Unix socket path can be (107)" in _error(
        run_cli("info", "--socket", long), 2)
    missing = tmp_path / "no" / "such" / "folder" / "apir.sock"
    assert _error(run_cli("host", "serve", "--socket", str(missing)), 1) == (
        f"apir: error: {missing}: its folder {missing.parent} does not exist")
    regular = tmp_path / "file.txt"
    regular.write_text("x")
    assert _error(run_cli("info", "--socket", str(regular)), 1) == (
        f"apir: error: {regular}: not a Unix socket (a regular file)")
    assert _error(run_cli("host", "serve", "--socket", str(regular)), 1) == (
        f"apir: error: {regular}: exists and is not a socket (a regular file); not replacing it")
    assert regular.read_text() == "x"
    nobody = tmp_path / "nobody.sock"
    assert _error(run_cli("info", "--socket", str(nobody)), 1) == (
        f"apir: error: {nobody}: no such socket; start a host there with `apir host serve --socket {nobody}`")


def test_exit_codes_usage_2_runtime_1():
    assert "--config expects KEY=VALUE, got 'x'" in _error(run_cli("info", "--config", "x"), 2)
    assert "--no-such-option" in _error(run_cli("info", "--no-such-option"), 2)
    r = subprocess.run([sys.executable, "-m", "apir.cli", "info"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "APIR_LOG_LEVEL": "loud"})
    assert "$APIR_LOG_LEVEL='loud': expected one of debug" in _error(r, 2)
    # A runtime error: the ggml library the embedded host is told to load does not exist.
    assert _error(run_cli("info", "--ggml-library", "/nonexistent/libggml-x.so"), 1).startswith("apir: error: ")


def test_an_unknown_config_key_is_refused_with_the_known_ones_named():
    for command in (["info"], ["host", "serve", "--socket", "/tmp/never-made.sock"]):
        line = _error(run_cli(*command, "--config", "apir.host.bogus=1"), 2)
        assert line.startswith("apir: error: --config apir.host.bogus: not a host configuration key (known: "), line
        for key in ("apir.host.n_threads", "apir.local.max_connections", "ggml.library.path", "apir.host.work_budget"):
            assert key in line


@pytest.mark.parametrize("argv,threads", [((), os.cpu_count()), (("--threads", "3"), 3), (("--threads", "free"), os.cpu_count())])
def test_host_serve_computes_on_the_machines_cores_or_threads(tmp_path, argv, threads):
    """The thread count the host applied to a guest's context (its log line): every core by
    default, --threads N or free (apir.host.n_threads) when given."""
    host = HostProcess(tmp_path / "apir.sock", *argv)
    try:
        assert run_cli("info", "--socket", host.path).returncode == 0
    finally:
        host.stop()
    assert f"ctx 1: computing on {threads} threads" in host.log()
    assert ("each graph on the free ones" in host.log()) == ("free" in argv)


def test_threads_must_be_a_count_or_free():
    for value in ("0", "-1", "many"):
        assert f"argument --threads: {value!r} is not a thread count" in _error(
            run_cli("host", "serve", "--socket", "/tmp/never-made.sock", "--threads", value), 2)


def test_an_unknown_option_gets_its_commands_usage():
    """`apir embed --model foo x`: embed's usage and error, not the top-level usage."""
    r = run_cli("embed", "--model", "foo", "x")
    assert r.returncode == 2
    assert r.stderr.startswith("usage: apir embed ") and r.stderr.strip().endswith(
        "apir embed: error: unrecognized arguments: --model"), r.stderr
    r = run_cli("host", "serve", "--socket", "/tmp/never-made.sock", "--bogus")
    assert r.stderr.startswith("usage: apir host serve ") and "unrecognized arguments: --bogus" in r.stderr


def test_a_read_only_socket_folder_is_named_with_its_cause(tmp_path, capsys, monkeypatch):
    """`host serve --socket /ro/apir.sock` said only "[Errno 30] Read-only file system"."""
    folder = tmp_path / "ro"
    folder.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: str(p) != str(folder) and real_access(p, mode))
    sock = folder / "apir.sock"
    from apir.socket_path import SocketPathError, check_listen

    with pytest.raises(SocketPathError):  # (checked first: a host that started would serve on)
        check_listen(str(sock))
    for command in (["host", "serve"], ["host", "vhost-user"]):
        assert main([*command, "--socket", str(sock)]) == 1
        assert capsys.readouterr().err == (
            f"apir: error: {sock}: cannot create a socket there: its folder {folder} is not writable by this user\n")


def test_info_on_a_vhost_user_socket_says_what_it_is(tmp_path):
    """It blamed the host's connection limit alone."""
    sock = tmp_path / "vgpu.sock"
    proc = subprocess.Popen([sys.executable, "-m", "apir.cli", "host", "vhost-user", "--socket", str(sock)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert "virtio-gpu vhost-user device on" in proc.stderr.readline()
        line = _error(run_cli("info", "--socket", str(sock)), 1)
    finally:
        proc.terminate()
        proc.wait(30)
    assert line == (f"apir: error: local:{sock}: the host closed the connection before answering HELLO: either "
                    "no `apir host serve` socket (a `host vhost-user` socket is for QEMU: inside its VM, use --drm) "
                    "or a host at its connection limit (apir.local.max_connections, or "
                    "apir.local.max_connections_per_peer for this user: see its log)")


def test_a_backend_the_build_lacks_says_which_build_has_it():
    """`apir info --backend vulkan:0` without a Vulkan build said "code 20 ... (NO_DEVICE)"."""
    g = apir.ggml.load()
    if g.ggml_backend_reg_by_name(b"Vulkan"):
        pytest.skip("this ggml build has Vulkan")
    line = _error(run_cli("info", "--backend", "vulkan:0"), 1)
    assert line.startswith("apir: error: --backend vulkan:0: 'vulkan:0': this ggml has no backend 'vulkan' (it has ")
    assert f"; the ggml build apir loaded ({g.lib_dir}) has no vulkan device: scripts/build-ggml-backends.sh" in line


def test_python_m_apir_beside_a_clone_named_apir_says_so(tmp_path):
    """In a clone's parent folder, the clone (a folder named apir, no __init__.py) is the
    namespace package `apir` that hides an editable install's: a one-line message, not an
    ImportError traceback. (Stood in for: the package's __main__ run with that `apir`.)"""
    clone = tmp_path / "apir"
    clone.mkdir()
    main_py = os.path.join(os.path.dirname(apir.__file__), "__main__.py")
    code = ("import runpy, sys, types; ns = types.ModuleType('apir'); ns.__path__ = [sys.argv[1]]; "
            "sys.modules['apir'] = ns; runpy.run_path(sys.argv[2], run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code, str(clone), main_py], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert (r.returncode, r.stderr) == (1, f"python -m apir: the folder {clone} hides the apir package (run it "
                                           "from inside the clone, or use the `apir` command)\n")


def test_a_host_refuses_a_backend_it_cannot_serve_before_serving(tmp_path):
    # Each used to start and say "serving"; the first guest then got a LoadLibrary error code.
    sock = str(tmp_path / "apir.sock")
    for argv, why in (
        (["--backend", "nosuch"], "--backend nosuch: 'nosuch': this ggml has no backend 'nosuch' (it has "),
        (["--backend", "cpu:x"], "--backend cpu:x: 'cpu:x': expected NAME[:DEVICE_INDEX]"),
        (["--backend", "rpc:127.0.0.1:1"], "--backend rpc:127.0.0.1:1: ggml-rpc server 127.0.0.1:1 not reachable"),
        (["--backend", "/nonexistent/libggml-x.so"], "ggml backend library '/nonexistent/libggml-x.so': no such file"),
    ):
        for command in (["host", "serve", "--socket", sock], ["host", "vhost-user", "--socket", sock]):
            line = _error(run_cli(*command, *argv), 2)
            assert line.startswith(f"apir: error: {why}"), (command, argv, line)
            assert not os.path.exists(sock)


def test_entry_returns_mains_status_and_freezes_what_is_left(monkeypatch):
    """The program's entry point: main's exit status, and the objects alive then frozen out of
    the cyclic GC (the interpreter's teardown skips them)."""
    monkeypatch.setattr(apir.cli, "main", lambda: 3)
    gc.unfreeze()
    probe = [object()]  # a list: tracked by the GC
    assert any(o is probe for o in gc.get_objects())
    try:
        assert apir.cli.entry() == 3
        assert gc.get_freeze_count() > 0
        assert not any(o is probe for o in gc.get_objects())  # frozen objects are not listed
    finally:
        gc.unfreeze()


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"apir {apir.__version__} (APIR protocol 0.2)\n"


def test_info_text_names_enums_and_sizes(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "transport:          embedded host in this process\n" in out
    assert "(APIR capset 10), HandShake ok" in out
    assert "type:               CPU (ggml_backend_dev_type 0)\n" in out
    assert "max buffer size:  unlimited\n" in out  # the CPU buffer type answers SIZE_MAX
    assert "18446744073709551615" not in out and "(embedded)" not in out
    mem = [line for line in out.splitlines() if line.startswith("memory:")][0]
    assert re.fullmatch(r"memory: +\d+\.\d [KMGT]iB free of \d+\.\d [KMGT]iB", mem), mem


def test_human_size():
    assert [human_size(n) for n in (0, 1023, 1024, 1536, 3 << 30, (1 << 64) - 1)] == [
        "0 bytes", "1023 bytes", "1.0 KiB", "1.5 KiB", "3.0 GiB", "unlimited"]


def test_subcommands_come_from_modules():
    parser = build_parser()
    args = parser.parse_args(["host", "serve", "--socket", "/tmp/x", "--ggml-reg", "r",
                              "--config", "apir.host.poll=5", "--log-level", "debug"])
    from apir.cli import host_config_from_args
    assert host_config_from_args(args) == {"apir.host.poll": "5", "ggml.library.reg": "r"}
    assert args.log_level == "debug" and callable(args.run)


def test_host_commands_raise_the_open_files_limit_to_the_hard_one():
    import resource
    import subprocess
    import sys

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard <= 256:
        pytest.skip(f"the hard open files limit is {hard}")
    code = (
        "import resource; from apir.cli import raise_open_files_limit; raise_open_files_limit(); "
        "print(*resource.getrlimit(resource.RLIMIT_NOFILE))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)),
        capture_output=True, text=True, check=True,
    )
    assert run.stdout.split() == [str(hard), str(hard)]
