"""Small deterministic envs whose state lives outside plain process memory, as agents' envs do:
in a child process, a Redis server, a SQLite file, an unlinked temporary file, a thread, or the
global RNGs.  Each step's observation depends on that outside state, so a copy that does not
carry it exactly shows up as a different trajectory.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import zlib

import gymnasium as gym
import numpy as np

# A child that keeps state of its own (a running sum and its own RNG) and answers over pipes;
# with a second argument it also logs each request to its stderr (a tool server's log).
_COUNTER_CHILD = r"""
import random, sys
rng = random.Random(int(sys.argv[1]))
log = len(sys.argv) > 2
total = 0
for line in sys.stdin:
    total = total * 31 % 1000003 + int(line) + rng.randrange(1000)
    if log:
        sys.stderr.write(f"request {line.strip()} -> {total}\n")
    sys.stdout.write(f"{total}\n")
    sys.stdout.flush()
"""


class _Base(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(-1e12, 1e12, (3,), np.float64)
        self.action_space = gym.spaces.Discrete(4)
        self.t = 0

    def _obs(self, value: float) -> np.ndarray:
        return np.array([self.t, value, float(self.np_random.integers(0, 100))], dtype=np.float64)

    def _done(self) -> tuple[bool, bool]:
        return False, self.t >= 40

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(0.0), {}


class PipeChildEnv(_Base):
    """State in a child process (started at reset) that the env talks to over a pipe."""

    def __init__(self) -> None:
        super().__init__()
        self.proc: subprocess.Popen | None = None

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._stop()
        self.proc = subprocess.Popen([sys.executable, "-c", _COUNTER_CHILD, str(int(self.np_random.integers(1 << 30)))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.t = 0
        return self._obs(0.0), {"child": self.proc.pid}

    def step(self, action):
        self.t += 1
        self.proc.stdin.write(f"{int(action)}\n")
        self.proc.stdin.flush()
        value = float(self.proc.stdout.readline())
        return self._obs(value), value % 7, *self._done(), {}

    def _stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def close(self) -> None:
        self._stop()


def start_redis(*, unix_socket: str | None = None, port: int = 0) -> subprocess.Popen:
    """A redis-server child with no persistence (nothing written to disk)."""
    args = ["redis-server", "--save", "", "--appendonly", "no", "--dir", tempfile.gettempdir(), "--port", str(port),
            "--daemonize", "no", "--logfile", ""]
    if port:
        args += ["--bind", "127.0.0.1"]
    if unix_socket:
        args += ["--unixsocket", unix_socket, "--unixsocketperm", "700"]
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise TimeoutError("the server did not come up")
        time.sleep(0.02)


class RedisEnv(_Base):
    """State in a redis-server child, used through the ``redis`` client over a unix socket or TCP.

    ``transport="unix"``: the socket path is unlinked once the client is connected (a path is one
    name in the shared file system; the established connection stays private to each copy).
    ``transport="tcp"``: 127.0.0.1:``port``; copies need ``private_network=True``.
    ``keep_socket_path=True`` keeps the unix socket path (for the refusal test)."""

    def __init__(self, transport: str = "unix", port: int = 6391, keep_socket_path: bool = False,
                 socket_dir: str | None = None) -> None:
        super().__init__()
        self.transport, self.port, self.keep = transport, port, keep_socket_path
        # a directory only for the unix socket: over TCP the env writes no file at all
        self.own_dir = transport == "unix" and socket_dir is None
        self.dir = tempfile.mkdtemp(prefix="gf-redis-") if self.own_dir else socket_dir
        self.proc: subprocess.Popen | None = None
        self.db = None

    def reset(self, *, seed=None, options=None):
        import redis

        super().reset(seed=seed)
        if self.proc is None:
            if self.transport == "unix":
                sock = os.path.join(self.dir, "redis.sock")
                self.proc = start_redis(unix_socket=sock)
                wait_until(lambda: os.path.exists(sock))
                self.db = redis.Redis(unix_socket_path=sock)
                wait_until(lambda: self.db.ping())
                if not self.keep:
                    os.unlink(sock)
            else:
                self.proc = start_redis(port=self.port)
                self.db = redis.Redis(host="127.0.0.1", port=self.port)
                wait_until(lambda: self.db.ping())
        self.db.flushall()
        self.t = 0
        return self._obs(0.0), {}

    def step(self, action):
        self.t += 1
        n = self.db.incrby("total", int(action) + int(self.np_random.integers(0, 5)))
        self.db.rpush("moves", int(action))
        moves = self.db.lrange("moves", -3, -1)
        value = float(n * 100 + sum(int(m) for m in moves))
        return self._obs(value), float(n % 5), *self._done(), {"keys": self.db.dbsize()}

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
        if self.own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


class SqliteEnv(_Base):
    """Keeps a SQLite database file open across steps (a row per step)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.conn = sqlite3.connect(path)
        self.conn.execute("create table if not exists moves (t integer, a integer)")
        self.conn.commit()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.conn.execute("delete from moves")
        self.conn.commit()
        self.t = 0
        return self._obs(0.0), {}

    def step(self, action):
        self.t += 1
        self.conn.execute("insert into moves values (?, ?)", (self.t, int(action)))
        self.conn.commit()
        n, s = self.conn.execute("select count(*), coalesce(sum(a), 0) from moves").fetchone()
        return self._obs(float(n * 10 + s)), 0.0, *self._done(), {}

    def close(self) -> None:
        self.conn.close()


