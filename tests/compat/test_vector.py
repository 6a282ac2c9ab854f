"""gym_fork.vector.ForkableVectorEnv behaves as Gymnasium's own vector envs do (bit for bit), and
its snapshots carry each slot's state *and* its pending autoreset.

Every comparison is against gymnasium.vector.SyncVectorEnv run with the same seeds and actions,
or against the same slot replayed from the same snapshot.
"""

from __future__ import annotations

import doctest
import subprocess
import sys
import textwrap

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from gymnasium.vector.utils import batch_space

import gym_fork.vector
from gym_fork.errors import ForeignSnapshotError, SnapshotReleasedError
from gym_fork.vector import ForkableVectorEnv, make_vec

pytestmark = pytest.mark.criu

MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]


def same(a, b) -> bool:
    """Bit-exact equality of batched results: arrays by dtype, shape and bytes (object arrays
    element by element), dicts including key order, floats by their bytes."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if type(a) is not type(b) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.dtype == object:
            return all(same(x, y) for x, y in zip(a.ravel(), b.ravel()))
        return a.tobytes() == b.tobytes()
    if isinstance(a, dict) or isinstance(b, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, (float, np.floating)):
        return type(a) is type(b) and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    return type(a) is type(b) and bool(a == b)


def assert_same(a, b, where: str = "") -> None:
    assert same(a, b), f"differs {where}:\n{a!r}\n{b!r}"


def actions_for(single_space: gym.Space, n: int, steps: int, seed: int) -> list:
    space = batch_space(single_space, n)
    space.seed(seed)
    return [space.sample() for _ in range(steps)]


def drive(envs, actions: list, mode: AutoresetMode, seed) -> tuple[list, int, int]:
    """Reset with ``seed``, step through ``actions`` (with DISABLED, reset ended sub-envs through
    reset_mask as a user must), reseed mid-way with a list; every result in order."""
    out = [envs.reset(seed=seed)]
    terms = truncs = 0
    for t, a in enumerate(actions):
        res = envs.step(a)
        out.append(res)
        terms += int(res[2].sum())
        truncs += int(res[3].sum())
        if mode == AutoresetMode.DISABLED and (res[2] | res[3]).any():
            out.append(envs.reset(options={"reset_mask": res[2] | res[3]}))
        if t == len(actions) // 2:
            out.append(envs.reset(seed=[seed + 100] + [None] * (envs.num_envs - 1)))
    return out, terms, truncs


CASES = {
    # (factory for both vector envs, gym_fork's env_fns entry, steps): truncations need a short limit
    "CartPole": (lambda: gym.make("CartPole-v1", max_episode_steps=30),
                 lambda: gym.make("CartPole-v1", max_episode_steps=30), 160),
    "LunarLander": (lambda: gym.make("LunarLander-v3"), "LunarLander-v3", 260),
}


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
@pytest.mark.parametrize("case", list(CASES))
def test_bit_identical_to_sync_vector_env(case, mode):
    sync_fn, fork_fn, steps = CASES[case]
    ref = SyncVectorEnv([sync_fn] * 3, autoreset_mode=mode)
    envs = ForkableVectorEnv([fork_fn] * 3, autoreset_mode=mode)
    try:
        assert envs.metadata["autoreset_mode"] is mode
        assert envs.single_observation_space == ref.single_observation_space
        assert envs.observation_space == ref.observation_space
        assert envs.single_action_space == ref.single_action_space
        assert envs.action_space == ref.action_space
        actions = actions_for(ref.single_action_space, 3, steps, seed=7)
        got, terms, truncs = drive(envs, actions, mode, seed=123)
        want, *_ = drive(ref, actions, mode, seed=123)
        assert len(got) == len(want)
        for k, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"at result {k}")
        assert terms >= 3, "the run must cross episode ends"
        if case == "CartPole":
            assert truncs >= 1, "the run must cross a truncation too"
    finally:
        envs.close()
        ref.close()


@pytest.mark.parametrize("mode", MODES[:2], ids=[m.value for m in MODES[:2]])
def test_episode_ends_cost_no_round_trip_of_their_own(mode, monkeypatch):
    """SAME_STEP: a worker whose step ends the episode resets in that request (no reset request
    at all). NEXT_STEP: the reset that replaces a sub-env's next step is sent with the others'
    steps, before any reply is read (before: a round trip of its own, waited for one by one).
    The results stay SyncVectorEnv's, bit for bit."""
    from gym_fork.backends.base import RemoteHandle

    fn = lambda: gym.make("CartPole-v1", max_episode_steps=6)  # noqa: E731
    ref = SyncVectorEnv([fn] * 3, autoreset_mode=mode)
    envs = ForkableVectorEnv([fn] * 3, autoreset_mode=mode)
    calls: list = []
    for name in ("send", "receive", "request"):
        def spy(self, *args, _f=getattr(RemoteHandle, name), _name=name):
            calls.append((_name, args[0] if args else None))
            return _f(self, *args)
        monkeypatch.setattr(RemoteHandle, name, spy)
    try:
        assert_same(envs.reset(seed=5), ref.reset(seed=5))
        resets = 0
        for t in range(20):
            a = np.array([t % 2, 1, 0])
            del calls[:]
            got = envs.step(a)
            assert_same(got, ref.step(a), f"at step {t}")
            cmds = [c for _, c in calls if c is not None]
            assert [k for k, _ in calls] == ["send"] * 3 + ["receive"] * 3, calls  # (no request of its own)
            resets += cmds.count("reset")
        assert (resets > 0) == (mode == AutoresetMode.NEXT_STEP)
    finally:
        monkeypatch.undo()
        envs.close()
        ref.close()


