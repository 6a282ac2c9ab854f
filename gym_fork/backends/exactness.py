"""Is a pickled copy of an env exact?  Checked by behaviour, not only by structure.

A pickle holds the env object's attributes.  What it does not hold -- the global RNGs of
``random``, ``numpy`` and ``torch``, module-level counters, a C library's hidden state -- can
still decide what ``step()`` returns, and then a restored copy silently continues differently.
Comparing the copy's attributes with the original's cannot see that.  So two copies are
unpickled from the same bytes and stepped one after the other with the same actions (to the
episode's end at most), then reset without a seed: a copy
whose future lives entirely in the pickle answers exactly like its twin; one that draws from
state outside it (the second copy finds the global RNG where the first one left it) does not.

The original is left as it was: the global RNG states are saved before the check and put back
after it, and an env with a workspace (an attribute ``workspace`` naming its directory, see
:mod:`gym_fork.snapshots.workspace`) has each copy work in a private copy of that directory.  An
env with other effects outside its process (files elsewhere, services) is not one the pickle
backend can copy exactly in the first place; its copies' steps would touch those.

Example:
    >>> import cloudpickle, gymnasium as gym
    >>> env = gym.make("CartPole-v1"); _ = env.reset(seed=0)
    >>> copies_diverge(cloudpickle.dumps(env), env.action_space)
    (None, 8)
"""

from __future__ import annotations

import copy
import os
import random
import select
import shutil
import signal
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

import cloudpickle
import numpy as np

from gym_fork.errors import ForeignWorkspaceError, UnsupportedEnvError
from gym_fork.interrupts import held
from gym_fork.worker import files


def global_rng_state() -> dict[str, Any]:
    """The process-wide RNG states a pickle of an env does not hold."""
    state: dict[str, Any] = {"random": random.getstate(), "numpy": np.random.get_state()}
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state()
    return state


def set_global_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch = sys.modules.get("torch")
    if torch is not None and "torch" in state:
        torch.set_rng_state(state["torch"])


def _same(a: Any, b: Any) -> bool:
    """Bit-exact equality of nested step results (arrays by dtype, shape and bytes)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and (a.dtype == object or a.tobytes() == b.tobytes())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (float, np.floating)) and isinstance(b, (float, np.floating)):
        return np.float64(a).tobytes() == np.float64(b).tobytes()
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable objects: compare their pickles
        return cloudpickle.dumps(a) == cloudpickle.dumps(b)


_FIELDS = ("observation", "reward", "terminated", "truncated", "info")


class _Raised(tuple):
    """A step that raised: (exception type name, message)."""


class _Reset(tuple):
    """What ``reset()`` (no seed) returned after the steps: (observation, info)."""


def _run(env: Any, actions: list) -> list:
    """The copy's answers to ``actions`` (up to an episode's end), then to one ``reset()``
    without a seed: a pickled copy's next episode must start as the original's would (an env
    that draws its next level from the global RNG at reset passes every step, then diverges)."""
    out: list = []
    for a in actions:
        try:
            res = env.step(a)
        except Exception as e:  # noqa: BLE001 - the twin must fail the same way
            out.append(_Raised((type(e).__name__, str(e))))
            break
        out.append(tuple(res))
        if res[2] or res[3]:
            break
    # Only an env that was reset and has its generator: before the first reset(), or before the
    # first draw, a reset without a seed seeds np_random afresh in the original as in any copy
    if out and not isinstance(out[0], _Raised) and getattr(getattr(env, "unwrapped", env), "_np_random", 0) is not None:
        try:
            out.append(_Reset(env.reset()))
        except Exception as e:  # noqa: BLE001
            out.append(_Raised((type(e).__name__, str(e))))
    return out


def _private_workspace(env: Any) -> str | None:
    """Point a copy's ``workspace`` at a private copy of the directory (None: it has none)."""
    u = getattr(env, "unwrapped", env)
    ws = getattr(u, "workspace", None)
    if not isinstance(ws, str) or not os.path.isdir(ws):
        return None
    from gym_fork.snapshots.workspace import copy_tree

    tmp = tempfile.mkdtemp(prefix="gym_fork-check-")
    copy_tree(ws, tmp)
    u.workspace = tmp
    return tmp


