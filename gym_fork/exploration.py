"""Exploring many futures from one saved state: :func:`explore`.

Branches are forks of one snapshot (``ForkableEnv.fork``). With the policy in the learner they
are stepped in lockstep: every step, all live branches' actions are sent first and the replies
collected after, so the worker processes compute concurrently while the controller evaluates the
policy (batched: the path for SB3 models). Open-loop ``actions`` and ``policy_in_worker=True``
run each branch's whole rollout inside its worker instead: one round trip per branch.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import numpy as np

from gym_fork.backends import capacity
from gym_fork.env import ForkableEnv, share_cpus, take_autoreset
from gym_fork.errors import UncapturedFilesError
from gym_fork.interrupts import held
from gym_fork.snapshots.snapshot import Snapshot
from gym_fork.worker.channel import canonical_digest
from gym_fork.worker.commands import is_sb3_model, own_action, own_copy, pickle_policy

Policy = Callable[[Any], Any]


@dataclass
class Branch:
    """What one branch did."""

    index: int
    seed: int | None
    actions: list = field(default_factory=list)
    rewards: list = field(default_factory=list)
    terminated: bool = False
    truncated: bool = False
    final_obs: Any = None
    final_info: dict = field(default_factory=dict)
    snapshot: Snapshot | None = None  # its end state, when explore(..., return_snapshots=True)

    @property
    def ret(self) -> float:
        """Undiscounted return."""
        return float(np.sum(self.rewards)) if self.rewards else 0.0

    @property
    def length(self) -> int:
        return len(self.actions)

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


@dataclass
class ExploreResult:
    root: Snapshot
    branches: list[Branch]
    wall_s: float

    @property
    def steps(self) -> int:
        return sum(b.length for b in self.branches)

    def best(self) -> Branch:
        return max(self.branches, key=lambda b: b.ret)

    def returns(self) -> np.ndarray:
        return np.array([b.ret for b in self.branches])


def as_policy(policy: Any, deterministic: bool = False) -> Callable[[list], list]:
    """A batch policy ``[obs] -> [action]`` from a callable ``obs -> action`` or an SB3 model."""
    if is_sb3_model(policy):
        def batch(obs_list: list) -> list:
            acts, _ = policy.predict(_stack(obs_list), deterministic=deterministic)
            return list(acts)

        return batch
    if not callable(policy):
        raise TypeError(f"policy must be a callable obs -> action or an SB3 model, not {type(policy).__name__}")
    return _PerObs(policy)


def _stack(obs_list: list) -> Any:
    """One batch of observations, as an SB3 model's ``predict`` takes it: a Dict space's
    observations key by key (``MultiInputPolicy``), a Tuple's item by item, arrays stacked."""
    first = obs_list[0]
    if isinstance(first, dict):
        return {k: _stack([o[k] for o in obs_list]) for k in first}
    if isinstance(first, tuple):
        return tuple(_stack([o[i] for o in obs_list]) for i in range(len(first)))
    return np.stack(obs_list)


class _PerObs:
    """A callable ``obs -> action`` used as a batch policy; :func:`_run_closed_loop` calls
    :attr:`policy` itself, one branch at a time (the same calls, in the same order)."""

    __slots__ = ("policy",)

    def __init__(self, policy: Callable[[Any], Any]):
        self.policy = policy

    def __call__(self, obs_list: list) -> list:
        return [self.policy(o) for o in obs_list]