def test_pickle_backend_bit_identical_to_sync_vector_env():
    fn = CASES["CartPole"][0]
    ref = SyncVectorEnv([fn] * 2)
    envs = ForkableVectorEnv([fn] * 2, backend="pickle")
    try:
        actions = actions_for(ref.single_action_space, 2, 100, seed=3)
        got, *_ = drive(envs, actions, AutoresetMode.NEXT_STEP, seed=5)
        want, *_ = drive(ref, actions, AutoresetMode.NEXT_STEP, seed=5)
        for k, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"at result {k}")
    finally:
        envs.close()
        ref.close()


def test_gymnasium_vector_wrappers_on_top_see_the_same_episodes():
    """Gymnasium's RecordEpisodeStatistics (which reads metadata['autoreset_mode']) on top of each
    gives the same episode statistics."""
    for mode in (AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP):
        fn = CASES["CartPole"][0]
        ref = gym.wrappers.vector.RecordEpisodeStatistics(SyncVectorEnv([fn] * 2, autoreset_mode=mode))
        envs = gym.wrappers.vector.RecordEpisodeStatistics(ForkableVectorEnv([fn] * 2, autoreset_mode=mode))
        try:
            actions = actions_for(ref.single_action_space, 2, 120, seed=1)
            got, *_ = drive(envs, actions, mode, seed=9)
            want, *_ = drive(ref, actions, mode, seed=9)
            episodes = [o[4]["episode"] for o in want[1:] if len(o) == 5 and "episode" in o[4]]
            assert len(episodes) >= 2
            # the wrapper's timing field differs between runs; everything else must not
            for g, w in zip(got, want):
                if len(g) == 5 and "episode" in w[4]:
                    g[4]["episode"].pop("t"), w[4]["episode"].pop("t")
                assert_same(g, w)
            assert list(envs.return_queue) == list(ref.return_queue)
            assert envs.unwrapped.metadata["autoreset_mode"] is mode
        finally:
            envs.close()
            ref.close()


def test_spaces_metadata_and_returned_data_follow_gymnasium():
    envs = make_vec("LunarLander-v3", num_envs=2, vector_kwargs={"autoreset_mode": "SameStep"})
    try:
        assert isinstance(envs, gym.vector.VectorEnv) and envs.unwrapped is envs
        assert envs.metadata["autoreset_mode"] is AutoresetMode.SAME_STEP
        assert envs.metadata["render_fps"] == gym.make("LunarLander-v3").metadata["render_fps"]
        assert repr(envs) == "ForkableVectorEnv(LunarLander-v3, num_envs=2)"
        assert envs.spec.id == "LunarLander-v3" and envs.spec.kwargs["num_envs"] == 2
        obs, info = envs.reset(seed=0)
        assert envs.observation_space.contains(obs) and info == {}
        # copy=True (the default): what step() returns is not this env's buffer
        obs2, rew, term, trunc, _ = envs.step(envs.action_space.sample())
        assert envs.observation_space.contains(obs2)
        obs2[:] = 0
        obs3, *_ = envs.step(envs.action_space.sample())
        assert not (obs3 == 0).all()
        assert rew.dtype == np.float64 and term.dtype == trunc.dtype == np.bool_
        with pytest.raises(ValueError, match="length must match num_envs"):
            envs.reset(seed=[1, 2, 3])
        with pytest.raises(TypeError, match="reset_mask"):
            envs.reset(options={"reset_mask": [True, False]})
    finally:
        envs.close()
    assert envs.closed


