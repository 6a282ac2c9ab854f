"""Random sequences of operations, each result checked against an in-process model.

Single envs: ``step``, ``step_send``/``step_receive``, ``rollout``, ``reset``, ``snapshot``,
``restore``, ``fork``, ``close``, ``persist``, ``release``, ``save``/``load_snapshot``,
``explore`` (open loop, a closed-loop policy here or in the workers) and ``from_snapshot``, on
any live env or snapshot, in any order.  The model is the
env's event history (resets with their seeds, then actions): every observation gym_fork returns
must equal, bit for bit, what a fresh in-process env gives after replaying that history.  Each
seed is one reproducible sequence; a failure prints the operations that led to it.

Vector envs: ``ForkableVectorEnv`` against ``SyncVectorEnv`` in each autoreset mode, with
``snapshot(i)``, ``restore(i, snap)`` and ``fork_into`` modelled by deep copies of the in-process
sub-env and its pending-autoreset flag.
"""

from __future__ import annotations

import copy
import functools
import os
import random
import tempfile
import warnings
from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv

import gym_fork
from gym_fork import ForkableEnv, SnapshotStore
from gym_fork.vector import ForkableVectorEnv
from gym_fork.worker import reseed

from conftest import same
import agent_envs
import random_envs

MAX_ENVS = 4


def cartpole() -> gym.Env:
    return gym.make("CartPole-v1", max_episode_steps=40)  # short episodes: resets come often


def lunar() -> gym.Env:
    return gym.make("LunarLander-v3", max_episode_steps=60)


def global_random() -> gym.Env:
    """Draws from ``random``'s global generator: only a whole-process snapshot keeps that."""
    return gym.wrappers.TimeLimit(random_envs.GlobalRandomEnv(), 40)


class _ActionTable(gym.ActionWrapper):
    """Actions by number from a fixed table: a continuous-action env in the harness, whose
    actions are small ints."""

    def __init__(self, env: gym.Env, table: list):
        super().__init__(env)
        self.table = [np.asarray(a, dtype=env.action_space.dtype) for a in table]
        self.action_space = gym.spaces.Discrete(len(table))

    def action(self, action: int) -> np.ndarray:
        return self.table[int(action)]


def half_cheetah() -> gym.Env:
    """MuJoCo: native simulator state, which only a whole-process snapshot carries."""
    env = gym.make("HalfCheetah-v5", max_episode_steps=40)
    return _ActionTable(env, [np.zeros(6), np.full(6, 0.7), np.full(6, -0.7), [1, -1, 1, -1, 1, -1]])


def pong_ram() -> gym.Env:
    """ALE: the emulator and its sticky-action RNG (native); observed through the console's RAM."""
    import ale_py

    gym.register_envs(ale_py)
    return gym.make("ALE/Pong-v5", obs_type="ram", max_episode_steps=60)


def replay(factory, history: list) -> tuple:
    """What an in-process env answers last after ``history`` (``("reset", seed)``, ``("step", a)``,
    ``("reseed", (seed, process_wide))``: a copy made by ``fork(..., rng="reseed")``, whose
    generators are reseeded as its worker reseeds them, with the process-wide ones when the copy
    has a process to itself). ``factory`` may also be a :class:`_Reused` model env."""
    env = factory.env if isinstance(factory, _Reused) else factory()
    out: tuple = ()
    for kind, arg in history:
        if kind == "reseed":
            _reseed_like_a_copy(env, *arg)
            continue
        out = env.reset(seed=arg) if kind == "reset" else env.step(arg)
    if not isinstance(factory, _Reused):
        env.close()
    return out


def _reseed_like_a_copy(env: gym.Env, seed: int, process_wide: bool) -> None:
    was = reseed._own_process
    reseed._own_process = process_wide  # (this process's globals stand in for the worker's)
    try:
        reseed.reseed_env(env, seed)
    finally:
        reseed._own_process = was


class _Reused:
    """One in-process model env for every replay, for an env that is costly to start (a server
    child): a history always begins with a seeded reset, which must bring it back to the same
    state whatever ran before (the env's own contract)."""

    def __init__(self, env: gym.Env):
        self.env = env


