"""gym_fork.ray on a real Ray cluster (head + 2 worker nodes on this machine; two tests add a third
worker node and remove it), real CRIU, real envs, real SB3 jobs under `gym-fork run`.

One module-scoped cluster (~6-15 s, ~1 GB) serves every test; teardown checks that nothing the
hosts restored is left running and that their image directories are gone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest

ray = pytest.importorskip("ray")

import gym_fork  # noqa: E402
from gym_fork.ray import BranchesFailedError, RayBranchPool  # noqa: E402
from gym_fork.ray.host import hosts_base  # noqa: E402

pytestmark = pytest.mark.criu


def crc_policy(obs):
    """A deterministic function of the observation's exact bytes: any bit difference in a branch's
    state changes its actions from then on."""
    return zlib.crc32(np.asarray(obs).tobytes()) % 4


class SlowPolicy:
    def __init__(self, delay: float):
        self.delay = delay

    def __call__(self, obs):
        time.sleep(self.delay)
        return crc_policy(obs)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def _wait_dead(pids, timeout=10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


@pytest.fixture(scope="module")
def cluster(criu_ok):
    from ray.cluster_utils import Cluster

    args = dict(num_cpus=1, object_store_memory=100 << 20, include_dashboard=False)
    c = Cluster(initialize_head=True, head_node_args=dict(args))
    c.add_node(**args)
    c.add_node(**args)
    c.wait_for_nodes()
    c.connect()
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def pool(cluster):
    p = RayBranchPool()
    assert len(p.nodes) == 3
    yield p
    infos = p.info()
    pids = [i["pid"] for i in infos.values()] + [d for i in infos.values() for d in i["descendants"]]
    sessions = [i["session"] for i in infos.values()]
    p.close()
    assert _wait_dead(pids) == [], "host actors or their restored processes outlived pool.close()"
    assert not any(os.path.exists(s) for s in sessions), "host image directories left behind"


@pytest.fixture(scope="module")
def lander():
    env = gym_fork.make("LunarLander-v3")
    env.reset(seed=3)
    for _ in range(30):
        env.step(crc_policy(env.step(0)[0]))
    snap = env.snapshot()
    yield env, snap
    env.close()


def assert_same_branch(a, b):
    assert a.index == b.index and a.seed == b.seed
    assert [int(x) for x in a.actions] == [int(x) for x in b.actions]
    assert np.array(a.rewards, np.float64).tobytes() == np.array(b.rewards, np.float64).tobytes()
    assert np.asarray(a.final_obs).tobytes() == np.asarray(b.final_obs).tobytes()
    assert (a.terminated, a.truncated) == (b.terminated, b.truncated)


def test_branches_bit_identical_on_every_node(pool, lander):
    env, snap = lander
    seeds = [11, 12, 13, 14, 15, 16]
    local = gym_fork.explore(env, snap, crc_policy, n_branches=6, horizon=80, rng="reseed", seeds=seeds)
    remote = pool.explore(snap, crc_policy, n_branches=6, horizon=80, rng="reseed", seeds=seeds,
                          branches_per_call=1)
    assert set(remote.node_of.values()) == set(pool.nodes), "every node ran branches"
    assert len(remote.branches) == 6 and not remote.failed
    for a, b in zip(remote.branches, local.branches):
        assert_same_branch(a, b)
    assert len({tuple(b.actions) for b in remote.branches}) > 1, "reseeded branches differ"

    # rng="same": every branch replays the snapshot's own randomness, on every node
    local_same = gym_fork.explore(env, snap, crc_policy, n_branches=1, horizon=80, rng="same")
    same = pool.explore(snap, crc_policy, n_branches=6, horizon=80, rng="same", branches_per_call=2)
    assert set(same.node_of.values()) == set(pool.nodes)
    ref = local_same.branches[0]
    for b in same.branches:
        ref.index = b.index
        assert_same_branch(b, ref)

    # the bundle was restored once per node: later calls reuse it
    again = pool.prepare(snap)
    assert set(again) == set(pool.nodes)
    for i in pool.info().values():
        assert i["roots"] == [snap.id]


class Offset:
    """A per-branch closed-loop policy (for ``policy_in_worker=True``)."""

    def __init__(self, k: int):
        self.k = k

    def __call__(self, obs) -> int:
        return (crc_policy(obs) + self.k) % 4


class Coin:
    """A stochastic policy with a generator of its own, one object for all branches."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def __call__(self, obs) -> int:
        return int(self.rng.integers(4))


