"""The env side of the protocol: what a worker does with each command.

:class:`EnvServer` owns one ``gymnasium.Env`` (the whole wrapper stack that ``gymnasium.make``
built) and answers commands on it.  The worker process (:mod:`gym_fork.worker.loop`) feeds it
commands from its channel; the in-process pickle backend calls it directly.  Keeping both on one
class means every backend steps the env through exactly the same code.
"""

from __future__ import annotations

import collections
import copy
import functools
import importlib
import os
import pickletools
import sys
import time
import traceback
from typing import Any, Callable

import cloudpickle
import gymnasium as gym
import numpy as np

from gym_fork.errors import EnvNotShippableError, PolicyError
from gym_fork.snapshots.set_order import address_order_hazard, copy_problem
from gym_fork.worker import checker, files, fswatch, mounts, refs, registry
from gym_fork.worker.reseed import reseed_env, reseed_policy
from gym_fork.worker.channel import PACKED_VERSION

# ("id", env_id, kwargs) | ("factory", cloudpickled zero-arg callable) | ("instance", cloudpickled env)
# | ("registered", registry.pack() of the learner, source): the learner's own env registrations first
# | ("wrapped", cloudpickled list of wrappers, source): wrappers applied in the worker, innermost first
EnvSource = tuple


def build_env(source: EnvSource) -> gym.Env:
    """Create the env a source describes (runs inside the worker)."""
    if source[0] == "registered":
        registry.install(source[1])
        return build_env(source[2])
    if source[0] == "wrapped":
        env = build_env(source[2])
        for wrap in cloudpickle.loads(source[1]):
            env = wrap(env)
            if not isinstance(env, gym.Env):
                raise TypeError(f"the wrapper {wrap!r} returned {type(env).__name__}, not a gymnasium.Env")
    else:
        env = _build(source)
    registry.publish_main_types(env)  # results holding its __main__ classes pickle back by name
    return env


def _build(source: EnvSource) -> gym.Env:
    kind = source[0]
    if kind == "id":
        _, env_id, kwargs = source
        if env_id.startswith("ALE/"):
            import ale_py  # registers the ALE/ namespace

            gym.register_envs(ale_py)
        return gym.make(env_id, **kwargs)
    obj = cloudpickle.loads(source[1])
    env = obj() if kind == "factory" else obj
    if not isinstance(env, gym.Env):
        raise TypeError(f"the env factory returned {type(env).__name__}, not a gymnasium.Env")
    return env


def make_source(env: Any, env_kwargs: dict | None = None, wrappers: Any = None) -> EnvSource:
    """Describe ``env`` (an id, a zero-argument factory, or an instance) so a worker can build it;
    the envs this process registered itself travel with it (:mod:`gym_fork.worker.registry`).
    ``wrappers`` (classes or ``env -> env`` callables) are applied in the worker, innermost first."""
    source = _source(env, env_kwargs)
    if wrappers:
        try:
            source = ("wrapped", cloudpickle.dumps(list(wrappers)), source)
        except Exception as e:  # noqa: BLE001
            raise EnvNotShippableError(
                f"cannot send the wrappers {wrappers!r} to the worker process ({type(e).__name__}: {e}). "
                "Pass wrapper classes, or functions/lambdas that close over picklable values only.") from e
    try:
        regs = registry.pack(env if isinstance(env, str) else None)
    except Exception as e:  # noqa: BLE001 - the needed spec does not pickle
        raise EnvNotShippableError(
            f"cannot send the registration of env {env!r} to the worker process ({type(e).__name__}: {e}). "
            "Register it with an entry point the worker can import ('package.module:Class') or a class "
            "or function that pickles.") from e
    return ("registered", regs, source) if regs else source


def is_sb3_model(obj: Any) -> bool:
    """Whether ``obj`` is used as a Stable-Baselines3 model (``predict`` and a ``policy``), without
    importing SB3."""
    return hasattr(obj, "predict") and hasattr(obj, "policy")


