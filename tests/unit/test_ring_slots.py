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


def test_a_slot_directory_others_can_write_gives_no_slot(slots):
    d = slots(4)
    os.makedirs(d)
    os.chmod(d, 0o777)
    assert ring_slots.claim() is None  # rather no ring than a directory another user controls
    os.chmod(d, 0o700)
    slot = ring_slots.claim()
    assert slot is not None
    slot.release()