@dataclass
class _Saved:
    snap: gym_fork.Snapshot
    history: list
    done: bool  # the episode had ended: the next event must be a reset
    owner: int | None  # the env that took it (closing that env releases it); None: loaded


@dataclass
class _Run:
    """One random sequence: the live envs and snapshots with their histories, and a log."""

    factory: object
    rng: random.Random
    n_actions: int
    seeded_resets_only: bool
    replay_factory: object = None  # the model's env, when it differs (a fresh workspace each time)
    workspaces: str | None = None  # where from_snapshot() makes workspaces (an env with one)
    private_dirs: list | None = None  # what from_snapshot() must be told (an env with some)
    # fork(..., rng="reseed") too: whether a copy's reseed reaches process-wide generators (a
    # worker's; not a pickle copy's, in this process); None: copies keep their snapshot's randomness
    reseeds_process_wide: bool | None = None
    agent: object = None  # a gym_fork.testing.nodes.Nodes: envs also migrate() to its agent "B"
    migrations: list = field(default_factory=list)  # live migrations started (each must end)
    envs: dict = field(default_factory=dict)  # id -> [ForkableEnv, history, done]
    saved: list = field(default_factory=list)
    log: list = field(default_factory=list)
    next_id: int = 0

    def add(self, env: ForkableEnv, history: list, done: bool) -> None:
        self.envs[self.next_id] = [env, history, done]
        self.next_id += 1

    def check(self, got_obs, history: list, what: str) -> tuple:
        if all(kind == "reseed" for kind, _ in history):  # taken before the first reset: nothing observed yet
            assert got_obs is None, f"{what}: {got_obs!r} before any reset"
            return ()
        want = replay(self.replay_factory or self.factory, history)
        assert same(np.asarray(got_obs), np.asarray(want[0])), (
            f"{what}: gym_fork {got_obs} vs in-process {want[0]}\nops so far (last 12): {self.log[-12:]}")
        return want

    def seeds(self, n: int) -> list[int] | None:
        """Seeds for ``n`` reseeded copies, half of the time (when this run reseeds at all)."""
        if self.reseeds_process_wide is None or self.rng.random() < 0.5:
            return None
        return [self.rng.randrange(2**32) for _ in range(n)]

    def reseeded(self, seeds: list[int] | None, k: int) -> list:
        """The event that starts copy ``k``'s history (none for a copy that was not reseeded)."""
        return [] if seeds is None else [("reseed", (seeds[k], self.reseeds_process_wide))]

    def restorable(self, env: ForkableEnv) -> list[_Saved]:
        return [s for s in self.saved if s.snap.lineage in (None, env._lineage)]


def _policy(n_actions: int):
    """A deterministic closed-loop policy (a closure: cloudpickle ships it to workers by value)."""
    def policy(obs) -> int:
        return int(abs(float(np.asarray(obs, dtype=np.float64).ravel()[0])) * 1e4) % n_actions
    return policy


def _migrated(env: ForkableEnv) -> bool:
    from gym_fork.migration.client import NetworkHandle

    return isinstance(env._handle, NetworkHandle)


