"""The audit hook's classification of events into written paths (gym_fork.worker.files), on real
files in a temporary directory, recorded in-process with ``tracking`` (as the pickle backend does)."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading

import pytest

from gym_fork.worker import files

files.install(in_process=True)


def _record(fn) -> dict:
    rec = files.Record()
    with files.tracking(rec):
        fn()
    return rec.current()


def _write(path: str, mode: str = "w") -> None:
    with open(path, mode) as f:
        f.write("x")


def test_opens_for_writing_are_recorded_reads_are_not(tmp_path):
    old = str(tmp_path / "old.txt")
    _write(old)
    new = str(tmp_path / "new.txt")
    assert _record(lambda: open(old).close()) == {}
    assert _record(lambda: _write(new, "a")) == {new: files.CREATED}
    assert _record(lambda: _write(old, "r+")) == {old: files.MODIFIED}
    fd_path = str(tmp_path / "fd.bin")
    assert _record(lambda: os.close(os.open(fd_path, os.O_WRONLY | os.O_CREAT))) == {fd_path: files.CREATED}
    assert _record(lambda: os.close(os.open(old, os.O_RDONLY))) == {}


def test_relative_and_pathlike_paths_are_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.mkdir(tmp_path / "sub")
    assert _record(lambda: _write("rel.txt")) == {str(tmp_path / "rel.txt"): files.CREATED}
    assert _record(lambda: _write(tmp_path / "sub" / ".." / "p.txt")) == {str(tmp_path / "p.txt"): files.CREATED}
    assert _record(lambda: _write(os.fsencode(tmp_path / "b.txt"))) == {str(tmp_path / "b.txt"): files.CREATED}


def test_removals_renames_and_metadata(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _write(a)
    assert _record(lambda: os.replace(a, b)) == {a: files.MODIFIED, b: files.CREATED}
    assert _record(lambda: os.remove(b)) == {b: files.MODIFIED}
    _write(a)
    assert _record(lambda: os.chmod(a, 0o600)) == {a: files.MODIFIED}
    assert _record(lambda: os.utime(a)) == {a: files.MODIFIED}
    assert _record(lambda: os.truncate(a, 0)) == {a: files.MODIFIED}
    d = str(tmp_path / "d")
    f = os.path.join(d, "e", "f")
    # a directory the env makes is not reported by itself; what it writes there is
    assert _record(lambda: (os.makedirs(os.path.join(d, "e")), _write(f))) == {f: files.CREATED}
    assert _record(lambda: shutil.rmtree(d)) == {d: files.MODIFIED}  # one it did not make


def test_what_changes_nothing_is_not_recorded(tmp_path):
    d = str(tmp_path / "exists")
    os.mkdir(d)
    assert _record(lambda: os.makedirs(d, exist_ok=True)) == {}
    missing = str(tmp_path / "missing")

    def remove_missing():
        with pytest.raises(FileNotFoundError):
            os.remove(missing)
        shutil.rmtree(missing, ignore_errors=True)

    assert _record(remove_missing) == {}


def test_created_and_removed_again_leaves_no_trace(tmp_path):
    def scratch():
        fd, p = tempfile.mkstemp(dir=tmp_path)
        os.close(fd)
        os.replace(p, p + ".x")
        os.remove(p + ".x")
        with tempfile.NamedTemporaryFile(dir=tmp_path):
            pass
        with tempfile.TemporaryFile(dir=tmp_path) as f:  # O_TMPFILE: never has a name
            f.write(b"x")
        os.mkdir(tmp_path / "d")
        os.rmdir(tmp_path / "d")
        made = tempfile.mkdtemp(dir=tmp_path)  # a server's socket directory, say
        _write(os.path.join(made, "f"))
        shutil.rmtree(made)

    assert _record(scratch) == {}
    kept = str(tmp_path / "kept")
    assert _record(lambda: (_write(kept), os.remove(kept), _write(kept))) == {kept: files.CREATED}


def test_sqlite_databases(tmp_path):
    db = str(tmp_path / "x.db")
    assert _record(lambda: sqlite3.connect(":memory:").close()) == {}
    assert _record(lambda: sqlite3.connect("").close()) == {}
    assert _record(lambda: sqlite3.connect(db).close()) == {db: files.CREATED}  # connect creates the file
    assert _record(lambda: sqlite3.connect(f"file:{db}?mode=ro", uri=True).close()) == {}
    assert _record(lambda: sqlite3.connect(f"file:{db}", uri=True).close()) == {db: files.MODIFIED}


def test_ignored_places(tmp_path):
    ws = str(tmp_path / "ws")
    os.mkdir(ws)
    rec = files.Record()
    with files.tracking(rec):
        _write(os.path.join(ws, "before.txt"))  # written before the workspace was declared
        files.set_workspace(ws)
        _write(os.path.join(ws, "after.txt"))
        os.mkdir(os.path.join(ws, "sub"))
        _write(os.devnull)
        os.makedirs(tmp_path / "pkg" / "__pycache__")
        _write(str(tmp_path / "pkg" / "__pycache__" / "m.cpython-311.pyc"))
        fd = os.open(tmp_path / "viafd", os.O_WRONLY | os.O_CREAT)
        with open(fd, "w") as f:  # a descriptor: recorded when it was opened by name
            f.write("x")
    assert rec.current() == {str(tmp_path / "viafd"): files.CREATED}


def test_unix_socket_names_are_ignored(tmp_path):
    import socket

    path = str(tmp_path / "s.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)  # made outside the record (by a server process, say)
    try:
        assert _record(lambda: (os.chmod(path, 0o600), os.remove(path))) == {}
    finally:
        srv.close()


def test_only_the_tracking_thread_counts(tmp_path):
    other = str(tmp_path / "other.txt")
    rec = files.Record()
    with files.tracking(rec):
        t = threading.Thread(target=_write, args=(other,))
        t.start()
        t.join()
        _write(str(tmp_path / "mine.txt"))
    _write(str(tmp_path / "outside_the_block.txt"))
    assert rec.current() == {str(tmp_path / "mine.txt"): files.CREATED}


def test_outside_filters_workspace_and_untracked_patterns():
    record = {"/w/ws/a": files.CREATED, "/w/wsx/b": files.CREATED, "/tmp/logs/run/1.log": files.MODIFIED,
              "/tmp/cache/x/y": files.CREATED, "/tmp/keep.db": files.MODIFIED}
    pats = files.untracked_patterns(["/tmp/logs/*.log", "/tmp/cache"])
    assert files.outside(record, "/w/ws", pats) == ["/tmp/keep.db", "/w/wsx/b"]
    assert files.outside(None) == [] and files.outside({}, None, pats) == []
    assert files.untracked_patterns("~/x") == (os.path.expanduser("~/x"),)
    with pytest.raises(TypeError):
        files.untracked_patterns([""])


def test_worker_reports_only_changes_and_again_after_hello(tmp_path):
    """The worker-side record (its own process): pending() sends the whole record when it changed,
    nothing otherwise, and again after resend()."""
    code = f"""
