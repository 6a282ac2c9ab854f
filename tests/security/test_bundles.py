"""Attacks by someone who can write to a bundle or a store directory, against the process that
loads it: files swapped between the check and the restore, unsigned MANIFEST entries naming
devices, FIFOs and files outside the bundle, payload files replaced by FIFOs or links, and extra
unsigned files in ``images/``.  Real CRIU, real files; every load runs in a child process with a
deadline, so a hang is a failure and not a stuck test run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import gym_fork
from gym_fork import SnapshotStore, cli, keys
from gym_fork.errors import BundleError, SnapshotCorruptedError

pytestmark = pytest.mark.criu

LOAD = textwrap.dedent(
    """
    import sys, gym_fork
    try:
        snap = gym_fork.load_snapshot(sys.argv[1])
    except gym_fork.GymForkError as e:
        print("REFUSED", type(e).__name__, e)
    else:
        print("LOADED", snap.steps)
    """
)


@pytest.fixture(autouse=True)
def _private_key(tmp_path, monkeypatch):
    monkeypatch.setenv("GYM_FORK_KEY_FILE", str(tmp_path / "key"))
    monkeypatch.delenv("GYM_FORK_KEY", raising=False)


def _load_in_child(path: str, timeout: float = 60) -> str:
    """``load_snapshot(path)`` in a fresh interpreter; its one-line verdict, or ``"HANG"``."""
    try:
        out = subprocess.run([sys.executable, "-c", LOAD, path], capture_output=True, text=True,
                             timeout=timeout, env={**os.environ, "GYM_FORK_KEY_FILE": keys.key_file()})
    except subprocess.TimeoutExpired:
        return "HANG"
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def _two_moments(env) -> tuple:
    """Snapshots A (step 20) and B (step 40) of one CartPole episode, and A's obs."""
    env.reset(seed=3)
    for i in range(20):
        obs, *_ = env.step(i % 2)
    a = env.snapshot()
    obs_a = obs
    for i in range(20):
        obs, *_ = env.step((i + 1) % 2)
    b = env.snapshot()
    return a, b, obs_a, obs


def _image_names(path: str) -> list[str]:
    return sorted(os.listdir(os.path.join(path, "images")))


def test_images_swapped_after_the_check_are_not_restored(tmp_path):
    env = gym_fork.make("CartPole-v1", backend="criu", fork_tier=False)
    try:
        a, b, obs_a, obs_b = _two_moments(env)
        assert not np.array_equal(obs_a, obs_b)
        pa, pb = a.save(str(tmp_path / "A")), b.save(str(tmp_path / "B"))
        loaded = gym_fork.load_snapshot(pa)  # verified here...
        os.rename(os.path.join(pa, "images"), str(tmp_path / "A-images"))  # ...then swapped
        os.rename(os.path.join(pb, "images"), os.path.join(pa, "images"))
        obs, _ = env.restore(loaded)
        assert env.steps == 20
        assert np.array_equal(obs, obs_a), "B's state was restored under A's name"
        # a second restore and a fork come from the verified private copy too
        kid = env.fork(loaded)[0]
        try:
            assert np.array_equal(kid.step(0)[0], env.step(0)[0])
        finally:
            kid.close()
        loaded.release()
        assert os.path.isdir(pa), "releasing a loaded snapshot must not delete the bundle"
    finally:
        env.close()


def test_store_entry_swapped_after_load_is_refused(tmp_path):
    st = SnapshotStore(tmp_path / "store", dedup=False)
    env = gym_fork.ForkableEnv("CartPole-v1", backend="criu", fork_tier=False)
    try:
        a, b, obs_a, obs_b = _two_moments(env)
        st.put(a)
        st.put(b)
        other = SnapshotStore(tmp_path / "store")  # another process's view
        la = other.load(a.id)
        sa, sb = other.snapshot_dir(a.id), other.snapshot_dir(b.id)
        os.rename(sa, sa + "-x")
        os.rename(sb, sa)  # B's (validly signed) entry now sits where A's was
        try:
            obs, _ = env.restore(la)
        except SnapshotCorruptedError as e:
            assert a.id in str(e)
        else:
            assert np.array_equal(obs, obs_a), "B's state was restored under A's name"
    finally:
        env.close()


def _bundle(tmp_path, name: str = "b") -> str:
    env = gym_fork.make("CartPole-v1", backend="criu", fork_tier=False)
    try:
        env.reset(seed=1)
        for i in range(7):
            env.step(i % 2)
        return env.snapshot().save(str(tmp_path / name))
    finally:
        env.close()