def test_policy_in_the_workers_gives_the_local_branches_on_every_node(pool, lander):
    env, snap = lander
    seeds = [21, 22, 23, 24]
    policies = [Offset(k) for k in range(4)]
    local = gym_fork.explore(env, snap, policies, n_branches=4, horizon=60, rng="reseed", seeds=seeds,
                             policy_in_worker=True)
    remote = pool.explore(snap, policies, n_branches=4, horizon=60, rng="reseed", seeds=seeds,
                          branches_per_call=1, policy_in_worker=True)
    assert set(remote.node_of.values()) == set(pool.nodes) and not remote.failed
    for a, b in zip(remote.branches, local.branches):
        assert_same_branch(a, b)
    # and the same as the learner-side loop with branch i's policy
    here = gym_fork.explore(env, snap, Offset(2), n_branches=1, horizon=60, rng="reseed", seeds=[23])
    here.branches[0].index = 2
    assert_same_branch(remote.branches[2], here.branches[0])
    # one stochastic policy for all branches, reseeded per branch from its seed: the same on a
    # node that runs that branch alone
    local = gym_fork.explore(env, snap, Coin(5), n_branches=4, horizon=60, rng="reseed", seeds=seeds,
                             policy_in_worker=True)
    remote = pool.explore(snap, Coin(5), n_branches=4, horizon=60, rng="reseed", seeds=seeds,
                          branches_per_call=1, policy_in_worker=True)
    assert len({tuple(b.actions) for b in local.branches}) == 4 and not remote.failed
    for a, b in zip(remote.branches, local.branches):
        assert_same_branch(a, b)
    with pytest.raises(ValueError, match="cannot be combined with policy_in_worker"):
        pool.explore(snap, policies, n_branches=4, horizon=5, record_obs=True, policy_in_worker=True)
    with pytest.raises(TypeError, match="needs policy_in_worker=True"):
        pool.explore(snap, policies, n_branches=4, horizon=5)


def test_sb3_policy_weights_shipped(pool):
    sb3 = pytest.importorskip("stable_baselines3")
    env = gym_fork.make("CartPole-v1")
    env.reset(seed=0)
    for _ in range(5):
        env.step(0)
    snap = env.snapshot()
    model = sb3.PPO("MlpPolicy", "CartPole-v1", seed=0, device="cpu")
    try:
        local = gym_fork.explore(env, snap, model, n_branches=2, horizon=40, rng="reseed", seeds=[1, 2],
                                 deterministic=True)
        remote = pool.explore(snap, model, n_branches=2, horizon=40, rng="reseed", seeds=[1, 2],
                              deterministic=True, branches_per_call=1)
        for a, b in zip(remote.branches, local.branches):
            assert_same_branch(a, b)
    finally:
        pool.forget(snap)
        env.close()


def test_env_error_fails_only_its_branches(pool, lander):
    _env, snap = lander

    def bad(obs):
        return 99  # LunarLander: AssertionError in the env

    with pytest.raises(BranchesFailedError) as ei:
        pool.explore(snap, bad, n_branches=3, horizon=5, rng="same")
    assert "AssertionError" in str(ei.value) and len(ei.value.result.failed) == 3


