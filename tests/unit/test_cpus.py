"""gym_fork.worker.cpus: telling the CPU a process runs on, and moving off one."""

import os

import pytest

from gym_fork.worker import cpus


def test_current_cpu_is_one_this_process_may_run_on():
    cpu = cpus.current_cpu()
    assert cpu is not None, "glibc's sched_getcpu should be found on Linux"
    assert cpu in os.sched_getaffinity(0)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="moving to another CPU needs two")
def test_step_aside_moves_off_the_cpu_and_keeps_the_allowed_cpus():
    allowed = os.sched_getaffinity(0)
    here = cpus.current_cpu()
    assert cpus.step_aside(here) is True
    assert cpus.current_cpu() != here
    assert os.sched_getaffinity(0) == allowed


def test_step_aside_stays_where_it_is_on_another_cpu_or_with_nowhere_to_go():
    allowed = os.sched_getaffinity(0)
    here = cpus.current_cpu()
    assert cpus.step_aside(None) is False
    assert cpus.step_aside(max(allowed) + 1) is False  # not the CPU this runs on
    os.sched_setaffinity(0, {here})
    try:
        assert cpus.step_aside(here) is False  # the only CPU it may use
        assert os.sched_getaffinity(0) == {here}
    finally:
        os.sched_setaffinity(0, allowed)
