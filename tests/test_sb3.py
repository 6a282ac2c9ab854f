"""BranchExplorationCallback: real CRIU workers, real (short) SB3 learn() runs, no mocks."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import torch as th
from conftest import same
from stable_baselines3 import A2C, DQN, PPO, SAC
from stable_baselines3.common.callbacks import BaseCallback, CallbackList
from stable_baselines3.common.vec_env import DummyVecEnv, VecMonitor, VecNormalize

import gym_fork.sb3.exploration
from gym_fork.sb3 import BranchExplorationCallback
from gym_fork.vec_env import ForkableVecEnv

pytestmark = pytest.mark.criu


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    # 2 cores shared with the env workers: torch's default threading is ~8x slower here.
    n = th.get_num_threads()
    th.set_num_threads(1)
    yield
    th.set_num_threads(n)


@pytest.fixture
def cartpole():
    # short episodes, so branches end by time-limit truncation as well as by termination
    venv = ForkableVecEnv("CartPole-v1", n_envs=2, seed=0, env_kwargs={"max_episode_steps": 8})
    yield venv
    venv.close()


def _replay_branch(cb: BranchExplorationCallback, branch) -> list[tuple]:
    """Replay one branch's actions by hand from the fork point's root snapshot, with the same
    reseed seed: [(obs_before, obs_after, reward, terminated, truncated)]."""
    env = cb.venv.envs[cb.last_slot]
    kid = env.fork(cb.last_result.root, 1, rng="reseed", seeds=[branch.seed])[0]
    try:
        obs, _info, _ = kid._request("last")
        out = []
        for a in branch.actions:
            o2, r, term, trunc, _ = kid.step(a)
            out.append((obs, o2, r, term, trunc))
            obs = o2
        return out
    finally:
        kid.close()


def _check_buffer(model, cb: BranchExplorationCallback, scale: float = 1.0) -> None:
    rb = model.replay_buffer
    assert cb.last_transitions, "nothing was added at the last fork point"
    # 1. the buffer rows are exactly the recorded branch transitions
    for tr, pos, col in cb.last_transitions:
        assert same(rb.observations[pos, col], np.asarray(tr.obs, dtype=rb.observations.dtype))
        assert same(rb.next_observations[pos, col], np.asarray(tr.next_obs, dtype=rb.observations.dtype))
        assert np.allclose(rb.actions[pos, col], np.asarray(tr.buffer_action).reshape(-1))
        assert rb.rewards[pos, col] == np.float32(tr.reward)
        assert rb.dones[pos, col] == float(tr.done)
        assert rb.timeouts[pos, col] == float(tr.truncated)
    # 2. the recorded transitions are the branches' true trajectories (replayed by hand)
    by_branch: dict[int, list] = {}
    for tr in cb.last_branch_transitions:
        by_branch.setdefault(tr.branch, []).append(tr)
    assert len(by_branch) == cb.n_branches
    for b in cb.last_result.branches:
        trs, ref = by_branch[b.index], _replay_branch(cb, b)
        assert len(trs) == len(ref) == b.length
        for k, (tr, (o, o2, r, term, trunc)) in enumerate(zip(trs, ref)):
            assert same(np.asarray(tr.obs), np.asarray(o)), (b.index, k)
            assert same(np.asarray(tr.next_obs), np.asarray(o2)), (b.index, k)  # never a reset obs
            assert tr.reward == float(r)
            assert tr.done == (term or trunc) and tr.truncated == (trunc and not term)
            assert np.allclose(np.asarray(tr.buffer_action), np.asarray(tr.action) * scale)


def test_dqn_buffer_transitions_match_branches(cartpole):
    # epsilon = 1: random branch actions, so branches outlive the 8-step time limit
    model = DQN("MlpPolicy", cartpole, learning_starts=50, train_freq=4, exploration_final_eps=1.0,
                device="cpu", seed=0)
    cb = BranchExplorationCallback(every=100, n_branches=6, horizon=16, mode="buffer", seed=1)
    model.learn(400, callback=cb)
    assert len(cb.history) == 4
    _check_buffer(model, cb)
    assert any(t.truncated for t in cb.last_branch_transitions)  # time-limit rows: timeouts=1
    # across all fork points: added + pending == simulated, nothing padded or lost
    added = sum(h["added_transitions"] for h in cb.history)
    assert added + len(cb.pending) == cb.total_steps_simulated
    assert added % cartpole.num_envs == 0
    # the buffer holds learn()'s own 400 steps (200 rows of 2) plus the branch rows
    assert model.replay_buffer.pos == 200 + added // 2
    h = cb.history[-1]
    assert h["prefix_steps_saved"] == cb.last_result.root.steps * 6
    assert h["steps_simulated"] == cb.last_result.steps
    # branch seeds come from SeedSequence(seed): fork point k uses its k-th child
    expect = np.random.SeedSequence(1).spawn(4)[3].generate_state(6, np.uint64) % (2**63)
    assert [b.seed for b in cb.last_result.branches] == [int(s) for s in expect]
    cb.release()
    assert cb.last_result is None


def test_sac_buffer_scaled_actions_pendulum():
    venv = ForkableVecEnv("Pendulum-v1", n_envs=2, seed=0)
    try:
        model = SAC("MlpPolicy", venv, learning_starts=100, batch_size=32, device="cpu", seed=0)
        cb = BranchExplorationCallback(every=200, n_branches=4, horizon=8, mode="buffer", seed=2)
        model.learn(400, callback=cb)
        assert len(cb.history) == 2 and cb.history[-1]["added_transitions"] == 32
        _check_buffer(model, cb, scale=0.5)  # Pendulum's actions are in [-2, 2]: stored / 2
        assert not any(t.done for t in cb.last_branch_transitions)  # 200-step episodes
        # evaluate on SAC: Q(s, a ~ pi(s)), min over the twin critics
        ev = BranchExplorationCallback(every=100, n_branches=4, horizon=8, mode="evaluate", seed=3)
        model.learn(100, callback=ev)
        h = ev.history[-1]
        assert np.isfinite([h["value_at_fork"], h["mc_return_mean"], h["value_error"]]).all()
    finally:
        venv.close()


class _JumpChecker(BaseCallback):
    """Runs right after a return_to_best callback (CallbackList order) and checks each jump."""

    def __init__(self, cb: BranchExplorationCallback):
        super().__init__()
        self.cb, self.jumps, self.expect, self.truncations = cb, 0, None, 0

    def _on_step(self) -> bool:
        if self.expect is not None:  # the step after a jump: SB3 acts from the branch's end
            slot, obs = self.expect
            assert same(self.model._last_obs[slot], np.asarray(obs, dtype=self.model._last_obs.dtype))
            assert self.model._last_episode_starts[slot]  # no GAE across the jump
            self.expect = None
        h = self.cb.history[-1] if self.cb.history else None
        if h is None or h["num_timesteps"] != self.num_timesteps or not h.get("jumped"):
            return True
        slot, best = self.cb.last_slot, self.cb.last_result.best()
        new_obs, dones, infos = self.locals["new_obs"], self.locals["dones"], self.locals["infos"]
        assert same(new_obs[slot], np.asarray(best.final_obs, dtype=new_obs.dtype))
        assert same(self.cb.venv.current_obs[slot], np.asarray(best.final_obs))
        # a jump marks the step as a time-limit truncation, unless the step had really ended
        # its episode already (then it stays that episode end, terminal or truncated)
        assert dones[slot] and "terminal_observation" in infos[slot]
        self.truncations += bool(infos[slot].get("TimeLimit.truncated"))
        # the slot's simulator state is the best branch's end state
        ref = self.cb.venv.envs[slot].fork(best.snapshot, 1)[0]
        try:
            assert same(np.asarray(self.cb.venv.envs[slot].unwrapped.state), np.asarray(ref.unwrapped.state))
        finally:
            ref.close()
        assert self.cb.venv.envs[slot].steps == best.snapshot.steps
        self.jumps += 1
        self.expect = (slot, best.final_obs)
        return True


def test_ppo_return_to_best_jumps_and_truncates():
    venv = ForkableVecEnv("CartPole-v1", n_envs=2, seed=0)
    try:
        model = PPO("MlpPolicy", venv, n_steps=32, batch_size=32, n_epochs=1, device="cpu", seed=0)
        cb = BranchExplorationCallback(every=16, n_branches=4, horizon=6, mode="return_to_best", seed=4)
        checker = _JumpChecker(cb)
        model.learn(256, callback=CallbackList([cb, checker]))
        assert checker.jumps >= 3 and checker.truncations >= 1
        assert sum(h["jumped"] for h in cb.history) == checker.jumps
        assert all(h["jump_steps"] == 6 for h in cb.history if h["jumped"])
    finally:
        venv.close()


class _ValueChecker(BaseCallback):
    def __init__(self, cb: BranchExplorationCallback):
        super().__init__()
        self.cb, self.checked = cb, 0

    def _on_step(self) -> bool:
        h = self.cb.history[-1] if self.cb.history else None
        if h is None or h["num_timesteps"] != self.num_timesteps:
            return True
        slot, res = self.cb.last_slot, self.cb.last_result
        obs = self.locals["new_obs"][slot]
        with th.no_grad():
            v = self.model.policy.predict_values(self.model.policy.obs_to_tensor(obs)[0]).item()
        assert h["value_at_fork"] == pytest.approx(v, rel=1e-5, abs=1e-6)
        g = self.model.gamma
        mc = np.mean([sum(r * g**t for t, r in enumerate(b.rewards)) for b in res.branches])
        assert h["mc_return_mean"] == pytest.approx(mc)
        assert h["value_error"] == pytest.approx(h["value_at_fork"] - h["mc_bootstrap_return_mean"])
        self.checked += 1
        return True


@pytest.mark.parametrize("algo", [PPO, A2C])
def test_evaluate_logs_calibration_and_changes_nothing(algo):
    venv = ForkableVecEnv("CartPole-v1", n_envs=2, seed=0)
    try:
        kw = dict(n_steps=32, batch_size=32, n_epochs=1) if algo is PPO else dict(n_steps=8)
        model = algo("MlpPolicy", venv, device="cpu", seed=0, **kw)
        cb = BranchExplorationCallback(every=32, n_branches=4, horizon=8, mode="evaluate", seed=5)
        checker = _ValueChecker(cb)
        model.learn(128, callback=CallbackList([cb, checker]))
        assert checker.checked == len(cb.history) == 4
        assert all(h["steps_simulated"] > 0 and h["time_s"] > 0 for h in cb.history)
    finally:
        venv.close()


def _trained(algo, callback) -> tuple[np.ndarray, np.ndarray]:
    venv = ForkableVecEnv("CartPole-v1", n_envs=2, seed=0)
    try:
        kw = dict(n_steps=32, batch_size=32, n_epochs=1) if algo is PPO else dict(learning_starts=50, train_freq=4)
        model = algo("MlpPolicy", venv, device="cpu", seed=0, **kw)
        model.learn(256, callback=callback)
        params = th.cat([p.detach().flatten() for p in model.policy.parameters()]).numpy()
        return params, venv.current_obs.copy()
    finally:
        venv.close()


@pytest.mark.parametrize("algo", [PPO, DQN])
def test_evaluate_leaves_training_bit_identical(algo):
    """"evaluate": training is unchanged. Before, the branches' actions (``model.predict`` in the
    learner) drew from the learner's generators -- torch's for PPO's samples, the action space's
    for DQN's epsilon-greedy -- so every later draw of the learner's changed, and the trained
    weights differed from a run without the callback."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (DQN's late, near-greedy branches go on alike: said)
        cb = BranchExplorationCallback(every=40, n_branches=3, horizon=8, mode="evaluate", seed=0)
        with_cb, without = _trained(algo, cb), _trained(algo, None)
    assert len(cb.history) >= 5
    assert same(with_cb[0], without[0]) and same(with_cb[1], without[1])


