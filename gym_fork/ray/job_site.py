"""A Ray node's migration host as a place where received jobs run, with one guard process per
job: the guard holds a pidfd of the job and the read end of a pipe only the host holds, so when
the host process ends in any way (``ray.kill``, a crash, its node dying) the guard SIGKILLs the
job's PID namespace and no restored job outlives its host."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from typing import Any

from gym_fork.migration.receive import JobSite

log = logging.getLogger("gym_fork.ray.migration")

# Exits when the job exits (its pidfd is readable); when the pipe's write end -- held by the host
# process only -- closes first, the host is gone: kill the job.
_GUARD = """
import os, select, signal, sys
life, pfd = int(sys.argv[1]), int(sys.argv[2])
p = select.poll()
p.register(life, select.POLLIN)
p.register(pfd, select.POLLIN)
while True:
    try:
        ev = dict(p.poll())
        break
    except InterruptedError:
        pass
if life in ev:
    try:
        signal.pidfd_send_signal(pfd, signal.SIGKILL)
    except ProcessLookupError:
        pass
"""


class RayJobSite(JobSite):
    """Jobs received by one migration host; ``busy`` counts receives in progress, ``last_active``
    is when the host last had something to do (its idle stop counts from there)."""

    def __init__(self, node: str, token: bytes, state_dir: str):
        super().__init__(node, token, state_dir, log=log)  # onward ray: hops use this process's Ray
        self.guards: dict[int, subprocess.Popen] = {}
        self.busy = 0
        self.received = 0
        self.closing = False
        self.last_active = time.monotonic()
        self._life_r, self._life_w = os.pipe()  # the write end lives (only) as long as this process

    def job_restored(self, pid: int) -> None:
        pfd = os.pidfd_open(pid)
        try:
            g = subprocess.Popen([sys.executable, "-S", "-c", _GUARD, str(self._life_r), str(pfd)],
                                 pass_fds=(self._life_r, pfd), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        finally:
            os.close(pfd)
        with self.lock:
            self.guards[pid] = g
            self.received += 1
            self.last_active = time.monotonic()

    def job_ended(self, host: Any, how: str) -> None:
        with self.lock:
            self.last_active = time.monotonic()
        self.reap_guards()

    def touch(self) -> bool:
        """Note activity now; False when the host is closing (take nothing new)."""
        with self.lock:
            if self.closing:
                return False
            self.last_active = time.monotonic()
            return True

    def begin(self) -> bool:
        """A receive starts; False (and nothing counted) when the host is closing."""
        with self.lock:
            if self.closing:
                return False
            self.busy += 1
            return True

    def end(self) -> None:
        with self.lock:
            self.busy -= 1
            self.last_active = time.monotonic()

    def idle_for(self, seconds: float) -> bool:
        """Nothing held or in progress for ``seconds``: then it starts closing (and says True)."""
        with self.lock:
            if self.jobs or self.busy or time.monotonic() - self.last_active < seconds:
                return False
            self.closing = True
            return True

    def info(self) -> dict:
        with self.lock:
            return {"jobs": {pid: {"guard": self.guards[pid].pid if pid in self.guards else None}
                             for pid in self.jobs},
                    "jobs_received": self.received}

    def reap_guards(self) -> None:
        with self.lock:
            done = [p for p, g in self.guards.items() if g.poll() is not None]
            for p in done:
                self.guards.pop(p)

    def kill_all(self) -> None:
        self.closing = True
        super().kill_all()
        deadline = time.monotonic() + 5
        while self.guards and time.monotonic() < deadline:
            self.reap_guards()
            time.sleep(0.02)