def pickle_policy(policy: Any) -> bytes:
    """``policy`` (a callable ``obs -> action``) as bytes the worker unpickles into its own copy
    (:meth:`EnvServer.cmd_policy_rollout`). Raises TypeError naming what to pass instead."""
    if is_sb3_model(policy):
        raise TypeError(
            "a Stable-Baselines3 model cannot run inside the env's worker (it would import torch into "
            "every copy); run it in the learner, batched: explore(env, snap, model) without "
            "policy_in_worker=True")
    if not callable(policy):
        raise TypeError(f"policy must be a callable obs -> action, not {type(policy).__name__}")
    try:
        return cloudpickle.dumps(policy)
    except Exception as e:  # noqa: BLE001 - any pickling failure means the same thing here
        raise TypeError(
            f"cannot send the policy {policy!r} to the worker process ({type(e).__name__}: {e}). Use a "
            "module-level function, a lambda or an object that pickles (closing over picklable values "
            "only), or run the policy in the learner (policy_in_worker=False).") from e


def _source(env: Any, env_kwargs: dict | None) -> EnvSource:
    if isinstance(env, str):
        return ("id", env, dict(env_kwargs or {}))
    if isinstance(env, gym.envs.registration.EnvSpec):  # as gymnasium.make(spec, **kwargs)
        return ("factory", cloudpickle.dumps(functools.partial(gym.make, env, **(env_kwargs or {}))))
    if env_kwargs:
        raise TypeError("env_kwargs is only accepted together with an env id string or an EnvSpec")
    if isinstance(env, gym.Env):
        _refuse_ezpickle_instance(env)
        _refuse_uncopyable_state(env)
        try:
            return ("instance", cloudpickle.dumps(env))
        except Exception as e:  # noqa: BLE001 - any pickling failure means the same thing here
            raise EnvNotShippableError(
                f"cannot send the env instance {env!r} to the worker process ({type(e).__name__}: {e}). "
                "Pass an env id (ForkableEnv('CartPole-v1')) or a zero-argument factory "
                "(ForkableEnv(lambda: MyEnv(...))) instead, so the worker builds the env itself."
            ) from e
    if callable(env):
        try:
            return ("factory", cloudpickle.dumps(env))
        except Exception as e:  # noqa: BLE001
            raise EnvNotShippableError(
                f"cannot send the env factory {env!r} to the worker process ({type(e).__name__}: {e}). "
                "Use a module-level function or a lambda that closes over picklable values only."
            ) from e
    raise TypeError(
        f"env must be an env id (str), an EnvSpec, a zero-argument factory or a gymnasium.Env, not "
        f"{type(env).__name__}"
    )


def _refuse_ezpickle_instance(env: gym.Env) -> None:
    """An EzPickle env (Box2D, MuJoCo, ALE) pickles as its constructor arguments only: the worker
    would build a fresh, un-reset env instead of this one."""
    layer = env
    while True:
        if isinstance(layer, gym.utils.EzPickle):
            spec = getattr(env, "spec", None)
            kw = f", env_kwargs={dict(spec.kwargs)!r}" if spec is not None and spec.kwargs else ""
            by_id = f"ForkableEnv({spec.id!r}{kw}) or " if spec is not None else ""
            raise EnvNotShippableError(
                f"cannot send the env instance {env!r} to the worker process exactly: "
                f"{type(layer).__name__} is a gymnasium EzPickle env, whose pickle holds only its constructor "
                "arguments, so the worker would get a fresh, different env (its state, even whether it was "
                f"reset, would be lost). Pass its id or a factory instead, so the worker builds it: {by_id}"
                "ForkableEnv(lambda: gym.make(...)).")
        if not isinstance(layer, gym.Wrapper):
            return
        layer = layer.env


def _refuse_uncopyable_state(env: gym.Env) -> None:
    """The worker is another process, where strings hash differently: a set of them (or of
    objects hashed by address, or one that shrank) the instance holds would iterate there in
    another order than here, and arrays that share memory here would be separate there; the env
    would go on differently."""
    found = copy_problem(env, cross_process=True)
    if found is not None:
        raise EnvNotShippableError(
            f"cannot send the env instance {env!r} to the worker process exactly: it holds {found[0]}, which "
            "the worker (another process) would not hold alike, so the env could go on differently. Pass an "
            "env id or a zero-argument factory instead, so the worker builds the env itself: "
            "ForkableEnv(lambda: MyEnv(...)).")


#: a rollout looks every this many steps whether its controller is still waiting (one select())
ABANDON_CHECK_EVERY = 64