class UnlinkedFileEnv(_Base):
    """Appends to an unlinked temporary file it holds open, and reads it back."""

    def __init__(self) -> None:
        super().__init__()
        self.f = tempfile.TemporaryFile()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.f.seek(0)
        self.f.truncate()
        self.t = 0
        return self._obs(0.0), {}

    def step(self, action):
        self.t += 1
        self.f.write(f"{int(action)}{int(self.np_random.integers(0, 10))};".encode())
        self.f.flush()
        self.f.seek(0)
        data = self.f.read()
        return self._obs(float(len(data) * 1000 + sum(data) % 997)), 0.0, *self._done(), {}


class ThreadAfterResetEnv(_Base):
    """Starts a helper thread at its first reset (like a render or I/O thread); the state itself
    is in memory, where the thread keeps a counter of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.ticks = 0
        self.go = threading.Event()
        self.done = threading.Event()

    def _worker(self) -> None:
        while True:
            self.go.wait()
            self.go.clear()
            with self.lock:
                self.ticks = self.ticks * 3 % 10007 + 1
            self.done.set()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if self.thread is None:
            self.thread = threading.Thread(target=self._worker, daemon=True)
            self.thread.start()
        self.t, self.ticks = 0, 0
        return self._obs(0.0), {}

    def step(self, action):
        self.t += 1
        self.done.clear()
        self.go.set()
        self.done.wait()
        with self.lock:
            value = float(self.ticks + int(action))
        return self._obs(value), 0.0, *self._done(), {}


class GlobalRNGEnv(_Base):
    """Draws from the global RNGs of ``random``, ``numpy`` (and ``torch`` when ``use_torch``) in
    ``step()``: state no pickle of the env holds."""

    def __init__(self, use_torch: bool = False) -> None:
        super().__init__()
        self.use_torch = use_torch

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        random.seed(seed)
        np.random.seed(seed if seed is not None else 0)
        if self.use_torch:
            import torch

            torch.manual_seed(seed if seed is not None else 0)
        self.t = 0
        return self._obs(0.0), {}

    def step(self, action):
        self.t += 1
        value = random.random() + float(np.random.rand())
        if self.use_torch:
            import torch

            value += float(torch.randn(1).item())
        return self._obs(value + int(action)), 0.0, *self._done(), {}


class LevelAtResetEnv(_Base):
    """Steps are a pure function of the env's attributes; only ``reset()`` draws the next
    episode's level from the global ``random`` (procedurally generated levels often do), so a
    pickled copy goes on exactly until its next episode starts."""

    def __init__(self) -> None:
        super().__init__()
        self.level = 0.0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.level = 0, random.random()
        return self._obs(self.level), {}

    def step(self, action):
        self.t += 1
        return self._obs(self.level + int(action)), 1.0, self.t >= 6, False, {}


def level_at_reset():
    return LevelAtResetEnv()


class LateGlobalRNGEnv(_Base):
    """Pure until step 20; from then on each step draws from the global ``random`` (an event the
    first steps never meet, as in an env whose weather starts to change after a while)."""

    def step(self, action):
        self.t += 1
        noise = random.random() if self.t > 20 else 0.0
        return self._obs(float(action) + noise), 0.0, *self._done(), {}


def late_global_rng():
    return LateGlobalRNGEnv()


class TempScriptEnv(_Base):
    """Like an agent's code tool: each step writes a throwaway script with ``tempfile`` (deleted
    again) and observes its name, as a traceback or a tool's log would show it. ``tempfile``
    draws names from a generator it seeds afresh in any process whose pid is not the one it last
    drew in: a forked copy that did not carry it on would name its scripts differently.
    ``scratch``: the directory for them (default: the temp directory)."""

    def __init__(self, scratch: str | None = None) -> None:
        super().__init__()
        self.scratch = scratch

    def step(self, action):
        self.t += 1
        with tempfile.NamedTemporaryFile("w", prefix=f"tool{int(action)}-", suffix=".py", dir=self.scratch) as f:
            f.write(f"print({self.t})\n")
            f.flush()
            name = os.path.basename(f.name)
        value = float(int.from_bytes(name.encode()[-12:], "big") % (1 << 40))
        return self._obs(value), 0.0, *self._done(), {"script": name}


class ListingEnv(_Base):
    """An agent that lists its workspace as ``ls -la`` shows it -- every entry's mode and mtime,
    the directory's own (``.``) included -- and, on action 1, first unpacks a note there with the
    times its archive gives (as ``tar x`` does: the note, ``notes/`` and the workspace itself), so
    that the listing is a function of the actions alone. Its observation is a digest of the
    listing; ``info["listing"]`` the listing itself."""

    def __init__(self, workspace: str) -> None:
        super().__init__()
        self.workspace = workspace

    def step(self, action):
        self.t += 1
        if int(action) == 1:
            os.makedirs(os.path.join(self.workspace, "notes"), exist_ok=True)
            with open(os.path.join(self.workspace, "notes", f"n{self.t}.txt"), "w") as f:
                f.write(f"{self.t}\n")
            when = 1_700_000_000_000_000_000 + self.t * 1_000_000_007
            for rel in (f"notes/n{self.t}.txt", "notes", "."):
                os.utime(os.path.join(self.workspace, rel), ns=(when, when))
        listing = {}
        for top, dirs, files in os.walk(self.workspace):
            for name in [".", *dirs, *files]:
                st = os.lstat(os.path.join(top, name))
                listing[os.path.relpath(os.path.join(top, name), self.workspace)] = (st.st_mode, st.st_mtime_ns)
        value = float(zlib.crc32(repr(sorted(listing.items())).encode()))
        return self._obs(value), 0.0, *self._done(), {"listing": listing}


def listing_in(workspace: str):
    return ListingEnv(workspace)


class UnsortedListingEnv(_Base):
    """An agent that walks its directory as ``find`` and ``os.walk`` do -- unsorted, in the order
    the file system lists entries -- after changing it: action 0 writes a new file, 1 removes the
    first file by name, 2 writes ``n{t % 3}.txt`` (anew or again; see below), 3 writes a file into
    ``sub{t % 2}/``. Its observation is a digest of the walk in that order; ``info["walk"]`` the
    walk. ``root``: the directory (None: its ``workspace`` attribute). Action 2 renames the first
    file by name to ``r{t}.txt`` when there are three or more (a rename files it last, as an
    atomic write's does)."""

    def __init__(self, root: str | None = None) -> None:
        super().__init__()
        self.root = root

    def step(self, action):
        self.t += 1
        root = self.root or self.workspace
        a = int(action)
        names = sorted(n for n in os.listdir(root) if os.path.isfile(os.path.join(root, n)))
        if a == 1:
            if names:
                os.unlink(os.path.join(root, names[0]))
        elif a == 2 and len(names) >= 3:
            os.rename(os.path.join(root, names[0]), os.path.join(root, f"r{self.t}.txt"))
        else:
            where = os.path.join(root, f"sub{self.t % 2}") if a == 3 else root
            os.makedirs(where, exist_ok=True)
            with open(os.path.join(where, f"n{self.t % 3}.txt" if a == 2 else f"f{self.t}.txt"), "w") as f:
                f.write(f"{self.t}\n")
        walk = [(os.path.relpath(top, root), dirs, files) for top, dirs, files in os.walk(root)]
        return self._obs(float(zlib.crc32(repr(walk).encode()))), 0.0, *self._done(), {"walk": walk}


def unsorted_listing(root: str | None = None):
    return UnsortedListingEnv(root)


class LogEnv(_Base):
    """An agent that keeps a log file open between steps and writes a line per step, as a
    ``logging.FileHandler`` (``mode="a"``) or SB3's ``Monitor`` (``mode="w"``, flushed per line)
    does. ``mode="r+"`` opens it for reading and writing. ``flush=False`` leaves the lines in
    Python's buffer, as ``print(..., file=f)`` does, until it fills or the file is closed."""

    def __init__(self, path: str, mode: str = "a", flush: bool = True) -> None:
        super().__init__()
        self.path = path
        self.flush = flush
        self.file = open(path, mode)
        if mode == "r+":
            self.file.seek(0, os.SEEK_END)

    def step(self, action):
        self.t += 1
        self.file.write(f"step {self.t} action {int(action)}\n")
        if self.flush:
            self.file.flush()
        return self._obs(float(action)), 0.0, *self._done(), {}


    def close(self):
        self.file.close()


def log_to(path: str, mode: str = "a", flush: bool = True):
    return LogEnv(path, mode, flush)


class MemoryLogEnv(_Base):
    """Logs a record per step through a ``logging.handlers.MemoryHandler`` (records kept until
    100 are buffered or an error comes) in front of a ``FileHandler`` on ``path``."""

    def __init__(self, path: str) -> None:
        import logging.handlers

        super().__init__()
        self.log = logging.getLogger(f"agent_envs.memory_log.{id(self)}")
        self.log.propagate = False
        self.log.setLevel(logging.INFO)
        self.file = logging.FileHandler(path)
        self.file.setFormatter(logging.Formatter("%(message)s"))
        self.buffer = logging.handlers.MemoryHandler(100, flushLevel=logging.ERROR, target=self.file)
        self.log.addHandler(self.buffer)

    def step(self, action):
        self.t += 1
        self.log.info("step %d action %d", self.t, int(action))
        return self._obs(float(action)), 0.0, *self._done(), {}

    def close(self):
        self.buffer.close()  # (hands what it holds to the file)
        self.file.close()


def memory_log_to(path: str):
    return MemoryLogEnv(path)


class ToolExitEnv(_Base):
    """Runs a tool per step and observes its exit code, as an agent's shell tool does. It handles
    SIGCHLD itself: ``"ignore"`` (``SIG_IGN``, a common way not to leave zombies: then every
    ``subprocess`` exit status reads 0, since there is nothing left to wait for) or ``"count"``
    (a Python handler counting the children that ended)."""

    def __init__(self, handler: str = "ignore") -> None:
        super().__init__()
        self.ended = 0
        signal.signal(signal.SIGCHLD, signal.SIG_IGN if handler == "ignore" else self._child_ended)

    def _child_ended(self, signum, frame) -> None:
        self.ended += 1

    def step(self, action):
        self.t += 1
        code = subprocess.run(["sh", "-c", f"exit {int(action) + 1}"]).returncode
        return self._obs(float(code * 1000 + self.ended)), 0.0, *self._done(), {}


def tool_exit(handler: str = "ignore"):
    return ToolExitEnv(handler)


class ProjectCwdEnv(_Base):
    """An agent that works in its project directory by relative paths, as a shell tool started
    there does: it ``chdir``s into ``root`` once (or, ``dir_fd=True``, holds a descriptor of it
    and opens files relative to that), writes a note per step (named by the action) and observes
    the directory's listing."""

    def __init__(self, root: str, dir_fd: bool = False) -> None:
        super().__init__()
        self.dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY) if dir_fd else None
        if not dir_fd:
            os.chdir(root)

    def step(self, action):
        self.t += 1
        fd = os.open(f"note{self.t}-{int(action)}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644,
                     dir_fd=self.dir_fd)
        os.write(fd, f"{self.t}\n".encode())
        os.close(fd)
        names = sorted(os.listdir("." if self.dir_fd is None else self.dir_fd))
        return self._obs(float(zlib.crc32(" ".join(names).encode()))), 0.0, *self._done(), {"ls": names}


