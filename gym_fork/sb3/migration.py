"""``gym_fork.sb3.LiveMigrationCallback``: move the whole training job at a step boundary."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from stable_baselines3.common.callbacks import BaseCallback

from gym_fork.migration.control import is_managed_job, prepare_migration, request_migration


class LiveMigrationCallback(BaseCallback):
    """Live-migrate the job (started with ``gym-fork run``) to ``target``: an agent's
    ``"host:port"``, or ``gym_fork.ray.RayNode(node_id)`` (the job moves into the migration host
    actor of that Ray node; the job itself never imports or connects to Ray: its supervisor does,
    with ``--ray-address`` or ``$RAY_ADDRESS``). A list of targets makes a route: each move goes
    to the next one (e.g. ``[B, A]``: out to B on the first trigger, back to A on the second).

    ``trigger``: ``"SIGUSR1"`` (default; ``kill -USR1`` the job or its ``gym-fork run``), a
    path prefixed ``"file:"`` (a preemption notice file appearing), an ``int`` timestep, or
    ``"call"`` (only :meth:`request`); a list combines them.  At the next step boundary after a
    trigger the job is checkpointed, shipped, restored on the target and continues there at the
    same timestep.  On failure training continues here; the error is printed and recorded as
    ``migration/failed``.  After arrival the callback records ``migration/downtime_s``,
    ``migration/bytes``, ``migration/source``, ``migration/target``, ``migration/timestep``.
    """

    def __init__(self, target: Any, trigger: Any = "SIGUSR1", verbose: int = 1):
        super().__init__(verbose)
        route = target if isinstance(target, (list, tuple)) else [target]
        if not route:
            raise ValueError("target: give an agent's 'host:port', a RayNode, or a non-empty list of them")
        self.route = [_job_target(t) for t in route]
        self.hops = 0  # moves that arrived
        triggers = trigger if isinstance(trigger, (list, tuple)) else [trigger]
        self.notice_files = [t[5:] for t in triggers if isinstance(t, str) and t.startswith("file:")]
        self.at_timestep = [t for t in triggers if isinstance(t, int)]
        self.on_signal = any(isinstance(t, str) and t.upper() in ("SIGUSR1", "USR1", "SIGNAL") for t in triggers)
        self._pending = False
        self.history: list[dict] = []
        if self.on_signal:
            signal.signal(signal.SIGUSR1, lambda *_: self.request())

    def _init_callback(self) -> None:
        self._prepare()

    def _prepare(self) -> None:
        """Tell the supervisor the route now: target kinds that need set-up (a Ray node's job host
        to start and keep warm) do it in the background, so a move does not wait for it."""
        if is_managed_job():
            try:
                prepare_migration(self.route)
            except Exception:  # noqa: BLE001 - an older supervisor: moves just resolve later
                pass

    @property
    def target(self) -> str:
        """Where the next move goes."""
        return self.route[self.hops % len(self.route)]

    def request(self) -> None:
        """Migrate at the next step boundary (safe from a signal handler)."""
        self._pending = True

    def _on_step(self) -> bool:
        if not self._pending:
            if any(self.num_timesteps >= t for t in self.at_timestep):
                self.at_timestep = [t for t in self.at_timestep if self.num_timesteps < t]
                self._pending = True
            elif self.notice_files and any(os.path.exists(p) for p in self.notice_files):
                self.notice_files = [p for p in self.notice_files if not os.path.exists(p)]
                self._pending = True
        if self._pending:
            self._pending = False
            self._migrate()
        return True

    def _migrate(self) -> None:
        t0 = time.time()
        try:
            reply = request_migration(self.target, timestep=self.num_timesteps)
        except Exception as e:  # noqa: BLE001 - not a managed job, etc.: keep training
            reply = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        now = time.time()
        rec = dict(reply, timestep=self.num_timesteps, t_request=t0, t_continue=now)
        self.history.append(rec)
        if reply.get("status") == "arrived":
            self.hops += 1
            self._prepare()  # a new supervisor (the target's) now: warm the rest of the route
            rec["downtime_s"] = now - reply["t_freeze"]
            self.logger.record("migration/downtime_s", rec["downtime_s"])
            self.logger.record("migration/bytes", reply.get("bytes", 0))
            self.logger.record("migration/source", str(reply.get("source")))
            self.logger.record("migration/target", str(reply.get("node")))
            self.logger.record("migration/timestep", self.num_timesteps)
            if self.verbose:
                tl = reply.get("timeline", {})
                print(f"[gym_fork] migrated {reply.get('source')} -> {reply.get('node')} at timestep "
                      f"{self.num_timesteps}: downtime {rec['downtime_s'] * 1e3:.0f} ms, "
                      f"{reply.get('bytes', 0) / 1e6:.1f} MB; "
                      + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in tl.items() if k.endswith("_s")),
                      flush=True)
        else:
            self.logger.record("migration/failed", 1)
            print(f"[gym_fork] migration to {self.target} failed, training continues here: "
                  f"{reply.get('error')}", file=sys.stderr, flush=True)


def _job_target(target: Any) -> str:
    """The string the supervisor gets: ``"host:port"`` as given; a ``RayNode`` (or anything with a
    ``job_target``) becomes ``"ray:<node id>"``, which only the supervisor resolves."""
    if isinstance(target, str):
        return target
    t = getattr(target, "job_target", None)
    if isinstance(t, str):
        return t
    raise TypeError(f"target must be an agent's 'host:port' or a gym_fork.ray.RayNode, not {type(target).__name__}")
