"""``ForkableVectorEnv``: a Gymnasium ``VectorEnv`` whose sub-envs can be snapshotted and forked.

A drop-in for :class:`gymnasium.vector.SyncVectorEnv` / :class:`~gymnasium.vector.AsyncVectorEnv`
(Gymnasium 1.x): the same constructor arguments that matter to a training script, the same
autoreset modes, seeding rule, batched observations and ``_key``-masked info dicts, so the same
seeds and actions give bit-identical results.  Every sub-env runs in its own gym_fork worker
(:class:`~gym_fork.ForkableEnv`), the workers step concurrently, and any slot can be captured
(:meth:`ForkableVectorEnv.snapshot`), put back (:meth:`~ForkableVectorEnv.restore`) or copied into
other slots (:meth:`~ForkableVectorEnv.fork_into`) in the middle of training.

It needs only Gymnasium and NumPy (no torch, no Stable-Baselines3); the SB3 counterpart is
:class:`gym_fork.vec_env.ForkableVecEnv`.
"""

from __future__ import annotations

import contextlib
import copy as copy_module
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import cloudpickle
import gymnasium as gym
import numpy as np
from gymnasium.spaces.utils import is_space_dtype_shape_equiv
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_differing_spaces, batch_space, concatenate, create_empty_array, iterate

from gym_fork.backends.base import Backend
from gym_fork.errors import IncompleteStepError, RestoreError
from gym_fork.interrupts import held
from gym_fork.env import (ForkableEnv, WorkerCall, check_rng, close_envs, ran_unanswered, share_cpus, start_envs,
                          take_autoreset)
from gym_fork.snapshots.snapshot import Snapshot
from gym_fork.worker.commands import EnvSource, build_env, make_source
from gym_fork.worker.reseed import reseed_env

__all__ = ["ForkableVectorEnv", "make_vec"]

EnvFn = str | Callable[[], gym.Env]

# Names the vector env uses to talk to the _Slot layer in a worker, through the public
# get_wrapper_attr / set_wrapper_attr of ForkableEnv (they run in the worker).
_DONE = "_gym_fork_vector_done"
_REQUEST = "_gym_fork_vector_request"
_REPLY = "_gym_fork_vector_reply"


class _Slot(gym.Wrapper):
    """The outermost layer of every sub-env, inside its worker.

    It records whether the last step ended the episode, so that this flag -- the slot's pending
    autoreset -- is part of the worker's state and travels with every snapshot, whatever backend
    took it and wherever it is restored.  It also runs ``call`` / ``set_attr`` requests on the
    user's env exactly as ``SyncVectorEnv`` does (``get_wrapper_attr`` on the user's outermost
    env, then a call when the attribute is callable), so methods run in the worker, never on a
    copy.  Otherwise it is transparent: same spec, same repr, steps and resets passed through.
    """

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self._done = (False, False)  # (terminated, truncated) of the last step; reset clears it
        self._reply: Any = None

    @property
    def spec(self):  # type: ignore[override]  # not an extra wrapper in the user's spec
        return self.env.spec

    def step(self, action: Any) -> tuple:
        out = self.env.step(action)
        self._done = (bool(out[2]), bool(out[3]))
        return out

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple:
        out = self.env.reset(seed=seed, options=options)
        self._done = (False, False)
        return out

    def get_wrapper_attr(self, name: str) -> Any:
        if name == _DONE:
            return self._done
        if name == _REPLY:  # one-shot: the worker keeps no reference to a call's result
            reply, self._reply = self._reply, None
            return reply
        return super().get_wrapper_attr(name)

    def set_wrapper_attr(self, name: str, value: Any, *, force: bool = True) -> bool:
        if name != _REQUEST:
            return super().set_wrapper_attr(name, value, force=force)
        kind, *args = value
        self._reply = None
        if kind == "call":
            attr_name, call_args, call_kwargs = args
            attr = self.env.get_wrapper_attr(attr_name)
            self._reply = attr(*call_args, **call_kwargs) if callable(attr) else attr
        elif kind == "set":
            self.env.set_wrapper_attr(*args)
        elif kind == "reseed":
            reseed_env(self.env, *args)
        else:
            raise ValueError(f"unknown vector slot request {kind!r}")
        return True

    def __str__(self) -> str:
        return str(self.env)

    def __repr__(self) -> str:
        return repr(self.env)