def project_cwd(root: str, dir_fd: bool = False):
    return ProjectCwdEnv(root, dir_fd)


class WorkspaceNotesEnv(_Base):
    """Appends a note per step to ``notes.txt`` in its workspace and observes how many it holds.
    It finds the file the way ``how`` says: ``"attr"`` from ``self.workspace`` at each step (the
    workspace contract), ``"derived"`` through a path computed once in ``__init__``, ``"cwd"`` by
    a relative path after ``chdir``ing into the workspace once, ``"tool"`` by running a shell in
    the directory computed once."""

    def __init__(self, workspace: str, how: str = "attr") -> None:
        super().__init__()
        self.workspace = workspace
        self.how = how
        self.notes = os.path.join(workspace, "notes.txt")
        if how == "cwd":
            os.chdir(workspace)
        elif how == "cwd-sub":  # a project directory inside the workspace
            os.makedirs(os.path.join(workspace, "proj"), exist_ok=True)
            os.chdir(os.path.join(workspace, "proj"))

    def step(self, action):
        self.t += 1
        path = {"attr": os.path.join(self.workspace, "notes.txt"), "derived": self.notes, "cwd": "notes.txt",
                "cwd-sub": "notes.txt", "tool": "notes.txt"}[self.how]
        if self.how == "tool":  # a shell tool run in the directory computed once
            subprocess.run(["sh", "-c", f"echo {self.t}:{int(action)} >> notes.txt"], cwd=os.path.dirname(self.notes),
                           check=True)
            path = self.notes
        else:
            with open(path, "a") as f:
                f.write(f"{self.t}:{int(action)}\n")
        with open(path) as f:
            n = len(f.read().splitlines())
        return self._obs(float(n)), 0.0, *self._done(), {"notes": n}


