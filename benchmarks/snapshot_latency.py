"""How long snapshot() and restore() take per backend, how big snapshots are, and what running the
env in a worker process costs per step.

    .venv/bin/python benchmarks/snapshot_latency.py            # ~1-2 min on 2 cores
    .venv/bin/python benchmarks/snapshot_latency.py --quick    # smoke run, ~30 s
    .venv/bin/python -m benchmarks.snapshot_latency --envs CartPole-v1 --reps 15

Part 1, per env and backend config -- CRIU dumps with ``verify="full"`` and ``verify="size"``
(``fork_tier=False``), CRIU's copy-on-write fork tier (``fork_tier=True``, where this gym_fork has
it) and pickle: after ``reset(seed=0)`` and 100 random steps, the median latency of ``snapshot()``
(each snapshot is released, untimed, right after), of ``restore()`` (until it returns
``(obs, info)``; it includes retiring the previous worker) and the snapshot's size.  The pickle
backend refuses EzPickle envs (Box2D, MuJoCo): shown as "refused".  For CRIU dumps a breakdown
separates the manifest check (sha256 vs sizes only) from CRIU's own restore; for the fork tier,
``Snapshot.persist()`` (writing the CRIU images later) is timed too.  An in-process
``copy.deepcopy``/cloudpickle of CartPole gives a reference for what pickle-style copying costs.

Part 2: median µs per step over ``--steps`` pre-sampled actions (episodes reset on termination)
for the env stepped in-process (``gymnasium.make``), in a bare echo process (the IPC floor), in a
ForkableEnv CRIU worker (freshly started, and CRIU-restored from a dump), in SB3's
``SubprocVecEnv`` with one env, and in a ForkableEnv pickle env (in-process, where allowed).

Tables go to stdout (markdown), progress to stderr, all numbers to ``results/snapshot_latency.json`` (``--out DIR``: DIR/).
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/x.py` too

import cloudpickle  # noqa: E402
import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402

import gym_fork  # noqa: E402
from benchmarks.common import (  # noqa: E402
    add_out_option,
    results_dir,
    Progress,
    busy_check,
    fmt,
    fmt_ratio,
    print_table,
    save_results,
    summarize,
    time_reps,
)
from gym_fork.snapshots import sessiondir  # noqa: E402
from gym_fork.criu.status import criu_status  # noqa: E402
from gym_fork.errors import BackendUnavailableError, UnsupportedEnvError  # noqa: E402

DEFAULT_ENVS = "CartPole-v1,LunarLander-v3,HalfCheetah-v5"
PRE_STEPS = 100  # random steps after reset(seed=0) before snapshotting
# Does this gym_fork have the copy-on-write fork tier (ForkableEnv(..., fork_tier=...))?
HAS_FORK_TIER = "fork_tier" in inspect.signature(gym_fork.ForkableEnv.__init__).parameters
_DUMP = {"fork_tier": False} if HAS_FORK_TIER else {}  # force real CRIU dumps
CONFIGS = [  # (label, backend, ForkableEnv kwargs)
    ("criu/full", "criu", {"verify": "full", **_DUMP}),
    ("criu/size", "criu", {"verify": "size", **_DUMP}),
    *([("criu/fork", "criu", {"fork_tier": True})] if HAS_FORK_TIER else []),
    ("pickle", "pickle", {}),
]
STEP_MODES = ["inprocess", "ipc_floor", "criu", "criu_restored", "subproc_vec", "pickle"]
STEP_LABELS = {
    "inprocess": "in-process",
    "ipc_floor": "bare IPC echo",
    "criu": "criu worker",
    "criu_restored": "criu worker (restored)",
    "subproc_vec": "SB3 SubprocVecEnv(1)",
    "pickle": "pickle (in-proc)",
}


def _warm_up_env(env: gym.Env, seed: int = 0, steps: int = PRE_STEPS) -> None:
    """reset(seed) then ``steps`` random steps (resetting on termination), reproducibly."""
    env.reset(seed=seed)
    env.action_space.seed(seed)
    for _ in range(steps):
        _, _, term, trunc, _ = env.step(env.action_space.sample())
        if term or trunc:
            env.reset()


# --- part 1: snapshot / restore ------------------------------------------------------------------


def bench_snapshot_restore(env_id: str, configs: list, reps: int, warmup: int, breakdown: bool) -> dict:
    """All configs of one env, interleaved rep by rep (so machine-speed drift hits them alike)."""
    out: dict = {}
    envs: dict = {}
    try:
        for label, backend, kwargs in configs:
            try:
                envs[label] = gym_fork.ForkableEnv(env_id, backend=backend, **kwargs)
            except UnsupportedEnvError as e:
                out[label] = {"status": "refused", "reason": str(e).split(":")[0]}
                continue
            except BackendUnavailableError as e:  # e.g. fork_tier=True on a multi-threaded worker
                out[label] = {"status": "unavailable", "reason": str(e)}
                continue
            _warm_up_env(envs[label])
            out[label] = {"status": "ok", "backend": backend, **kwargs}
        snap_t: dict = {k: [] for k in envs}
        sizes: dict = {k: [] for k in envs}
        for i in range(warmup + reps):
            for label, env in envs.items():
                dt, snap = _timed(env.snapshot)
                sizes[label].append(snap.size_bytes)
                snap.release()
                if i >= warmup:
                    snap_t[label].append(dt)
        snaps = {label: env.snapshot() for label, env in envs.items()}
        rest_t: dict = {k: [] for k in envs}
        try:
            for i in range(warmup + reps):
                for label, env in envs.items():
                    dt, _ = _timed(lambda: env.restore(snaps[label]))
                    if i >= warmup:
                        rest_t[label].append(dt)
            for label, env in envs.items():
                r = out[label]
                r["snapshot_ms"] = summarize(snap_t[label])
                r["restore_ms"] = summarize(rest_t[label])
                r["size_bytes"] = statistics.median(sizes[label])
                payload = snaps[label].payload()
                r["payload_type"] = type(payload).__name__
                if r["backend"] == "criu":
                    r["worker_rss_kb"] = _rss_kb(env.worker_pid)
                if hasattr(payload, "path"):  # a CRIU dump on disk
                    man = sessiondir.read_manifest(payload.path)
                    r["image_files"] = {k: v["size"] for k, v in man["files"].items()}
                    if breakdown and r.get("verify") == "full":
                        r["restore_breakdown_ms"] = criu_restore_breakdown(env, snaps[label], reps, warmup)
                elif r["backend"] == "criu":  # copy-on-write fork tier
                    r.update(fork_tier_extras(env, reps, warmup))
        finally:
            for snap in snaps.values():
                snap.release()
    finally:
        for env in envs.values():
            env.close()
    return out


def _timed(fn):
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        res = fn()
        return time.perf_counter() - t0, res
    finally:
        gc.enable()


def _rss_kb(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _sha256_all(path: str, man: dict) -> None:
    for name in man["files"]:
        sessiondir.file_digest(os.path.join(path, name))


def criu_restore_breakdown(env: gym_fork.ForkableEnv, snap, reps: int, warmup: int) -> dict:
    """Where a CRIU restore's time goes, timed piece by piece (private API), and ``restore()``
    itself in the same loop so the pieces and the whole see the same machine state.

    restore() = verify manifest (sha256 or sizes) + CRIU restore of a new worker (+ ping)
              + kill the previous worker + one ``last`` round trip for (obs, info).
    """
    be = env._backend  # noqa: SLF001 - a benchmark may look inside
    payload = snap.payload()
    path = payload.path
    man = sessiondir.read_manifest(path)
    keys = ("restore_total", "verify_full", "verify_size", "sha256_images", "criu_restore_and_ping",
            "last_roundtrip", "kill_worker")
    t: dict = {k: [] for k in keys}
    for i in range(warmup + reps):
        row = {
            "verify_full": _timed(lambda: sessiondir.verify(path, full=True))[0],
            "verify_size": _timed(lambda: sessiondir.verify(path, full=False))[0],
            "sha256_images": _timed(lambda: _sha256_all(path, man))[0],
        }
        row["criu_restore_and_ping"], h = _timed(lambda: be.restore_verified(payload))
        row["last_roundtrip"] = _timed(lambda: h.request("last"))[0]
        row["kill_worker"] = _timed(h.kill)[0]
        row["restore_total"] = _timed(lambda: env.restore(snap))[0]
        if i >= warmup:
            for k in keys:
                t[k].append(row[k])
    return {k: summarize(v) for k, v in t.items()}


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def snapshot_critical_path(env: gym_fork.ForkableEnv, reps: int, warmup: int, work_s: float = 0.003) -> dict:
    """What a fork-tier snapshot costs the learner, not just the call: the worker answers
    before it forks, and the first steps after a fork pay copy-on-write faults. Measures a plain
    step, snapshot()+step() back to back, and a step after ``work_s`` of learner work (a policy
    forward pass) that overlaps the fork."""
    rng = np.random.default_rng(0)
    step_t, pair_t, after_work_t = [], [], []

    def step() -> None:
        if env.step(env.action_space.sample())[2]:
            env.reset(seed=int(rng.integers(1 << 30)))

    for i in range(warmup + reps):
        for _ in range(5):
            step()
        dt, _ = _timed(step)
        t0 = time.perf_counter()
        s = env.snapshot()
        step()
        pair = time.perf_counter() - t0
        s.release()
        for _ in range(5):
            step()
        s = env.snapshot()
        _busy(work_s)
        dt2, _ = _timed(step)
        s.release()
        if i >= warmup:
            step_t.append(dt)
            pair_t.append(pair)
            after_work_t.append(dt2)
    return {"step_ms": summarize(step_t), "snapshot_then_step_ms": summarize(pair_t),
            "step_after_work_ms": summarize(after_work_t), "work_ms": work_s * 1e3}


def fork_tier_extras(env: gym_fork.ForkableEnv, reps: int, warmup: int) -> dict:
    """Fork-tier snapshots: private memory held (at once, after the env runs on), persist(), and
    the cost on the learner's critical path."""
    out: dict = {"critical_path": snapshot_critical_path(env, reps, warmup)}
    snap = env.snapshot()
    try:
        if hasattr(snap, "memory_bytes"):
            out["private_bytes_at_once"] = snap.memory_bytes()
            _warm_up_env(env, seed=1)
            out[f"private_bytes_after_{PRE_STEPS}_steps"] = snap.memory_bytes()
    finally:
        snap.release()
    if hasattr(gym_fork.Snapshot, "persist"):
        t, sizes = [], []
        for i in range(warmup + reps):
            s = env.snapshot()
            try:
                dt, _ = _timed(s.persist)
                image = getattr(s.payload(), "image", None)
                if image is not None:
                    sizes.append(sum(v["size"] for v in sessiondir.read_manifest(image.path)["files"].values()))
            finally:
                s.release()
            if i >= warmup:
                t.append(dt)
        out["persist_ms"] = summarize(t)
        out["persisted_bytes"] = statistics.median(sizes) if sizes else None
    return out


