"""Envs for tests/test_workspace_audit.py: workspaces that a copy of the directory cannot reproduce
(a symlink naming the workspace by its own path, a file hard-linked to one outside it) and envs
that hold a workspace file open between steps (read-only too).  Module-level classes, so that a
worker unpickles them by reference.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

import gymnasium as gym
import numpy as np


class _Base(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self):
        self.observation_space = gym.spaces.Box(-1e12, 1e12, (2,), np.float64)
        self.action_space = gym.spaces.Discrete(4)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2), {}


class _OneHelper(_Base):
    """An env with one helper process (``self.proc``), killed when the env closes."""

    def __init__(self):
        super().__init__()
        self.proc = None

    def close(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


class LinkedDataEnv(_Base):
    """Appends each action to ``data.txt`` through a symlink ``current`` in the workspace, made at
    reset as ``how`` says: ``"absolute"`` ($PWD/data.txt), ``"relative"`` (data.txt) or
    ``"climbing"`` (../<workspace name>/data.txt: out of the workspace and back in)."""

    def __init__(self, how: str = "relative"):
        super().__init__()
        self.how = how

    def reset(self, *, seed=None, options=None):
        r = super().reset(seed=seed)
        ws = self.workspace
        with open(os.path.join(ws, "data.txt"), "w"):
            pass
        link = os.path.join(ws, "current")
        if os.path.lexists(link):
            os.unlink(link)
        target = {"absolute": os.path.join(ws, "data.txt"), "relative": "data.txt",
                  "climbing": os.path.join("..", os.path.basename(ws), "data.txt")}[self.how]
        os.symlink(target, link)
        return r

    def relink(self, how: str) -> None:
        """Make ``current`` again, as ``how`` says (between steps: the env's own fix)."""
        self.how = how
        link = os.path.join(self.workspace, "current")
        os.unlink(link)
        os.symlink("data.txt" if how == "relative" else os.path.join(self.workspace, "data.txt"), link)

    def step(self, a):
        self.t += 1
        p = os.path.join(self.workspace, "current")
        with open(p, "a") as f:
            f.write(str(int(a)))
        with open(p) as f:
            d = f.read()
        return np.array([self.t, len(d)], float), 0.0, False, False, {"d": d}


def linked_data(how: str = "relative") -> LinkedDataEnv:
    return LinkedDataEnv(how)


class HardLinkedEnv(_Base):
    """Two names of one file, ``a.txt`` in the workspace and ``other``: ``other`` outside the
    workspace (a path to an existing file the test made), or None for ``b.txt`` inside it (made
    at reset). Appends through ``a.txt``, reads the other name."""

    def __init__(self, other: str | None = None):
        super().__init__()
        self.other = other

    def _other(self) -> str:
        return self.other or os.path.join(self.workspace, "b.txt")

    def reset(self, *, seed=None, options=None):
        r = super().reset(seed=seed)
        a = os.path.join(self.workspace, "a.txt")
        if os.path.lexists(a):
            os.unlink(a)
        if self.other is None:
            b = self._other()
            if os.path.lexists(b):
                os.unlink(b)
            with open(b, "w"):
                pass
        os.link(self._other(), a)
        return r

    def unlink_outside(self) -> None:
        """Give ``a.txt`` a content of its own (the env's own fix: a copy, not a link)."""
        a = os.path.join(self.workspace, "a.txt")
        with open(a) as f:
            data = f.read()
        os.unlink(a)
        with open(a, "w") as f:
            f.write(data)
        self.other = os.path.join(self.workspace, "b.txt")
        with open(self.other, "w") as f:
            f.write(data)

    def step(self, a):
        self.t += 1
        with open(os.path.join(self.workspace, "a.txt"), "a") as f:
            f.write(str(int(a)))
        with open(self._other()) as f:
            d = f.read()
        return np.array([self.t, len(d)], float), 0.0, False, False, {"d": d}


def hard_linked(other: str | None = None) -> HardLinkedEnv:
    return HardLinkedEnv(other)


class HeldOpenEnv(_Base):
    """Keeps ``state.txt`` in its workspace open between steps, as ``how`` says: ``"read"`` (a
    read-only file object it reads the state through), ``"write"`` (``log.txt`` opened for
    appending, a line per step), ``"sqlite-ro"`` (a read-only SQLite connection to ``app.db`` for queries, writes
    through a connection per step) or ``"child"`` (a child process whose stdin is the file).
    Each step rewrites the state through a per-step open."""

    def __init__(self, how: str = "read"):
        super().__init__()
        self.how = how
        self.held = None
        self.proc = None

    def reset(self, *, seed=None, options=None):
        r = super().reset(seed=seed)
        ws = self.workspace
        p = os.path.join(ws, "state.txt")
        with open(p, "w") as f:
            f.write("00000000\n")
        if self.how == "sqlite-ro":
            c = sqlite3.connect(os.path.join(ws, "app.db"))
            c.execute("create table if not exists m (t, a)")
            c.commit()
            c.close()
        if self.held is None and self.proc is None:
            if self.how == "read":
                self.held = open(p)
            elif self.how == "write":
                self.held = open(os.path.join(ws, "log.txt"), "a", buffering=1)
            elif self.how == "sqlite-ro":
                self.held = sqlite3.connect(f"file:{os.path.join(ws, 'app.db')}?mode=ro", uri=True)
            elif self.how == "child":
                with open(p) as f:
                    self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], stdin=f,
                                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return r

    def step(self, a):
        self.t += 1
        p = os.path.join(self.workspace, "state.txt")
        if self.how == "sqlite-ro":
            c = sqlite3.connect(os.path.join(self.workspace, "app.db"))
            c.execute("insert into m values (?, ?)", (self.t, int(a)))
            c.commit()
            c.close()
            ro = self.held or sqlite3.connect(f"file:{os.path.join(self.workspace, 'app.db')}?mode=ro", uri=True)
            n, s = ro.execute("select count(*), coalesce(sum(a), 0) from m").fetchone()
            if ro is not self.held:
                ro.close()
            return np.array([self.t, n * 1000 + s], float), 0.0, False, False, {}
        if self.how == "read" and self.held is not None:
            self.held.seek(0)
            v = int(self.held.read().strip() or 0)
        else:
            with open(p) as f:
                v = int(f.read().strip() or 0)
        if self.how == "write" and self.held is not None:
            self.held.write(f"step {self.t}\n")
        with open(p, "r+") as f:
            f.write(f"{(v * 3 + int(a) + 1) % 10**8:08d}\n")
        return np.array([self.t, v], float), 0.0, False, False, {}

    def let_go(self) -> None:
        """Close what it held (the env's own fix): from now on it opens everything per step."""
        if self.held is not None:
            self.held.close()
            self.held = None
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def close(self):
        self.let_go()


