"""``RayBranchPool``: :func:`gym_fork.explore` fanned out over the nodes of a Ray cluster.

The driver turns the snapshot into a bundle once (``Snapshot.save``: images, sha256 manifest,
HMAC), puts its files into Ray's object store once (a dict of uint8 arrays), and sends each
node's host actor a reference. Each host pulls the bundle once, verifies it (``load_snapshot``:
HMAC, CRIU major version, mapped files, checksums), restores it once
(``ForkableEnv.from_snapshot``) and serves every further branch from that copy through the fork
tier (copy-on-write clones, milliseconds) -- or by CRIU restores of the local images when the fork
tier does not apply (multi-threaded workers).
"""

from __future__ import annotations

import io
import math
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from gym_fork.exploration import ExploreResult, check_in_worker_policy
from gym_fork.env import check_rng
from gym_fork.errors import BranchesFailedError
from gym_fork.ray.errors import cause, first_line
from gym_fork.ray.host import BranchHost, pack_dir, pid_alive, reap_dead_dirs
from gym_fork.snapshots import sessiondir
from gym_fork.snapshots.snapshot import Snapshot


@dataclass
class BranchFailure:
    index: int
    seed: int | None
    node_id: str
    error: str


@dataclass
class PoolExploreResult(ExploreResult):
    """:class:`gym_fork.ExploreResult` plus where each branch ran and what failed.

    ``branches`` holds only branches that completed (each keeps its ``index``)."""

    failed: list[BranchFailure] = field(default_factory=list)
    node_of: dict[int, str] = field(default_factory=dict)
    first_restore: dict[str, dict] = field(default_factory=dict)  # node id -> timings (first use)
    ray_overhead_s: float = 0.0  # sum over calls of (round trip - time inside the actor)