def notes_in(workspace: str, how: str = "attr"):
    return WorkspaceNotesEnv(workspace, how)


class GridViewEnv(_Base):
    """A grid with the agent's row kept beside it as a NumPy view (``self.row = self.grid[1]``):
    each step adds to the row through the view and observes column sums of the grid. A pickled
    copy holds the two apart, so its writes through ``row`` no longer reach ``grid``.
    ``masked``: the grid is a masked array (an ``ndarray`` subclass; its views share its data)."""

    def __init__(self, masked: bool = False) -> None:
        super().__init__()
        self.masked = masked

    def reset(self, *, seed=None, options=None):
        self.grid = np.ma.zeros((4, 4)) if self.masked else np.zeros((4, 4))
        self.row = self.grid[1]
        return super().reset(seed=seed, options=options)

    def step(self, action):
        self.t += 1
        self.row[int(action)] += 1.0
        return self._obs(float(self.grid.sum(axis=0) @ np.arange(4.0))), 0.0, *self._done(), {}


def grid_view(masked: bool = False):
    return GridViewEnv(masked)


class Entity:
    """A game object with no ``__hash__`` of its own: a set holds it by its address."""

    def __init__(self, v: int) -> None:
        self.v = v


class EntitiesEnv(_Base):
    """Keeps a set of entities; each step spawns two and retires whichever the set yields first.
    The set iterates by memory address, so the env is not reproducible: not in a second run, and
    not in any copy (gym_fork's own loop allocates differently in a restored copy)."""

    def reset(self, *, seed=None, options=None):
        self.ents = {Entity(i) for i in range(8)}
        self.n = 8
        return super().reset(seed=seed, options=options)

    def step(self, action):
        self.t += 1
        for _ in range(2):
            self.ents.add(Entity(self.n))
            self.n += 1
        first = next(iter(self.ents))
        self.ents.discard(first)
        return self._obs(float(first.v)), 0.0, *self._done(), {}


def entities():
    return EntitiesEnv()


class ForkSafeRNGEnv(_Base):
    """Draws its noise from a generator of its own that it reseeds in any forked child, from fresh
    entropy (``os.register_at_fork(after_in_child=...)``: a "fork-safe" generator, so that worker
    processes of a multiprocessing pool do not draw alike). A fork-tier copy runs that hook; the
    original never does."""

    def __init__(self) -> None:
        super().__init__()
        self.rng = random.Random(7)
        os.register_at_fork(after_in_child=self._reseed)

    def _reseed(self) -> None:
        self.rng.seed(os.urandom(16))

    def step(self, action):
        self.t += 1
        return self._obs(float(self.rng.randrange(10**9))), 0.0, *self._done(), {}


def fork_safe_rng():
    return ForkSafeRNGEnv()


def cache_clearing_hook():
    """An env whose module registers an after-fork hook that only clears a cache (``lru_cache``'s
    ``cache_clear``, as matplotlib's font manager and importlib_metadata do)."""
    import functools

    @functools.lru_cache(8)
    def lookup(x):
        return x * 2

    os.register_at_fork(after_in_child=lookup.cache_clear)
    return GlobalRNGEnv()


