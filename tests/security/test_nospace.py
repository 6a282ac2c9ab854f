"""A full disk: store writes, bundle saves, spills under a memory budget and CRIU dumps into the
session directory raise NoSpaceError with the numbers, leave nothing half-written behind (a
failed store write removes the chunks it created), and the env keeps working; once space is
freed, everything works again.  Real small tmpfs mounts (root), unmounted after."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import gym_fork
from gym_fork import SnapshotStore
from gym_fork.errors import NoSpaceError

pytestmark = pytest.mark.criu


@contextlib.contextmanager
def tmpfs(path, size: str):
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], check=True)
    try:
        yield str(path)
    finally:
        if subprocess.run(["umount", str(path)]).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)


def fill(path: str, leave: int) -> str:
    """Write a filler file until only about ``leave`` bytes are free on ``path``'s file system."""
    filler = os.path.join(path, "filler")
    v = os.statvfs(path)
    with open(filler, "wb") as f:
        try:
            f.write(b"\0" * max(v.f_bavail * v.f_frsize - leave, 0))
        except OSError:
            pass
    return filler


def _chunks(store_dir: str) -> set[str]:
    return {n for _, _, fs in os.walk(os.path.join(store_dir, "chunks")) for n in fs}


def _leftovers(d: str) -> list[str]:
    return [n for n in os.listdir(d) if n.startswith(".tmp-") or ".tmp-" in n]


def test_store_put_save_and_spill_on_a_full_disk(tmp_path):
    with tmpfs(tmp_path / "small", "64m") as small:
        st = SnapshotStore(os.path.join(small, "store"))
        other = gym_fork.ForkableEnv("Acrobot-v1", backend="criu", fork_tier=True, store=st)
        env = gym_fork.ForkableEnv("CartPole-v1", backend="criu", fork_tier=True, store=st)
        try:
            other.reset(seed=0)
            first = other.snapshot()
            st.put(first)  # fits
            before = _chunks(st.path)
            # room for the small images, not for the pages (another env: few chunks in common)
            filler = fill(small, 2 << 20)
            env.reset(seed=0)
            second = env.snapshot()
            with pytest.raises(NoSpaceError, match="bytes free") as exc:
                st.put(second)
            assert exc.value.free_bytes is not None and exc.value.path
            assert _chunks(st.path) == before, "the failed put left its chunks behind"
            assert not _leftovers(st.path) and sorted(st.list()) == [first.id]
            obs_after = env.step(1)[0]
            env.restore(second)  # still restorable (from the images it was persisted to)
            assert np.array_equal(env.step(1)[0], obs_after)

            with pytest.raises(NoSpaceError):
                second.save(os.path.join(small, "bundle"))
            assert not any(n.startswith("bundle") for n in os.listdir(small))

            st.max_in_memory = 1  # every new snapshot now spills the older one
            third = env.snapshot()
            with pytest.raises(NoSpaceError, match="memory budget"):
                env.snapshot()
            assert not third.released and env.step(0) is not None
            fourth = env.snapshot()  # third is out of memory now: nothing to spill, no error
            with pytest.raises(NoSpaceError):  # but fourth has to go, and cannot
                env.snapshot()
            os.unlink(filler)  # space again: everything works
            fifth = env.snapshot()
            sixth = env.snapshot()
            assert fifth.id in st.list() and not sixth.released
            other.restore(first)
            env.restore(third)
            env.restore(fourth)
            st.put(third)
            st.put(second)
            assert second.id in st.list() and st.verify(second.id)["id"] == second.id
        finally:
            env.close()
            other.close()
            del st


SESSION_FULL = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import gym_fork
    from gym_fork.errors import NoSpaceError
    env = gym_fork.ForkableEnv("CartPole-v1", backend="criu", fork_tier=True)
    env.reset(seed=1)
    s = env.snapshot()  # copy-on-write: no disk
    out = {}
    try:
        s.persist()
        out["persist"] = "ok"
    except NoSpaceError as e:
        out["persist"] = "NoSpaceError"
        out["msg"] = str(e)
    except Exception as e:
        out["persist"] = type(e).__name__
    obs = env.step(0)[0]
    env.restore(s)
    out["same"] = bool(np.array_equal(env.step(0)[0], obs))
    out["snapshot_after"] = env.snapshot().id is not None
    env.close()
    print(json.dumps(out))
    """
)


def test_criu_dump_into_a_full_session_dir(tmp_path):
    with tmpfs(tmp_path / "sess", "8m") as sess:
        r = subprocess.run([sys.executable, "-c", SESSION_FULL], capture_output=True, text=True, timeout=180,
                           env=dict(os.environ, GYM_FORK_DIR=sess))
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["persist"] == "NoSpaceError", out
        assert "bytes free" in out["msg"]
        assert out["same"] and out["snapshot_after"]
        leftovers = [n for _, ds, fs in os.walk(sess) for n in ds + fs if n.startswith(".") and n.endswith(".tmp")]
        assert not leftovers