import os
from gym_fork.worker import files
files.install()
p = os.path.join({str(tmp_path)!r}, "w.txt")
assert files.pending() is None
open(p, "a").close()
first = files.pending()
open(p, "a").close()
again = files.pending()
files.resend()
resent = files.pending()
q = os.path.join({str(tmp_path)!r}, "tmp.txt")
open(q, "w").close(); os.remove(q)
print(first == {{p: "created"}}, again is None, resent == first, files.pending() is None)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True"] * 4


def test_bad_untracked_paths_are_refused_with_what_was_given():
    import pytest

    assert files.untracked_patterns(None) == ()
    assert files.untracked_patterns("/tmp/a/*.log") == ("/tmp/a/*.log",)
    for bad, said in ((5, "not int"), ([3], "not 3"), ([""], "not ''"), ([b"/x"], "not b'/x'")):
        with pytest.raises(TypeError, match=said):
            files.untracked_patterns(bad)


def test_libraries_own_logs_and_shader_caches_are_never_outside():
    """MuJoCo's MUJOCO_LOG.TXT (written natively when a model compiles) and OpenGL shader caches
    hold nothing an env's behaviour depends on: not refused, wherever they are."""
    rec = {"/work/run/MUJOCO_LOG.TXT": files.MODIFIED,
           "/root/.cache/mesa_shader_cache/4f/aa": files.CREATED,
           "/home/u/.cache/mesa_shader_cache_db/index": files.MODIFIED,
           "/home/u/.nv/GLCache/x/y": files.CREATED,
           "/tmp/run/MUJOCO_LOG.TXT.bak": files.CREATED,
           "/tmp/run/state.bin": files.MODIFIED}
    assert files.outside(rec) == ["/tmp/run/MUJOCO_LOG.TXT.bak", "/tmp/run/state.bin"]