def _explore_in_thread(p, snap, seeds):
    """``p.explore`` with a slow policy in a thread (one branch per seed); returns (thread, out)
    with ``out["res"]`` or ``out["err"]`` once it is done."""
    out: dict = {}

    def run():
        try:
            out["res"] = p.explore(snap, SlowPolicy(0.01), n_branches=len(seeds), horizon=150, rng="reseed",
                                   seeds=seeds, stop_at_done=False)
        except BaseException as e:  # noqa: BLE001
            out["err"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


def _wait_running(host) -> dict:
    """The host's info once one of its branches is mid-way (its clones are stepping)."""
    deadline = time.monotonic() + 30
    while ray.get(host.info.remote())["busy"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    running = ray.get(host.info.remote())
    assert running["busy"] > 0
    return running


def _assert_images_gone(info) -> None:
    assert not os.path.exists(info["session"])
    assert not [n for n in os.listdir(hosts_base()) if n.startswith(f"s{info['pid']}-")]


def test_killed_actor_fails_its_branches_rest_complete(cluster, lander):
    env, snap = lander
    seeds = list(range(100, 106))
    local = gym_fork.explore(env, snap, crc_policy, n_branches=6, horizon=150, rng="reseed", seeds=seeds,
                             stop_at_done=False)
    p = RayBranchPool()
    try:
        p.prepare(snap)
        victim_node = p.nodes[1]
        victim = p.host(victim_node)
        before = p.info()
        vinfo = before[victim_node]
        t, out = _explore_in_thread(p, snap, seeds)
        running = _wait_running(victim)
        procs = running["descendants"] + ray.get(victim.info.remote())["descendants"]
        ray.kill(victim, no_restart=True)
        t.join(60)
        assert not t.is_alive()
        err = out.get("err")
        assert isinstance(err, BranchesFailedError), out
        res = err.result
        assert {f.node_id for f in res.failed} == {victim_node}
        assert "died" in str(err) and victim_node in str(err)
        assert len(res.branches) + len(res.failed) == 6 and len(res.branches) == 4
        for b in res.branches:
            assert res.node_of[b.index] != victim_node
            assert_same_branch(b, local.branches[b.index])
        # nothing of the killed host survives: not its restored env, frozen snapshot or clones
        assert _wait_dead([vinfo["pid"]] + procs) == []
        # the pool goes on without it
        again = p.explore(snap, crc_policy, n_branches=2, horizon=10, rng="same")
        assert victim_node not in again.node_of.values() and len(again.branches) == 2
    finally:
        p.close()
    _assert_images_gone(vinfo)  # close() reaps the killed host's images on its node


def test_node_removed_mid_explore_fails_its_branches_rest_complete(cluster, lander):
    """A whole node (not only its actor) dies while its branches run: they fail naming the node,
    the other nodes' branches complete bit-identical to local ones, nothing of that node's host is
    left (processes, images). A node is added for this test and removed."""
    env, snap = lander
    seeds = list(range(200, 208))
    local = gym_fork.explore(env, snap, crc_policy, n_branches=8, horizon=150, rng="reseed", seeds=seeds,
                             stop_at_done=False)
    node = cluster.add_node(num_cpus=1, object_store_memory=100 << 20)
    cluster.wait_for_nodes()
    victim_node = node.node_id
    p = RayBranchPool()
    try:
        assert victim_node in p.nodes and len(p.nodes) == 4
        p.prepare(snap)
        victim = p.host(victim_node)
        vinfo = p.info()[victim_node]
        t, out = _explore_in_thread(p, snap, seeds)  # 8 seeds: 2 branches per node
        running = _wait_running(victim)
        procs = running["descendants"]
        assert len(procs) >= 3  # restored env, frozen snapshot, the call's clones
        t_kill = time.monotonic()
        cluster.remove_node(node)
        t.join(90)
        assert not t.is_alive()
        took = time.monotonic() - t_kill
        err = out.get("err")
        assert isinstance(err, BranchesFailedError), out
        res = err.result
        assert {f.node_id for f in res.failed} == {victim_node}
        assert sorted(f.index for f in res.failed) == sorted(i for i in range(8) if i not in res.node_of)
        assert victim_node in str(err) and all(victim_node in f.error for f in res.failed)
        assert len(res.failed) == 2 and len(res.branches) == 6
        for b in res.branches:
            assert res.node_of[b.index] != victim_node
            assert_same_branch(b, local.branches[b.index])
        # nothing of the dead node's host survives: not the host, its restored env, snapshot or clones
        assert _wait_dead([vinfo["pid"]] + procs) == []
        assert victim_node not in p.nodes
        print(f"node removal -> explore returned in {took:.2f} s")
    finally:
        p.close()
    _assert_images_gone(vinfo)  # here by close()'s reap on the surviving nodes, which share this disk


def test_branch_exploration_callback_with_pool(pool):
    pytest.importorskip("stable_baselines3")
    from stable_baselines3 import DQN

    from gym_fork.sb3 import BranchExplorationCallback
    from gym_fork.vec_env import ForkableVecEnv

    with pytest.raises(ValueError, match="return_to_best"):
        BranchExplorationCallback(every=10, mode="return_to_best", pool=pool)
    venv = ForkableVecEnv("CartPole-v1", n_envs=1, seed=0)
    try:
        model = DQN("MlpPolicy", venv, learning_starts=50, device="cpu", seed=0)
        cb = BranchExplorationCallback(every=60, n_branches=3, horizon=8, mode="buffer", seed=0, pool=pool)
        model.learn(100, callback=cb)
        assert len(cb.history) >= 1
        res = cb.last_result
        assert len(set(res.node_of.values())) >= 2  # the branches ran on the cluster
        assert cb.history[-1]["steps_simulated"] == res.steps > 0
        assert cb.history[-1]["added_transitions"] + cb.history[-1]["pending"] >= res.steps
        first = cb.last_branch_transitions[0]
        assert first.obs.shape == (4,) and first.next_obs.shape == (4,)
        cb.release() if hasattr(cb, "release") else None
    finally:
        venv.close()


# --- migration targets named by Ray node (gym_fork.ray.env_migration) -------------------------------
def _run_crc(env, obs, n, traj):
    for _ in range(n):
        obs, r, term, trunc, _info = env.step(crc_policy(obs))
        traj.append((np.asarray(obs).tobytes(), float(r), bool(term), bool(trunc)))
        if term or trunc:
            obs, _info = env.reset(seed=len(traj))
    return obs


def test_live_migration_to_a_ray_node_then_on(cluster):
    """live=True to a Ray node: the driver keeps stepping while the snapshot is exported, restored
    on the node and replayed; the switch happens inside a step; the worker can then move on."""
    from gym_fork.ray import RayNode
    from gym_fork.ray.hosts import close_hosts

    head = ray.get_runtime_context().get_node_id()
    others = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] != head)[:2]
    moved, ref = gym_fork.make("LunarLander-v3"), gym_fork.make("LunarLander-v3")
    try:
        om, _ = moved.reset(seed=11)
        orf, _ = ref.reset(seed=11)
        tm, tr = [], []
        om, orf = _run_crc(moved, om, 20, tm), _run_crc(ref, orf, 20, tr)
        mig = moved.migrate(RayNode(others[0]), live=True)
        n = 0
        while not mig.done():
            om, orf = _run_crc(moved, om, 1, tm), _run_crc(ref, orf, 1, tr)
            n += 1
            assert n < 100_000
        rep = mig.result()
        assert rep["live"] and rep["node"] == others[0] and rep["replayed_ops"] >= n > 0
        assert moved._handle.node_id == others[0]
        om, orf = _run_crc(moved, om, 30, tm), _run_crc(ref, orf, 30, tr)
        moved.migrate(RayNode(others[1]))  # and on, stop-and-copy from the host
        om, orf = _run_crc(moved, om, 30, tm), _run_crc(ref, orf, 30, tr)
        assert tm == tr, "the live-migrated worker diverged from the one that never moved"
    finally:
        moved.close()
        ref.close()
        close_hosts()


