"""What a step, a snapshot and a restore cost the learner: the hot path, side by side with the
natural baselines, against the performance targets.

    .venv/bin/python benchmarks/hot_path.py                    # ~2-3 min on 2 cores
    .venv/bin/python benchmarks/hot_path.py --quick            # smoke run, ~40 s
    .venv/bin/python benchmarks/hot_path.py --json out.json    # numbers to a file as well

Rows (medians of ``--reps`` repetitions, modes interleaved rep by rep so that machine-load drift
hits them alike):

* **step** (CartPole, LunarLander, HalfCheetah): µs per step over pre-drawn random actions
  (reset at episode ends) in-process (``gymnasium.make``), in a ``ForkableEnv`` worker, and in
  SB3's ``SubprocVecEnv`` with one env. The target is on the overhead over in-process.
* **snapshot()+step − step** / **restore()+step − step** (LunarLander): the learner-visible
  cost: the call plus the next step (which waits for work the call deferred), minus the median
  plain step of the same env; fork tier (``fork_tier=True``) and CRIU dumps (``fork_tier=False``).
  Restores are timed twice: after a short idle pause (what a learner that steps in between
  sees) and back to back. A process that slept 30 ms runs its next request cold (on this
  virtual machine a plain step after such a pause costs ~0.7 ms instead of ~0.06), so the ratio
  column also gives the snapshot and the restore minus a plain step taken after the same pause.
  A **search loop** row: ``restore()`` + 5 steps, over and over (tree search: restores milliseconds
  apart, each copy taken while the next ones are being made), minus 5 plain steps.
* **Pong**: ALE's own ``cloneState()`` / ``restoreState()`` in one process vs a fork-tier
  ``restore()`` (+ step − step); 16 closed-loop branches x 100 steps from depth 300: a native
  restore loop in one process (``restoreState`` + 100 ``env.step`` per branch, the policy
  called on every observation) vs ``snapshot()`` + ``gym_fork.explore()``, with the policy in
  the learner (a round trip per step) and inside the branches' workers (``policy_in_worker=True``).
  Pong's floor: the same branches in a process as lean as a worker (no gym_fork code), natively
  and with one bare ``os.fork()`` per branch, all running at once -- the most any fork-based
  ``explore()`` can gain over the native loop on this machine (its CPUs, its page-fault costs).
* **break-even depth** (LunarLander, 16 closed-loop branches x 100 steps): the prefix depth D
  above which branching from a snapshot beats replaying ``reset(seed) + D + 100`` steps per
  branch in process, from the measured costs: D* = (T_branch / 16 - t_reset) / t_step - 100;
  also with the policy inside the workers. Its floor: the same branches from bare ``fork()``s
  of a process as lean as a worker (no gym_fork code), the learner stepping them over sockets in
  ``explore()``'s order (an action byte out, the observation's bytes back), and with the
  branches run inside the children; T_branch and the replay measured in that process -- the
  depth any fork-based ``explore()`` can reach on this machine.
* **ForkableVecEnv(4)** (CartPole): µs per batch step vs ``SubprocVecEnv(4)``.
* **step between policy calls** (CartPole, ``--gap-us`` of learner work, default 300 µs, before
  each step -- an SB3 ``MlpPolicy`` forward pass costs about that here): µs per step, the step
  timed alone. The tight loop above flatters every mode: a process woken after a pause and caches
  cooled by the learner's work cost more than back-to-back steps do, in-process too.
* **PPO learn()** (CartPole, 4096 steps, ``n_steps=512``): the learner's own number, steps per
  second, env in process (``DummyVecEnv``), in a ``ForkableEnv`` and in ``SubprocVecEnv(1)``.
* **the machine's floor** (no gym_fork code): in a process as lean as a worker holding a
  LunarLander env after 100 steps, a bare ``os.fork()``, and the first step after it minus a
  plain step (the copy-on-write faults of the pages that step writes): what any fork-based
  snapshot costs the learner here, before gym_fork does anything. Also a page's first-touch
  fault and copy-on-write fault, and a ``fork()`` of 24 MB of written memory, from a plain
  ``mmap``. On a virtual machine whose guest page tables are shadowed by the hypervisor these
  cost several times what they do on bare metal; the row tells whether a bar below it can be met
  by forking at all on the machine at hand.

Only gym_fork's public API is used, so the same script measures an older checkout too::

    cd OLD && PYTHONPATH=OLD /path/to/.venv/bin/python /path/to/benchmarks/hot_path.py --json old.json

(the env workers import gym_fork from where the controller did). Tables go to stdout, progress to
stderr. Tests never assert these timings.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

# After PYTHONPATH (an older checkout measured with this script keeps its own gym_fork).
sys.path.append(str(Path(__file__).resolve().parent.parent))

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402

import gym_fork  # noqa: E402

SEED = 0
WARM_STEPS = 100
K, H, PONG_DEPTH = 16, 100, 300
PARTS = ("steps", "gap", "snapshot", "floor", "pong", "break_even", "vec", "ppo")
SEARCH_STEPS = 5  # steps per branch in the snapshot part's search loop (restore, 5 steps, restore ...)
SNAPSHOT_WORK_S = 0.001  # the learner's work between a snapshot and the next step, in its row with work


# --- small helpers ---------------------------------------------------------------------------------
def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def progress(msg: str) -> None:
    print(f"[hot_path {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class NoGC:
    """Collect before, keep the collector off while timing."""

    def __enter__(self) -> None:
        gc.collect()
        gc.disable()

    def __exit__(self, *exc: Any) -> None:
        gc.enable()


def make_plain(env_id: str) -> gym.Env:
    if env_id.startswith("ALE/"):
        import ale_py

        gym.register_envs(ale_py)
    return gym.make(env_id)


def forkable(env_id: str, **kw: Any) -> gym_fork.ForkableEnv:
    return gym_fork.ForkableEnv(env_id, backend="criu", **kw)


def actions_for(env_id: str, n: int) -> list:
    space = make_plain(env_id).action_space
    space.seed(SEED)
    return [space.sample() for _ in range(n)]


def warm(env: gym.Env, actions: list, n: int = WARM_STEPS) -> Any:
    obs, _ = env.reset(seed=SEED)
    for a in actions[:n]:
        obs, _, term, trunc, _ = env.step(a)
        if term or trunc:
            obs, _ = env.reset()
    return obs


def step_loop(env: gym.Env, actions: list) -> float:
    """Seconds per step over ``actions`` (reset at episode ends, not timed apart)."""
    step, reset = env.step, env.reset
    with NoGC():
        t0 = time.perf_counter()
        for a in actions:
            _, _, term, trunc, _ = step(a)
            if term or trunc:
                reset()
        dt = time.perf_counter() - t0
    return dt / len(actions)


def sleeps() -> int:
    """How often this thread has gone to sleep so far (its voluntary context switches: each time it
    blocked, e.g. waiting for a reply, and had to be woken)."""
    with open("/proc/thread-self/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    return 0


def vec_loop(venv: Any, batches: list) -> tuple[float, float]:
    """Seconds per batch step of an SB3 VecEnv (it auto-resets), and how often the learner was
    woken per batch step."""
    with NoGC():
        n0 = sleeps()
        t0 = time.perf_counter()
        for b in batches:
            venv.step(b)
        dt = time.perf_counter() - t0
        woken = sleeps() - n0
    return dt / len(batches), woken / len(batches)


def plain_step_s(env: gym.Env, actions: list, n: int = 30) -> float:
    """Median single-step time (a reference for 'minus a plain step')."""
    out = []
    for a in actions[:n]:
        t0 = time.perf_counter()
        _, _, term, trunc, _ = env.step(a)
        out.append(time.perf_counter() - t0)
        if term or trunc:
            env.reset()
    return statistics.median(out)


# --- rows ------------------------------------------------------------------------------------------
def busy_wait(seconds: float) -> None:
    """The learner's work between steps (a policy's forward pass), as a busy loop."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def gap_loop(step: Callable, reset: Callable | None, actions: list, gap_s: float) -> float:
    """Median seconds of one step when ``gap_s`` of learner work comes before each."""
    out = []
    with NoGC():
        for a in actions:
            busy_wait(gap_s)
            t0 = time.perf_counter()
            res = step(a)
            out.append(time.perf_counter() - t0)
            if reset is not None and (res[2] or res[3]):
                reset()
    return statistics.median(out)


