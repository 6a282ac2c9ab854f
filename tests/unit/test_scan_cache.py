"""The worker's scan for what fork() cannot copy skips its /proc reads when nothing changed since
a scan that found nothing -- and never misses a change (gym_fork.worker.resources)."""

import json
import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(r'''
    import json, mmap, os, subprocess, sys, threading, time
    from gym_fork.worker import resources as R

    def kinds():
        return sorted(r.kind for r in R.fork_blockers({0}).resources)

    nul = os.open("/dev/null", os.O_RDONLY)
    os.dup2(nul, 5)
    os.close(nul)
    out = {}
    out["clean"] = kinds()
    out["clean_again"] = kinds()  # from the fingerprint
    out["cached"] = R._last_clean is not None
    d = sys.argv[1]
    f = open(os.path.join(d, "w.txt"), "w")
    out["file_open"] = kinds()
    f.close()
    out["file_closed"] = kinds()
    r = open(os.path.join(d, "w.txt"))
    out["read_only"] = kinds()
    r.close()
    # the same descriptor number, now another file opened for writing
    w = os.open(os.path.join(d, "x.txt"), os.O_WRONLY | os.O_CREAT)
    os.dup2(w, 5)
    os.close(w)
    out["dup2_same_number"] = kinds()
    nul = os.open("/dev/null", os.O_RDONLY)
    os.dup2(nul, 5)
    os.close(nul)
    out["null_back"] = kinds()
    ev = threading.Event()
    t = threading.Thread(target=ev.wait)
    t.start()
    out["thread"] = kinds()
    ev.set(); t.join()
    time.sleep(0.05)
    out["thread_gone"] = kinds()
    m = mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED)
    out["shared_map"] = kinds()
    m.close()
    out["map_gone"] = kinds()
    p = subprocess.Popen(["sleep", "30"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, close_fds=True)
    out["child"] = kinds()
    p.kill(); p.wait()
    out["child_gone"] = kinds()
    with open(os.path.join(d, "out.json"), "w") as f:
        json.dump(out, f)
''')


def test_the_fingerprint_never_hides_a_change(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], check=True, env=env, timeout=60,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   start_new_session=True)
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["clean"] == [] and out["clean_again"] == [] and out["cached"]
    assert out["file_open"] == ["file"] and out["file_closed"] == []
    assert out["read_only"] == ["file"]
    assert out["dup2_same_number"] == ["file"] and out["null_back"] == []
    assert out["thread"] == ["thread"] and out["thread_gone"] == []
    assert out["shared_map"] == ["shared-memory"] and out["map_gone"] == []
    assert "child" in out["child"] and out["child_gone"] == []


RELEASED = textwrap.dedent(r'''
    import json, os, sys, time
    from gym_fork.worker import resources as R

    forked = set()
    for _ in range(3):  # frozen snapshots of this process, released: they exited, unreaped
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        forked.add(pid)
    time.sleep(0.2)
    reads = []
    real = R._status
    R._status = lambda *a, **k: reads.append(a) or real(*a, **k)
    scan = R.fork_blockers({0, 1, 2}, forked)
    left = [p for p in forked]
    zombies = []
    for tid in os.listdir("/proc/self/task"):
        try:  # (a thread may end between the listing and the open)
            with open(f"/proc/self/task/{tid}/children") as f:
                zombies += f.read().split()
        except FileNotFoundError:
            continue
    with open(sys.argv[1], "w") as f:
        json.dump({"status_reads": len(reads), "forked_left": left, "children_left": zombies,
                   "fork_processes": scan.fork_processes}, f)
''')


def test_a_scan_collects_released_snapshots_before_looking_at_the_children(tmp_path):
    """Frozen snapshots that were released exited and wait to be collected: the scan collects
    them first (waitpid), so it finds no children at all and reads no process's status -- not
    one /proc read per child for processes that are gone."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    out_path = tmp_path / "out.json"
    subprocess.run([sys.executable, "-c", RELEASED, str(out_path)], check=True, env=env, timeout=60,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   start_new_session=True)
    out = json.loads(out_path.read_text())
    assert out["forked_left"] == [] and out["children_left"] == [] and out["fork_processes"] == []
    assert out["status_reads"] == 0


def test_a_childs_host_pid_comes_from_its_pidfd_and_matches_the_status_scan():
    """Inside a PID namespace (a worker's), a child's pid as /proc names it is read from a pidfd's
    NSpid in a few system calls, not by reading every child's status: same answer, for each of
    several children."""
    import ctypes
    import time

    import pytest
    from conftest import run_in_child

    from gym_fork.worker import exits, resources

    if os.geteuid() != 0:
        pytest.skip("a PID namespace needs root here")

    def in_a_new_pid_namespace() -> bytes:
        if ctypes.CDLL(None, use_errno=True).unshare(0x20000000) != 0:  # CLONE_NEWPID
            raise OSError(ctypes.get_errno(), "unshare")
        init = os.fork()
        if init:
            os.waitpid(init, 0)
            return b""
        kids = []  # PID 1 of the new namespace from here on
        for _ in range(8):
            k = os.fork()
            if k == 0:
                time.sleep(30)
                os._exit(0)
            kids.append(k)
        level = resources._own_level()
        by_scan = {}
        for p in resources._children("self"):
            st = resources._status(p, level)
            if st is not None:
                by_scan[st[2]] = p
        res = {"level": level, "kids": kids, "pidfd": [exits.pid_via_pidfd(k) for k in kids],
               "host": [resources.host_pid_of_child(k) for k in kids], "scan": [by_scan.get(k) for k in kids]}
        for k in kids:
            os.kill(k, 9)
            os.waitpid(k, 0)
        return json.dumps(res).encode()

    data = run_in_child(in_a_new_pid_namespace)
    res = json.loads(data)
    assert res["level"] == 1 and res["kids"] == list(range(2, 10))  # pids as the namespace sees them
    assert None not in res["scan"] and all(p > 10 for p in res["scan"])  # host pids
    assert res["pidfd"] == res["scan"] and res["host"] == res["scan"]