def test_migrate_across_nodes_and_back_bit_identical(cluster):
    from gym_fork.migration import MigratedEnvError, RemoteRestoreError
    from gym_fork.ray import RayNode
    from gym_fork.ray.hosts import close_hosts, host_for

    head = ray.get_runtime_context().get_node_id()
    others = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] != head]
    assert len(others) == 2
    moved, ref = gym_fork.make("LunarLander-v3"), gym_fork.make("LunarLander-v3")
    try:
        om, _ = moved.reset(seed=7)
        orf, _ = ref.reset(seed=7)
        tm, tr = [], []
        om, orf = _run_crc(moved, om, 20, tm), _run_crc(ref, orf, 20, tr)
        # a bundle signed with another token's key is refused before anything is restored
        with pytest.raises(RemoteRestoreError, match="HMAC"):
            moved.migrate(RayNode(others[0]), token="not-the-token")
        om, orf = _run_crc(moved, om, 5, tm), _run_crc(ref, orf, 5, tr)  # still local, unchanged
        hops = []
        for nid in [head, others[0], others[1], head]:  # A -> B -> C -> A, mid-episode
            rep = moved.migrate(RayNode(nid))
            assert rep["node_id"] == nid and moved._handle.node_id == nid
            hops.append(rep)
            om, orf = _run_crc(moved, om, 25, tm), _run_crc(ref, orf, 25, tr)
        assert tm == tr, "the migrated worker diverged from the one that never moved"
        assert [h["source"] for h in hops[1:]] == [head, others[0], others[1]]
        with pytest.raises(MigratedEnvError, match="Ray node"):
            moved.snapshot()
        # only the current host holds the worker; the others released theirs
        time.sleep(0.3)
        held = {n: ray.get(host_for(n).info.remote())["hosted"] for n in [head] + others}
        assert [len(v) for v in held.values()] == [1, 0, 0]
        host = host_for(head)
        moved.close()
        deadline = time.monotonic() + 5
        while ray.get(host.info.remote())["hosted"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ray.get(host.info.remote())["hosted"] == {}
    finally:
        moved.close()
        ref.close()
        close_hosts()


def test_killed_migration_host_leaves_nothing_and_env_raises(cluster):
    from gym_fork.errors import WorkerDiedError
    from gym_fork.ray import RayNode
    from gym_fork.ray.hosts import close_hosts, host_for

    head = ray.get_runtime_context().get_node_id()
    nid = next(n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] != head)
    env = gym_fork.make("LunarLander-v3")
    try:
        obs, _ = env.reset(seed=1)
        env.migrate(RayNode(nid))
        env.step(0)
        host = host_for(nid)
        info = ray.get(host.info.remote())
        wpid = list(info["hosted"].values())[0]
        assert wpid in info["descendants"]
        ray.kill(host, no_restart=True)
        assert _wait_dead([info["pid"], *info["descendants"]]) == [], "the migrated worker outlived its host"
        with pytest.raises(WorkerDiedError, match=f"Ray node {nid}.*host actor is gone"):
            env.step(0)
        env.close()  # closing a dead remote env is not an error
    finally:
        env.close()
        close_hosts()


