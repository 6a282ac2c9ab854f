"""Crash safety of the SnapshotStore: a writer process putting snapshots into a store is killed
with SIGKILL at random moments (and the criu process it runs is killed mid-dump); afterwards every
visible snapshot loads and verifies, gc removes the leftovers and the index matches."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import gym_fork
from gym_fork import SnapshotStore
from gym_fork.criu.client import _kill_criu

pytestmark = pytest.mark.criu

WRITER = textwrap.dedent(
    """
    import sys
    import gym_fork
    st = gym_fork.SnapshotStore(sys.argv[1])
    env = gym_fork.ForkableEnv("CartPole-v1", store=st, fork_tier=True)
    env.reset(seed=int(sys.argv[2]))
    print("ready", flush=True)
    i = 0
    while True:
        _, _, term, trunc, _ = env.step(i % 2)
        if term or trunc:
            env.reset()
        s = env.snapshot()
        print("begin", s.id, flush=True)
        try:
            st.put(s)
            print("done", s.id, flush=True)
        except Exception as e:
            print("fail", s.id, type(e).__name__, flush=True)
        s.release()
        i += 1
    """
)


def _children(pid: int) -> list[tuple[int, str]]:
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                st = f.read()
        except OSError:
            continue
        comm = st[st.index("(") + 1: st.rindex(")")]
        ppid = int(st[st.rindex(")") + 2:].split()[1])
        if ppid == pid:
            out.append((int(name), comm))
    return out


class Writer:
    def __init__(self, store_dir: str, sess: str, seed: int):
        env = dict(os.environ, GYM_FORK_DIR=sess)
        self.p = subprocess.Popen([sys.executable, "-c", WRITER, store_dir, str(seed)], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True, env=env)
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            if line.startswith("ready"):
                self.ready.set()
            elif line.endswith("\n") and len(line.split()) >= 2:  # (not a line the kill cut short)
                self.lines.append(line.split())

    def kill(self) -> None:
        self.p.kill()
        self.p.wait()


def test_kill_9_during_50_snapshot_writes(tmp_path):
    rng = random.Random(7)
    store_dir, sess = str(tmp_path / "store"), str(tmp_path / "sess")
    SnapshotStore(store_dir)
    begun, done = set(), set()
    criu_kills = writer_kills = rounds = 0
    # until 50 writes began and the writer was killed 10 times, criu 3 times (how many writes a
    # round begins depends on the machine's speed: a fast one needed fewer rounds than asserted)
    while (len(begun) < 50 or writer_kills < 10 or criu_kills < 3) and rounds < 40:
        w = Writer(store_dir, sess, seed=rounds)
        assert w.ready.wait(60), "writer did not start"
        rounds += 1
        if rounds % 3 == 0:  # kill criu itself mid-dump, twice, then the writer
            deadline = time.monotonic() + 20
            kills = 0
            while kills < 2 and time.monotonic() < deadline:
                crius = [pid for pid, comm in _children(w.p.pid) if comm == "criu"]
                if crius:
                    time.sleep(rng.uniform(0, 0.05))
                    if os.path.exists(f"/proc/{crius[0]}"):
                        # SIGKILL, with the helper children criu would otherwise leave running
                        _kill_criu(crius[0])
                        kills += 1
                        criu_kills += 1
                    time.sleep(0.2)
                else:
                    time.sleep(0.002)
        time.sleep(rng.uniform(0.0, 1.5))
        w.kill()
        writer_kills += 1
        begun |= {ln[1] for ln in w.lines if ln[0] == "begin"}
        done |= {ln[1] for ln in w.lines if ln[0] == "done"}
    assert criu_kills >= 3 and writer_kills >= 10

    st = SnapshotStore(store_dir)  # opening reconciles the index with the snapshot directories
    out = st.gc()
    names = os.listdir(store_dir)
    assert not [n for n in names if n.startswith(".tmp-") or ".tmp-" in n]
    with open(os.path.join(store_dir, "index.json")) as f:
        index = json.load(f)["snapshots"]
    dirs = set(os.listdir(os.path.join(store_dir, "snaps")))
    assert set(index) == dirs
    assert done <= dirs <= begun  # every completed write is visible; nothing unannounced appears
    assert len(dirs) >= 5
    for sid in dirs:  # every visible snapshot is complete: HMAC, chunks, sha256 of every image
        st.verify(sid)
    # every chunk on disk is referenced, every referenced chunk is on disk
    refs = st._chunk_refs(dirs)
    on_disk = {n for sub in os.listdir(os.path.join(store_dir, "chunks"))
               for n in os.listdir(os.path.join(store_dir, "chunks", sub))}
    assert on_disk == set(refs)
    # and one really restores
    snap = st.load(sorted(dirs)[0])
    env = gym_fork.ForkableEnv.from_snapshot(snap)
    assert env.steps == snap.steps
    env.step(0)
    env.close()
    print(f"rounds={rounds} begun={len(begun)} done={len(done)} visible={len(dirs)} "
          f"criu_kills={criu_kills} gc={out}")