class _SlotFactory:
    """Builds one sub-env in its worker: the user's env (an id or a factory), the extra wrappers,
    and the :class:`_Slot` layer on top.  Pickled to the worker by reference to this module."""

    def __init__(self, source: EnvSource, wrappers: Sequence[Callable[[gym.Env], gym.Env]] = ()):
        self.source = source
        self.wrappers = tuple(wrappers)

    def __call__(self) -> gym.Env:
        env = build_env(self.source)
        for wrapper in self.wrappers:
            env = wrapper(env)
        return _Slot(env)


class ForkableVectorEnv(VectorEnv):
    """A Gymnasium vector env of N gym_fork workers that step concurrently, where any slot can be
    snapshotted, restored, or overwritten with copies of a snapshot of any slot.

    It behaves like :class:`gymnasium.vector.SyncVectorEnv` (same seeds and actions: bit-identical
    observations, rewards, terminations, truncations and infos), but every sub-env lives in its
    own process: :meth:`step` sends every worker its action before it reads any reply, so the
    sub-envs compute at the same time.  Episode ends follow ``autoreset_mode``
    (``metadata["autoreset_mode"]``), as in Gymnasium:

    - ``NEXT_STEP`` (default): the step after an episode end resets that sub-env (reward 0,
      not terminated, not truncated; its action is ignored).
    - ``SAME_STEP``: the ending step resets it at once; the last observation and info are in
      ``infos["final_obs"]`` / ``infos["final_info"]``.
    - ``DISABLED``: the caller resets ended sub-envs with ``reset(options={"reset_mask": mask})``
      before stepping them again.

    Snapshots: :meth:`snapshot` captures one slot; :meth:`restore` puts a snapshot into one slot;
    :meth:`fork_into` puts it into several, each an independent copy.  A snapshot carries the
    slot's pending autoreset: restore one taken right after an episode end and the next
    ``step()`` resets that slot (``NEXT_STEP``); restore one taken mid-episode into a slot whose
    episode had just ended and the next ``step()`` continues the snapshot's episode.  All slots
    share one lineage, so a snapshot of one slot restores into any slot.  A snapshot stays
    usable until it is released or this vector env is closed.

    Gymnasium wrappers stacked on *this* vector env (``gymnasium.wrappers.vector.*``) keep their
    state in this process and are not in snapshots; wrappers inside the sub-envs (the factory's,
    or ``make_vec(..., wrappers=[...])``) are.  Reach the snapshot API through vector wrappers
    with ``envs.unwrapped``.

    Example:
        >>> import numpy as np
        >>> from gym_fork.vector import ForkableVectorEnv
        >>> envs = ForkableVectorEnv(["CartPole-v1"] * 3)
        >>> obs, infos = envs.reset(seed=42)
        >>> obs.shape, envs.metadata["autoreset_mode"]
        ((3, 4), <AutoresetMode.NEXT_STEP: 'NextStep'>)
        >>> obs, rewards, terminations, truncations, infos = envs.step(np.array([1, 0, 1]))
        >>> snap = envs.snapshot(0)                           # slot 0, now
        >>> obs, infos = envs.fork_into(snap, [1, 2])         # slots 1 and 2 continue from it
        >>> bool((obs[1] == obs[0]).all() and (obs[2] == obs[0]).all())
        True
        >>> obs, *_ = envs.step(np.array([0, 0, 1]))          # now each goes its own way
        >>> bool((obs[1] == obs[0]).all()), bool((obs[2] == obs[0]).all())
        (True, False)
        >>> envs.get_attr("gravity")
        (9.8, 9.8, 9.8)
        >>> envs.close()

    Args:
        env_fns: one entry per sub-env: an env id (built with ``gymnasium.make`` in the worker) or
            a zero-argument factory returning a ``gymnasium.Env`` (pickled to the worker with
            cloudpickle, so a lambda or closure works).
        copy: return copies of the observation batch from :meth:`reset` and :meth:`step` (as
            ``SyncVectorEnv``); ``False`` returns this env's buffer, overwritten by the next call.
        observation_mode: ``"same"``, ``"different"`` or ``(batched_space, single_space)``, as
            ``SyncVectorEnv``.
        autoreset_mode: an :class:`gymnasium.vector.AutoresetMode` or its value (``"NextStep"``,
            ``"SameStep"``, ``"Disabled"``).
        backend: ``"auto"``, ``"criu"`` or ``"pickle"`` (see :class:`~gym_fork.ForkableEnv`);
            ``"pickle"`` runs every sub-env in this process, one after another.
        **forkable_kwargs: passed to every :class:`~gym_fork.ForkableEnv` (``verify``,
            ``record_actions``, ``worker_log``, ``fork_tier``, ``store``).

    Raises:
        ValueError: ``env_fns`` is empty, a mode is unknown, or ``workspace`` was given (one
            directory cannot back several sub-envs).
        TypeError: an entry of ``env_fns`` is neither an id nor a callable.
        gym_fork.errors.EnvNotShippableError: a factory cannot be pickled to a worker.
        RuntimeError: the sub-envs' spaces differ (as ``SyncVectorEnv``).

    Attributes:
        envs: the slots' :class:`~gym_fork.ForkableEnv` s.  Stepping one directly bypasses this
            env's autoreset bookkeeping; use the vector API.
    """

    def __init__(self, env_fns: Sequence[EnvFn], copy: bool = True,
                 observation_mode: str | tuple[gym.Space, gym.Space] = "same",
                 autoreset_mode: str | AutoresetMode = AutoresetMode.NEXT_STEP, *,
                 backend: str | Backend = "auto", **forkable_kwargs: Any):
        self._closing_envs: list[ForkableEnv] = []  # lets close() work after a failed __init__
        self.env_fns = env_fns
        self.copy = copy
        self.observation_mode = observation_mode
        self.autoreset_mode = (autoreset_mode if isinstance(autoreset_mode, AutoresetMode)
                               else AutoresetMode(autoreset_mode))
        if "workspace" in forkable_kwargs:
            raise ValueError("workspace= cannot be shared by several sub-envs; give each its own "
                             "gym_fork.ForkableEnv(..., workspace=DIR) instead")
        if isinstance(env_fns, (str, gym.Env)) or callable(env_fns) or not len(env_fns):
            raise ValueError("env_fns must be a non-empty list of env ids or zero-argument factories")
        factories = [self._factory(fn) for fn in env_fns]
        envs = start_envs(factories, backend=backend, **forkable_kwargs)
        self._closing_envs = envs
        # One lineage for all slots (they are interchangeable sub-envs), so a snapshot of any
        # slot restores into any other; ForkableEnv checks the lineage on every restore.
        for env in envs[1:]:
            env._share_lineage(envs[0])
        self.envs = envs
        self.num_envs = len(envs)
        self.metadata = dict(envs[0].metadata)
        self.metadata["autoreset_mode"] = self.autoreset_mode
        self.render_mode = envs[0].render_mode
        try:
            share_cpus(envs)  # (workers outnumbering the CPUs do not poll for requests)
            self._init_spaces(observation_mode)
        except BaseException:
            self.close()  # the workers are running: stop them before the error goes up
            raise

        self._env_obs: list[Any] = [None] * self.num_envs
        self._observations = create_empty_array(self.single_observation_space, n=self.num_envs, fn=np.zeros)
        self._rewards = np.zeros((self.num_envs,), dtype=np.float64)
        self._terminations = np.zeros((self.num_envs,), dtype=np.bool_)
        self._truncations = np.zeros((self.num_envs,), dtype=np.bool_)
        self._autoreset_envs = np.zeros((self.num_envs,), dtype=np.bool_)
        # sub-envs out of step since a step that Ctrl-C interrupted: no step until reset() has
        # reset them
        self._unsettled = np.zeros((self.num_envs,), dtype=np.bool_)
        self._unsettled_why = ""

    @staticmethod
    def _factory(fn: Any) -> _SlotFactory:
        if isinstance(fn, _SlotFactory):  # from make_vec
            return fn
        if isinstance(fn, gym.Env) or not (isinstance(fn, str) or callable(fn)):
            raise TypeError(f"env_fns entries must be env ids or zero-argument factories, not {type(fn).__name__}")
        return _SlotFactory(make_source(fn))

    def _init_spaces(self, observation_mode: str | tuple[gym.Space, gym.Space]) -> None:
        first = self.envs[0]
        self.single_action_space = first.action_space
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        if isinstance(observation_mode, tuple) and len(observation_mode) == 2:
            batched, single = observation_mode
            if not isinstance(batched, gym.Space) or not isinstance(single, gym.Space):
                raise TypeError(f"Expected both elements of observation_mode to be Spaces, got "
                                f"{type(batched)} and {type(single)}")
            self.observation_space, self.single_observation_space = batched, single
        elif observation_mode == "same":
            self.single_observation_space = first.observation_space
            self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        elif observation_mode == "different":
            self.single_observation_space = first.observation_space
            self.observation_space = batch_differing_spaces([e.observation_space for e in self.envs])
        else:
            raise ValueError(f"Invalid `observation_mode`, expected: 'same' or 'different' or tuple of "
                             f"single and batch observation space, actual got {observation_mode}")
        for env in self.envs:
            if observation_mode == "same":
                if env.observation_space != self.single_observation_space:
                    raise RuntimeError(
                        f"ForkableVectorEnv(..., observation_mode='same') but the sub-envs' observation "
                        f"spaces differ: {self.single_observation_space} and {env.observation_space}; "
                        "use observation_mode='different' if that is intended")
            elif not is_space_dtype_shape_equiv(env.observation_space, self.single_observation_space):
                raise RuntimeError(
                    f"the sub-envs' observation spaces differ in shape or dtype: "
                    f"{self.single_observation_space} and {env.observation_space}")
            if env.action_space != self.single_action_space:
                raise RuntimeError(f"the sub-envs' action spaces differ: {self.single_action_space} and "
                                   f"{env.action_space}")

    # --- the VectorEnv API ------------------------------------------------------------------------
    @property
    def np_random_seed(self) -> tuple[int, ...]:  # type: ignore[override]
        """The sub-envs' ``np_random_seed`` (as ``SyncVectorEnv``)."""
        return self.get_attr("np_random_seed")

    @property
    def np_random(self) -> tuple[np.random.Generator, ...]:  # type: ignore[override]
        """Copies of the sub-envs' random generators (as ``SyncVectorEnv``, but fetched from the
        workers: changing them here changes nothing there)."""
        return self.get_attr("np_random")

    def reset(self, *, seed: int | list[int | None] | None = None,
              options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        """Reset every sub-env (or those in ``options["reset_mask"]``) and batch the results.

        Args:
            seed: ``None`` (each sub-env keeps its own randomness), an int ``s`` (sub-env ``i``
                gets ``s + i``) or a list with one seed (or ``None``) per sub-env.
            options: passed to every sub-env's ``reset``; a boolean array
                ``options["reset_mask"]`` (taken out of the dict) selects the sub-envs to reset.

        Returns:
            The batched observations and the ``_key``-masked infos of the sub-envs that were reset.
        """
        if seed is None:
            seed = [None for _ in range(self.num_envs)]
        elif isinstance(seed, int):
            seed = [seed + i for i in range(self.num_envs)]
        if len(seed) != self.num_envs:
            raise ValueError(f"If seeds are passed as a list the length must match num_envs={self.num_envs} "
                             f"but got length={len(seed)}.")
        mask = np.ones((self.num_envs,), dtype=np.bool_)
        if options is not None and "reset_mask" in options:
            mask = options.pop("reset_mask")
            if not isinstance(mask, np.ndarray):
                raise TypeError(f"`options['reset_mask']` must be a numpy array, got {type(mask)}")
            if mask.shape != (self.num_envs,):
                raise ValueError(f"`options['reset_mask']` must have shape `({self.num_envs},)`, got {mask.shape}")
            if mask.dtype != np.bool_:
                raise TypeError(f"`options['reset_mask']` must have `dtype=np.bool_`, got {mask.dtype}")
            if not np.any(mask):
                raise ValueError(f"`options['reset_mask']` must contain a boolean array with at least one "
                                 f"True value, got reset_mask={mask}")
        self._terminations[mask] = False
        self._truncations[mask] = False
        self._autoreset_envs[mask] = False
        infos: dict[str, Any] = {}
        for i in np.flatnonzero(mask):
            self._env_obs[i], env_info = self.envs[i].reset(seed=seed[i], options=options)
            self._unsettled[i] = False
            infos = self._add_info(infos, env_info, i)
        return self._batch_obs(), infos

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Step every sub-env (resetting those whose episode ended, per ``autoreset_mode``).

        All workers get their action before any reply is read, so they step concurrently.

        Returns:
            Batched ``(observations, rewards, terminations, truncations, infos)``.

        Raises:
            AssertionError: ``autoreset_mode`` is ``DISABLED`` and a sub-env whose episode ended
                was not reset (nothing is stepped then).
            Exception: what a sub-env's ``step`` or ``reset`` raised (a
                :class:`~gym_fork.errors.WorkerError` that is also the env's own type), once every
                sub-env's reply is read. Each sub-env's step count and action log say what its
                worker did: a step that ran counts even where the reset right after it raised
                (``SAME_STEP``) or its answer could not come back
                (:class:`~gym_fork.errors.NotSendableError`). The other sub-envs' steps stand:
                their record (observation, episode end, pending autoreset) follows their workers,
                and the error's ``partial_step`` holds this step's results, ``(observations,
                rewards, terminations, truncations, infos, failed)`` (``failed``: the slots whose
                rows are their old ones). ``restore()`` or ``reset()`` the failed slots to go on;
                ``reset()`` brings all back in line.
        """
        actions = list(iterate(self.action_space, actions))
        if len(actions) != self.num_envs:
            raise ValueError(f"expected {self.num_envs} actions, got {len(actions)}")
        mode = self.autoreset_mode
        if mode not in (AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED):
            raise ValueError(f"Unexpected autoreset mode, {mode}")
        if mode == AutoresetMode.DISABLED and self._autoreset_envs.any():
            raise AssertionError(
                f"sub-envs {np.flatnonzero(self._autoreset_envs).tolist()} ended their episode and were not "
                f"reset (autoreset_mode=DISABLED): call reset(options={{'reset_mask': mask}}) first; "
                f"self._autoreset_envs={self._autoreset_envs}")
        if self._unsettled.any():
            raise IncompleteStepError(
                f"the last step did not complete ({self._unsettled_why}): sub-envs "
                f"{np.flatnonzero(self._unsettled).tolist()} are out of step with each other and with the "
                "observations you hold. Call reset() first (all of them, or those in options['reset_mask']).")
        resetting = self._autoreset_envs.copy() if mode == AutoresetMode.NEXT_STEP else np.zeros_like(
            self._autoreset_envs)
        try:
            return self._step(actions, mode, resetting)
        except BaseException as e:
            # (after an error the caller decides: reset(), or restore() of a dead slot, as before)
            if not isinstance(e, Exception):  # Ctrl-C: the steps sent run all the same
                for env, action in zip(self.envs, actions):  # (also one interrupted inside its step_send())
                    env._give_up_request(lambda env=env, action=action: env._settle_step(action, may_reset=True))
                self._unsettled[:] = True
                self._unsettled_why = "interrupted"
            raise

    def _step(self, actions: list, mode: AutoresetMode,
              resetting: np.ndarray) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        results: list[Any] = [None] * self.num_envs
        error: BaseException | None = None
        same_step = mode == AutoresetMode.SAME_STEP
        calls: dict[int, WorkerCall] = {}  # the sub-envs reset now (NEXT_STEP), sent with the steps
        sent = []
        for i, (env, action) in enumerate(zip(self.envs, actions)):
            if resetting[i]:
                calls[i] = WorkerCall(env, "reset", (None, None))
                continue
            try:
                # (a row of a Box batch, a Dict action's arrays: views of the caller's arrays;
                # the env records its own copy.) SAME_STEP: the worker resets right after a step
                # that ends the episode and sends the reset with it: no round trip of its own
                env._step_send(action, same_step)
                sent.append(i)
            except Exception as e:  # noqa: BLE001 - raised once every sent step is answered
                error = error or e
        # Every request is out before any reply is read: the resets run while the others step.
        for i in range(self.num_envs):
            try:
                if i in calls:
                    results[i] = calls[i].result()
                    self.envs[i]._record_reset()
                elif i in sent:
                    results[i] = self.envs[i].step_receive()
            except Exception as e:  # noqa: BLE001
                error = error or e
                if i in calls and ran_unanswered(e):  # (it reset: only its answer did not come back)
                    self.envs[i]._record_reset()
        finals: dict[int, tuple] = {}
        unreset: set[int] = set()
        if same_step:  # (also where another sub-env failed: a worker that reset is accounted for)
            for i in sent:
                out = results[i]
                if out is None or not (out[2] or out[3]):
                    continue
                finals[i] = out
                try:  # (raises where the env's reset after the step did: the step stands)
                    reset = take_autoreset(self.envs[i], out[4])
                    if reset is None and error is None:  # an older gym_fork's worker: a request of its own
                        reset = self.envs[i].reset()
                except Exception as e:  # noqa: BLE001
                    error, reset = error or e, None
                if reset is None:
                    unreset.add(i)
                else:
                    results[i] = out[:4] + (reset,)
        # (a slot whose step or reset failed, or whose episode ended with no reset after it: only
        # ever with an error, so a step that went well builds no list)
        failed = [i for i in range(self.num_envs) if results[i] is None or i in unreset] if error is not None else ()
        infos: dict[str, Any] = {}
        for i in range(self.num_envs):
            if i in failed:
                # (its record stays; the slot is where its worker is: restore() or reset() it)
                continue
            if resetting[i]:
                self._env_obs[i], env_info = results[i]
                self._rewards[i] = 0.0
                self._terminations[i] = False
                self._truncations[i] = False
            elif i in finals:
                final_obs, self._rewards[i], self._terminations[i], self._truncations[i], final_info = finals[i]
                infos = self._add_info(infos, {"final_obs": final_obs, "final_info": final_info}, i)
                self._env_obs[i], env_info = results[i][4]
            else:
                (self._env_obs[i], self._rewards[i], self._terminations[i], self._truncations[i],
                 env_info) = results[i]
            infos = self._add_info(infos, env_info, i)
        self._autoreset_envs = np.logical_or(self._terminations, self._truncations)
        out = (self._batch_obs(), np.copy(self._rewards), np.copy(self._terminations), np.copy(self._truncations), infos)
        if error is not None:
            # The other sub-envs did step (and reset at an episode's end). Their record above
            # follows their workers -- before, it stayed where it was, so a learner that
            # restored the failed slot and stepped on fed them stale observations and stepped
            # past their episodes' ends -- and their results travel with the error.
            with contextlib.suppress(AttributeError, TypeError):  # (an exception that takes no attribute)
                error.partial_step = (*out, list(failed))
            raise error
        return out

    def render(self) -> tuple[Any, ...]:
        """Every sub-env's ``render()``, in slot order."""
        return tuple(env.render() for env in self.envs)

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """In every worker: ``env.get_wrapper_attr(name)``, called with ``args`` / ``kwargs`` when
        it is callable (as ``SyncVectorEnv``).  Arguments and results are pickled."""
        return tuple(self._slot_call(env, name, args, kwargs) for env in self.envs)

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """Every sub-env's attribute ``name`` (``call(name)``, as ``SyncVectorEnv``)."""
        return self.call(name)

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | Any) -> None:
        """``env.set_wrapper_attr(name, value)`` in every worker; ``values`` is one value for all
        or a list/tuple of one per sub-env.

        Raises:
            ValueError: a list/tuple whose length is not ``num_envs``.
        """
        if not isinstance(values, (list, tuple)):
            values = [values for _ in range(self.num_envs)]
        if len(values) != self.num_envs:
            raise ValueError("Values must be a list or tuple with length equal to the number of environments. "
                             f"Got `{len(values)}` values for {self.num_envs} environments.")
        for env, value in zip(self.envs, values):
            env.set_wrapper_attr(_REQUEST, ("set", name, value))

    def close_extras(self, **kwargs: Any) -> None:
        """Stop every worker; snapshots taken from this env are released."""
        close_envs(self._closing_envs)

    # --- snapshots -------------------------------------------------------------------------------
    @property
    def pending_reset(self) -> np.ndarray:
        """Which sub-envs have ended their episode and not been reset yet (a copy): with
        ``NEXT_STEP`` their next ``step()`` resets them, with ``DISABLED`` the caller must reset
        them; always all ``False`` with ``SAME_STEP``.  Restores and forks set it from the
        snapshot."""
        if self.autoreset_mode == AutoresetMode.SAME_STEP:
            return np.zeros((self.num_envs,), dtype=np.bool_)
        return self._autoreset_envs.copy()

    def snapshot(self, index: int, *, restore_soon: bool | None = None) -> Snapshot:
        """Capture sub-env ``index`` now, including whether its episode has just ended; the
        sub-env keeps running.  Restorable into any slot of this env. ``restore_soon``: as
        :meth:`gym_fork.ForkableEnv.snapshot` (prepare the first restore ahead; None: guessed).

        Raises:
            IndexError: no such slot.
            gym_fork.errors.SnapshotError: the backend failed; the sub-env is unchanged.
        """
        return self.envs[self._slot(index)].snapshot(restore_soon=restore_soon)

    def restore(self, index: int, snapshot: Snapshot) -> tuple[Any, dict[str, Any]]:
        """Put ``snapshot`` (of any slot) into slot ``index``; the other slots are untouched.

        The slot's pending autoreset comes from the snapshot: with ``NEXT_STEP`` a snapshot taken
        right after an episode end makes the next ``step()`` reset the slot, a mid-episode one
        makes it continue; with ``DISABLED`` the former must be reset through ``reset_mask``
        first; with ``SAME_STEP`` an ended episode is reset here at once (the returned info then
        holds ``final_obs`` / ``final_info``, as a step's would).

        Returns:
            The slot's ``(observation, info)``: those the snapshot's sub-env had returned last.

        Raises:
            IndexError: no such slot.
            gym_fork.errors.RestoreError: the snapshot cannot be restored here (released, of
                another env); the slot is unchanged.
        """
        i = self._slot(index)
        with held():  # a Ctrl-C raises after the slot's record follows its worker (_restore_slot)
            info = self._restore_slot(i, snapshot)
            self._observations = concatenate(self.single_observation_space, self._env_obs, self._observations)
        obs = self._env_obs[i]
        return (copy_module.deepcopy(obs) if self.copy else obs), info

    def fork_into(self, snapshot: Snapshot, indices: Sequence[int], *,
                  rng: Literal["same", "reseed"] = "same",
                  seeds: Sequence[int] | None = None) -> tuple[Any, dict[str, Any]]:
        """Put ``snapshot`` into every slot in ``indices``: each continues from it as an
        independent copy (its own process); the other slots, including the one the snapshot was
        taken from unless it is listed, are untouched.

        Args:
            snapshot: a snapshot of any slot of this env.
            indices: distinct slot numbers.
            rng: ``"same"``: every copy keeps the snapshot's randomness (the same actions give the
                same trajectories); ``"reseed"``: every generator each copy's env draws from
                (``np_random``, its own, ALE's, its worker's global ones) is reseeded from
                ``seeds[k]`` or fresh entropy, the simulated state unchanged -- as
                :meth:`gym_fork.ForkableEnv.fork`.
            seeds: with ``rng="reseed"``, one seed per index.

        Returns:
            Like a masked ``reset()``: the whole observation batch, and the ``_key``-masked infos
            of the slots in ``indices`` (each the info the snapshot's sub-env had returned last).

        Raises:
            ValueError: bad ``indices``, ``rng`` or ``seeds``.
            gym_fork.errors.RestoreError: the snapshot cannot be restored here; no slot changed
                when it is refused up front (released, of another env), and when a restore fails
                part way, the slots listed before the failing one already hold the snapshot.
            KeyboardInterrupt: a Ctrl-C lands once the slot being restored holds the snapshot
                (reseeded as asked); the slots after it are untouched.
        """
        idx = [int(i) for i in indices]
        if not idx:
            raise ValueError("indices is empty")
        if len(set(idx)) != len(idx) or not all(0 <= i < self.num_envs for i in idx):
            raise ValueError(f"indices must be distinct slots in 0..{self.num_envs - 1}, got {idx}")
        check_rng(rng, seeds, len(idx), "len(indices)")
        if not isinstance(snapshot, Snapshot):
            raise TypeError(f"expected a gym_fork.Snapshot, got {type(snapshot).__name__}")
        snapshot.payload()  # a released snapshot is refused before any slot changes
        slot_infos = {}
        for k, i in enumerate(idx):
            # a Ctrl-C raises between two slots: each holds its old state or the snapshot,
            # reseeded as asked, with its record (_restore_slot)
            with held():
                slot_infos[i] = self._restore_slot(i, snapshot)
                if rng == "reseed":
                    seed = int(seeds[k]) if seeds is not None else int(np.random.SeedSequence().entropy % (2**63))
                    self.envs[i].set_wrapper_attr(_REQUEST, ("reseed", seed))
        infos: dict[str, Any] = {}
        for i in sorted(slot_infos):
            infos = self._add_info(infos, slot_infos[i], i)
        return self._batch_obs(), infos

    # --- internals -------------------------------------------------------------------------------
    def _slot(self, index: int) -> int:
        i = int(index)
        if not 0 <= i < self.num_envs:
            raise IndexError(f"slot {index} out of range: this env has {self.num_envs} sub-envs")
        return i

    def _restore_slot(self, i: int, snapshot: Snapshot) -> dict[str, Any]:
        """Restore slot ``i`` and its autoreset bookkeeping; returns the slot's info. Call it
        inside :func:`~gym_fork.interrupts.held`: a Ctrl-C between the slot's switch to the
        restored worker and its record here left the record of the old state (whether its episode
        had ended: the next step then reset a restored mid-episode slot, or stepped on past an
        ended one)."""
        env = self.envs[i]
        unknown: list[bool] = []
        obs, info = env._restore(snapshot, lambda new, snap: self._accept(i, new, snap, unknown))
        if unknown:
            # A snapshot of an env that never ran in a vector slot (a bundle of a plain
            # ForkableEnv): whether its episode had ended is not recorded.
            warnings.warn(f"snapshot {snapshot.id} does not record whether its episode had ended "
                          f"(it was not taken from a ForkableVectorEnv slot); slot {i} treats it as "
                          "mid-episode", stacklevel=3)
            terminated = truncated = False
        else:
            terminated, truncated = env.get_wrapper_attr(_DONE)
        if (terminated or truncated) and self.autoreset_mode == AutoresetMode.SAME_STEP:
            # A SAME_STEP slot never rests at an episode end: reset it as its step would have.
            reset_obs, reset_info = env.reset()
            info = {"final_obs": obs, "final_info": info, **reset_info}
            obs, terminated, truncated = reset_obs, False, False
        self._env_obs[i] = obs
        self._terminations[i], self._truncations[i] = terminated, truncated
        self._autoreset_envs[i] = terminated or truncated
        return info

    def _accept(self, i: int, new: Any, snapshot: Snapshot, unknown: list[bool]) -> None:
        """Before slot ``i`` switches to ``new``, a worker restored from ``snapshot``: its env must
        have this vector env's spaces (a loaded bundle of another env's stack: refused, and the
        slot keeps running), and the slot layer, put on where the snapshot was taken without one
        (else ``call``/``get_attr``/``set_attr`` would not reach its env)."""
        meta = snapshot._mirror if snapshot._mirror is not None else new.request("meta")
        for name, want in (("observation", self.single_observation_space), ("action", self.single_action_space)):
            got = meta[f"{name}_space"]
            if got != want:
                raise RestoreError(
                    f"snapshot {snapshot.id}'s env has the {name} space {got}, and slot {i} of this vector env "
                    f"{want}: it cannot be one of its sub-envs. Restore it into a ForkableEnv "
                    f"(ForkableEnv.from_snapshot), or into a vector env of that env. Slot {i} is unchanged.")
        try:
            new.request("getattr", _DONE, "wrapper")  # (a WorkerError from a worker is one too)
            return
        except AttributeError:
            pass
        new.request("wrap", cloudpickle.dumps(_Slot))
        unknown.append(True)

    def _slot_call(self, env: ForkableEnv, name: str, args: tuple, kwargs: dict) -> Any:
        env.set_wrapper_attr(_REQUEST, ("call", name, args, kwargs))
        # the reply's value itself, pickled (get_wrapper_attr would hand objects back as references)
        return env._request("getattr", _REPLY, "wrapper")

    def _batch_obs(self) -> Any:
        self._observations = concatenate(self.single_observation_space, self._env_obs, self._observations)
        return copy_module.deepcopy(self._observations) if self.copy else self._observations

    def __getstate__(self) -> dict:
        raise TypeError("a ForkableVectorEnv cannot be pickled (its sub-envs are live processes); "
                        "save a slot with snapshot(i).save(path) instead")


