"""Envs a user defines and registers in their own script work through gym_fork as through Gymnasium.

Each case is a real user script run as ``__main__`` in a fresh interpreter, from a directory that
is not the script's own (so the worker must learn the script's ``sys.path`` too): an env class in
``__main__`` registered by class and by ``"__main__:Class"`` string, an env in a module next to
the script, made by id, by a factory calling ``gym.make``, through SB3's ``make_vec_env`` and
through ``gym_fork.vector``; every one must run in a worker, step exactly as ``gymnasium.make``
in the script does, and restore exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.criu

SCRIPT = textwrap.dedent('''
    import functools, json, sys
    import gymnasium as gym
    import numpy as np
    import gym_fork
    from gym_fork.vector import make_vec
    import myenvs  # registers "Module-v0" (entry point "myenvs:Walker") when imported

    class Walker(gym.Env):
        observation_space = gym.spaces.Box(-100.0, 100.0, (2,), np.float64)
        action_space = gym.spaces.Discrete(3)

        def __init__(self, step_size=1.0):
            self.step_size = step_size

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.pos = self.np_random.normal(size=2)
            return self.pos.copy(), {}

        def step(self, action):
            self.pos += (int(action) - 1) * self.step_size + self.np_random.normal(size=2) * 0.1
            return self.pos.copy(), float(-abs(self.pos).sum()), bool(abs(self.pos).max() > 5), False, {}

    gym.register("ByClass-v0", entry_point=Walker, max_episode_steps=20, kwargs={"step_size": 0.5})
    gym.register("ByString-v0", entry_point="__main__:Walker", max_episode_steps=20)

    def trajectory(env, actions, seed):
        obs, _ = env.reset(seed=seed)
        out = [obs.tolist()]
        for a in actions:
            obs, r, term, trunc, _ = env.step(a)
            out.append([obs.tolist(), r, term, trunc])
            if term or trunc:
                out.append(env.reset()[0].tolist())
        return out

    actions = [0, 2, 1, 2, 2, 0, 1] * 5
    results = {}
    for name, source in [("by class", "ByClass-v0"), ("by string", "ByString-v0"),
                         ("module", "Module-v0"),
                         ("factory calling gym.make", lambda: gym.make("ByString-v0")),
                         ("partial", functools.partial(gym.make, "ByClass-v0"))]:
        ref_id = source if isinstance(source, str) else {"factory calling gym.make": "ByString-v0",
                                                         "partial": "ByClass-v0"}[name]
        want = trajectory(gym.make(ref_id), actions, seed=3)
        env = gym_fork.ForkableEnv(source, backend=sys.argv[1])
        got = trajectory(env, actions, seed=3)
        env.reset(seed=4)
        for a in actions[:5]:
            env.step(a)
        snap = env.snapshot()
        first = [env.step(a)[0].tolist() for a in actions[:8]]
        env.restore(snap)
        again = [env.step(a)[0].tolist() for a in actions[:8]]
        results[name] = {"same_as_gymnasium": got == want, "restore_exact": first == again,
                         "in_worker": env.worker_pid is not None,
                         "spec": env.spec.id if env.spec else None, "entry_point": repr(env.spec.entry_point) if env.spec else None}
        env.close()

    if sys.argv[1] == "criu":
        from stable_baselines3.common.env_util import make_vec_env
        from gym_fork.vec_env import ForkableVecEnv
        venv = make_vec_env("ByClass-v0", n_envs=2, vec_env_cls=ForkableVecEnv, seed=0)
        results["make_vec_env"] = {"shape": list(venv.reset().shape)}
        venv.close()
        vec = make_vec("ByString-v0", num_envs=2)
        obs, _ = vec.reset(seed=1)
        results["gym_fork.vector"] = {"shape": list(obs.shape)}
        vec.close()
    print("RESULT " + json.dumps(results))
''')

MODULE = textwrap.dedent('''
    import gymnasium as gym
    import numpy as np

    class Walker(gym.Env):
        observation_space = gym.spaces.Box(-100.0, 100.0, (2,), np.float64)
        action_space = gym.spaces.Discrete(3)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.pos = self.np_random.normal(size=2)
            return self.pos.copy(), {}

        def step(self, action):
            self.pos += int(action) - 1
            return self.pos.copy(), 0.0, bool(abs(self.pos).max() > 5), False, {}

    gym.register("Module-v0", entry_point="myenvs:Walker", max_episode_steps=20)
''')


@pytest.mark.parametrize("backend", ["criu", "pickle"])
def test_envs_defined_in_the_users_script(tmp_path, backend):
    scripts = tmp_path / "project"
    scripts.mkdir()
    (scripts / "train.py").write_text(SCRIPT)
    (scripts / "myenvs.py").write_text(MODULE)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(scripts / "train.py"), backend], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    results = json.loads(line[len("RESULT "):])
    for name in ("by class", "by string", "module", "factory calling gym.make", "partial"):
        r = results[name]
        assert r["same_as_gymnasium"] and r["restore_exact"], (name, r)
        assert r["in_worker"] == (backend == "criu")
    assert results["by class"]["spec"] == "ByClass-v0" and "Walker" in results["by class"]["entry_point"]
    assert results["by string"]["entry_point"] == "'__main__:Walker'"  # the spec travels unchanged
    if backend == "criu":
        assert results["make_vec_env"]["shape"] == [2, 2]
        assert results["gym_fork.vector"]["shape"] == [2, 2]


ALE_SCRIPT = textwrap.dedent('''
    import json
    import ale_py
    import gymnasium as gym
    import numpy as np
    import gym_fork
    from gym_fork.vector import ForkableVectorEnv

    gym.register_envs(ale_py)  # as every Atari script does

    def make_env():  # a CleanRL-style thunk
        return gym.make("ALE/Pong-v5", obs_type="ram")

    ref = make_env()
    want = [ref.reset(seed=1)[0]] + [ref.step(a)[0] for a in (2, 3, 2, 2)]
    env = gym_fork.ForkableEnv(make_env)
    got = [env.reset(seed=1)[0]] + [env.step(a)[0] for a in (2, 3, 2, 2)]
    in_worker = env.worker_pid is not None
    env.close()
    vec = ForkableVectorEnv([make_env] * 2)
    vec_obs = vec.reset(seed=1)[0]
    vec.close()
    print("RESULT " + json.dumps({"same": all(np.array_equal(a, b) for a, b in zip(want, got)),
                                  "in_worker": in_worker, "vec_shape": list(vec_obs.shape)}))
''')


def test_a_factory_making_an_ale_env_by_id_works_in_the_worker(tmp_path):
    """Before: a factory calling ``gym.make("ALE/...")`` (the usual Atari script) failed in the
    worker with ``NamespaceNotFound: Namespace ALE not found. Have you installed the proper
    package for ALE?`` -- ALE was installed; only the learner had registered its envs."""
    pytest.importorskip("ale_py")
    (tmp_path / "atari.py").write_text(ALE_SCRIPT)
    proc = subprocess.run([sys.executable, str(tmp_path / "atari.py")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    assert json.loads(line[len("RESULT "):]) == {"same": True, "in_worker": True, "vec_shape": [2, 128]}
