"""Branch exploration inside Stable-Baselines3 training: :class:`BranchExplorationCallback`.

At a *fork point* the callback snapshots one training env slot of a
:class:`~gym_fork.vec_env.ForkableVecEnv`, runs ``n_branches`` branches of ``horizon`` steps
from it with the current (stochastic) policy, in parallel (:func:`gym_fork.explore`), and then:

* ``mode="buffer"`` (off-policy: DQN, SAC, TD3): every branch transition goes into
  ``model.replay_buffer``;
* ``mode="return_to_best"`` (any algorithm): the slot jumps to the end state of the best branch;
* ``mode="evaluate"`` (any algorithm): nothing changes; the branches' discounted returns are
  logged against the critic's value at the fork point (a calibration diagnostic).

Needs ``stable-baselines3`` (``pip install gym_fork[sb3]``).
"""

from __future__ import annotations

import contextlib
import copy
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Literal

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.off_policy_algorithm import OffPolicyAlgorithm
from stable_baselines3.common.vec_env import VecCheckNan, VecEnvWrapper, VecMonitor, VecNormalize
from stable_baselines3.common.vec_env import VecTransposeImage

from gym_fork.exploration import ExploreResult, explore
from gym_fork.env import ForkableEnv
from gym_fork.vec_env import ForkableVecEnv

Mode = Literal["buffer", "return_to_best", "evaluate"]
WhenPredicate = Callable[[Any, dict, dict], bool]
_MODES = ("buffer", "return_to_best", "evaluate")
# VecEnv wrappers the callback sees through: they leave observations alone, or (VecTransposeImage)
# change them in a way that is applied to the branch observations too.
_PASSTHROUGH = (VecMonitor, VecCheckNan, VecTransposeImage)


@dataclass
class Transition:
    """One branch step as it goes into the replay buffer (observations as the model sees them)."""

    branch: int
    t: int
    obs: Any
    next_obs: Any  # the step's own observation, also at an episode end (never a reset obs)
    action: Any  # as returned by model.predict (env units)
    buffer_action: Any  # as stored: scaled to [-1, 1] for Box action spaces, like SB3 does
    reward: float
    done: bool  # terminated or truncated
    truncated: bool  # TimeLimit truncation (and not terminated): "TimeLimit.truncated"


class _RecordingPolicy:
    """Delegates to an SB3 model and keeps every batch of observations ``explore`` asks about
    (``explore`` records actions, rewards and the final obs, not the intermediate ones)."""

    def __init__(self, model: Any):
        self.model = model
        self.policy = model.policy  # explore() recognizes SB3 models by .predict and .policy
        self.calls: list[np.ndarray] = []

    def predict(self, obs: np.ndarray, deterministic: bool = False) -> tuple[np.ndarray, Any]:
        self.calls.append(np.array(obs, copy=True))
        return self.model.predict(obs, deterministic=deterministic)


@contextlib.contextmanager
def _learner_rngs_kept(model: Any):
    """The branches' actions come from ``model.predict`` in this process, which draws from the
    learner's generators: torch's (a stochastic policy's samples), NumPy's and ``random``'s, the
    model's action space's (DQN's epsilon-greedy). Put back after a fork point, so the learner
    draws after it what it would have drawn without one ("evaluate" leaves training unchanged,
    bit for bit; in every mode, the learner's own stream does not depend on the branches)."""
    gens = {id(sp): sp for sp in (model.action_space, model.observation_space) if sp is not None}.values()
    saved_spaces = [(sp, sp._np_random, None if sp._np_random is None else copy.deepcopy(sp._np_random.bit_generator.state))
                    for sp in gens]
    cuda = th.cuda.get_rng_state_all() if th.cuda.is_available() else None
    saved = (th.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        yield
    finally:
        th.set_rng_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])
        if cuda is not None:
            th.cuda.set_rng_state_all(cuda)
        for sp, gen, state in saved_spaces:
            sp._np_random = gen  # (None again where the branches made one)
            if gen is not None:
                gen.bit_generator.state = state