def _one_op(run: _Run, tmp_path, i: int) -> None:
    rng = run.rng
    eid = rng.choice(sorted(run.envs))
    entry = run.envs[eid]
    env, history, done = entry
    act = lambda: rng.randrange(run.n_actions)  # noqa: E731
    r = rng.random()
    if run.agent is not None and rng.random() < 0.1:
        _migration_op(run, eid, i)
        return
    if _migrated(env) and 0.62 <= r < 0.85 and r >= 0.72:  # restore, fork: need a local worker
        from gym_fork.errors import MigratedEnvError

        options = run.restorable(env)
        if options:
            run.log.append((eid, "restore/fork on a migrated env"))
            with pytest.raises(MigratedEnvError):
                if r < 0.80:
                    env.restore(rng.choice(options).snap)
                else:
                    env.fork(rng.choice(options).snap)
        return
    if r < 0.55:
        if done:
            # the first reset is seeded (unseeded, it draws fresh entropy); later ones go on from
            # the env's generator half of the time
            seeded = run.seeded_resets_only or not history or rng.random() < 0.5
            seed = rng.randrange(1000) if seeded else None
            run.log.append((eid, "reset", seed))
            obs, _ = env.reset(seed=seed)
            history.append(("reset", seed))
            run.check(obs, history, f"reset of env {eid}")
            entry[2] = False
            return
        a = act()
        split = rng.random() < 0.2
        run.log.append((eid, "step_send/receive" if split else "step", a))
        if split:
            env.step_send(a)
            got = env.step_receive()
        else:
            got = env.step(a)
        history.append(("step", a))
        want = run.check(got[0], history, f"step {i} of env {eid}")
        assert got[1:4] == tuple(want[1:4]), f"step {i}: reward/flags {got[1:4]} vs {want[1:4]}"
        entry[2] = bool(got[2] or got[3])
    elif r < 0.62 and not done:
        actions = [act() for _ in range(rng.randrange(1, 6))]
        run.log.append((eid, "rollout", actions))
        res = env.rollout(actions)
        n = len(res["rewards"])  # stops at an episode end
        history.extend(("step", a) for a in actions[:n])
        assert res["actions"] == actions[:n] and res["steps"] == env.steps
        want = run.check(res["final_obs"], history, f"rollout {i} of env {eid}")
        assert same(res["rewards"][-1], want[1]), f"rollout {i}: last reward"
        entry[2] = bool(want[2] or want[3])
    elif r < 0.72:
        restore_soon = rng.choice([None, True, False])
        run.log.append((eid, "snapshot", restore_soon))
        if _migrated(env):
            from gym_fork.errors import MigratedEnvError

            with pytest.raises(MigratedEnvError):
                env.snapshot(restore_soon=restore_soon)
            return
        run.saved.append(_Saved(env.snapshot(restore_soon=restore_soon), list(history), done, eid))
    elif r < 0.80:
        options = run.restorable(env)
        if options:
            s = rng.choice(options)
            run.log.append((eid, "restore", run.saved.index(s)))
            obs, _ = env.restore(s.snap)
            entry[1] = list(s.history)
            entry[2] = s.done
            run.check(obs, entry[1], f"restore {i} into env {eid}")
    elif r < 0.85 and len(run.envs) < MAX_ENVS:
        options = run.restorable(env)
        if options:
            s = rng.choice(options)
            n = rng.randrange(1, 3)
            seeds = run.seeds(n)
            run.log.append((eid, "fork", run.saved.index(s), n, seeds))
            kids = env.fork(s.snap, n, rng="reseed" if seeds else "same", seeds=seeds)
            for k, kid in enumerate(kids):
                run.add(kid, s.history + run.reseeded(seeds, k), s.done)
    elif r < 0.88 and len(run.envs) > 1:
        run.log.append((eid, "close"))
        env.close()
        del run.envs[eid]
        run.saved = [s for s in run.saved if s.owner != eid]  # released with their env
    elif r < 0.91 and run.saved:
        s = rng.choice(run.saved)
        keep = rng.random() < 0.5
        run.log.append(("persist", run.saved.index(s), keep))
        s.snap.persist(keep_in_memory=keep)
    elif r < 0.93 and run.saved:
        s = rng.choice(run.saved)
        run.log.append(("release", run.saved.index(s)))
        s.snap.release()
        run.saved.remove(s)
    elif r < 0.95 and run.saved:
        s = rng.choice(run.saved)
        path = os.path.join(tmp_path, f"bundle-{i}")
        run.log.append(("save+load", run.saved.index(s)))
        s.snap.save(path)
        run.saved.append(_Saved(gym_fork.load_snapshot(path), list(s.history), s.done, None))
    elif r < 0.97:
        options = [s for s in run.restorable(env) if not s.done]
        if options and not _migrated(env):  # (explore() forks copies of env's worker)
            s = rng.choice(options)
            keep = rng.random() < 0.5
            how = rng.choice(["actions", "policy", "policy_in_worker"])
            policy = _policy(run.n_actions)
            actions = [[act() for _ in range(5)] for _ in range(2)] if how == "actions" else None
            seeds = run.seeds(2)
            run.log.append((eid, "explore", how, run.saved.index(s), actions, keep, seeds))
            res = gym_fork.explore(env, s.snap, None if actions else policy, n_branches=2, horizon=5,
                                   rng="reseed" if seeds else "same", seeds=seeds,
                                   actions=actions, return_snapshots=keep,
                                   policy_in_worker=how == "policy_in_worker")
            for b in res.branches:
                start = s.history + run.reseeded(seeds, b.index)
                h = start + [("step", a) for a in b.actions]
                if actions is None:  # closed loop: each action is the policy's answer to what it saw
                    seen = [replay(run.replay_factory or run.factory, start + [("step", a) for a in b.actions[:t]])[0]
                            for t in range(b.length)]
                    assert [policy(o) for o in seen] == [int(a) for a in b.actions], f"explore {i}: {run.log[-6:]}"
                want = run.check(b.final_obs, h, f"explore {i}, branch {b.index}")
                if keep:
                    run.saved.append(_Saved(b.snapshot, h, bool(want[2] or want[3]), eid))
    elif run.saved and len(run.envs) < MAX_ENVS:
        s = rng.choice(run.saved)
        run.log.append(("from_snapshot", run.saved.index(s)))
        new = ForkableEnv.from_snapshot(
            s.snap, workspace=tempfile.mkdtemp(dir=run.workspaces) if run.workspaces else None,
            private_dirs=run.private_dirs)
        assert new.steps == s.snap.steps
        run.add(new, list(s.history), s.done)  # its next step is checked like any other