def bench_steps(env_id: str, n_steps: int, reps: int, gap_s: float | None = None) -> dict:
    """µs per step in process, in a ForkableEnv and in SubprocVecEnv(1), interleaved rep by rep:
    back to back (``gap_s=None``: seconds per step over the whole loop) or with ``gap_s`` of
    learner work before each step (the median step, timed alone)."""
    from stable_baselines3.common.vec_env import SubprocVecEnv

    acts = actions_for(env_id, n_steps + WARM_STEPS)
    run_acts = acts[WARM_STEPS:]
    inproc = make_plain(env_id)
    fenv = gym_fork.ForkableEnv(env_id)
    sub = SubprocVecEnv([lambda: make_plain(env_id)], start_method="forkserver")
    batches = [np.array([a]) for a in run_acts]
    samples: dict[str, list[float]] = {"inproc": [], "gym_fork": [], "subproc": []}
    try:
        warm(inproc, acts)
        warm(fenv, acts)
        sub.reset()
        vec_loop(sub, batches[:WARM_STEPS])
        for _ in range(reps):
            if gap_s is None:
                samples["inproc"].append(step_loop(inproc, run_acts))
                samples["gym_fork"].append(step_loop(fenv, run_acts))
                samples["subproc"].append(vec_loop(sub, batches)[0])
            else:
                samples["inproc"].append(gap_loop(inproc.step, inproc.reset, run_acts, gap_s))
                samples["gym_fork"].append(gap_loop(fenv.step, fenv.reset, run_acts, gap_s))
                samples["subproc"].append(gap_loop(sub.step, None, batches, gap_s))
    finally:
        fenv.close()
        sub.close()
        inproc.close()
    return {k: {"median_us": med(v) * 1e6, "samples_us": [x * 1e6 for x in v]} for k, v in samples.items()}