class RolloutAbandoned(Exception):
    """The controller closed the channel (or asked to retire) while a rollout ran: it ends."""


_SUBIMPORT = ("global", "cloudpickle.cloudpickle", "subimport")  # how cloudpickle refers to a module


def pickled_modules(blob: bytes) -> list[str]:
    """The modules unpickling ``blob`` imports, in order: those its ``GLOBAL`` / ``STACK_GLOBAL``
    opcodes name, and those cloudpickle's ``subimport(name)`` brings back (a function's module
    globals). Read from the opcodes with their stack effects, nothing unpickled; [] for what is
    not a well-formed pickle."""
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    out: list[str] = []
    mark = object()
    try:
        for op, arg, _pos in pickletools.genops(blob):
            name = op.name
            if name == "MEMOIZE":
                memo[len(memo)] = stack[-1] if stack else None
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = stack[-1] if stack else None
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo.get(arg))
            elif name == "GLOBAL":  # protocols 0-3: "module name"
                module, _, attr = str(arg).partition(" ")
                out.append(module)
                stack.append(("global", module, attr))
            elif name == "STACK_GLOBAL":  # protocol 4+: module and name pushed just before
                module, attr = (stack[-2], stack[-1]) if len(stack) >= 2 else (None, None)
                if type(module) is str:
                    out.append(module)
                del stack[-2:]
                stack.append(("global", module, attr))
            else:  # any other opcode: its stack effect, keeping the strings it pushes
                before, after = op.stack_before, op.stack_after
                if pickletools.markobject in before:
                    while stack and stack[-1] is not mark:
                        stack.pop()
                    if stack:
                        stack.pop()
                    del stack[len(stack) - before.index(pickletools.markobject):]
                elif before:
                    del stack[len(stack) - len(before):]
                for kind in after:
                    stack.append(mark if kind is pickletools.markobject else arg if type(arg) is str else None)
            if len(stack) >= 2 and type(stack[-1]) is str and stack[-2] == _SUBIMPORT:
                out.append(stack[-1])  # subimport's argument, pushed right after it
    except Exception:  # noqa: BLE001 - not a pickle we can read: nothing to import ahead
        return []
    return list(dict.fromkeys(out))


def _own_copy(obs: Any) -> Any:
    """A copy of an observation for a policy to keep or change (arrays copied, the rest deep-copied)."""
    if type(obs) is np.ndarray:
        return obs.copy()
    return copy.deepcopy(obs)


own_copy = _own_copy

#: action types that the caller may change after the step (a policy filling one buffer for every
#: step): recorded as copies, else every recorded action would be the buffer's last content and
#: a snapshot's (or a branch's) ``actions`` would replay to another state
MUTABLE_ACTIONS = frozenset({np.ndarray, list, dict, tuple, collections.OrderedDict})  # (a tuple may hold arrays)


def own_action(action: Any) -> Any:
    """``action``, or a copy of it where the caller could change it after the step (MUTABLE_ACTIONS)."""
    t = type(action)
    if t is np.ndarray:
        return action.copy()
    if t in MUTABLE_ACTIONS or isinstance(action, (list, dict, tuple)):
        return copy.deepcopy(action)
    return action


#: the key under which a step's info carries the reset that followed it (EnvServer.cmd_step's reset_at_end)
AUTORESET_KEY = "_gym_fork_autoreset"

#: where the env's reset right after such a step raised: the step's info carries, under this key
#: instead, ``(type name, message, traceback)`` as an error reply says them (plain strings: a
#: controller of an older gym_fork, which knows no such key, resets the env by a request of its own)
AUTORESET_ERROR_KEY = "_gym_fork_autoreset_error"