def held_open(how: str = "read") -> HeldOpenEnv:
    return HeldOpenEnv(how)


class ReadOnlyLinkedEnv(_Base):
    """A read-only file hard-linked into the workspace as ``ref.txt`` from ``other`` (as a local
    ``git clone`` links its objects), read each step beside ``log.txt``, which the env appends to."""

    def __init__(self, other: str):
        super().__init__()
        self.other = other

    def reset(self, *, seed=None, options=None):
        r = super().reset(seed=seed)
        ref = os.path.join(self.workspace, "ref.txt")
        if not os.path.lexists(ref):
            os.link(self.other, ref)
        return r

    def step(self, a):
        self.t += 1
        with open(os.path.join(self.workspace, "log.txt"), "a") as f:
            f.write(str(int(a)))
        with open(os.path.join(self.workspace, "ref.txt")) as f, open(os.path.join(self.workspace, "log.txt")) as g:
            d = f.read() + g.read()
        return np.array([self.t, len(d)], float), 0.0, False, False, {"d": d}


def read_only_linked(other: str) -> ReadOnlyLinkedEnv:
    return ReadOnlyLinkedEnv(other)


_APPEND = ("import os, sys\n"
           "path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.environ['NOTES_DIR'], 'notes.txt')\n"
           "for line in sys.stdin:\n"
           "    with open(path, 'a') as f:\n"
           "        f.write(line)\n"
           "    sys.stdout.write('ok\\n')\n"
           "    sys.stdout.flush()\n")