def _migration_op(run: _Run, eid: int, i: int) -> None:
    """Move env ``eid``'s worker to the agent: stop and copy, or live (it switches inside a later
    step, or is cancelled by a later snapshot/restore/fork); its next answers are checked as any."""
    from gym_fork.errors import MigratedEnvError

    env = run.envs[eid][0]
    live = run.rng.random() < 0.5
    run.log.append((eid, "migrate", "live" if live else "stop-and-copy"))
    if _migrated(env):
        with pytest.raises(MigratedEnvError):
            env.migrate(run.agent.target["B"], token=run.agent.token, live=live)
        return
    if env._live is not None and run.rng.random() < 0.5:  # finish the one in progress now
        run.log[-1] = (eid, "live migration: result()")
        report = env._live.result(timeout=60)
        assert report["live"] and _migrated(env), report
        return
    steps = env.steps
    out = env.migrate(run.agent.target["B"], token=run.agent.token, live=live)  # (cancels a live one)
    if live:
        run.migrations.append(out)
    else:
        assert out["node"] == "B" and _migrated(env) and env.steps == steps, out


def _random_run(factory, seed: int, n_ops: int, tmp_path, *, n_actions: int = 2,
                seeded_resets_only: bool = False, replay_factory=None, workspaces: str | None = None,
                reseeds: bool = True, reseed_model_reused: bool = False, agent=None, **env_kwargs) -> _Run:
    """``reseeds``: forks and explore() branches reseed half of the time. The model env must then
    be a fresh one per replay (a reseed reaches generators a reset may not), unless
    ``reseed_model_reused``: a model env whose seeded reset sets every generator it draws from."""
    assert not (reseeds and isinstance(replay_factory, _Reused) and not reseed_model_reused)
    run = _Run(factory, random.Random(seed), n_actions, seeded_resets_only, replay_factory, workspaces,
               env_kwargs.get("private_dirs"),
               reseeds_process_wide=(env_kwargs.get("backend") != "pickle") if reseeds else None, agent=agent)
    first = ForkableEnv(factory, **env_kwargs)
    run.add(first, [], True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. steps after an episode's end in a branch
            for i in range(n_ops):
                _one_op(run, tmp_path, i)
        return run
    finally:
        for env, _h, _d in run.envs.values():
            env.close()
        for s in run.saved:
            s.snap.release()


@pytest.mark.criu
@pytest.mark.parametrize("seed", range(4))
def test_random_operations_fork_tier(seed, tmp_path):
    _random_run(cartpole, seed, 250, tmp_path)


@pytest.mark.criu
@pytest.mark.parametrize("seed", range(2))
def test_random_operations_fork_tier_box2d_with_a_store(seed, tmp_path):
    store = SnapshotStore(tmp_path / "store", max_in_memory=2)
    _random_run(lunar, seed, 150, tmp_path, n_actions=4, store=store)


@pytest.mark.criu
@pytest.mark.parametrize("seed", range(2))
def test_random_operations_global_rng_env(seed, tmp_path):
    # a reset without a seed reseeds `random` from fresh entropy: not reproducible by replay
    _random_run(global_random, seed, 200, tmp_path, seeded_resets_only=True)


@pytest.mark.criu
@pytest.mark.parametrize("fork_tier", [True, False], ids=["fork-tier", "criu-dumps"])
def test_random_operations_on_an_agent_env_with_a_workspace(fork_tier, tmp_path):
    """An agent env that appends a note per step to a file in its workspace and observes how
    many there are: every restore, fork, explore branch, bundle and from_snapshot() must come
    with the snapshot's files. The model replays in a fresh directory."""
    ws = tmp_path / "ws"
    ws.mkdir()
    models = tmp_path / "models"
    models.mkdir()
    _random_run(functools.partial(agent_envs.notes_in, str(ws)), 3, 150 if fork_tier else 50, tmp_path,
                n_actions=4, workspace=str(ws), fork_tier=fork_tier, workspaces=str(tmp_path),
                replay_factory=lambda: agent_envs.notes_in(tempfile.mkdtemp(dir=models)))


@pytest.mark.criu
@pytest.mark.parametrize("seed", range(2))
def test_random_operations_on_step_rings_from_the_first_step(seed, tmp_path, monkeypatch):
    """Every worker steps through its shared-memory ring from its first step (normally after
    64), so each restored, forked and branched copy makes its own ring at once."""
    from gym_fork.backends.base import RemoteHandle
    from gym_fork.worker import ring as rings
    from gym_fork.worker import ring_slots

    monkeypatch.setattr(RemoteHandle, "RING_AFTER", 0)
    monkeypatch.setattr(rings, "wanted", lambda: True)
    monkeypatch.setattr(ring_slots, "claim", lambda: ring_slots.Slot(None))  # whatever else runs
    _random_run(cartpole, 20 + seed, 200, tmp_path)


@pytest.mark.criu
@pytest.mark.parametrize("seed", [0, 3])
def test_random_operations_on_an_env_with_a_redis_server_child(seed, tmp_path):
    """The agent use case: state in a real redis-server the env starts, reached over a unix
    socket bound in a directory every copy has to itself (``private_dirs``). Every snapshot is
    a CRIU dump of the process tree; each restored copy, fork and branch has its own server."""
    sockets = tmp_path / "sockets"
    sockets.mkdir()
    model = _Reused(agent_envs.redis_unix())
    try:
        _random_run(functools.partial(agent_envs.redis_unix_in, str(sockets)), seed, 100, tmp_path, n_actions=4,
                    replay_factory=model, fork_tier=False, private_dirs=[str(sockets)], reseeds=False)
    finally:
        model.env.close()


@pytest.mark.criu
@pytest.mark.parametrize("fork_tier", [True, False], ids=["fork-tier", "criu-dumps"])
def test_random_operations_mujoco(fork_tier, tmp_path):
    # one model env for every replay (it is slow to start): its reset(seed) sets all its state
    model = _Reused(half_cheetah())
    try:
        _random_run(half_cheetah, 5, 150 if fork_tier else 50, tmp_path, n_actions=4, replay_factory=model,
                    fork_tier=fork_tier, reseed_model_reused=True)
    finally:
        model.env.close()


@pytest.mark.criu
def test_random_operations_atari(tmp_path):
    pytest.importorskip("ale_py")  # (installed with the full suite's extras)
    model = _Reused(pong_ram())
    try:
        _random_run(pong_ram, 6, 100, tmp_path, n_actions=6, replay_factory=model, reseed_model_reused=True)
    finally:
        model.env.close()


@pytest.mark.criu
@pytest.mark.parametrize("seed", [42, 44])  # (seeds whose live migrations both switch and are cancelled)
def test_random_operations_with_migrations(seed, agent, tmp_path):
    """Envs also move to a local ``gym-fork agent`` (stop and copy, or live: the switch comes in a
    later step, or a snapshot/restore/fork cancels it). A moved env must go on exactly; what
    needs a local worker (snapshot, restore, fork) is refused with MigratedEnvError, the env
    untouched."""
    run = _random_run(cartpole, seed, 150, tmp_path, agent=agent)
    assert run.migrations and all(m.done() for m in run.migrations)  # (switched, cancelled or failed)


@pytest.mark.criu
def test_random_operations_criu_dumps(tmp_path):
    _random_run(cartpole, 10, 60, tmp_path, fork_tier=False)


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_pickle(seed, tmp_path):
    store = SnapshotStore(tmp_path / "store", max_in_memory=2) if seed % 2 else None
    _random_run(cartpole, seed, 300, tmp_path, backend="pickle", store=store)


def _vector_run(mode: AutoresetMode, seed: int, n_ops: int, backend: str) -> None:
    rng = random.Random(seed)
    n = 3
    ref = SyncVectorEnv([lambda: gym.make("CartPole-v1", max_episode_steps=12)] * n, autoreset_mode=mode)
    fv = ForkableVectorEnv([lambda: gym.make("CartPole-v1", max_episode_steps=12)] * n,
                           autoreset_mode=mode, backend=backend)
    saved: list = []  # (snapshot, sub-env copy, pending autoreset, observation)
    log: list = []

    def put(j: int, env: gym.Env, pending: bool, obs) -> None:
        ref.envs[j] = copy.deepcopy(env)
        ref._autoreset_envs[j] = pending
        ref._env_obs[j] = obs
        ref._observations[j] = obs

    try:
        assert same(ref.reset(seed=seed)[0], fv.reset(seed=seed)[0])
        for i in range(n_ops):
            r = rng.random()
            if r < 0.6:
                if mode == AutoresetMode.DISABLED and ref._autoreset_envs.any():
                    mask = ref._autoreset_envs.copy()
                    log.append(("reset", mask.tolist()))
                    want, got = ref.reset(options={"reset_mask": mask})[0], fv.reset(options={"reset_mask": mask})[0]
                    assert same(want, got), f"partial reset {i}: {log[-8:]}"
                    continue
                actions = np.array([rng.randrange(2) for _ in range(n)])
                log.append(("step", actions.tolist()))
                want, got = ref.step(actions), fv.step(actions)
                for k in range(4):
                    assert same(np.asarray(want[k]), np.asarray(got[k])), f"step {i}, field {k}: {log[-8:]}"
                if "_final_obs" in want[4]:
                    assert same(want[4]["_final_obs"], got[4]["_final_obs"])
                    for j in np.flatnonzero(want[4]["_final_obs"]):
                        assert same(want[4]["final_obs"][j], got[4]["final_obs"][j]), f"final_obs {i}"
            elif r < 0.75:
                j = rng.randrange(n)
                log.append(("snapshot", j))
                # SAME_STEP: the ended episode was reset within the step (the flag is only a record)
                pending = bool(ref._autoreset_envs[j]) and mode != AutoresetMode.SAME_STEP
                saved.append((fv.snapshot(j, restore_soon=rng.choice([None, True, False])),
                              copy.deepcopy(ref.envs[j]), pending, ref._env_obs[j].copy()))
            elif r < 0.9 and saved:
                j, k = rng.randrange(n), rng.randrange(len(saved))
                log.append(("restore", j, k))
                snap, env, pending, obs = saved[k]
                got, _ = fv.restore(j, snap)
                put(j, env, pending, obs)
                assert same(np.asarray(got), obs), f"restore {i}: {log[-8:]}"
            elif saved:
                k = rng.randrange(len(saved))
                slots = rng.sample(range(n), rng.randrange(1, n + 1))
                log.append(("fork_into", k, slots))
                snap, env, pending, obs = saved[k]
                got, _ = fv.fork_into(snap, slots)
                for j in slots:
                    put(j, env, pending, obs)
                    assert same(np.asarray(got[j]), obs), f"fork_into {i}: {log[-8:]}"
    finally:
        fv.close()
        ref.close()


@pytest.mark.criu
@pytest.mark.parametrize("mode", list(AutoresetMode), ids=lambda m: m.name)
def test_random_vector_operations(mode):
    for seed in range(2):
        _vector_run(mode, seed, 150, "criu")


@pytest.mark.parametrize("mode", list(AutoresetMode), ids=lambda m: m.name)
def test_random_vector_operations_pickle(mode):
    _vector_run(mode, 7, 150, "pickle")
