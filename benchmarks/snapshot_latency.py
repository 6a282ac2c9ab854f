"""How long snapshot() and restore() take per backend, how big snapshots are, and what running the
env in a worker process costs per step.

    .venv/bin/python benchmarks/snapshot_latency.py            # ~1-2 min on 2 cores
    .venv/bin/python benchmarks/snapshot_latency.py --quick    # smoke run, ~30 s
    .venv/bin/python -m benchmarks.snapshot_latency --envs CartPole-v1 --reps 15

Part 1, per env and backend (criu with verify="full", criu with verify="size", pickle): after
``reset(seed=0)`` and 100 random steps, the median latency of ``snapshot()`` (each snapshot is
released, untimed, right after), of ``restore()`` (until it returns ``(obs, info)``; CRIU's includes
retiring the previous worker) and the snapshot's size.  The pickle backend refuses EzPickle envs
(Box2D, MuJoCo): shown as "refused".  For CRIU a breakdown separates the manifest check (sha256 vs
sizes only) from CRIU's own restore, and an in-process ``copy.deepcopy``/cloudpickle of CartPole
gives a reference for what pickle-style copying costs.

Part 2: median µs per step over ``--steps`` pre-sampled actions (episodes reset on termination)
for the env stepped in-process (``gymnasium.make``), in a ForkableEnv CRIU worker (freshly started
and CRIU-restored), in SB3's ``SubprocVecEnv`` with one env, and in a ForkableEnv pickle env
(in-process, where allowed).

Tables go to stdout (markdown), progress to stderr, all numbers to ``results/snapshot_latency.json``.
"""

from __future__ import annotations

import argparse
import copy
import gc
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
    Progress,
    fmt,
    fmt_ratio,
    print_table,
    save_results,
    summarize,
    time_reps,
)
from gym_fork import store  # noqa: E402
from gym_fork.criu_support import criu_status  # noqa: E402
from gym_fork.errors import UnsupportedEnvError  # noqa: E402

