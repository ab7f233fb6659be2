"""llama.cpp, unmodified, inside a VM: tests/llama's token program
(llama_tokens, on the llama-cpp-python 0.3.36 build's libllama and ggml-virtgpu) runs in the
guest under TCG, where ggml-virtgpu opens the kernel's virtio-gpu render node
(/dev/dri/renderD128) and offloads every layer of SmolLM2-135M-Instruct Q4_1 to apir's device
(`apir host vhost-user` on the build's ggml 0.25, presented as a GPU). The prompt's tokens and
the N_PREDICT greedy tokens must be those of the same program on local ggml CPU of the same
build (tests/llama/runner.py's local run), with no host refusal or failure in the device's log.

The guest runs the host's binaries, libraries and model through the VM's read-only 9p root
(apir/vm/machine.py), so what runs in the VM is byte for byte what ran locally.
"""

from __future__ import annotations

import json
import re
import shlex

import pytest

from tests.llama.conftest import llama_paths, smollm2  # noqa: F401 - fixtures of tests/llama
from tests.llama.runner import HOST_ERROR, generate, local_env, parse_tokens, tokens_command
from apir.vm import machine
from apir.vm.host import VhostUserHost
from tests.vm.session import GuestSession

pytestmark = [pytest.mark.vm, pytest.mark.llama]

# tests/llama/test_generate.py's CI prompt
PROMPT = "The capital of France is"
# Greedy tokens compared: 64, as tests/llama/test_generate.py does through the shim; affordable
# under TCG (docs/design.md, Measurements; the guest builds and encodes each token's graph, the
# host computes it; docs/llama.md).
N_PREDICT = 64
# apir host vhost-user on the guest's ggml: --venus, since ggml-virtgpu asks for the Venus capset
# (4) unless GGML_REMOTING_USE_APIR_CAPSET is set, and llama.cpp runs here as it comes; presented
# as a GPU (docs/llama.md: a remote device of type CPU is taken by llama.cpp for its own CPU);
# one compute thread (2 shared cores)
# (--log-level info: the log names each guest context and its capset)
DEVICE_ARGS = ("--venus", "--config", "apir.host.device_type=gpu", "--config", "apir.host.n_threads=1",
               "--log-level", "info")


@pytest.fixture(scope="session")
def llama_in_vm(provisioned, vm_kernel, vm_work, llama_paths, smollm2) -> GuestSession:  # noqa: F811
    """One boot of `vm_kernel` running llama_tokens on PROMPT against a fresh device; results:
    {"rc", "tokens.out", "tokens.err" (llama_tokens' stdout and stderr), "device.log"}; logs (the
    report's): timing, console, the ends of tokens.err and device.log."""
    work = vm_work / f"llama-{vm_kernel.suite}"
    work.mkdir()
    argv = tokens_command(llama_paths, smollm2, PROMPT, N_PREDICT, threads=1)
    command = (f"LD_LIBRARY_PATH={shlex.quote(llama_paths['GGML_LIB_DIR'])} "
               f"{' '.join(shlex.quote(a) for a in argv)} > {work}/tokens.out 2> {work}/tokens.err")
    device = VhostUserHost([work / "vgpu.sock"], work / "device.log", args=DEVICE_ARGS).start(
        env={"APIR_GGML_LIB_DIR": llama_paths["GGML_LIB_DIR"], "APIR_GGML_INCLUDE_DIR": llama_paths["GGML_INCLUDE"]})
    vm = machine.Vm(provisioned, vm_kernel, work, command, socket=device.socket, timeout_s=900,
                    name=f"llama-{vm_kernel.suite}")
    try:
        vm.start()
        vm.wait()
    finally:
        vm.kill()
        device.stop()
    texts = {f: (work / f).read_text(errors="replace") if (work / f).exists() else ""
             for f in ("tokens.out", "tokens.err", "device.log")}
    name = vm.name
    logs = {f"timing ({name})": json.dumps({"boot_s": vm.boot_seconds(), "vm_s": round(vm.seconds, 1)}),
            f"console ({name})": vm.console}
    logs.update({f"{f} ({name})": texts[f][-20000:] or "(none)" for f in ("tokens.err", "device.log")})
    return GuestSession(vm_kernel, vm, {"rc": vm.rc, **texts}, logs)


def test_llama_cpp_in_vm_generates_the_local_tokens(llama_in_vm, llama_paths, smollm2):  # noqa: F811
    got = llama_in_vm.results
    errors = [line for line in got["device.log"].splitlines() if HOST_ERROR.search(line)]
    assert errors == [], "the device refused or failed commands"
    assert got["rc"] == 0, f"llama_tokens in the VM: rc {got['rc']}\n{got['tokens.err'][-3000:]}"
    remote = parse_tokens(got["tokens.out"], got["tokens.err"])
    local = generate(llama_paths, smollm2, PROMPT, local_env(llama_paths), n_predict=N_PREDICT)
    # the guest offloaded every layer to apir's device through the VM's render node, on the
    # Venus capset (4); the local run computed on ggml CPU
    offloaded = re.search(r"offloaded (\d+)/(\d+) layers to GPU", remote.stderr)
    assert offloaded and offloaded.group(1) == offloaded.group(2), offloaded
    assert "[virtgpu] CPU model buffer size" in remote.stderr
    assert "[virtgpu]" not in local.stderr
    assert re.search(r"context \d+ created \(capset 4, 'llama_tokens'\)", got["device.log"])
    assert remote.prompt == local.prompt
    assert len(local.generated) == N_PREDICT  # no end-of-generation token before N_PREDICT
    assert remote.generated == local.generated, (local.text, remote.text)