class CachedLookupEnv(_Base):
    """Looks its values up through a ``functools.lru_cache`` that its module clears in every
    forked child (``os.register_at_fork(after_in_child=cache_clear)``, as matplotlib's font
    manager does), and shows how many entries the cache holds. A fork-tier snapshot whose fork
    ran that hook came back with an empty cache: its copies showed other sizes than the
    original."""

    def __init__(self) -> None:
        super().__init__()
        import functools

        @functools.lru_cache(64)
        def lookup(x: int) -> int:
            return 2 * x

        self.lookup = lookup
        os.register_at_fork(after_in_child=lookup.cache_clear)

    def step(self, action):
        self.t += 1
        self.lookup(self.t % 50 + int(action))
        return self._obs(float(self.lookup.cache_info().currsize)), 0.0, *self._done(), {}


def cached_lookup():
    return CachedLookupEnv()


class ReapFailsEnv(_Base):
    """Fault injection for a fork-tier snapshot's answer: the bookkeeping the worker does right
    after it forks a snapshot, its answer already sent (collecting its exited snapshots), raises
    each time. (The worker's scan before the answer collects them too: only every second call,
    the one after a fork, fails.) Otherwise a counter: the observation's first entry is the
    number of steps since reset."""

    def __init__(self) -> None:
        super().__init__()
        from gym_fork.worker import resources

        real, calls = resources.reap_forked, [0]

        def reap_then_fail(forked: set) -> None:
            calls[0] += 1
            real(forked)
            if calls[0] % 2 == 0:
                raise RuntimeError("injected: collecting the exited snapshots failed")

        resources.reap_forked = reap_then_fail

    def step(self, action):
        self.t += 1
        return self._obs(0.0), 0.0, *self._done(), {}


def reap_fails():
    return ReapFailsEnv()


class GoalsLeftEnv(_Base):
    """Goals left to visit in a set; each step visits a few and heads for whichever the set yields
    first. A set that shrank keeps its larger table, so a pickled copy (its elements added to an
    empty set) iterates in another order: the copy would head elsewhere."""

    def reset(self, *, seed=None, options=None):
        self.left = set(range(0, 1000, 7))
        return super().reset(seed=seed, options=options)

    def step(self, action):
        self.t += 1
        for goal in list(self.left)[: 25 + int(action)]:
            self.left.discard(goal)
        return self._obs(float(next(iter(self.left), -1))), 0.0, *self._done(), {}


class ItemsInViewEnv(_Base):
    """A text adventure's room: the items in view are a set of names, and the observation is
    the one listed first. String hashes differ between processes (PYTHONHASHSEED), and with them
    the order a set of strings iterates in."""

    def reset(self, *, seed=None, options=None):
        self.items = {"lamp", "key", "map"}
        return super().reset(seed=seed, options=options)

    def step(self, action):
        self.t += 1
        self.items.add(f"coin{self.t}")
        first = next(iter(self.items))
        return self._obs(float(sum(first.encode()))), 0.0, *self._done(), {"first": first}


class WatchdogEnv(_Base):
    """An episode with a wall-clock budget: ``reset`` arms a timer (``signal.setitimer``), and
    once it has fired every step is truncated. With ``per_step`` the timer guards each step only
    (armed and disarmed inside it, as around a slow tool call): none is armed between steps."""

    def __init__(self, budget_s: float = 0.2, per_step: bool = False) -> None:
        super().__init__()
        self.budget_s, self.per_step, self.expired = budget_s, per_step, False

    def _expire(self, *_args) -> None:
        self.expired = True

    def reset(self, *, seed=None, options=None):
        self.expired = False
        signal.signal(signal.SIGALRM, self._expire)
        if not self.per_step:
            signal.setitimer(signal.ITIMER_REAL, self.budget_s)
        return super().reset(seed=seed, options=options)

    def step(self, action):
        self.t += 1
        if self.per_step:
            signal.setitimer(signal.ITIMER_REAL, self.budget_s)
            signal.setitimer(signal.ITIMER_REAL, 0)
        return self._obs(float(self.expired)), 0.0, False, self.expired, {}


class PosixTimerEnv(_Base):
    """Native code's timer: ``timer_create`` at the first reset, and each step observes whether
    ``timer_gettime`` still knows its id (a forked child has none of its parent's timers)."""

    def reset(self, *, seed=None, options=None):
        import ctypes

        if not hasattr(self, "timer"):
            libc = ctypes.CDLL(None, use_errno=True)
            self.timer = ctypes.c_void_p()
            if libc.timer_create(1, None, ctypes.byref(self.timer)) != 0:  # CLOCK_MONOTONIC, SIGALRM
                raise OSError(ctypes.get_errno(), "timer_create")
            self.gettime = libc.timer_gettime
        return super().reset(seed=seed, options=options)

    def step(self, action):
        import ctypes

        self.t += 1
        spec = (ctypes.c_long * 4)()
        ok = self.gettime(self.timer, spec) == 0  # a timer id this process does not have: -1
        return self._obs(float(ok)), 0.0, *self._done(), {}