class BranchExplorationCallback(BaseCallback):
    """Branch ``n_branches`` futures of ``horizon`` steps off a training env slot, every
    ``every`` env steps, and use them according to ``mode``.

    The training env must be a :class:`~gym_fork.vec_env.ForkableVecEnv` (possibly under
    ``VecMonitor``, ``VecCheckNan`` or ``VecTransposeImage``; ``VecNormalize`` is refused).
    Branches use the model's current stochastic policy (``model.predict(obs,
    deterministic=False)``: epsilon-greedy for DQN, the Gaussian / squashed policy for
    PPO, A2C, SAC; TD3's ``action_noise`` is not applied) and reseeded env randomness.

    Modes:

    ``"buffer"`` (off-policy algorithms only)
        Every branch transition is added to ``model.replay_buffer`` with its true next
        observation (the step's own observation at an episode end, never a reset one),
        ``done = terminated or truncated`` and ``info["TimeLimit.truncated"] = truncated and
        not terminated`` (so ``handle_timeout_termination`` bootstraps through time limits).
        Actions are stored the way SB3 stores them (scaled to [-1, 1] for ``Box``). The
        buffer has one column per env slot, so transitions are added ``n_envs`` at a time, one
        per column; the remainder (fewer than ``n_envs``) waits for the next fork point
        (:attr:`pending`) — nothing is padded or duplicated. ``optimize_memory_usage=True`` is
        refused (it stores next_obs in the next row, which branch rows would corrupt).
    ``"return_to_best"``
        The slot jumps to the end state of the branch with the highest return, unless that
        branch ended its episode (then nothing happens). The learner sees the jump as a *time
        limit truncation*: the step just taken gets ``done=True``, ``TimeLimit.truncated=True``
        and ``terminal_observation`` = its real next observation, and the slot's next
        observation becomes the branch's end observation. So off-policy algorithms store the
        real transition as non-terminal (with ``handle_timeout_termination``), and on-policy
        algorithms bootstrap the interrupted trajectory with ``gamma * V(terminal_observation)``
        (SB3's own timeout handling) and start a new trajectory at the jump, so GAE never mixes
        two trajectories. Side effects: SB3 counts the jump as an episode end
        (``_episode_num``), and a ``VecMonitor`` keeps accumulating the interrupted episode's
        statistics into the one continued after the jump. The branch's own steps are not given
        to the learner.
    ``"evaluate"``
        Training is unchanged, bit for bit (the branches draw from the learner's generators --
        torch's, NumPy's, ``random``'s, the action space's -- which are put back after every
        fork point, in every mode). Logged: ``value_at_fork`` (PPO/A2C: ``V(s)``; DQN: ``max_a
        Q(s, a)``; SAC/TD3: the mean over the branches' first actions ``a_k ~ pi(s)`` of
        ``min_i Q_i(s, a_k)``), ``mc_return_mean`` (the branches' discounted returns over
        their ``horizon`` steps), ``mc_bootstrap_return_mean`` (the same plus ``gamma^L
        V(s_L)`` for branches that did not terminate: the quantity ``V(s)`` estimates) and
        ``value_error = value_at_fork - mc_bootstrap_return_mean``. SAC's soft Q includes the
        entropy bonus, so it is biased upwards against reward-only returns.

    Logged at every fork point under ``branch/``: ``n_branches``, ``mean_return``,
    ``max_return`` (undiscounted), ``steps_simulated`` (branch steps, not counted in
    ``num_timesteps``), ``total_steps_simulated``, ``time_s``, ``prefix_steps_saved`` (the
    steps a replay from reset to the fork point would have cost: ``snapshot.steps *
    n_branches``), ``slot``, plus ``added_transitions`` / ``pending`` (buffer), ``jumped``
    (return_to_best), and the values above (evaluate). :attr:`history` keeps them all.

    Example:
        >>> from stable_baselines3 import DQN
        >>> from gym_fork.sb3 import BranchExplorationCallback
        >>> from gym_fork.vec_env import ForkableVecEnv
        >>> venv = ForkableVecEnv("CartPole-v1", n_envs=2, seed=0)
        >>> model = DQN("MlpPolicy", venv, learning_starts=100, device="cpu", seed=0)
        >>> cb = BranchExplorationCallback(every=200, n_branches=4, horizon=16, mode="buffer", seed=0)
        >>> _ = model.learn(400, callback=cb)
        >>> len(cb.history) >= 1 and cb.total_steps_simulated > 0
        True
        >>> venv.close()

    Args:
        every: fork every ``every`` env steps (``self.num_timesteps``, which grows by
            ``n_envs`` per vector step); ``None``: only when ``when`` says so.
        n_branches: branches per fork point (K).
        horizon: steps per branch at most (H); a branch stops at its episode end.
        mode: ``"buffer"``, ``"return_to_best"`` or ``"evaluate"``.
        when: optional predicate ``when(obs, info, locals) -> bool``, asked at every step for
            the candidate slot (``env_index``, else every slot from the round-robin position
            on; the first that says yes is used) with that slot's current observation and
            last info and the rollout's ``locals``. A fork point happens when ``every`` or
            ``when`` says so.
        env_index: always branch off this slot (default: round-robin over the slots).
        seed: seeds the branches' env randomness (each fork point gets fresh seeds from a
            ``SeedSequence(seed)``; every ``Branch.seed`` is recorded), for reproducibility.
            The policy's own sampling follows torch's global RNG, as in SB3.
        verbose: 1 prints one line per fork point.
        pool: a :class:`gym_fork.ray.RayBranchPool`: the branches run on its cluster (the fork
            point's snapshot travels as a bundle, the model's weights once per fork point);
            modes ``"buffer"`` and ``"evaluate"`` (``"return_to_best"`` needs the branches'
            end states here, which a pool does not bring back).

    Attributes:
        last_result: the latest fork point's :class:`~gym_fork.ExploreResult`. Its root
            snapshot (and branch snapshots, in ``"return_to_best"``) stay valid until the
            next fork point, the next ``learn()``, :meth:`release` or the env's ``close()``.
        last_slot: the slot it branched off.
        last_transitions: ``"buffer"``: the transitions added at the latest fork point, as
            ``(Transition, buffer_pos, env_column)`` (earlier pending ones first).
        last_branch_transitions: ``"buffer"``: all transitions of the latest fork point's
            branches, branch by branch (some may still be :attr:`pending`).
        history: one dict of logged values per fork point.
        total_steps_simulated: branch steps so far.
    """

    def __init__(self, every: int | None = 10_000, n_branches: int = 8, horizon: int = 64,
                 mode: Mode = "buffer", *, when: WhenPredicate | None = None, env_index: int | None = None,
                 seed: int | None = None, verbose: int = 0, pool: Any = None):
        super().__init__(verbose)
        self.pool = pool  # a gym_fork.ray.RayBranchPool: branches run on the cluster
        self.every = every
        self.n_branches = n_branches
        self.horizon = horizon
        self.mode = mode
        self.when = when
        self.env_index = env_index
        self.seed = seed
        self.last_result: ExploreResult | None = None
        self.last_slot: int | None = None
        self.last_transitions: list[tuple[Transition, int, int]] = []
        self.last_branch_transitions: list[Transition] = []
        self.pending: deque[Transition] = deque()
        self.history: list[dict[str, float]] = []
        self.total_steps_simulated = 0
        self._check_args()

    # --- configuration -------------------------------------------------------------------------
    def _check_args(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, not {self.mode!r}")
        for name in ("n_branches", "horizon"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{name} must be an int, not {type(v).__name__}")
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if self.every is not None:
            if isinstance(self.every, bool) or not isinstance(self.every, (int, np.integer)):
                raise TypeError(f"every must be an int or None, not {type(self.every).__name__}")
            if self.every < 1:
                raise ValueError(f"every must be >= 1 (or None), got {self.every}")
        if self.pool is not None and self.mode == "return_to_best":
            raise ValueError("mode='return_to_best' cannot use a pool (branch end states stay on the "
                             "nodes); use 'buffer' or 'evaluate', or no pool")
        if self.when is not None and not callable(self.when):
            raise TypeError("when must be a callable when(obs, info, locals) -> bool")
        if self.every is None and self.when is None:
            raise ValueError("give every=..., when=..., or both: otherwise no fork point ever happens")
        if self.env_index is not None and (isinstance(self.env_index, bool)
                                           or not isinstance(self.env_index, (int, np.integer))):
            raise TypeError(f"env_index must be an int or None, not {type(self.env_index).__name__}")

    def _init_callback(self) -> None:
        self._check_args()
        env = self.model.get_env()
        if env is None:
            raise ValueError("the model has no env; BranchExplorationCallback needs a ForkableVecEnv")
        self._wrappers: list[VecEnvWrapper] = []
        while isinstance(env, VecEnvWrapper):
            if isinstance(env, VecNormalize):
                raise TypeError("BranchExplorationCallback does not support VecNormalize: branch "
                                "observations and rewards would bypass (and not update) its statistics")
            if not isinstance(env, _PASSTHROUGH):
                raise TypeError(f"BranchExplorationCallback cannot see through {type(env).__name__}; "
                                f"supported wrappers: {', '.join(w.__name__ for w in _PASSTHROUGH)}")
            self._wrappers.append(env)
            env = env.venv
        if not isinstance(env, ForkableVecEnv):
            raise TypeError(f"the training env must be a gym_fork ForkableVecEnv, not {type(env).__name__}")
        if isinstance(env.observation_space, (spaces.Dict, spaces.Tuple)):
            raise TypeError("Dict/Tuple observation spaces are not supported")
        if self.env_index is not None and not 0 <= self.env_index < env.num_envs:
            raise ValueError(f"env_index={self.env_index} but the env has {env.num_envs} slots")
        self.venv: ForkableVecEnv = env
        model = self.model
        self._off_policy = isinstance(model, OffPolicyAlgorithm)
        if self.mode == "buffer":
            rb = getattr(model, "replay_buffer", None)
            if not self._off_policy or rb is None:
                raise ValueError(f"mode='buffer' needs an off-policy algorithm with a replay buffer "
                                 f"(DQN, SAC, TD3); {type(model).__name__} has none. Use "
                                 "'return_to_best' or 'evaluate'")
            if type(rb).__name__ == "HerReplayBuffer" or not hasattr(rb, "next_observations"):
                raise ValueError(f"mode='buffer' needs a plain ReplayBuffer with next_observations "
                                 f"(not {type(rb).__name__}, nor optimize_memory_usage=True)")
        if self.mode == "evaluate":
            pol = model.policy
            if not (hasattr(pol, "predict_values") or hasattr(model, "q_net")
                    or (hasattr(model, "critic") and hasattr(model, "actor"))):
                raise TypeError(f"mode='evaluate' cannot find a critic in {type(model).__name__}")
        self._seedseq = np.random.SeedSequence(self.seed)
        self._rr = 0
        self._last_fork_bin = 0
        self._release()

    # --- the step hook -------------------------------------------------------------------------
    def _on_step(self) -> bool:
        slot = self._fork_slot()
        if slot is not None:
            with _learner_rngs_kept(self.model):
                self._fork(slot)
        return True

    def release(self) -> None:
        """Free the latest fork point's snapshots now (else: at the next fork point, at the next
        ``learn()``, or when the env is closed)."""
        self._release()

    def _fork_slot(self) -> int | None:
        n = self.venv.num_envs
        due = False
        if self.every is not None:
            b = self.num_timesteps // self.every
            if b > self._last_fork_bin:
                self._last_fork_bin = b
                due = True
        candidates = [self.env_index] if self.env_index is not None else [(self._rr + k) % n for k in range(n)]
        if due:
            slot = candidates[0]
        elif self.when is not None:
            new_obs = self.locals.get("new_obs")
            infos = self.locals.get("infos") or [{}] * n
            slot = None
            for i in candidates:
                obs_i = new_obs[i] if new_obs is not None else self.venv.current_obs[i]
                if self.when(obs_i, infos[i], self.locals):
                    slot = i
                    break
            if slot is None:
                return None
        else:
            return None
        if self.env_index is None:
            self._rr = (slot + 1) % n
        return slot

    def _fork(self, slot: int) -> None:
        self._release()
        t0 = time.perf_counter()
        env: ForkableEnv = self.venv.envs[slot]
        root = self.venv.snapshot(slot)
        seeds = [int(s) for s in self._seedseq.spawn(1)[0].generate_state(self.n_branches, np.uint64) % (2**63)]
        recorder = _RecordingPolicy(self.model)
        if self.pool is not None:
            result = self.pool.explore(root, self.model, n_branches=self.n_branches, horizon=self.horizon,
                                       rng="reseed", seeds=seeds, stop_at_done=True, deterministic=False,
                                       record_obs=True)
            live_at = range(max((b.length for b in result.branches), default=0))
            recorder.calls = [np.stack([b.observations[t] for b in result.branches if b.length > t])
                              for t in live_at]
        else:
            result = explore(env, root, recorder, n_branches=self.n_branches, horizon=self.horizon,
                             rng="reseed", seeds=seeds, return_snapshots=self.mode == "return_to_best",
                             stop_at_done=True, deterministic=False, progress=False)
        self.last_result, self.last_slot = result, slot
        self.total_steps_simulated += result.steps
        returns = result.returns()
        rec: dict[str, float] = {
            "num_timesteps": float(self.num_timesteps),
            "slot": float(slot),
            "n_branches": float(self.n_branches),
            "mean_return": float(returns.mean()),
            "max_return": float(returns.max()),
            "steps_simulated": float(result.steps),
            "total_steps_simulated": float(self.total_steps_simulated),
            "prefix_steps_saved": float(root.steps * self.n_branches),
        }
        if self.mode == "buffer":
            rec.update(self._to_buffer(result, recorder.calls))
        elif self.mode == "return_to_best":
            rec.update(self._jump(result, slot))
        else:
            rec.update(self._evaluate(result, recorder.calls))
        rec["time_s"] = time.perf_counter() - t0
        self.history.append(rec)
        for k, v in rec.items():
            if k != "num_timesteps":
                self.logger.record(f"branch/{k}", v)
        if self.verbose >= 1:
            print(f"[branch] t={self.num_timesteps} slot={slot} depth={root.steps} "
                  f"mean_return={rec['mean_return']:.2f} max_return={rec['max_return']:.2f} "
                  f"steps={result.steps} {rec['time_s'] * 1e3:.0f} ms")

    # --- modes ---------------------------------------------------------------------------------
    def _transitions(self, result: ExploreResult, calls: list[np.ndarray]) -> list[Transition]:
        """Per-branch transitions from the observation batches explore() asked the policy about:
        at step t the live branches (those longer than t) were asked, in index order."""
        branches = result.branches
        obs_of: list[list[Any]] = [[] for _ in branches]
        for t, batch in enumerate(calls):
            live = [b.index for b in branches if b.length > t]
            if len(live) != len(batch):
                raise RuntimeError("internal: explore() observation batches do not match the branches")
            for row, i in zip(batch, live):
                obs_of[i].append(row)
        box = isinstance(self.model.action_space, spaces.Box)
        out = []
        for b in branches:
            for t in range(b.length):
                last = t == b.length - 1
                nxt = obs_of[b.index][t + 1] if not last else np.asarray(b.final_obs)
                a = np.asarray(b.actions[t])
                buf_a = self.model.policy.scale_action(a) if box else a
                out.append(Transition(
                    branch=b.index, t=t, obs=self._model_obs(obs_of[b.index][t]), next_obs=self._model_obs(nxt),
                    action=a, buffer_action=buf_a, reward=float(b.rewards[t]),
                    done=bool(last and b.done), truncated=bool(last and b.truncated and not b.terminated)))
        return out

    def _to_buffer(self, result: ExploreResult, calls: list[np.ndarray]) -> dict[str, float]:
        rb = self.model.replay_buffer
        n = rb.n_envs
        new = self._transitions(result, calls)
        self.last_branch_transitions = new
        self.pending.extend(new)
        self.last_transitions = []
        added = 0
        while len(self.pending) >= n:
            group = [self.pending.popleft() for _ in range(n)]
            pos = rb.pos
            rb.add(np.stack([g.obs for g in group]), np.stack([g.next_obs for g in group]),
                   np.stack([np.asarray(g.buffer_action) for g in group]),
                   np.array([g.reward for g in group], dtype=np.float32),
                   np.array([g.done for g in group], dtype=np.float32),
                   [{"TimeLimit.truncated": g.truncated} for g in group])
            self.last_transitions.extend((g, pos, col) for col, g in enumerate(group))
            added += n
        return {"added_transitions": float(added), "pending": float(len(self.pending))}

    def _jump(self, result: ExploreResult, slot: int) -> dict[str, float]:
        best = result.best()
        if best.done or best.snapshot is None:
            return {"jumped": 0.0}
        obs = self.venv.restore(slot, best.snapshot)
        new_obs, dones, infos = self.locals.get("new_obs"), self.locals.get("dones"), self.locals.get("infos")
        if new_obs is None or dones is None or infos is None:
            raise RuntimeError("BranchExplorationCallback needs SB3's rollout locals (new_obs, dones, infos)")
        if not dones[slot]:
            # The step just taken is recorded as a time-limit truncation of its trajectory ...
            infos[slot]["terminal_observation"] = np.array(new_obs[slot], copy=True)
            infos[slot]["TimeLimit.truncated"] = True
            dones[slot] = True
        # ... and the slot continues from the branch's end (SB3 copies new_obs to _last_obs).
        new_obs[slot] = self._model_obs(obs)
        return {"jumped": 1.0, "jump_return": best.ret, "jump_steps": float(best.length)}

    def _evaluate(self, result: ExploreResult, calls: list[np.ndarray]) -> dict[str, float]:
        gamma = float(self.model.gamma)
        root_obs = self._model_obs(calls[0][0])
        first_actions = [b.actions[0] for b in result.branches]
        v0 = float(self._values(root_obs[None], first_actions=first_actions)[0])
        raw, boot = [], []
        ends = [b for b in result.branches if not b.terminated]
        v_end = self._values(np.stack([self._model_obs(b.final_obs) for b in ends])) if ends else []
        v_of = {b.index: float(v) for b, v in zip(ends, v_end)}
        for b in result.branches:
            g = float(np.sum(np.asarray(b.rewards) * gamma ** np.arange(b.length)))
            raw.append(g)
            boot.append(g + (gamma ** b.length * v_of[b.index] if b.index in v_of else 0.0))
        return {"value_at_fork": v0, "mc_return_mean": float(np.mean(raw)),
                "mc_bootstrap_return_mean": float(np.mean(boot)),
                "value_error": v0 - float(np.mean(boot))}

    # --- helpers -------------------------------------------------------------------------------
    @th.no_grad()
    def _values(self, obs_batch: np.ndarray, first_actions: list | None = None) -> np.ndarray:
        """The critic's state values for a batch of (model-space) observations."""
        model, pol = self.model, self.model.policy
        obs_t, _ = pol.obs_to_tensor(obs_batch)
        if hasattr(pol, "predict_values"):  # PPO, A2C
            return pol.predict_values(obs_t).flatten().cpu().numpy()
        if hasattr(model, "q_net"):  # DQN
            return model.q_net(obs_t).max(dim=1).values.cpu().numpy()
        # SAC / TD3: Q(s, a) with a ~ pi(s) (the branches' first actions at the fork point)
        if first_actions is not None and len(obs_batch) == 1:
            acts = np.stack([pol.scale_action(np.asarray(a)) for a in first_actions])
            act_t = th.as_tensor(acts, dtype=th.float32, device=model.device)
            q = th.cat(model.critic(obs_t.repeat(len(acts), *([1] * (obs_t.dim() - 1))), act_t), dim=1)
            return np.array([q.min(dim=1).values.mean().item()])
        q = th.cat(model.critic(obs_t, model.actor(obs_t)), dim=1)
        return q.min(dim=1).values.cpu().numpy()

    def _model_obs(self, obs: Any) -> np.ndarray:
        """An env observation as the model sees it (through VecTransposeImage, if any)."""
        o = np.asarray(obs)
        for w in reversed(self._wrappers):  # innermost first
            if isinstance(w, VecTransposeImage):
                o = w.transpose_observations(o[None])[0]
        return o

    def _release(self) -> None:
        res, self.last_result = self.last_result, None
        if res is None:
            return
        for b in res.branches:
            if b.snapshot is not None:
                b.snapshot.release()
        res.root.release()