def _manifest_with(path: str, name: str, size: int = 4096) -> None:
    """The unsigned images/MANIFEST.json of an older bundle, with one more entry."""
    man_path = os.path.join(path, "images", "MANIFEST.json")
    meta = json.load(open(os.path.join(path, "bundle.json")))
    man = {"files": dict(meta["images"]), "meta": {}}
    man["files"][name] = {"size": size, "sha256": "0" * 64}
    with open(man_path, "w") as f:
        json.dump(man, f)


def test_unsigned_manifest_entries_are_never_opened(tmp_path):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 12345)
    os.chmod(secret, 0o600)
    # size 0: what stat() says of a device or a FIFO, so a size check alone lets them through
    for i, (entry, size) in enumerate([("/dev/zero", 0), (fifo, 0), ("../../secret", 4096)]):
        path = _bundle(tmp_path, f"b{i}")
        _manifest_with(path, entry, size)
        verdict = _load_in_child(path)
        assert verdict != "HANG", f"a MANIFEST entry {entry} makes load_snapshot hang"
        assert "12345" not in verdict, f"the size of a file outside the bundle leaked: {verdict}"
        # images/MANIFEST.json is not signed: the bundle is refused for holding it, or loads
        # from the signed list; it never decides what is opened
        assert verdict.startswith(("LOADED 7", "REFUSED")), verdict


@pytest.mark.parametrize("kind", ["fifo", "dev-zero-link", "link-outside", "directory", "grown"])
def test_signed_image_replaced_by_something_else_is_refused(tmp_path, kind):
    path = _bundle(tmp_path)
    pages = [n for n in _image_names(path) if n.startswith("pages-")][0]
    p = os.path.join(path, "images", pages)
    os.unlink(p)
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "dev-zero-link":
        os.symlink("/dev/zero", p)
    elif kind == "link-outside":
        (tmp_path / "big").write_bytes(b"x" * 5000)
        os.symlink(str(tmp_path / "big"), p)
    elif kind == "directory":
        os.mkdir(p)
    else:  # far larger than signed: never read past the signed size
        with open(p, "wb") as f:
            f.truncate(1 << 40)  # sparse: 1 TiB of zeros
    verdict = _load_in_child(path, timeout=60)
    assert verdict.startswith("REFUSED SnapshotCorruptedError") and pages in verdict, verdict


def test_fifo_bundle_json_and_pickle_payload_are_refused(tmp_path):
    path = _bundle(tmp_path)
    os.rename(os.path.join(path, "bundle.json"), str(tmp_path / "saved.json"))
    os.mkfifo(os.path.join(path, "bundle.json"))
    verdict = _load_in_child(path)
    assert verdict.startswith(("REFUSED BundleError", "REFUSED BundleDamagedError")) and "FIFO" in verdict, verdict

    env = gym_fork.make("CartPole-v1", backend="pickle")
    try:
        env.reset(seed=0)
        ppath = env.snapshot().save(str(tmp_path / "p"))
    finally:
        env.close()
    os.unlink(os.path.join(ppath, "payload.pkl"))
    os.mkfifo(os.path.join(ppath, "payload.pkl"))
    verdict = _load_in_child(ppath)
    assert verdict.startswith("REFUSED SnapshotCorruptedError"), verdict


def test_extra_unsigned_images_are_refused(tmp_path, capsys):
    path = _bundle(tmp_path)
    with open(os.path.join(path, "images", "pages-99.img"), "wb") as f:
        f.write(b"\0" * 4096)
    with pytest.raises((BundleError, SnapshotCorruptedError), match="pages-99.img"):
        gym_fork.load_snapshot(path)
    os.unlink(os.path.join(path, "images", "pages-99.img"))
    os.symlink("/etc/passwd", os.path.join(path, "images", "evil.img"))
    with pytest.raises((BundleError, SnapshotCorruptedError), match="evil.img"):
        gym_fork.load_snapshot(path)
    os.unlink(os.path.join(path, "images", "evil.img"))
    assert gym_fork.load_snapshot(path).steps == 7

    # a store entry: load, restore and `snapshots inspect --verify` all refuse it
    st = SnapshotStore(tmp_path / "store")
    env = gym_fork.ForkableEnv("CartPole-v1", backend="criu", store=st)
    try:
        env.reset(seed=2)
        s = env.snapshot()
        st.put(s)
        with open(os.path.join(st.snapshot_dir(s.id), "images", "pages-99.img"), "wb") as f:
            f.write(b"\0" * 4096)
        assert cli.main(["snapshots", "inspect", str(st.path), s.id, "--verify"]) == 1
        assert "pages-99.img" in capsys.readouterr().err
        fresh = SnapshotStore(tmp_path / "store").load(s.id)
        with pytest.raises(SnapshotCorruptedError, match="pages-99.img"):
            env.restore(fresh)
        with pytest.raises(SnapshotCorruptedError, match="pages-99.img"):
            env.restore(s)
        env.step(0)  # the env keeps running
    finally:
        env.close()