def bench_ppo(env_id: str, total: int, reps: int) -> dict:
    """PPO learn() steps per second with the env in process, in a ForkableEnv, in SubprocVecEnv(1)."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    makers = {
        "inproc": lambda: DummyVecEnv([lambda: make_plain(env_id)]),
        "gym_fork": lambda: gym_fork.ForkableEnv(env_id),
        "subproc": lambda: SubprocVecEnv([lambda: make_plain(env_id)], start_method="forkserver"),
    }
    samples: dict[str, list[float]] = {k: [] for k in makers}
    for _ in range(reps):
        for mode, make in makers.items():
            env = make()
            try:
                model = PPO("MlpPolicy", env, n_steps=512, batch_size=64, n_epochs=4, device="cpu", seed=SEED)
                model.learn(512)  # warm: the first rollout and update
                t0 = time.perf_counter()
                model.learn(total, reset_num_timesteps=False)
                samples[mode].append(total / (time.perf_counter() - t0))
            finally:
                env.close()
    return {k: {"median_steps_per_s": med(v), "samples": v} for k, v in samples.items()}


def bench_vec(env_id: str, n_envs: int, n_steps: int, reps: int) -> dict | None:
    from stable_baselines3.common.vec_env import SubprocVecEnv

    try:
        from gym_fork import ForkableVecEnv
    except ImportError:  # sb3 extra missing
        return None
    space = make_plain(env_id).action_space
    space.seed(SEED)
    batches = [np.array([space.sample() for _ in range(n_envs)]) for _ in range(n_steps)]
    fv = ForkableVecEnv(env_id, n_envs=n_envs, backend="criu", seed=SEED)
    sub = SubprocVecEnv([lambda: make_plain(env_id)] * n_envs, start_method="forkserver")
    samples: dict[str, list[float]] = {"gym_fork": [], "subproc": []}
    woken: dict[str, list[float]] = {"gym_fork": [], "subproc": []}
    try:
        fv.reset()
        sub.reset()
        vec_loop(fv, batches[:50])
        vec_loop(sub, batches[:50])
        for _ in range(reps):
            for name, venv in (("gym_fork", fv), ("subproc", sub)):
                t, w = vec_loop(venv, batches)
                samples[name].append(t)
                woken[name].append(w)
    finally:
        fv.close()
        sub.close()
    return {k: {"median_us": med(v) * 1e6, "samples_us": [x * 1e6 for x in v],
                "wake_ups_per_batch": med(woken[k])} for k, v in samples.items()}


def bench_snapshot(env_id: str, fork_tier: bool, reps: int, pause_s: float) -> dict:
    """snapshot()+step and restore()+step, each minus a plain step, in ms."""
    acts = actions_for(env_id, 400)
    env = forkable(env_id, fork_tier=fork_tier)
    snap_s, rest_s, rest_b2b_s, rest_call_s, plain, paused, search_s = [], [], [], [], [], [], []
    snap_call_s, snap_work_s = [], []
    try:
        warm(env, acts)
        it = iter(acts[WARM_STEPS:] * 100)
        for _ in range(reps):
            plain.append(plain_step_s(env, [next(it) for _ in range(10)], 10))
            a = next(it)
            with NoGC():
                t0 = time.perf_counter()
                s = env.snapshot()
                t1 = time.perf_counter()
                env.step(a)
                snap_s.append(time.perf_counter() - t0)
            snap_call_s.append(t1 - t0)
            s.release()
            time.sleep(pause_s)
            # the same with the learner's own work (its policy) between the snapshot and the
            # step, which a fork-tier worker's fork() runs beside: the work's time not counted
            plain_step_s(env, [next(it) for _ in range(10)], 10)
            a = next(it)
            with NoGC():
                t0 = time.perf_counter()
                s = env.snapshot()
                t1 = time.perf_counter()
                busy_wait(SNAPSHOT_WORK_S)
                t2 = time.perf_counter()
                env.step(a)
                snap_work_s.append(time.perf_counter() - t2 + (t1 - t0))
            s.release()
            time.sleep(pause_s)
        root = env.snapshot()
        time.sleep(pause_s)
        for _ in range(reps):  # restores with a pause between (the learner steps meanwhile)
            plain.append(plain_step_s(env, [next(it) for _ in range(10)], 10))
            time.sleep(pause_s)
            with NoGC():  # the same pause before a plain step: what waking up costs by itself
                t0 = time.perf_counter()
                env.step(next(it))
                paused.append(time.perf_counter() - t0)
            plain_step_s(env, [next(it) for _ in range(5)], 5)
            time.sleep(pause_s)
            a = next(it)
            with NoGC():
                t0 = time.perf_counter()
                env.restore(root)
                t1 = time.perf_counter()
                env.step(a)
                rest_s.append(time.perf_counter() - t0)
            rest_call_s.append(t1 - t0)
        time.sleep(pause_s)
        a = acts[WARM_STEPS]
        # back to back, truly: one collection before the loop, none between (a collection before
        # each, as above, put ~10 ms between the restores here -- a pause, not back to back)
        with NoGC():
            for _ in range(reps):
                t0 = time.perf_counter()
                env.restore(root)
                env.step(a)
                rest_b2b_s.append(time.perf_counter() - t0)
        branch = acts[WARM_STEPS:WARM_STEPS + SEARCH_STEPS]
        with NoGC():
            for _ in range(3 * reps):  # a search loop: restore, a few steps, restore again
                t0 = time.perf_counter()
                env.restore(root)
                for b in branch:
                    env.step(b)
                search_s.append(time.perf_counter() - t0)
        root.release()
    finally:
        env.close()
    p = med(plain)
    ms = lambda xs: {"median_ms": (med(xs) - p) * 1e3, "samples_ms": [(x - p) * 1e3 for x in xs]}  # noqa: E731
    return {"plain_step_us": p * 1e6, "paused_step_us": med(paused) * 1e6,
            "snapshot_step": ms(snap_s), "restore_step": ms(rest_s),
            "snapshot_call": {"median_ms": med(snap_call_s) * 1e3},
            "snapshot_work_step": ms(snap_work_s),
            "snapshot_step_minus_paused_step": {"median_ms": (med(snap_s) - med(paused)) * 1e3},
            "restore_step_minus_paused_step": {"median_ms": (med(rest_s) - med(paused)) * 1e3},
            "restore_step_back_to_back": ms(rest_b2b_s),
            "restore_call": {"median_ms": med(rest_call_s) * 1e3},
            "search_loop": {"median_ms": (med(search_s) - SEARCH_STEPS * p) * 1e3,
                            "samples_ms": [(x - SEARCH_STEPS * p) * 1e3 for x in search_s]}}


class Planned:
    """A closed-loop policy that plays pre-drawn actions but looks at every observation (the
    call is what a closed loop costs; the actions are what makes runs comparable)."""

    def __init__(self, branches: list):
        self.branches, self.k, self.calls = branches, len(branches), 0

    def __call__(self, obs: Any) -> Any:
        _ = obs[0]
        i, t = self.calls % self.k, self.calls // self.k
        self.calls += 1
        return self.branches[i][t]


class Replay:
    """:class:`Planned` for one branch, as a policy run inside that branch's worker
    (``explore(..., policy_in_worker=True)``): it too looks at every observation."""

    def __init__(self, actions: list):
        self.actions, self.t = actions, 0

    def __call__(self, obs: Any) -> Any:
        _ = obs[0]
        self.t += 1
        return self.actions[self.t - 1]


def in_worker_supported() -> bool:
    """Whether the gym_fork measured has ``explore(..., policy_in_worker=True)`` (an older
    checkout measured with this script has not: its rows stay empty)."""
    import inspect

    return "policy_in_worker" in inspect.signature(gym_fork.explore).parameters


def explore_in_workers(fenv: Any, snap: Any, branches: list) -> None:
    gym_fork.explore(fenv, snap, [Replay(b) for b in branches], n_branches=len(branches), horizon=H,
                     rng="same", stop_at_done=False, progress=False, policy_in_worker=True)


def bench_pong(reps: int) -> dict:
    env_id = "ALE/Pong-v5"
    rng = np.random.default_rng(1)
    prefix = [int(a) for a in rng.integers(0, 6, PONG_DEPTH)]
    branches = [[int(a) for a in rng.integers(0, 6, H)] for _ in range(K)]
    plain = make_plain(env_id)
    fenv = forkable(env_id, fork_tier=True)
    out: dict = {}
    try:
        obs0 = warm(plain, prefix, PONG_DEPTH)
        warm(fenv, prefix, PONG_DEPTH)
        ale = plain.unwrapped.ale
        clone_t, rest_t = [], []
        for _ in range(max(50, reps * 10)):
            t0 = time.perf_counter()
            st = ale.cloneState()
            t1 = time.perf_counter()
            ale.restoreState(st)
            t2 = time.perf_counter()
            clone_t.append(t1 - t0)
            rest_t.append(t2 - t1)
        out["ale_clone_ms"], out["ale_restore_ms"] = med(clone_t) * 1e3, med(rest_t) * 1e3
        root = fenv.snapshot()
        time.sleep(0.05)
        r_step, r_call, plain_s = [], [], []
        for _ in range(reps):
            plain_s.append(plain_step_s(fenv, prefix[:10], 10))
            time.sleep(0.05)
            with NoGC():
                t0 = time.perf_counter()
                fenv.restore(root)
                t1 = time.perf_counter()
                fenv.step(0)
                r_step.append(time.perf_counter() - t0)
            r_call.append(t1 - t0)
        p = med(plain_s)
        out["restore_step_ms"] = (med(r_step) - p) * 1e3
        out["restore_call_ms"] = med(r_call) * 1e3
        fenv.restore(root)
        root.release()

        def native() -> None:
            pol = Planned(branches)
            for _b in range(K):
                ale.restoreState(st0)
                obs = obs0
                for _t in range(H):
                    obs, _, term, trunc, _ = plain.step(pol(obs))
                    if term or trunc:
                        obs, _ = plain.reset()

        def forked() -> None:
            snap = fenv.snapshot()
            gym_fork.explore(fenv, snap, Planned(branches), n_branches=K, horizon=H, rng="same",
                             stop_at_done=False, progress=False)
            snap.release()

        def forked_in_workers() -> None:
            snap = fenv.snapshot()
            explore_in_workers(fenv, snap, branches)
            snap.release()

        obs0 = warm(plain, prefix, PONG_DEPTH)
        st0 = ale.cloneState()
        nat, frk, frw = [], [], []
        modes = [(native, nat), (forked, frk)] + ([(forked_in_workers, frw)] if in_worker_supported() else [])
        for _ in range(reps):
            for fn, xs in modes:
                with NoGC():
                    t0 = time.perf_counter()
                    fn()
                    xs.append(time.perf_counter() - t0)
        out["native_branches_s"], out["explore_branches_s"] = med(nat), med(frk)
        out["native_samples_s"], out["explore_samples_s"] = nat, frk
        if frw:
            out["explore_in_workers_s"], out["explore_in_workers_samples_s"] = med(frw), frw
    finally:
        fenv.close()
        plain.close()
    out["floor"] = bench_pong_floor(reps, prefix, branches)
    return out


_FLOOR_SCRIPT = r"""
import json, mmap, os, statistics, sys, time
from gym_fork.worker import lean
lean.install()  # as a worker: no pygame
import gymnasium as gym
import numpy as np