class LateChildEnv(PipeChildEnv):
    """Runs a short tool (``true``) at every reset, and starts its stateful child (the counter over
    a pipe) only at step 3: its early snapshots are copy-on-write forks, its later ones CRIU dumps
    of the tree -- also in a copy restored from an early one."""

    def reset(self, *, seed=None, options=None):
        gym.Env.reset(self, seed=seed)
        self._stop()
        subprocess.run(["true"], check=True)
        self.t = 0
        return self._obs(0.0), {}

    def step(self, action):
        if self.proc is None and self.t >= 2:
            self.proc = subprocess.Popen([sys.executable, "-c", _COUNTER_CHILD, str(int(self.np_random.integers(1 << 30)))],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        if self.proc is None:
            self.t += 1
            return self._obs(0.0), 0.0, *self._done(), {}
        return super().step(action)


class ShellLogEnv(_Base):
    """Runs a shell per step that appends to a log outside any workspace (a tool the agent calls):
    a write below Python, seen by the worker's kernel-side watch (gym_fork.worker.fswatch)."""

    def __init__(self, path: str, read_back: bool = False) -> None:
        super().__init__()
        self.path = path
        self.read_back = read_back  # observe how many lines the log holds (what a tool's output shows)

    def step(self, action):
        self.t += 1
        subprocess.run(["sh", "-c", f"echo {self.t} {int(action)} >> '{self.path}'"], check=True)
        if self.read_back:
            with open(self.path) as f:
                return self._obs(float(len(f.readlines()))), 0.0, *self._done(), {}
        return self._obs(float(self.t)), 0.0, *self._done(), {}


def shell_log(path: str, read_back: bool = False):
    return ShellLogEnv(path, read_back)


class AppDirEnv(_Base):
    """Works in a directory of the machine, as an agent's app tree: each step writes a file, appends
    to a journal it keeps open (``hold``), has a shell append to a tool log (``shell``) and records
    the move in a SQLite database it connects to per step; the observation reads all of it back
    (sizes and a checksum of every file), so a copy with other files takes another trajectory."""

    def __init__(self, root: str, hold: bool = True, shell: bool = True) -> None:
        super().__init__()
        self.root, self.hold, self.shell = root, hold, shell
        self.journal = None

    def _db(self) -> sqlite3.Connection:
        c = sqlite3.connect(os.path.join(self.root, "app.db"))
        c.execute("create table if not exists moves (t integer, a integer)")
        return c

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        for name in os.listdir(self.root):
            p = os.path.join(self.root, name)
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
        if self.hold:
            self.journal = open(os.path.join(self.root, "journal.txt"), "a", buffering=1)
        self.t = 0
        return self._obs(0.0), {}

    def step(self, action):
        import zlib

        self.t += 1
        with open(os.path.join(self.root, f"step-{self.t}.txt"), "w") as f:
            f.write(f"{int(action)} {int(self.np_random.integers(0, 1000))}\n")
        if self.journal is not None:
            self.journal.write(f"{self.t} {int(action)}\n")
        if self.shell:
            subprocess.run(["sh", "-c", f"echo {self.t} {int(action)} >> '{self.root}/tool.log'"], check=True)
        with contextlib.closing(self._db()) as c:
            c.execute("insert into moves values (?, ?)", (self.t, int(action)))
            c.commit()
            n, s = c.execute("select count(*), coalesce(sum(a), 0) from moves").fetchone()
        size, crc = 0, 0
        for name in sorted(os.listdir(self.root)):
            if name.endswith(".txt") or name.endswith(".log"):
                with open(os.path.join(self.root, name), "rb") as f:
                    data = f.read()
                size += len(data)
                crc = zlib.crc32(data, crc)
        return self._obs(float(size * 1000 + crc % 997 + n * 7 + s)), 0.0, *self._done(), {"files": size}

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()


def app_dir(root: str, hold: bool = True, shell: bool = True) -> AppDirEnv:
    return AppDirEnv(root, hold, shell)


def _pool_work(x: int) -> int:
    """Runs in the pool's process: a module-level running sum and the process's own ``random``
    (each pool process keeps state between tasks, as a tool server would)."""
    global _POOL_TOTAL
    _POOL_TOTAL = (globals().get("_POOL_TOTAL", 0) * 31 + x + random.randrange(1000)) % 1000003
    return _POOL_TOTAL


class ProcessPoolEnv(_Base):
    """Tool calls run in a ``concurrent.futures.ProcessPoolExecutor`` of one process, started at
    reset with the given multiprocessing start method: its process, the executor's threads, pipes
    and semaphores are the env's."""

    def __init__(self, start_method: str = "fork") -> None:
        super().__init__()
        self.start_method = start_method
        self.pool = None

    def reset(self, *, seed=None, options=None):
        import concurrent.futures
        import multiprocessing

        out = super().reset(seed=seed)
        if self.pool is None:
            self.pool = concurrent.futures.ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context(self.start_method))
            self.pool.submit(random.seed, int(self.np_random.integers(1 << 30))).result()
        return out

    def step(self, action):
        self.t += 1
        value = float(self.pool.submit(_pool_work, int(action)).result())
        return self._obs(value), value % 7, *self._done(), {}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
            self.pool = None


def process_pool(start_method: str = "fork"):
    return ProcessPoolEnv(start_method)


class ServerLogEnv(PipeChildEnv):
    """A child started with its stderr in a log file opened with ``"w"`` (not append) that the env
    does not keep open itself: only the child holds the log (``with open(...) as log: Popen(...)``)."""

    def __init__(self, log_path: str) -> None:
        super().__init__()
        self.log_path = log_path

    def reset(self, *, seed=None, options=None):
        gym.Env.reset(self, seed=seed)
        self._stop()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-u", "-c", _COUNTER_CHILD,
                                          str(int(self.np_random.integers(1 << 30))), "log"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         text=True, bufsize=1)
        self.t = 0
        return self._obs(0.0), {}


def server_log(log_path: str):
    return ServerLogEnv(log_path)


class UnsendableInfo(gym.Wrapper):
    """Puts a lambda into ``info`` while ``self.bad`` is set: a result the worker cannot send back."""

    bad = False

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward, terminated, truncated, (dict(info, callback=lambda: None) if self.bad else info)

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return obs, (dict(info, callback=lambda: None) if self.bad else info)


