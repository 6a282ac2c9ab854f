"""Crashes (SIGKILL) of vector envs' slot workers in the middle of steps, checked against an
in-process model of every slot.

Both vector APIs, as ``ctrl_c_vector_campaign.py`` drives them: Gymnasium's
``ForkableVectorEnv`` (against ``SyncVectorEnv``, in each autoreset mode) and SB3's
``ForkableVecEnv`` (against ``DummyVecEnv``), 3 CartPole slots whose episodes end every 12 steps.
Random steps, persisted snapshots of a slot and restores of one; in a third of the steps one
slot's worker is killed, before the step or 0-2 ms into it. A step must then answer whole, or
raise ``WorkerDiedError`` whose ``partial_step`` lists exactly the dead slot as failed and holds
every other slot's row of the step, bit for bit the model's (observations, rewards, episode
ends), and its message must say that the worker was killed by SIGKILL (most workers are copies,
whose end only their parent process sees). The dead slot is then restored from a persisted snapshot, and every later step must match
the model. After the env is closed no worker may be left. Prints what broke that and
``(bad, crashes)`` per seed and API.

    .venv/bin/python scripts/crash_vector_campaign.py --seeds 1-4 --calls 150
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time

import numpy as np
from gymnasium.vector import AutoresetMode

from gym_fork.errors import WorkerDiedError
from gym_fork.testing.campaigns import parser, report, worker_processes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from crash_campaign import kill  # noqa: E402 - (the scripts directory, put on the path above)
from ctrl_c_vector_campaign import N, SB3, Gymnasium, add_api_option, runs_of  # noqa: E402


def row_fault(v: Gymnasium, want: tuple, got: tuple, slots: list[int]) -> str | None:
    """Where ``got`` (a step's result, or an error's ``partial_step``) differs from the model's
    ``want`` in the rows of ``slots``: observations, rewards and episode ends."""
    fields = ("observation", "reward", "termination", "truncation") if isinstance(v, Gymnasium) and not isinstance(
        v, SB3) else ("observation", "reward", "done")
    for k, name in enumerate(fields):
        w, g = np.asarray(want[k]), np.asarray(got[k])
        for j in slots:
            if not np.array_equal(w[j], g[j]):
                return f"slot {j}'s {name} is {g[j]}, the model's {w[j]}"
    return None


def run(api: type, seed: int, calls: int, mode: AutoresetMode | None) -> tuple[int, int]:
    rng = random.Random(seed)
    others = worker_processes()  # (others', e.g. a test's: not this run's to end)
    v = api(seed, mode)
    saved = [(v.fv.snapshot(j).persist(), v.saved_of(j)) for j in range(N)]  # (CRIU images: outlive a crash)
    bad = crashes = 0
    dead: set[int] = set()  # slots whose worker was killed and whose step has not failed yet
    log: list = []
    try:
        for i in range(calls):
            r = rng.random()
            if r < 0.1:
                j = rng.randrange(N)
                log.append(("snapshot", j))
                if j in dead:
                    continue  # (its worker is gone: the snapshot would fail, as it should)
                saved.append((v.fv.snapshot(j).persist(), v.saved_of(j)))
                continue
            if r < 0.2:
                j, (snap, model) = rng.randrange(N), rng.choice(saved)
                log.append(("restore", j))
                v.restore(j, snap)
                v.put(j, model)
                dead.discard(j)
                continue
            actions = np.array([rng.randrange(2) for _ in range(N)])
            if mode == AutoresetMode.DISABLED and v.ref._autoreset_envs.any():
                log.append(("masked reset",))
                if dead:  # (a reset of a dead slot fails as a step does: not what this campaign checks)
                    for j in sorted(dead):
                        snap, model = rng.choice(saved)
                        v.restore(j, snap)
                        v.put(j, model)
                    dead.clear()
                    continue
                err = v.step(actions)
                if err:
                    print(f"  {v.name} seed {seed} call {i}: {err}; last calls {log[-12:]}")
                    return bad + 1, crashes
                continue
            timer, late = None, set()  # late: a slot killed while this step may have answered already
            if rng.random() < 0.33:
                victim = rng.randrange(N)
                pid = v.fv.envs[victim].worker_pid
                delay = rng.choice([0.0, rng.uniform(0, 2e-3)])
                log.append(("kill", victim, round(delay * 1e3, 3)))
                if delay == 0.0:
                    kill(pid)
                else:
                    timer = threading.Timer(delay, kill, (pid,))
                    timer.start()
                    late = {victim} - dead
                dead.add(victim)
                crashes += 1
            log.append(("step", actions.tolist()))
            before = [v.saved_of(j) for j in range(N)]
            want = v.ref.step(actions)
            try:
                got, failed = v.fv.step(actions), []
            except WorkerDiedError as e:
                got = getattr(e, "partial_step", None)
                if got is None:
                    print(f"  {v.name} seed {seed} call {i}: WorkerDiedError without partial_step; last calls {log[-12:]}")
                    return bad + 1, crashes
                failed = got[-1]
                if "killed by SIGKILL" not in str(e):  # its parent wrote it down (gym_fork.worker.exits)
                    print(f"  {v.name} seed {seed} call {i}: the error does not say how the worker ended: {e}")
                    return bad + 1, crashes
            finally:
                if timer is not None:
                    timer.join()
            if not set(failed) <= dead or not dead - late <= set(failed):
                print(f"  {v.name} seed {seed} call {i}: slots {failed} failed, killed: {sorted(dead)}; "
                      f"last calls {log[-12:]}")
                return bad + 1, crashes
            fault = row_fault(v, want, got, [j for j in range(N) if j not in failed])
            if fault:
                print(f"  {v.name} seed {seed} call {i}: {fault}; last calls {log[-12:]}")
                return bad + 1, crashes
            for j in failed:  # the model's slot did not step either; the learner restores it
                v.put(j, before[j])
                snap, model = rng.choice(saved)
                v.restore(j, snap)
                v.put(j, model)
                dead.discard(j)
                log.append(("restored", j))
            if timer is not None:
                time.sleep(0.003)  # (a kill that came after the answer: the next step says so)
    finally:
        v.close()
        for snap, _ in saved:
            snap.release()
    deadline = time.monotonic() + 5
    while (left := worker_processes() - others) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        print(f"  {v.name} seed {seed}: worker processes left after close: {sorted(left)}")
        bad += 1
    return bad, crashes


def main() -> int:
    ap = parser(__doc__, seeds="1-3", count="calls", per_seed=150)
    add_api_option(ap)
    args = ap.parse_args()

    def one(api: type, seed: int, mode: AutoresetMode | None) -> tuple[bool, str]:
        bad, n = run(api, seed, args.calls, mode)
        return bad > 0, f"{bad} calls broken, {n} crashes"

    return report(runs_of(args, one))


if __name__ == "__main__":
    sys.exit(main())
