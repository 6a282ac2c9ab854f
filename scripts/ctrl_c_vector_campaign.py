"""Ctrl-C (SIGINT) at random moments of a vector env's snapshot(), restore() and fork_into(),
checked against an in-process model of every slot.

Both vector APIs: Gymnasium's ``ForkableVectorEnv`` (against ``SyncVectorEnv``, in each autoreset
mode) and SB3's ``ForkableVecEnv`` (against ``DummyVecEnv``), 3 CartPole slots whose episodes end
every 12 steps. Random steps run whole; snapshots, restores and fork_into()s get a SIGINT
0.05-30 ms in (log-uniform), half of them. After an interrupted restore or fork_into() each target
slot must be whole: its worker holds either its old state or the snapshot's, and the vector env's
own record of the slot (its observation, whether its episode ended) says the same. Every later
step must then match the model, bit for bit. Every 25 calls the snapshots are released, each slot
answers one request (a replaced worker is told to end along with it), and within 5 s no worker
process may be left but the slots' own. Prints what broke that and
``(bad, interrupted)`` per seed and API.

    .venv/bin/python scripts/ctrl_c_vector_campaign.py --seeds 1-4 --calls 120
"""

from __future__ import annotations

import copy
import functools
import random
import sys
import time
import warnings
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from gym_fork.testing.campaigns import parse_seeds, parser, report, worker_processes
from gym_fork.testing.interrupts import interrupt_after
from gym_fork.vector import ForkableVectorEnv

N = 3


def make() -> gym.Env:
    return gym.make("CartPole-v1", max_episode_steps=12)


def worker_state(env: Any) -> tuple:
    """What a slot's worker holds: CartPole's state and the step count of its TimeLimit."""
    return np.asarray(env.get_wrapper_attr("state")).tobytes(), env.get_wrapper_attr("_elapsed_steps")


def model_state(env: gym.Env) -> tuple:
    return np.asarray(env.unwrapped.state).tobytes(), env.get_wrapper_attr("_elapsed_steps")


class Gymnasium:
    """ForkableVectorEnv and its model, SyncVectorEnv with deep-copied sub-envs."""

    def __init__(self, seed: int, mode: AutoresetMode):
        self.mode = mode
        self.name = f"ForkableVectorEnv {mode.name}"
        self.ref = SyncVectorEnv([make] * N, autoreset_mode=mode)
        self.fv = ForkableVectorEnv([make] * N, autoreset_mode=mode)
        self.ref.reset(seed=seed)
        self.fv.reset(seed=seed)

    def step(self, actions: np.ndarray) -> str | None:
        ref, fv = self.ref, self.fv
        if self.mode == AutoresetMode.DISABLED and ref._autoreset_envs.any():
            mask = ref._autoreset_envs.copy()
            want, got = ref.reset(options={"reset_mask": mask})[0], fv.reset(options={"reset_mask": mask})[0]
            return None if np.array_equal(want, got) else "a masked reset differs from the model's"
        want, got = ref.step(actions), fv.step(actions)
        for k in range(4):
            if not np.array_equal(np.asarray(want[k]), np.asarray(got[k])):
                return f"a step's field {k} differs from the model's: {got[k]} for {want[k]}"
        return None

    def saved_of(self, j: int) -> tuple:
        """The model's slot ``j``: (sub-env copy, episode ended, observation)."""
        pending = bool(self.ref._autoreset_envs[j]) and self.mode != AutoresetMode.SAME_STEP
        return copy.deepcopy(self.ref.envs[j]), pending, self.ref._env_obs[j].copy()

    def put(self, j: int, model: tuple) -> None:
        env, pending, obs = model
        self.ref.envs[j] = copy.deepcopy(env)
        self.ref._autoreset_envs[j] = pending
        self.ref._env_obs[j] = obs
        self.ref._observations[j] = obs

    def record(self, j: int) -> tuple:
        """The vector env's own record of slot ``j``: (episode ended, observation)."""
        pending = bool(self.fv._autoreset_envs[j]) and self.mode != AutoresetMode.SAME_STEP
        return pending, self.fv._env_obs[j].tobytes()

    def restore(self, j: int, snap: Any) -> None:
        self.fv.restore(j, snap)

    def fork_into(self, snap: Any, slots: list[int], rng: str, seeds: list[int]) -> None:
        self.fv.fork_into(snap, slots, rng=rng, seeds=seeds if rng == "reseed" else None)

    def close(self) -> None:
        self.fv.close()
        self.ref.close()


