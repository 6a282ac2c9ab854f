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

    @property
    def drain_us(self) -> float:
        """One look at the worker's fanotify queue (ahead of every reply), when it is empty."""
        from gym_fork.worker import fswatch

        if not fswatch.available():
            return float("nan")
        xs = []
        for _ in range(2000):
            t = time.perf_counter()
            fswatch.drain()
            xs.append(time.perf_counter() - t)
        return statistics.median(xs) * 1e6


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
            drain = statistics.median(env.get_wrapper_attr("drain_us") for _ in range(3))
            snap = time_reps(env.snapshot, reps * 4, 2, teardown=lambda s: s.release())
            rows.append({"env": name, "scan_ms": scan, "snapshot_ms": _med(snap), "fraction": scan / _med(snap),
                         "drain_us": drain, "drain_fraction": drain / 1e3 / _med(snap)})
        finally:
            env.close()
    return rows


def watch_ab(reps: int, rounds: int = 3) -> list[dict]:
    """The kernel-side file watch on and off (``GYM_FORK_FSWATCH=0``), alternating: a plain step
    and snapshot()+step - step (fork tier), medians over the rounds."""
    out = []
    for name in ("CartPole-v1", "LunarLander-v3"):
        res: dict[str, list[float]] = {"on_step": [], "off_step": [], "on_snap": [], "off_snap": []}
        for _ in range(rounds):
            for mode in ("on", "off"):
                if mode == "off":
                    os.environ["GYM_FORK_FSWATCH"] = "0"
                try:
                    env = gym_fork.ForkableEnv(name)
                finally:
                    os.environ.pop("GYM_FORK_FSWATCH", None)
                try:
                    env.reset(seed=0)
                    a = env.action_space.sample()

                    def step() -> None:
                        if env.step(a)[2]:
                            env.reset()

                    steps = time_reps(step, reps * 400, 50, collect=False)

                    def snap_step():
                        s = env.snapshot()
                        step()
                        return s

                    snaps = time_reps(snap_step, reps * 8, 2, teardown=lambda s: s.release())
                    res[f"{mode}_step"].append(_med(steps) * 1e3)
                    res[f"{mode}_snap"].append(_med(snaps) - _med(steps))
                finally:
                    env.close()
        row = {"env": name}
        for k, v in res.items():
            row[k] = statistics.median(v)
        row["step_ratio"] = row["on_step"] / row["off_step"]
        row["snap_ratio"] = row["on_snap"] / row["off_snap"]
        out.append(row)
    return out


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
    ("shell child appending to a log outside a workspace", "shell-log", {}),
    ("app directory (files per step, a shell tool), no private_dirs", "app", {}),
    ("app directory (files per step, a shell tool), private_dirs", "app-private", {}),
    ("app directory with a journal held open, private_dirs", "app-private-hold", {}),
    ("Redis on a socket path in a private_dirs directory", "redis-private", {}),
]
BACKENDS = [("auto", {}), ("criu, fork_tier=False", {"backend": "criu", "fork_tier": False}),
            ("pickle", {"backend": "pickle"})]


def _make(src, opts: dict, tmp: str):
    if src == "sqlite":
        path = os.path.join(tmp, f"moves-{time.monotonic_ns()}.db")
        return gym_fork.ForkableEnv(lambda: agent_envs.SqliteEnv(path), **opts)
    if src == "shell-log":
        path = os.path.join(tmp, f"tool-{time.monotonic_ns()}.log")
        return gym_fork.ForkableEnv(lambda: agent_envs.ShellLogEnv(path), **opts)
    if src in ("app", "app-private", "app-private-hold", "redis-private"):
        d = os.path.join(tmp, f"{src}-{time.monotonic_ns()}")
        os.makedirs(d)
        private = {"private_dirs": [d]} if src != "app" else {}
        factory = (functools.partial(agent_envs.redis_unix_in, d) if src == "redis-private" else
                   functools.partial(agent_envs.app_dir, d, src == "app-private-hold", True))
        return gym_fork.ForkableEnv(factory, **private, **opts)
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
    p.add_argument("--skip-watch-ab", action="store_true", help="skip the file watch on/off comparison")
    p.add_argument("--only-checks", action="store_true", help="only the check-cost tables (no mechanism table)")
    p.add_argument("--kinds", default="", help="only the env kinds whose name contains one of these "
                                               "comma-separated words (e.g. 'private_dirs,CartPole'); "
                                               "skips the check-cost tables")
    add_out_option(p)
    args = p.parse_args(argv)

    cost = [] if args.kinds else check_cost(args.reps)
    if cost:
        print_table(["env", "check (scan, in the worker) ms", "snapshot() ms", "check / snapshot",
                     "file watch: one empty drain us", "drain / snapshot"],
                    [[r["env"], fmt(r["scan_ms"], 3), fmt(r["snapshot_ms"]), f"{100 * r['fraction']:.0f} %",
                      fmt(r["drain_us"], 2), f"{100 * r['drain_fraction']:.2f} %"] for r in cost],
                    title="What the check before each copy-on-write snapshot costs (medians)")
    watch = [] if args.skip_watch_ab or args.kinds else watch_ab(args.reps)
    if watch:
        print_table(["env", "step us, watch on", "step us, off (GYM_FORK_FSWATCH=0)", "on / off",
                     "snapshot()+step - step ms, on", "off", "on / off"],
                    [[r["env"], fmt(r["on_step"], 1), fmt(r["off_step"], 1), fmt(r["step_ratio"], 3),
                      fmt(r["on_snap"], 3), fmt(r["off_snap"], 3), fmt(r["snap_ratio"], 3)] for r in watch],
                    title="The kernel-side file watch (fanotify) on vs off, alternating rounds (medians)")

    tmp = tempfile.mkdtemp(prefix="gf-bench-")
    rows = []
    wanted = [w for w in args.kinds.split(",") if w]
    for kind, src, kopts in ([] if args.only_checks else KINDS):
        if wanted and not any(w in kind for w in wanted):
            continue
        for bname, bopts in BACKENDS:
            rows.append(mechanism_row(kind, src, kopts, bname, bopts, args.reps, args.prefix, tmp))
            print(f"  {kind} / {bname}: {rows[-1].get('mechanism')}", file=sys.stderr, flush=True)
    print_table(["env kind", "backend", "mechanism", "snapshot ms", "restore ms", "fork(4) ms",
                 f"replay {args.prefix} steps from reset() ms", "restore vs replay"],
                [[r["kind"], r["backend"], r["mechanism"], fmt(r.get("snapshot_ms")), fmt(r.get("restore_ms")),
                  fmt(r.get("fork4_ms")), fmt(r.get("replay_ms")), fmt_ratio(r.get("restore_ms"), r.get("replay_ms"))]
                 for r in rows],
                title="Env kind x backend: the mechanism used and its cost (medians)")
    out = {"check_cost": cost, "watch_ab": watch, "table": rows, "reps": args.reps, "prefix": args.prefix}
    save_results("tree_capture", out)
    return out


if __name__ == "__main__":
    main()
