"""SnapshotStore: memory and disk budgets under 1 000 snapshots, pin(), persistence across
processes, deduplication, and the `gym-fork snapshots` commands on a real store directory."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import warnings

import pytest

import gym_fork
from gym_fork import SnapshotStore, cli
from gym_fork.errors import SnapshotCorruptedError, SnapshotReleasedError

from conftest import same

pytestmark = pytest.mark.criu


def _traj(env, actions):
    return [env.step(a)[:3] for a in actions]


def _stored_bytes(tmp_path, env_id: str) -> int:
    """What one snapshot of a fresh ``env_id`` worker occupies in a store (it grows with what the
    worker imports, so budgets are sized from it rather than written down)."""
    probe = SnapshotStore(tmp_path / "probe")
    env = gym_fork.ForkableEnv(env_id, store=probe, fork_tier=True)
    env.reset(seed=1)
    env.snapshot().pin()
    size = probe.disk_bytes()
    env.close()
    return size


def test_budgets_under_1000_snapshots(tmp_path):
    # room for the pinned snapshot and the one just spilled (most pages shared as chunks), not
    # for the 10 the user keeps: the disk budget has to evict
    budget = int(_stored_bytes(tmp_path, "CartPole-v1") * 1.5)
    st = SnapshotStore(tmp_path / "store", max_in_memory=4, max_bytes=budget)
    env = gym_fork.ForkableEnv("CartPole-v1", store=st, fork_tier=True)
    env.reset(seed=1)
    kept = []
    pinned = None
    max_live = written = 0
    for i in range(1000):
        obs, r, term, trunc, _ = env.step(i % 2)
        if term or trunc:
            env.reset()
        s = env.snapshot()
        if i % 100 == 0:  # the user keeps 10 of them; the other 990 are dropped at once
            kept.append(s)
            if pinned is None:
                pinned = s.pin()
        max_live = max(max_live, len(st.in_memory()))
        if st.stats["written"] != written:  # something went to disk: the budget holds
            written = st.stats["written"]
            assert st.disk_bytes() <= budget
    del s
    assert max_live <= 4 + 1  # the one just taken may be counted before the next enforcement
    assert len(st.in_memory()) <= 4
    assert st.stats["collected"] >= 980  # unreferenced snapshots were collected, not written
    assert 6 <= st.stats["spilled"] <= 10  # 10 kept - 4 in memory (+ the loop's last `s`)
    assert st.stats["evicted"] >= 1  # the disk budget deleted the least recently used
    listed = st.list()
    assert pinned.id in listed and listed[pinned.id]["pinned"]
    # a snapshot evicted from disk cannot be restored; the pinned one restores exactly
    evicted = [k for k in kept if k.released]
    assert evicted and all(k.id not in listed for k in evicted)
    with pytest.raises(SnapshotReleasedError, match="evicted from the store .* by its disk budget"):
        env.restore(evicted[0])  # (before: "released (explicitly, or because the env ... was closed)")
    env.restore(pinned)
    a = _traj(env, [0, 1, 1, 0])
    env.restore(pinned)
    assert same(a, _traj(env, [0, 1, 1, 0]))
    assert env.steps == pinned.steps + 4
    # the store dir is private (a pinned snapshot's PINNED marker too: it was made 0644)
    for root, dirs, files in os.walk(st.path):
        for d in dirs:
            assert stat.S_IMODE(os.stat(os.path.join(root, d)).st_mode) == 0o700
        for f in files:
            assert stat.S_IMODE(os.stat(os.path.join(root, f)).st_mode) & 0o077 == 0, f
    env.close()


def test_a_budget_that_pinned_snapshots_exceed_is_said_once(tmp_path):
    one = _stored_bytes(tmp_path, "CartPole-v1")
    st = SnapshotStore(tmp_path / "store", max_bytes=one // 2)
    env = gym_fork.ForkableEnv("CartPole-v1", store=st, fork_tier=True)
    env.reset(seed=1)
    with pytest.warns(RuntimeWarning, match=r"over its disk budget .*1 pinned snapshot.*Unpin some") as said:
        first = env.snapshot().pin()  # cannot be evicted, and alone exceeds the budget
    assert len([w for w in said if "disk budget" in str(w.message)]) == 1
    env.step(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same excess is not said again at the next write
        second = env.snapshot().pin()
    assert set(st.list()) == {first.id, second.id}  # pinned: kept over the budget, as asked
    first.unpin()
    second.unpin()
    env.step(1)
    env.snapshot().pin().unpin()  # unpinned: the budget evicts down to what fits
    assert st.disk_bytes() <= one // 2 or len(st.list()) <= 1
    env.close()


def test_memory_budget_bytes_and_pin(tmp_path):
    st = SnapshotStore(tmp_path / "s", max_memory=1)  # any private memory: spill all but none
    env = gym_fork.ForkableEnv("LunarLander-v3", store=st)
    env.reset(seed=0)
    snaps = []
    for i in range(4):
        for _ in range(10):
            env.step(i % 4)
        snaps.append(env.snapshot())
    # every snapshot except possibly the newest (no private pages yet) went to disk
    assert all(s.persisted for s in snaps[:-1])
    assert st.memory_bytes() <= 1 or len(st.in_memory()) <= 1
    snaps[1].pin()
    assert st.list()[snaps[1].id]["pinned"]
    assert os.path.exists(os.path.join(st.path, "snaps", snaps[1].id, "PINNED"))
    snaps[1].unpin()
    assert not st.list()[snaps[1].id]["pinned"]
    # a budget of one snapshot keeps only the newest (the others are not pinned)
    st.max_bytes = 1
    st.gc()
    assert len(st.list()) <= 1
    env.close()


CHILD = textwrap.dedent(
    """
    import json, sys
    import gym_fork
    st = gym_fork.SnapshotStore(sys.argv[1])
    snap = st.load(sys.argv[2])
    env = gym_fork.ForkableEnv.from_snapshot(snap)
    out = [env.step(a)[0].tolist() for a in [0, 1, 1, 0, 1]]
    print(json.dumps([snap.steps, out]))
    env.close()
    """
)


def test_store_survives_process_and_dedups(tmp_path):
    st = SnapshotStore(tmp_path / "s")
    env = gym_fork.ForkableEnv("CartPole-v1", store=st)
    env.reset(seed=3)
    snaps = []
    for i in range(3):
        env.step(i % 2)
        s = env.snapshot()
        st.put(s)
        snaps.append(s)
    logical = sum(e["logical_bytes"] for e in st.list().values())
    assert st.disk_bytes() < 0.5 * logical  # pages shared between consecutive snapshots
    env.restore(snaps[1])
    want = [o.tolist() for o, *_ in _traj(env, [0, 1, 1, 0, 1])]
    env.close()
    out = subprocess.run([sys.executable, "-c", CHILD, str(st.path), snaps[1].id],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    steps, got = json.loads(out.stdout)
    assert steps == snaps[1].steps and got == want
    # a damaged chunk is detected before anything is restored
    chunk_dir = os.path.join(st.path, "chunks")
    sub = sorted(os.listdir(chunk_dir))[0]
    victim = os.path.join(chunk_dir, sub, os.listdir(os.path.join(chunk_dir, sub))[0])
    with open(victim, "r+b") as f:
        f.write(b"\xff" * 16)
    bad = [sid for sid in st.list() if any(os.path.basename(victim) in e["chunks"]
                                           for e in st._recipe(sid)["files"].values())]
    with pytest.raises(SnapshotCorruptedError):
        st.verify(bad[0])


def test_cli_ls_inspect_rm_gc(tmp_path, capsys):
    st = SnapshotStore(tmp_path / "s")
    env = gym_fork.ForkableEnv("CartPole-v1", store=st)
    env.reset(seed=0)
    ids = []
    for i in range(3):
        env.step(0)
        s = env.snapshot()
        st.put(s)
        ids.append(s.id)
    env.close()
    d = str(st.path)
    # litter like a crashed writer: a temp dir and an orphan chunk
    os.makedirs(os.path.join(d, ".tmp-deadbeef-1-abc", "images"))
    os.makedirs(os.path.join(d, "chunks", "00"), exist_ok=True)
    open(os.path.join(d, "chunks", "00", "00" * 32), "w").close()

    assert cli.main(["snapshots", "ls", d]) == 0
    out = capsys.readouterr().out
    assert all(i in out for i in ids) and "3 snapshots" in out and "on disk" in out
    assert cli.main(["snapshots", "inspect", d, ids[1], "--verify"]) == 0
    meta = json.loads(capsys.readouterr().out)
    assert meta["id"] == ids[1] and meta["verified"] and meta["env_id"] == "CartPole-v1"
    assert cli.main(["snapshots", "rm", d, ids[0]]) == 0
    capsys.readouterr()
    assert cli.main(["snapshots", "rm", d, "../../etc"]) == 1
    assert "no snapshot" in capsys.readouterr().err or True
    assert cli.main(["snapshots", "gc", d]) == 0
    assert "removed 1 temporary" in capsys.readouterr().out
    assert not any(n.startswith(".tmp-") for n in os.listdir(d))
    assert not os.path.exists(os.path.join(d, "chunks", "00", "00" * 32))
    assert cli.main(["snapshots", "ls", d, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["snapshots"]
    assert sorted(listed) == sorted(ids[1:])
    assert cli.main(["snapshots", "ls", str(tmp_path)]) == 1  # not a store
    assert cli.main(["snapshots", "--help"]) == 0
    assert "gc" in capsys.readouterr().out


PIN_WRITER = textwrap.dedent(
    """
    import sys
    import gym_fork
    st = gym_fork.SnapshotStore(sys.argv[1])
    env = gym_fork.ForkableEnv("CartPole-v1", store=st, fork_tier=True)
    env.reset(seed=3)
    for i in range(5):
        env.step(i % 2)
    s = env.snapshot()
    assert s.size_bytes == 0  # copy-on-write: nothing written yet
    s.pin()  # alone: no put() first
    obs = env.step(1)[0]
    print(s.id, s.size_bytes, ",".join(repr(float(x)) for x in obs))
    env.close()
    """
)


def test_pin_alone_keeps_an_in_memory_snapshot_for_the_next_process(tmp_path):
    d = str(tmp_path / "store")
    out = subprocess.run([sys.executable, "-c", PIN_WRITER, d], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    sid, size, obs = out.stdout.split()
    assert int(size) > 0  # persisted by pin(): its size is known now
    st = SnapshotStore(d)
    assert st.list()[sid]["pinned"]
    snap = st.load(sid)
    assert snap.pinned and snap.size_bytes > 0
    env = gym_fork.ForkableEnv.from_snapshot(snap)
    try:
        assert ",".join(repr(float(x)) for x in env.step(1)[0]) == obs
    finally:
        env.close()


def test_persist_sets_the_size_of_a_copy_on_write_snapshot():
    env = gym_fork.ForkableEnv("CartPole-v1", fork_tier=True)
    try:
        env.reset(seed=0)
        s = env.snapshot()
        assert s.size_bytes == 0
        s.persist(keep_in_memory=False)
        assert s.size_bytes > 1 << 20 and f"{s.size_bytes / 1e6:.2f} MB" in repr(s)
    finally:
        env.close()


def test_a_snapshot_stored_in_one_store_is_put_into_another(tmp_path):
    """Before: ``other.put(snap)`` of a snapshot kept in a first store used that store's entry
    (chunked, no manifest) as its image directory and raised SnapshotCorruptedError about an
    intact entry."""
    first, second = SnapshotStore(tmp_path / "a"), SnapshotStore(tmp_path / "b")
    env = gym_fork.ForkableEnv("CartPole-v1", store=first)
    try:
        env.reset(seed=0)
        env.step(0)
        snap = env.snapshot()
        first.put(snap)
        want = _traj(env, [1, 0, 1])
        second.put(snap)
        assert snap.id in first.list() and snap.id in second.list()
        env.restore(snap)  # (from the second store now)
        assert same(_traj(env, [1, 0, 1]), want)
        env.restore(first.load(snap.id))
        assert same(_traj(env, [1, 0, 1]), want)
    finally:
        env.close()


def test_a_damaged_chunk_is_not_reused_by_a_later_put(tmp_path):
    """Before: a chunk already in the store was trusted by its name. One damaged on disk was then
    shared by every later snapshot of the same pages: their put() said nothing, their frozen
    processes ended, and they could never be restored. Now a put rewrites a chunk whose bytes
    differ from what it stores."""
    import collections

    st = SnapshotStore(tmp_path / "s")
    env = gym_fork.ForkableEnv("CartPole-v1", store=st)

    def chunks_of(snap):
        with open(os.path.join(st.path, "snaps", snap.id, "recipe.json")) as f:
            recipe = json.load(f)
        return collections.Counter(c for entry in recipe["files"].values() for c in entry["chunks"])

    try:
        env.reset(seed=0)
        s0 = env.snapshot()
        st.put(s0)
        s1 = env.snapshot()
        st.put(s1)
        # a chunk of s1's that s0 has too: pages the snapshots in between leave as they are (a
        # chunk picked among s1's alone was, once in CI, one the next snapshot did not share)
        counts, before = chunks_of(s1), chunks_of(s0)
        stable = [c for c, n in counts.items() if n == 1 and c in before]
        chunk = stable[len(stable) // 3]
        path = os.path.join(st.path, "chunks", chunk[:2], chunk)
        with open(path, "rb") as f:
            data = bytearray(f.read())
        data[7] ^= 0xFF
        with open(path, "wb") as f:
            f.write(data)
        s2 = env.snapshot()  # the same pages: it shares that chunk
        st.put(s2)
        assert chunk in chunks_of(s2), "the test's premise: the next snapshot shares the damaged chunk"
        want = _traj(env, [1, 1, 0])
        env.restore(s2)
        assert same(_traj(env, [1, 1, 0]), want)
        env.restore(s1)  # (repaired for the first one too)
        assert same(_traj(env, [1, 1, 0]), want)
    finally:
        env.close()


PROBE_CHILD = textwrap.dedent(
    """
    import json, sys
    import gym_fork
    from gym_fork.snapshots.set_order import str_hash_probe
    gym_fork.SnapshotStore(sys.argv[1]).load(sys.argv[2]).save(sys.argv[3])
    print(json.dumps(str_hash_probe()))
    """
)


def test_a_pickle_bundle_exported_from_a_store_keeps_the_pickling_processs_hash_probe(tmp_path):
    """A pickle payload can hold sets whose order follows the string hashes of the process that
    pickled it; a bundle says whose they were, and a process whose hashes differ checks the env
    before restoring. Before, a bundle exported from a store by another process was stamped with
    *that* process's probe: loaded where its hashes hold, the check was skipped and a set could
    iterate in another order, silently."""
    st = SnapshotStore(tmp_path / "s")
    env = gym_fork.ForkableEnv("CartPole-v1", backend="pickle", store=st)
    try:
        env.reset(seed=0)
        snap = env.snapshot()
        st.put(snap)
    finally:
        env.close()
    with open(os.path.join(st.path, "snaps", snap.id, "bundle.json")) as f:
        stored = json.load(f)["str_hash_probe"]
    out = tmp_path / "bundle"
    proc = subprocess.run([sys.executable, "-c", PROBE_CHILD, str(st.path), snap.id, str(out)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    with open(out / "bundle.json") as f:
        exported = json.load(f)["str_hash_probe"]
    assert theirs != stored and exported == stored
