"""An agent-style env whose state is partly *files*: it builds a tiny web app in a workspace
directory (writes route files, fills an SQLite database, runs its tests as the reward).

``ForkableEnv(..., workspace=DIR)`` snapshots the directory with the process: branches forked
from a mid-episode snapshot each get their own copy of the files and database and diverge;
``restore()`` brings back exactly the files and rows of the snapshot moment.

    .venv/bin/python examples/agent_workspace.py
"""

from __future__ import annotations

import atexit
import os
import shutil
import sqlite3
import sys
import tempfile

import gymnasium as gym
import numpy as np

ROUTES = ["home", "login", "logout", "profile", "search", "cart", "checkout", "admin"]


class WebAppAgentEnv(gym.Env):
    """Actions: 0..7 write the route file for ROUTES[a]; 8 add a user row; 9 run the tests.

    Follows gym_fork's workspace contract: files are opened only during a step, and the
    workspace is found through ``self.workspace`` (gym_fork sets it; forks get their own)."""

    metadata = {"render_modes": []}

    def __init__(self, workspace: str | None = None):
        self.workspace = workspace  # set by gym_fork: ForkableEnv(..., workspace=DIR)
        self.action_space = gym.spaces.Discrete(10)
        self.observation_space = gym.spaces.Box(0, 1000, shape=(3,), dtype=np.float32)

    # --- helpers (each opens files only for the duration of the call) -------------------------
    def _db(self) -> sqlite3.Connection:
        con = sqlite3.connect(os.path.join(self.workspace, "app.db"))
        con.execute("CREATE TABLE IF NOT EXISTS users (id INTEGER PRIMARY KEY, name TEXT)")
        return con

    def _obs(self) -> np.ndarray:
        routes = len([n for n in os.listdir(os.path.join(self.workspace, "routes"))])
        with self._db() as con:
            users = con.execute("SELECT COUNT(*) FROM users").fetchone()[0]
        con.close()
        return np.array([routes, users, self._passed], dtype=np.float32)

    def _run_tests(self) -> int:
        """The app's "test suite": every route file must be valid Python defining handler(), and
        the admin route needs at least one user."""
        passed = 0
        for name in sorted(os.listdir(os.path.join(self.workspace, "routes"))):
            ns: dict = {}
            with open(os.path.join(self.workspace, "routes", name)) as f:
                exec(compile(f.read(), name, "exec"), ns)
            passed += int(callable(ns.get("handler")))
        with self._db() as con:
            if con.execute("SELECT COUNT(*) FROM users").fetchone()[0] > 0:
                passed += 1
        con.close()
        return passed

    # --- gymnasium API -----------------------------------------------------------------------
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if self.workspace is None:
            raise ValueError("WebAppAgentEnv needs a workspace directory: ForkableEnv(WebAppAgentEnv, workspace=DIR)")
        os.makedirs(os.path.join(self.workspace, "routes"), exist_ok=True)
        for name in os.listdir(os.path.join(self.workspace, "routes")):
            os.unlink(os.path.join(self.workspace, "routes", name))
        with self._db() as con:
            con.execute("DELETE FROM users")
        con.close()
        self._passed = 0
        return self._obs(), {}

    def step(self, action):
        a = int(action)
        if a < len(ROUTES):
            with open(os.path.join(self.workspace, "routes", f"{ROUTES[a]}.py"), "w") as f:
                f.write(f"def handler(request):\n    return {ROUTES[a]!r} + str({self.np_random.integers(100)})\n")
        elif a == 8:
            with self._db() as con:
                con.execute("INSERT INTO users (name) VALUES (?)", (f"user{self.np_random.integers(10**6)}",))
            con.close()
        reward = 0.0
        if a == 9:
            passed = self._run_tests()
            reward, self._passed = float(passed - self._passed), passed
        return self._obs(), reward, self._passed >= len(ROUTES) + 1, False, {}


def snapshot_of_files(ws: str) -> dict:
    """What the workspace holds: route file contents and the users rows (for comparisons)."""
    files = {}
    for name in sorted(os.listdir(os.path.join(ws, "routes"))):
        with open(os.path.join(ws, "routes", name)) as f:
            files[name] = f.read()
    con = sqlite3.connect(os.path.join(ws, "app.db"))
    rows = con.execute("SELECT id, name FROM users ORDER BY id").fetchall()
    con.close()
    return {"files": files, "rows": rows}


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gym_fork
    from agent_workspace import WebAppAgentEnv as Env  # importable by the worker too

    ws = tempfile.mkdtemp(prefix="agent-ws-")
    # gym_fork never deletes a workspace the user passed in (only the branches' copies): this
    # script removes its own when it exits.
    atexit.register(shutil.rmtree, ws, True)
    env = gym_fork.ForkableEnv(Env, workspace=ws)
    env.reset(seed=0)
    for a in [0, 1, 8, 9]:  # two routes, one user, run the tests
        env.step(a)
    snap = env.snapshot()
    at_snap = snapshot_of_files(ws)
    print(f"snapshot at step {snap.steps}: {sorted(at_snap['files'])}, {len(at_snap['rows'])} user(s)")

    branches = env.fork(snap, 2, rng="reseed", seeds=[1, 2])
    plans = [[2, 3, 8, 8, 9], [7, 8, 9]]
    for b, plan in zip(branches, plans):
        for a in plan:
            obs, r, *_ = b.step(a)
        st = snapshot_of_files(b.unwrapped.workspace)
        print(f"branch {b.unwrapped.workspace}: routes {sorted(st['files'])}, {len(st['rows'])} users, tests passed {obs[2]:.0f}")

    for a in [4, 5, 6, 8, 9]:  # the original keeps going, then goes back
        env.step(a)
    env.restore(snap)
    back = snapshot_of_files(ws)
    print("restore brings back exactly the files and rows of the snapshot:", back == at_snap)
    assert back == at_snap
    for b in branches:
        b.close()
    env.close()
    assert os.path.isdir(ws)  # the user's workspace outlives the env


if __name__ == "__main__":
    main()