reps = int(sys.argv[1])
env = gym.make("LunarLander-v3")
env.reset(seed=0)
env.action_space.seed(0)
acts = [env.action_space.sample() for _ in range(4000)]
it = iter(acts)

def step():
    _, _, term, trunc, _ = env.step(next(it))
    if term or trunc:
        env.reset()

def fork_holder():  # fork() a child that only sleeps, holding the pages shared
    t = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    return time.perf_counter() - t, pid

def end(pid):
    os.kill(pid, 9)
    os.waitpid(pid, 0)

for _ in range(100):
    step()
fork_s, after_s, plain_s = [], [], []
for _ in range(reps * 4):
    for _ in range(10):
        t = time.perf_counter(); step(); plain_s.append(time.perf_counter() - t)
    took, pid = fork_holder()
    fork_s.append(took)
    t = time.perf_counter(); step(); after_s.append(time.perf_counter() - t)
    end(pid)
    time.sleep(0.005)

pages = 6000  # ~24 MB: a LunarLander worker's private memory
first, cow, big = [], [], []
for _ in range(reps):
    m = mmap.mmap(-1, pages * 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, dtype=np.uint8)
    t = time.perf_counter(); a[::4096] = 1; first.append((time.perf_counter() - t) / pages)
    took, pid = fork_holder()
    big.append(took)
    t = time.perf_counter(); a[::4096] = 2; cow.append((time.perf_counter() - t) / pages)
    end(pid)
    del a
    m.close()