def inprocess_reference(env_id: str, reps: int, warmup: int) -> dict:
    """copy.deepcopy / cloudpickle of a plain in-process env (what the pickle backend builds on)."""
    env = gym.make(env_id)
    try:
        _warm_up_env(env)
        blob = cloudpickle.dumps(env)
        return {
            "deepcopy_ms": summarize(time_reps(lambda: copy.deepcopy(env), reps, warmup)),
            "cloudpickle_dumps_ms": summarize(time_reps(lambda: cloudpickle.dumps(env), reps, warmup)),
            "cloudpickle_loads_ms": summarize(time_reps(lambda: cloudpickle.loads(blob), reps, warmup)),
            "pickle_bytes": len(blob),
        }
    finally:
        env.close()


# --- part 2: per-step overhead -------------------------------------------------------------------


def presample_actions(env_id: str, n: int, seed: int = 0) -> list:
    env = gym.make(env_id)
    try:
        space = env.action_space
        space.seed(seed)
        return [space.sample() for _ in range(n)]
    finally:
        env.close()


def _loop(env, actions) -> None:
    env.reset(seed=0)
    for a in actions:
        _, _, term, trunc, _ = env.step(a)
        if term or trunc:
            env.reset()


def _vec_loop(venv, batched) -> None:
    venv.seed(0)
    venv.reset()
    for a in batched:
        venv.step(a)  # VecEnvs reset finished episodes themselves


