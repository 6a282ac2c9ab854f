"""Launching criu from a threaded controller: concurrent restores each fork a criu, so what is
exec'd must never be a file being written (ETXTBSY), and a failed exec in pycriu's forked
child must end that child instead of letting a copy of the controller run on."""

from __future__ import annotations

import errno
import os
import subprocess
import threading
import time

import pytest

from gym_fork.backends.criu import _criu_via
from gym_fork.criu.status import new_client


def test_a_script_held_open_for_writing_cannot_be_executed(tmp_path):
    """The failure mode itself: a fork in another thread holds the new script open (ETXTBSY)."""
    script = tmp_path / "criu-private"
    fd = os.open(script, os.O_WRONLY | os.O_CREAT, 0o700)
    os.write(fd, b"#!/bin/sh\necho ran\n")
    try:
        with pytest.raises(OSError) as e:
            subprocess.run([str(script)], check=True)
        assert e.value.errno == errno.ETXTBSY
    finally:
        os.close(fd)


def test_criu_via_runs_while_its_per_call_files_are_held_open(tmp_path):
    path = _criu_via(str(tmp_path / "criu-private"), 'exec /bin/echo via "$@"\n')
    assert os.path.islink(path)
    held = [os.open(path + ".conf", os.O_WRONLY | os.O_APPEND)]  # what a concurrent fork inherits
    try:
        out = subprocess.run([path, "swrk", "7"], capture_output=True, text=True, check=True)
        assert out.stdout == "via swrk 7\n"
    finally:
        for fd in held:
            os.close(fd)


def test_a_criu_that_cannot_be_executed_fails_at_once_and_leaves_no_copy(tmp_path):
    not_exec = tmp_path / "criu"
    not_exec.write_text("not a program\n")  # mode 0644: execv fails with EACCES in the child
    before = _children()
    errors: list[BaseException] = []
    me, ran_on = os.getpid(), tmp_path / "ran-on"

    def call() -> None:
        try:
            new_client(str(not_exec)).check()
        except BaseException as e:  # noqa: BLE001 - any error will do; a hang will not
            errors.append(e)
        if os.getpid() != me:  # pycriu's child came back here: a copy of this process runs on
            ran_on.write_text(str(os.getpid()))
            os._exit(0)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "pycriu waited for a criu that was never executed"
    assert errors
    for _ in range(100):  # the child is gone (exec'd or _exit-ed) ...
        if _children() <= before:  # (no new one: a child of an earlier test may end meanwhile)
            break
        time.sleep(0.05)
    assert _children() <= before
    assert not ran_on.exists(), "the forked child ran the caller's code after its exec failed"


def _children(zombies: bool = False) -> set[int]:
    out: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                out.update(int(p) for p in f.read().split())
        except OSError:
            pass
    return {p for p in out if _state(p) not in ((None,) if zombies else ("Z", None))}


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def test_criu_gets_exactly_the_descriptors_made_inheritable_and_is_reaped(tmp_path):
    """criu is started with vfork + exec (no copy of the learner's page tables): it must still
    get the descriptors a dump or restore hands it (images dir, inherit_fd channels: made
    inheritable) and nothing else of ours, and be waited for."""
    seen = tmp_path / "fds"
    fake = tmp_path / _FAKE  # a name of its own: a real criu some other thread started is not it
    # what each of its descriptors points to (numbers alone would be ambiguous: the shell opens
    # its script at the lowest free number from 10, which may be one our process used)
    fake.write_text(f"#!/bin/sh\nfor f in /proc/$$/fd/*; do readlink $f; done > {seen}\nexit 3\n")
    fake.chmod(0o700)
    (tmp_path / "given").mkdir()
    (tmp_path / "private").mkdir()
    given = os.open(tmp_path / "given", os.O_DIRECTORY)
    private = os.open(tmp_path / "private", os.O_DIRECTORY)
    os.set_inheritable(given, True)
    before = _children()
    try:
        with pytest.raises(Exception):  # criu exits without an answer
            new_client(str(fake)).check()
    finally:
        os.close(given)
        os.close(private)
    targets = set(seen.read_text().split())
    assert str(tmp_path / "given") in targets and str(tmp_path / "private") not in targets
    # criu was waited for: no child of ours is it, running or a zombie (another child may have
    # started meanwhile, e.g. multiprocessing's resource tracker, spawned when an earlier test's
    # object is collected)
    left = [p for p in _children(zombies=True) - before if _comm(p) == _FAKE]
    assert left == [], f"criu was not reaped: {left}"


_FAKE = f"fakecriu{os.getpid() % 10**6}"  # (a process name: at most 15 characters)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def test_a_criu_that_exits_before_the_request_is_sent_is_still_reaped(tmp_path, monkeypatch):
    """pycriu waits for criu only after a complete exchange: a criu that was gone before our
    request went out (the send fails) was left a zombie, its socket open. The window is a race
    in real use (the earlier test hit it one run in a few); here criu has exited for sure before
    the request is sent."""
    fake = tmp_path / _FAKE
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o700)
    client = new_client(str(fake))
    comm = client._comm
    connect = comm.connect

    def connect_then_wait_for_exit(daemon: bool):
        sk = connect(daemon)
        for _ in range(500):  # until criu is a zombie: it read nothing, and our send will fail
            if _state(comm.swrk) == "Z":
                break
            time.sleep(0.01)
        assert _state(comm.swrk) == "Z"
        return sk

    monkeypatch.setattr(comm, "connect", connect_then_wait_for_exit)
    before = _children(zombies=True)
    with pytest.raises(Exception):
        client.check()
    left = [p for p in _children(zombies=True) - before if _comm(p) == _FAKE]
    assert left == [], f"criu was not reaped: {left}"
    assert comm.sk.fileno() == -1  # our end of its socket is closed
