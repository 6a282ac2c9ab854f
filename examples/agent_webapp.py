"""The flagship example: an agent's whole working environment, branched at a fork in the road.

The env is an agent building a small web app.  Its state is everywhere an agent's state is:

* **files** -- route files it writes into its app directory;
* **a server process** -- a real HTTP server (a child process) that serves the routes it wrote;
* **a database server** -- Redis (a ``redis-server`` child), where the app keeps its users;
* **tool runs** -- each "run the tests" action starts the app's test suite as a child process,
  which talks to the running server.

A scripted policy writes two routes, adds users and runs the tests; then it reaches a fork in
the road: which feature next?  gym_fork snapshots the whole thing (the process tree: env,
Redis, HTTP server, their connections; and the app directory) and 8 branches continue from
that one snapshot, each with its own files, its own server and its own Redis data, side by side
on the same ports (``private_network=True``: every copy has a network namespace of its own) and
at the same paths (``private_dirs=[APP]``: every copy has its own copy of the app directory,
so its server keeps serving from the path it was started with).  ``--files workspace`` runs the
same with ``workspace=APP`` instead: branches then work in ``APP.branch-<id>`` and the env tells
its server the new directory at a branch's first step.
Then the original is restored: files, server and Redis come back exactly.  Costs are printed
next to the natural alternative, replaying the prefix from ``reset()`` (which restarts the
servers), and the branch tree is drawn as a PNG.

    sudo .venv/bin/python examples/agent_webapp.py [--branches 8] [--files private|workspace] [--out agent_webapp.png]

Needs root, CRIU and Debian's ``redis-server`` (``scripts/setup.sh`` installs them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import gymnasium as gym
import numpy as np

ROUTES = ["home", "login", "search", "cart", "checkout", "profile", "admin", "blog", "api", "settings"]
ADD_USER, RUN_TESTS = len(ROUTES), len(ROUTES) + 1
# how likely the agent gets a route wrong (harder features, more bugs)
DIFFICULTY = {name: 0.05 + 0.1 * i for i, name in enumerate(ROUTES)}
HTTP_PORT, REDIS_PORT = 8000, 6390

# The app server: serves GET /<route> by running routes/<route>.py from the workspace, keeps users
# in Redis (POST /users?name=...).  POST /__workspace?path=... points it at another directory (a
# branch's copy of the workspace).
SERVER = r"""
import http.server, json, os, sys, urllib.parse
import redis
port, workspace, redis_port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
db = redis.Redis(host="127.0.0.1", port=redis_port)
state = {"workspace": workspace, "requests": 0}

class App(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, code, body):
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        state["requests"] += 1
        name = self.path.strip("/")
        if name == "__stats":
            return self.reply(200, json.dumps(state))
        path = os.path.join(state["workspace"], "routes", name + ".py")
        if not os.path.exists(path):
            return self.reply(404, "no route " + name)
        ns = {}
        try:
            with open(path) as f:
                exec(compile(f.read(), path, "exec"), ns)
            return self.reply(200, ns["handler"](db))
        except Exception as e:
            return self.reply(500, type(e).__name__)

    def do_POST(self):
        state["requests"] += 1
        url = urllib.parse.urlparse(self.path)
        q = urllib.parse.parse_qs(url.query)
        if url.path == "/users":
            return self.reply(200, str(db.rpush("users", q["name"][0])))
        if url.path == "/__workspace":
            state["workspace"] = q["path"][0]
            return self.reply(200, "ok")
        return self.reply(404, "")

http.server.HTTPServer(("127.0.0.1", port), App).serve_forever()
"""

# The app's test suite, run as a child process against the running server.
TESTS = r"""
import json, os, sys, urllib.request
port, workspace = int(sys.argv[1]), sys.argv[2]
passed = failed = 0
for name in sorted(os.listdir(os.path.join(workspace, "routes"))):
    route = name[:-3]
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/{route}", timeout=10).read().decode()
        ok = body.startswith(route + ":")
    except Exception:
        ok = False
    passed, failed = passed + ok, failed + (not ok)