def explore(env: ForkableEnv, snapshot: Snapshot | None, policy: Any, n_branches: int = 8,
            horizon: int = 100, *, rng: Literal["same", "reseed"] = "reseed",
            seeds: Sequence[int] | None = None, return_snapshots: bool = False,
            stop_at_done: bool = True, deterministic: bool = False,
            progress: bool | None = None, actions: Sequence[Sequence[Any]] | None = None,
            max_copies: int | None = None, policy_in_worker: bool = False) -> ExploreResult:
    """Run ``n_branches`` branches of up to ``horizon`` steps from ``snapshot``, in parallel.

    Args:
        env: the ForkableEnv the snapshot belongs to (it is not changed).
        snapshot: where to branch from; ``None`` snapshots ``env`` now.
        policy: a callable ``obs -> action`` or a Stable-Baselines3 model (``model.predict``,
            stochastic unless ``deterministic=True``), called once per step for all branches.
            With ``policy_in_worker=True``: a picklable callable ``obs -> action``, or a list of
            ``n_branches`` of them (one per branch, e.g. each with its own random generator).
        rng: ``"reseed"`` (default) gives each branch its own env randomness (``seeds[i]`` or
            fresh entropy; every generator the env draws from, as :meth:`ForkableEnv.fork`);
            ``"same"`` keeps the snapshot's, so identical actions replay exactly.
        return_snapshots: snapshot every branch's end state (``Branch.snapshot``; its
            ``parent_id`` is the root -- None where ``snapshot`` was None: that root is released --
            and its ``actions`` the branch's actions; after an auto-reset inside the branch
            (``stop_at_done=False``) a new timeline, as after ``reset()``: ``parent_id`` None and
            ``actions`` those since the reset). They belong to ``env`` afterwards and are
            released with it.
        stop_at_done: a branch stops at its first episode end (else it auto-resets and goes on).
        progress: show a progress bar (default: when ``n_branches * horizon >= 20000``).
        actions: open-loop branches instead of a policy (pass ``policy=None``): branch ``i``
            runs ``actions[i][:horizon]``, entirely inside its worker (one round trip per
            branch instead of one per step: the fast path for random or planned action
            sequences).
        max_copies: ``n_branches`` is checked against what the machine can hold (processes,
            threads, memory) before anything starts; this replaces the memory estimate by "at
            most that many" (also ``$GYM_FORK_MAX_COPIES``; see :mod:`gym_fork.backends.capacity`).
        policy_in_worker: run the policy inside every branch's worker instead of here: each
            branch steps its whole rollout without a round trip per step (one per branch, as for
            open-loop ``actions``), still choosing every action from the observation it sees.
            The fast path for cheap policies (scripted, planners, small NumPy models): on a
            2-vCPU VM, 16 closed-loop Pong branches ran 1.4x faster than round trips per step.
            Every branch steps its own unpickled copy (``policy`` here is not changed). With
            ``rng="reseed"`` each copy of one policy shared by all branches has the generators
            it holds (attributes, closed-over variables, and module globals its code names)
            reseeded from the branch's seed, as the env's are, so a stochastic policy draws
            differently in every branch and a branch is reproducible from its seed; a list of
            policies (one per branch) keeps the seeds their author gave them. With
            ``rng="same"`` every copy draws the same numbers (a UserWarning says so when the one
            policy holds a generator). SB3 models stay in the learner (batched).

    Raises:
        TypeError: ``n_branches`` or ``horizon`` is not an int; with ``policy_in_worker=True``, a
            policy that does not pickle, or an SB3 model.
        ValueError: both or neither of ``policy`` and ``actions``; a list of policies or action
            sequences of the wrong length.
        CapacityError: more branches than fit (the message has the numbers and the override).
        UncapturedFilesError: a branch wrote a file outside its workspace and ``untracked_paths``
            (the branches shared it, so their results are not their own).
        PolicyError: a policy run in a worker raised (the other branches are stopped).

    Example:
        >>> import gym_fork
        >>> env = gym_fork.make("CartPole-v1")
        >>> _ = env.reset(seed=0)
        >>> res = gym_fork.explore(env, None, lambda obs: int(obs[2] > 0), n_branches=4, horizon=50)
        >>> len(res.branches), res.best().ret > 0
        (4, True)
        >>> env.close()
    """
    n_branches, horizon = capacity.count(n_branches, "n_branches"), capacity.count(horizon, "horizon")
    if (policy is None) == (actions is None):
        raise ValueError("pass either a policy or open-loop `actions`, not both or neither")
    if actions is not None and len(actions) != n_branches:
        raise ValueError(f"actions needs one sequence per branch ({n_branches}), got {len(actions)}")
    if policy_in_worker:
        if policy is None:
            raise ValueError("policy_in_worker=True needs a policy (open-loop `actions` run in the workers anyway)")
        policies = _per_branch(policy, n_branches, rng)
        act = None
    else:
        act = as_policy(policy, deterministic) if policy is not None else None
    t0 = time.perf_counter()
    own_root = snapshot is None
    # only cloned, then released; it leaves the env's timeline alone (parent_id, actions)
    root = env._side_snapshot() if own_root else snapshot
    if rng == "reseed" and seeds is None:
        seeds = [int(s) for s in np.random.SeedSequence().generate_state(n_branches, np.uint64) % (2**63)]
    try:
        if policy_in_worker:  # each distinct policy once, in the order the branches first use them
            kids = env._fork(root, n_branches, rng=rng, seeds=seeds, max_copies=max_copies,
                             policies=list(dict.fromkeys(policies)))
        else:
            kids = env.fork(root, n_branches, rng=rng, seeds=seeds, max_copies=max_copies)
    except BaseException:
        if own_root:
            root.release()
        raise
    branches = [Branch(i, None if seeds is None else int(seeds[i])) for i in range(n_branches)]
    try:
        if actions is not None:
            _run_open_loop(kids, branches, actions, horizon, stop_at_done)
        elif policy_in_worker:
            # one policy for all branches: each copy's generators reseeded from its branch's seed (a list
            # keeps its author's seeds); so decided for the whole call, as a Ray pool's node sees it too
            _run_in_workers(kids, branches, policies, horizon, stop_at_done, progress, reseed=rng == "reseed",
                            shared=not isinstance(policy, (list, tuple)))
        else:
            _run_closed_loop(kids, branches, act, horizon, stop_at_done, progress)
        _refuse_shared_writes(kids)
        if rng == "reseed":
            _warn_if_all_alike(branches)
        if return_snapshots:
            for k, b in zip(kids, branches):
                b.snapshot = k._snapshot(ready_copy=False)  # most are never restored: no copy ahead
                k._hand_over(b.snapshot, env)  # the branch env is closed below; `env` keeps it
                if own_root and b.snapshot.parent_id == root.id:  # (a root released below: none)
                    b.snapshot.parent_id = None
    except BaseException:
        for k in kids:  # a branch failed (or Ctrl-C): the others' rollouts are not waited for
            k._abort()
        raise
    finally:
        # Ctrl-C held back until every branch is stopped: cut in this loop, the branches not yet
        # reached lived on, each waiting for requests nobody would send (a second one goes through)
        with held():
            for k in kids:  # every worker closes its env at once ...
                k._begin_close()
            for k in kids:  # ... then each is stopped
                k.close()
            if own_root:
                root.release()
    return ExploreResult(root, branches, time.perf_counter() - t0)


