"""`apir vm run` (apir/vm/run.py), through the command line docs/vm.md gives: llama.cpp's
llama-simple on SmolLM2 in one VM and in two (one host process), printing the text of the same
binary run locally on ggml CPU; Ctrl-C leaving no QEMU or host process and no temporary file,
exit 130; and the relay that labels each VM's lines (no VM)."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from apir.vm.run import Relay, guest_script
from tests.cref import REPO
from tests.llama.conftest import llama_paths, smollm2  # noqa: F401 - fixtures of tests/llama

PROMPT = "The capital of France is"
N_PREDICT = 16


def apir(*args: str) -> list:
    return [sys.executable, "-m", "apir", *args]


def llama_simple(paths, model) -> list:
    # docs/vm.md's command (every layer offloaded: -ngl 99)
    return [paths["LLAMA_SIMPLE"], "-m", str(model), "-n", str(N_PREDICT), "-ngl", "99", PROMPT]


def host_env(paths) -> dict:
    """docs/vm.md: the host on the build's ggml (APIR_GGML_LIB_DIR, APIR_GGML_INCLUDE_DIR)."""
    return dict(os.environ, APIR_GGML_LIB_DIR=paths["GGML_LIB_DIR"], APIR_GGML_INCLUDE_DIR=paths["GGML_INCLUDE"])