_ECHO = (
    "import socket, sys\n"
    "import numpy as np\n"
    "from gym_fork.worker import channel as ch\n"
    "c = ch.Channel(socket.socket(fileno=int(sys.argv[1])))\n"
    "result = (np.zeros(4, dtype=np.float32), 1.0, False, False, {})\n"
    "while True:\n"
    "    try:\n"
    "        m = c.recv()\n"
    "    except ch.ChannelClosed:\n"
    "        break\n"
    "    (c.reply if hasattr(c, 'reply') else c.send)((0, result))\n"
)


class _IpcFloor:
    """A bare echo process on gym_fork's Channel: one step request and a CartPole-sized result
    per "step", no env; packed step frames where this gym_fork has them, else pickles.

    The floor under any one-process-per-env design on this machine (wake-up + syscalls + codec).
    """

    def __init__(self):
        import socket
        import subprocess

        from gym_fork.backends.criu import _worker_environ
        from gym_fork.worker.channel import Channel

        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-c", _ECHO, str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], env=_worker_environ())
        theirs.close()
        self.chan = Channel(ours)

    def loop(self, actions) -> None:
        recv = self.chan.recv
        if hasattr(self.chan, "send_step"):
            send = self.chan.send_step
        else:
            def send(a):
                self.chan.send(("step", (a,)))
        for a in actions:
            send(a)
            recv()

    def close(self) -> None:
        self.chan.close()
        self.proc.wait(timeout=10)


