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


@pytest.fixture
def tasks(tmp_path, monkeypatch):
    """A stand-in /proc/self/task: write(states) makes one thread per state letter."""
    root = tmp_path / "task"
    monkeypatch.setattr(spin_policy, "_TASKS", str(root))

    def write(states):
        root.mkdir()
        for tid, state in enumerate(states, 100):
            (root / str(tid)).mkdir()
            # the command name may hold spaces and parentheses: the state follows the last ")"
            (root / str(tid) / "stat").write_text(f"{tid} (py (x) y) {state} 1 {tid} {tid} 0 -1\n")

    return write


@pytest.mark.parametrize(
    "running,own,free",
    [("1/90", "RSS", 2), ("2/90", "RRS", 2), ("2/90", "RSS", 1), ("3/90", "RSS", 1), ("9/90", "R", 1)],
)
def test_free_cores_leave_out_this_processs_own_runnable_threads(loadavg, tasks, running, own, free):
    loadavg(f"1.0 1.0 1.0 {running} 1\n")
    tasks(own)
    assert spin_policy.own_runnable_threads() == own.count("R")
    assert spin_policy.free_cores() == free


def test_free_cores_all_when_not_readable(loadavg, tasks, tmp_path, monkeypatch):
    loadavg("garbage\n")
    tasks("R")
    assert spin_policy.free_cores() == 2
    loadavg("1.0 1.0 1.0 9/90 1\n")
    monkeypatch.setattr(spin_policy, "_TASKS", str(tmp_path / "none"))
    assert spin_policy.own_runnable_threads() == -1
    assert spin_policy.free_cores() == 2


def test_free_cores_of_this_process_for_real():
    """The real files: this thread is running, so it counts itself among its own."""
    assert spin_policy.own_runnable_threads() >= 1
    assert 1 <= spin_policy.free_cores() <= spin_policy._cores
