"""``gym_fork.check_env``: is this env correct, and does every backend that claims it copy it exactly?

Two kinds of checks, one verdict table:

* **Gymnasium's checker** (``gymnasium.utils.env_checker.check_env``) runs on the env itself,
  inside a worker (through a ForkableEnv it would only see the stand-in, and miss the env's
  bugs).  Its exception is a FAIL, its warnings are listed.
* **Exactness, per backend**: the copy-on-write fork tier, CRIU dumps, and the pickle backend.
  Each starts the env, steps it with seeded random actions (resetting at episode ends), takes a
  snapshot, then runs the same continuation four ways -- on after the snapshot, after
  ``restore()``, in a ``fork()`` child, and (CRIU) from the snapshot saved as a bundle and loaded
  back -- and compares every step's observation, reward, flags and info bit for bit.  A backend
  that cannot work here is "n/a", one that refuses the env (with the reason) "refuses"; a
  backend that accepts the env and whose copies diverge FAILs.  If no backend accepts the env,
  that is a FAIL too.
* **Reseeded branches**, on the first backend that passed: two copies reseeded differently
  (``rng="reseed"``) stepped alike, then reset, must differ somewhere; a WARN when they do not.

Example:
    >>> import gym_fork
    >>> report = gym_fork.check_env("CartPole-v1", backends=["pickle"], verbose=False)
    >>> report.ok
    True
    >>> [(r.check, r.verdict) for r in report.rows]
    [('gymnasium checker', 'WARN'), ('exact: pickle', 'PASS'), ("rng='reseed'", 'PASS')]
    >>> report.warnings[0]   # CartPole's velocities are unbounded
    'A Box observation space minimum value is -infinity. This is probably too low.'
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import gymnasium as gym

from gym_fork.backends.bundles import load_snapshot
from gym_fork.env import ForkableEnv
from gym_fork.errors import BackendUnavailableError, GymForkError, UncapturableStateError, UnsupportedEnvError
from gym_fork.worker.channel import canonical_digest

PASS, WARN, FAIL, REFUSES, NA = "PASS", "WARN", "FAIL", "refuses", "n/a"
# backend name -> (label, ForkableEnv options)
BACKENDS: dict[str, tuple[str, dict]] = {
    "fork": ("fork tier (copy-on-write)", {"backend": "criu", "fork_tier": True}),
    "criu": ("CRIU dumps", {"backend": "criu", "fork_tier": False}),
    "pickle": ("pickle", {"backend": "pickle"}),
}
_FIELDS = ("obs", "reward", "terminated", "truncated", "info")


@dataclass
class Row:
    """One line of the verdict table."""

    check: str
    verdict: str  # PASS, WARN, FAIL, refuses, n/a
    detail: str = ""


@dataclass
class CheckReport:
    """What :func:`check_env` found; ``str(report)`` is the verdict table."""

    env: str
    rows: list[Row] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # Gymnasium's checker's warnings

    @property
    def ok(self) -> bool:
        """No FAIL, and at least one backend copies the env exactly."""
        exact = [r for r in self.rows if r.check.startswith("exact:")]
        return not any(r.verdict == FAIL for r in self.rows) and any(r.verdict == PASS for r in exact)

    def __str__(self) -> str:
        width = max(len(r.check) for r in self.rows) if self.rows else 10
        lines = [f"gym_fork check: {self.env}", ""]
        lines += [f"  {r.check:<{width}}  {r.verdict:<7}  {r.detail}".rstrip() for r in self.rows]
        if self.warnings:
            lines += ["", "  Gymnasium's checker warned:"] + [f"    - {w}" for w in self.warnings]
        lines += ["", "  verdict: " + ("OK" if self.ok else "FAILED")]
        return "\n".join(lines)


def check_env(env: str | Callable[[], gym.Env] | ForkableEnv, *, backends: Sequence[str] = ("fork", "criu", "pickle"),
              steps: int = 40, seed: int = 0, skip_render_check: bool = True, env_kwargs: dict | None = None,
              verbose: bool = True) -> CheckReport:
    """Run Gymnasium's env checker on the env in its worker, and gym_fork's exactness check on
    every backend in ``backends``; print the verdict table (``verbose``) and return it.

    Args:
        env: an env id, a zero-argument factory, or a ForkableEnv (left unchanged: its checks run
            on fresh envs built as it was, or on forks of it).
        backends: any of ``"fork"`` (the copy-on-write fork tier), ``"criu"`` (CRIU dumps) and
            ``"pickle"``.
        steps: random steps before the snapshot, and in each continuation.
        seed: seeds ``reset`` and the random actions.
        skip_render_check: passed to Gymnasium's checker.
        env_kwargs: for ``gymnasium.make`` when ``env`` is an id.
        verbose: print the table.

    Returns:
        The report; ``report.ok`` is False when anything FAILed.

    Raises:
        ValueError: an unknown backend name.
    """
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; choose from {', '.join(BACKENDS)}")
    build = env_builder(env, env_kwargs)
    report = CheckReport(env=_name(env))
    report.rows.append(_gymnasium_row(build, env, skip_render_check, report))
    exact_on = []
    for name in backends:
        label, options = BACKENDS[name]
        report.rows.append(_exactness_row(f"exact: {label}", lambda o=options: build(**o), steps, seed))
        if report.rows[-1].verdict == PASS:
            exact_on.append(options)
    if exact_on:  # on the first backend that copies it exactly
        report.rows.append(_reseed_row(lambda o=exact_on[0]: build(**o), steps, seed))
    if not any(r.verdict == PASS for r in report.rows if r.check.startswith("exact:")) and not any(
            r.verdict == FAIL for r in report.rows if r.check.startswith("exact:")):
        report.rows.append(Row("exact: any backend", FAIL, "no backend here can snapshot this env exactly"))
    if verbose:
        print(report)
    return report


def _name(env: Any) -> str:
    if isinstance(env, str):
        return env
    if isinstance(env, ForkableEnv):
        return repr(env)
    return getattr(env, "__qualname__", None) or repr(env)


def env_builder(env: Any, env_kwargs: dict | None) -> Callable[..., ForkableEnv]:
    """``build(**options)``: a new ForkableEnv of the env being checked."""
    if isinstance(env, ForkableEnv):
        if env._origin is None:  # built from a snapshot: its own backend, through forks
            def from_fork(backend: str = "", **_: Any) -> ForkableEnv:
                if backend and backend != env.backend:
                    raise BackendUnavailableError(f"the env was restored from a snapshot; only its own backend "
                                                  f"({env.backend}) can be checked")
                return env.fork()[0]
            return from_fork
        src, kwargs, wrappers = env._origin
        return lambda **o: ForkableEnv(src, env_kwargs=kwargs, wrappers=wrappers, **o)
    return lambda **o: ForkableEnv(env, env_kwargs=env_kwargs, **o)


def _gymnasium_row(build: Callable[..., ForkableEnv], env: Any, skip_render_check: bool, report: CheckReport) -> Row:
    try:
        subject = build(backend="auto") if not isinstance(env, ForkableEnv) or env._origin else build()
    except GymForkError as e:
        return Row("gymnasium checker", FAIL, f"the env does not start: {e}")
    try:
        found = subject._request("gymnasium_check", skip_render_check)
    finally:
        subject.close()
    report.warnings = found["warnings"]
    if found["error"]:
        return Row("gymnasium checker", FAIL, found["error"])
    if found["warnings"]:
        return Row("gymnasium checker", WARN, f"{len(found['warnings'])} warning(s), below")
    return Row("gymnasium checker", PASS)


def _exactness_row(check: str, build: Callable[[], ForkableEnv], steps: int, seed: int) -> Row:
    try:
        env = build()
    except BackendUnavailableError as e:
        return Row(check, NA, short_error(e))
    except UnsupportedEnvError as e:
        return Row(check, REFUSES, short_error(e))
    extra: list[str] = []
    try:
        space = copy.deepcopy(env.action_space)
        space.seed(seed)
        env.reset(seed=seed)
        _drive(env, [space.sample() for _ in range(steps)])
        try:
            snap = env.snapshot()
        except (UnsupportedEnvError, UncapturableStateError) as e:
            return Row(check, REFUSES, short_error(e))
        tail = [space.sample() for _ in range(steps)]
        runs = {"on": _drive(env, tail)}
        env.restore(snap)
        runs["restore"] = _drive(env, tail)
        (kid,) = env.fork(snap)
        try:
            runs["fork"] = _drive(kid, tail)
        finally:
            kid.close()
        if env.backend == "criu":
            saved = _saved_run(snap, tail)
            if isinstance(saved, str):
                extra.append(f"save/load: {saved}")
            else:
                runs["save/load"] = saved
    except (UnsupportedEnvError, UncapturableStateError) as e:  # refused later, before anything
        return Row(check, REFUSES, short_error(e))  # diverged (e.g. files it wrote after the snapshot)
    except Exception as e:  # noqa: BLE001 - gym_fork's errors, and the env's own (pickle: in this process)
        return Row(check, FAIL, f"{type(e).__name__}: {short_error(e)}" if not isinstance(e, GymForkError) else short_error(e))
    else:
        diverged = next((how for how, run in runs.items() if how != "on" and run != runs["on"]), None)
        if diverged is not None:
            why = f"{diverged} diverges: {_first_difference(runs['on'], runs[diverged])}"
            try:
                hazard = env._request("order_hazard")
            except Exception:  # noqa: BLE001 - an explanation, not the verdict
                hazard = None
            if hazard:
                why += (f"; likely because the env holds {hazard}: a set iterates such objects in the order they "
                        "lie in memory, which no copy keeps (nor a second run): give the class a __hash__ "
                        "(e.g. by an id of its own), or keep them in a list or dict")
            return Row(check, FAIL, why)
    finally:
        env.close()
    done = ", ".join(h for h in runs if h != "on")
    return Row(check, PASS, f"{steps} steps bit-identical after {done}" + (f"; {'; '.join(extra)}" if extra else ""))


def _reseed_row(build: Callable[[], ForkableEnv], steps: int, seed: int) -> Row:
    """Whether ``fork(..., rng="reseed")`` gives copies randomness of their own: two copies
    reseeded differently, given the same actions and then an unseeded ``reset()``, must differ
    somewhere. Copies that do not either draw no randomness at all, or draw it from somewhere
    the reseed cannot reach: explore()'s branches would then differ only by their actions."""
    check = "rng='reseed'"
    try:
        env = build()
    except GymForkError as e:
        return Row(check, NA, short_error(e))
    try:
        space = copy.deepcopy(env.action_space)
        space.seed(seed)
        env.reset(seed=seed)
        _drive(env, [space.sample() for _ in range(steps)])
        snap = env.snapshot()
        tail = [space.sample() for _ in range(steps)]
        kids = env.fork(snap, 2)
        try:
            reached = [k._request("reseed", s) for k, s in zip(kids, (seed + 1, seed + 2))]
            a, b = ([*_drive(k, tail), ("reset",) + tuple(canonical_digest(x) for x in k.reset())] for k in kids)
        finally:
            for k in kids:
                k.close()
    except Exception as e:  # noqa: BLE001 - a note on branching, not on the env's exactness
        return Row(check, NA, f"{type(e).__name__}: {short_error(e)}")
    finally:
        env.close()
    names = ", ".join(reached[0]) or "nothing"
    if a != b:
        return Row(check, PASS, f"copies reseeded differently diverge ({_first_difference(a, b)}); "
                                f"reseeded: {names}")
    return Row(check, WARN, f"two copies reseeded differently went on identically ({steps} steps, then a "
                            "reset): the env draws no randomness, or draws it where rng='reseed' cannot reach "
                            "(a C library, a closure); explore()'s branches would differ only by their actions. "
                            f"Reseeded: {names}")