def _make_step_env(mode: str, env_id: str):
    """(loop(actions), closer) for one per-step mode; raises UnsupportedEnvError."""
    if mode == "ipc_floor":
        f = _IpcFloor()
        return f.loop, f.close
    if mode == "inprocess":
        env = gym.make(env_id)
        return (lambda acts: _loop(env, acts)), env.close
    if mode in ("criu", "pickle"):
        env = gym_fork.ForkableEnv(env_id, backend=mode, record_actions=False)
        return (lambda acts: _loop(env, acts)), env.close
    if mode == "criu_restored":  # a worker CRIU restored from a dump (not a fork-tier clone)
        env = gym_fork.ForkableEnv(env_id, backend="criu", record_actions=False, **_DUMP)
        env.reset(seed=0)
        snap = env.snapshot()
        env.restore(snap)
        snap.release()
        return (lambda acts: _loop(env, acts)), env.close
    if mode == "subproc_vec":
        from stable_baselines3.common.vec_env import SubprocVecEnv

        venv = SubprocVecEnv([lambda: gym.make(env_id)])
        return (lambda acts: _vec_loop(venv, acts)), venv.close
    raise ValueError(mode)


def bench_steps(env_id: str, modes: list[str], actions: list, reps: int, warmup: int) -> dict:
    """µs/step of every mode for one env, interleaved run by run (drift hits all modes alike)."""
    out: dict = {}
    runners: dict = {}
    batched = [np.asarray([a]) for a in actions]
    try:
        for mode in modes:
            try:
                loop, close = _make_step_env(mode, env_id)
            except UnsupportedEnvError as e:
                out[mode] = {"status": "refused", "reason": str(e).split(":")[0]}
                continue
            runners[mode] = (loop, close, batched if mode == "subproc_vec" else actions)
        samples: dict = {m: [] for m in runners}
        for i in range(warmup + reps):
            for mode, (loop, _, acts) in runners.items():
                t0 = time.perf_counter()
                loop(acts)
                if i >= warmup:
                    samples[mode].append((time.perf_counter() - t0) / len(acts))
        for mode in runners:
            out[mode] = {"status": "ok", "us_per_step": summarize(samples[mode], unit=1e6)}
    finally:
        for _, close, _ in runners.values():
            close()
    return {m: out[m] for m in modes}


# --- main ----------------------------------------------------------------------------------------