def test_invalid_configs_raise_at_learn_start(cartpole):
    with pytest.raises(ValueError, match="mode"):
        BranchExplorationCallback(mode="bogus")
    with pytest.raises(ValueError, match="horizon"):
        BranchExplorationCallback(horizon=0)
    with pytest.raises(ValueError, match="n_branches"):
        BranchExplorationCallback(n_branches=0)
    with pytest.raises(ValueError, match="every"):
        BranchExplorationCallback(every=None)
    ppo = PPO("MlpPolicy", cartpole, n_steps=8, batch_size=8, device="cpu")
    # buffer on an on-policy algorithm: refused before a single env step
    with pytest.raises(ValueError, match="off-policy"):
        ppo.learn(16, callback=BranchExplorationCallback(every=8, mode="buffer"))
    assert ppo.num_timesteps == 0
    # an attribute changed after construction is checked again at learn() start
    cb = BranchExplorationCallback(every=8, mode="evaluate")
    cb.horizon = 0
    with pytest.raises(ValueError, match="horizon"):
        ppo.learn(16, callback=cb)
    with pytest.raises(ValueError, match="env_index"):
        ppo.learn(16, callback=BranchExplorationCallback(every=8, mode="evaluate", env_index=5))
    # not a ForkableVecEnv
    dummy = DummyVecEnv([lambda: __import__("gymnasium").make("CartPole-v1")])
    with pytest.raises(TypeError, match="ForkableVecEnv"):
        PPO("MlpPolicy", dummy, n_steps=8, batch_size=8, device="cpu").learn(
            16, callback=BranchExplorationCallback(every=8, mode="evaluate"))
    # VecNormalize refused; VecMonitor seen through
    with pytest.raises(TypeError, match="VecNormalize"):
        PPO("MlpPolicy", VecNormalize(cartpole), n_steps=8, batch_size=8, device="cpu").learn(
            16, callback=BranchExplorationCallback(every=8, mode="evaluate"))
    mon = PPO("MlpPolicy", VecMonitor(cartpole), n_steps=8, batch_size=8, device="cpu")
    cb = BranchExplorationCallback(every=8, n_branches=2, horizon=4, mode="evaluate")
    mon.learn(16, callback=cb)
    assert len(cb.history) == 2


