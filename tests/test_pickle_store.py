"""Pickle-backend snapshots on disk: ``Snapshot.persist()`` and a ``SnapshotStore``'s budgets,
pins and later processes, exact as in memory, and never unpickled unless their sha256 checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest

import agent_envs
import gym_fork
from gym_fork import SnapshotStore
from gym_fork.errors import SnapshotCorruptedError


def _replay(seed: int, actions: list[int]) -> list:
    """What an in-process CartPole does after ``reset(seed)`` and ``actions``: the next 5 steps."""
    env = gym.make("CartPole-v1")
    env.reset(seed=seed)
    for a in actions:
        env.step(a)
    out = [env.step(a)[0].tolist() for a in (0, 1, 1, 0, 1)]
    env.close()
    return out


def _next5(env) -> list:
    return [env.step(a)[0].tolist() for a in (0, 1, 1, 0, 1)]


def test_a_memory_budget_spills_pickle_snapshots_and_each_restores_exactly(tmp_path):
    st = SnapshotStore(tmp_path / "s", max_in_memory=2)
    env = gym_fork.ForkableEnv("CartPole-v1", backend="pickle", store=st)
    try:
        env.reset(seed=4)
        actions, snaps = [], []
        for i in range(6):  # before this fix the 3rd snapshot and every one after raised StoreError
            for _ in range(3):
                a = len(actions) % 2
                env.step(a)
                actions.append(a)
            snaps.append((env.snapshot(), list(actions)))
        assert st.stats["spilled"] == 4 and len(st.list()) == 4
        assert [s.memory_bytes() for s, _ in snaps[:4]] == [0, 0, 0, 0]  # on disk only now
        assert all(s.memory_bytes() > 0 for s, _ in snaps[4:])
        for s, acts in reversed(snaps):
            env.restore(s)
            assert _next5(env) == _replay(4, acts)
    finally:
        env.close()


def test_a_byte_budget_counts_the_pickles(tmp_path):
    st = SnapshotStore(tmp_path / "s")
    env = gym_fork.ForkableEnv("CartPole-v1", backend="pickle", store=st)
    try:
        env.reset(seed=0)
        first = env.snapshot()
        st.max_memory = int(first.memory_bytes() * 2.5)  # room for two
        kept = []
        for a in (0, 1, 0):
            env.step(a)
            kept.append(env.snapshot())
        assert st.stats["spilled"] == 2 and first.memory_bytes() == 0
        assert st.memory_bytes() <= st.max_memory
    finally:
        env.close()


PIN_WRITER = """
import sys, gym_fork
st = gym_fork.SnapshotStore(sys.argv[1])
env = gym_fork.ForkableEnv("CartPole-v1", backend="pickle", store=st)
env.reset(seed=7)
for a in (1, 0, 1, 1):
    env.step(a)
snap = env.snapshot().pin()
print(snap.id, repr(env.step(1)[0].tolist()))
env.close()
"""


def test_a_pinned_pickle_snapshot_restores_in_the_next_process(tmp_path):
    d = str(tmp_path / "store")
    out = subprocess.run([sys.executable, "-c", PIN_WRITER, d], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    sid, obs = out.stdout.split(maxsplit=1)
    st = SnapshotStore(d)
    assert st.list()[sid]["pinned"]  # pin() wrote it: before, it stayed in the writer's memory
    snap = st.load(sid)
    env = gym_fork.ForkableEnv.from_snapshot(snap)
    try:
        assert env.backend == "pickle" and env.steps == 4
        assert repr(env.step(1)[0].tolist()) == obs.strip()
    finally:
        env.close()


def _flip_a_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))


def test_a_persisted_pickle_changed_on_disk_is_not_unpickled_and_the_env_goes_on():
    env = gym_fork.ForkableEnv("CartPole-v1", backend="pickle")
    try:
        env.reset(seed=1)
        snap = env.snapshot().persist(keep_in_memory=False)
        assert snap.persisted and snap.memory_bytes() == 0
        path = snap.payload().path
        assert os.stat(path).st_mode & 0o777 == 0o700
        want = _next5(env)
        env.restore(snap)
        assert _next5(env) == want  # from the file
        _flip_a_byte(os.path.join(path, "payload.pkl"))
        with pytest.raises(SnapshotCorruptedError, match="sha256.*not unpickled"):
            env.restore(snap)
        assert env.steps == 5 and env.step(0)[0].shape == (4,)  # unchanged, still running
        snap.release()
        assert not os.path.exists(path)  # its private directory goes with it
    finally:
        env.close()


@pytest.mark.parametrize("verify", ["full", "size"])
def test_a_stored_pickle_changed_in_the_store_is_not_unpickled(tmp_path, verify):
    st = SnapshotStore(tmp_path / "s", verify=verify)
    env = gym_fork.ForkableEnv("CartPole-v1", backend="pickle", store=st)
    try:
        env.reset(seed=2)
        snap = env.snapshot()
        st.put(snap)
        entry = os.path.join(st.snapshot_dir(snap.id), "images", "payload.pkl")
        meta = json.load(open(os.path.join(st.snapshot_dir(snap.id), "bundle.json")))
        assert meta["backend"] == "pickle" and meta["payload_size"] == os.path.getsize(entry)
        _flip_a_byte(entry)  # same size: the "size" check alone would pass it
        with pytest.raises(SnapshotCorruptedError):
            env.restore(snap)
        assert np.asarray(env.step(1)[0]).shape == (4,)
    finally:
        env.close()


def test_a_stored_pickle_whose_set_order_follows_the_string_hash_seed(tmp_path, monkeypatch):
    """As for bundles: a stored pickle of an env holding a set of strings continues exactly in a
    process with the same PYTHONHASHSEED and is refused, naming the set, under another."""
    tests = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("GYM_FORK_KEY_FILE", str(tmp_path / "key"))

    def run(seed: int, *args: str) -> list[str]:
        env = {**os.environ, "PYTHONHASHSEED": str(seed),
               "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
        out = subprocess.run([sys.executable, "-c", agent_envs.HASH_ORDER_CHILD, *args], capture_output=True, text=True,
                             timeout=120, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.strip().splitlines()

    store = str(tmp_path / "store")
    sid, saved = run(1, "save", store, "store")
    assert run(1, "load", store, sid) == [saved]
    (refused,) = run(2, "load", store, sid)
    assert refused.startswith("refused:") and "string hashes differ" in refused
    assert "env.items (a set of strs" in refused and "Nothing was restored" in refused


def test_snapshots_at_an_episode_end_do_not_warn_from_the_pickle_check():
    """The pickle backend steps two copies to check a snapshot; stepping a copy of an env whose
    episode had ended made Gymnasium warn "step() ... already returned terminated" in the user's
    process at each such snapshot (46 times in a short PPO run with branch exploration)."""
    import warnings

    env = gym_fork.ForkableEnv("CartPole-v1", backend="pickle")
    try:
        env.reset(seed=0)
        while not env.step(1)[2]:
            pass
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            snaps = [env.snapshot() for _ in range(4)]  # the check runs at the 1st, 2nd and 4th
        assert not [w for w in seen if "terminated" in str(w.message)], [str(w.message) for w in seen]
        assert len(snaps) == 4
    finally:
        env.close()
