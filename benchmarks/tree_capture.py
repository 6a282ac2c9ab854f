"""Envs whose state lives outside process memory: what each backend does with them, what it
costs, and what the check before each copy-on-write snapshot costs.

1. *Check cost*: the worker's scan for what ``fork()`` cannot copy (threads, children, shared
   descriptors) runs before every fork-tier snapshot.  Measured as the round trip of the
   ``resources`` command minus that of ``ping`` (median), against the median ``snapshot()``.
2. *Mechanism table*: each env kind (tests/agent_envs.py) x backend -> what a snapshot is (a
   copy-on-write fork, a CRIU dump of the whole process tree, a pickle, or a refusal naming the
   resource) and the median snapshot / restore / fork(4) latency against replaying the prefix
   from ``reset()`` in the same env.

    sudo .venv/bin/python benchmarks/tree_capture.py [--reps 5] [--prefix 20]

Prints markdown tables and writes results/tree_capture.json (``--out DIR``).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the env kinds live with the tests
from benchmarks.common import add_out_option, fmt, fmt_ratio, print_table, save_results, time_reps  # noqa: E402

import agent_envs  # noqa: E402
import gymnasium as gym  # noqa: E402
import gym_fork  # noqa: E402
from gym_fork.errors import GymForkError  # noqa: E402


def _med(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


class ScanTimer(gym.Wrapper):
    """Times the worker's scan where it runs, in the worker (a round trip would add more noise
    than the scan costs): ``env.get_wrapper_attr("scan_ms")``."""

    @property
    def scan_ms(self) -> float:
        from gym_fork.worker import resources

        own = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                    own.add(int(fd))  # the channel
            except OSError:
                pass  # the fd listdir itself used
        xs = []
        for _ in range(200):
            t = time.perf_counter()
            resources.fork_blockers(own)
            xs.append(time.perf_counter() - t)
        return statistics.median(xs) * 1e3


def _make_timed(src):
    if isinstance(src, str) and src.startswith("ALE/"):
        import ale_py  # registers ALE/ in the worker

        gym.register_envs(ale_py)
    return ScanTimer(gym.make(src) if isinstance(src, str) else src())


def _timed(src):
    return functools.partial(_make_timed, src)


def check_cost(reps: int) -> list[dict]:
    """Scan cost (in the worker) vs snapshot() latency, per env (fork tier where the env allows it)."""
    rows = []
    for name, src in [("CartPole-v1", "CartPole-v1"), ("LunarLander-v3", "LunarLander-v3"),
                      ("ALE/Pong-v5", "ALE/Pong-v5"), ("HalfCheetah-v5", "HalfCheetah-v5"),
                      ("child process over a pipe (found: CRIU dump)", agent_envs.pipe_child)]:
        env = gym_fork.ForkableEnv(_timed(src))
        try:
            env.reset(seed=0)
            for _ in range(5):
                env.step(env.action_space.sample())
            scan = statistics.median(env.get_wrapper_attr("scan_ms") for _ in range(3))
            snap = time_reps(env.snapshot, reps * 4, 2, teardown=lambda s: s.release())
            rows.append({"env": name, "scan_ms": scan, "snapshot_ms": _med(snap), "fraction": scan / _med(snap)})
        finally:
            env.close()
    return rows


KINDS = [
    ("memory only (CartPole-v1)", "CartPole-v1", {}),
    ("child process over a pipe", agent_envs.pipe_child, {}),
    ("Redis over a unix socket", agent_envs.redis_unix, {}),
    ("Redis over TCP, private_network", agent_envs.redis_tcp, {"private_network": True}),
    ("Redis over TCP, no isolation", agent_envs.redis_tcp, {}),
    ("unlinked temp file", agent_envs.unlinked_file, {}),
    ("thread started after reset", agent_envs.thread_after_reset, {}),
    ("CarRacing-v3 (render thread)", "CarRacing-v3", {}),
    ("global RNGs (random, numpy)", agent_envs.global_rng, {}),
    ("SQLite file outside a workspace", "sqlite", {}),
]
BACKENDS = [("auto", {}), ("criu, fork_tier=False", {"backend": "criu", "fork_tier": False}),
            ("pickle", {"backend": "pickle"})]


def _make(src, opts: dict, tmp: str):
    if src == "sqlite":
        path = os.path.join(tmp, f"moves-{time.monotonic_ns()}.db")
        return gym_fork.ForkableEnv(lambda: agent_envs.SqliteEnv(path), **opts)
    return gym_fork.ForkableEnv(src, **opts)


def mechanism_row(kind: str, src, kopts: dict, bname: str, bopts: dict, reps: int, prefix: int, tmp: str) -> dict:
    row = {"kind": kind, "backend": bname}
    try:
        env = _make(src, {**kopts, **bopts}, tmp)
    except GymForkError as e:
        return row | {"mechanism": f"refused at start: {type(e).__name__}"}
    try:
        env.action_space.seed(0)
        acts = [env.action_space.sample() for _ in range(prefix)]

        def replay() -> None:
            env.reset(seed=0)
            for a in acts:
                env.step(a)

        replay()
        try:
            snap = env.snapshot()
        except GymForkError as e:
            return row | {"mechanism": f"refused: {type(e).__name__}", "why": str(e)[:200]}
        row["mechanism"] = ("pickle" if env.backend == "pickle" else
                            "fork (copy-on-write)" if snap.size_bytes == 0 else "CRIU dump of the tree")
        snaps = time_reps(env.snapshot, reps, 1, teardown=lambda s: s.release())
        restores = time_reps(lambda: env.restore(snap), reps, 1)
        forks = time_reps(lambda: env.fork(snap, 4), reps, 1, teardown=lambda kids: [k.close() for k in kids])
        replays = time_reps(replay, reps, 1)
        row.update(snapshot_ms=_med(snaps), restore_ms=_med(restores), fork4_ms=_med(forks), replay_ms=_med(replays))
    finally:
        env.close()
    return row


def main(argv: list[str] | None = None) -> dict:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--prefix", type=int, default=20, help="steps replayed from reset() (the baseline)")
    add_out_option(p)
    args = p.parse_args(argv)

    cost = check_cost(args.reps)
    print_table(["env", "check (scan, in the worker) ms", "snapshot() ms", "check / snapshot"],
                [[r["env"], fmt(r["scan_ms"], 3), fmt(r["snapshot_ms"]), f"{100 * r['fraction']:.0f} %"] for r in cost],
                title="What the check before each copy-on-write snapshot costs (medians)")

    tmp = tempfile.mkdtemp(prefix="gf-bench-")
    rows = []
    for kind, src, kopts in KINDS:
        for bname, bopts in BACKENDS:
            rows.append(mechanism_row(kind, src, kopts, bname, bopts, args.reps, args.prefix, tmp))
            print(f"  {kind} / {bname}: {rows[-1].get('mechanism')}", file=sys.stderr, flush=True)
    print_table(["env kind", "backend", "mechanism", "snapshot ms", "restore ms", "fork(4) ms",
                 f"replay {args.prefix} steps from reset() ms", "restore vs replay"],
                [[r["kind"], r["backend"], r["mechanism"], fmt(r.get("snapshot_ms")), fmt(r.get("restore_ms")),
                  fmt(r.get("fork4_ms")), fmt(r.get("replay_ms")), fmt_ratio(r.get("restore_ms"), r.get("replay_ms"))]
                 for r in rows],
                title="Env kind x backend: the mechanism used and its cost (medians)")
    out = {"check_cost": cost, "table": rows, "reps": args.reps, "prefix": args.prefix}
    save_results("tree_capture", out)
    return out


if __name__ == "__main__":
    main()
