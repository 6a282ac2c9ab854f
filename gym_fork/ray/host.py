"""The per-node host actor of :mod:`gym_fork.ray`: restores a snapshot's bundle once on its node and
serves branches from it (copy-on-write fork tier where available).

What a Ray worker process needs before it can run CRIU (:func:`prepare_process`): SIGCHLD back
to SIG_DFL (Ray may set SIG_IGN; criu inherits it and then fails while exiting 0, so restores
are checked by pinging the restored worker, never by criu's exit code); the actor a child
subreaper, so whatever it restores or orphans stays below it and dies with it; Ray's inherited
fds close-on-exec, so criu never holds them. Images live in a per-actor session directory under
:func:`hosts_base`; an actor killed by ``ray.kill`` cannot clean up, so every host deletes the
directories of dead pids when it starts (and :func:`reap_dead_dirs` runs when a pool closes).
"""

from __future__ import annotations

import ctypes
import io
import os
import shutil
import signal
import threading
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from gym_fork.snapshots import reclaim, sessiondir

PR_SET_CHILD_SUBREAPER = 36


def hosts_base() -> str:
    """Where host actors keep their session directories on a node."""
    return os.path.join(sessiondir.base_dir(), "ray-hosts")


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: e.g. a host whose node died, not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def reap_dead_dirs(base: str | None = None) -> list[str]:
    """Delete the host session directories under ``base`` whose process is gone. Returns their names.

    Directories with an owner lock go by the lock (:func:`gym_fork.snapshots.reclaim.reclaim_orphans`,
    the rule of every session directory); older ones without a lock by their pid."""
    base = base or hosts_base()
    out = reclaim.reclaim_orphans(base)
    gone = list(out["reclaimed"])
    for name in out["legacy"]:
        try:
            pid = int(name[1:name.index("-")])
        except ValueError:
            continue
        if pid != os.getpid() and not pid_alive(pid):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
            gone.append(name)
    return gone


def prepare_process() -> str:
    """Make this (Ray worker) process fit to run CRIU restores; returns its session directory."""
    libc = ctypes.CDLL(None, use_errno=True)
    # libc.signal, not signal.signal: a threaded actor's methods are not on the main thread.
    libc.signal(signal.SIGCHLD, ctypes.c_void_p(0))  # SIG_DFL
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            try:
                os.set_inheritable(fd, False)
            except OSError:
                pass
    base = hosts_base()
    os.makedirs(base, mode=0o700, exist_ok=True)
    reap_dead_dirs(base)
    os.environ["GYM_FORK_DIR"] = base  # gym_fork.snapshots.sessiondir puts this process's session dir here
    from gym_fork.criu.status import criu_status

    criu_status()  # probed (and cached) now, not on the first restore's critical path
    return sessiondir.session_dir()


def pack_dir(path: str) -> dict[str, np.ndarray]:
    """A directory's regular files as ``{relative path: uint8 array}`` (Ray stores arrays
    out-of-band: zero-copy ``ray.get`` on the node, fast write-out)."""
    out = {}
    for root, _dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            out[os.path.relpath(full, path)] = np.fromfile(full, dtype=np.uint8)
    return out


def unpack_dir(files: dict[str, np.ndarray], path: str) -> None:
    """Write :func:`pack_dir`'s output into the new directory ``path`` (aside, then renamed)."""
    tmp = f"{path}.tmp-{os.urandom(3).hex()}"
    os.makedirs(tmp, mode=0o700)
    try:
        for rel, data in files.items():
            rel = os.path.normpath(rel)
            if rel.startswith("..") or os.path.isabs(rel):
                raise ValueError(f"refusing bundle member {rel!r}")
            full = os.path.join(tmp, rel)
            os.makedirs(os.path.dirname(full), mode=0o700, exist_ok=True)
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(memoryview(data))
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class _Root:
    """One snapshot restored on this node: its bundle, the restored env, the snapshot branches
    fork from (a copy-on-write snapshot of that env when the fork tier applies)."""

    def __init__(self, key: str, path: str | None, snap: Any, env: Any, fork_snap: Any, stats: dict):
        self.key, self.path, self.snap, self.env, self.fork_snap, self.stats = key, path, snap, env, fork_snap, stats

    def close(self) -> None:
        try:
            if self.fork_snap is not self.snap:
                self.fork_snap.release()
            self.env.close()
        finally:
            self.snap.release()
            if self.path:
                shutil.rmtree(self.path, ignore_errors=True)