def test_call_get_attr_set_attr_act_on_the_worker_envs():
    fn = CASES["CartPole"][0]
    ref = SyncVectorEnv([fn] * 3)
    envs = ForkableVectorEnv([fn] * 3)
    try:
        for v in (envs, ref):
            v.reset(seed=1)
        assert envs.get_attr("gravity") == ref.get_attr("gravity") == (9.8, 9.8, 9.8)
        assert envs.np_random_seed == ref.np_random_seed == (1, 2, 3)
        assert envs.get_attr("spec")[0] == ref.get_attr("spec")[0]
        # a write reaches the physics of each worker's env (and only the slots asked for)
        for v in (envs, ref):
            v.set_attr("force_mag", [100.0, 10.0, 0.5])
        assert envs.get_attr("force_mag") == (100.0, 10.0, 0.5)
        # a method call runs in the worker: reset(seed=...) through call() changes the real env
        got = envs.call("reset", seed=77)
        want = ref.call("reset", seed=77)
        assert_same(got, want)
        actions = actions_for(ref.single_action_space, 3, 15, seed=2)
        for a in actions:
            assert_same(envs.step(a), ref.step(a))
        with pytest.raises(AttributeError):
            envs.get_attr("no_such_attribute")
        with pytest.raises(ValueError, match="length equal to the number of environments"):
            envs.set_attr("force_mag", [1.0, 2.0])
        assert envs.render() == ref.render() == (None, None, None)
    finally:
        envs.close()
        ref.close()


def _run(envs, actions) -> list:
    return [envs.step(a) for a in actions]


def test_snapshot_restore_continuations_are_bit_identical():
    envs = ForkableVectorEnv(["LunarLander-v3"] * 3)
    try:
        envs.reset(seed=4)
        warmup = actions_for(envs.single_action_space, 3, 30, seed=5)
        _run(envs, warmup)
        snap = envs.snapshot(1)
        before = envs.step(np.array([0, 0, 0]))[0]
        rest = actions_for(envs.single_action_space, 3, 120, seed=6)
        first = _run(envs, rest)
        assert any((r[2] | r[3])[1] for r in first), "slot 1 must cross an episode end"
        obs, info = envs.restore(1, snap)
        assert obs.shape == (8,) and info == {}
        # slot 1 is back; its continuation is the same, bit for bit
        again = envs.step(np.array([0, 0, 0]))[0]
        assert_same(again[1], before[1])
        second = _run(envs, rest)
        for k, (x, y) in enumerate(zip(first, second)):
            assert_same(x[0][1], y[0][1], f"obs at step {k}")
            for part in (1, 2, 3):
                assert_same(x[part][1], y[part][1], f"result {part} at step {k}")
    finally:
        envs.close()


def _step_until_end(envs, slot: int, action: np.ndarray, limit: int = 600):
    """Step with ``action`` until slot ``slot``'s episode has just ended; the last result."""
    for _ in range(limit):
        res = envs.step(action)
        if res[2][slot] or res[3][slot]:
            return res
    raise AssertionError(f"slot {slot}'s episode did not end in {limit} steps")


def test_restore_carries_the_pending_autoreset_of_an_ended_episode():
    """NEXT_STEP: a snapshot taken as slot 0's episode ended, restored into slot 1 while that is
    mid-episode, makes slot 1's next step a reset -- the one slot 0 did."""
    envs = ForkableVectorEnv(["CartPole-v1"] * 2)
    try:
        envs.reset(seed=0)
        push = np.array([1, 0])  # slot 0 falls fast; slot 1 stays up a while
        _step_until_end(envs, 0, push)
        snap = envs.snapshot(0)
        after_end = envs.step(np.array([1, 1]))  # slot 0 resets now (reward 0, its action ignored)
        assert after_end[1][0] == 0.0 and not after_end[2][0]
        envs.reset(options={"reset_mask": np.array([False, True])})
        envs.step(np.array([0, 0]))  # slot 1 is mid-episode
        assert envs.pending_reset.tolist() == [False, False]
        obs, _ = envs.restore(1, snap)
        assert envs.pending_reset.tolist() == [False, True]
        res = envs.step(np.array([0, 0]))
        assert res[1][1] == 0.0 and not res[2][1] and not res[3][1], "slot 1 must reset, not step"
        assert_same(res[0][1], after_end[0][0])
        # and from there it goes on as slot 0 did from its reset
        more = envs.step(np.array([1, 1]))
        assert more[1][1] == 1.0
    finally:
        envs.close()


