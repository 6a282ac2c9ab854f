"""The ``"ray:<node id>"`` target kind for whole jobs (``LiveMigrationCallback(RayNode(id))``),
registered through the entry point ``gym_fork.migration_targets: ray``.

Only the job's supervisor uses it, never the job (CRIU cannot dump a process tree that holds
Ray's connections): it connects to the cluster, gets the node's job host and streams the job to
its bridge exactly as to an agent. Imports Ray only when a move or a warm-up needs it.
"""

from __future__ import annotations

import logging
import threading
import time

from gym_fork.errors import MigrationError
from gym_fork.migration.targets import Connection, TargetContext, TargetKind
from gym_fork.migration.wire.connect import connect
from gym_fork.ray.node import parse_job_target

log = logging.getLogger("gym_fork.job")
WARM_WAIT_S = 60.0  # a move waits this long for a warm-up of its node that is in progress


class RayTarget(TargetKind):
    """A Ray node's job host. :meth:`prepare` starts the hosts of the route and keeps them warm
    (refreshing each address every third of the hosts' idle limit, which also keeps them from
    idling out) until :meth:`close`."""

    scheme = "ray"

    def __init__(self, ctx: TargetContext):
        super().__init__(ctx)
        self.ray_address = ctx.options.get("ray_address")  # else $RAY_ADDRESS, else "auto"
        self._warm: dict[str, str] = {}  # node id -> its job host's bridge
        self._warm_ready: dict[str, threading.Event] = {}  # per node: its first warm-up is over
        self._stop = threading.Event()

    def parse(self, address: str) -> str:
        nid = parse_job_target(address)
        if nid is None:
            raise ValueError(f"not a Ray node target: {address!r} (want 'ray:<node id>')")
        return nid

    def describe(self, address: str) -> str:
        return f"Ray node {self.parse(address)}"

    def connect(self, address: str) -> Connection:
        from gym_fork.ray.auth import resolve_token
        from gym_fork.ray.hosts import job_host_address

        nid = self.parse(address)
        token = resolve_token(self.ctx.token)  # the hosts' rule: explicit/env token, else the HMAC key's
        t0 = time.time()
        ready = self._warm_ready.get(nid)
        if ready is not None:  # being warmed right now: that is the same work, wait for it
            ready.wait(WARM_WAIT_S)
        warm = self._warm.get(nid)
        if warm is not None:
            try:
                t1 = time.time()
                sock, hello = connect(warm, token)
                return Connection(sock, hello, token, prewarmed=True,
                                  timings={"warm_wait_s": t1 - t0, "handshake_s": time.time() - t1})
            except MigrationError:
                pass  # the host went away meanwhile: ask Ray again
        sock, hello = connect(job_host_address(nid, self.ray_address), token)
        return Connection(sock, hello, token)

    def prepare(self, addresses: list[str]) -> None:
        nids = []
        for a in addresses:
            nid = self.parse(a)
            if nid not in nids:
                nids.append(nid)
        if nids and not self._warm_ready:
            self._warm_ready.update({nid: threading.Event() for nid in nids})
            threading.Thread(target=self._keep_warm, args=(nids,), daemon=True, name="gym_fork-warm").start()

    def close(self) -> None:
        self._stop.set()

    def _keep_warm(self, nids: list[str]) -> None:
        try:
            import ray

            from gym_fork.ray.hosts import connect_ray, job_host_for, job_host_idle_s

            connect_ray(self.ray_address)
        except Exception as e:  # noqa: BLE001 - a move there reports it
            log.info("keeping Ray job hosts warm: %s", e)
            for nid in nids:
                self._warm_ready[nid].set()
            return
        period = max(0.5, job_host_idle_s() / 3)
        while not self._stop.is_set():
            # all hosts start at once; each node is ready as soon as its own host answers
            refs = {}
            for nid in nids:
                try:
                    refs[nid] = job_host_for(nid).job_address.remote()
                except Exception as e:  # noqa: BLE001
                    log.info("keeping Ray node %s's job host warm: %s", nid, e)
            for nid in nids:
                try:
                    if nid in refs:
                        self._warm[nid] = ray.get(refs[nid], timeout=60)
                except Exception as e:  # noqa: BLE001 - a move there resolves (and reports) it again
                    self._warm.pop(nid, None)
                    log.info("keeping Ray node %s's job host warm: %s", nid, e)
                self._warm_ready[nid].set()
            self._stop.wait(period)
