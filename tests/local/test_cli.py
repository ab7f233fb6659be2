"""The `apir` command: info over embedded and socket, one-line errors, registration."""

import json
import subprocess
import sys

import apir.ggml
from apir.cli import build_parser, main
from tests.local.hostproc import HostProcess


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "apir.cli", *args], capture_output=True, text=True,
                          timeout=120)


def expected_cpu():
    g = apir.ggml.load()
    cpu = g.ggml_backend_dev_by_type(0)
    return g.ggml_backend_dev_name(cpu).decode(), g.ggml_backend_dev_description(cpu).decode()


def test_info_embedded_and_socket(tmp_path, capsys):
    name, description = expected_cpu()
    assert main(["info", "--json"]) == 0
    embedded = json.loads(capsys.readouterr().out)
    assert embedded["transport"] == "embedded"
    assert embedded["protocol"] == {"guest": "0.2", "host": "0.2", "capset": 10}
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
    r = run_cli("info", "--socket", str(tmp_path / "nobody.sock"))
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("apir: error: ") and "no apir host" in lines[0]
    assert run_cli("info", "--socket", "a", "--drm", "b").returncode == 2


def test_subcommands_come_from_modules():
    parser = build_parser()
    args = parser.parse_args(["host", "serve", "--socket", "/tmp/x", "--ggml-reg", "r",
                              "--config", "k=v", "--log-level", "debug"])
    from apir.cli import host_config_from_args
    assert host_config_from_args(args) == {"k": "v", "ggml.library.reg": "r"}
    assert args.log_level == "debug" and callable(args.run)
