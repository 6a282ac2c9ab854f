"""gym_fork.ray on a real Ray cluster (head + 2 worker nodes on this machine), real CRIU, real envs.

One module-scoped cluster (~6-15 s, ~1 GB) serves every test; teardown checks that nothing the
hosts restored is left running and that their image directories are gone.
"""

from __future__ import annotations

import os
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
        out: dict = {}

        def run():
            try:
                out["res"] = p.explore(snap, SlowPolicy(0.01), n_branches=6, horizon=150, rng="reseed",
                                       seeds=seeds, stop_at_done=False)
            except BaseException as e:  # noqa: BLE001
                out["err"] = e

        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + 30
        while ray.get(victim.info.remote())["busy"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        running = ray.get(victim.info.remote())
        assert running["busy"] > 0
        time.sleep(0.3)  # mid-branch: its clones are stepping
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
    # close() reaps the killed host's images on its node
    assert not os.path.exists(vinfo["session"])
    assert not [n for n in os.listdir(hosts_base()) if n.startswith(f"s{vinfo['pid']}-")]


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


# --- migration targets named by Ray node (gym_fork.ray.migration) -------------------------------
def _run_crc(env, obs, n, traj):
    for _ in range(n):
        obs, r, term, trunc, _info = env.step(crc_policy(obs))
        traj.append((np.asarray(obs).tobytes(), float(r), bool(term), bool(trunc)))
        if term or trunc:
            obs, _info = env.reset(seed=len(traj))
    return obs


def test_migrate_across_nodes_and_back_bit_identical(cluster):
    from gym_fork.migration import MigratedEnvError, RemoteRestoreError
    from gym_fork.ray import RayNode
    from gym_fork.ray.migration import close_hosts, host_for

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
    from gym_fork.ray.migration import close_hosts, host_for

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