def _saved_run(snap: Any, tail: list) -> list | str:
    """The continuation from ``snap`` saved as a bundle and loaded back, or why that is n/a."""
    tmp = tempfile.mkdtemp(prefix="gym_fork-check-")
    try:
        path = os.path.join(tmp, "bundle")
        try:
            snap.save(path)
        except GymForkError as e:
            return f"n/a ({short_error(e)})"
        env = ForkableEnv.from_snapshot(load_snapshot(path))
        try:
            return _drive(env, tail)
        finally:
            env.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _drive(env: gym.Env, actions: list) -> list:
    """Each step's digests (obs, reward, terminated, truncated, info), resetting (unseeded) at
    episode ends."""
    out = []
    for a in actions:
        result = env.step(a)
        out.append(tuple(canonical_digest(x) for x in result))
        if result[2] or result[3]:
            out.append(("reset",) + tuple(canonical_digest(x) for x in env.reset()))
    return out


def _first_difference(a: list, b: list) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            if x[0] == "reset" and y[0] == "reset":
                fields = [f for f, p, q in zip(("obs", "info"), x[1:], y[1:]) if p != q]
                return f"at item {i}: the reset's {', '.join(fields)} differ"
            if x[0] == "reset" or y[0] == "reset":
                return f"at item {i} (an episode ends in one run only)"
            fields = [f for f, p, q in zip(_FIELDS, x, y) if p != q]
            return f"at step {i + 1}: {', '.join(fields)} differ"
    return f"after {min(len(a), len(b))} items (different lengths)"


def short_error(e: BaseException, limit: int = 300) -> str:
    text = str(e).strip().replace("\n", " ")
    return text if len(text) <= limit else text[:limit - 3] + "..."