# --- a whole `gym-fork run` job moved into a Ray node's host (LiveMigrationCallback(RayNode)) -------
TRAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "migration_train.py")
JOB_TOTAL = 1024


def _json_lines(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines() if x.startswith("{")]


def _log_lines(logd: str) -> list[dict]:
    try:
        with open(os.path.join(logd, "stdout.log")) as f:
            return _json_lines(f.read())
    except OSError:
        return []


@pytest.fixture(scope="module")
def job_reference():
    """The same PPO job, never moved: its episodes and final policy hash."""
    out = subprocess.run([sys.executable, TRAIN, "--total", str(JOB_TOTAL)], capture_output=True, text=True,
                         timeout=180, check=True).stdout
    return _json_lines(out)


def _run_job_to(cluster, node_id: str, logd: str, at: int | str, total: int,
                token_file: str | None = None, hold_file: str | None = None) -> subprocess.CompletedProcess:
    """`gym-fork run` on this machine (a driver-side supervisor, no token: the HMAC-derived one, like
    the hosts), the job moving into ``node_id``'s job host at timestep ``at``; returns once the
    supervisor exited (after the move, or the job's end)."""
    env = dict(os.environ, RAY_ADDRESS=cluster.address, GYM_FORK_RAY_JOB_HOST_IDLE_S="3")
    env.pop("GYM_FORK_TOKEN", None)
    env.pop("GYM_FORK_TOKEN_FILE", None)
    cmd = [sys.executable, "-m", "gym_fork.cli", "run", "--node", "driver", "--log-dir", logd,
           *(["--token-file", token_file] if token_file else []), "--",
           sys.executable, TRAIN, "--ray-node", node_id, "--at", str(at), "--total", str(total),
           *(["--hold-file", hold_file] if hold_file else [])]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)