def _med(d: dict | None, key: str) -> float | None:
    if not d or d.get("status") != "ok" or key not in d:
        return None
    return d[key]["median"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement (default 7; 3 with --quick)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions first (default 1)")
    p.add_argument("--envs", default=DEFAULT_ENVS, help=f"comma-separated env ids (default {DEFAULT_ENVS})")
    p.add_argument("--steps", type=int, default=None, help="steps per per-step run (default 2000; 500 with --quick)")
    p.add_argument("--quick", action="store_true", help="fewer reps and steps: a smoke run")
    p.add_argument("--no-breakdown", action="store_true", help="skip the CRIU restore breakdown")
    p.add_argument("--no-steps", action="store_true", help="skip part 2 (per-step cost)")
    p.add_argument("--name", default="snapshot_latency", help="results/<name>.json (default snapshot_latency)")
    add_out_option(p)
    args = p.parse_args(argv)
    reps = args.reps or (3 if args.quick else 7)
    steps = args.steps or (500 if args.quick else 2000)
    envs = [e.strip() for e in args.envs.split(",") if e.strip()]
    warmup = max(0, args.warmup)

    # MuJoCo appends warnings to ./MUJOCO_LOG.TXT of whichever process hits them (workers too):
    # run from the git-ignored results/ folder so they land there, not in the repository root.
    results_dir().mkdir(parents=True, exist_ok=True)
    os.chdir(results_dir())

    load_start = busy_check()
    criu_ok = criu_status().usable
    configs = [c for c in CONFIGS if c[1] != "criu" or criu_ok]
    modes = [m for m in STEP_MODES if not m.startswith("criu") or criu_ok]
    if not criu_ok:
        print("CRIU is not usable here: only the pickle backend is measured.", file=sys.stderr)

    results: dict = {"args": {"reps": reps, "warmup": warmup, "steps": steps, "envs": envs,
                              "pre_steps": PRE_STEPS, "quick": args.quick, "fork_tier": HAS_FORK_TIER,
                              "configs": {c[0]: {"backend": c[1], **c[2]} for c in configs}},
                     "snapshot_restore": {}, "inprocess_reference": {}, "per_step": {}}
    total = (1 if args.no_steps else 2) * len(envs) + 1
    t_start = time.perf_counter()
    with Progress(total, "snapshot_latency") as prog:
        for env_id in envs:
            prog.step(f"{env_id} snapshot/restore ({', '.join(c[0] for c in configs)})")
            results["snapshot_restore"][env_id] = bench_snapshot_restore(
                env_id, configs, reps, warmup, breakdown=not args.no_breakdown)
        prog.step("CartPole-v1 in-process deepcopy/cloudpickle reference")
        results["inprocess_reference"]["CartPole-v1"] = inprocess_reference("CartPole-v1", reps, warmup)
        for env_id in ([] if args.no_steps else envs):
            actions = presample_actions(env_id, steps)
            prog.step(f"{env_id} per-step ({len(modes)} modes, {steps} steps x {warmup + reps} runs)")
            results["per_step"][env_id] = bench_steps(env_id, modes, actions, reps, warmup)
    results["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    results["load"] = {"start": load_start, "end": busy_check()}

    report(results, reps, steps)
    path = save_results(args.name, results)
    la = results["load"]
    print(f"\n(results: {path}; {results['elapsed_s']} s; load average {la['start']['loadavg'][0]:.2f} at start, "
          f"{la['end']['loadavg'][0]:.2f} at end on {la['end']['cpus']} CPUs)", flush=True)
    return 0


def report(results: dict, reps: int, steps: int) -> None:
    sr = results["snapshot_restore"]
    envs = list(sr)
    labels = [c[0] for c in CONFIGS if any(c[0] in sr[e] for e in envs)]
    cfg = lambda e, c: sr[e].get(c)  # noqa: E731
    has_fork = "criu/fork" in labels

    def cell(e: str, c: str, key: str) -> str:
        d = cfg(e, c)
        if d is None:
            return "n/a"
        if d["status"] != "ok":
            return d["status"]
        return fmt(d[key]["median"])

    def med(e: str, c: str, key: str) -> float | None:
        return _med(cfg(e, c), key)

    # snapshot latency
    rows = []
    for e in envs:
        m = {c: med(e, c, "snapshot_ms") for c in labels}
        row = [e] + [cell(e, c, "snapshot_ms") for c in labels]
        row += [fmt_ratio(m.get("criu/full"), m.get("pickle")), fmt_ratio(m.get("criu/full"), m.get("criu/size"))]
        if has_fork:
            row += [fmt_ratio(m.get("criu/fork"), m.get("pickle")), fmt_ratio(m.get("criu/full"), m.get("criu/fork"))]
        rows.append(row)
    hdr = ["env"] + [f"{c} ms" for c in labels] + ["criu/full vs pickle", "full vs size"]
    if has_fork:
        hdr += ["criu/fork vs pickle", "full vs fork"]
    print_table(hdr, rows, title=f"snapshot() latency (median of {reps}; after reset(seed=0) + {PRE_STEPS} steps)",
                note="criu/full and criu/size are CRIU dumps (fork_tier=False) and differ only at restore: "
                     "every dump writes a sha256 manifest. criu/fork = copy-on-write fork() of the worker "
                     "(fork_tier=True), no images until persist(). The first pickle snapshot per env also "
                     "runs a round-trip check (in the warmup).")

    # restore latency
    rows = []
    for e in envs:
        m = {c: med(e, c, "restore_ms") for c in labels}
        row = [e] + [cell(e, c, "restore_ms") for c in labels]
        row += [fmt_ratio(m.get("criu/full"), m.get("pickle")), fmt_ratio(m.get("criu/size"), m.get("pickle")),
                fmt_ratio(m.get("criu/full"), m.get("criu/size"))]
        if has_fork:
            row += [fmt_ratio(m.get("criu/fork"), m.get("pickle")), fmt_ratio(m.get("criu/full"), m.get("criu/fork"))]
        rows.append(row)
    hdr = ["env"] + [f"{c} ms" for c in labels] + ["criu/full vs pickle", "criu/size vs pickle", "full vs size"]
    if has_fork:
        hdr += ["criu/fork vs pickle", "full vs fork"]
    print_table(hdr, rows, title=f"restore() latency until (obs, info) (median of {reps})",
                note="CRIU dump restore = verify images + CRIU restore of a new worker + kill the old worker; "
                     "criu/fork restore = clone() of the frozen fork + kill the old worker.")

    # sizes
    rows = []
    for e in envs:
        c, pk, fk = cfg(e, "criu/full"), cfg(e, "pickle"), cfg(e, "criu/fork")
        ok = lambda d: d is not None and d["status"] == "ok"  # noqa: E731
        c_mb = c["size_bytes"] / 1e6 if ok(c) else None
        pk_mb = pk["size_bytes"] / 1e6 if ok(pk) else None
        rss = c.get("worker_rss_kb") if ok(c) else None
        pages = (c.get("image_files") or {}).get("pages-1.img") if ok(c) else None
        pk_cell = fmt(pk_mb, 4) if pk_mb is not None else (pk["status"] if pk else "n/a")
        row = [e, fmt(c_mb), fmt(pages / 1e6 if pages else None), fmt(rss / 1e3 if rss else None), pk_cell,
               fmt_ratio(c_mb, pk_mb)]
        if has_fork:
            if ok(fk):
                a0 = fk.get("private_bytes_at_once")
                a1 = fk.get(f"private_bytes_after_{PRE_STEPS}_steps")
                pb = fk.get("persisted_bytes")
                row += [f"{fmt(a0 / 1e6 if a0 is not None else None)} / {fmt(a1 / 1e6 if a1 is not None else None)}",
                        fmt(pb / 1e6 if pb else None)]
            else:
                row += [fk["status"] if fk else "n/a"] * 2
        rows.append(row)
    hdr = ["env", "criu image MB", "of which pages-1.img MB", "worker RSS MB", "pickle MB", "criu vs pickle"]
    if has_fork:
        hdr += [f"fork snapshot private MB (at once / after {PRE_STEPS} steps)", "fork persisted MB"]
    print_table(hdr, rows, title="snapshot size",
                note="fork snapshot private MB = Private_Dirty of the frozen process (Snapshot.memory_bytes()): "
                     "the memory it alone holds, growing as the live env rewrites shared pages."
                if has_fork else None)

    # CRIU restore breakdown
    bd_rows = []
    for e in envs:
        c = cfg(e, "criu/full")
        if not c or c["status"] != "ok" or "restore_breakdown_ms" not in c:
            continue
        b = c["restore_breakdown_ms"]
        tot = b["restore_total"]["median"]
        vf, vs, sha = b["verify_full"]["median"], b["verify_size"]["median"], b["sha256_images"]["median"]
        cr, kill, last = b["criu_restore_and_ping"]["median"], b["kill_worker"]["median"], b["last_roundtrip"]["median"]
        snap_ms = c["snapshot_ms"]["median"]
        bd_rows.append([e, fmt(tot), fmt(vf), fmt(vs), fmt(sha), f"{100 * sha / tot:.0f}%", fmt(cr), fmt(kill),
                        fmt(last), fmt(tot - vf - cr - kill - last), f"{100 * sha / snap_ms:.0f}%"])
    if bd_rows:
        print_table(["env", "restore() ms", "verify full", "verify size", "sha256 only", "sha256 share",
                     "CRIU restore+ping", "kill old worker", "last round trip", "rest", "sha256 share of snapshot()"],
                    bd_rows, title=f"where a criu/full restore goes (median ms of {reps}; pieces and restore() timed in one loop)",
                    note="sha256 only = hashing the image files listed in MANIFEST.json (the same work "
                         "write_manifest() does in every CRIU dump). rest = restore() − the pieces.")

    # fork tier persist
    if has_fork:
        rows = []
        for e in envs:
            fk = cfg(e, "criu/fork")
            if fk and fk["status"] == "ok" and "persist_ms" in fk:
                rows.append([e, cell(e, "criu/fork", "snapshot_ms"), fmt(fk["persist_ms"]["median"]),
                             cell(e, "criu/full", "snapshot_ms"),
                             fmt_ratio(fk["persist_ms"]["median"], med(e, "criu/full", "snapshot_ms"))])
        if rows:
            print_table(["env", "fork snapshot() ms", "persist() ms", "criu/full snapshot() ms",
                         "persist vs full dump"], rows,
                        title=f"fork tier: snapshot now, write CRIU images later (median of {reps})")

    rows = []
    for e in envs:
        fk = cfg(e, "criu/fork")
        cp = fk.get("critical_path") if fk and fk["status"] == "ok" else None
        if cp:
            st, pair, aw = (cp[k]["median"] for k in ("step_ms", "snapshot_then_step_ms", "step_after_work_ms"))
            rows.append([e, cell(e, "criu/fork", "snapshot_ms"), fmt(st), fmt(pair), fmt(pair - st),
                         fmt(aw), fmt_ratio(aw, st)])
    if rows:
        print_table(["env", "snapshot() returns ms", "step() ms", "snapshot()+step() ms", "cost on critical path ms",
                     "step() after 3 ms of learner work",
                     "vs plain step"], rows,
                    title="fork tier: what a snapshot costs the learner (the worker answers, then forks; "
                          "the next steps pay copy-on-write faults)")

    # in-process reference
    ref = results["inprocess_reference"].get("CartPole-v1")
    if ref:
        rows = [
            ["copy.deepcopy(env)", fmt(ref["deepcopy_ms"]["median"]), "—"],
            ["cloudpickle.dumps(env)", fmt(ref["cloudpickle_dumps_ms"]["median"]), f"{ref['pickle_bytes']} B"],
            ["cloudpickle.loads(blob)", fmt(ref["cloudpickle_loads_ms"]["median"]), "—"],
        ]
        for c in labels:
            d = (sr.get("CartPole-v1") or {}).get(c)
            if not d or d["status"] != "ok":
                continue
            size = (f"{int(d['size_bytes'])} B" if d["size_bytes"] < 1e5 else f"{d['size_bytes'] / 1e6:.1f} MB") \
                if d["size_bytes"] else "in memory"
            rows += [[f"ForkableEnv {c} snapshot()", fmt(_med(d, "snapshot_ms")), size],
                     [f"ForkableEnv {c} restore()", fmt(_med(d, "restore_ms")), "—"]]
        print_table(["CartPole-v1, in this process", "median ms", "size"], rows,
                    title="reference: pickle-style copying in-process (CartPole-v1)")

    # per-step
    ps = results["per_step"]
    if not ps:
        return
    modes = [m for m in STEP_MODES if any(m in ps[e] for e in ps)]
    rows = []
    for e in ps:
        base = _med(ps[e].get("inprocess"), "us_per_step")
        row = [e]
        for m in modes:
            d = ps[e].get(m)
            if d is None:
                row.append("n/a")
            elif d["status"] != "ok":
                row.append(d["status"])
            else:
                v = d["us_per_step"]["median"]
                row.append(fmt(v) if m == "inprocess" else f"{fmt(v)} ({fmt_ratio(v, base)})")
        rows.append(row)
    print_table(["env"] + [STEP_LABELS[m] + " µs" for m in modes], rows,
                title=f"per-step cost (median µs/step over {steps} pre-sampled steps, {reps} runs; ratio vs in-process)",
                note="Episodes reset on termination inside the timed loop (SubprocVecEnv resets itself). "
                     "bare IPC echo = one step request and a CartPole-sized reply (packed step frames) with an "
                     "echo process over gym_fork's Channel and no env: the floor for any env-in-another-process "
                     "design here. "
                     "All modes of an env are timed interleaved, run by run.")


if __name__ == "__main__":
    sys.exit(main())