def _refuse_shared_writes(kids: list[ForkableEnv]) -> None:
    """Raise UncapturedFilesError when a branch wrote a file outside its workspace (and its env's
    ``untracked_paths``): every branch -- and the env explored -- has that one file, so branches
    running side by side may have read each other's writes, and their returns are not theirs
    alone. A branch that is snapshotted is refused so anyway; one that only runs was not."""
    for i, k in enumerate(kids):
        paths = k._outside_writes()
        if paths:
            shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
            raise UncapturedFilesError(
                f"explore(): branch {i} wrote {shown}, outside its workspace: the branches share such a file "
                "(with the env explored), so they may have read each other's writes and their results are not "
                "theirs alone. The env explored is unchanged, but the file is as the branches left it. To fix: "
                "keep such files in the env's workspace (workspace=DIR: every branch gets its own copy), declare "
                "their directories private (private_dirs=[DIR], root), or, if their content does not matter "
                "(logs), declare them with untracked_paths=[...].", paths)


def _warn_if_all_alike(branches: list[Branch]) -> None:
    """Say so when every reseeded branch went on exactly like the first: then neither the policy
    nor the env's randomness told them apart, and all branches but one were wasted work. (Cheap
    in the usual case: the first branch whose rewards differ ends the comparison.)"""
    if len(branches) < 2:
        return
    first = branches[0]
    try:
        if any(b.rewards != first.rewards for b in branches[1:]):
            return
    except (ValueError, TypeError):  # rewards that do not compare as a list does (arrays): by digest
        pass
    same = canonical_digest((first.actions, first.rewards, first.terminated, first.truncated, first.final_obs))
    if any(canonical_digest((b.actions, b.rewards, b.terminated, b.truncated, b.final_obs)) != same
           for b in branches[1:]):
        return
    warnings.warn(
        f"explore(): all {len(branches)} branches went on identically (the same actions, rewards and final "
        "observations), though rng='reseed' gave each its own seed: neither the policy nor the env's randomness "
        "told them apart, so all but one were wasted. The env may draw no randomness after the snapshot (use a "
        "stochastic policy, or one policy per branch), or draw it where a reseed cannot reach, such as a C "
        "library (`gym-fork check ENV` lists what a reseed reaches).", RuntimeWarning, stacklevel=3)


