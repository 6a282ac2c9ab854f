"""Crashes (SIGKILL) of the env's worker and of frozen snapshots at random moments, checked
against the env's own history.

An env whose observation is its step count and a running hash of its actions takes random calls
(steps, rollouts, snapshots -- half of them persisted --, restores, forks). Now and then its
current worker is killed 0-5 ms into a call, or a snapshot's frozen process is killed between
calls. A call must then answer exactly or raise ``WorkerDiedError`` / ``RestoreError``; after a
crash, a restore of a persisted snapshot must bring the env back exactly (a snapshot never
persisted may be gone, and must say so); every answer is checked against the history, and after
the env is closed no worker may be left. A ``WorkerDiedError`` must say the worker was killed by
SIGKILL (a copy's end is seen only by its parent process, which writes it down) where that
worker is the process the campaign killed. Prints what broke that and, per seed,
``(bad, crashes)``.

    .venv/bin/python scripts/crash_campaign.py --seeds 1-4 --calls 150
"""

from __future__ import annotations

import functools
import os
import re
import signal
import sys
import threading
import time

import numpy as np

import gym_fork
from gym_fork.errors import RestoreError, WorkerDiedError
from gym_fork.testing.campaigns import parse_seeds, parser, report, worker_processes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ctrl_c_campaign import EchoEnv, history_fault  # noqa: E402 - (the scripts directory, put on the path above)


KILLED: set[int] = set()  # every pid kill() was given


def kill(pid: int | None) -> None:
    if pid:
        KILLED.add(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(seed: int, calls: int, fork_tier: bool) -> tuple[int, int]:
    rng = np.random.default_rng(seed)
    before = worker_processes()  # (others', e.g. a test's: not this run's to end)
    env = gym_fork.ForkableEnv(EchoEnv, record_actions=True, fork_tier=fork_tier)
    bad = crashes = 0
    snaps: dict[str, tuple] = {}  # id -> (snapshot, t, h, persisted)
    taken: dict[str, tuple] = {}  # every snapshot taken: id -> (t, h)
    dead = False
    try:
        env.reset(seed=0)
        first = env.snapshot().persist()
        snaps[first.id], taken[first.id] = (first, 0, 0, True), (0, 0)
        for i in range(calls):
            if dead:  # the worker crashed: go on from a snapshot
                sid = list(snaps)[int(rng.integers(len(snaps)))]
                snap, t, h, persisted = snaps[sid]
                try:
                    out = env.restore(snap)[0]
                    dead = False
                except RestoreError as e:
                    if persisted or "never persisted" not in str(e):
                        print(f"  seed {seed} call {i}: a restore after a crash failed: {e}")
                        return bad + 1, crashes
                    del snaps[sid]  # (gone with its worker, and said so)
                    continue
            else:
                kind = rng.choice(["step", "step", "step", "rollout", "snapshot", "restore", "fork", "frozen"])
                timer = None
                if kind != "frozen" and rng.random() < 0.15:
                    pid = env.worker_pid
                    timer = threading.Timer(float(rng.uniform(0, 5e-3)), kill, (pid,))
                    timer.start()
                a = int(rng.integers(1000))
                sid = list(snaps)[int(rng.integers(len(snaps)))]
                try:
                    if kind == "step":
                        out = env.step(a)[0]
                    elif kind == "rollout":
                        out = env.rollout([a, a + 1])["final_obs"]
                    elif kind == "snapshot":
                        out = env.step(a)[0]
                        s = env.snapshot()
                        taken[s.id] = (int(out[0]), int(out[2]))
                        persisted = bool(rng.random() < 0.5)
                        if persisted:
                            s.persist()
                        snaps[s.id] = (s, int(out[0]), int(out[2]), persisted)
                    elif kind == "restore":
                        try:
                            out = env.restore(snaps[sid][0])[0]
                        except RestoreError as e:
                            if snaps[sid][3] or "never persisted" not in str(e):
                                raise
                            del snaps[sid]
                            continue
                    elif kind == "fork":
                        snap, t, h, _ = snaps[sid]
                        try:
                            [child] = env.fork(snap, 1)
                        except RestoreError as e:
                            if snaps[sid][3] or "never persisted" not in str(e):
                                raise
                            del snaps[sid]
                            continue
                        got = child.step(a)[0]
                        child.close()
                        if (int(got[0]), int(got[2])) != (t + 1, (h * 31 + a) % 1_000_003):
                            print(f"  seed {seed} call {i}: a fork of {sid} answered {got}, its snapshot was at t={t}")
                            bad += 1
                        continue
                    else:  # a snapshot's frozen process crashes (fork tier only)
                        payload = snaps[sid][0]._payload
                        if getattr(payload, "chan", None) is not None:
                            try:
                                kill(payload.pid)
                            except (OSError, gym_fork.errors.GymForkError):
                                pass  # (gone already)
                        continue
                except WorkerDiedError as e:
                    crashes += 1
                    dead = True
                    # a worker killed here must say so: its parent wrote it down (gym_fork.worker.exits).
                    # Not one that went with its PID namespace, whose init was killed here (then
                    # its parent went too), nor a snapshot's frozen process found gone (persist()
                    # of a snapshot that went with its worker)
                    named = re.search(r"\(pid (\d+)\)", str(e))
                    if named and int(named.group(1)) in KILLED and "killed by SIGKILL" not in str(e):
                        print(f"  seed {seed} call {i}: the error does not say how the worker ended: {e}")
                        bad += 1
                    continue
                except (RestoreError, gym_fork.errors.SnapshotError) as e:
                    if timer is None:
                        raise
                    # a restore whose new worker, or a persist() whose copy, the kill took (the env
                    # runs as before, or its worker died too: the next call says so)
                    if not ("died" in str(e) or "gone" in str(e)):
                        print(f"  seed {seed} call {i}: {kind} failed without saying a process died: {e}")
                        bad += 1
                    crashes += 1
                    continue
                finally:
                    if timer is not None:
                        timer.cancel()
                        timer.join()
                if timer is not None and not dead:
                    # the kill may have come after the answer: the next call says so
                    time.sleep(0.01)
            parent = taken.get(env._parent_id)
            if parent is None:
                bad += 1
                print(f"  seed {seed} call {i}: the env's parent snapshot {env._parent_id} is not one taken here")
                continue
            fault = history_fault(env, *parent, out)
            if fault:
                print(f"  seed {seed} call {i}: {fault}")
                return bad + 1, crashes
    finally:
        env.close()
        for s, *_ in snaps.values():
            s.release()
    deadline = time.monotonic() + 5
    while (left := worker_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        bad += 1
        print(f"  seed {seed}: worker processes left after close: {sorted(left)}")
    return bad, crashes


def main() -> int:
    ap = parser(__doc__, seeds="1-3", count="calls", per_seed=150)
    ap.add_argument("--criu-dumps", action="store_true", help="every snapshot a CRIU dump (default: the fork tier)")
    args = ap.parse_args()

    def one(seed: int) -> tuple[bool, str]:
        bad, n = run(seed, args.calls, not args.criu_dumps)
        return bad > 0, f"{bad} calls broken, {n} crashes"

    return report((f"seed {seed}", functools.partial(one, seed)) for seed in parse_seeds(args.seeds))


if __name__ == "__main__":
    sys.exit(main())
