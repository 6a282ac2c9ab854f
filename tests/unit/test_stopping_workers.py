"""A worker being stopped gets a small share of the CPU -- never none: dying workers must finish
exiting while the learner keeps every CPU busy."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gym_fork.backends.base import _deprioritize

# Waits for a line on stdin, then spends ~20 ms of CPU time (a worker tearing itself down).
_EXIT_WORK = "import sys, time\nsys.stdin.readline()\nt = time.process_time()\nwhile time.process_time() - t < 0.02: pass\n"


@pytest.mark.alone  # keeps every CPU busy: the other test process would crawl meanwhile
def test_a_deprioritized_process_still_finishes_while_every_cpu_is_busy():
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    dying = subprocess.Popen([sys.executable, "-c", _EXIT_WORK], stdin=subprocess.PIPE)
    try:
        _deprioritize(dying.pid)
        assert os.sched_getscheduler(dying.pid) == os.SCHED_BATCH
        assert os.getpriority(os.PRIO_PROCESS, dying.pid) == 19
        dying.stdin.write(b"go\n")
        dying.stdin.flush()
        # SCHED_IDLE (what it was) is not done after 30 s here; nice 19 takes about a second.
        assert dying.wait(timeout=60) == 0
    finally:
        for p in (*hogs, dying):
            p.kill()
            p.wait()