def _job_host(node_id: str):
    from gym_fork.ray.hosts import HOST_NAME, JOB_NAMESPACE

    return ray.get_actor(HOST_NAME.format(node_id), namespace=JOB_NAMESPACE)


def test_job_live_migrates_into_ray_node(cluster, job_reference, tmp_path):
    head = ray.get_runtime_context().get_node_id()
    nid = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] != head)[0]
    logd = str(tmp_path / "logs")
    at = 520  # just after the first PPO update: the job still has ~500 steps to go on the host
    hold = tmp_path / "go-on"  # the job waits on the host until we looked at it (~500 steps take < 1 s)
    r = _run_job_to(cluster, nid, logd, at, JOB_TOTAL, hold_file=str(hold))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"now runs on Ray node {nid}" in r.stdout, (r.stdout, r.stderr[-3000:])
    src_pid = int(r.stdout.split("job pid ")[1].split()[0])
    assert not _alive(src_pid)  # the source stopped (after the host confirmed)
    # the job now runs as the job host's child on that node, guarded
    host = _job_host(nid)
    info = ray.get(host.info.remote())
    assert info["node_id"] == nid and info["jobs_received"] == 1
    assert len(info["jobs"]) == 1, info
    job_pid, guard = next(iter(info["jobs"].items()))
    assert job_pid in info["descendants"] and guard["guard"] in info["descendants"]
    hold.touch()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(x.get("done") for x in _log_lines(logd)):
        time.sleep(0.2)
    lines = _log_lines(logd)
    done = [x for x in lines if x.get("done")]
    assert done, (lines[-3:], open(os.path.join(logd, "stderr.log")).read()[-3000:])
    done = done[0]
    assert done["ray_imported"] is False  # the job never touched Ray: its supervisor did
    assert done["host_ppid"] == info["pid"]  # it finished as the host actor's child
    mig = done["migrations"]
    assert [m["status"] for m in mig] == ["arrived"], mig
    assert mig[0]["node"] == nid and mig[0]["source"] == "driver" and mig[0]["timestep"] == at
    assert mig[0]["bytes"] > 1_000_000 and mig[0]["downtime_s"] > 0
    assert mig[0]["timeline"]["prewarmed"] == 1.0  # the supervisor started the job host at training start
    logged = done["logged"]
    assert logged["migration/target"] == nid and logged["migration/source"] == "driver"
    assert logged["migration/timestep"] == at and logged["migration/downtime_s"] > 0 and logged["migration/bytes"] > 0
    # zero lost timesteps; RNG, optimizer and episode state continue exactly: same as never moving
    ref = [x for x in job_reference if x.get("done")][0]
    assert done["timesteps"] == ref["timesteps"] == JOB_TOTAL
    assert done["policy_sha"] == ref["policy_sha"]
    eps = [x for x in lines if "ret" in x]
    assert [(x["t"], x["ret"]) for x in eps] == [(x["t"], x["ret"]) for x in job_reference if "ret" in x]
    assert {x["node"] for x in eps if x["t"] > at} == {nid}
    # the job ended there: its guard exits, nothing restored is left, and the idle job host stops
    # itself (GYM_FORK_RAY_JOB_HOST_IDLE_S=3 in the supervisor that created it) and deletes its images
    assert _wait_dead([job_pid, guard["guard"]], timeout=20) == []
    assert _wait_dead([info["pid"], *info["descendants"]], timeout=30) == [], "the idle job host did not stop"
    assert not os.path.exists(info["session"])
    with pytest.raises(ValueError):
        _job_host(nid)