class ToolEnv(_OneHelper):
    """An agent env whose tool writes its workspace, knowing it by the path it was given: a
    helper started at the first reset and kept running (``"server-cwd"``: started in the
    workspace, writes ``notes.txt``; ``"server-arg"``: the file's absolute path as its argument;
    ``"server-env"``: the workspace in its environment) or run anew each step with the path
    the env derived at reset (``"tool-arg"``), or the env's own writes through that derived
    path (``"derived"``).  The helper appends each step's line to ``notes.txt``; the observation
    is the step and how many lines the file holds (read through ``self.workspace``)."""

    def __init__(self, how: str = "server-cwd"):
        super().__init__()
        self.how = how
        self.proc = None
        self.notes = None

    def reset(self, *, seed=None, options=None):
        r = super().reset(seed=seed)
        self.notes = os.path.join(self.workspace, "notes.txt")  # derived once
        with open(self.notes, "w"):
            pass
        if self.how.startswith("server") and self.proc is None:
            argv, cwd, env = [sys.executable, "-c", _APPEND], "/", dict(os.environ)
            if self.how == "server-cwd":
                argv, cwd = argv + ["notes.txt"], self.workspace
            elif self.how == "server-arg":
                argv = argv + [self.notes]
            else:
                env["NOTES_DIR"] = self.workspace
            self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True)
        return r

    def step(self, a):
        self.t += 1
        line = f"{self.t}:{int(a)}\n"
        if self.proc is not None:
            self.proc.stdin.write(line)
            self.proc.stdin.flush()
            self.proc.stdout.readline()
        elif self.how == "tool-arg":
            subprocess.run([sys.executable, "-c", _APPEND, self.notes], input=line, text=True, check=True,
                           stdout=subprocess.DEVNULL)
        else:
            with open(self.notes, "a") as f:
                f.write(line)
        with open(os.path.join(self.workspace, "notes.txt")) as f:
            lines = f.read().splitlines()
        return np.array([self.t, len(lines)], float), 0.0, False, False, {"last": lines[-1] if lines else ""}


def tool(how: str = "server-cwd") -> ToolEnv:
    return ToolEnv(how)


_WATCH = ("import os, sys, time\n"
          "last, changes = None, 0\n"
          "def look():\n"
          "    global last, changes\n"
          "    try:\n"
          "        with open('state.txt') as f:\n"
          "            now = f.read()\n"
          "    except FileNotFoundError:\n"
          "        return\n"
          "    if now != last:\n"
          "        last, changes = now, changes + 1\n"
          "        with open('changes.log', 'a') as f:\n"
          "            f.write(now + '\\n')\n"
          "import select\n"
          "while True:\n"
          "    look()\n"
          "    if select.select([sys.stdin], [], [], 0.001)[0]:\n"
          "        want = sys.stdin.readline().strip()\n"
          "        while last != want:\n"
          "            look()\n"
          "            time.sleep(0.0005)\n"
          "        sys.stdout.write(f'{changes}\\n')\n"
          "        sys.stdout.flush()\n")


def write_state(workspace: str, content: str) -> None:
    """Replace ``state.txt`` in ``workspace`` atomically (a reader sees the old or the new content)."""
    tmp = os.path.join(workspace, "state.tmp")
    with open(tmp, "w") as f:
        f.write(content)
    os.replace(tmp, os.path.join(workspace, "state.txt"))


