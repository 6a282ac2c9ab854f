"""``gym_fork.measure_costs``: what a step, a snapshot and a restore of *this* env cost through
gym_fork on *this* machine, and from what depth branching beats replaying from ``reset()``.

Branching pays off only past a depth: to try another continuation of ``horizon`` steps from
step ``D`` of an episode, replaying costs ``reset() + (D + horizon)`` in-process steps, while
branching costs one ``restore()`` plus ``horizon`` steps through the worker.  Both sides depend
on the env (a CartPole step is 10 µs, a MuJoCo one 50, an Atari one 300) and on the machine (a
``fork()`` copies page tables, several times slower on a virtual machine).  This module measures
them, side by side, and solves for ``D``:

    break-even depth = (restore + horizon * (worker step - in-process step) - reset) / in-process step

Everything is a median of several runs, taken the way a learner sees it: a step is the call
``env.step(a)``; a snapshot is ``snapshot()`` plus the next step (a fork-tier snapshot's fork is
finished by then) minus a plain step; a restore is ``restore()`` after a short pause (a learner
does other work between restores) plus the next step, minus a plain step.  Nothing here asserts a
time; ``gym-fork bench ENV`` prints the table.

Example:
    >>> import gym_fork
    >>> report = gym_fork.measure_costs("CartPole-v1", backends=["pickle"], steps=40, reps=3, verbose=False)
    >>> [row.backend for row in report.rows]
    ['in process', 'pickle']
    >>> report.rows[1].step_us > 0 and report.rows[1].break_even_depth is not None
    True
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import gymnasium as gym

from gym_fork.check import BACKENDS, env_builder, short_error
from gym_fork.env import ForkableEnv
from gym_fork.errors import BackendUnavailableError, GymForkError, UncapturableStateError, UnsupportedEnvError

#: snapshots and restores done before the timed ones: the first restores of a fork-tier snapshot
#: find no ready copy, or one that has not learned which pages to fault in yet
WARM_UP = 3
#: the pause before each measured restore (seconds): a learner runs its policy, trains or searches
#: between restores; back-to-back restores in a tight loop cost more (``benchmarks/hot_path.py``)
RESTORE_PAUSE_S = 0.03


@dataclass
class CostRow:
    """One backend's costs (``None``: not measured; see ``note``)."""

    backend: str
    step_us: float | None = None  # median env.step() call
    overhead_us: float | None = None  # step_us minus the in-process step
    snapshot_ms: float | None = None  # snapshot() + the next step, minus a plain step
    restore_ms: float | None = None  # restore() after a pause + the next step, minus a plain step
    break_even_depth: float | None = None  # steps; 0 when branching always wins
    snapshot_samples_ms: list[float] = field(default_factory=list)
    restore_samples_ms: list[float] = field(default_factory=list)
    note: str = ""  # why a backend was not measured (n/a here, refuses the env)


@dataclass
class CostReport:
    """What :func:`measure_costs` measured; ``str(report)`` is the table, :meth:`as_dict` the data."""

    env: str
    horizon: int
    steps: int
    reps: int
    reset_us: float | None = None  # median in-process reset()
    rows: list[CostRow] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        head = ["backend", "step", "overhead", "snapshot()+step−step", "restore()+step−step",
                f"break-even depth ({self.horizon}-step branch)"]
        notes = [r for r in self.rows if r.note]
        body = [[r.backend, _us(r.step_us), _signed_us(r.overhead_us), _ms(r.snapshot_ms), _ms(r.restore_ms),
                 f"see ({notes.index(r) + 1})" if r.note else _depth(r.break_even_depth)] for r in self.rows]
        widths = [max(len(row[i]) for row in [head] + body) for i in range(len(head))]
        lines = [f"gym_fork costs: {self.env} (medians: {self.steps} steps, {self.reps} snapshots and "
                 f"{self.reps} restores per backend)", ""]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head] + body]
        lines += [""] + [f"  ({i}) {r.backend}: {r.note}" for i, r in enumerate(notes, 1)] + ([""] if notes else [])
        lines += [f"  Branching from a snapshot beats replaying reset() + D + {self.horizon} steps in process once "
                  "the snapshot is at least the break-even depth D steps into the episode."]
        return "\n".join(lines)