med = statistics.median
print(json.dumps({"fork_ms": med(fork_s) * 1e3, "first_step_after_fork_minus_step_ms": (med(after_s) - med(plain_s)) * 1e3,
                  "plain_step_us": med(plain_s) * 1e6, "first_touch_fault_us": med(first) * 1e6,
                  "cow_fault_us": med(cow) * 1e6, "fork_24mb_ms": med(big) * 1e3}))
"""


_PONG_FLOOR_SCRIPT = r"""
import json, os, statistics, sys, time
from gym_fork.worker import lean
lean.install()  # as a worker
import ale_py
import gymnasium as gym

gym.register_envs(ale_py)
reps, prefix, branches = int(sys.argv[1]), *json.loads(sys.argv[2])
env = gym.make("ALE/Pong-v5")
obs0, _ = env.reset(seed=0)
for a in prefix:
    obs0, *_ = env.step(a)
ale = env.unwrapped.ale
st0 = ale.cloneState()

def branch(actions, obs):
    for a in actions:
        _ = obs[0]  # a policy looks at every observation
        obs, _, term, trunc, _ = env.step(a)
        if term or trunc:
            obs, _ = env.reset()

def native():  # one process: restoreState, then the branch
    for actions in branches:
        ale.restoreState(st0)
        branch(actions, obs0)

def forked():  # a bare fork() per branch, all running at once; the parent waits for them all
    pids = []
    for actions in branches:
        pid = os.fork()
        if pid == 0:
            branch(actions, obs0)
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)

nat, frk = [], []
for _ in range(reps):
    for fn, xs in ((native, nat), (forked, frk)):
        t = time.perf_counter(); fn(); xs.append(time.perf_counter() - t)
med = statistics.median
print(json.dumps({"native_s": med(nat), "forked_s": med(frk), "native_samples_s": nat, "forked_samples_s": frk}))
"""


# The break-even's floor: the same branches from bare fork()s of a process as lean as a worker (no
# gym_fork), the policy in the learner (one round trip per step over a socket, in the same order
# as explore()'s pipelined loop), and with the policy in the children (no round trips); and the
# replay it is weighed against, in the same process.
_BREAK_EVEN_FLOOR_SCRIPT = r"""
import json, os, socket, statistics, sys, time
from gym_fork.worker import lean
lean.install()  # as a worker
import gc
import numpy as np
import gymnasium as gym

reps, warm_steps, seed, prefix, branches = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *json.loads(sys.argv[4])
env = gym.make("LunarLander-v3")
env.reset(seed=seed)
for a in prefix[:warm_steps]:
    _, _, term, trunc, _ = env.step(a)
    if term or trunc:
        env.reset()

def serve(sock):  # a bare worker: an action byte in, the observation's bytes out
    while True:
        d = sock.recv(8)
        if not d:
            os._exit(0)
        obs, _, term, trunc, _ = env.step(d[0])
        if term or trunc:
            obs, _ = env.reset()
        sock.sendall(obs.tobytes())

def in_learner():
    socks, pids = [], []
    for _b in branches:
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            ours.close()
            serve(theirs)
        theirs.close(); socks.append(ours); pids.append(pid)
    for s, b in zip(socks, branches):
        s.sendall(bytes([b[0]]))
    for t in range(1, len(branches[0]) + 1):
        for s, b in zip(socks, branches):
            obs = np.frombuffer(s.recv(4096), np.float32)
            _ = obs[0]  # a policy looks at every observation
            if t < len(b):
                s.sendall(bytes([b[t]]))
    for s in socks:
        s.close()
    for pid in pids:
        os.waitpid(pid, 0)

def in_children():
    pids = []
    for b in branches:
        pid = os.fork()
        if pid == 0:
            for a in b:
                obs, _, term, trunc, _ = env.step(a)
                _ = obs[0]
                if term or trunc:
                    env.reset()
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)

gc.disable()
learner_t, children_t = [], []
for _ in range(reps):
    for fn, xs in ((in_learner, learner_t), (in_children, children_t)):
        t = time.perf_counter(); fn(); xs.append(time.perf_counter() - t)
replay = gym.make("LunarLander-v3")
reset_t, step_t = [], []
for _ in range(reps):
    t0 = time.perf_counter(); replay.reset(seed=seed); t1 = time.perf_counter()
    for a in prefix:
        obs, _, term, trunc, _ = replay.step(a)
        _ = obs[0]
        if term or trunc:
            replay.reset()
    reset_t.append(t1 - t0); step_t.append((time.perf_counter() - t1) / len(prefix))
med = statistics.median
print(json.dumps({"in_learner_s": med(learner_t), "in_children_s": med(children_t), "reset_ms": med(reset_t) * 1e3,
                  "inproc_step_us": med(step_t) * 1e6}))
