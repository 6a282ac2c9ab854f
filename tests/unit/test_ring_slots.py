"""Machine-wide ring slots (gym_fork.worker.ring_slots): claimed across processes, freed by
their claimant only, taken over once their claimant is gone, refused in a directory that is not
private."""

from __future__ import annotations

import os
import time

import pytest

from gym_fork.worker import ring_slots


@pytest.fixture
def slots(tmp_path, monkeypatch):
    """A slot directory of this test's own, on a machine of ``cpus`` CPUs (``cpus - 1`` slots)."""
    monkeypatch.setenv("GYM_FORK_RING_SLOTS_DIR", str(tmp_path / "slots"))

    def machine(cpus: int) -> str:
        monkeypatch.setattr(os, "cpu_count", lambda: cpus)
        return str(tmp_path / "slots")

    return machine


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Forget which slot directories were warned about, so each test sees its own warning."""
    monkeypatch.setattr(ring_slots, "_warned", set())


def _child(fn, *, then_exit: bool) -> tuple[int, int]:
    """Fork a child that runs ``fn`` and reports on a pipe; it exits, or stays until killed."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.write(w, b"1" if fn() else b"0")
        finally:
            if then_exit:
                os._exit(0)
            time.sleep(60)
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.close(r)
    return pid, int(got)


def test_a_machine_has_one_slot_per_cpu_but_one(slots):
    slots(3)
    a, b = ring_slots.claim(), ring_slots.claim()
    assert a is not None and b is not None and a.path != b.path
    assert ring_slots.claim() is None  # both CPUs but the learner's are spun on
    freed = a.path
    a.release()
    c = ring_slots.claim()
    assert c is not None and c.path == freed
    b.release()
    c.release()
    assert os.listdir(ring_slots.directory()) == []
    slots(1)
    assert ring_slots.claim() is None  # one CPU: nothing to spin on


def test_slots_are_counted_across_processes(slots):
    slots(2)
    holder, claimed = _child(lambda: ring_slots.claim() is not None, then_exit=False)
    try:
        assert claimed
        assert ring_slots.claim() is None  # the other process holds the only slot
    finally:
        os.kill(holder, 9)
        os.waitpid(holder, 0)
    slot = ring_slots.claim()  # its claimant is gone: the slot is taken over
    assert slot is not None
    slot.release()


def test_a_slot_whose_pid_belongs_to_another_process_now_is_taken_over(slots):
    d = slots(2)
    os.makedirs(d, mode=0o700)
    with open(os.path.join(d, "slot-0"), "wb") as f:
        f.write(b"1 1")  # pid 1 exists, but it started at another time than this claimant did
    slot = ring_slots.claim()
    assert slot is not None
    slot.release()


def test_a_child_forked_from_the_claimant_does_not_free_its_slot(slots):
    slots(2)
    slot = ring_slots.claim()
    assert slot is not None
    try:
        pid, _ = _child(lambda: slot.release() is None, then_exit=True)
        os.waitpid(pid, 0)
        assert os.listdir(ring_slots.directory()) == ["slot-0"]
        assert ring_slots.claim() is None
    finally:
        slot.release()
    assert os.listdir(ring_slots.directory()) == []


def test_a_slot_directory_others_can_write_gives_no_slot(slots, fresh_warnings):
    d = slots(4)
    os.makedirs(d)
    os.chmod(d, 0o777)
    with pytest.warns(RuntimeWarning, match="others may use it"):
        assert ring_slots.claim() is None  # rather no ring than a directory another user controls
    os.chmod(d, 0o700)
    slot = ring_slots.claim()
    assert slot is not None
    slot.release()


@pytest.mark.parametrize("case", ["missing_parent", "a_file", "others_can_write", "another_owner"])
def test_a_slot_directory_that_cannot_be_used_warns_once_and_says_what_to_do(case, tmp_path, monkeypatch,
                                                                            fresh_warnings):
    d = tmp_path / "slots"
    if case == "missing_parent":
        d = tmp_path / "nonexistent" / "slots"
    elif case == "a_file":
        d.write_bytes(b"")
    elif case == "others_can_write":
        d.mkdir(mode=0o700)
        os.chmod(d, 0o777)
    else:
        if os.getuid() != 0:
            pytest.skip("giving a directory to another user needs root")
        d.mkdir(mode=0o700)
        os.chown(d, 65534, 65534)
    monkeypatch.setenv("GYM_FORK_RING_SLOTS_DIR", str(d))
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert ring_slots.problem() is not None  # what `gym-fork doctor` reports
    with pytest.warns(RuntimeWarning, match="GYM_FORK_RING_SLOTS_DIR") as seen:
        assert ring_slots.claim() is None
    assert str(d) in str(seen[0].message)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second env asking must not warn again
        assert ring_slots.claim() is None


def test_a_usable_slot_directory_warns_nothing(tmp_path, monkeypatch, fresh_warnings):
    import warnings

    monkeypatch.setenv("GYM_FORK_RING_SLOTS_DIR", str(tmp_path / "slots"))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert ring_slots.problem() is None  # missing, but it can be made
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = ring_slots.claim()
        assert a is not None
        assert ring_slots.claim() is None  # all slots held: no ring, and nothing wrong to warn about
    a.release()