def measure_costs(env: str | Callable[[], gym.Env], *, backends: Sequence[str] = ("fork", "criu"),
                  steps: int = 300, reps: int = 10, horizon: int = 100, seed: int = 0,
                  env_kwargs: dict | None = None, verbose: bool = True) -> CostReport:
    """Measure ``env``'s step, snapshot and restore costs in process and on each backend.

    Args:
        env: an env id or a zero-argument factory (it is also built in this process, for the
            in-process baseline).
        backends: any of ``"fork"`` (the copy-on-write fork tier), ``"criu"`` (CRIU dumps) and
            ``"pickle"``; one that cannot work here, or refuses the env, is listed with the reason.
        steps: steps timed per backend (seeded random actions, resetting at episode ends; the
            resets are not timed).
        reps: snapshots and restores timed per backend.
        horizon: the branch length the break-even depth is solved for.
        seed: seeds ``reset()`` and the random actions.
        env_kwargs: for ``gymnasium.make`` when ``env`` is an id.
        verbose: print progress to stderr and the table to stdout.

    Returns:
        The report (``report.rows[0]`` is the in-process baseline).

    Raises:
        TypeError: ``env`` is neither an id nor a factory (for a ``ForkableEnv``, pass the id or
            factory it was made from).
        ValueError: an unknown backend, or ``steps`` / ``reps`` / ``horizon`` below 1.
    """
    if not isinstance(env, str) and not callable(env) or isinstance(env, gym.Env):
        raise TypeError(f"env must be an env id or a zero-argument factory, not {type(env).__name__}; "
                        "for a ForkableEnv, pass the id or factory it was made from")
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; choose from {', '.join(BACKENDS)}")
    for name, value in (("steps", steps), ("reps", reps), ("horizon", horizon)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    label = env if isinstance(env, str) else getattr(env, "__qualname__", repr(env))
    report = CostReport(env=label, horizon=horizon, steps=steps, reps=reps)
    say = (lambda msg: print(f"[gym-fork bench] {msg}", file=sys.stderr, flush=True)) if verbose else (lambda msg: None)

    say("in process")
    plain = gym.make(env, **(env_kwargs or {})) if isinstance(env, str) else env()
    try:
        actions = _actions(plain.action_space, seed, steps)
        # in-process steps before and after the backends' (a machine's speed drifts): their median
        inproc_steps, resets = _step_and_reset_times(plain, actions, seed)
        build = env_builder(env, env_kwargs)
        rows = []
        for name in backends:
            title, options = BACKENDS[name]
            say(title)
            rows.append(_backend_row(title, lambda o=options: build(**o), actions, seed, reps))
        say("in process, again")
        more_steps, more_resets = _step_and_reset_times(plain, actions, seed)
    finally:
        plain.close()
    inproc_step = statistics.median(inproc_steps + more_steps) * 1e6
    report.reset_us = statistics.median(resets + more_resets) * 1e6
    report.rows.append(CostRow("in process", step_us=inproc_step))
    for row in rows:
        if row.step_us is not None:
            row.overhead_us = row.step_us - inproc_step
            if row.restore_ms is not None:
                worker_step, reset = row.step_us * 1e-6, (report.reset_us or 0.0) * 1e-6
                depth = (row.restore_ms * 1e-3 + horizon * (worker_step - inproc_step * 1e-6) - reset) / (inproc_step * 1e-6)
                row.break_even_depth = max(0.0, depth)
        report.rows.append(row)
    if verbose:
        print(report)
    return report


def _actions(space: gym.Space, seed: int, n: int) -> list:
    space = copy.deepcopy(space)
    space.seed(seed)
    return [space.sample() for _ in range(n)]


def _step_and_reset_times(env: gym.Env, actions: list, seed: int) -> tuple[list[float], list[float]]:
    """The step and reset times of ``env`` through ``actions`` (seconds); episode ends reset,
    timed as resets."""
    steps, resets = [], []
    t = time.perf_counter()
    env.reset(seed=seed)
    resets.append(time.perf_counter() - t)
    for a in actions:
        t = time.perf_counter()
        _, _, terminated, truncated, _ = env.step(a)
        steps.append(time.perf_counter() - t)
        if terminated or truncated:
            t = time.perf_counter()
            env.reset()
            resets.append(time.perf_counter() - t)
    return steps, resets


def _backend_row(title: str, build: Callable[[], ForkableEnv], actions: list, seed: int, reps: int) -> CostRow:
    try:
        env = build()
    except BackendUnavailableError as e:
        return CostRow(title, note=f"n/a: {short_error(e)}")
    except UnsupportedEnvError as e:
        return CostRow(title, note=f"refuses the env: {short_error(e)}")
    try:
        step_times, _resets = _step_and_reset_times(env, actions, seed)
        plain = statistics.median(step_times)
        step_us = plain * 1e6
        more = iter(actions * (1 + 3 * (reps + WARM_UP) // len(actions)))
        snapshots, restores = [], []
        try:
            for _ in range(WARM_UP + reps):
                a = next(more)
                t = time.perf_counter()
                snap = env.snapshot()
                done = _step_done(env, a)
                snapshots.append(time.perf_counter() - t - plain)
                if done:
                    env.reset()
                snap.release()
                time.sleep(RESTORE_PAUSE_S)  # the fork tier ends a released snapshot's processes
            root = env.snapshot()
            try:
                for _ in range(WARM_UP + reps):
                    if _step_done(env, next(more)):  # the restore has something to undo
                        env.reset()
                    time.sleep(RESTORE_PAUSE_S)
                    a = next(more)
                    t = time.perf_counter()
                    env.restore(root)
                    done = _step_done(env, a)
                    restores.append(time.perf_counter() - t - plain)
                    if done:
                        env.reset()
            finally:
                root.release()
        except (UnsupportedEnvError, UncapturableStateError) as e:
            return CostRow(title, step_us=step_us, note=f"refuses the env: {short_error(e)}")
        snapshots, restores = [x * 1e3 for x in snapshots[WARM_UP:]], [x * 1e3 for x in restores[WARM_UP:]]
        return CostRow(title, step_us=step_us, snapshot_ms=statistics.median(snapshots),
                       restore_ms=statistics.median(restores), snapshot_samples_ms=snapshots,
                       restore_samples_ms=restores)
    except GymForkError as e:
        return CostRow(title, note=f"failed: {short_error(e)}")
    finally:
        env.close()


def _step_done(env: gym.Env, action: Any) -> bool:
    """One step; whether it ended the episode."""
    _, _, terminated, truncated, _ = env.step(action)
    return bool(terminated or truncated)


def _us(x: float | None) -> str:
    return "—" if x is None else f"{x:.0f} µs"


def _signed_us(x: float | None) -> str:
    return "—" if x is None else f"{x:+.0f} µs"


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f} ms"


def _depth(d: float | None) -> str:
    if d is None:
        return "—"
    if d <= 0:
        return "0 steps (branching always wins)"
    return "1 step" if round(d) == 1 else f"{d:.0f} steps"