#: how long the original's fork() child may take to answer, at least (and 20x what a copy took)
REFERENCE_TIMEOUT_S = 10.0


def _in_private_workspace(env: Any, actions: list) -> list:
    """``_run(env, actions)`` with the env's workspace (if any) a private copy, as a fork() child
    works: the original's directory is not the copy's."""
    original = getattr(getattr(env, "unwrapped", env), "workspace", None)
    private = _private_workspace(env)
    rec = files.Record()
    rec.workspace, rec.foreign = private, (os.path.normpath(os.path.abspath(original)) if private else None)
    try:
        # the copies' own warnings are not the user's (Gymnasium's "step() after
        # terminated", for a snapshot taken at an episode's end)
        with files.tracking(rec), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _run(env, actions)
    finally:
        if private:
            shutil.rmtree(private, ignore_errors=True)


def _answer_and_exit(env: Any, actions: list, rng_state: dict[str, Any], r: int, w: int) -> None:
    """In :func:`original_answers`'s fork() child: write the original's answers to ``w`` and
    leave without running the parent's exit handlers (status 1 where it could not)."""
    code = 1
    try:
        os.close(r)
        set_global_rng_state(rng_state)  # (random reseeds itself in a fork child)
        data = cloudpickle.dumps(_in_private_workspace(env, actions))
        view = memoryview(data)
        while view:
            view = view[os.write(w, view):]
        code = 0
    except BaseException:  # noqa: BLE001 - the parent sees no answer
        pass
    finally:
        os._exit(code)