class RayBranchPool:
    """Branch exploration over a Ray cluster: one host actor per node.

    Example (an existing cluster: ``ray.init(address="auto")`` first, or nothing for a local one)::

        pool = gym_fork.ray.RayBranchPool()
        res = pool.explore(snap, policy, n_branches=64, horizon=200, rng="reseed")
        res.best().actions
        pool.close()

    Args:
        address: passed to ``ray.init`` when Ray is not initialised yet (``None``: a local cluster).
        nodes: node ids to use (default: every alive node).
        num_cpus: CPUs each host actor reserves (default 0: the work happens in env worker
            processes Ray does not account for; reserve what you want Ray to keep free).
        max_concurrency: branch calls one host runs at once (threads).
        max_roots: snapshots each host keeps restored (least recently used go first).
        init_kwargs: more ``ray.init`` arguments.
    """

    def __init__(self, address: str | None = None, *, nodes: Sequence[str] | None = None,
                 num_cpus: float = 0, max_concurrency: int = 16, max_roots: int = 4,
                 init_kwargs: dict | None = None):
        if not ray.is_initialized():
            ray.init(address=address, **(init_kwargs or {}))
        alive = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        if nodes is not None:
            missing = [n for n in nodes if n not in alive]
            if missing:
                raise ValueError(f"nodes not alive in this cluster: {missing}")
            alive = list(nodes)
        if not alive:
            raise RuntimeError("the Ray cluster has no alive node")
        self._uid = uuid.uuid4().hex[:8]
        self._cls = ray.remote(BranchHost)
        self._actor_opts = dict(num_cpus=num_cpus, max_concurrency=max_concurrency, max_restarts=0)
        self._max_roots = max_roots
        self._hosts: dict[str, Any] = {}
        self._dead: dict[str, str] = {}  # node id -> why its host is gone
        self._lock = threading.Lock()
        self._bundles: OrderedDict[str, Any] = OrderedDict()  # snapshot id -> ObjectRef
        self._prepared: dict[str, set[str]] = {}  # snapshot id -> nodes that restored it
        # in this process's session directory: reclaimed by the next gym_fork process should this
        # driver be killed (one directory in /tmp per killed driver was left behind for good)
        self._tmp = tempfile.mkdtemp(prefix="ray-pool-", dir=sessiondir.session_dir())
        self._closed = False
        for nid in alive:
            self._hosts[nid] = self._start_host(nid)
        infos = ray.get([h.info.remote() for h in self._hosts.values()])  # up, subreaper set
        self._pids = {i["node_id"]: i["pid"] for i in infos}

    def _start_host(self, nid: str) -> Any:
        return self._cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False),
                                 **self._actor_opts).remote(
            self._max_roots)

    # --- introspection -----------------------------------------------------------------------
    @property
    def nodes(self) -> list[str]:
        """Node ids whose host is (believed) alive."""
        return [n for n in self._hosts if n not in self._dead]

    def host(self, node_id: str) -> Any:
        """The host actor of ``node_id`` (an ActorHandle)."""
        return self._hosts[node_id]

    def info(self) -> dict[str, dict]:
        return dict(zip(self.nodes, ray.get([self._hosts[n].info.remote() for n in self.nodes])))

    # --- snapshots -------------------------------------------------------------------------------
    def put(self, snapshot: Snapshot) -> Any:
        """The object-store reference of ``snapshot``'s bundle (saved and put once per pool)."""
        with self._lock:
            ref = self._bundles.get(snapshot.id)
            if ref is not None:
                self._bundles.move_to_end(snapshot.id)
                return ref
        path = snapshot.bundle_path
        tmp = None
        if path is None:
            tmp = os.path.join(self._tmp, f"b-{snapshot.id}-{os.urandom(3).hex()}")
            path = snapshot.save(tmp)
        try:
            ref = ray.put(pack_dir(path))
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        with self._lock:
            self._bundles[snapshot.id] = ref
            while len(self._bundles) > self._max_roots:
                old, _ = self._bundles.popitem(last=False)
                self._drop_everywhere(old)
        return ref

    def prepare(self, snapshot: Snapshot, nodes: Sequence[str] | None = None) -> dict[str, dict]:
        """Ship and restore ``snapshot`` on ``nodes`` (default: all) now, in parallel; returns
        each node's first-restore timings (zeros where it was already restored)."""
        ref = self.put(snapshot)
        nodes = list(nodes or self.nodes)
        out = ray.get([self._hosts[n].prepare.remote(snapshot.id, [ref]) for n in nodes])
        self._prepared.setdefault(snapshot.id, set()).update(nodes)
        return dict(zip(nodes, out))

    def forget(self, snapshot: Snapshot | str) -> None:
        """Drop a snapshot from the object store and from every node."""
        sid = snapshot if isinstance(snapshot, str) else snapshot.id
        with self._lock:
            self._bundles.pop(sid, None)
        self._drop_everywhere(sid)

    def _drop_everywhere(self, sid: str) -> None:
        self._prepared.pop(sid, None)
        for n in self.nodes:
            self._hosts[n].drop.remote(sid)

    # --- explore ---------------------------------------------------------------------------------
    def explore(self, snapshot: Snapshot, policy: Any, n_branches: int = 8, horizon: int = 100, *,
                rng: Literal["same", "reseed"] = "reseed", seeds: Sequence[int] | None = None,
                stop_at_done: bool = True, deterministic: bool = False,
                branches_per_call: int | None = None, max_in_flight: int | None = None,
                on_error: Literal["raise", "return"] = "raise", record_obs: bool = False,
                policy_in_worker: bool = False) -> PoolExploreResult:
        """:func:`gym_fork.explore` over the cluster: the same arguments, the same branches.

        Branch ``i`` runs exactly as local ``explore``'s branch ``i`` would (same snapshot, same
        ``seeds[i]`` or the snapshot's own randomness with ``rng="same"``, the policy applied to
        its observations), on whichever node gets it.

        Args:
            policy: a callable ``obs -> action`` (cloudpickled, one copy per node and call: keep it
                a function of the observation) or a Stable-Baselines3 model (its weights are
                shipped once per call and loaded on CPU).
            branches_per_call: branches per actor call, run in lockstep there (default: spread
                evenly, one call per node). Smaller calls balance better; each costs ~1-4 ms.
            max_in_flight: actor calls running at once (default: all).
            on_error: ``"raise"``: if any branch failed, raise :class:`BranchesFailedError`
                (its ``.result`` has the completed branches); ``"return"``: return them, with
                ``result.failed`` listing the others.
            record_obs: also return, as ``branch.observations``, the observation each action
                was chosen for (what :class:`gym_fork.sb3.BranchExplorationCallback` needs).
            policy_in_worker: as for :func:`gym_fork.explore`: the policy (a picklable callable,
                or a list of ``n_branches`` of them) runs inside each branch's worker on its node,
                one round trip per branch instead of one per step.
        """
        if self._closed:
            raise RuntimeError("this RayBranchPool was closed")
        if n_branches < 1 or horizon < 1:
            raise ValueError(f"n_branches and horizon must be >= 1 (got {n_branches}, {horizon})")
        check_rng(rng, seeds, n_branches, "n_branches")
        if on_error not in ("raise", "return"):
            raise ValueError(f"on_error must be 'raise' or 'return', not {on_error!r}")
        if policy_in_worker:
            if record_obs:
                raise ValueError("record_obs=True records what the learner-side policy was asked; "
                                 "it cannot be combined with policy_in_worker=True")
            check_in_worker_policy(policy, n_branches, rng)
        elif isinstance(policy, (list, tuple)):
            raise TypeError("a list of policies (one per branch) needs policy_in_worker=True")
        nodes = self.nodes
        if not nodes:
            raise RuntimeError(f"no host of this pool is alive: {self._dead}")
        t0 = time.perf_counter()
        if rng == "reseed" and seeds is None:
            seeds = [int(s) for s in np.random.SeedSequence().generate_state(n_branches, np.uint64) % (2**63)]
        ref = self.put(snapshot)
        pol = self._ship_policy(policy)
        per = branches_per_call or math.ceil(n_branches / len(nodes))
        chunks = [list(range(i, min(i + per, n_branches))) for i in range(0, n_branches, per)]
        limit = max_in_flight or len(chunks)

        result = PoolExploreResult(root=snapshot, branches=[], wall_s=0.0)
        pending: dict[Any, tuple[str, list[int], float]] = {}
        todo = list(reversed(chunks))
        free = list(nodes)  # nodes in the order they should get the next chunk
        prepared = self._prepared.setdefault(snapshot.id, set())

        def submit(node: str, idx: list[int]) -> None:
            sd = None if seeds is None else [int(seeds[i]) for i in idx]
            call = self._hosts[node].run.remote(snapshot.id, [ref], pol, idx, sd, horizon, rng,
                                                stop_at_done, deterministic, record_obs, policy_in_worker)
            pending[call] = (node, idx, time.perf_counter())

        def fail(node: str, idx: list[int], why: str) -> None:
            for i in idx:
                result.failed.append(BranchFailure(i, None if seeds is None else int(seeds[i]), node, why))

        while todo or pending:
            while todo and len(pending) < limit:
                alive = [n for n in free if n not in self._dead] or [n for n in self.nodes]
                if not alive:
                    for idx in todo:
                        fail("-", idx, f"no host alive: {self._dead}")
                    todo = []
                    break
                node = alive[0]
                free.remove(node) if node in free else None
                free.append(node)  # round-robin
                submit(node, todo.pop())
            if not pending:
                break
            done, _ = ray.wait(list(pending), num_returns=1)
            call = done[0]
            node, idx, t_sub = pending.pop(call)
            try:
                out = ray.get(call)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                why = f"the host actor on node {node} died during the call ({type(e).__name__}: {first_line(e)})"
                self._dead[node] = why
                fail(node, idx, why)
                continue
            except ray.exceptions.RayError as e:  # the actor raised: env error, bad bundle, policy error
                fail(node, idx, f"on node {node}: {cause(e)}")
                continue
            rt = time.perf_counter() - t_sub
            result.ray_overhead_s += max(0.0, rt - out["prepare_s"] - out["run_s"])
            for b in out["branches"]:
                result.node_of[b.index] = node
                result.branches.append(b)
            if node not in prepared:
                prepared.add(node)
                result.first_restore[node] = {"prepare_s": out["prepare_s"]}
            # the node that just finished gets the next chunk first
            if node in free:
                free.remove(node)
            free.insert(0, node)
        result.branches.sort(key=lambda b: b.index)
        result.failed.sort(key=lambda f: f.index)
        result.wall_s = time.perf_counter() - t0
        if result.failed and on_error == "raise":
            nodes_failed = sorted({f.node_id for f in result.failed})
            raise BranchesFailedError(
                f"{len(result.failed)} of {n_branches} branches failed (nodes {nodes_failed}): "
                f"{result.failed[0].error}. The {len(result.branches)} completed branches are in "
                "this error's .result (or pass on_error='return').", result)
        return result

    def _ship_policy(self, policy: Any) -> tuple:
        if isinstance(policy, (list, tuple)):  # one per branch (policy_in_worker=True, checked)
            return ("callable", [ray.put([_by_value(p) for p in policy])])
        if hasattr(policy, "predict") and hasattr(policy, "policy") and hasattr(policy, "save"):
            buf = io.BytesIO()
            policy.save(buf)
            cls = type(policy)
            return ("sb3", [ray.put((cls.__module__, cls.__qualname__, buf.getvalue()))])
        if not callable(policy):
            raise TypeError(f"policy must be a callable obs -> action or an SB3 model, not {type(policy).__name__}")
        return ("callable", [ray.put(_by_value(policy))])

    # --- lifecycle ---------------------------------------------------------------------------------
    def close(self, timeout: float = 30.0) -> None:
        """Stop every host: their restored processes end and their images are deleted. Hosts that
        died are cleaned up by a short task pinned to their node (if it is still alive)."""
        if self._closed:
            return
        self._closed = True
        closing = {n: self._hosts[n].close.remote() for n in self.nodes}
        try:
            ray.wait(list(closing.values()), num_returns=len(closing), timeout=timeout)
        except Exception:  # noqa: BLE001
            pass
        for h in self._hosts.values():
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        reap = ray.remote(_reap_task)
        calls = [reap.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(
            [self._pids[n]]) for n in self._hosts if n in alive]
        try:
            ray.get(calls, timeout=timeout)
        except Exception:  # noqa: BLE001 - best effort; the next host on that node reaps too
            pass
        self._bundles.clear()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "RayBranchPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Pickled:
    """A cloudpickle made on the driver, unpickled on first use on the host."""

    def __init__(self, data: bytes):
        self.data = data


def _by_value(obj: Any) -> Any:
    """``obj`` cloudpickled with its own module by value when that module is not an installed
    package (a script, a test file): the nodes need not be able to import it."""
    import sys

    import cloudpickle

    mod = sys.modules.get(getattr(obj, "__module__", None) or type(obj).__module__)
    f = getattr(mod, "__file__", None) or ""
    if mod is None or mod.__name__ == "__main__" or not f or "site-packages" in f or f.startswith(sys.base_prefix):
        return obj
    cloudpickle.register_pickle_by_value(mod)
    try:
        return _Pickled(cloudpickle.dumps(obj))
    finally:
        cloudpickle.unregister_pickle_by_value(mod)


def _reap_task(pids: list[int]) -> list[str]:
    """On one node: wait (<= 5 s) for the given host pids to be gone, then delete the session
    directories of every dead host there."""
    deadline = time.monotonic() + 5
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return reap_dead_dirs()