class SB3(Gymnasium):
    """ForkableVecEnv and its model, DummyVecEnv with deep-copied sub-envs."""

    def __init__(self, seed: int, mode: AutoresetMode | None = None):
        from stable_baselines3.common.vec_env import DummyVecEnv  # (here: the Gymnasium runs need no SB3)

        from gym_fork.vec_env import ForkableVecEnv

        self.name = "ForkableVecEnv"
        self.ref = DummyVecEnv([make] * N)
        self.fv = ForkableVecEnv(make, n_envs=N)
        self.ref.seed(seed)
        self.fv.seed(seed)
        self.ref.reset()
        self.fv.reset()

    def step(self, actions: np.ndarray) -> str | None:
        want, got = self.ref.step(actions), self.fv.step(actions)
        for k in range(3):
            if not np.array_equal(np.asarray(want[k]), np.asarray(got[k])):
                return f"a step's field {k} differs from the model's: {got[k]} for {want[k]}"
        return None

    def saved_of(self, j: int) -> tuple:
        return copy.deepcopy(self.ref.envs[j]), False, self.ref.buf_obs[None][j].copy()

    def put(self, j: int, model: tuple) -> None:
        env, _pending, obs = model
        self.ref.envs[j] = copy.deepcopy(env)
        self.ref.buf_obs[None][j] = obs

    def record(self, j: int) -> tuple:
        return False, np.asarray(self.fv._obs[j]).tobytes()