print(json.dumps({"passed": passed, "failed": failed}))
"""


def _http(method: str, path: str, timeout: float = 10.0) -> str:
    req = urllib.request.Request(f"http://127.0.0.1:{HTTP_PORT}{path}", method=method)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


def _wait(check, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not come up")
        time.sleep(0.01)


class AgentWebAppEnv(gym.Env):
    """Actions: 0..9 write the route file ROUTES[a]; 10 add a user (through the server, into
    Redis); 11 run the app's tests (a child process).  Observation: routes written, users, tests
    passed, tests failed.  Reward: the change in passed tests.

    ``workspace``: the app directory, given here (``private_dirs``: every copy sees its own at this
    path) or set by gym_fork (``workspace=``: files opened only during a step, the directory found
    through ``self.workspace``; a branch's server is told its new directory at its first step)."""

    metadata = {"render_modes": []}

    def __init__(self, workspace: str | None = None):
        self.workspace = workspace
        self.action_space = gym.spaces.Discrete(len(ROUTES) + 2)
        self.observation_space = gym.spaces.Box(0, 1000, shape=(4,), dtype=np.float32)
        self._procs: list[subprocess.Popen] = []
        self._server_ws: str | None = None
        self._tests = (0, 0)
        self._db = None

    # --- the servers ---------------------------------------------------------------------------
    def _start_servers(self) -> None:
        import redis

        self._stop_servers()
        quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._procs.append(subprocess.Popen(
            ["redis-server", "--port", str(REDIS_PORT), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", tempfile.gettempdir(), "--logfile", ""], **quiet))
        self._db = redis.Redis(host="127.0.0.1", port=REDIS_PORT)
        _wait(self._db.ping, "redis-server")
        self._procs.append(subprocess.Popen(
            [sys.executable, "-c", SERVER, str(HTTP_PORT), self.workspace, str(REDIS_PORT)], **quiet))
        _wait(lambda: _http("GET", "/__stats"), "the app server")
        self._server_ws = self.workspace

    def _stop_servers(self) -> None:
        for p in self._procs:
            p.kill()
            p.wait()
        self._procs = []
        if self._db is not None:
            self._db.close()
            self._db = None

    def _sync_workspace(self) -> None:
        if self.workspace != self._server_ws:  # a fork branch works in its own directory
            _http("POST", f"/__workspace?path={self.workspace}")
            self._server_ws = self.workspace

    def _obs(self) -> np.ndarray:
        routes = len(os.listdir(os.path.join(self.workspace, "routes")))
        return np.array([routes, self._db.llen("users"), *self._tests], dtype=np.float32)

    # --- gymnasium API ---------------------------------------------------------------------------
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if self.workspace is None:
            raise ValueError("AgentWebAppEnv needs a workspace: ForkableEnv(AgentWebAppEnv, workspace=DIR)")
        shutil.rmtree(os.path.join(self.workspace, "routes"), ignore_errors=True)
        os.makedirs(os.path.join(self.workspace, "routes"))
        self._start_servers()  # a fresh Redis and app server
        self._tests = (0, 0)
        return self._obs(), {}

    def step(self, action):
        self._sync_workspace()
        a = int(action)
        reward = 0.0
        if a < len(ROUTES):
            name = ROUTES[a]
            buggy = self.np_random.random() < DIFFICULTY[name]  # sometimes the agent writes a bug
            prefix = name.upper() if buggy else name
            with open(os.path.join(self.workspace, "routes", f"{name}.py"), "w") as f:
                f.write(f"def handler(db):\n    return {prefix!r} + ':' + str(db.llen('users'))\n")
        elif a == ADD_USER:
            _http("POST", f"/users?name=user{int(self.np_random.integers(10**6))}")
        else:
            out = subprocess.run([sys.executable, "-c", TESTS, str(HTTP_PORT), self.workspace],
                                 capture_output=True, text=True, timeout=60, check=True)
            res = json.loads(out.stdout)
            reward = float(res["passed"] - self._tests[0])
            self._tests = (res["passed"], res["failed"])
        return self._obs(), reward, False, False, {}

    def close(self) -> None:
        self._stop_servers()

    @property
    def world(self) -> dict:
        """Everything the env's state is made of, read here in the env's process: file digests,
        the Redis data, and what the server answers (for comparisons in the controller)."""
        files = {}
        for name in sorted(os.listdir(os.path.join(self.workspace, "routes"))):
            with open(os.path.join(self.workspace, "routes", name), "rb") as f:
                files[name] = hashlib.sha256(f.read()).hexdigest()[:12]
        served = {n[:-3]: _get_or_status(n[:-3]) for n in files}
        return {"files": files, "users": [u.decode() for u in self._db.lrange("users", 0, -1)],
                "served": served, "tests": list(self._tests)}


def _get_or_status(route: str) -> str:
    try:
        return _http("GET", f"/{route}")
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"


def _isolated(at_snap: dict, outcomes: list[dict]) -> bool:
    """Each branch holds the snapshot's files plus its own route, the snapshot's users plus its
    own, and its server answers from its own files and its own Redis (the user count it prints)."""
    for o in outcomes:
        w = o["world"]
        files = set(at_snap["files"]) | {o["feature"] + ".py"}
        if set(w["files"]) != files or w["users"][:-1] != at_snap["users"] or len(w["users"]) != len(at_snap["users"]) + 1:
            return False
        if set(w["served"]) != {f[:-3] for f in files}:
            return False
        if not all(body.endswith(f":{len(w['users'])}") for body in w["served"].values()):
            return False
    return True


PREFIX = [0, ADD_USER, RUN_TESTS, 1, ADD_USER, RUN_TESTS]  # home, a user, tests; login, a user, tests
FEATURES = ROUTES[2:]  # the fork in the road: which feature next?


def _name(a: int) -> str:
    return ROUTES[a] if a < len(ROUTES) else ("add user", "run tests")[a - ADD_USER]


def _draw(path: str, prefix: list[int], outcomes: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefix_len = len(prefix)
    fig, ax = plt.subplots(figsize=(10, 4.8))
    ax.plot(range(prefix_len + 1), [0] * (prefix_len + 1), "-o", color="0.3")
    ax.annotate("reset()", (0, 0), textcoords="offset points", xytext=(0, 8), ha="center")
    for k, a in enumerate(prefix):
        ax.annotate(_name(a), (k + 0.5, 0), textcoords="offset points", xytext=(0, -14), ha="center", fontsize=7)
    ax.annotate("snapshot", (prefix_len, 0), textcoords="offset points", xytext=(-30, 8), ha="center",
                fontsize=8)
    n = len(outcomes)
    for i, o in enumerate(outcomes):
        y = (i - (n - 1) / 2) * 1.0
        xs = [prefix_len + k for k in range(len(o["actions"]) + 1)]
        ok = o["failed"] == 0
        ax.plot(xs, [0] + [y] * len(o["actions"]), "-o", color="tab:green" if ok else "tab:red")
        ax.annotate(f"{o['feature']}: {o['passed']} passed, {o['failed']} failed, {o['users']} users",
                    (xs[-1], y), textcoords="offset points", xytext=(6, -3), fontsize=8)
    ax.set_xlim(-0.5, prefix_len + 8)
    ax.set_xlabel("step")
    ax.set_yticks([])
    ax.set_title(f"{n} branches from one snapshot: each with its own files, app server and Redis")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--branches", type=int, default=8)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--files", choices=["private", "workspace"], default="private",
                   help="how the app directory is captured: private_dirs (each copy its own at the same path, "
                        "default) or workspace= (branches in APP.branch-<id>)")
    p.add_argument("--out", default="agent_webapp.png", help="the branch tree (PNG)")
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the worker imports this module
    import functools

    import gym_fork
    from agent_webapp import AgentWebAppEnv as Env

    ws = tempfile.mkdtemp(prefix="agent-webapp-")
    if args.files == "private":
        env = gym_fork.ForkableEnv(functools.partial(Env, ws), private_dirs=[ws], private_network=True)
    else:
        env = gym_fork.ForkableEnv(Env, workspace=ws, private_network=True)

    def where(e) -> str:  # the env's app directory, as a path on this machine
        return e.private_dir_view(ws) if args.files == "private" else e.unwrapped.workspace
    out: dict = {}
    branches: list = []
    try:
        t = time.perf_counter()
        env.reset(seed=args.seed)
        for a in PREFIX:
            env.step(a)
        replay_first = time.perf_counter() - t
        print(f"prefix: {[_name(a) for a in PREFIX]}")

        t = time.perf_counter()
        snap = env.snapshot()
        t_snap = time.perf_counter() - t
        at_snap = env.unwrapped.world
        print(f"fork in the road at step {snap.steps}: routes {sorted(at_snap['files'])}, "
              f"{len(at_snap['users'])} users in Redis, tests {at_snap['tests']}")

        n = args.branches
        t = time.perf_counter()
        branches = env.fork(snap, n)
        t_fork = time.perf_counter() - t
        outcomes = []
        for i, b in enumerate(branches):
            feature = FEATURES[i % len(FEATURES)]
            plan = [ROUTES.index(feature), ADD_USER, RUN_TESTS]
            for a in plan:
                obs, *_ = b.step(a)
            w = b.unwrapped.world
            outcomes.append({"feature": feature, "actions": plan, "passed": int(obs[2]), "failed": int(obs[3]),
                             "users": len(w["users"]), "files": sorted(w["files"]), "served": w["served"],
                             "workspace": where(b), "world": w})
            print(f"branch {i}: +{feature:<9} files {len(w['files'])}, users {len(w['users'])}, tests "
                  f"{int(obs[2])} passed / {int(obs[3])} failed  (its files: {where(b)})")
        isolated = _isolated(at_snap, outcomes)
        print(f"each branch saw only its own files, server and Redis data: {isolated}")

        for a in [9, ADD_USER, ADD_USER, RUN_TESTS]:  # meanwhile the original goes another way
            env.step(a)
        t = time.perf_counter()
        env.restore(snap)
        t_restore = time.perf_counter() - t
        back = env.unwrapped.world
        exact = back == at_snap
        print(f"restore brings back files, app server and Redis exactly: {exact}")
        # ...and continues exactly as branch 0 did from the same snapshot
        for a in outcomes[0]["actions"]:
            env.step(a)
        same_as_branch = env.unwrapped.world == outcomes[0]["world"]
        print(f"after the restore, the same actions as branch 0 give branch 0's world: {same_as_branch}")

        t = time.perf_counter()  # the alternative: replay the prefix from reset() (restarts the servers)
        env.reset(seed=args.seed)
        for a in PREFIX:
            env.step(a)
        t_replay = time.perf_counter() - t

        rows = [("snapshot()", t_snap), ("restore()", t_restore), (f"fork({n}), per branch", t_fork / n),
                (f"fork({n}), all", t_fork), ("replay prefix from reset()", t_replay)]
        print(f"\n{'operation':<30} {'seconds':>8}   vs replay")
        for name, v in rows:
            print(f"{name:<30} {v:8.3f}   {v / t_replay:6.2f}x")
        _draw(args.out, PREFIX, outcomes)
        print(f"branch tree: {args.out}")
        out = {"snapshot_s": t_snap, "restore_s": t_restore, "fork_s": t_fork, "replay_s": t_replay,
               "replay_first_s": replay_first, "branches": outcomes, "at_snapshot": at_snap,
               "restored_exact": exact, "isolated": isolated, "continues_like_branch": same_as_branch,
               "png": args.out}
    finally:
        for b in branches:
            b.close()
        env.close()
        shutil.rmtree(ws, ignore_errors=True)
    return out


if __name__ == "__main__":
    main()
