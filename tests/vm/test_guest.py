"""apir's guest in a real Linux VM (TCG) against apir's virtio-gpu device (`apir host
vhost-user`) behind QEMU 11.1: the kernel's virtio_gpu driver in between, DrmDevice on
/dev/dri/renderD128. One boot per kernel runs every check (tests/vm/guest_program.py); these
tests assert on its results. The device is killed during the last check."""

import pytest

pytestmark = pytest.mark.vm


def test_kernel_offers_what_apir_needs(guest):
    params = guest.check("params")
    assert params["FEATURES_3D"] == 1
    assert params["RESOURCE_BLOB"] == 1 and params["HOST_VISIBLE"] == 1 and params["CONTEXT_INIT"] == 1
    assert params["SUPPORTED_CAPSET_IDS"] & (1 << 10)  # capset 10: APIR
    assert guest.results["kernel"] == guest.kernel.release


def test_info_over_drm(guest):
    info = guest.check("info")
    assert info["transport"] == "drm" and info["node"] == "/dev/dri/renderD128", info
    # apir's guest and host both have the extensions (docs/protocol.md section 12): agreed in a VM too
    assert info["protocol"] == {
        "guest": "0.2",
        "host": "0.2",
        "capset": 10,
        "devices": 1,
        "extensions": ["devices", "graph_replay", "async", "use_counts"],
    }
    assert info["device"]["name"] == "CPU" and info["device"]["memory_total"] > 0
    assert info["buffer_type"]["alignment"] > 0


def test_embed_over_drm_is_bit_identical_to_embedded(guest, embedded_embeddings):
    got = guest.check("embed")
    assert got["backend"]["transport"] == "drm" and got["backend"]["through_apir"] is True
    assert embedded_embeddings["backend"]["transport"] == "embedded"
    assert len(got["embeddings"]) == len(embedded_embeddings["embeddings"]) == 3
    # JSON floats round-trip exactly: equal values are equal bits
    assert got["embeddings"] == embedded_embeddings["embeddings"]


def test_client_calls_and_transfers_larger_than_the_window(guest):
    c = guest.check("client")
    assert c["transfer_bytes"] > 8 * c["window_bytes"]
    assert c["set_get_equal"] is True
    assert c["graph_status"] == 0  # GGML_STATUS_SUCCESS
    assert c["add_equal"] is True
    assert c["name"] and c["buft_name"] and c["alignment"] > 0
    assert c["memory"][1] > 0


def test_eight_threads_of_mixed_calls(guest):
    t = guest.check("threads")
    assert t["errors"] == []
    assert t["threads"] == 8 and t["calls"] == 8 * 150


@pytest.mark.parametrize("kind", ["zero-copy", "host-only"])
def test_ggml_backend_graph_equals_cpu(guest, kind):
    b = guest.check("backend")[kind]
    assert b["shape"] == [4, 16] and b["finite_nonzero"]
    assert b["equal"] is True  # byte for byte against ggml's CPU backend in the guest
    assert b["big_round_trip"] is True
    assert b["live_buffers"] == 0


def test_device_killed_mid_call_is_an_error_within_the_timeout(guest):
    k = guest.check("kill")
    assert guest.killed_after_s is not None, "the host never saw kill.ready"
    assert k["calls_before"] > 0
    assert k["error"] is not None and "Timeout" in k["error"], k
    assert k["seconds_to_error"] <= k["timeout_s"] + 5
    # the VM kept running: the guest program finished and the shell reported its status
    assert guest.vm.rc == 0
    assert "guest_program:" in guest.logs[f"guest.log ({guest.kernel.suite})"]