def test_docstring_example():
    res = doctest.testmod(gym_fork.sb3.exploration, verbose=False)
    assert res.attempted > 0 and res.failed == 0


def test_a2c_return_to_best_with_progress_bar_and_logger(tmp_path):
    """A2C + return_to_best inside a real learn(progress_bar=True); the branch/ keys reach SB3's
    logger outputs (CSV here; TensorBoard uses the same logger.record calls)."""
    from stable_baselines3.common.logger import configure

    venv = ForkableVecEnv("CartPole-v1", n_envs=2, seed=1)
    try:
        model = A2C("MlpPolicy", venv, n_steps=8, device="cpu", seed=1)
        model.set_logger(configure(str(tmp_path), ["csv"]))
        cb = BranchExplorationCallback(every=16, n_branches=4, horizon=6, mode="return_to_best", seed=2)
        checker = _JumpChecker(cb)
        model.learn(400, callback=CallbackList([cb, checker]), progress_bar=True, log_interval=2)
        assert checker.jumps >= 2
        header = (tmp_path / "progress.csv").read_text().splitlines()[0].split(",")
        for key in ("branch/n_branches", "branch/mean_return", "branch/max_return", "branch/steps_simulated",
                    "branch/time_s", "branch/prefix_steps_saved", "branch/jumped"):
            assert key in header, key
    finally:
        venv.close()


