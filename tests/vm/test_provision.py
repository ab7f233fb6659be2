"""apir/vm/provision.py: with nothing provisioned, `apir vm run` says exactly which command
provisions (and `apir vm provision` is that command); no VM is booted here."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

from apir.vm import provision


def test_vm_run_with_nothing_provisioned_names_the_command_to_run(tmp_path):
    cache = tmp_path / "vm-cache"
    run = subprocess.run([sys.executable, "-m", "apir", "vm", "run", "--", "true"], capture_output=True, text=True,
                         env=dict(os.environ, APIR_VM_CACHE=str(cache)), timeout=120)
    assert run.returncode == 1
    command = f"{shlex.quote(sys.executable)} -m apir vm provision {shlex.quote(str(cache))}"
    if os.geteuid() != 0:
        command = "sudo " + command
    assert run.stderr == (f"apir: error: no VM provisioned in {cache} (QEMU 11.1 and guest kernels): run "
                          f"`{command}` once (root, Debian 12, a few minutes; docs/vm.md)\n")
    assert run.stdout == ""
    assert not cache.exists()  # nothing started, nothing written


def test_the_named_command_is_apir_vm_provision_of_that_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("APIR_VM_CACHE", str(tmp_path / "c"))
    words = shlex.split(provision.provision_command())
    assert words[-5:] == ["-m", "apir", "vm", "provision", str(tmp_path / "c")]
    assert words[words.index("-m") - 1] == sys.executable
    assert provision.cache_dir() == tmp_path / "c"


def test_the_cache_folder_follows_the_apir_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("APIR_VM_CACHE", raising=False)
    monkeypatch.setenv("APIR_CACHE_DIR", str(tmp_path))
    assert provision.cache_dir() == tmp_path / "vm" / "qemu-11.1"