def test_job_hops_on_from_one_ray_node_to_the_next(cluster, job_reference, tmp_path):
    """driver -> node 1 -> node 2: the second move starts in node 1's job host (it resolves the
    next Ray node itself) and the job still trains exactly as if it never moved."""
    head = ray.get_runtime_context().get_node_id()
    n1, n2 = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] != head)[:2]
    logd = str(tmp_path / "logs")
    r = _run_job_to(cluster, f"{n1},{n2}", logd, "520,800", JOB_TOTAL)
    assert r.returncode == 0 and f"now runs on Ray node {n1}" in r.stdout, (r.stdout, r.stderr[-3000:])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(x.get("done") for x in _log_lines(logd)):
        time.sleep(0.2)
    lines = _log_lines(logd)
    done = [x for x in lines if x.get("done")]
    assert done, (lines[-3:], open(os.path.join(logd, "stderr.log")).read()[-3000:])
    done = done[0]
    hops = [(m["status"], m["source"], m["node"], m["timestep"]) for m in done["migrations"]]
    assert hops == [("arrived", "driver", n1, 520), ("arrived", n1, n2, 800)], hops
    assert done["host_ppid"] == ray.get(_job_host(n2).info.remote())["pid"]  # finished under node 2's host
    ref = [x for x in job_reference if x.get("done")][0]
    assert (done["timesteps"], done["policy_sha"]) == (ref["timesteps"], ref["policy_sha"])
    eps = [x for x in lines if "ret" in x]
    assert [(x["t"], x["ret"]) for x in eps] == [(x["t"], x["ret"]) for x in job_reference if "ret" in x]


def test_job_on_ray_node_dies_with_its_node(cluster, tmp_path):
    """The node a job moved to dies (its raylet and workers end; no Ray cleanup reaches the job,
    which is in its own session and PID namespace): the job's guard kills it, nothing is left. A
    node is added for this test and removed."""
    node = cluster.add_node(num_cpus=1, object_store_memory=100 << 20)
    cluster.wait_for_nodes()
    nid = node.node_id
    logd = str(tmp_path / "logs")
    try:
        r = _run_job_to(cluster, nid, logd, 300, 50_000)  # moves at 300, then would run for minutes
        assert r.returncode == 0 and f"now runs on Ray node {nid}" in r.stdout, r.stderr[-3000:]
        info = ray.get(_job_host(nid).info.remote())
        job_pid, guard = next(iter(info["jobs"].items()))
        assert _alive(job_pid) and job_pid in info["descendants"]
    except BaseException:
        cluster.remove_node(node)
        raise
    cluster.remove_node(node)
    assert _wait_dead([info["pid"], job_pid, guard["guard"], *info["descendants"]], timeout=20) == [], \
        "the restored job outlived its node"
    assert not any(x.get("done") for x in _log_lines(logd))
    from gym_fork.ray.host import reap_dead_dirs

    reap_dead_dirs()  # what the next host on that machine (or pool.close()) does
    assert not os.path.exists(info["session"])


def test_job_migration_to_dead_ray_node_keeps_training(cluster, job_reference, tmp_path):
    logd = str(tmp_path / "logs")
    r = _run_job_to(cluster, "f" * 56, logd, 200, JOB_TOTAL)  # no such node: the job stays and finishes
    assert r.returncode == 0, r.stderr[-3000:]
    assert "is not an alive node" in r.stderr
    done = [x for x in _json_lines(open(os.path.join(logd, "stdout.log")).read()) if x.get("done")][0]
    assert done["migrations"][0]["status"] == "failed" and "not an alive node" in done["migrations"][0]["error"]
    assert done["logged"]["migration/failed"] == 1
    ref = [x for x in job_reference if x.get("done")][0]
    assert (done["timesteps"], done["policy_sha"]) == (ref["timesteps"], ref["policy_sha"])