class BranchHost:
    """One per node (pinned with ``NodeAffinitySchedulingStrategy(soft=False)``); threaded.

    Not used directly: :class:`gym_fork.ray.RayBranchPool` creates and drives these.
    """

    def __init__(self, max_roots: int = 4):
        self.session = prepare_process()
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self.max_roots = max_roots
        self._roots: OrderedDict[str, _Root] = OrderedDict()
        self._key_locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._policies: OrderedDict[str, Any] = OrderedDict()
        self._busy = 0

    # --- introspection (pool, tests, benchmarks) ------------------------------------------------
    def info(self) -> dict:
        return {"node_id": self.node_id, "pid": os.getpid(), "session": self.session,
                "roots": list(self._roots), "busy": self._busy, "descendants": descendants(os.getpid())}

    def branches_busy(self) -> bool:
        """Whether this host holds a restored snapshot or runs branches now."""
        return bool(self._roots or self._busy)

    # --- snapshots --------------------------------------------------------------------------------
    def prepare(self, key: str, refs: list) -> dict:
        """Make sure the bundle ``refs[0]`` is restored here; returns its first-restore timings."""
        return dict(self._root(key, refs).stats)

    def _root(self, key: str, refs: list | None) -> _Root:
        with self._lock:
            r = self._roots.get(key)
            if r is not None:
                self._roots.move_to_end(key)
                return r
            lock = self._key_locks.setdefault(key, threading.Lock())
        with lock:  # one restore per key; other keys proceed concurrently
            with self._lock:
                r = self._roots.get(key)
            if r is not None:
                return r
            if not refs:
                raise KeyError(f"snapshot {key} is not on node {self.node_id} and no bundle was sent")
            r = self._restore_root(key, refs[0])
            with self._lock:
                self._roots[key] = r
                old = []
                while len(self._roots) > self.max_roots:
                    old.append(self._roots.popitem(last=False)[1])
            for o in old:
                o.close()
            return r

    def _restore_root(self, key: str, ref: Any) -> _Root:
        import ray

        from gym_fork.backends.bundles import load_snapshot
        from gym_fork.env import ForkableEnv

        t0 = time.perf_counter()
        files = ray.get(ref)
        t1 = time.perf_counter()
        path = os.path.join(self.session, f"bundle-{key}")
        unpack_dir(files, path)
        del files
        t2 = time.perf_counter()
        try:
            snap = load_snapshot(path)  # HMAC, CRIU major version, mapped files, sha256 of images
            t3 = time.perf_counter()
            env = ForkableEnv.from_snapshot(snap, record_actions=False)
            t4 = time.perf_counter()
            try:
                fork_tier = bool(getattr(env._handle, "fork_tier", False))
                fork_snap = env.snapshot() if fork_tier else snap
            except BaseException:
                env.close()
                raise
            t5 = time.perf_counter()
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        stats = {"node_id": self.node_id, "get_s": t1 - t0, "write_s": t2 - t1, "verify_s": t3 - t2,
                 "restore_s": t4 - t3, "fork_snapshot_s": t5 - t4, "total_s": t5 - t0,
                 "fork_tier": fork_tier, "bytes": int(sum(os.path.getsize(os.path.join(dp, f))
                                                           for dp, _d, fs in os.walk(path) for f in fs))}
        if fork_tier:
            # Branches fork from the in-memory snapshot: the images are not needed any more, and
            # deleting them now leaves nothing on disk if this host is killed (e.g. with its driver:
            # Ray then kills every process the host started, a clean-up helper included).
            snap.release()
            shutil.rmtree(path, ignore_errors=True)
            return _Root(key, None, fork_snap, env, fork_snap, stats)
        return _Root(key, path, snap, env, fork_snap, stats)

    def drop(self, key: str) -> bool:
        with self._lock:
            r = self._roots.pop(key, None)
            self._key_locks.pop(key, None)
        if r is not None:
            r.close()
        return r is not None

    # --- policies -----------------------------------------------------------------------------
    def _policy(self, spec: tuple) -> Any:
        kind, ref_list = spec
        import ray

        k = ref_list[0].hex()
        with self._lock:
            p = self._policies.get(k)
        if p is not None:
            return p
        obj = ray.get(ref_list[0])
        if kind == "sb3":
            import importlib

            mod, cls, data = obj
            model_cls = getattr(importlib.import_module(mod), cls)
            p = model_cls.load(io.BytesIO(data), device="cpu")
        elif isinstance(obj, list):  # one per branch
            p = [_unpickled(x) for x in obj]
        else:
            p = _unpickled(obj)
        with self._lock:
            self._policies[k] = p
            while len(self._policies) > 4:
                self._policies.popitem(last=False)
        return p

    # --- branches -------------------------------------------------------------------------------
    def run(self, key: str, refs: list, policy: tuple, indices: list[int], seeds: list[int] | None,
            horizon: int, rng: str, stop_at_done: bool, deterministic: bool, record_obs: bool = False,
            policy_in_worker: bool = False) -> dict:
        """Run the branches ``indices`` (their seeds) from snapshot ``key``; same semantics as
        :func:`gym_fork.explore` on this node's restored copy."""
        from gym_fork.exploration import explore

        with self._lock:
            self._busy += 1
        try:
            t0 = time.perf_counter()
            root = self._root(key, refs)
            pol = self._policy(policy)
            if isinstance(pol, list):  # one policy per branch: these branches' own
                pol = [pol[i] for i in indices]
            rec = _Recorder(pol, deterministic) if record_obs else None
            t1 = time.perf_counter()
            res = explore(root.env, root.fork_snap, rec or pol, n_branches=len(indices), horizon=horizon,
                          rng=rng, seeds=seeds, stop_at_done=stop_at_done, deterministic=deterministic,
                          progress=False, policy_in_worker=policy_in_worker)
            t2 = time.perf_counter()
            if rec is not None:  # the observation each action was chosen for, per branch
                for b in res.branches:
                    b.observations = []
                for t, batch in enumerate(rec.calls):
                    live = [b for b in res.branches if b.length > t]
                    for b, row in zip(live, batch):
                        b.observations.append(row)
            for b, i in zip(res.branches, indices):
                b.index = i
                b.snapshot = None
            return {"branches": res.branches, "node_id": self.node_id, "prepare_s": t1 - t0,
                    "run_s": t2 - t1}
        finally:
            with self._lock:
                self._busy -= 1

    def close(self) -> None:
        """Stop every restored process and delete every image of this actor."""
        with self._lock:
            roots, self._roots = list(self._roots.values()), OrderedDict()
        for r in roots:
            try:
                r.close()
            except Exception:  # noqa: BLE001 - best effort; the directory goes below anyway
                pass
        shutil.rmtree(self.session, ignore_errors=True)


def _unpickled(obj: Any) -> Any:
    """A policy as the driver shipped it: cloudpickled by value (``pool._Pickled``) or as is."""
    if type(obj).__name__ == "_Pickled":
        import cloudpickle

        return cloudpickle.loads(obj.data)
    return obj


class _Recorder:
    """Batch policy wrapper that keeps every observation batch explore() asks about (explore()
    recognises it as an SB3-like model: it has ``predict`` and ``policy``)."""

    policy = None

    def __init__(self, inner: Any, deterministic: bool):
        from gym_fork.exploration import as_policy

        self.act = as_policy(inner, deterministic)
        self.calls: list[np.ndarray] = []

    def predict(self, obs: np.ndarray, deterministic: bool = False) -> tuple[list, None]:
        self.calls.append(np.array(obs, copy=True))
        return self.act(list(obs)), None


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (by /proc ppid links)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out