def make_vec(id: str, num_envs: int = 1, *, vector_kwargs: dict[str, Any] | None = None,
             wrappers: Sequence[Callable[[gym.Env], gym.Env]] | None = None,
             backend: str | Backend = "auto", **kwargs: Any) -> ForkableVectorEnv:
    """The :func:`gymnasium.make_vec` twin: ``num_envs`` sub-envs of ``id`` in gym_fork workers.

    Args:
        id: a registered env id (``"module:Env-v0"`` imports ``module`` first).
        num_envs: how many sub-envs.
        vector_kwargs: for :class:`ForkableVectorEnv` (``autoreset_mode``, ``copy``, ...).
        wrappers: applied to each sub-env in its worker, innermost first (they are snapshotted).
        backend: see :class:`ForkableVectorEnv`.
        **kwargs: for ``gymnasium.make`` in each worker.

    Example:
        >>> from gym_fork.vector import make_vec
        >>> envs = make_vec("CartPole-v1", num_envs=2, vector_kwargs={"autoreset_mode": "SameStep"})
        >>> envs
        ForkableVectorEnv(CartPole-v1, num_envs=2)
        >>> envs.close()
    """
    if num_envs < 1:
        raise ValueError(f"num_envs must be >= 1, got {num_envs}")
    vector_kwargs = dict(vector_kwargs or {})
    source = make_source(id, kwargs)
    envs = ForkableVectorEnv([_SlotFactory(source, wrappers or ()) for _ in range(num_envs)],
                             backend=backend, **vector_kwargs)
    spec = copy_module.deepcopy(gym.spec(id))
    spec.kwargs = {**spec.kwargs, **kwargs}
    if num_envs != 1:
        spec.kwargs["num_envs"] = num_envs
    envs.spec = spec
    return envs