def test_restore_clears_the_pending_autoreset_for_a_mid_episode_snapshot():
    """NEXT_STEP: a mid-episode snapshot restored into a slot whose episode has just ended
    continues the snapshot's episode on the next step (no reset)."""
    envs = ForkableVectorEnv(["CartPole-v1"] * 2)
    try:
        envs.reset(seed=3)
        envs.step(np.array([0, 1]))
        snap = envs.snapshot(0)
        cont = envs.step(np.array([1, 1]))  # slot 0 steps on from the snapshot
        assert cont[1][0] == 1.0
        _step_until_end(envs, 1, np.array([0, 1]))  # slot 1 has just ended
        assert envs.pending_reset[1]
        envs.restore(1, snap)
        assert not envs.pending_reset[1]
        res = envs.step(np.array([1, 1]))
        assert res[1][1] == 1.0, "slot 1 must step, not reset"
        for part in range(4):
            assert_same(res[part][1], cont[part][0], f"result {part}")
    finally:
        envs.close()


def test_disabled_mode_needs_a_reset_after_restoring_an_ended_episode():
    envs = ForkableVectorEnv(["CartPole-v1"] * 2, autoreset_mode="Disabled")
    try:
        envs.reset(seed=0)
        _step_until_end(envs, 0, np.array([1, 0]))
        ended = envs.snapshot(0)
        envs.reset(seed=1)
        envs.restore(1, ended)
        with pytest.raises(AssertionError, match=r"sub-envs \[1\]"):
            envs.step(np.array([0, 0]))
        obs, info = envs.reset(options={"reset_mask": np.array([False, True])})
        res = envs.step(np.array([0, 0]))
        assert res[1].tolist() == [1.0, 1.0]
    finally:
        envs.close()


def test_same_step_mode_resets_a_restored_ended_episode_at_once(tmp_path):
    """A SAME_STEP slot never rests at an episode end: a (saved) snapshot of one is reset on
    restore, and the restore's info carries the final observation, as the step's would."""
    src = ForkableVectorEnv(["CartPole-v1"])
    dst = ForkableVectorEnv(["CartPole-v1"] * 2, autoreset_mode="SameStep")
    try:
        src.reset(seed=0)
        last = _step_until_end(src, 0, np.array([1]))
        path = src.snapshot(0).save(str(tmp_path / "ended"))
        loaded = gym_fork.load_snapshot(path)
        dst.reset(seed=5)
        obs, info = dst.restore(1, loaded)
        assert_same(info["final_obs"], last[0][0])
        assert not np.array_equal(obs, last[0][0])
        res = dst.step(np.array([0, 0]))
        assert res[1][1] == 1.0, "slot 1 must step on from its reset"
    finally:
        src.close()
        dst.close()


def test_fork_into_gives_independent_copies_and_leaves_the_source_alone():
    ref = SyncVectorEnv([lambda: gym.make("LunarLander-v3")] * 3)
    envs = ForkableVectorEnv(["LunarLander-v3"] * 3)
    try:
        for v in (envs, ref):
            v.reset(seed=11)
        warm = actions_for(envs.single_action_space, 3, 20, seed=12)
        for a in warm:
            assert_same(envs.step(a), ref.step(a))
        snap = envs.snapshot(0)
        obs, infos = envs.fork_into(snap, [1, 2])
        assert infos == {}
        assert_same(obs[1], obs[0]) and assert_same(obs[2], obs[0])
        # each slot its own actions: slot 0 as the reference's slot 0 (untouched by the fork)
        rng = np.random.default_rng(13)
        steps = [rng.integers(0, 4, size=3) for _ in range(60)]
        traj = {1: [], 2: []}
        for a in steps:
            got, want = envs.step(a), ref.step(a)
            assert_same(got[0][0], want[0][0]) and assert_same(got[1][0], want[1][0])
            for i in (1, 2):
                traj[i].append((got[0][i], got[1][i]))
        assert not all(np.array_equal(x[0], y[0]) for x, y in zip(traj[1], traj[2]))
        # each copy is exactly the snapshot continued with its actions: replay in slot 0
        for i in (1, 2):
            envs.restore(0, snap)
            for k, a in enumerate(steps):
                out = envs.step(np.array([a[i], 0, 0]))
                assert_same((out[0][0], out[1][0]), traj[i][k], f"slot {i} step {k}")
    finally:
        envs.close()
        ref.close()


