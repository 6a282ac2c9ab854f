"""Run as an unprivileged user by tests/test_nonroot.py (copied next to a venv that user can read).

    python nonroot_driver.py userns     CRIU in a user namespace + fork tier: exactness, branching,
                                        4 concurrent restores, CRIU timeout
    python nonroot_driver.py loadbundle PATH...   (started by the userns run: a fresh interpreter)
    python nonroot_driver.py nouserns   first disable user namespaces (user.max_user_namespaces=0 in
                                        a fresh user namespace of our own, mapping only our own uid),
                                        then exec itself as "forkonly": the fork-only checks

Prints one JSON object as the last line of stdout.
"""

from __future__ import annotations

import ctypes
import io
import json
import logging
import os
import sys
import time
import traceback

if __name__ == "__main__" and sys.argv[1:] == ["nouserns"]:
    # before numpy starts threads: unshare(CLONE_NEWUSER) needs a single-threaded process
    _libc = ctypes.CDLL(None, use_errno=True)
    _uid, _gid = os.getuid(), os.getgid()
    if _libc.unshare(0x10000000) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER)")
    for _path, _text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{_uid} {_uid} 1"),
                         ("/proc/self/gid_map", f"{_gid} {_gid} 1"), ("/proc/sys/user/max_user_namespaces", "0")):
        with open(_path, "w") as _f:
            _f.write(_text)
    # exec as the plain user: capabilities are dropped at exec (uid is not 0 in this namespace)
    os.execv(sys.executable, [sys.executable, __file__, "forkonly"])

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402


class CounterWalk(gym.Env):
    """A custom env (pure NumPy, own RNG), shipped to the worker by value."""

    observation_space = gym.spaces.Box(-1e9, 1e9, (2,), np.float64)
    action_space = gym.spaces.Discrete(3)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.x = 0, float(self.np_random.normal())
        return np.array([self.t, self.x]), {}

    def step(self, a):
        self.t += 1
        self.x += (a - 1) + float(self.np_random.normal())
        return np.array([self.t, self.x]), -abs(self.x), abs(self.x) > 6, self.t >= 40, {"t": self.t}


def _idle(ev):
    ev.wait()


class ThreadedWalk(CounterWalk):
    """A pure-Python env whose constructor starts a helper thread (not kept as state): its worker
    is unsafe to fork, but it pickles exactly."""

    def __init__(self):
        import threading

        threading.Thread(target=_idle, args=(threading.Event(),), daemon=True).start()


class ThreadedHolder(CounterWalk):
    """Keeps its thread as an attribute: it does not pickle (a lock), so no backend can copy it."""

    def __init__(self):
        import threading

        self.helper = threading.Thread(target=_idle, args=(threading.Event(),), daemon=True)
        self.helper.start()


class ThreadedEz(ThreadedWalk, gym.utils.EzPickle):
    """An EzPickle env with a thread: pickling it would build a fresh env, so it is refused."""

    def __init__(self):
        ThreadedWalk.__init__(self)
        gym.utils.EzPickle.__init__(self)