@pytest.fixture(scope="module")
def local_text(llama_paths, smollm2):  # noqa: F811
    """llama-simple's stdout on the host, no device: ggml CPU of the same build."""
    run = subprocess.run(llama_simple(llama_paths, smollm2), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[virtgpu]" not in run.stderr
    assert run.stdout.startswith(PROMPT) and len(run.stdout) > len(PROMPT) + 10, run.stdout
    return run.stdout


@pytest.mark.vm
@pytest.mark.llama
def test_vm_run_llama_prints_the_generated_text(provisioned, llama_paths, smollm2, local_text, tmp_path):  # noqa: F811
    run = subprocess.run(apir("vm", "run", "--threads", "1", "--host-log", str(tmp_path / "host.log"), "--",
                              *llama_simple(llama_paths, smollm2)),
                         capture_output=True, text=True, env=host_env(llama_paths), cwd=REPO, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    # every layer on apir's device through the guest's render node, the text of the local run
    offloaded = re.search(r"offloaded (\d+)/(\d+) layers to GPU", run.stderr)
    assert offloaded and offloaded.group(1) == offloaded.group(2), run.stderr[-4000:]
    assert "ggml-virtgpu: using DRM device /dev/dri/renderD128" in run.stderr
    assert "[virtgpu] CPU model buffer size" in run.stderr
    assert run.stdout == local_text
    assert not re.search(r" (refused|failed): | ERROR |Traceback", (tmp_path / "host.log").read_text())


@pytest.mark.vm
@pytest.mark.llama
def test_vm_run_two_vms_prints_each_vms_text_labelled(provisioned, llama_paths, smollm2, local_text):  # noqa: F811
    run = subprocess.run(apir("vm", "run", "--vms", "2", "--threads", "1", "--", *llama_simple(llama_paths, smollm2)),
                         capture_output=True, text=True, env=host_env(llama_paths), cwd=REPO, timeout=1200)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = run.stdout.splitlines()
    assert {line[:6] for line in lines} == {"[vm1] ", "[vm2] "}, run.stdout
    for name in ("vm1", "vm2"):
        mine = [line[6:] for line in lines if line.startswith(f"[{name}] ")]
        assert mine == local_text.splitlines()
        assert re.search(rf"^\[{name}\] .*offloaded (\d+)/\1 layers to GPU", run.stderr, re.M), run.stderr[-4000:]


def _children(pid: int) -> list:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


@pytest.mark.vm
def test_ctrl_c_leaves_no_qemu_host_or_temporary_file_and_exits_130(provisioned, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen(apir("vm", "run", "--", "sh", "-c", "echo started; exec sleep 600"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, TMPDIR=str(tmp)))
    try:
        # the program runs in the guest (its first line came back streamed)
        ready, _, _ = select.select([proc.stdout], [], [], 600)
        assert ready and proc.stdout.readline() == b"started\n", proc.stderr.read1(4000)
        children = _children(proc.pid)
        cmdlines = [Path(f"/proc/{c}/cmdline").read_bytes() for c in children]
        assert any(b"qemu-system-x86_64" in c for c in cmdlines) and any(b"vhost-user" in c for c in cmdlines), cmdlines
        assert list(tmp.iterdir()) != []
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        assert b"apir: interrupted" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 5  # (a child reaped by init after its parent ended)
    while any(os.path.exists(f"/proc/{c}") for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [c for c in children if os.path.exists(f"/proc/{c}")] == []
    assert list(tmp.iterdir()) == []


def test_relay_labels_each_line_and_ends_a_last_partial_one(tmp_path):
    r, w = os.pipe()
    out = (tmp_path / "out").open("wb")
    relay = Relay(r, out, b"[vm2] ").start()
    for chunk in (b"one\ntw", b"o\n", b"\nthree"):
        os.write(w, chunk)
    os.close(w)
    relay.join()
    out.close()
    assert (tmp_path / "out").read_bytes() == b"[vm2] one\n[vm2] two\n[vm2] \n[vm2] three\n"


def test_relay_without_a_label_copies_bytes_as_they_are(tmp_path):
    r, w = os.pipe()
    out = (tmp_path / "out").open("wb")
    relay = Relay(r, out).start()
    os.write(w, b"a\r\nb\x00c")
    os.close(w)
    relay.join()
    out.close()
    assert (tmp_path / "out").read_bytes() == b"a\r\nb\x00c"


@pytest.mark.vm
def test_a_vm_ending_without_the_programs_status_is_an_error_naming_its_console(provisioned):
    run = subprocess.run(apir("vm", "run", "--timeout", "5", "--", "sleep", "600"), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 1
    assert run.stderr.endswith("apir: error: vm1 ended without the program's exit status (QEMU exit -9; above: "
                               "the end of its console and of the host's log)\n"), run.stderr
    assert "--- vm1's console ends:\n" in run.stderr and "minivm: killed at the 5 s timeout" in run.stderr
    assert "--- the host's log ends:\napir: virtio-gpu vhost-user device on " in run.stderr


def test_the_guest_script_exports_the_environment_enters_the_folder_and_execs_the_program(tmp_path):
    script = guest_script(["printf", "%s|", "a b", "it's", "$HOME"], {"X": "1 2", "PWD": "/elsewhere", "A-B": "no"},
                          "/work dir")
    assert script.splitlines() == ["export X='1 2'", "cd '/work dir' || exit 125",
                                   """exec printf '%s|' 'a b' 'it'"'"'s' '$HOME'"""]
    # what /bin/sh makes of it
    (tmp_path / "work dir").mkdir()
    run = subprocess.run(["sh", "-c", script.replace("/work dir", str(tmp_path / "work dir"))], capture_output=True,
                         text=True)
    assert run.stdout == "a b|it's|$HOME|"


@pytest.mark.vm
def test_vm_run_attaches_to_a_running_device_and_leaves_it_serving(provisioned, tmp_path):
    sock = tmp_path / "vgpu.sock"
    host = subprocess.Popen(apir("host", "vhost-user", "--socket", str(sock)), stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists() and time.monotonic() < deadline and host.poll() is None:
            time.sleep(0.1)
        for status in (3, 0):  # two VMs one after the other on the same device
            run = subprocess.run(apir("vm", "run", "--device", str(sock), "--", "sh", "-c",
                                      f"ls /dev/dri; exit {status}"),
                                 capture_output=True, text=True, timeout=600)  # fmt: skip
            assert run.returncode == status, run.stderr[-3000:]
            assert "renderD128" in run.stdout
        assert host.poll() is None  # the device is the user's: apir vm run leaves it running
    finally:
        host.terminate()
        host.wait(timeout=60)


def test_vm_run_device_must_be_a_socket_and_one_per_vm(tmp_path):
    run = subprocess.run(apir("vm", "run", "--device", str(tmp_path / "none.sock"), "--", "true"),
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2 and "no socket there" in run.stderr
    run = subprocess.run(apir("vm", "run", "--vms", "2", "--device", str(tmp_path / "a"), "--", "true"),
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2 and "one --device per VM" in run.stderr