def test_job_migration_with_a_token_the_hosts_do_not_share_is_refused(cluster, job_reference, tmp_path):
    """The supervisor holds a token the Ray hosts do not: the host refuses the handshake, nothing
    is restored there, and the job trains on where it is."""
    head = ray.get_runtime_context().get_node_id()
    nid = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] != head)[0]
    tok = tmp_path / "wrong-token"
    tok.write_text("not the hosts' token\n")
    tok.chmod(0o600)
    logd = str(tmp_path / "logs")
    r = _run_job_to(cluster, nid, logd, 200, JOB_TOTAL, token_file=str(tok))
    assert r.returncode == 0, r.stderr[-3000:]
    done = [x for x in _json_lines(open(os.path.join(logd, "stdout.log")).read()) if x.get("done")][0]
    m = done["migrations"][0]
    assert m["status"] == "failed" and "Authentication" in m["error"], m
    ref = [x for x in job_reference if x.get("done")][0]
    assert (done["timesteps"], done["policy_sha"]) == (ref["timesteps"], ref["policy_sha"])
    try:  # nothing was restored on the node (an idle job host stops itself after 3 s here)
        assert ray.get(_job_host(nid).info.remote())["jobs"] == {}
    except (ValueError, ray.exceptions.RayActorError):
        pass


_DRIVER = """
import json, sys, time, zlib
import numpy as np, ray
import gym_fork
from gym_fork.ray import RayBranchPool
ray.init(address=sys.argv[1])
env = gym_fork.make("LunarLander-v3")
env.reset(seed=0)
snap = env.snapshot()
pool = RayBranchPool()
pool.prepare(snap)
def slow(obs):
    time.sleep(0.05)
    return zlib.crc32(np.asarray(obs).tobytes()) % 4
import threading
threading.Thread(target=lambda: pool.explore(snap, slow, n_branches=6, horizon=5000), daemon=True).start()
time.sleep(3)  # branches are running on every node now
print(json.dumps(pool.info()), flush=True)
print(json.dumps(pool._tmp), flush=True)
time.sleep(600)
"""


def test_killed_driver_leaves_no_process_and_no_image(cluster, tmp_path):
    """SIGKILL a driver mid-exploration: Ray ends its host actors, the restored roots and branches
    die with them (subreapers), and no image is left on any node."""
    from gym_fork.snapshots import reclaim

    p = subprocess.Popen([sys.executable, "-c", _DRIVER, cluster.address], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line, p.stderr.read()[-3000:]
        infos = json.loads(line)
        pool_dir = json.loads(p.stdout.readline())  # the driver's own scratch directory
    finally:
        p.kill()
        p.wait()
    assert len(infos) == 3 and sum(i["busy"] for i in infos.values()) > 0, infos  # killed mid-call
    procs = [i["pid"] for i in infos.values()] + [d for i in infos.values() for d in i["descendants"]]
    assert len(procs) > 3  # hosts and their restored roots / running branches
    assert _wait_dead(procs, timeout=60) == [], "processes of the dead driver's hosts outlived it"
    # No image is left: a host deletes a bundle's images once it restored it (branches fork from
    # memory). Its (empty) session directory goes when the next host starts on that node.
    sessions = [i["session"] for i in infos.values()]
    # (each holds only its owner lock, which is how the next process knows its owner is gone)
    assert [f for s in sessions for _d, _s, fs in os.walk(s) for f in fs if f != reclaim.OWNER] == []
    assert os.path.isdir(pool_dir)  # nobody removed it: its driver was killed
    p2 = RayBranchPool()
    try:
        assert not any(os.path.exists(s) for s in sessions), "dead hosts' directories were not reaped"
        # ... nor the dead driver's: it was in its session directory, which the next gym_fork
        # process reclaims (in /tmp, one such directory was left behind per killed driver)
        from gym_fork.snapshots import sessiondir

        reclaim.reclaim_orphans(sessiondir.base_dir(), keep=sessiondir.current_session())  # (what it does)
        assert not os.path.exists(pool_dir), pool_dir
    finally:
        p2.close()
