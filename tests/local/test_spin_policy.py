"""apir.local.spin_policy: spin only while the machine has a core for every runnable thread."""

import pytest

from apir.local import spin_policy


@pytest.fixture
def loadavg(tmp_path, monkeypatch):
    path = tmp_path / "loadavg"
    monkeypatch.setattr(spin_policy, "_LOADAVG", str(path))
    monkeypatch.setattr(spin_policy, "_cores", 2)
    monkeypatch.setattr(spin_policy, "_checked_at", -1.0)

    def write(text):
        path.write_text(text)
        spin_policy._checked_at = -1.0  # the next call samples again

    return write


@pytest.mark.parametrize("running,pays", [(1, True), (2, True), (3, False), (17, False)])
def test_spins_while_runnable_threads_fit_the_cores(loadavg, running, pays):
    loadavg(f"15.40 14.74 11.78 {running}/1234 27999\n")
    assert spin_policy.runnable_threads() == running
    assert spin_policy.spinning_pays() is pays


def test_unreadable_count_spins(loadavg):
    loadavg("garbage\n")
    assert spin_policy.runnable_threads() == -1
    assert spin_policy.spinning_pays() is True


def test_sampled_at_most_every_sample_s(loadavg, tmp_path):
    loadavg("1.0 1.0 1.0 9/100 1\n")
    assert spin_policy.spinning_pays() is False
    (tmp_path / "loadavg").write_text("1.0 1.0 1.0 1/100 1\n")
    assert spin_policy.spinning_pays() is False  # within SAMPLE_S: the last sample holds
    spin_policy._checked_at -= spin_policy.SAMPLE_S
    assert spin_policy.spinning_pays() is True
