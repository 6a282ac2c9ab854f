"""A damaged (or altered) store entry must not brick the store or silently lose data: it is moved
into DIR/quarantine/ with the reason, `gym-fork snapshots ls` lists it, the other entries keep
working, and every malformed field of a bundle.json is a typed BundleError.  Real CRIU, real
store directories."""

from __future__ import annotations

import json
import os

import pytest

import gym_fork
from gym_fork import SnapshotStore, cli, keys
from gym_fork.errors import BundleError, StoreError
from gym_fork.snapshots.bundle import canonical_meta

pytestmark = pytest.mark.criu


@pytest.fixture(autouse=True)
def _private_key(tmp_path, monkeypatch):
    monkeypatch.setenv("GYM_FORK_KEY_FILE", str(tmp_path / "key"))
    monkeypatch.delenv("GYM_FORK_KEY", raising=False)


def _store(tmp_path, n: int = 3) -> tuple[SnapshotStore, list[str]]:
    st = SnapshotStore(tmp_path / "store")
    env = gym_fork.ForkableEnv("CartPole-v1", backend="criu", fork_tier=False, store=st)
    try:
        env.reset(seed=4)
        ids = []
        for i in range(n):
            env.step(i % 2)
            s = env.snapshot()
            st.put(s)
            ids.append(s.id)
        return st, ids
    finally:
        env.close()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _ls(d: str, capsys) -> str:
    assert cli.main(["snapshots", "ls", d]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("forget_index", [False, True])
@pytest.mark.parametrize("damage", ["[]", "{not json", '{"format": 1, "id": 5}', ""])
def test_a_damaged_entry_is_quarantined_and_listed(tmp_path, capsys, damage, forget_index):
    st, (a, b, c) = _store(tmp_path)
    d = str(st.path)
    entry = st.snapshot_dir(a)
    files_before = sorted(os.listdir(os.path.join(entry, "images")))
    _write(os.path.join(entry, "bundle.json"), damage)
    if forget_index:  # the index is a cache: a crash or a copy of the directory loses it
        os.unlink(os.path.join(d, "index.json"))
    out = _ls(d, capsys)
    assert b in out and c in out and "2 snapshots" in out
    assert f"DAMAGED {a}" in out, out
    q = SnapshotStore(d).damaged()
    assert [e["id"] for e in q] == [a] and q[0]["reason"]
    # nothing deleted: the entry's files are all in quarantine
    assert sorted(os.listdir(os.path.join(q[0]["path"], "images"))) == files_before
    assert not os.path.exists(entry)
    # the rest of the store works: rm, load, restore, gc (which keeps the quarantined entry)
    assert cli.main(["snapshots", "rm", d, b]) == 0
    fresh = SnapshotStore(d)
    env = gym_fork.ForkableEnv.from_snapshot(fresh.load(c))
    try:
        env.step(0)
    finally:
        env.close()
    with pytest.raises(StoreError):
        fresh.load(a)
    assert cli.main(["snapshots", "gc", d]) == 0
    assert "1 damaged entries in quarantine" in capsys.readouterr().out
    assert os.path.isdir(q[0]["path"])
    assert cli.main(["snapshots", "gc", d, "--drop-quarantined"]) == 0
    assert f"deleted quarantined entry {q[0]['path']}" in capsys.readouterr().out
    assert not os.path.exists(q[0]["path"]) and SnapshotStore(d).damaged() == []


def _resign(path: str, **changes) -> None:
    meta = json.load(open(os.path.join(path, "bundle.json")))
    meta.update(changes)
    meta["hmac"] = keys.sign(canonical_meta(meta))
    _write(os.path.join(path, "bundle.json"), json.dumps(meta))


def test_every_malformed_field_is_a_bundle_error(tmp_path):
    env = gym_fork.make("CartPole-v1", backend="criu", fork_tier=False)
    try:
        env.reset(seed=0)
        path = env.snapshot().save(str(tmp_path / "b"))
    finally:
        env.close()
    good = open(os.path.join(path, "bundle.json")).read()
    meta = json.loads(good)
    _write(os.path.join(path, "bundle.json"), json.dumps(dict(meta, hmac=5)))
    with pytest.raises(BundleError, match="hmac"):
        gym_fork.load_snapshot(path)
    # fields signed with the right key but of the wrong type (a key holder's bug, or damage
    # before signing): refused by name, never a TypeError/AttributeError/KeyError
    for field, value in [("steps", "12"), ("steps", True), ("images", []), ("images", {"core-1.img": 3}),
                         ("images", {"../x": {"size": 1, "sha256": "0" * 64}}), ("files", "x"),
                         ("files", [["/bin/sh"]]), ("ino", "1"), ("id", 7), ("id", "../../x"),
                         ("actions", "x"), ("workspace", []), ("created", None), ("backend", 3),
                         ("criu_version", None)]:
        _write(os.path.join(path, "bundle.json"), good)
        _resign(path, **{field: value})
        with pytest.raises(BundleError):
            gym_fork.load_snapshot(path)
    for field in ("steps", "images", "ino", "backend"):
        _write(os.path.join(path, "bundle.json"), good)
        m = dict(meta)
        del m[field]
        m["hmac"] = keys.sign(canonical_meta(m))
        _write(os.path.join(path, "bundle.json"), json.dumps(m))
        with pytest.raises(BundleError):
            gym_fork.load_snapshot(path)
    _write(os.path.join(path, "bundle.json"), good)
    assert gym_fork.load_snapshot(path).steps == 0


def test_damaged_recipe_and_index_do_not_stop_the_store(tmp_path, capsys):
    st, (a, b, c) = _store(tmp_path)
    d = str(st.path)
    _write(os.path.join(st.snapshot_dir(a), "recipe.json"), '{"files": {"pages-1.img": {"size": "x"}}}')
    _write(os.path.join(d, "index.json"), '{"format": 1, "snapshots": {"%s": {"last_used": "yesterday"}}}' % b)
    st2 = SnapshotStore(d, max_bytes=1 << 40)
    env = gym_fork.ForkableEnv("CartPole-v1", backend="criu", fork_tier=False, store=st2)
    try:  # writing more (which counts every entry's chunks for the disk budget) keeps working
        env.reset(seed=1)
        st2.put(env.snapshot())
    finally:
        env.close()
    out = _ls(d, capsys)
    assert f"DAMAGED {a}" in out and "recipe.json" in out and "3 snapshots" in out
    chunks = sum(len(fs) for _, _, fs in os.walk(os.path.join(d, "chunks")))
    # the quarantined entry's chunks cannot be told from garbage: gc keeps them all, and says so
    assert cli.main(["snapshots", "gc", d]) == 0
    assert "kept unreferenced chunks" in capsys.readouterr().out
    assert sum(len(fs) for _, _, fs in os.walk(os.path.join(d, "chunks"))) == chunks
    assert SnapshotStore(d).verify(c)["id"] == c
    assert cli.main(["snapshots", "gc", d, "--drop-quarantined"]) == 0
    assert "deleted quarantined entry" in capsys.readouterr().out
    with pytest.raises(StoreError):
        st2.load(a)
