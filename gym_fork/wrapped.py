"""Snapshots of a :class:`~gym_fork.ForkableEnv` that sits inside Gymnasium wrappers.

The rule: a snapshot holds the worker -- the env and every wrapper *inside* the worker (the ones
the env id or factory builds, and ``make(..., wrappers=[...])``).  Wrappers you put *around* a
ForkableEnv live in your process and are not in it: after a restore, an outer
``RecordEpisodeStatistics`` still counts the steps taken since the snapshot, an outer
``FrameStackObservation`` still holds the frames of the abandoned future.  Put stateful wrappers
inside the worker instead.

Gymnasium 1.x wrappers do not forward unknown attributes, so ``wrapped_env.snapshot()`` does not
exist; :func:`snapshot_of` / :func:`restore_of` find the ForkableEnv under the wrappers and warn
(once per env) about each outer wrapper that holds, or may hold, state of its own.  Gymnasium's
pure transforms (``ClipAction``, ``RescaleAction``, ``TransformObservation``,
``FlattenObservation``, ...) do not; a wrapper of your own that keeps no state can say so with a
class attribute ``gym_fork_stateless = True``.

Example:
    >>> import gymnasium as gym, gym_fork
    >>> env = gym.wrappers.FlattenObservation(gym_fork.make("CartPole-v1", backend="pickle"))
    >>> _ = env.reset(seed=0)
    >>> snap = gym_fork.snapshot_of(env)       # no warning: FlattenObservation keeps no state
    >>> obs, info = gym_fork.restore_of(env, snap)
    >>> obs.shape
    (4,)
    >>> env.close()
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import gymnasium as gym
import gymnasium.wrappers as gw

from gym_fork.env import ForkableEnv
from gym_fork.snapshots.snapshot import Snapshot

# Gymnasium wrappers whose behaviour is a pure function of what passes through them.
_PURE_NAMES = ("ClipAction", "RescaleAction", "TransformAction", "TransformObservation", "TransformReward",
               "ClipReward", "FlattenObservation", "ReshapeObservation", "RescaleObservation", "DtypeObservation",
               "FilterObservation", "GrayscaleObservation", "ResizeObservation", "PassiveEnvChecker")
STATELESS: tuple[type, ...] = tuple(getattr(gw, n) for n in _PURE_NAMES if isinstance(getattr(gw, n, None), type))

_warned: "weakref.WeakSet[gym.Env]" = weakref.WeakSet()


def find_forkable(env: gym.Env) -> tuple[ForkableEnv, list[gym.Wrapper]]:
    """The ForkableEnv under ``env``'s wrappers, and the wrappers around it (outermost first).

    Raises:
        TypeError: there is no ForkableEnv in ``env``'s stack.
    """
    outer: list[gym.Wrapper] = []
    layer: Any = env
    while not isinstance(layer, ForkableEnv):
        if not isinstance(layer, gym.Wrapper):
            raise TypeError(f"{env!r} has no gym_fork.ForkableEnv in its wrapper stack: create the env with "
                            "gym_fork.make(...) or gym_fork.ForkableEnv(...)")
        outer.append(layer)
        layer = layer.env
    return layer, outer


def stateful(wrappers: list[gym.Wrapper]) -> list[gym.Wrapper]:
    """The wrappers among ``wrappers`` that hold, or may hold, state of their own."""
    return [w for w in wrappers if not (type(w) in STATELESS or getattr(w, "gym_fork_stateless", False))]


def snapshot_of(env: gym.Env) -> Snapshot:
    """``snapshot()`` of the ForkableEnv inside ``env``'s wrappers.

    Warns (once per ``env``) about outer wrappers that hold state a snapshot does not capture.

    Raises:
        TypeError: no ForkableEnv in the stack.
        As :meth:`ForkableEnv.snapshot`.
    """
    forkable, outer = find_forkable(env)
    _warn_outer(env, outer, "snapshot")
    return forkable.snapshot()


def restore_of(env: gym.Env, snapshot: Snapshot) -> tuple[Any, dict]:
    """``restore(snapshot)`` of the ForkableEnv inside ``env``'s wrappers; returns ``(obs, info)``
    as ``env`` would show them: passed through the outer observation wrappers that keep no state.

    Warns (once per ``env``) about outer wrappers whose state stays as it is; the observation is
    then the one the first such wrapper receives.

    Raises:
        TypeError: no ForkableEnv in the stack.
        As :meth:`ForkableEnv.restore`.
    """
    forkable, outer = find_forkable(env)
    _warn_outer(env, outer, "restore")
    obs, info = forkable.restore(snapshot)
    kept = stateful(outer)
    for w in reversed(outer):  # innermost first
        if kept and w in kept:
            break
        if isinstance(w, gym.ObservationWrapper):
            obs = w.observation(obs)
    return obs, info


def _warn_outer(env: gym.Env, outer: list[gym.Wrapper], what: str) -> None:
    kept = stateful(outer)
    if not kept or env in _warned:
        return
    try:
        _warned.add(env)
    except TypeError:
        pass
    names = ", ".join(type(w).__name__ for w in kept)
    warnings.warn(
        f"gym_fork: {what} through outer wrappers ({names}): a snapshot holds the env's worker only, so "
        "these wrappers' own state (step counters, episode statistics, frame buffers, running means) is "
        "not in it and is not restored. Put them inside the worker: gym_fork.make(id, wrappers=[...]) or "
        "ForkableEnv(env, wrappers=[...]). A wrapper of your own that keeps no state: set "
        "gym_fork_stateless = True on its class.", UserWarning, stacklevel=3)