def check_in_worker_policy(policy: Any, n_branches: int, rng: str = "reseed") -> None:
    """Raise what :func:`explore` with ``policy_in_worker=True`` would, before anything starts
    (for callers that ship the policy elsewhere first, such as the Ray pool)."""
    _per_branch(policy, n_branches, rng)


def _per_branch(policy: Any, n_branches: int, rng: str) -> list[bytes]:
    """The pickled policy of every branch (one pickle when all branches share one policy)."""
    if isinstance(policy, (list, tuple)):
        if len(policy) != n_branches:
            raise ValueError(f"a list of policies needs one per branch ({n_branches}), got {len(policy)}")
        return [pickle_policy(p) for p in policy]
    if n_branches > 1 and rng == "same" and _holds_generator(policy):
        warnings.warn(
            f"explore(policy_in_worker=True, rng='same'): every branch gets a copy of the same "
            f"{type(policy).__name__}, random generator included, so all branches draw the same numbers. "
            "Use rng='reseed' (each copy's generators reseeded from its branch's seed), or pass one policy "
            "per branch, each with its own seed (a list of n_branches policies).", UserWarning, stacklevel=3)
    return [pickle_policy(policy)] * n_branches


def _holds_generator(policy: Any) -> bool:
    """Whether ``policy`` keeps a random generator of its own (an attribute or a closed-over
    variable): NumPy's ``Generator`` / ``RandomState`` or a ``random.Random``."""
    import random

    kinds = (np.random.Generator, np.random.RandomState, random.Random)
    values = list(getattr(policy, "__dict__", {}).values())
    values += [c.cell_contents for c in (getattr(policy, "__closure__", None) or ()) if _filled(c)]
    return any(isinstance(v, kinds) for v in values)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def _run_open_loop(kids: list, branches: list[Branch], actions: Sequence[Sequence[Any]], horizon: int,
                   stop_at_done: bool) -> None:
    for k, seq in zip(kids, actions):  # every worker starts at once ...
        k.rollout_send(list(seq)[:horizon], stop_at_done=stop_at_done)
    for k, b in zip(kids, branches):  # ... and we collect in order
        _fill(b, _receive(k, b))


def _run_in_workers(kids: list, branches: list[Branch], policies: list[bytes], horizon: int,
                    stop_at_done: bool, progress: bool | None, *, reseed: bool, shared: bool) -> None:
    index = {blob: i for i, blob in enumerate(dict.fromkeys(policies))}
    for k, blob in zip(kids, policies):  # every worker starts its closed-loop rollout at once ...
        # a worker that unpickled the policies ahead (the backend's preloading) runs its by index
        i = index[blob]
        k._policy_rollout_send(i if i < getattr(k._handle, "preloaded", 0) else blob, horizon, stop_at_done,
                               reseed=reseed, shared=shared)
    bar = _progress(len(kids), progress if progress is not None else len(kids) * horizon >= 20000, "branch")
    try:
        for k, b in zip(kids, branches):  # ... and we collect in order
            _fill(b, _receive(k, b))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()