def unsendable_info():
    return UnsendableInfo(gym.make("CartPole-v1"))


class LockedFileEnv(_Base):
    """Takes a lock on a file at its first reset (``flock``, or ``lockf``: a POSIX lock) and keeps
    it between steps, as a tool cache or a "this directory is mine" guard does."""

    def __init__(self, path: str, how: str = "flock") -> None:
        super().__init__()
        self.path, self.how, self.f = path, how, None

    def reset(self, *, seed=None, options=None):
        import fcntl

        out = super().reset(seed=seed)
        if self.f is None:
            self.f = open(self.path, "a+")
            if self.how == "flock":
                fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            else:
                fcntl.lockf(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return out

    def step(self, action):
        self.t += 1
        return self._obs(float(action)), 0.0, *self._done(), {}


def locked_file(path: str, how: str = "flock"):
    return LockedFileEnv(path, how)


# Module-level factories (the worker imports this module to build the envs).
def pipe_child():
    return PipeChildEnv()


def late_child():
    return LateChildEnv()


def redis_unix():
    return RedisEnv("unix")


def redis_unix_kept_path():
    return RedisEnv("unix", keep_socket_path=True)


def redis_unix_in(socket_dir: str):
    """Redis over a unix socket whose path stays bound in ``socket_dir`` (made private by the test)."""
    return RedisEnv("unix", keep_socket_path=True, socket_dir=socket_dir)


def redis_tcp():
    return RedisEnv("tcp")


def unlinked_file():
    return UnlinkedFileEnv()


def thread_after_reset():
    return ThreadAfterResetEnv()


def global_rng():
    return GlobalRNGEnv()


def temp_script():
    return TempScriptEnv()


def watchdog():
    return WatchdogEnv()


def watchdog_per_step():
    return WatchdogEnv(per_step=True)


def posix_timer():
    return PosixTimerEnv()


def goals_left():
    return GoalsLeftEnv()


def items_in_view():
    return ItemsInViewEnv()


def temp_script_in(scratch: str):
    return TempScriptEnv(scratch)


def global_rng_torch():
    return GlobalRNGEnv(use_torch=True)


class RedisNoRetryEnv(RedisEnv):
    """:class:`RedisEnv` whose client does not reconnect and retry: a connection the server
    closed or reset shows up as ``redis.ConnectionError`` from the next ``step()``."""

    def reset(self, *, seed=None, options=None):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        first = self.proc is None
        out = super().reset(seed=seed, options=options)
        if first:
            self.db.close()
            self.db = redis.Redis(host="127.0.0.1", port=self.port, retry=Retry(NoBackoff(), 0))
            self.db.ping()
        return out


class ExternalRedisEnv(_Base):
    """Keeps its state in a Redis server it did *not* start (another process's server), through a
    client connection it keeps open between steps: over TCP (``port``) or a unix socket path."""

    def __init__(self, port: int = 0, unix_socket: str | None = None) -> None:
        super().__init__()
        self.port, self.unix_socket = port, unix_socket
        self.db = None

    def reset(self, *, seed=None, options=None):
        import redis

        super().reset(seed=seed)
        if self.db is None:
            self.db = (redis.Redis(unix_socket_path=self.unix_socket) if self.unix_socket
                       else redis.Redis(host="127.0.0.1", port=self.port))
        self.db.delete("total", "moves")
        self.t = 0
        return self._obs(0.0), {}

    step = RedisEnv.step

    def close(self) -> None:
        if self.db is not None:
            self.db.close()


def redis_tcp_no_retry():
    return RedisNoRetryEnv("tcp")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PROMPT = b"@@gf$ "


class TerminalEnv(_Base):
    """An agent's terminal tool: an interactive bash on a pseudo-terminal the env opens itself
    (as ``pexpect.spawn`` does), kept between steps. The shell's state -- variables, functions,
    its working directory, the terminal's settings (echo off) -- shapes every observation: each
    step runs a command and observes a digest of exactly what the terminal showed."""

    def __init__(self, scratch: str | None = None) -> None:
        import pty

        super().__init__()
        self.master, slave = pty.openpty()
        self.slave_name = os.ttyname(slave)
        # (HISTFILE empty: no ~/.bash_history written when a shell ends, a file outside the env's
        # directories that a later snapshot of a shell still running would be refused for)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PS1": _PROMPT.decode(), "TERM": "dumb",
               "HOME": scratch or "/tmp", "LANG": "C", "HISTFILE": ""}
        self.shell = subprocess.Popen(["bash", "--norc", "--noprofile", "-i"], stdin=slave, stdout=slave,
                                      stderr=slave, start_new_session=True, env=env, cwd=scratch or "/tmp")
        os.close(slave)
        self._until_prompt()
        self.run("stty -echo; f() { X=$(( (X * 31 + $1 + ${#PWD}) % 1000003 )); echo \"x=$X\"; }")
        if scratch:
            self.run("mkdir -p work && cd work")

    def _until_prompt(self, timeout: float = 10.0) -> bytes:
        import select

        out, end = b"", time.monotonic() + timeout
        while not out.endswith(_PROMPT):
            ready, _, _ = select.select([self.master], [], [], max(0.0, end - time.monotonic()))
            if not ready:
                raise TimeoutError(f"no prompt from the shell; it showed {out[-200:]!r}")
            out += os.read(self.master, 65536)
        return out

    def run(self, command: str) -> bytes:
        os.write(self.master, command.encode() + b"\n")
        return self._until_prompt()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.run("X=1")
        return self._obs(0.0), {}

    def step(self, action):
        self.t += 1
        shown = self.run(f"f {int(action)}")
        value = int(shown.split(b"x=")[-1].split()[0])
        # the digest covers everything the terminal showed (an echo turned back on would show)
        return self._obs(float(value * 4096 + zlib.crc32(shown) % 4096)), 0.0, *self._done(), {"shown": shown}

    def close(self):
        with contextlib.suppress(OSError):
            self.shell.kill()
            self.shell.wait(5)
        with contextlib.suppress(OSError):
            os.close(self.master)