class ShellSum(gym.Env):
    """Keeps its state in a child process: a shell loop that sums the numbers it reads on a pipe.
    A snapshot must hold the child (a CRIU dump of the whole tree): a copy of the worker alone
    would share one shell with the original."""

    observation_space = gym.spaces.Box(-1e9, 1e9, (2,), np.float64)
    action_space = gym.spaces.Discrete(4)

    def __init__(self):
        self.child = None
        self.t = 0

    def reset(self, *, seed=None, options=None):
        import subprocess

        super().reset(seed=seed)
        if self.child is not None:
            self.child.kill()
            self.child.wait()
        self.child = subprocess.Popen(["sh", "-c", "s=0; while read x; do s=$((s + x)); echo $s; done"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, bufsize=1)
        self.t = 0
        return np.array([0.0, 0.0]), {}

    def step(self, a):
        self.t += 1
        self.child.stdin.write(f"{int(a) + int(self.np_random.integers(3))}\n")
        total = float(self.child.stdout.readline())
        return np.array([self.t, total]), total, False, self.t >= 30, {}

    def close(self):
        if self.child is not None:
            self.child.kill()
            self.child.wait()


class NotesTool(gym.Env):
    """Appends a line per step to ``notes.txt`` in its workspace: through a shell started in the
    workspace at the first reset and kept running (``"server"``), or itself, through a path it
    derived at reset (``"derived"``)."""

    observation_space = gym.spaces.Box(-1e9, 1e9, (2,), np.float64)
    action_space = gym.spaces.Discrete(4)

    def __init__(self, how="server"):
        self.how, self.child, self.t, self.notes = how, None, 0, None

    def reset(self, *, seed=None, options=None):
        import subprocess

        super().reset(seed=seed)
        self.t = 0
        self.notes = os.path.join(self.workspace, "notes.txt")
        open(self.notes, "w").close()
        if self.how == "server" and self.child is None:
            self.child = subprocess.Popen(["sh", "-c", "while read x; do echo $x >> notes.txt; echo ok; done"],
                                          cwd=self.workspace, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          text=True, bufsize=1)
        return np.array([0.0, 0.0]), {}

    def step(self, a):
        self.t += 1
        if self.child is not None:
            self.child.stdin.write(f"{self.t}:{int(a)}\n")
            self.child.stdout.readline()
        else:
            with open(self.notes, "a") as f:
                f.write(f"{self.t}:{int(a)}\n")
        with open(os.path.join(self.workspace, "notes.txt")) as f:
            n = len(f.read().splitlines())
        return np.array([self.t, n]), 0.0, False, False, {}

    def close(self):
        if self.child is not None:
            self.child.kill()
            self.child.wait()


def workspace_copies(how: str) -> dict:
    """A copy whose process (``how="server"``) or own code (``"derived"``) knows the original's
    workspace path: refused, and the original's notes stay its own (no mount namespaces here)."""
    import tempfile

    import gym_fork

    ws = os.path.join(tempfile.mkdtemp(), "ws")
    env = gym_fork.ForkableEnv(lambda: NotesTool(how), workspace=ws)
    out = {}
    try:
        env.reset(seed=0)
        env.step(1)
        snap = env.snapshot()
        try:
            kid = env.fork(snap, 1)[0]
            try:
                kid.step(2)
                out["refused"] = None
            except Exception as e:  # noqa: BLE001
                out["refused"] = f"{type(e).__name__}: {e}"
            kid.close()
        except Exception as e:  # noqa: BLE001
            out["refused"] = f"{type(e).__name__}: {e}"
        with open(os.path.join(ws, "notes.txt")) as f:
            out["original_notes"] = f.read().split()
        out["original_goes_on"] = env.step(3)[0].tolist()
    finally:
        env.close()
    return out


def same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return np.float64(a).tobytes() == np.float64(b).tobytes()
    return type(a) is type(b) and a == b


def run(env, actions):
    traj, ends = [], 0
    for a in actions:
        obs, r, term, trunc, info = env.step(a)
        traj.append((obs, r, term, trunc, info))
        if term or trunc:
            ends += 1
            traj.append(("reset",) + tuple(env.reset()))
    return traj, ends


ENVS = {  # name -> (source, k steps before the snapshot, n actions after)
    "CartPole-v1": ("CartPole-v1", 10, 80),
    "LunarLander-v3": ("LunarLander-v3", 30, 60),
    "CounterWalk": (CounterWalk, 5, 60),
}


def exactness(fork_tier, envs=None) -> dict:
    import gym_fork

    out = {}
    for name, (src, k, n) in (envs or ENVS).items():
        env = gym_fork.ForkableEnv(src, backend="auto", fork_tier=fork_tier)
        try:
            env.reset(seed=3)
            rng = np.random.default_rng(0)
            for _ in range(k):
                env.step(env.action_space.sample())
            snap = env.snapshot()
            acts = [env.action_space.sample() for _ in range(n)]
            t1, ends = run(env, acts)
            env.restore(snap)
            snap2 = env.snapshot()  # a snapshot of the restored copy
            t2, _ = run(env, acts)
            env.restore(snap)
            t3, _ = run(env, acts)
            env.restore(snap2)
            t4, _ = run(env, acts)
            out[name] = {"same": same(t1, t2) and same(t1, t3) and same(t1, t4), "ends": ends,
                         "snap_backend": snap.backend, "backend": env.backend,
                         "fork_tier": getattr(env._handle, "fork_tier", None)}
            del rng
        finally:
            env.close()
    return out


def branching() -> dict:
    """4 concurrent CRIU restores of one image while the original keeps running."""
    import gym_fork

    env = gym_fork.ForkableEnv("LunarLander-v3", backend="auto", fork_tier=False)
    try:
        env.reset(seed=7)
        for _ in range(40):
            env.step(1)
        t0 = time.perf_counter()
        snap = env.snapshot()
        dump_ms = (time.perf_counter() - t0) * 1e3
        acts = [i % 4 for i in range(50)]
        t0 = time.perf_counter()
        kids = env.fork(snap, 4)
        fork4_ms = (time.perf_counter() - t0) * 1e3
        orig, _ = run(env, acts)  # the original runs on meanwhile
        trajs = [run(k, acts)[0] for k in kids]
        pids = [k._handle.pid for k in kids] if hasattr(kids[0], "_handle") else []
        ok = all(same(orig, t) for t in trajs)
        for k in kids:
            k.close()
        # the fork tier: snapshot, branch 4 copies, also exact
        fsnap = gym_fork.ForkableEnv  # noqa: F841
        return {"same": ok, "n": len(kids), "distinct_pids": len(set(pids)), "dump_ms": round(dump_ms, 1),
                "fork4_ms": round(fork4_ms, 1), "size_bytes": snap.size_bytes}
    finally:
        env.close()


def canon(x) -> bytes:
    """Bytes that equal exactly when ``same`` holds (to compare trajectories across processes)."""
    if isinstance(x, np.ndarray):
        return b"A" + str((x.dtype.str, x.shape)).encode() + x.tobytes()
    if isinstance(x, dict):
        return b"D" + b"".join(canon(k) + canon(v) for k, v in x.items()) + b"."
    if isinstance(x, (tuple, list)):
        return b"L" + b"".join(canon(v) for v in x) + b"."
    if isinstance(x, float):
        return b"F" + np.float64(x).tobytes()
    return type(x).__name__.encode() + repr(x).encode()


def digest(traj) -> str:
    import hashlib

    return hashlib.sha256(canon(traj)).hexdigest()


BUNDLE_ACTS = [i % 4 for i in range(60)]


def persist_and_bundle() -> dict:
    """A fork-tier snapshot persisted (``promote`` + CRIU dump inside the user namespace), evicted,
    restored from its images; then saved as a bundle and loaded by a fresh interpreter."""
    import subprocess
    import tempfile

    import gym_fork
    from gym_fork.backends.criu import ForkPayload

    out = {}
    env = gym_fork.ForkableEnv("LunarLander-v3", backend="auto")
    try:
        env.reset(seed=5)
        for i in range(30):
            env.step(i % 4)
        snap = env.snapshot()
        out["fork_payload"] = isinstance(snap._payload, ForkPayload)
        ref, _ = run(env, BUNDLE_ACTS)
        snap.persist(keep_in_memory=False)
        p = snap._payload
        out["persisted"] = snap.persisted
        out["evicted"] = getattr(p, "chan", "x") is None and getattr(p, "image", None) is not None
        env.restore(snap)  # from the images
        out["restore_same"] = same(ref, run(env, BUNDLE_ACTS)[0])
        kids = env.fork(snap, 2)  # two more restores of the images
        out["fork2_same"] = all(same(ref, run(k, BUNDLE_ACTS)[0]) for k in kids)
        for k in kids:
            k.close()
        d = tempfile.mkdtemp(prefix="gym_fork-bundle-")
        path = snap.save(os.path.join(d, "b1"))
        # a snapshot taken and saved in one go (save() persists a fork-tier snapshot itself)
        env.restore(snap)
        s2 = env.snapshot()
        path2 = s2.save(os.path.join(d, "b2"))
        out["ref"] = digest(ref)
        p = subprocess.run([sys.executable, __file__, "loadbundle", path, path2], capture_output=True,
                           text=True, timeout=120)
        try:
            out["fresh"] = json.loads(p.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            out["fresh"] = {"error": p.stdout[-2000:] + p.stderr[-2000:]}
        out["fresh_same"] = out["fresh"].get("digests") == [digest(ref)] * 3
        import shutil

        shutil.rmtree(d, ignore_errors=True)
    finally:
        env.close()
    return out


def main_loadbundle(paths) -> dict:
    """In a fresh interpreter of the same user: load the bundles, from_snapshot, and replay."""
    import gym_fork

    res = {"digests": []}
    for i, path in enumerate(paths):
        snap = gym_fork.load_snapshot(path)
        env = gym_fork.ForkableEnv.from_snapshot(snap)
        try:
            res["digests"].append(digest(run(env, BUNDLE_ACTS)[0]))
            if i == 0:  # and env.restore() of a loaded snapshot into a fresh env of the same id
                env2 = gym_fork.ForkableEnv("LunarLander-v3")
                try:
                    env2.reset(seed=99)
                    env2.restore(snap)
                    res["digests"].append(digest(run(env2, BUNDLE_ACTS)[0]))
                finally:
                    env2.close()
        finally:
            env.close()
    return res


def timeout_check() -> dict:
    """A CRIU restore that overruns $GYM_FORK_CRIU_TIMEOUT is killed and reported; nothing leaks."""
    import gym_fork
    from gym_fork.errors import RestoreError

    env = gym_fork.ForkableEnv("CartPole-v1", backend="auto", fork_tier=False)
    try:
        env.reset(seed=0)
        snap = env.snapshot()
        before = _my_processes()
        os.environ["GYM_FORK_CRIU_TIMEOUT"] = "0.001"
        try:
            env.restore(snap)
            msg = None
        except RestoreError as e:
            msg = str(e)
        finally:
            os.environ.pop("GYM_FORK_CRIU_TIMEOUT")
        time.sleep(0.3)
        leaked = sorted(_my_processes() - before)
        env.step(0)  # the env still works
        env.restore(snap)  # and a normal restore still works
        return {"message": msg, "leaked": leaked}
    finally:
        env.close()


def _my_processes() -> set:
    me = os.getuid()
    out = set()
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.stat(f"/proc/{p}").st_uid == me:
                    with open(f"/proc/{p}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                            out.add(int(p))
            except OSError:
                pass
    return out


def capture_log():
    buf = io.StringIO()
    h = logging.StreamHandler(buf)
    lg = logging.getLogger("gym_fork")
    lg.addHandler(h)
    lg.setLevel(logging.INFO)
    return buf


def main_userns() -> dict:
    from gym_fork.criu.status import criu_status

    logbuf = capture_log()
    st = criu_status()
    res = {"uid": os.getuid(), "mode": st.mode, "usable": st.usable, "reasons": st.reasons}
    tree = {"ShellSum": (ShellSum, 5, 45)}
    for key, fn in (("fork_tier", lambda: exactness("auto")), ("criu_dumps", lambda: exactness(False)),
                    ("tree_auto", lambda: exactness("auto", tree)), ("tree_criu", lambda: exactness(False, tree)),
                    ("branching", branching), ("persist", persist_and_bundle), ("timeout", timeout_check),
                    ("ws_server", lambda: workspace_copies("server")), ("ws_derived", lambda: workspace_copies("derived"))):
        try:
            res[key] = fn()
        except Exception:  # noqa: BLE001
            res[key] = {"error": traceback.format_exc()}
    res["log"] = logbuf.getvalue()
    return res


def main_forkonly() -> dict:
    import gym_fork
    from gym_fork.criu.status import criu_status
    from gym_fork.errors import BackendUnavailableError

    logbuf = capture_log()
    st = criu_status()
    res = {"uid": os.getuid(), "max_user_namespaces": open("/proc/sys/user/max_user_namespaces").read().strip(),
           "mode": st.mode, "usable": st.usable, "reasons": st.reasons, "advice": st.advice}
    try:
        res["fork_tier"] = exactness("auto")
    except Exception:  # noqa: BLE001
        res["fork_tier"] = {"error": traceback.format_exc()}
    try:  # a thread in the worker: not forkable, no CRIU -> pickle, which is exact for it
        res["threaded"] = exactness("auto", {"ThreadedWalk": (ThreadedWalk, 5, 60)})["ThreadedWalk"]
    except Exception:  # noqa: BLE001
        res["threaded"] = {"error": traceback.format_exc()}
    res["refused"] = {}
    for cls in (ThreadedHolder, ThreadedEz):  # ... and refused at start-up where pickle is not exact
        try:
            gym_fork.ForkableEnv(cls).close()
            res["refused"][cls.__name__] = None
        except BackendUnavailableError as e:
            res["refused"][cls.__name__] = str(e)
    env = gym_fork.ForkableEnv("LunarLander-v3")
    try:
        env.reset(seed=1)
        snap = env.snapshot()
        try:
            snap.persist()
            res["persist"] = "no error"
        except BackendUnavailableError as e:
            res["persist"] = str(e)
        kids = env.fork(snap, 4)
        acts = [0, 1, 2, 3] * 10
        orig, _ = run(env, acts)
        res["fork4_same"] = all(same(orig, run(k, acts)[0]) for k in kids)
        for k in kids:
            k.close()
    finally:
        env.close()
    res["log"] = logbuf.getvalue()
    return res


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "loadbundle":
        result = main_loadbundle(sys.argv[2:])
    else:
        result = main_userns() if mode == "userns" else main_forkonly()
    print(json.dumps(result, default=str))