def test_fork_into_reseed_gives_each_copy_its_own_randomness():
    envs = ForkableVectorEnv(["CartPole-v1"] * 4)
    try:
        envs.reset(seed=0)
        _step_until_end(envs, 0, np.array([1, 0, 0, 0]))
        ended = envs.snapshot(0)  # the next step resets: the new episode draws from np_random
        envs.fork_into(ended, [1, 2, 3], rng="reseed", seeds=[5, 5, 6])
        obs = envs.step(np.zeros(4, dtype=np.int64))[0]
        assert_same(obs[1], obs[2])
        assert not np.array_equal(obs[1], obs[3]) and not np.array_equal(obs[1], obs[0])
    finally:
        envs.close()


def test_refused_restores_change_no_slot():
    envs = ForkableVectorEnv(["CartPole-v1"] * 2)
    other = ForkableVectorEnv(["CartPole-v1"])
    try:
        obs, _ = envs.reset(seed=0)
        other.reset(seed=0)
        foreign = other.snapshot(0)
        with pytest.raises(ForeignSnapshotError):
            envs.fork_into(foreign, [0, 1])
        snap = envs.snapshot(0)
        snap.release()
        with pytest.raises(SnapshotReleasedError):
            envs.fork_into(snap, [0, 1])
        with pytest.raises(ValueError):
            envs.fork_into(envs.snapshot(0), [1, 1])
        with pytest.raises(IndexError):
            envs.restore(2, envs.snapshot(0))
        # neither slot changed: the next step is the one a fresh reset(seed=0) leads to
        assert_same(envs.step(np.array([0, 0]))[0], _sync_first_step(0, [0, 0]))
    finally:
        envs.close()
        other.close()


def test_a_plain_envs_bundle_in_a_slot_gets_the_slot_layer_and_a_foreign_one_is_refused(tmp_path):
    """Before: a bundle saved from a plain ForkableEnv, restored into a slot, ran without the
    slot's layer: ``set_attr`` created an attribute nobody read (silently) and ``get_attr``/``call``
    raised; a bundle of an env with another observation space was switched to anyway, and every
    later step raised (the slot was lost)."""
    from gymnasium.wrappers import FrameStackObservation

    from gym_fork.errors import RestoreError

    plain = gym_fork.make("CartPole-v1")
    stacked = gym_fork.make("CartPole-v1", wrappers=[lambda e: FrameStackObservation(e, 4)])
    try:
        plain.reset(seed=0)
        plain.unwrapped.force_mag = 30.0
        plain.step(0)
        plain.snapshot().save(tmp_path / "plain")
        stacked.reset(seed=0)
        stacked.snapshot().save(tmp_path / "stacked")
    finally:
        plain.close()
        stacked.close()
    envs = ForkableVectorEnv(["CartPole-v1"] * 2)
    try:
        envs.reset(seed=0)
        with pytest.warns(UserWarning, match="does not record whether its episode had ended"):
            envs.restore(1, gym_fork.load_snapshot(tmp_path / "plain"))
        assert envs.get_attr("force_mag") == (10.0, 30.0)
        envs.set_attr("force_mag", 5.0)
        assert [e.unwrapped.force_mag for e in envs.envs] == [5.0, 5.0]
        assert envs.call("force_mag") == (5.0, 5.0)
        envs.reset(seed=0)
        pid = envs.envs[1].worker_pid
        with pytest.raises(RestoreError, match="observation space"):
            envs.restore(1, gym_fork.load_snapshot(tmp_path / "stacked"))
        assert envs.envs[1].worker_pid == pid  # slot 1 unchanged: it steps on
        envs.set_attr("force_mag", 10.0)
        assert_same(envs.step(np.array([0, 0]))[0], _sync_first_step(0, [0, 0]))
    finally:
        envs.close()


def _sync_first_step(seed: int, actions: list):
    ref = SyncVectorEnv([lambda: gym.make("CartPole-v1")] * len(actions))
    ref.reset(seed=seed)
    return ref.step(np.array(actions))[0]


def test_examples_in_the_docstrings_run():
    res = doctest.testmod(gym_fork.vector, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.attempted > 0 and res.failed == 0


def test_no_torch_in_this_process_or_the_workers():
    code = textwrap.dedent("""
        import sys
        import numpy as np
        import gym_fork.vector
        envs = gym_fork.vector.make_vec("CartPole-v1", num_envs=2)
        envs.reset(seed=0)
        envs.step(np.array([0, 1]))
        envs.fork_into(envs.snapshot(0), [1])
        envs.get_attr("gravity")
        for pid in [e.worker_pid for e in envs.envs]:
            maps = open(f"/proc/{pid}/maps").read()
            assert "libtorch" not in maps and "/torch/" not in maps, pid
        envs.close()
        assert "torch" not in sys.modules, "torch was imported"
        print("no torch")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "no torch"