DEFAULT_ENVS = "CartPole-v1,LunarLander-v3,HalfCheetah-v5"
PRE_STEPS = 100  # random steps after reset(seed=0) before snapshotting
CONFIGS = [  # (label, backend, verify)
    ("criu/full", "criu", "full"),
    ("criu/size", "criu", "size"),
    ("pickle", "pickle", "full"),
]
STEP_MODES = ["inprocess", "criu", "criu_restored", "subproc_vec", "pickle"]
STEP_LABELS = {
    "inprocess": "in-process",
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
        for label, backend, verify in configs:
            try:
                envs[label] = gym_fork.ForkableEnv(env_id, backend=backend, verify=verify)
            except UnsupportedEnvError as e:
                out[label] = {"status": "refused", "reason": str(e).split(":")[0]}
                continue
            _warm_up_env(envs[label])
            out[label] = {"status": "ok", "backend": backend, "verify": verify}
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
                if r["backend"] == "criu":
                    man = store.read_manifest(snaps[label].payload().path)
                    r["image_files"] = {k: v["size"] for k, v in man["files"].items()}
                    r["worker_rss_kb"] = _rss_kb(env.worker_pid)
                    if breakdown and r["verify"] == "full":
                        r["restore_breakdown_ms"] = criu_restore_breakdown(env, snaps[label], reps, warmup)
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
        store.file_digest(os.path.join(path, name))


def criu_restore_breakdown(env: gym_fork.ForkableEnv, snap, reps: int, warmup: int) -> dict:
    """Where a CRIU restore's time goes, timed piece by piece on the side (private API).

    restore() = verify manifest (sha256 or sizes) + CRIU restore of a new worker (+ ping)
              + kill the previous worker + one ``last`` round trip for (obs, info).
    """
    be = env._backend  # noqa: SLF001 - a benchmark may look inside
    payload = snap.payload()
    path = payload.path
    man = store.read_manifest(path)
    out = {
        "verify_full": summarize(time_reps(lambda: store.verify(path, full=True), reps, warmup)),
        "verify_size": summarize(time_reps(lambda: store.verify(path, full=False), reps, warmup)),
        "sha256_images": summarize(time_reps(lambda: _sha256_all(path, man), reps, warmup)),
    }
    t_restore, t_kill, t_last = [], [], []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        h = be._restore_verified(payload)  # noqa: SLF001
        t1 = time.perf_counter()
        h.request("last")
        t2 = time.perf_counter()
        h.kill()
        t3 = time.perf_counter()
        if i >= warmup:
            t_restore.append(t1 - t0)
            t_last.append(t2 - t1)
            t_kill.append(t3 - t2)
    out["criu_restore_and_ping"] = summarize(t_restore)
    out["last_roundtrip"] = summarize(t_last)
    out["kill_worker"] = summarize(t_kill)
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


def _make_step_env(mode: str, env_id: str):
    """(env-like, loop function, closer) for one per-step mode; raises UnsupportedEnvError."""
    if mode == "inprocess":
        env = gym.make(env_id)
        return env, _loop, env.close
    if mode in ("criu", "pickle"):
        env = gym_fork.ForkableEnv(env_id, backend=mode, record_actions=False)
        return env, _loop, env.close
    if mode == "criu_restored":
        env = gym_fork.ForkableEnv(env_id, backend="criu", record_actions=False)
        env.reset(seed=0)
        snap = env.snapshot()
        env.restore(snap)
        snap.release()
        return env, _loop, env.close
    if mode == "subproc_vec":
        from stable_baselines3.common.vec_env import SubprocVecEnv

        venv = SubprocVecEnv([lambda: gym.make(env_id)])
        return venv, _vec_loop, venv.close
    raise ValueError(mode)


def bench_steps(env_id: str, mode: str, actions: list, reps: int, warmup: int) -> dict:
    try:
        env, loop, close = _make_step_env(mode, env_id)
    except UnsupportedEnvError as e:
        return {"status": "refused", "reason": str(e).split(":")[0]}
    try:
        acts = [np.asarray([a]) for a in actions] if mode == "subproc_vec" else actions
        samples = time_reps(lambda: loop(env, acts), reps, warmup, collect=False)
        per_step = [s / len(actions) for s in samples]
        return {"status": "ok", "us_per_step": summarize(per_step, unit=1e6)}
    finally:
        close()


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
    p.add_argument("--name", default="snapshot_latency", help="results/<name>.json (default snapshot_latency)")
    args = p.parse_args(argv)
    reps = args.reps or (3 if args.quick else 7)
    steps = args.steps or (500 if args.quick else 2000)
    envs = [e.strip() for e in args.envs.split(",") if e.strip()]
    warmup = max(0, args.warmup)

    criu_ok = criu_status().usable
    configs = [c for c in CONFIGS if c[1] != "criu" or criu_ok]
    modes = [m for m in STEP_MODES if not m.startswith("criu") or criu_ok]
    if not criu_ok:
        print("CRIU is not usable here: only the pickle backend is measured.", file=sys.stderr)

    results: dict = {"args": {"reps": reps, "warmup": warmup, "steps": steps, "envs": envs,
                              "pre_steps": PRE_STEPS, "quick": args.quick},
                     "snapshot_restore": {}, "inprocess_reference": {}, "per_step": {}}
    total = len(envs) * (len(configs) + len(modes)) + 1
    t_start = time.perf_counter()
    with Progress(total, "snapshot_latency") as prog:
        for env_id in envs:
            prog.step(f"{env_id} snapshot/restore ({', '.join(c[0] for c in configs)})")
            results["snapshot_restore"][env_id] = bench_snapshot_restore(
                env_id, configs, reps, warmup, breakdown=not args.no_breakdown)
        prog.step("CartPole-v1 in-process deepcopy/cloudpickle reference")
        results["inprocess_reference"]["CartPole-v1"] = inprocess_reference("CartPole-v1", reps, warmup)
        for env_id in envs:
            actions = presample_actions(env_id, steps)
            results["per_step"][env_id] = {}
            for mode in modes:
                prog.step(f"{env_id} per-step {STEP_LABELS[mode]}")
                results["per_step"][env_id][mode] = bench_steps(env_id, mode, actions, reps, warmup)
    results["elapsed_s"] = round(time.perf_counter() - t_start, 1)

    report(results, reps, steps)
    path = save_results(args.name, results)
    print(f"\n(results: {path.relative_to(path.parent.parent)}; {results['elapsed_s']} s)", flush=True)
    return 0


def report(results: dict, reps: int, steps: int) -> None:
    sr = results["snapshot_restore"]
    envs = list(sr)
    cfg = lambda e, c: sr[e].get(c)  # noqa: E731

    def cell(e: str, c: str, key: str) -> str:
        d = cfg(e, c)
        if d is None:
            return "n/a"
        if d["status"] == "refused":
            return "refused"
        return fmt(d[key]["median"])

    rows = []
    for e in envs:
        full, size, pk = (_med(cfg(e, c), "snapshot_ms") for c in ("criu/full", "criu/size", "pickle"))
        rows.append([e, cell(e, "criu/full", "snapshot_ms"), cell(e, "criu/size", "snapshot_ms"),
                     cell(e, "pickle", "snapshot_ms"), fmt_ratio(full, pk), fmt_ratio(full, size)])
    print_table(["env", "criu/full ms", "criu/size ms", "pickle ms", "criu/full vs pickle", "full vs size"],
                rows, title=f"snapshot() latency (median of {reps}; after reset(seed=0) + {PRE_STEPS} steps)",
                note="criu/full and criu/size differ only at restore: every CRIU snapshot writes a sha256 "
                     "manifest; the first pickle snapshot per env also runs a round-trip check (in the warmup).")

    rows = []
    for e in envs:
        full, size, pk = (_med(cfg(e, c), "restore_ms") for c in ("criu/full", "criu/size", "pickle"))
        rows.append([e, cell(e, "criu/full", "restore_ms"), cell(e, "criu/size", "restore_ms"),
                     cell(e, "pickle", "restore_ms"), fmt_ratio(full, pk), fmt_ratio(size, pk),
                     fmt_ratio(full, size)])
    print_table(["env", "criu/full ms", "criu/size ms", "pickle ms", "criu/full vs pickle",
                 "criu/size vs pickle", "full vs size"],
                rows, title=f"restore() latency until (obs, info) (median of {reps})",
                note="CRIU restore = verify images + CRIU restore of a new worker + kill the old worker.")

    rows = []
    for e in envs:
        c, pk = cfg(e, "criu/full"), cfg(e, "pickle")
        c_mb = c["size_bytes"] / 1e6 if c and c["status"] == "ok" else None
        pk_mb = pk["size_bytes"] / 1e6 if pk and pk["status"] == "ok" else None
        rss = c.get("worker_rss_kb") if c and c["status"] == "ok" else None
        pages = (c.get("image_files") or {}).get("pages-1.img") if c and c["status"] == "ok" else None
        rows.append([e, fmt(c_mb), fmt(pages / 1e6 if pages else None), fmt(rss / 1e3 if rss else None),
                     "refused" if pk and pk["status"] == "refused" else fmt(pk_mb, 4) if pk_mb is not None else "n/a",
                     fmt_ratio(c_mb, pk_mb)])
    print_table(["env", "criu image MB", "of which pages-1.img MB", "worker RSS MB", "pickle MB",
                 "criu vs pickle"], rows, title="snapshot size")

    bd_rows = []
    for e in envs:
        c = cfg(e, "criu/full")
        if not c or c["status"] != "ok" or "restore_breakdown_ms" not in c:
            continue
        b = c["restore_breakdown_ms"]
        tot = c["restore_ms"]["median"]
        vf, vs, sha = b["verify_full"]["median"], b["verify_size"]["median"], b["sha256_images"]["median"]
        cr, kill, last = b["criu_restore_and_ping"]["median"], b["kill_worker"]["median"], b["last_roundtrip"]["median"]
        bd_rows.append([e, fmt(tot), fmt(vf), fmt(vs), fmt(sha), f"{100 * sha / tot:.0f}%", fmt(cr), fmt(kill),
                        fmt(last), fmt(tot - vf - cr - kill - last)])
    if bd_rows:
        print_table(["env", "restore() ms", "verify full", "verify size", "sha256 only", "sha256 share",
                     "CRIU restore+ping", "kill old worker", "last round trip", "rest"],
                    bd_rows, title=f"where a criu/full restore goes (median ms of {reps}, pieces timed separately)",
                    note="sha256 only = hashing the image files listed in MANIFEST.json (the same work "
                         "write_manifest() does in every CRIU snapshot). rest = restore() − the pieces.")

    ref = results["inprocess_reference"].get("CartPole-v1")
    if ref:
        pk = (sr.get("CartPole-v1") or {}).get("pickle")
        c = (sr.get("CartPole-v1") or {}).get("criu/full")
        rows = [
            ["copy.deepcopy(env)", fmt(ref["deepcopy_ms"]["median"]), "—"],
            ["cloudpickle.dumps(env)", fmt(ref["cloudpickle_dumps_ms"]["median"]), f"{ref['pickle_bytes']} B"],
            ["cloudpickle.loads(blob)", fmt(ref["cloudpickle_loads_ms"]["median"]), "—"],
        ]
        if pk and pk["status"] == "ok":
            rows += [["ForkableEnv pickle snapshot()", fmt(_med(pk, "snapshot_ms")), f"{int(pk['size_bytes'])} B"],
                     ["ForkableEnv pickle restore()", fmt(_med(pk, "restore_ms")), "—"]]
        if c and c["status"] == "ok":
            rows += [["ForkableEnv criu/full snapshot()", fmt(_med(c, "snapshot_ms")), f"{c['size_bytes'] / 1e6:.1f} MB"],
                     ["ForkableEnv criu/full restore()", fmt(_med(c, "restore_ms")), "—"]]
        print_table(["CartPole-v1, in this process", "median ms", "size"], rows,
                    title="reference: pickle-style copying in-process (CartPole-v1)")

    ps = results["per_step"]
    modes = [m for m in STEP_MODES if any(m in ps[e] for e in ps)]
    rows = []
    for e in ps:
        base = _med(ps[e].get("inprocess"), "us_per_step")
        row = [e]
        for m in modes:
            d = ps[e].get(m)
            if d is None:
                row.append("n/a")
            elif d["status"] == "refused":
                row.append("refused")
            else:
                v = d["us_per_step"]["median"]
                row.append(fmt(v) if m == "inprocess" else f"{fmt(v)} ({fmt_ratio(v, base)})")
        rows.append(row)
    print_table(["env"] + [STEP_LABELS[m] + " µs" for m in modes], rows,
                title=f"per-step cost (median µs/step over {steps} pre-sampled steps, {reps} runs; ratio vs in-process)",
                note="Episodes reset on termination inside the timed loop (SubprocVecEnv resets itself).")


if __name__ == "__main__":
    sys.exit(main())
