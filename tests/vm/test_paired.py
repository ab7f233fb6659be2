"""Paired VMs: two guests at once, each with its own vhost-user socket, served by ONE host
process (tests/vm/paired_host.py: apir's device twice in one process). Both compute
concurrently and exactly; neither can name or read the other's buffers or blobs (each VM's
device has its own contexts, resource ids and handle tables); killing one VM frees every
context, blob and ggml buffer it held while the other keeps computing."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from apir.vm import machine
from tests.cref import REPO
from tests.vm.session import GUEST_PROGRAM, GuestSession, guest_env

pytestmark = pytest.mark.vm

PAIRED_HOST = Path(__file__).with_name("paired_host.py")


def read_status(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


@pytest.fixture(scope="session")
def paired(provisioned, vm_kernel, vm_work, embedded_embeddings):
    """Runs the pair; returns {"a": GuestSession, "b": ..., "events": host times, "counts": ...}."""
    root = vm_work / f"paired-{vm_kernel.suite}"
    works = {r: root / r for r in "ab"}
    for w in works.values():
        w.mkdir(parents=True)
        shutil.copytree(vm_work / "numba", w / "numba", dirs_exist_ok=True)
    status_path = root / "status.json"
    sockets = {r: works[r] / "vgpu.sock" for r in "ab"}
    host_log = open(root / "host.log", "wb")
    host = subprocess.Popen([sys.executable, str(PAIRED_HOST), str(status_path)]
                            + [f"{r}={sockets[r]}" for r in "ab"], stdout=host_log, stderr=subprocess.STDOUT,
                            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    vms = {}
    events, counts = {}, {"samples_both_computing": 0}
    t0 = time.monotonic()
    try:
        deadline = time.monotonic() + 60
        while not all(s.exists() for s in sockets.values()):
            assert host.poll() is None and time.monotonic() < deadline, (root / "host.log").read_text()
            time.sleep(0.1)
        for r in "ab":
            env = dict(guest_env(works[r]), APIR_VM_ROLE=r)
            command = (" ".join(f"{k}={v}" for k, v in env.items())
                       + f" {sys.executable} {GUEST_PROGRAM} {works[r]}/guest.json paired > {works[r]}/guest.log 2>&1")
            vms[r] = machine.Vm(prov=provisioned, kernel=vm_kernel, work=works[r], command=command,
                                socket=sockets[r], timeout_s=900, name=f"paired-{r}").start()

        def seen(r, name):
            key = f"{r}:{name}"
            if key not in events and (works[r] / name).exists():
                events[key] = time.monotonic() - t0
            return key in events

        killed = False
        while vms["b"].proc.poll() is None and time.monotonic() - t0 < 900:
            status = read_status(status_path).get("vms", {})
            if all((status.get(r, {}).get("device") or {}).get("contexts", 0) > 0 for r in "ab"):
                counts["samples_both_computing"] += 1
            for r in "ab":
                for name in ("compute.start", "compute.end", "handles.json", "probed"):
                    seen(r, name)
            if seen("a", "compute.start") and seen("b", "compute.start") and "both.started" not in events:
                for w in works.values():
                    (w / "both.started").write_text("")
                events["both.started"] = time.monotonic() - t0
            if seen("a", "handles.json") and seen("b", "handles.json") and not (works["a"] / "peer.json").exists():
                # each copy renamed into place whole: the guest reads peer.json once it exists
                for src, dst in (("b", "a"), ("a", "b")):
                    shutil.copy(works[src] / "handles.json", works[dst] / "peer.json.part")
                    os.replace(works[dst] / "peer.json.part", works[dst] / "peer.json")
            if not killed and seen("a", "probed") and seen("b", "probed"):
                counts["a_before_kill"] = status["a"]
                counts["b_before_kill"] = status["b"]
                vms["a"].kill()
                events["a:killed"] = time.monotonic() - t0
                killed = True
                # wait until the host noticed and freed a's state
                limit = time.monotonic() + 60
                while time.monotonic() < limit:
                    st = read_status(status_path).get("vms", {}).get("a", {})
                    if not st.get("connected") and st.get("sessions_ended", 0) >= 1:
                        break
                    time.sleep(0.2)
                time.sleep(1)
                counts["a_after_kill"] = read_status(status_path)["vms"]["a"]
                counts["b_after_kill"] = read_status(status_path)["vms"]["b"]
                (works["b"] / "a-killed").write_text("")
            if vms["a"].proc.poll() is not None and not killed:
                events["a:ended-early"] = time.monotonic() - t0
                break  # a ended on its own: the checks below say why
            time.sleep(0.2)
        events["loop-ended"] = time.monotonic() - t0
        if not killed:
            vms["a"].kill()  # b ended (or time ran out) first: a would wait for its peer in vain
        for r in "ab":
            vms[r].wait()
        counts["b_after_end"] = read_status(status_path).get("vms", {}).get("b")
    finally:
        for vm in vms.values():
            vm.kill()
        host.terminate()
        try:
            host.wait(timeout=15)
        except subprocess.TimeoutExpired:
            host.kill()
        host_log.close()
    sessions = {}
    for r in "ab":
        out = works[r] / "guest.json"
        results = json.loads(out.read_text()) if out.exists() else {}
        logs = {f"console (paired-{r})": vms[r].console if r in vms else "",
                f"guest.log (paired-{r})": (works[r] / "guest.log").read_text(errors="replace")
                if (works[r] / "guest.log").exists() else "(none)"}
        sessions[r] = GuestSession(vm_kernel, vms[r], results, logs)
    sessions["b"].logs["host.log (paired)"] = (root / "host.log").read_text(errors="replace")[-20000:]
    sessions["b"].logs["paired events"] = json.dumps({"events": events, "counts": counts}, indent=1)
    return {"a": sessions["a"], "b": sessions["b"], "events": events, "counts": counts}


def test_both_vms_compute_concurrently_and_exactly(paired):
    a, b = paired["a"].check("paired"), paired["b"].check("paired")
    assert a["exact_rounds"] == a["rounds"] >= 40 and b["exact_rounds"] == b["rounds"] >= 40
    ev = paired["events"]
    # the two compute loops overlapped in host time, and the host saw both VMs' contexts live at once
    assert ev["a:compute.start"] < ev["b:compute.end"] and ev["b:compute.start"] < ev["a:compute.end"], ev
    assert paired["counts"]["samples_both_computing"] > 0


@pytest.mark.parametrize("role", ["a", "b"])
def test_neither_vm_can_name_or_read_the_others_buffers_or_blobs(paired, role):
    v = paired[role].check("paired")
    probes = v["buffer_probes"]
    assert probes["accepted"] == 0 and probes["peer_data_seen"] == 0, probes
    assert probes["handles"] >= 50 and probes["refused"] == 2 * probes["handles"]
    res = v["res_probes"]
    assert res["accepted"] == 0 and res["res_ids"] >= 60 and res["refused"] == res["res_ids"], res
    assert v["after_probes_exact"] is True and v["own_pattern_intact"] is True
    # the peer's handles exist on the peer: a probed handles the peer owns
    assert set(v["peer"]["buffers"]) - set(range(1, 65)) == set() and len(v["peer"]["buffers"]) >= 1


def test_killing_one_vm_frees_all_its_state_while_the_other_computes(paired):
    c = paired["counts"]
    before, after = c["a_before_kill"], c["a_after_kill"]
    assert before["device"]["contexts"] >= 1 and before["device"]["blobs"] >= 2 and before["ggml_buffers"] >= 1, c
    assert after["connected"] is False and after["sessions_ended"] == 1
    assert after["device"] == {"contexts": 0, "blobs": 0, "blob_bytes": 0, "closing_contexts": 0, "ggml_buffers": 0}
    assert after["ggml_buffers"] == 0 and after["host_contexts"] == before["host_contexts"]
    # b was untouched by a's teardown and computed on
    assert c["b_after_kill"]["connected"] is True
    assert c["b_after_kill"]["device"]["contexts"] == c["b_before_kill"]["device"]["contexts"]
    assert c["b_after_kill"]["ggml_buffers"] == c["b_before_kill"]["ggml_buffers"] >= 6
    b = paired["b"].check("paired")
    assert b["rounds_after_peer_killed"] == 40
    assert paired["b"].vm.rc == 0