def _receive(kid: ForkableEnv, b: Branch) -> dict:
    try:
        return kid.rollout_receive()
    except Exception as e:
        e.add_note(f"(in explore()'s branch {b.index})")
        raise


def _fill(b: Branch, out: dict) -> None:
    b.actions, b.rewards = out["actions"], out["rewards"]
    b.terminated, b.truncated = out["terminated"], out["truncated"]
    b.final_obs, b.final_info = out["final_obs"], out["final_info"]


_ENDED = object()


def _take_reply(kid: ForkableEnv, b: Branch, action: Any, stop_at_done: bool) -> Any:
    """Record the reply to ``kid``'s step with ``action`` in its branch; the observation its
    next action is chosen from (after an auto-reset where the episode ended), or ``_ENDED``
    where the branch stops there."""
    o, r, term, trunc, info = kid.step_receive()
    b.actions.append(own_action(action))  # (a policy may fill one array for every step)
    b.rewards.append(float(r))
    if term or trunc:
        b.final_obs, b.final_info = o, info
        b.terminated, b.truncated = bool(term), bool(trunc)
        if stop_at_done:
            return _ENDED
        reset = take_autoreset(kid, info)  # (sent with reset_at_end; raises where that reset did)
        if reset is None:  # a worker of an older gym_fork: a round trip of its own
            o, _ = kid.reset()
        else:
            o = reset[0]
        return o
    b.final_obs, b.final_info = o, info
    return o


def _run_closed_loop_pipelined(kids: list, branches: list[Branch], policy: Callable[[Any], Any], obs0: Any,
                               horizon: int, stop_at_done: bool, bar: Any) -> None:
    """:func:`_run_closed_loop` for a policy of one observation: each branch's next step is sent
    as soon as its reply is read and its action chosen, instead of after every branch's reply:
    the workers that answered first step again while the learner reads the others (a whole
    round's barrier left a CPU idle ~20% of the time: 16 LunarLander branches on 2 CPUs). The
    policy sees the same observations in the same order (branch 0, 1, ... at every step), so a
    stateful policy (its own random generator) draws exactly what the round-by-round loop drew."""
    live = list(range(len(kids)))
    pending = {}
    try:
        for i in live:  # step 0 of every branch: each with its own copy, as in the workers
            pending[i] = a = policy(own_copy(obs0))
            kids[i]._step_send(a, not stop_at_done)
        for t in range(horizon):
            if not live:
                break
            more = t + 1 < horizon
            still = []
            for i in live:
                o = _take_reply(kids[i], branches[i], pending.pop(i), stop_at_done)
                if o is _ENDED:
                    continue
                still.append(i)
                if more:  # (its own copy: a policy that changes it must not change final_obs)
                    pending[i] = a = policy(own_copy(o))
                    kids[i]._step_send(a, not stop_at_done)
            live = still
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()


def _run_closed_loop(kids: list, branches: list[Branch], act: Callable, horizon: int, stop_at_done: bool,
                     progress: bool | None) -> None:
    n_branches = len(kids)
    share_cpus(kids)  # (they step at once: where they outnumber the CPUs, polling takes the CPU one waits for)
    obs0, _info0, _ = kids[0]._request("last")
    obs = [own_copy(obs0) for _ in range(n_branches)]  # (each branch its own: the workers' do too)
    live = list(range(n_branches))
    bar = _progress(horizon, progress if progress is not None else n_branches * horizon >= 20000)
    if isinstance(act, _PerObs):
        _run_closed_loop_pipelined(kids, branches, act.policy, obs0, horizon, stop_at_done, bar)
        return
    for _t in range(horizon):
        if not live:
            break
        actions = act([own_copy(obs[i]) for i in live])
        for i, a in zip(live, actions):
            kids[i]._step_send(a, not stop_at_done)
        still = []
        for i, a in zip(live, actions):
            o = _take_reply(kids[i], branches[i], a, stop_at_done)
            if o is _ENDED:
                continue
            obs[i] = o
            still.append(i)
        live = still
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()


def _progress(total: int, enabled: bool, unit: str = "step"):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="explore", unit=unit)