def original_answers(env: Any, actions: list, rng_state: dict[str, Any], timeout: float) -> list | None:
    """What the original ``env`` answers to ``actions`` (as :func:`_run`), asked in a ``fork()``
    child so that the original itself is not touched; None when no child could answer (it failed
    to pickle its answers, crashed or took longer than ``timeout`` seconds).

    Two pickled copies compared with each other can be alike and both wrong: an env holding a
    module's sentinel, or a dict keyed by ``id()``, loses the same thing in every copy. Only the
    original shows what a copy should have answered."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # (a buffer not yet written would be the child's too)
        except Exception:  # noqa: BLE001
            pass
    r, w = os.pipe()
    pid, status, answered = -1, -1, False
    chunks: list[bytes] = []
    try:
        # Ctrl-C held back through fork(): one that comes inside the fork's hooks (logging's
        # lock, in the parent) would be lost, as CPython ignores what they raise, and one between
        # fork() and the wait below would leave the child behind. It is raised here, inside the
        # try: the child is reaped below.
        with held():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # (3.12+: "multi-threaded, fork() may deadlock")
                pid = os.fork()
            if pid == 0:  # the child: answer, then leave without running the parent's exit handlers
                _answer_and_exit(env, actions, rng_state, r, w)
            os.close(w)
            w = -1
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                return None  # (killed below)
            chunk = os.read(r, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        answered = True
    finally:
        os.close(r)  # (a child still writing gets EPIPE and leaves)
        if w >= 0:
            os.close(w)
        if pid > 0 and not answered:  # Ctrl-C (or a timeout): the child is not waited for
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        while pid > 0:
            try:
                status = os.waitpid(pid, 0)[1]
                break
            except ChildProcessError:  # (reaped already: SIGCHLD ignored, as Ray does; the pipe says)
                status = 0
                break
            except InterruptedError:
                continue
    if status != 0:
        return None
    try:
        return cloudpickle.loads(b"".join(chunks))
    except Exception:  # noqa: BLE001
        return None


def _first_difference(a: list, b: list, who: str) -> tuple[str | None, int]:
    """Where two runs' answers first differ (as words, and the step index), or (None, 0).
    ``who``: what each run is, as in "one copy"."""
    steps = lambda run: [x for x in run if not isinstance(x, _Reset)]  # noqa: E731
    if len(steps(a)) != len(steps(b)):
        return f"{who}'s episode ended after {len(steps(a))} steps, the other's after {len(steps(b))}", 0
    for i, (x, y) in enumerate(zip(a, b)):
        when = f"at the reset() after {i} step(s)" if isinstance(x, _Reset) else f"at step {i + 1}"
        if isinstance(x, _Raised) or isinstance(y, _Raised):
            if not (isinstance(x, _Raised) and isinstance(y, _Raised) and tuple(x) == tuple(y)):
                raised = x if isinstance(x, _Raised) else y
                return f"{when} {who} raised {raised[0]}: {raised[1]}", i
            continue
        if isinstance(x, _Reset) != isinstance(y, _Reset):
            return f"{when} only one was reset", i
        for name, u, v in zip(("observation", "info") if isinstance(x, _Reset) else _FIELDS, x, y):
            if not _same(u, v):
                return f"{when} their {name}s differ", i
    return None, 0


def copies_diverge(blob: bytes, action_space: Any, steps: int = 8,
                   unpack: Callable[[Any], Any] | None = None,
                   original: Any = None) -> tuple[str | None, int]:
    """Step two copies unpickled from ``blob`` with the same ``steps`` actions, one after the other
    (and the original, when given, in a ``fork()`` child).

    Args:
        blob: the pickled env (or a tuple holding it; ``unpack`` picks the env out).
        action_space: where the actions come from (a copy is seeded, the space is not touched).
        steps: how many actions (fewer if an episode ends).
        unpack: maps the unpickled object to the env (default: the object itself).
        original: the env ``blob`` was pickled from, in this process: its own answers (asked in a
            ``fork()`` child, :func:`original_answers`) are compared with the first copy's.

    Returns:
        ``(None, n)`` when both copies (and the original) answered identically for ``n`` steps
        (``n == 0``: all raised at once, e.g. before ``reset()``, so nothing was compared); else
        ``(where they first differed, as words, n)``; the words begin with "the original and a
        pickled copy" when a copy differs from the original.
    """
    saved = global_rng_state()
    space = copy.deepcopy(action_space)
    space.seed(12345)
    actions = [space.sample() for _ in range(steps)]
    runs = []
    started = time.monotonic()
    try:
        for _ in range(2):
            obj = cloudpickle.loads(blob)
            env = unpack(obj) if unpack else obj
            try:
                runs.append(_in_private_workspace(env, actions))
            finally:
                try:
                    env.close()
                except Exception:  # noqa: BLE001 - a copy that fails to close says nothing about exactness
                    pass
        took = (time.monotonic() - started) / 2
    finally:
        set_global_rng_state(saved)
    a, b = runs
    for x in (*a, *b):
        if isinstance(x, _Raised) and x[0] == ForeignWorkspaceError.__name__:
            raise UnsupportedEnvError(
                f"{x[1]} (a pickled copy, stepped in a copy of the workspace as a fork() child is, reached "
                "into the original's directory; nothing was snapshotted)")
    compared = sum(1 for x in a if not isinstance(x, (_Raised, _Reset)))
    if original is not None:
        ref = original_answers(original, actions, saved, max(REFERENCE_TIMEOUT_S, 20 * took))
        if ref is None:
            warnings.warn(
                "gym_fork could not compare a pickled copy with the original env (a fork() child stepping the "
                "original did not answer: it crashed, hung or returned what cloudpickle cannot pickle); the "
                "pickle snapshot was checked copy against copy only, which misses state that every copy loses "
                "alike (an object compared with `is`, a dict keyed by id()). backend='criu' needs no check.",
                RuntimeWarning, stacklevel=4)
        else:
            why, at = _first_difference(ref, a, "the original")
            if why is not None:
                return f"the original and a pickled copy, stepped with the same actions, diverge: {why}", at
    why, at = _first_difference(a, b, "one copy")
    return (why, at) if why is not None else (None, compared)