@pytest.mark.parametrize("algo,env_id,mode", [(DQN, "CartPole-v1", "return_to_best"), (DQN, "CartPole-v1", "evaluate"),
                                              (SAC, "Pendulum-v1", "return_to_best")])
def test_off_policy_return_to_best_and_evaluate(algo, env_id, mode):
    """The remaining applicable (algorithm, mode) pairs, in real learn() runs."""
    venv = ForkableVecEnv(env_id, n_envs=2, seed=3)
    try:
        kw = dict(learning_starts=32, buffer_size=2000, batch_size=16, train_freq=8)
        if algo is SAC:
            kw.update(gradient_steps=1)
        model = algo("MlpPolicy", venv, device="cpu", seed=3, **kw)
        cb = BranchExplorationCallback(every=32, n_branches=4, horizon=5, mode=mode, seed=5)
        extra = [_JumpChecker(cb)] if mode == "return_to_best" else []
        model.learn(200, callback=CallbackList([cb, *extra]))
        assert cb.history, "no fork point was reached"
        if mode == "return_to_best":
            assert extra[0].jumps >= 1
            assert sum(h["jumped"] for h in cb.history) == extra[0].jumps
        else:
            for h in cb.history:
                assert np.isfinite([h["value_at_fork"], h["mc_return_mean"], h["value_error"]]).all()
    finally:
        venv.close()