def run(api: type, seed: int, calls: int, mode: AutoresetMode | None, interrupts: bool = True) -> tuple[int, int]:
    rng = random.Random(seed)
    others = worker_processes()  # (others', e.g. a test's: not this run's to end)
    v = api(seed, mode)
    saved: list = []  # (snapshot, the model's slot when it was taken)
    bad = interrupted = 0
    log: list = []

    def take_rng(j: int) -> bool:
        """The model's slot ``j`` draws from the generator its worker's env holds (after a
        reseed); whether that was another than the model's."""
        got = copy.deepcopy(v.fv.envs[j].get_wrapper_attr("np_random"))  # (a local copy, not the live reference)
        differs = got.bit_generator.state != v.ref.envs[j].unwrapped.np_random.bit_generator.state
        v.ref.envs[j].unwrapped._np_random = got
        return differs

    def whole(j: int, old: tuple, new: tuple, reseed: bool) -> str | None:
        """Check slot ``j`` after an interrupted restore of ``new`` over ``old`` (model slots);
        the model takes whichever the worker holds. (The two may share CartPole's state and
        differ in the generator only: a restore over a fork_into's reseeded copy.)"""
        held = worker_state(v.fv.envs[j])
        held_rng = v.fv.envs[j].get_wrapper_attr("np_random").bit_generator.state
        record = v.record(j)
        for name, model in (("its old state", old), ("the snapshot", new)):
            if held != model_state(model[0]):
                continue
            same_rng = held_rng == model[0].unwrapped.np_random.bit_generator.state
            if model is old and not same_rng:
                continue
            if record != (model[1], model[2].tobytes()):
                return (f"slot {j}'s worker holds {name}, but the vector env's record of the slot "
                        f"(episode ended {record[0]}, observation {np.frombuffer(record[1], np.float32)}) "
                        f"is not that state's (ended {model[1]}, observation {model[2]})")
            v.put(j, model)
            if model is new and reseed and not take_rng(j):
                return f"slot {j}'s worker holds the snapshot, not reseeded"
            if model is new and not reseed and not same_rng:
                return f"slot {j}'s worker holds the snapshot's state with another generator"
            return None
        return f"slot {j}'s worker holds neither its old state nor the snapshot's"

    try:
        for i in range(calls):
            r = rng.random()
            if r < 0.5 or not saved and r >= 0.65:
                actions = np.array([rng.randrange(2) for _ in range(N)])
                log.append(("step", actions.tolist()))
                err = v.step(actions)
                if err:
                    print(f"  {v.name} seed {seed} call {i}: {err}; last calls {log[-12:]}")
                    return bad + 1, interrupted
                continue
            delay = float(np.exp(rng.uniform(np.log(5e-5), np.log(3e-2)))) if rng.random() < 0.5 and interrupts else 0.0
            # (everything the checks need is made before the SIGINT can come)
            if r < 0.65:
                j = rng.randrange(N)
                log.append(("snapshot", j, delay))
                model, soon = v.saved_of(j), rng.choice([None, True, False])
            elif r < 0.85:
                j, (snap, model) = rng.randrange(N), rng.choice(saved)
                log.append(("restore", j, delay))
                old = {j: v.saved_of(j)}
            else:
                (snap, model), how = rng.choice(saved), rng.choice(["same", "same", "reseed"])
                slots = rng.sample(range(N), rng.randrange(1, N + 1))
                seeds = [rng.randrange(2**31) for _ in slots]  # (new ones: a reseed gives what its seed says)
                log.append(("fork_into", slots, how, delay))
                old = {j: v.saved_of(j) for j in slots}
            try:
                with interrupt_after(delay, sigint=True):
                    if r < 0.65:
                        saved.append((v.fv.snapshot(j, restore_soon=soon), model))
                    elif r < 0.85:
                        v.restore(j, snap)
                    else:
                        v.fork_into(snap, slots, how, seeds)
                    time.sleep(0.03)  # (a SIGINT due after the call lands here, not in the checks)
            except KeyboardInterrupt:
                interrupted += 1
                if log[-1][0] != "snapshot":
                    for j in old:
                        err = whole(j, old[j], model, log[-1][0] == "fork_into" and log[-1][2] == "reseed")
                        if err:
                            bad += 1
                            print(f"  {v.name} seed {seed} call {i}: {err}; last calls {log[-12:]}")
                            return bad, interrupted
            else:
                for j in old if r >= 0.65 else ():
                    v.put(j, model)
                    if r >= 0.85 and how == "reseed" and not take_rng(j):
                        print(f"  {v.name} seed {seed} call {i}: slot {j} was not reseeded")
                        return bad + 1, interrupted
            if i % 25 == 24:
                for snap, _ in saved:
                    snap.release()
                saved.clear()
                for e in v.fv.envs:  # (a replaced worker is told to end with its slot's next request)
                    e.get_wrapper_attr("_elapsed_steps")
                own = {e.worker_pid for e in v.fv.envs} | others
                deadline = time.monotonic() + 5
                while (left := worker_processes() - own) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if left:
                    print(f"  {v.name} seed {seed} call {i}: worker processes left: {sorted(left)}; "
                          f"last calls {log[-12:]}")
                    return bad + 1, interrupted
    finally:
        v.close()
    return bad, interrupted


def add_api_option(ap: Any) -> None:
    ap.add_argument("--api", choices=["gymnasium", "sb3", "both"], default="both", help="which vector API (default: both)")


def runs_of(args: Any, one: Any) -> Any:
    """``(name, run)`` per seed of ``args.seeds`` and per vector API of ``args.api`` (Gymnasium's in
    each autoreset mode): ``one(api, seed, mode)`` runs it. Silences Gymnasium's "step() after
    terminated" warnings: the model steps the same."""
    warnings.simplefilter("ignore")
    apis = ([(Gymnasium, m) for m in AutoresetMode] if args.api != "sb3" else []) + (
        [(SB3, None)] if args.api != "gymnasium" else [])
    return ((f"seed {seed} {api.__name__}" + (f" {mode.name}" if mode else ""), functools.partial(one, api, seed, mode))
            for seed in parse_seeds(args.seeds) for api, mode in apis)


def main() -> int:
    ap = parser(__doc__, seeds="1-3", count="calls", per_seed=100)
    ap.add_argument("--no-interrupts", action="store_true",
                    help="the same calls, no SIGINT: a control run, for what the interrupts alone break")
    add_api_option(ap)
    args = ap.parse_args()

    def one(api: type, seed: int, mode: AutoresetMode | None) -> tuple[bool, str]:
        bad, n = run(api, seed, args.calls, mode, not args.no_interrupts)
        return bad > 0, f"{bad} calls broken, {n} interrupted"

    return report(runs_of(args, one))


if __name__ == "__main__":
    sys.exit(main())