"""


def bench_break_even_floor(reps: int, prefix: list, branches: list) -> dict:
    """The break-even depth's floor on this machine, without gym_fork (see the module docstring)."""
    out = subprocess.run([sys.executable, "-c", _BREAK_EVEN_FLOOR_SCRIPT, str(reps), str(WARM_STEPS), str(SEED),
                          json.dumps([prefix, branches])], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    if out.returncode != 0:
        raise RuntimeError(f"the break-even floor measurement failed:\n{out.stderr[-2000:]}")
    fl = json.loads(out.stdout.strip().splitlines()[-1])
    k, h, tr, ts = len(branches), len(branches[0]), fl["reset_ms"] / 1e3, fl["inproc_step_us"] / 1e6
    fl["depth_in_learner"] = (fl["in_learner_s"] / k - tr) / ts - h
    fl["depth_in_children"] = (fl["in_children_s"] / k - tr) / ts - h
    return fl


def bench_pong_floor(reps: int, prefix: list, branches: list) -> dict:
    """Pong's ceiling for fork-based branching on this machine, without gym_fork: in a process as
    lean as a worker, the native restore loop vs one bare ``fork()`` per branch (see the module
    docstring)."""
    out = subprocess.run([sys.executable, "-c", _PONG_FLOOR_SCRIPT, str(reps), json.dumps([prefix, branches])],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    if out.returncode != 0:
        raise RuntimeError(f"the Pong floor measurement failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_floor(reps: int) -> dict:
    """What forking costs on this machine, without gym_fork: see the module docstring."""
    out = subprocess.run([sys.executable, "-c", _FLOOR_SCRIPT, str(reps)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    if out.returncode != 0:
        raise RuntimeError(f"the floor measurement failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_break_even(reps: int) -> dict:
    env_id = "LunarLander-v3"
    rng = np.random.default_rng(2)
    prefix = [int(a) for a in rng.integers(0, 4, 1000)]
    branches = [[int(a) for a in rng.integers(0, 4, H)] for _ in range(K)]
    plain = make_plain(env_id)
    fenv = forkable(env_id, fork_tier=True)
    try:
        warm(fenv, prefix, WARM_STEPS)
        branch_t, branch_w = [], []
        for _ in range(reps):
            with NoGC():
                t0 = time.perf_counter()
                snap = fenv.snapshot()
                gym_fork.explore(fenv, snap, Planned(branches), n_branches=K, horizon=H, rng="same",
                                 stop_at_done=False, progress=False)
                branch_t.append(time.perf_counter() - t0)
            snap.release()
            if in_worker_supported():
                with NoGC():
                    t0 = time.perf_counter()
                    snap = fenv.snapshot()
                    explore_in_workers(fenv, snap, branches)
                    branch_w.append(time.perf_counter() - t0)
                snap.release()
        reset_t, step_t = [], []
        for _ in range(reps):
            with NoGC():
                t0 = time.perf_counter()
                plain.reset(seed=SEED)
                t1 = time.perf_counter()
                pol = Planned([prefix])
                obs = None
                for _i in range(len(prefix)):
                    obs, _, term, trunc, _ = plain.step(pol(obs if obs is not None else [0]))
                    if term or trunc:
                        obs, _ = plain.reset()
                t2 = time.perf_counter()
            reset_t.append(t1 - t0)
            step_t.append((t2 - t1) / len(prefix))
    finally:
        fenv.close()
        plain.close()
    tb, tr, ts = med(branch_t), med(reset_t), med(step_t)
    depth = (tb / K - tr) / ts - H
    out = {"branch_s": tb, "reset_ms": tr * 1e3, "inproc_step_us": ts * 1e6, "break_even_depth": depth,
           "branch_samples_s": branch_t, "floor": bench_break_even_floor(reps, prefix, branches)}
    if branch_w:
        out["branch_in_workers_s"] = med(branch_w)
        out["break_even_depth_in_workers"] = (med(branch_w) / K - tr) / ts - H
        out["branch_in_workers_samples_s"] = branch_w
    return out


# --- table -----------------------------------------------------------------------------------------
def us(x: float | None) -> str:
    return "—" if x is None else f"{x:.0f} µs"


def ms(x: float | None) -> str:
    return "—" if x is None else (f"{x:.2f} ms" if abs(x) < 10 else f"{x:.0f} ms")


def rx(a: float | None, b: float | None) -> str:
    return "—" if a is None or b is None or b == 0 else f"{a / b:.2f}×"


def verdict(ok: bool | None) -> str:
    return "—" if ok is None else ("yes" if ok else "no")


def table(r: dict) -> list[list[str]]:
    rows = []
    for env_id, name in (("CartPole-v1", "CartPole"), ("LunarLander-v3", "LunarLander"),
                         ("HalfCheetah-v5", "HalfCheetah")):
        s = r["steps"].get(env_id)
        if not s:
            continue
        i, g, p = s["inproc"]["median_us"], s["gym_fork"]["median_us"], s["subproc"]["median_us"]
        rows.append([f"{name} step", us(i), us(g), us(p),
                     f"{rx(g, i)} in-proc, {rx(g, p)} Subproc; +{g - i:.0f} µs",
                     "overhead ≤ 40 µs", "≤ 15 µs", verdict(g - i <= 40)])
    for tier, label, bar, head in (("fork", "fork tier", 1.0, 0.3), ("criu", "CRIU dump", 50.0, 25.0)):
        s = r["snapshot"].get(tier)
        if not s:
            continue
        x = s["snapshot_step"]["median_ms"]
        xp = s.get("snapshot_step_minus_paused_step", {}).get("median_ms")
        call, work = s.get("snapshot_call"), s.get("snapshot_work_step")
        rows.append([f"LunarLander snapshot()+step − step, {label}", "—", ms(x), "—",
                     "; ".join(["—" if xp is None else f"{ms(xp)} minus a step after the same pause"]
                               + ([f"the call alone {ms(call['median_ms'])}"] if call else [])
                               + ([f"with {SNAPSHOT_WORK_S * 1e3:g} ms of the learner's work before the step "
                                   f"(not counted) {ms(work['median_ms'])}"] if work else [])),
                     f"≤ {bar:g} ms", f"≤ {head:g} ms", verdict(x <= bar)])
    for tier, label, bar, head in (("fork", "fork tier", 1.0, 0.3), ("criu", "CRIU", 50.0, 25.0)):
        s = r["snapshot"].get(tier)
        if not s:
            continue
        x, b2b = s["restore_step"]["median_ms"], s["restore_step_back_to_back"]["median_ms"]
        xp = s.get("restore_step_minus_paused_step", {}).get("median_ms")
        rows.append([f"LunarLander restore()+step − step, {label}", "—",
                     f"{ms(x)} (back to back {ms(b2b)})", "—",
                     "—" if xp is None else f"{ms(xp)} minus a step after the same pause",
                     f"≤ {bar:g} ms", f"≤ {head:g} ms", verdict(max(x, b2b) <= bar)])
        sl = s.get("search_loop")
        if sl:
            rows.append([f"LunarLander in a search loop (restore() + {SEARCH_STEPS} steps, again and again) "
                         f"− {SEARCH_STEPS} steps, {label}", "—", ms(sl["median_ms"]), "—", "—",
                         f"≤ {bar:g} ms", f"≤ {head:g} ms", verdict(sl["median_ms"] <= bar)])
    pg = r.get("pong")
    if pg:
        rows.append(["Pong: ALE cloneState / restoreState vs gym_fork restore()+step − step",
                     f"{pg['ale_clone_ms']:.2f} / {pg['ale_restore_ms']:.2f} ms", ms(pg["restore_step_ms"]), "—",
                     f"{rx(pg['restore_step_ms'], pg['ale_restore_ms'])} restoreState",
                     "≤ 1 ms", "≤ 0.3 ms", verdict(pg["restore_step_ms"] <= 1.0)])
        n, e = pg["native_branches_s"], pg["explore_branches_s"]
        rows.append([f"Pong: {K} closed-loop branches x {H} steps from depth {PONG_DEPTH}",
                     f"native restore loop {n:.2f} s", f"explore() {e:.2f} s", "—",
                     f"{n / e:.2f}× faster than native", "≥ 1.5× faster", "—", verdict(n / e >= 1.5)])
        w = pg.get("explore_in_workers_s")
        if w:
            rows.append(["Pong: the same, the policy in the workers (policy_in_worker=True)",
                         f"native restore loop {n:.2f} s", f"explore() {w:.2f} s", "—",
                         f"{n / w:.2f}× faster than native", "≥ 1.5× faster", "—", verdict(n / w >= 1.5)])
        pf = pg.get("floor")
        if pf:
            ceiling = pf["native_s"] / pf["forked_s"]
            best = n / min(e, w or e)
            rows.append([f"Pong's floor: the same {K} branches, one bare fork() each, no gym_fork (vs the faster "
                         "explore() above)", f"native restore loop {pf['native_s']:.2f} s",
                         f"bare forks {pf['forked_s']:.2f} s", "—",
                         f"ceiling {ceiling:.2f}× faster than native; explore() reaches {best / ceiling:.0%} of it",
                         "≥ 1.5× faster", "—", "reachable by fork" if ceiling >= 1.5 else "not by fork here"])
    be = r.get("break_even")
    if be:
        d = be["break_even_depth"]
        rows.append([f"Break-even depth vs replay from reset (LunarLander, {K} x {H}, closed loop)", "—",
                     f"{max(d, 0):.0f} steps", "—",
                     f"branching {be['branch_s']:.2f} s; in-proc step {be['inproc_step_us']:.0f} µs",
                     "≤ 100 steps", "≤ 20 steps", verdict(d <= 100)])
        dw = be.get("break_even_depth_in_workers")
        if dw is not None:
            rows.append(["Break-even depth, the policy in the workers (policy_in_worker=True)", "—",
                         f"{max(dw, 0):.0f} steps", "—", f"branching {be['branch_in_workers_s']:.2f} s",
                         "≤ 100 steps", "≤ 20 steps", verdict(dw <= 100)])
        bf = be.get("floor")
        if bf:
            d_floor = bf["depth_in_learner"]
            rows.append([f"Break-even's floor: the same {K} branches from bare fork()s, no gym_fork (policy in the "
                         "learner, one round trip a step; in the children)", "—",
                         f"{max(d_floor, 0):.0f} steps; {max(bf['depth_in_children'], 0):.0f} steps", "—",
                         f"branching {bf['in_learner_s']:.2f} s / {bf['in_children_s']:.2f} s; in-proc step "
                         f"{bf['inproc_step_us']:.0f} µs; gym_fork's {max(d, 0):.0f} steps are "
                         f"{(d + H) / (d_floor + H):.2f}× the floor's branch cost", "≤ 100 steps", "—",
                         "reachable by fork" if d_floor <= 100 else "not by fork here"])
    gs = r.get("gap_steps")
    if gs:
        i, g, p = gs["inproc"]["median_us"], gs["gym_fork"]["median_us"], gs["subproc"]["median_us"]
        rows.append([f"CartPole step after {r['gap_us']:.0f} µs of learner work", us(i), us(g), us(p),
                     f"{rx(g, i)} in-proc, {rx(g, p)} Subproc; +{g - i:.0f} µs",
                     "overhead ≤ 40 µs", "≤ 15 µs", verdict(g - i <= 40)])
    pp = r.get("ppo")
    if pp:
        i, g, p = (pp[k]["median_steps_per_s"] for k in ("inproc", "gym_fork", "subproc"))
        rows.append(["PPO CartPole learn(), steps/s", f"{i:.0f}", f"{g:.0f}", f"{p:.0f}",
                     f"{rx(g, i)} in-proc, {rx(g, p)} Subproc", "—", "—", "—"])
    fl = r.get("floor")
    if fl:
        floor = fl["fork_ms"] + fl["first_step_after_fork_minus_step_ms"]
        snap = r["snapshot"].get("fork", {}).get("snapshot_step", {}).get("median_ms")
        rows.append(["The machine's floor: fork() of a LunarLander process + its next step's copy-on-write "
                     "faults, no gym_fork (vs the fork-tier snapshot()+step − step)",
                     f"{ms(floor)} (fork {ms(fl['fork_ms'])} + faults {ms(fl['first_step_after_fork_minus_step_ms'])})",
                     ms(snap), "—",
                     (f"{rx(snap, floor)} the floor; " if snap else "")
                     + f"per page: first touch {fl['first_touch_fault_us']:.1f} µs, copy-on-write "
                     f"{fl['cow_fault_us']:.1f} µs; fork() of 24 MB {ms(fl['fork_24mb_ms'])}",
                     "≤ 1 ms (the fork-tier bars)", "—",
                     "reachable by fork" if floor <= 1.0 else "not by fork here"])
    v = r.get("vec")
    if v:
        g, p = v["gym_fork"]["median_us"], v["subproc"]["median_us"]
        wg, wp = v["gym_fork"].get("wake_ups_per_batch"), v["subproc"].get("wake_ups_per_batch")
        woken = "" if wg is None else f"; learner woken {wg:.2f} times a batch (Subproc {wp:.2f})"
        rows.append([f"CartPole ForkableVecEnv({r['vec_n']}) batch step", "—", us(g), us(p) + f" ({r['vec_n']})",
                     f"{rx(g, p)} Subproc" + woken, "one wake-up per batch", "—",
                     "—" if wg is None else verdict(wg <= 1.0)])
    return rows


def print_md(rows: list[list[str]]) -> None:
    head = ["work", "in-process / native", "gym_fork", "SB3 SubprocVecEnv(1)", "ratio",
            "target (bar)", "target (heading)", "meets bar"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def code_version() -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(gym_fork.__file__)))
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", root, "status", "--porcelain", "gym_fork"], capture_output=True,
                                    text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", False
    return {"gym_fork": gym_fork.__file__, "commit": commit, "dirty": dirty}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and repetitions (~40 s)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per cell (default 7, quick 3)")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts: {','.join(PARTS)}")
    ap.add_argument("--gap-us", type=float, default=300.0,
                    help="learner work before each step in the 'gap' part, µs (default 300)")
    ap.add_argument("--json", dest="json_path", default=None, help="write all numbers to this file")
    args = ap.parse_args(argv)
    reps = args.reps or (3 if args.quick else 7)
    n_steps = 300 if args.quick else 2000
    parts = {p.strip() for p in args.only.split(",") if p.strip()}
    unknown = parts - set(PARTS)
    if unknown or not parts:
        ap.error(f"--only: unknown part(s) {', '.join(sorted(unknown)) or '(none given)'}; "
                 f"choose from {','.join(PARTS)}")
    r: dict = {"version": code_version(), "reps": reps, "n_steps": n_steps, "quick": args.quick,
               "loadavg_start": list(os.getloadavg()), "steps": {}, "snapshot": {}}
    progress(f"gym_fork from {r['version']['gym_fork']} ({r['version']['commit']}"
             f"{', dirty' if r['version']['dirty'] else ''})")
    if "steps" in parts:
        for env_id in ("CartPole-v1", "LunarLander-v3", "HalfCheetah-v5"):
            progress(f"steps {env_id}")
            r["steps"][env_id] = bench_steps(env_id, n_steps, reps)
    if "gap" in parts:
        progress(f"steps CartPole-v1 after {args.gap_us:.0f} µs of learner work")
        r["gap_us"] = args.gap_us
        r["gap_steps"] = bench_steps("CartPole-v1", n_steps // 2, reps, args.gap_us * 1e-6)
    if "snapshot" in parts:
        for tier, ft in (("fork", True), ("criu", False)):
            progress(f"snapshot/restore LunarLander, {tier}")
            r["snapshot"][tier] = bench_snapshot("LunarLander-v3", ft, reps * (2 if ft else 1), 0.03)
    if "floor" in parts:
        progress("the machine's floor: fork() and page faults, without gym_fork")
        r["floor"] = bench_floor(reps)
    if "pong" in parts:
        progress("Pong")
        r["pong"] = bench_pong(max(3, reps // 2) if args.quick else reps)
    if "break_even" in parts:
        progress("break-even LunarLander")
        r["break_even"] = bench_break_even(reps)
    if "vec" in parts:
        progress("ForkableVecEnv")
        r["vec_n"] = 4
        r["vec"] = bench_vec("CartPole-v1", 4, n_steps // 2, reps)
    if "ppo" in parts:
        progress("PPO CartPole learn()")
        r["ppo"] = bench_ppo("CartPole-v1", 1024 if args.quick else 4096, max(3, reps // 2))
    r["loadavg_end"] = list(os.getloadavg())
    print_md(table(r))
    print(f"\nmedians of {reps} repetitions; load average {r['loadavg_start'][0]:.2f} -> "
          f"{r['loadavg_end'][0]:.2f} on {os.cpu_count()} CPUs; gym_fork {r['version']['commit']}"
          f"{' (dirty)' if r['version']['dirty'] else ''}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(r, f, indent=1)
        progress(f"wrote {args.json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