def terminal(scratch: str | None = None):
    return TerminalEnv(scratch)


class ForeignTerminalEnv(_Base):
    """Writes to a terminal it did not open: the slave end of a pty whose master someone else
    holds (the learner's terminal, say)."""

    def __init__(self, slave_name: str) -> None:
        super().__init__()
        self.fd = os.open(slave_name, os.O_RDWR | os.O_NOCTTY)

    def step(self, action):
        self.t += 1
        os.write(self.fd, b"step\n")
        return self._obs(float(action)), 0.0, *self._done(), {}

    def close(self):
        os.close(self.fd)


def foreign_terminal(slave_name: str):
    return ForeignTerminalEnv(slave_name)


#: A process that saves a pickle snapshot of :func:`items_in_view` after three steps (``save
#: DIR``: a bundle at DIR; ``save DIR store``: pinned in the SnapshotStore at DIR, its id printed)
#: or restores it (``load DIR`` / ``load DIR ID``), then prints what the env observes next; a
#: refused load prints ``refused: <why>``. Run it under different PYTHONHASHSEEDs.
HASH_ORDER_CHILD = """
import sys
import gym_fork, agent_envs
mode, path, sid = sys.argv[1], sys.argv[2], (sys.argv[3] if len(sys.argv) > 3 else None)
store = gym_fork.SnapshotStore(path) if sid else None
if mode == "save":
    env = gym_fork.ForkableEnv(agent_envs.items_in_view, backend="pickle", store=store)
    env.reset(seed=0)
    for a in (0, 1, 2):
        env.step(a)
    snap = env.snapshot()
    if store is None:
        snap.save(path)
    else:
        print(snap.pin().id)
else:
    try:
        env = gym_fork.ForkableEnv.from_snapshot(store.load(sid) if store else gym_fork.load_snapshot(path))
    except gym_fork.errors.BundleError as e:
        print("refused:", e)
        sys.exit(0)
print(" ".join(env.step(0)[4]["first"] for _ in range(3)))
env.close()
"""


class LateWriterEnv(_Base):
    """Reads a file outside any workspace each step; at step ``arm_at`` it leaves a writer behind
    that overwrites the file 0.2 s later, between steps: a thread (``how="thread"``) or a SIGALRM
    handler on a timer it arms (``how="alarm"``) -- no process of its own."""

    def __init__(self, path: str, how: str, arm_at: int = 3) -> None:
        super().__init__()
        self.path, self.how, self.arm_at = path, how, arm_at

    def _write(self, *_args) -> None:
        with open(self.path, "w") as f:
            f.write("LATE")

    def step(self, action):
        self.t += 1
        if self.t == self.arm_at:
            if self.how == "thread":
                threading.Timer(0.2, self._write).start()
            else:
                signal.signal(signal.SIGALRM, self._write)
                signal.setitimer(signal.ITIMER_REAL, 0.2)
        with open(self.path) as f:
            data = f.read()
        return self._obs(float(len(data) + int(action))), 0.0, *self._done(), {"data": data}


def late_writer(path: str, how: str):
    return LateWriterEnv(path, how)


class SharedMemoryFileEnv(_Base):
    """A tool that keeps its state in a POSIX shared-memory file (``/dev/shm``, a tmpfs):
    appended each step by Python (``how="python"``) or by a shell (``how="shell"``), and read
    back into the observation."""

    def __init__(self, path: str, how: str) -> None:
        super().__init__()
        self.path, self.how = path, how

    def step(self, action):
        self.t += 1
        if self.how == "python":
            with open(self.path, "a") as f:
                f.write(str(int(action)))
        else:
            subprocess.run(["sh", "-c", f"printf {int(action)} >> {self.path}"], check=True)
        with open(self.path) as f:
            data = f.read()
        return self._obs(float(len(data) * 10 + int(action))), 0.0, *self._done(), {"data": data}


def shared_memory_file(path: str, how: str):
    return SharedMemoryFileEnv(path, how)


class WorkspaceThreadEnv(_Base):
    """A background thread keeps ``workspace/count.txt`` equal to a counter in memory (under a
    lock), bumping both every millisecond; each step observes both. In any exact copy they are
    equal. ``workspace``: the directory (the env's workspace)."""

    def __init__(self, workspace: str) -> None:
        super().__init__()
        self.workspace = workspace
        self.lock = threading.Lock()
        self.counter = 0
        self._write()
        threading.Thread(target=self._run, daemon=True).start()

    def _write(self) -> None:
        with open(os.path.join(self.workspace, "count.txt"), "w") as f:
            f.write(str(self.counter))

    def _run(self) -> None:
        while True:
            with self.lock:
                self.counter += 1
                self._write()
            time.sleep(0.001)

    def step(self, action):
        self.t += 1
        with self.lock:
            with open(os.path.join(self.workspace, "count.txt")) as f:
                on_disk = int(f.read())
            counter = self.counter
        return self._obs(float(counter - on_disk)), 0.0, *self._done(), {"counter": counter, "file": on_disk}


def workspace_thread(workspace: str):
    return WorkspaceThreadEnv(workspace)
