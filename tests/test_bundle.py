"""Snapshot bundles: save in one process, load and restore in a fresh interpreter; tampering,
a foreign key and an incompatible machine are refused before anything is started."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import agent_envs
import gym_fork
from gym_fork import keys
from gym_fork.errors import BundleError
from gym_fork.snapshots.bundle import canonical_meta as _canonical
from gym_fork.errors import ForeignSnapshotError, SnapshotCorruptedError

ACTIONS = [0, 2, 3, 1, 2, 2, 0, 3] * 8


def _digest(traj) -> str:
    h = hashlib.sha256()
    for obs, r, term, trunc in traj:
        h.update(np.asarray(obs).tobytes() + np.float64(r).tobytes() + bytes([term, trunc]))
    return h.hexdigest()


CHILD = textwrap.dedent(
    """
    import hashlib, json, sys
    import numpy as np
    import gym_fork
    snap = gym_fork.load_snapshot(sys.argv[1])
    env = gym_fork.ForkableEnv.from_snapshot(snap)
    traj = []
    for a in json.loads(sys.argv[2]):
        obs, r, term, trunc, _ = env.step(a)
        traj.append((obs, r, term, trunc))
        if term or trunc:
            break
    h = hashlib.sha256()
    for obs, r, term, trunc in traj:
        h.update(np.asarray(obs).tobytes() + np.float64(r).tobytes() + bytes([term, trunc]))
    print(env.steps, snap.steps, h.hexdigest())
    env.close()
    """
)


def _continue_in_fresh_interpreter(path: str, actions: list) -> tuple[int, int, str]:
    out = subprocess.run([sys.executable, "-c", CHILD, path, json.dumps(actions)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "GYM_FORK_KEY_FILE": keys.key_file()})
    assert out.returncode == 0, out.stderr[-2000:]
    a, b, h = out.stdout.split()
    return int(a), int(b), h


def _take(env_id: str, backend: str, **kw):
    env = gym_fork.make(env_id, backend=backend, **kw)
    env.reset(seed=5)
    env.action_space.seed(5)
    for i in range(20):
        _, _, term, trunc, _ = env.step(i % 2 if env_id.startswith("CartPole") else env.action_space.sample())
        assert not (term or trunc)
    return env, env.snapshot()


@pytest.fixture(autouse=True)
def _private_key(tmp_path, monkeypatch):
    monkeypatch.setenv("GYM_FORK_KEY_FILE", str(tmp_path / "key"))
    monkeypatch.delenv("GYM_FORK_KEY", raising=False)


def test_a_pickle_bundle_whose_set_order_follows_the_string_hash_seed(tmp_path):
    """A set of strings iterates in an order that follows the process's string hashes
    (PYTHONHASHSEED): a pickle bundle saved under one seed continues exactly under the same seed
    and is refused, naming the set and the fix, under another."""
    tests = os.path.dirname(os.path.abspath(__file__))

    def run(seed: int, *args: str) -> str:
        env = {**os.environ, "GYM_FORK_KEY_FILE": keys.key_file(), "PYTHONHASHSEED": str(seed),
               "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
        out = subprocess.run([sys.executable, "-c", agent_envs.HASH_ORDER_CHILD, *args], capture_output=True, text=True,
                             timeout=120, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.strip().splitlines()[-1]

    path = str(tmp_path / "b")
    saved = run(1, "save", path)  # what the env does after the snapshot, in the saving process
    assert run(1, "load", path) == saved
    refused = run(2, "load", path)
    assert refused.startswith("refused:")
    assert "string hashes differ" in refused and "env.items (a set of strs" in refused
    assert "PYTHONHASHSEED" in refused and "Nothing was restored" in refused


@pytest.mark.criu
@pytest.mark.parametrize("env_id,backend,kw", [("LunarLander-v3", "criu", {"fork_tier": True}),
                                               ("LunarLander-v3", "criu", {"fork_tier": False}),
                                               ("CartPole-v1", "pickle", {})])
def test_round_trip_in_a_fresh_interpreter(tmp_path, env_id, backend, kw):
    env, snap = _take(env_id, backend, **kw)
    try:
        acts = [int(a % env.action_space.n) for a in ACTIONS]
        traj = []
        for a in acts:
            obs, r, term, trunc, _ = env.step(a)
            traj.append((obs, r, term, trunc))
            if term or trunc:
                break
        path = snap.save(str(tmp_path / "b"))
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
        assert all(stat.S_IMODE(os.stat(os.path.join(r, f)).st_mode) == 0o600
                   for r, _, fs in os.walk(path) for f in fs)
        steps, snap_steps, digest = _continue_in_fresh_interpreter(path, acts)
        assert snap_steps == 20 and steps == 20 + len(traj)
        assert digest == _digest(traj)
        # and in this process, into the running env (same env id)
        loaded = gym_fork.load_snapshot(path)
        env.restore(loaded)
        assert env.steps == 20
        loaded.release()
        assert os.path.isdir(path), "releasing a loaded snapshot must not delete the bundle"
    finally:
        env.close()


@pytest.mark.criu
def test_tampering_and_foreign_keys_are_refused(tmp_path):
    env, snap = _take("CartPole-v1", "criu", fork_tier=False)
    pe, psnap = _take("CartPole-v1", "pickle")
    try:
        path = snap.save(str(tmp_path / "c"))
        ppath = psnap.save(str(tmp_path / "p"))
        with pytest.raises(FileExistsError):
            snap.save(path)

        meta = json.load(open(os.path.join(path, "bundle.json")))
        meta["steps"] = 999
        json.dump(meta, open(os.path.join(path, "bundle.json"), "w"))
        with pytest.raises(BundleError, match="HMAC"):
            gym_fork.load_snapshot(path)

        with pytest.raises(BundleError, match="HMAC"):
            gym_fork.load_snapshot(ppath, key=b"another machine's key")

        with open(os.path.join(ppath, "payload.pkl"), "r+b") as f:
            f.seek(10)
            b = f.read(1)
            f.seek(10)
            f.write(bytes([b[0] ^ 0xFF]))
        with pytest.raises(SnapshotCorruptedError, match="not unpickled"):
            gym_fork.load_snapshot(ppath)

        path2 = snap.save(str(tmp_path / "c2"))
        pages = [f for f in os.listdir(os.path.join(path2, "images")) if f.startswith("pages-")][0]
        p = os.path.join(path2, "images", pages)
        os.chmod(p, 0o600)
        data = bytearray(open(p, "rb").read())
        data[len(data) // 2] ^= 0xFF
        # break the hard link before writing: the original snapshot's images must stay intact
        os.unlink(p)
        open(p, "wb").write(bytes(data))
        with pytest.raises(SnapshotCorruptedError, match="sha256"):
            gym_fork.load_snapshot(path2)
        env.restore(snap)  # the in-memory snapshot was not affected
    finally:
        env.close()
        pe.close()


def _resign(path: str, **changes) -> None:
    meta = json.load(open(os.path.join(path, "bundle.json")))
    meta.update(changes)
    meta["hmac"] = keys.sign(_canonical(meta))
    json.dump(meta, open(os.path.join(path, "bundle.json"), "w"))


@pytest.mark.criu
def test_incompatible_bundles_are_refused_before_restoring(tmp_path):
    env, snap = _take("CartPole-v1", "criu")
    try:
        path = snap.save(str(tmp_path / "b"))
        meta = json.load(open(os.path.join(path, "bundle.json")))
        assert any(f[0] == meta["python"] or "python" in f[0] for f in meta["files"])
        _resign(path, criu_version="3.17.1")
        with pytest.raises(BundleError, match="major versions differ"):
            gym_fork.load_snapshot(path)
        _resign(path, criu_version=meta["criu_version"], files=meta["files"] + [["/opt/nowhere/libfoo.so", 10]])
        with pytest.raises(BundleError, match="libfoo.so is missing"):
            gym_fork.load_snapshot(path)
        _resign(path, files=meta["files"])
        loaded = gym_fork.load_snapshot(path)
        other = gym_fork.make("Acrobot-v1", backend="criu")
        try:
            with pytest.raises(ForeignSnapshotError, match="CartPole"):
                other.restore(loaded)
        finally:
            other.close()
    finally:
        env.close()


def test_a_pickle_bundle_from_another_python_minor_version_is_refused(tmp_path):
    """cloudpickle keeps code defined in a script as bytecode of the Python that saved it; another
    minor version ran it with other meanings (a Python 3.11 bundle of a script's env, loaded by
    3.13, raised "unsupported operand type(s) for +: 'Walk' and 'int'" from a step that adds two
    floats). Such a bundle is refused before anything is unpickled; another patch release loads."""
    env, snap = _take("CartPole-v1", "pickle")
    try:
        path = snap.save(str(tmp_path / "b"))
        ours = platform.python_version()
        major, minor = (int(x) for x in ours.split(".")[:2])
        _resign(path, python_version=f"{major}.{minor - 1}.4")
        with pytest.raises(BundleError, match=rf"saved by Python {major}\.{minor - 1}\.4, and this is Python "
                                              rf"{re.escape(ours)}.*Nothing was loaded"):
            gym_fork.load_snapshot(path)
        _resign(path, python_version=f"{major}.{minor}.999")
        loaded = gym_fork.load_snapshot(path)
        env.restore(loaded)
    finally:
        env.close()