class WatcherEnv(_OneHelper):
    """An agent env with a tool that watches its workspace on its own, between steps too (a dev
    server's file watcher): started in the workspace (at the first reset or step), it polls ``state.txt``
    every millisecond and logs each new content to ``changes.log``.  Each step writes
    ``state.txt`` (atomically) and waits until the watcher has seen it; the observation is the
    step and how many changes the watcher has counted (the content it found when it started
    included)."""

    def __init__(self, start: str = "reset"):
        super().__init__()
        self.start = start
        self.proc = None

    def reset(self, *, seed=None, options=None):
        r = super().reset(seed=seed)
        self._write("0")
        if self.start == "reset":
            self._start()
        return r

    def _start(self) -> None:
        if self.proc is None:
            self.proc = subprocess.Popen([sys.executable, "-c", _WATCH], cwd=self.workspace, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
            # it has seen what the file holds now before anything else is written: whether it
            # saw that or only the next step's content depended on how fast Python started
            # (a loaded CI machine: one change more than counted on)
            with open(os.path.join(self.workspace, "state.txt")) as f:
                self.proc.stdin.write(f.read() + "\n")
            self.proc.stdin.flush()
            self.proc.stdout.readline()

    def _write(self, content: str) -> None:
        write_state(self.workspace, content)

    def step(self, a):
        self.t += 1
        content = f"{self.t}:{int(a)}"
        self._start()
        self._write(content)
        self.proc.stdin.write(content + "\n")
        self.proc.stdin.flush()
        changes = int(self.proc.stdout.readline())
        with open(os.path.join(self.workspace, "changes.log")) as f:
            logged = f.read().splitlines()
        return np.array([self.t, changes], float), 0.0, False, False, {"logged": logged}


_HOLD = ("import os, signal, time\n"
         "held = []\n"
         "def hold(*_):\n"
         "    held.append(os.open('state.txt', os.O_RDONLY))\n"
         "def let_go(*_):\n"
         "    while held:\n"
         "        os.close(held.pop())\n"
         "signal.signal(signal.SIGUSR1, hold)\n"
         "signal.signal(signal.SIGUSR2, let_go)\n"
         "print('ready', flush=True)\n"
         "while True:\n"
         "    time.sleep(0.01)\n")


class HolderEnv(_OneHelper):
    """An agent env with a tool in its workspace that opens ``state.txt`` on ``SIGUSR1`` and
    closes it on ``SIGUSR2`` (a watcher's read, stretched so that a test can place it); each step
    writes ``state.txt`` (``"t:a"``) and the observation is the step and the first byte of what the
    file holds."""

    def reset(self, *, seed=None, options=None):
        r = super().reset(seed=seed)
        self._write("0")
        if self.proc is None:
            self.proc = subprocess.Popen([sys.executable, "-c", _HOLD], cwd=self.workspace, stdout=subprocess.PIPE)
            self.proc.stdout.readline()  # (its handlers are set: a signal before would end it)
            self.proc.stdout.close()
        return r

    def _write(self, content: str) -> None:
        write_state(self.workspace, content)

    def step(self, a):
        self.t += 1
        self._write(f"{self.t}:{int(a)}")
        with open(os.path.join(self.workspace, "state.txt")) as f:
            first = f.read(1)
        return np.array([self.t, float(first)]), 0.0, False, False, {}


def holder() -> HolderEnv:
    return HolderEnv()


def watcher(start: str = "reset") -> WatcherEnv:
    """``start``: when the watcher starts, at the first ``"reset"`` or at the first ``"step"``
    (a snapshot taken between the two holds the worker alone)."""
    return WatcherEnv(start)


class StoppedHelperEnv(_Base):
    """An env with two helpers in its workspace: one it stopped (``SIGSTOP``, as a shell's job
    control does) and one that runs; the observation is the step and whether each is stopped
    (``/proc`` state ``T``)."""

    def __init__(self):
        super().__init__()
        self.procs = None

    def reset(self, *, seed=None, options=None):
        r = super().reset(seed=seed)
        if self.procs is None:
            self.procs = [subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)"],
                                           cwd=self.workspace) for _ in range(2)]
            self.procs[0].send_signal(19)  # SIGSTOP
            while self._state(self.procs[0]) != "T":
                pass
        return r

    @staticmethod
    def _state(proc) -> str:
        # /proc is the host's (the worker is PID 1 of a PID namespace of its own): find the
        # helper among this process's children by its number in this namespace
        for tid in os.listdir("/proc/self/task"):
            try:  # (a thread, or another child, may end between the listing and the open)
                with open(f"/proc/self/task/{tid}/children") as f:
                    kids = f.read().split()
            except FileNotFoundError:
                continue
            for kid in kids:
                try:
                    with open(f"/proc/{kid}/status") as f:
                        status = dict(line.split(":", 1) for line in f if ":" in line)
                except FileNotFoundError:
                    continue
                if int(status["NSpid"].split()[-1]) == proc.pid:
                    return status["State"].split()[0]
        raise RuntimeError(f"no child {proc.pid}")

    def step(self, a):
        self.t += 1
        return (np.array([self.t, sum(self._state(p) == "T" for p in self.procs)], float), 0.0, False, False,
                {"states": [self._state(p) for p in self.procs]})

    def close(self):
        for p in self.procs or ():
            p.kill()
            p.wait()
        self.procs = None


def stopped_helper() -> StoppedHelperEnv:
    return StoppedHelperEnv()


class SubdirServerEnv(_OneHelper):
    """An agent env whose tool server works in a subdirectory of the workspace (``sub``, its
    working directory); action 3 renames that directory (``moved``: the server follows it, its
    working directory is the directory itself).  The observation is the step and the number of
    lines the server has written to ``notes.txt`` there."""

    def __init__(self):
        super().__init__()
        self.proc = None
        self.sub = None

    def reset(self, *, seed=None, options=None):
        r = super().reset(seed=seed)
        if self.proc is None:
            self.sub = os.path.join(self.workspace, "sub")
            os.makedirs(self.sub, exist_ok=True)
            self.proc = subprocess.Popen([sys.executable, "-c", _APPEND, "notes.txt"], cwd=self.sub,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return r

    def step(self, a):
        self.t += 1
        self.proc.stdin.write(f"{self.t}:{int(a)}\n")
        self.proc.stdin.flush()
        self.proc.stdout.readline()
        if int(a) == 3 and os.path.basename(self.sub) == "sub":
            moved = os.path.join(self.workspace, "moved")
            os.rename(self.sub, moved)
            self.sub = moved
        with open(os.path.join(self.workspace, os.path.basename(self.sub), "notes.txt")) as f:
            n = len(f.read().splitlines())
        return np.array([self.t, n], float), 0.0, False, False, {"dir": os.path.basename(self.sub)}


def subdir_server() -> SubdirServerEnv:
    return SubdirServerEnv()