class EnvServer:
    """Executes protocol commands on one env and remembers the latest (obs, info)."""

    def __init__(self, env: gym.Env):
        self.env = env
        self.last_obs: Any = None
        self.last_info: dict = {}
        self.steps = 0  # steps since the last reset
        self.rollout_actions: list = []  # the steps the latest rollout completed
        # ... and its name, drawn afresh for each rollout: the controller settling a rollout
        # interrupted by Ctrl-C tells by it whether it has accounted for this one already (a step
        # count cannot tell: a reset inside a rollout can bring it back to the same number)
        self.rollout_id: str | None = None
        # set by the serving loop: whether the controller stopped waiting (closed the channel, or
        # sent anything: mid-request that can only be a retire) -- a long rollout ends then
        self.abandoned: Callable[[], bool] = lambda: False
        # the serving loop's average wait for the next request when it took a fork-tier
        # snapshot: the snapshot's copies start polling at that pace (worker.channel.SpinWait)
        self.pace: float | None = None
        # the cap on that polling when the controller set one (``poll``: a vector env whose
        # workers outnumber the free CPUs turns polling off); None: GYM_FORK_WORKER_SPIN_US.
        # Kept by the snapshot's copies (this object is in their memory), as the pace is
        self.poll_cap: float | None = None
        # policies unpickled ahead of a batch of branches (cmd_load_policy), by index
        self.policies: list = []
        self.torch_ahead = False  # torch was imported by a policy loaded ahead (_note_torch_ahead)
        # this copy's seed (fork(..., rng="reseed")) and the generators reseeded from it, by id:
        # a policy run here later is reseeded from the same seed (cmd_policy_rollout)
        self.copy_seed: int | None = None
        self.reseeded: dict[int, Any] = {}
        # The env's generators as reseed.generators_of(env) lists them, found by a frozen snapshot
        # whose copies will be reseeded first (fork(..., rng="reseed")), once for all of them: a
        # copy's own walk of the env's objects cost it ~1 ms of CPU in copy-on-write faults (every
        # object it visits is written: reference counts). A copy has the very objects its frozen
        # snapshot walked, so the list holds for its reseed -- until it runs any other request
        # that may run the env's code (the worker loop then drops it: _KEEP_GENERATORS).
        self.generators: list | None = None

    def dispatch(self, cmd: str, args: tuple) -> Any:
        method: Callable | None = getattr(self, "cmd_" + cmd, None)
        if method is None:
            raise ValueError(f"unknown worker command {cmd!r}")
        return method(*args)

    # --- the Gymnasium API -------------------------------------------------------------------
    def cmd_step(self, action: Any, reset_at_end: bool = False) -> tuple:
        """The env's step. ``reset_at_end`` (packed kind "A": a vector env's step, an explore()
        branch that goes on past episode ends): a step that ends the episode is followed by a
        reset at once, sent with it (:meth:`_reset_after`), so the controller needs no round trip
        of its own to reset. Per request, never a standing mode: a worker snapshotted or stepped
        directly afterwards steps as any other."""
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.last_obs, self.last_info = obs, info
        self.steps += 1
        if reset_at_end and (terminated or truncated):
            return obs, reward, terminated, truncated, self._reset_after(info)
        return obs, reward, terminated, truncated, info

    def _reset_after(self, info: dict) -> dict:
        """The episode just ended: reset now (see :meth:`cmd_step`); ``info`` (a copy: the env's
        own dict is not changed) with the new episode's (obs, info) under AUTORESET_KEY -- or,
        where the env's reset raised, what it raised under AUTORESET_ERROR_KEY: the step was
        taken all the same, and its reply must say so (an error reply would tell the controller
        it was not, and its step count and action log would lag the worker's by that step)."""
        told = dict(info)
        try:
            told[AUTORESET_KEY] = self.cmd_reset(None, None)  # (as a reset request would: same bookkeeping)
        except Exception as e:  # noqa: BLE001 - reported with the step, raised by take_autoreset
            told[AUTORESET_ERROR_KEY] = (type(e).__name__, str(e), traceback.format_exc())
        return told

    def cmd_rollout(self, actions: list, stop_at_done: bool) -> dict:
        """Step through ``actions`` here in the worker: one round trip for a whole open-loop
        branch. At an episode end it stops, or (``stop_at_done=False``) resets and goes on."""
        queued = iter(actions)
        return self._rollout(lambda _obs: next(queued), len(actions), stop_at_done)

    def cmd_load_policy(self, blob: bytes) -> float:
        """Unpickle a policy ahead of the branches that will all run it (``policy_rollout`` with
        the index 0 instead of the pickle): a copy forked after this holds it already, unpickled
        once, exactly as it would have unpickled it itself. Returns the seconds that took."""
        t0 = time.perf_counter()
        torch_before = "torch" in sys.modules
        self.policies = [cloudpickle.loads(blob)]
        self._note_torch_ahead(torch_before)
        return time.perf_counter() - t0

    def _note_torch_ahead(self, torch_before: bool) -> None:
        """Torch, imported here by a policy ahead of its branches (not by the env): its generator is
        then the policy's to reseed (:func:`reseed_policy`, when the branch unpickles it), not the
        env's -- as where nothing was loaded ahead, so a branch draws the same with or without."""
        if not torch_before and "torch" in sys.modules:
            self.torch_ahead = True

    def cmd_import_modules(self, names: list[str]) -> float:
        """Import these modules (those the branches' policy pickles name, :func:`pickled_modules`:
        what unpickling them would import, and nothing else: no object is made), so that copies
        forked after this need not import them again each. Returns the seconds that took."""
        t0 = time.perf_counter()
        torch_before = "torch" in sys.modules
        for name in names:
            try:
                importlib.import_module(name)
            except ImportError:  # (a name the unpickler maps, or one that fails there too: the
                pass  # branch that unpickles it says so)
        self._note_torch_ahead(torch_before)
        return time.perf_counter() - t0

    def cmd_policy_rollout(self, policy_blob: bytes | int, steps: int, stop_at_done: bool, reseed: bool = False,
                           shared: bool = False) -> dict:
        """Run a closed-loop branch here in the worker: ``policy(obs) -> action`` (cloudpickled by
        the controller, unpickled into this process's own copy; or, an int, the one
        :meth:`cmd_load_policy` unpickled at that index) picks every action from the
        observation it sees, for up to ``steps`` steps -- no round trip per step. The reply also
        says which ``actions`` the policy took, so the controller's action log stays exact.

        ``reseed`` (a branch of ``explore(rng="reseed")``, after :meth:`cmd_reseed`): generators
        that appeared since the reseed (unpickling the policy imported torch) are reseeded from
        this copy's seed too, and with ``shared`` (every branch got a copy of this one policy)
        so are the policy's own: otherwise every branch would draw the same numbers."""
        if type(policy_blob) is int:
            if not 0 <= policy_blob < len(self.policies):
                raise ValueError(f"no loaded policy {policy_blob} in this worker ({len(self.policies)} loaded)")
            # each copy has its own unpickled instance (copied at the fork); dropped once taken, so
            # that what a branch snapshots holds only its own
            policy, self.policies = self.policies[policy_blob], []
        else:
            policy = cloudpickle.loads(policy_blob)
        if reseed and self.copy_seed is not None:
            reseed_policy(policy, self.copy_seed, self.reseeded, own_generators=shared)
        # each observation is the policy's own copy, as in the learner: a policy that normalises
        # in place must not write into an array the env keeps (some return their state buffer)
        return self._rollout(lambda obs: policy(_own_copy(obs)), steps, stop_at_done)

    def _rollout(self, choose: Callable[[Any], Any], steps: int, stop_at_done: bool) -> dict:
        # kept on self: when the policy or the env raises midway, the controller asks for them
        # (cmd_rollout_progress) so that its step count and action log match what happened
        self.rollout_actions = actions = []
        self.rollout_id = os.urandom(8).hex()  # (the kernel's: no generator of the env's is drawn from)
        rewards: list[float] = []
        done: tuple[bool, bool] = (False, False)
        obs, info = self.last_obs, self.last_info
        seen = obs  # what the policy decides from: after an auto-reset, the new episode's start
        for t in range(steps):
            if t % ABANDON_CHECK_EVERY == ABANDON_CHECK_EVERY - 1 and self.abandoned():
                raise RolloutAbandoned(f"the controller stopped waiting for this rollout (after {t} steps)")
            try:
                a = choose(seen)
            except Exception as e:  # noqa: BLE001 - said as the policy's, not the env's
                raise PolicyError(f"the policy raised {type(e).__name__}: {e} (at step {t} of the rollout, "
                                  "inside the env's worker)") from e
            obs, r, term, trunc, info = self.cmd_step(a)
            actions.append(own_action(a))  # (a policy may fill one array for every step)
            seen = obs
            rewards.append(float(r))
            if term or trunc:
                done = (bool(term), bool(trunc))
                if stop_at_done:
                    break
                self.last_obs, self.last_info = self.env.reset()
                self.steps = 0
                seen = self.last_obs
        # final_obs / final_info: the last step's, also when that step ended an episode
        return {"rewards": rewards, "terminated": done[0], "truncated": done[1], "final_obs": obs,
                "final_info": info, "steps": self.steps, "actions": actions, "id": self.rollout_id}

    def cmd_rollout_progress(self) -> dict:
        """After a rollout raised, or was interrupted: the actions whose steps completed, the step
        count now, and the rollout's name (None: no rollout since this process's snapshot)."""
        return {"actions": list(self.rollout_actions), "steps": self.steps, "id": self.rollout_id}

    def forget_rollout(self) -> None:
        """A snapshot is being taken (every rollout is accounted for by now): every copy of it,
        and this process, start with no latest rollout, so a rollout interrupted before it reached
        a copy is never taken for one that ran there -- whichever env the copy now serves."""
        self.rollout_actions, self.rollout_id = [], None

    def cmd_reset(self, seed: int | None, options: dict | None) -> tuple:
        obs, info = self.env.reset(seed=seed, options=options)
        self.last_obs, self.last_info, self.steps = obs, info, 0
        return obs, info

    def cmd_render(self) -> Any:
        return self.env.render()

    def cmd_close(self) -> None:
        self.env.close()

    # --- introspection -----------------------------------------------------------------------
    def cmd_meta(self) -> dict:
        env = self.env
        base = env.unwrapped
        return {
            "observation_space": env.observation_space,
            "action_space": env.action_space,
            "metadata": env.metadata,
            "render_mode": env.render_mode,
            "spec": env.spec,
            # the base env's own, which the outer stack's may differ from (a FrameStackObservation
            # space, a RenderCollection's render_mode): what ``env.unwrapped`` mirrors
            "unwrapped": {"observation_space": base.observation_space, "action_space": base.action_space,
                          "metadata": base.metadata, "render_mode": base.render_mode, "spec": base.spec},
            "env_repr": repr(env),
            "unwrapped_type": type(env.unwrapped).__module__ + "." + type(env.unwrapped).__qualname__,
            "ezpickle": isinstance(env.unwrapped, gym.utils.EzPickle),
            "pid": host_pid(),
            "threads": len(os.listdir("/proc/self/task")),
            "torch_loaded": "torch" in __import__("sys").modules,
            "packed": PACKED_VERSION,  # reads packed step frames (see gym_fork.worker.channel)
        }

    def cmd_getattr(self, name: str, where: str) -> Any:
        if where == "wrapper":
            return self.env.get_wrapper_attr(name)
        return getattr(self.env.unwrapped, name)

    def cmd_setattr(self, name: str, value: Any, where: str) -> None:
        if where == "wrapper":
            self.env.set_wrapper_attr(name, value)
        else:
            previous = getattr(self.env.unwrapped, name, None) if name == "workspace" else None
            setattr(self.env.unwrapped, name, value)
            if name == "workspace":  # the declared workspace: captured by snapshots, not recorded
                files.set_workspace(value, previous)

    def cmd_wrap(self, blob: bytes) -> None:
        """Put one more layer on the env stack: ``cloudpickle.loads(blob)(env)`` (a vector env's
        slot layer around an env restored from a snapshot taken without one)."""
        env = cloudpickle.loads(blob)(self.env)
        if not isinstance(env, gym.Env):
            raise TypeError(f"the wrapper returned {type(env).__name__}, not a gymnasium.Env")
        self.env = env

    def cmd_wrapper_classes(self) -> list[list[tuple[str, str]]]:
        """Each wrapper layer of the env stack, outermost first: the classes it is an instance of
        (its MRO), by module and qualified name (the learner matches a class by them, without
        importing what only it has: SB3's ``Monitor`` would import torch here)."""
        out, env = [], self.env
        while isinstance(env, gym.Wrapper):
            out.append([(c.__module__, c.__qualname__) for c in type(env).__mro__])
            env = env.env
        return out

    def cmd_call(self, name: str, args: tuple, kwargs: dict, where: str) -> Any:
        """``where``: "wrapper", the outermost layer; "stack", the outermost layer that has
        ``name`` (``get_wrapper_attr``, as SB3's worker calls ``env_method``); else the base env."""
        if where == "stack":
            return self.env.get_wrapper_attr(name)(*args, **kwargs)
        target = self.env if where == "wrapper" else self.env.unwrapped
        return getattr(target, name)(*args, **kwargs)

    # --- paths into the env (gym_fork.worker.refs): the learner's env.unwrapped, env.call ------
    def cmd_ref_get(self, path: tuple) -> tuple:
        return refs.get(self.env, path)

    def cmd_ref_set(self, path: tuple, value: Any) -> None:
        refs.assign(self.env, path, value)

    def cmd_ref_del(self, path: tuple) -> None:
        refs.delete(self.env, path)

    def cmd_ref_call(self, path: tuple, args: tuple, kwargs: dict, or_get: bool = False) -> Any:
        return refs.call(self.env, path, args, kwargs, or_get)

    def cmd_ref_call_out(self, path: tuple, args: tuple, kwargs: dict, outs: list[int], keys: list[str],
                         or_get: bool = False) -> tuple:
        """:meth:`cmd_ref_call` whose array arguments may be filled in place (``gym_fork.proxy.call``):
        also their final contents, and which of them the result is (None: none)."""
        result = refs.call(self.env, path, args, kwargs, or_get)
        finals = [args[i] for i in outs] + [kwargs[k] for k in keys]
        which = next((j for j, a in enumerate(finals) if result is a), None)
        return (None if which is not None else result), which, finals

    def cmd_ref_value(self, path: tuple) -> Any:
        return refs.resolve(self.env, path)

    def cmd_set_wrapper_attr(self, name: str, value: Any, force: bool) -> bool:
        return refs.set_wrapper_attr(self.env, name, value, force)

    def cmd_gymnasium_check(self, skip_render_check: bool = True) -> dict:
        """Gymnasium's env checker on the base env, here (:mod:`gym_fork.worker.checker`)."""
        return checker.gymnasium_check(self.env.unwrapped, skip_render_check)

    def cmd_last(self) -> tuple:
        """(obs, info, steps) of the latest reset/step: what restore() hands back."""
        return self.last_obs, self.last_info, self.steps

    def cmd_steps(self) -> int:
        """The step count since the last reset, alone: what a controller asks to settle a request
        whose reply did not come (``last`` would send the info too, which may be what did not pickle)."""
        return self.steps

    def cmd_ping(self) -> int:
        return host_pid()

    def cmd_exit_log(self, path: str) -> None:
        """Where this worker's copies' parents write down how the copies ended: the controller's
        (:mod:`gym_fork.worker.exits`). A CRIU-restored worker still named the file of the
        controller that started it, perhaps in another process or on another machine."""
        files.set_exit_log(path)

    def cmd_hello(self, packed: int = 0, state: bool = True) -> tuple:
        """First words with a new copy: (host pid, obs, info, steps) in one round trip; a
        controller that offers ``packed`` step frames also learns the version this worker reads
        (a fifth element; an older worker refuses the argument). ``state`` false (a copy for
        ``fork()``, whose controller reads no observation from it): obs and info are None."""
        files.resend()  # a new copy: its record of written files goes to its new channel
        # ... and it watches its own changes: a new group (a CRIU-restored one came back deaf;
        # read the mount table again there: it may be another machine)
        if not fswatch.deferred:  # (a ready copy opens its group with its first request)
            fswatch.start(refresh=os.getpid() == 1)
        if packed:
            # the newest version both read (a controller of version 2 compares for equality)
            version = min(int(packed), PACKED_VERSION)
            if not state:
                return host_pid(), None, None, self.steps, version
            return host_pid(), self.last_obs, self.last_info, self.steps, version
        return host_pid(), self.last_obs, self.last_info, self.steps

    def cmd_order_hazard(self) -> str | None:
        """Where the env holds a set whose order follows memory addresses (``gym-fork check``'s
        explanation of a diverging restore), or None."""
        return address_order_hazard(self.env)

    def cmd_untracked(self, patterns: list[str]) -> None:
        """The env's ``untracked_paths``: files open for writing there are logs to the fork-tier scan."""
        files.set_untracked(patterns)

    def cmd_private_dirs(self, dirs: list[str] | None, binds: list[tuple[str, str]]) -> None:
        """The env's private directories (:mod:`gym_fork.worker.mounts`; None: as this process
        knows them); with ``binds``, this copy moves into a mount namespace of its own where each
        target shows its source (a private copy, or the copy's own workspace)."""
        if dirs is not None:
            mounts.set_private(dirs)
        if binds:
            mounts.enter(binds)

    def cmd_reseed(self, seed: int) -> list[str]:
        self.copy_seed, self.reseeded = seed, {}
        found, self.generators = self.generators, None
        return reseed_env(self.env, seed, self.reseeded,
                          skip=("torch.default_generator",) if self.torch_ahead else (), found=found)

    def cmd_rng_digests(self) -> dict:
        """The digest of each random generator the env may draw from, by name, read without
        drawing (an env never seeded stays so): ``random``'s, ``numpy.random``'s, torch's when it is
        loaded, and those each layer of the env stack (and its spaces) holds as an attribute
        (``np_random``). Live migration compares them on source and target before it switches: an
        answer does not show a generator seeded from the OS on one side only."""
        import random

        from gym_fork.worker.channel import canonical_digest

        states: dict[str, Any] = {"random": _mt_state(random.getstate()), "numpy.random": np.random.get_state()}
        torch = sys.modules.get("torch")
        if torch is not None:
            try:
                states["torch"] = torch.random.get_rng_state().numpy()
            except Exception:  # noqa: BLE001 - a torch that cannot say: not compared
                pass
        layer, depth = self.env, 0
        while True:
            for name, value in list(getattr(layer, "__dict__", {}).items()):
                if isinstance(value, gym.spaces.Space):
                    name, value = name + "._np_random", value.__dict__.get("_np_random")
                state = _generator_state(value)
                if state is not None:
                    states[f"{depth}:{type(layer).__name__}.{name}"] = state
            if not isinstance(layer, gym.Wrapper):
                break
            layer, depth = layer.env, depth + 1
        return {k: canonical_digest(v) for k, v in states.items()}

    def cmd_replay(self, ops: list, generators: bool = False,
                   rollout_ids: dict[int, str] | None = None) -> list | tuple[list, dict]:
        """Run recorded ``(cmd, args)`` requests again, in order; returns the canonical digest of
        each result (or of its error). Live migration's catch-up: the target replays what the
        source answered while the snapshot travelled (:mod:`gym_fork.migration.live`).
        ``generators`` (the last replay, before the switch): returns ``(digests,``
        :meth:`cmd_rng_digests` ``)``, the generators as the replay left them. ``rollout_ids``:
        the source worker's name of the rollout at each index of ``ops``; a rollout replayed
        takes it (a name is drawn afresh in each rollout, so this one's would differ), so its
        answer is the source's and the controller's record of its last rollout names this
        worker's too (:meth:`ForkableEnv._settle_rollout` compares names)."""
        from gym_fork.worker.channel import canonical_digest

        out = []
        for k, (cmd, args) in enumerate(ops):
            if cmd == "replay":
                raise ValueError("replay cannot be replayed")
            try:
                result = self.dispatch(cmd, args)
            except Exception as e:  # noqa: BLE001 - the source saw this error too (or it diverged)
                out.append(canonical_digest(("error", type(e).__name__, str(e))))
                continue
            rid = (rollout_ids or {}).get(k)
            if rid is not None and isinstance(result, dict) and "id" in result:
                self.rollout_id = result["id"] = rid
            out.append(canonical_digest(result))
        return (out, self.cmd_rng_digests()) if generators else out


def _generator_state(value: Any) -> Any:
    """The state of a random generator (None: ``value`` is none, or has no state to read)."""
    import random

    if isinstance(value, np.random.Generator):
        return value.bit_generator.state
    if isinstance(value, np.random.RandomState):
        return value.get_state()
    if isinstance(value, random.Random) and not isinstance(value, random.SystemRandom):
        return _mt_state(value.getstate())
    return None


def _mt_state(state: tuple) -> tuple:
    """A ``random.Random`` state with its 625 ints as one array (a digest 50x cheaper)."""
    version, internal, gauss = state
    return version, np.array(internal, dtype=np.uint64), gauss


def host_pid() -> int:
    """This process's pid as the host sees it (``os.getpid()`` is 1 inside a fresh pid namespace)."""
    try:
        return int(os.readlink("/proc/self"))
    except (OSError, ValueError):
        return os.getpid()
