"""Envs whose state lives outside plain process memory (tests/agent_envs.py): exact where gym_fork
claims it, refused by name where it cannot be.

Exact: reset -> 5 steps -> snapshot; the original goes on with actions X; two branches forked from
the snapshot step *interleaved* with it (one with X, one with other actions Y), then a restore
replays X and Y: every trajectory bit-identical to its replay.  Interleaving is what shows
isolation: branches sharing a child process, a Redis, a file or a socket would see each other's
writes and diverge.  Afterwards no process of any copy is left.
"""

from __future__ import annotations

import functools
import os
import signal
import time

import numpy as np
import pytest
from conftest import assert_same_traj, eventually, process_states

import agent_envs
import gym_fork
from gym_fork.errors import UncapturableStateError, WorkerDiedError
from gym_fork.snapshots import sessiondir

pytestmark = pytest.mark.criu


def _tree(pid: int) -> set[int]:
    """pid and all its descendants (host pids)."""
    return {pid, *process_states(pid, tree=True)}


def _alive(pids: set[int]) -> set[int]:
    out = set()
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.add(p)
        except OSError:
            pass
    return out


def assert_gone(pids: set[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pids), f"processes left behind: {sorted(_alive(pids))}"


def step(env, a) -> tuple:
    obs, r, term, trunc, info = env.step(a)
    return (obs, r, term, trunc, info)


def check_exact_and_isolated(factory, n_steps: int = 12, *, mechanism: str | None = None,
                             on_branches=None, on_restored=None, **opts) -> None:
    """Snapshot after a prefix; two branches step interleaved with the original (shared state
    would show as a divergence); two restores replay both action paths bit-identically; nothing
    is left behind. ``mechanism``: the payload type the snapshot must be; ``on_branches(env,
    kids)`` and ``on_restored(env)`` add checks after the branches ran and after the last restore
    (which replayed the second branch's actions)."""
    env = gym_fork.ForkableEnv(factory, **opts)
    pids: set[int] = set()
    kids: list = []
    try:
        env.action_space.seed(11)
        env.reset(seed=5)
        for _ in range(5):
            env.step(env.action_space.sample())
        snap = env.snapshot()
        if mechanism is not None:
            assert type(snap._payload).__name__ == mechanism
        xs = [env.action_space.sample() for _ in range(n_steps)]
        ys = [(int(a) + 1) % 4 for a in xs]
        kids = env.fork(snap, 2)
        orig, bx, by = [], [], []
        for x, y in zip(xs, ys):  # interleaved: shared state would show up as a divergence
            bx.append(step(kids[0], x))
            orig.append(step(env, x))
            by.append(step(kids[1], y))
        assert_same_traj(orig, bx)
        pids |= _tree(env.worker_pid) | _tree(kids[0].worker_pid) | _tree(kids[1].worker_pid)
        assert len({env.worker_pid, kids[0].worker_pid, kids[1].worker_pid}) == 3
        if on_branches is not None:
            on_branches(env, kids)
        env.restore(snap)
        assert_same_traj(orig, [step(env, x) for x in xs])
        pids |= _tree(env.worker_pid)
        env.restore(snap)
        assert_same_traj(by, [step(env, y) for y in ys])
        assert snap.backend == "criu"
        if on_restored is not None:
            on_restored(env)
    finally:
        for k in kids:
            k.close()
        env.close()
    assert_gone(pids)


def test_child_process_over_pipe():
    """fork_tier='auto': the child makes the env's snapshots CRIU dumps of the whole tree."""
    check_exact_and_isolated(agent_envs.pipe_child)


def test_child_process_criu_dumps_only():
    check_exact_and_isolated(agent_envs.pipe_child, backend="criu", fork_tier=False)


def test_redis_over_unix_socket():
    check_exact_and_isolated(agent_envs.redis_unix)


def test_redis_over_tcp_private_network():
    check_exact_and_isolated(agent_envs.redis_tcp, private_network=True)


def test_unlinked_temp_file():
    check_exact_and_isolated(agent_envs.unlinked_file)


def test_thread_started_after_reset():
    check_exact_and_isolated(agent_envs.thread_after_reset)


def _again_from_a_restored_copy(env) -> None:
    """A restored copy lives in a mount namespace with a devpts of its own: it is dumped from
    there, and its snapshot restores (twice, and as a fork) to the same continuation."""
    snap = env.snapshot()
    first = [step(env, a) for a in (3, 1, 2)]
    for _ in range(2):
        env.restore(snap)
        assert_same_traj(first, [step(env, a) for a in (3, 1, 2)])
    kid = env.fork(snap, 1)[0]
    try:
        assert_same_traj(first, [step(kid, a) for a in (3, 1, 2)])
    finally:
        kid.close()


@pytest.mark.parametrize("scratch, opts", [(False, {}), (True, {}), (True, {"private_dirs": True}),
                                           (False, {"private_network": True})],
                         ids=["plain", "cd-into-scratch", "in-a-private-dir", "private-network"])
def test_an_interactive_shell_on_a_pty_the_env_opened(tmp_path, scratch, opts):
    """An agent's terminal tool: bash on a pty the env opened (pexpect's way), its variables,
    function, working directory and terminal settings kept between steps. Both ends of the pty
    are the env's, so a CRIU dump of the tree captures it; each restore gets a devpts instance of
    its own, where the pty keeps its number while the original still holds it (also together
    with a private directory's binds, or a network namespace of its own). (Refused as "a
    terminal" before.)"""
    factory = functools.partial(agent_envs.terminal, str(tmp_path) if scratch else None)
    if opts.get("private_dirs"):
        opts = {"private_dirs": [str(tmp_path)]}
    check_exact_and_isolated(factory, on_restored=_again_from_a_restored_copy, **opts)
    if opts.get("private_dirs"):
        assert os.listdir(tmp_path) == []  # the shell's `mkdir work` happened in the copies only


def test_a_pty_shell_snapshot_saved_and_loaded(tmp_path):
    env = gym_fork.ForkableEnv(agent_envs.terminal)
    try:
        env.reset(seed=1)
        for a in (1, 2):
            env.step(a)
        snap = env.snapshot()
        want = [step(env, a) for a in (0, 3)]
        snap.save(str(tmp_path / "shell.gfsnap"))
        loaded = gym_fork.load_snapshot(str(tmp_path / "shell.gfsnap"))
        env.restore(loaded)
        assert_same_traj(want, [step(env, a) for a in (0, 3)])
    finally:
        env.close()


def test_terminals_the_env_does_not_own_are_refused_by_name():
    """A terminal whose other end a process outside the env holds is not the env's: refused,
    naming who holds it, and the env runs on."""
    import pty

    master, slave = pty.openpty()
    try:
        env = gym_fork.ForkableEnv(functools.partial(agent_envs.foreign_terminal, os.ttyname(slave)))
        try:
            env.reset(seed=0)
            env.step(1)
            with pytest.raises(UncapturableStateError, match="a terminal.*not on a terminal"):
                env.snapshot()
            env.step(2)
        finally:
            env.close()
        env = gym_fork.ForkableEnv(agent_envs.terminal)  # its own pty, but we open its terminal end too
        try:
            env.reset(seed=0)
            fd = os.open(env.unwrapped.slave_name, os.O_RDWR | os.O_NOCTTY)
            try:
                with pytest.raises(UncapturableStateError, match=rf"pty \d+, also open in process\(es\) \[{os.getpid()}\]"):
                    env.snapshot()
            finally:
                os.close(fd)
            env.step(1)
            env.snapshot()  # ours closed again: the env's own
        finally:
            env.close()
    finally:
        os.close(master)
        os.close(slave)


def test_car_racing_render_thread_switches_to_criu(caplog):
    """CarRacing-v3 starts a thread at reset(): its snapshots become CRIU dumps, with one log line."""
    caplog.set_level("INFO", logger="gym_fork")
    env = gym_fork.ForkableEnv("CarRacing-v3")
    try:
        env.reset(seed=1)
        acts = [np.array([0.1 * (i % 3), 0.5, 0.0], dtype=np.float32) for i in range(8)]
        for a in acts[:3]:
            env.step(a)
        snap = env.snapshot()
        env.snapshot().release()  # a second snapshot logs nothing new
        first = [step(env, a) for a in acts]
        env.restore(snap)
        assert_same_traj(first, [step(env, a) for a in acts])
    finally:
        env.close()
    lines = [r.getMessage() for r in caplog.records if "CRIU dumps of the whole process tree" in r.getMessage()]
    assert len(lines) == 1 and "thread" in lines[0]


# --- refusals: named, before anything diverged ------------------------------------------------

def test_tcp_without_private_network_is_refused():
    env = gym_fork.ForkableEnv(agent_envs.redis_tcp)
    try:
        env.reset(seed=0)
        env.step(1)
        with pytest.raises(UncapturableStateError, match=r"127\.0\.0\.1:6391.*private_network=True") as ei:
            env.snapshot()
        assert {r.kind for r in ei.value.resources} >= {"listener", "socket"}
        env.step(2)  # the env keeps running, unchanged
    finally:
        env.close()


def assert_snapshot_refused(factory, match: str, **opts) -> None:
    """The env's snapshot is refused (UncapturableStateError matching ``match``) and the env steps on."""
    env = gym_fork.ForkableEnv(factory, **opts)
    try:
        env.reset(seed=0)
        with pytest.raises(UncapturableStateError, match=match):
            env.snapshot()
        env.step(1)
    finally:
        env.close()


def test_unix_socket_path_kept_is_refused():
    assert_snapshot_refused(agent_envs.redis_unix_kept_path, r"redis\.sock \(listening\).*unlink the path")


def test_sqlite_outside_workspace_is_refused(tmp_path):
    path = str(tmp_path / "moves.db")
    env = gym_fork.ForkableEnv(lambda: agent_envs.SqliteEnv(path))
    try:
        env.reset(seed=0)
        env.step(1)
        with pytest.raises(UncapturableStateError, match=rf"{path} \(open for writing\).*workspace=DIR") as ei:
            env.snapshot()
        assert any(r.fd is not None and r.pid == env.worker_pid for r in ei.value.resources)
        env.step(2)
    finally:
        env.close()


def test_refused_on_criu_dumps_too(tmp_path):
    """fork_tier=False checks the same way before each dump."""
    path = str(tmp_path / "moves.db")
    env = gym_fork.ForkableEnv(lambda: agent_envs.SqliteEnv(path), backend="criu", fork_tier=False)
    try:
        env.reset(seed=0)
        with pytest.raises(UncapturableStateError, match="moves.db"):
            env.snapshot()
    finally:
        env.close()


def test_fork_tier_true_refuses_with_fix():
    env = gym_fork.ForkableEnv(agent_envs.pipe_child, backend="criu", fork_tier=True)
    try:
        env.reset(seed=0)
        with pytest.raises(UncapturableStateError, match=r"fork_tier=True.*child process|fork_tier=True.*process"):
            env.snapshot()
    finally:
        env.close()


def test_children_after_a_fork_tier_restore_are_refused_by_name():
    """A copy-on-write clone cannot be dumped with its children: refused, naming the fix."""
    env = gym_fork.ForkableEnv(agent_envs.pipe_child)
    try:
        s0 = env.snapshot()  # before reset(): no child yet, a fork-tier snapshot
        env.restore(s0)  # the worker is now a copy-on-write clone
        env.reset(seed=0)  # starts the child
        env.step(1)
        with pytest.raises(UncapturableStateError, match="fork_tier=False"):
            env.snapshot()
        env.step(2)
    finally:
        env.close()


def test_a_copy_of_an_env_that_starts_processes_can_take_its_children_along():
    """An env that started processes before a copy-on-write snapshot gets copies that are PID 1 of
    namespaces of their own: when such a copy starts a child, its snapshots are CRIU dumps of
    its whole tree (a plain clone would be refused), exact, and the copies' trees stay apart."""
    env = gym_fork.ForkableEnv(agent_envs.late_child)
    kids = []
    pids = {env.worker_pid}
    try:
        env.action_space.seed(3)
        env.reset(seed=4)  # runs `true`: the env has started a process
        s0 = env.snapshot()  # no child alive: a copy-on-write snapshot
        assert s0.size_bytes == 0
        env.restore(s0)  # the worker is a copy now
        for a in (1, 2, 3):  # the child starts at step 3
            env.step(a)
        pids |= _tree(env.worker_pid)
        assert len(_tree(env.worker_pid)) >= 2
        s1 = env.snapshot()  # the copy's tree: a CRIU dump, not a refusal
        assert s1.size_bytes > 0
        xs = [env.action_space.sample() for _ in range(8)]
        first = [step(env, x) for x in xs]
        kids = env.fork(s1, 2)
        for k in kids:
            assert_same_traj(first, [step(k, x) for x in xs])
            pids |= _tree(k.worker_pid)
        env.restore(s1)
        assert_same_traj(first, [step(env, x) for x in xs])
        pids |= _tree(env.worker_pid)
        env.restore(s0)  # back to a copy-on-write copy: the namespace-init copy is replaced
        pids |= _tree(env.worker_pid)
        env.step(0)
    finally:
        for k in kids:
            k.close()
        env.close()
    assert_gone(pids)


def test_explore_branches_of_an_env_that_starts_processes_end_in_tree_snapshots():
    """explore() from a copy-on-write snapshot: each branch (a namespace-init copy) starts its
    child on the way, and its end snapshot is a CRIU dump of its own tree, restorable exactly."""
    env = gym_fork.ForkableEnv(agent_envs.late_child)
    try:
        env.action_space.seed(0)
        env.reset(seed=1)
        res = gym_fork.explore(env, env.snapshot(), lambda obs: 1, n_branches=3, horizon=6,
                               return_snapshots=True)
        ends = [b.snapshot for b in res.branches]
        assert all(s is not None and s.size_bytes > 0 for s in ends)  # tree dumps, not refusals
        xs = [0, 3, 1, 2, 2]
        env.restore(ends[0])
        first = [step(env, x) for x in xs]
        env.restore(ends[0])
        assert_same_traj(first, [step(env, x) for x in xs])
    finally:
        env.close()


# --- faults ---------------------------------------------------------------------------------

def test_child_killed_between_snapshot_and_restore():
    env = gym_fork.ForkableEnv(agent_envs.pipe_child)
    try:
        env.action_space.seed(3)
        env.reset(seed=2)
        for _ in range(3):
            env.step(env.action_space.sample())
        snap = env.snapshot()
        xs = [env.action_space.sample() for _ in range(8)]
        first = [step(env, x) for x in xs]
        child = [p for p in _tree(env.worker_pid) if p != env.worker_pid]
        assert child
        for p in child:
            os.kill(p, signal.SIGKILL)
        with pytest.raises(gym_fork.GymForkError):
            env.step(0)  # the original lost its child
        env.restore(snap)  # the snapshot has its own copy of the child
        assert_same_traj(first, [step(env, x) for x in xs])
    finally:
        env.close()


def _netns_fds() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("net:"):
            out.append(link)
    return out


def test_close_mid_fork_leaves_nothing():
    """close() while fork() restores copies (each with its own Redis and network namespace):
    afterwards no process, no namespace fd, no mount and no image directory is left."""
    import threading

    ns_before = _netns_fds()
    env = gym_fork.ForkableEnv(agent_envs.redis_tcp, private_network=True)
    env.reset(seed=0)
    env.step(1)
    snap = env.snapshot()
    pids = _tree(env.worker_pid)
    netns = {os.stat(f"/proc/{env.worker_pid}/ns/net").st_ino}
    out: dict = {}

    def fork() -> None:
        try:
            out["kids"] = env.fork(snap, 4)
        except Exception as e:  # noqa: BLE001 - closing under it may fail it; it must not leak
            out["error"] = e

    t = threading.Thread(target=fork)
    t.start()
    time.sleep(0.05)
    env.close()
    t.join(120)
    assert out, "fork() neither returned nor raised"
    for k in out.get("kids", []):
        pids |= _tree(k.worker_pid)
        netns.add(os.stat(f"/proc/{k.worker_pid}/ns/net").st_ino)
        k.close()
    assert_gone(pids)
    left = [n for n in os.listdir(sessiondir.session_dir()) if n.startswith(("snap-", "restore-", "."))]
    assert not left, (left, out)
    assert _netns_fds() == ns_before, out
    with open("/proc/self/mountinfo") as f:  # gym_fork mounts nothing: no namespace of ours is pinned
        assert not [line for line in f if any(f"net:[{ino}]" in line for ino in netns)]


def test_close_kills_the_env_children():
    env = gym_fork.ForkableEnv(agent_envs.pipe_child, backend="criu", fork_tier=False)
    env.reset(seed=0)
    pids = _tree(env.worker_pid)
    assert len(pids) >= 2
    env.close()
    assert_gone(pids)


def test_scan_finds_nothing_in_matrix_envs():
    """No false positives: the exactness-matrix envs keep copy-on-write snapshots."""
    for env_id in ("CartPole-v1", "LunarLander-v3"):
        env = gym_fork.ForkableEnv(env_id)
        try:
            env.reset(seed=0)
            env.step(env.action_space.sample())
            snap = env.snapshot()
            assert snap.size_bytes == 0  # a copy-on-write fork, no CRIU images
        finally:
            env.close()



# --- honest fallbacks: pickle checks by behaviour; EzPickle instances are refused -------------

@pytest.mark.parametrize("factory", [agent_envs.global_rng, agent_envs.global_rng_torch], ids=["random+numpy", "torch"])
def test_global_rng_env_refused_by_pickle(factory):
    import random

    env = gym_fork.ForkableEnv(factory, backend="pickle")
    try:
        env.reset(seed=0)
        env.step(1)
        before = (random.getstate(), np.random.get_state()[1].tobytes())
        # (seen as the env drew, by the pickle handle's watch of the global generators)
        with pytest.raises(gym_fork.errors.UnsupportedEnvError, match=r"drew from (random|numpy\.random|torch) \(the global RNG\)"):
            env.snapshot()
        # the check stepped copies, not the env, and left the global RNGs as they were
        assert before == (random.getstate(), np.random.get_state()[1].tobytes())
    finally:
        env.close()


def test_an_env_drawing_its_next_level_from_the_global_rng_at_reset():
    """Every step is a function of the pickle, but reset() draws the next level from the global
    ``random``: the pickle backend's check stepped its copies to the episode's end and passed, and
    a restored copy silently started another level at its next reset. The check now ends with a
    reset() of both copies (refused, the env runs on); a CRIU dump holds the global RNG (exact
    across episodes)."""
    env = gym_fork.ForkableEnv(agent_envs.level_at_reset, backend="pickle")
    try:
        env.reset(seed=0)
        env.step(1)
        with pytest.raises(gym_fork.errors.UnsupportedEnvError,
                           match=r"at the reset\(\) after 5 step\(s\).*global RNGs|drew from random \(the global RNG\) at reset\(\)"):
            env.snapshot()
        env.step(0)
    finally:
        env.close()
    env = gym_fork.ForkableEnv(agent_envs.level_at_reset, backend="criu")
    try:
        env.reset(seed=0)
        env.step(1)
        snap = env.snapshot()

        def on() -> list:
            out = [step(env, a) for a in (1, 0, 1, 1, 0)]
            return out + [env.reset(), step(env, 1)]

        first = on()
        env.restore(snap)
        assert_same_traj(first, on())
    finally:
        env.close()


def test_an_env_reaching_for_the_global_rng_only_later_is_refused_at_a_later_snapshot():
    """The pickle backend's first-snapshot check stepped 8 actions from step 1, and the env draws
    from the global ``random`` only after step 20: the check passed, and a second snapshot at step
    31 restored into a copy that silently went on with other numbers. The check now runs again at
    the 2nd, 4th, 8th, ... snapshot, from that later state (refused, the env runs on)."""
    env = gym_fork.ForkableEnv(agent_envs.late_global_rng, backend="pickle")
    try:
        env.reset(seed=0)
        env.step(0)
        env.snapshot()  # checked here: nothing outside the pickle within 8 steps
        for _ in range(30):
            env.step(1)
        with pytest.raises(gym_fork.errors.UnsupportedEnvError, match=r"drew from random \(the global RNG\) at step 21"):
            env.snapshot()
        env.step(0)
    finally:
        env.close()


def test_an_armed_timer_makes_snapshots_process_dumps():
    """A ``fork()`` child starts with no interval timer: a fork-tier copy of an env whose timer is
    armed between steps (an episode's wall-clock budget) would never get its signal. The scan
    finds it; ``fork_tier='auto'`` then takes a CRIU dump, which restores the timer with the time
    it had left, and ``fork_tier=True`` refuses, naming it."""
    env = gym_fork.ForkableEnv(agent_envs.watchdog, backend="criu")
    try:
        env.reset(seed=0)
        env.step(0)
        snap = env.snapshot()
        assert type(snap._payload).__name__ == "CriuPayload"
        time.sleep(0.4)
        assert step(env, 0)[3] is True  # the budget ran out
        env.restore(snap)
        time.sleep(0.4)
        assert step(env, 0)[3] is True  # and it runs out in the restored copy too
    finally:
        env.close()
    env = gym_fork.ForkableEnv(agent_envs.watchdog, backend="criu", fork_tier=True)
    try:
        env.reset(seed=0)
        with pytest.raises(UncapturableStateError, match=r"ITIMER_REAL armed by signal\.alarm/setitimer \(0\.\d+ s left\)"):
            env.snapshot()
        env.step(0)  # untouched
    finally:
        env.close()
    env = gym_fork.ForkableEnv(agent_envs.posix_timer, backend="criu")
    try:  # a POSIX timer (native code's timer_create): a fork() child would not have its id
        env.reset(seed=0)
        env.step(0)
        snap = env.snapshot()
        assert type(snap._payload).__name__ == "CriuPayload"
        env.restore(snap)
        assert step(env, 0)[0][1] == 1.0  # the restored copy has its timer
        kid = env.fork(snap)[0]
        assert step(kid, 0)[0][1] == 1.0
        kid.close()
    finally:
        env.close()
    env = gym_fork.ForkableEnv(agent_envs.watchdog_per_step, backend="criu")
    try:  # a timer armed only inside a step: nothing between steps, a copy-on-write snapshot
        env.reset(seed=0)
        env.step(0)
        assert type(env.snapshot()._payload).__name__ == "ForkPayload"
    finally:
        env.close()


def test_pickle_refuses_a_set_whose_order_pickling_would_change():
    """A set that shrank iterates in another order once pickled (loading adds its elements to an
    empty set, laid out anew); an env that heads for the set's first element would go on
    elsewhere after a restore. Every pickle snapshot looks for such sets and refuses, naming it;
    the env is untouched and steps on; process snapshots copy it exactly."""
    env = gym_fork.ForkableEnv(agent_envs.goals_left, backend="pickle")
    try:
        env.reset(seed=0)
        refused = None
        for i in range(12):
            env.step(0)
            try:
                env.snapshot()
            except gym_fork.errors.UnsupportedEnvError as e:
                refused = (i, str(e))
                break
        assert refused is not None, "the shrinking set was never noticed"
        assert "env.left (a set whose order changes when it is pickled)" in refused[1]
        assert "sorted(" in refused[1] and "backend='criu'" in refused[1]
        left = set(env.unwrapped.left)
        env.step(0)  # untouched: it steps on from where it was
        assert len(env.unwrapped.left) < len(left)
    finally:
        env.close()
    env = gym_fork.ForkableEnv(agent_envs.goals_left, backend="criu")
    try:
        env.reset(seed=0)
        for _ in range(refused[0] + 1):
            env.step(0)
        snap = env.snapshot()
        first = [step(env, 0) for _ in range(4)]
        env.restore(snap)
        assert_same_traj(first, [step(env, 0) for _ in range(4)])
    finally:
        env.close()


@pytest.mark.parametrize("fork_tier", [True, False], ids=["fork-tier", "criu-dumps"])
def test_global_rng_env_exact_on_criu(fork_tier):
    """The worker process holds the global RNGs: copies are exact (the fork tier keeps `random`'s
    state, which Python reseeds in a forked child)."""
    env = gym_fork.ForkableEnv(agent_envs.global_rng, backend="criu", fork_tier=fork_tier)
    try:
        env.reset(seed=0)
        env.step(1)
        snap = env.snapshot()
        first = [step(env, a) for a in (0, 1, 2, 3, 0)]
        env.restore(snap)
        assert_same_traj(first, [step(env, a) for a in (0, 1, 2, 3, 0)])
        kid = env.fork(snap)[0]
        assert_same_traj(first, [step(kid, a) for a in (0, 1, 2, 3, 0)])
        kid.close()
    finally:
        env.close()


@pytest.mark.parametrize("fork_tier", [True, False], ids=["fork-tier", "criu-dumps"])
def test_temporary_file_names_continue_exactly(fork_tier):
    """``tempfile`` names (``NamedTemporaryFile``, ``mkstemp``, ...) continue as in the original:
    a fork-tier copy has another pid, where ``tempfile`` would seed its name generator afresh
    (its copies re-key it); a CRIU restore keeps the pid."""
    payload = "ForkPayload" if fork_tier else "CriuPayload"
    check_exact_and_isolated(agent_envs.temp_script, mechanism=payload, backend="criu", fork_tier=fork_tier)
    env = gym_fork.ForkableEnv(agent_envs.temp_script, backend="criu", fork_tier=fork_tier)
    try:  # a copy of a copy (a snapshot of a restored env), its ready copy, and explore()'s branches
        env.reset(seed=1)
        env.step(0)
        s1 = env.snapshot(restore_soon=True)
        env.step(1)
        env.restore(s1)
        env.step(2)
        s2 = env.snapshot(restore_soon=True)
        first = [step(env, a) for a in (0, 1, 2, 3)]
        time.sleep(0.1)  # the ready copy is forked after a quiet spell
        env.restore(s2)
        assert_same_traj(first, [step(env, a) for a in (0, 1, 2, 3)])
    finally:
        env.close()


def test_concurrent_branches_draw_the_same_temporary_names_in_private_scratch_dirs(tmp_path):
    """Branches that run at the same time draw the same ``tempfile`` names as the original (as
    CRIU restores always did): in a shared directory they would collide (``mkstemp`` then skips
    to the next name); with the scratch directory private, each branch has it to itself."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.temp_script_in, str(scratch)), backend="criu",
                               private_dirs=[str(scratch)])
    try:
        env.reset(seed=1)
        env.step(0)
        snap = env.snapshot()
        want = [step(env, a)[4]["script"] for a in (0, 1, 2, 3)]
        res = gym_fork.explore(env, snap, None, n_branches=3, actions=[[0, 1, 2, 3]] * 3, rng="same", progress=False)
        assert [b.final_info["script"] for b in res.branches] == [want[-1]] * 3
        assert os.listdir(scratch) == []  # the template is never written
    finally:
        env.close()


def test_ezpickle_instance_is_refused_with_the_fix():
    import gymnasium as gym

    inst = gym.make("LunarLander-v3")
    inst.reset(seed=0)
    with pytest.raises(gym_fork.errors.EnvNotShippableError, match=r"EzPickle.*ForkableEnv\('LunarLander-v3'\)"):
        gym_fork.ForkableEnv(inst)
    with pytest.raises(gym_fork.errors.EnvNotShippableError, match="EzPickle"):
        gym_fork.ForkableEnv(inst, backend="pickle")
    inst.close()


def test_an_instance_whose_sets_would_reorder_in_the_worker_is_refused():
    """The worker is another process, where strings hash differently: an instance holding a set
    of names would iterate it there in another order than here. Refused with the fix (a
    factory); the same env built by a factory in the worker is exact as ever."""
    inst = agent_envs.ItemsInViewEnv()
    inst.reset(seed=0)
    with pytest.raises(gym_fork.errors.EnvNotShippableError,
                       match=r"env\.items \(a set of strs, whose order follows the hash seed\).*factory"):
        gym_fork.ForkableEnv(inst)
    check_exact_and_isolated(agent_envs.items_in_view)


def test_plain_instance_still_ships():
    import gymnasium as gym

    inst = gym.make("CartPole-v1")
    inst.reset(seed=4)
    env = gym_fork.ForkableEnv(inst, backend="criu")
    try:
        obs, *_ = env.step(0)  # the instance's state (reset with seed 4) arrived
        obs2, *_ = inst.step(0)
        assert obs.tobytes() == obs2.tobytes()
    finally:
        env.close()
        inst.close()


def test_children_after_fork_tier_snapshots_move_them_out():
    """Snapshots taken before the env had a child are copy-on-write processes in the worker's tree;
    the first whole-tree dump writes them as CRIU images first. All stay exact."""
    env = gym_fork.ForkableEnv(agent_envs.pipe_child)
    try:
        s0 = env.snapshot()  # before reset(): no child yet, a fork-tier snapshot
        assert s0.size_bytes == 0
        env.action_space.seed(1)
        env.reset(seed=4)
        env.step(1)
        s1 = env.snapshot()  # the child is there: a CRIU dump of the tree (s0 written out first)
        assert s1.size_bytes > 0
        xs = [env.action_space.sample() for _ in range(6)]
        first = [step(env, x) for x in xs]
        env.restore(s0)
        env.reset(seed=4)
        env.step(1)
        assert_same_traj(first, [step(env, x) for x in xs])  # s0 restores (from its images) exactly
        env.restore(s1)
        assert_same_traj(first, [step(env, x) for x in xs])
    finally:
        env.close()


def test_an_env_forked_before_it_starts_children_says_why_it_cannot_be_dumped_with_them():
    """The price of forks that outlive their parent's crash (env._spare_namespace): the parent
    moved to a copy when its snapshot was first copied into another env, and a copy cannot be
    CRIU-dumped with child processes it starts later. That is refused, plainly, with the fix;
    the fork and the parent's earlier snapshot stay usable."""
    env = gym_fork.ForkableEnv(agent_envs.pipe_child)
    try:
        s0 = env.snapshot()  # before reset(): no child yet, a fork-tier snapshot
        [kid] = env.fork(s0, 1)
        env.reset(seed=4)  # the child starts
        env.step(1)
        with pytest.raises(UncapturableStateError, match=r"moved to one when a snapshot of it was first copied.*"
                                                         r"fork_tier=False"):
            env.snapshot()
        env.step(0)  # the env runs on
        kid.reset(seed=4)
        kid.step(1)
        kid.close()
        env.restore(s0)
    finally:
        env.close()


def test_restore_away_from_a_clone_with_children_leaves_none(monkeypatch):
    """A copy-on-write clone that started a child is replaced by a restore (killed, not asked to
    close, nor retired to stop its children itself later): its env's child goes with it."""
    from gym_fork.backends.base import RemoteHandle

    killed = []
    kill = RemoteHandle.kill
    monkeypatch.setattr(RemoteHandle, "kill", lambda self: (killed.append(self.pid), kill(self))[1])
    env = gym_fork.ForkableEnv(agent_envs.redis_unix)  # redis-server does not stop with its client
    try:
        s0 = env.snapshot()  # before reset(): a fork-tier snapshot
        env.restore(s0)  # the worker is now a clone (not its namespace's init)
        env.reset(seed=0)  # starts redis-server
        env.step(1)
        pids = _tree(env.worker_pid)
        assert len(pids) >= 2
        clone = env._handle.pid
        assert env._handle.chan.spawned  # the worker said so: a restore kills it (and them) at once
        env.restore(s0)  # the clone is killed, not retired (RemoteHandle.retire)
        assert clone in killed
        assert_gone(pids)
    finally:
        env.close()


_KILLED_CONTROLLER = r'''
import os, sys
sys.path.insert(0, sys.argv[1])
import agent_envs, gym_fork
env = gym_fork.ForkableEnv(getattr(agent_envs, sys.argv[2]), backend="criu", private_network=sys.argv[2] == "redis_tcp")
env.reset(seed=0)
env.step(1)
if sys.argv[3] == "snapshot":
    snap = env.snapshot()  # a tree dump (the env has a child), or a frozen copy of a plain worker
    env.step(0)
print(env.worker_pid, flush=True)
sys.stdin.read()  # until killed
'''


@pytest.mark.parametrize("kind,after", [("pipe_child", "start"), ("pipe_child", "snapshot"), ("redis_tcp", "snapshot")])
def test_a_killed_controller_leaves_no_env_process(kind, after):
    """kill -9 of the learner: its worker gets EOF and stops, killing its env's children too (the
    worker is PID 1 of its own namespace: it must kill them by their numbers there)."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.Popen([sys.executable, "-c", _KILLED_CONTROLLER, here, kind, after], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        worker = int(p.stdout.readline())
        pids = _tree(worker)
        assert len(pids) >= 2, pids  # the worker and the env's child
    finally:
        p.kill()
        p.wait()
    assert_gone(pids)


_KILLED_IN_HOLD = r'''
import glob, os, signal, sys
sys.path.insert(0, sys.argv[1])
import agent_envs, gym_fork
from gym_fork.criu import images

env = gym_fork.ForkableEnv(agent_envs.PipeChildEnv, backend="criu", workspace=sys.argv[2])
env.reset(seed=0)
env.step(1)
snap = env.snapshot()  # a tree dump: the env has a child
env.step(0)
old = env.worker_pid

def killed(images_dir):  # inside the restore, criu done: the tree it restored is ours, held
    kids = set()
    for path in glob.glob("/proc/self/task/*/children"):
        try:  # (a thread of the restore may end between the glob and the open)
            with open(path) as f:
                kids.update(int(p) for p in f.read().split())
        except FileNotFoundError:
            continue
    print(" ".join(str(k) for k in kids - {old}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

images.stopped_at_dump = killed
env.restore(snap)
'''


def test_a_controller_killed_while_a_restored_tree_is_held_leaves_no_process(tmp_path):
    """kill -9 of the learner in the middle of a workspace env's CRIU restore, after criu left
    the restored tree stopped (its tools wait until the workspace is back) and before it let the
    worker go: a stopped worker never sees its channel's EOF, and the tree stayed stopped for
    good. The worker is continued first now, so it sees the EOF and ends its tree."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    (tmp_path / "ws").mkdir()
    p = subprocess.Popen([sys.executable, "-c", _KILLED_IN_HOLD, here, str(tmp_path / "ws")],
                         stdout=subprocess.PIPE, text=True)
    try:
        restored = [int(x) for x in p.stdout.readline().split()]
        assert restored, "the restore never reached the hold"
        pids = set().union(*(_tree(r) for r in restored))
        assert len(pids) >= 2, pids  # the restored worker and the env's child
    finally:
        p.kill()
        p.wait()
    assert_gone(pids)


# --- logs the env keeps open ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["a", "w"], ids=["append-mode", "write-mode"])
@pytest.mark.parametrize("fork_tier", [True, False], ids=["fork-tier", "criu-dumps"])
def test_a_log_the_env_holds_open_is_appended_to_by_every_copy(tmp_path, fork_tier, mode):
    """A file declared in ``untracked_paths`` that the env keeps open for writing (a
    ``logging.FileHandler``: ``"a"``; SB3's Monitor: ``"w"``) is a log, not a reason to refuse the
    snapshot: every copy appends its lines -- a CRIU-restored copy too, not over what was written
    after the dump -- and the env's own trajectory is exact."""
    path = str(tmp_path / "agent.log")
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.log_to, path, mode), untracked_paths=[path],
                               fork_tier=fork_tier)
    env.reset(seed=0)
    for a in (1, 2):
        env.step(a)
    snap = env.snapshot()
    assert type(snap._payload).__name__ == ("ForkPayload" if fork_tier else "CriuPayload")
    want = [step(env, 3) for _ in range(3)]
    env.restore(snap)
    assert_same_traj([step(env, 3) for _ in range(3)], want)
    [kid] = env.fork(snap, 1)
    kid.step(0)
    kid.close()
    env.step(1)
    env.close()
    with open(path) as f:
        lines = f.read().splitlines()
    after = [f"step {t} action 3" for t in (3, 4, 5)]
    assert lines == ["step 1 action 1", "step 2 action 2", *after, *after, "step 3 action 0", "step 6 action 1"]


def _logging_env_at_step_2(tmp_path, fork_tier, factory, *args):
    """An env logging a line per step to ``agent.log`` (declared untracked), stepped with actions
    1 and 2, and a snapshot there: ``(the log's path, env, snapshot)``."""
    path = str(tmp_path / "agent.log")
    env = gym_fork.ForkableEnv(functools.partial(factory, path, *args), untracked_paths=[path], fork_tier=fork_tier)
    env.reset(seed=0)
    for a in (1, 2):
        env.step(a)
    return path, env, env.snapshot()


@pytest.mark.parametrize("fork_tier", [True, False], ids=["fork-tier", "criu-dumps"])
def test_lines_still_in_pythons_buffer_reach_a_log_once(tmp_path, fork_tier):
    """Lines the env wrote to its log but Python had not flushed were part of the memory every
    copy got: the original and each copy flushed them, and the log held each line written before
    the snapshot once per copy. The worker now flushes a log's buffer before a copy is made."""
    path, env, snap = _logging_env_at_step_2(tmp_path, fork_tier, agent_envs.log_to, "a", False)
    kids = env.fork(snap, 2)
    for i, kid in enumerate(kids):
        kid.step(3 + i)
        kid.close()  # (closing the env closes its file: what it wrote is flushed)
    env.step(0)
    env.close()
    with open(path) as f:
        lines = f.read().splitlines()
    assert sorted(lines) == ["step 1 action 1", "step 2 action 2", "step 3 action 0", "step 3 action 3",
                             "step 3 action 4"]
    assert lines[:2] == ["step 1 action 1", "step 2 action 2"]


@pytest.mark.parametrize("fork_tier", [True, False], ids=["fork-tier", "criu-dumps"])
def test_an_abandoned_branchs_lines_still_reach_its_log(tmp_path, fork_tier):
    """A restore stops the worker it replaces (CRIU's are killed): the lines that branch had
    written but Python had not flushed were lost with it, where an env dropped in the learner's
    process flushes them when collected. Its log now holds them."""
    path, env, snap = _logging_env_at_step_2(tmp_path, fork_tier, agent_envs.log_to, "a", False)
    env.step(3)  # the branch the restore abandons
    env.restore(snap)
    env.step(0)
    env.close()
    with open(path) as f:
        assert f.read().splitlines() == ["step 1 action 1", "step 2 action 2", "step 3 action 3", "step 3 action 0"]


@pytest.mark.parametrize("fork_tier", [True, False], ids=["fork-tier", "criu-dumps"])
def test_records_a_memory_handler_buffers_for_a_log_reach_it_once(tmp_path, fork_tier):
    """A ``logging`` ``MemoryHandler`` in front of a log: its buffered records were copied into
    every fork and restored copy (each wrote them again: 3x here) and lost with the branch a
    restore abandoned. Each record now reaches the log once."""
    from collections import Counter

    path, env, snap = _logging_env_at_step_2(tmp_path, fork_tier, agent_envs.memory_log_to)
    for i, kid in enumerate(env.fork(snap, 2)):
        kid.step(3 + i)
        kid.close()
    env.step(0)  # abandoned by the restore
    env.restore(snap)
    env.step(2)
    env.close()
    with open(path) as f:
        lines = f.read().splitlines()
    assert Counter(lines) == Counter(["step 1 action 1", "step 2 action 2", "step 3 action 3", "step 3 action 4",
                                      "step 3 action 0", "step 3 action 2"])
    assert lines[:2] == ["step 1 action 1", "step 2 action 2"]


def test_a_file_held_open_for_writing_is_a_log_only_when_declared_and_write_only(tmp_path):
    """Undeclared, a file held open for writing still refuses a snapshot, and the message names
    ``untracked_paths``; declared but open for reading too (the env may read back what it wrote),
    it is state and refused as such. The env runs on after each refusal."""
    from gym_fork.errors import UncapturedFilesError

    path = str(tmp_path / "agent.log")
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.log_to, path), fork_tier=True)
    env.reset(seed=0)
    env.step(0)
    with pytest.raises((UncapturableStateError, UncapturedFilesError), match="untracked_paths"):
        env.snapshot()
    env.step(1)
    env.close()
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.log_to, path, "r+"), untracked_paths=[path],
                               fork_tier=True)
    env.reset(seed=0)
    env.step(0)
    with pytest.raises(UncapturableStateError, match=r"agent\.log \(a log open for reading too"):
        env.snapshot()
    env.step(1)
    env.close()


def test_a_copy_of_an_env_that_ran_tools_says_how_it_ended():
    """A copy of an env that has run processes of its own is PID 1 of a namespace of its own,
    made through a short-lived process that exits at once: the copy is then its frozen
    snapshot's by adoption, and its end was written down as an unknown orphan's, which the
    learner could not tie to its worker (gym_fork.worker.exits). The frozen snapshot now knows
    it by its pid in its own namespace."""
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.tool_exit, "count"), fork_tier=True)
    try:
        env.reset(seed=0)
        env.step(1)  # a tool ran: from now on, copies are namespace inits
        snap = env.snapshot()
        assert type(snap._payload).__name__ == "ForkPayload"
        env.restore(snap)
        assert env._handle.ns_root
        pid = env.worker_pid
        # (SIGKILL: a namespace init ignores signals it has no handler for, a kill's SIGSEGV too)
        os.kill(pid, signal.SIGKILL)
        assert eventually(lambda: not os.path.exists(f"/proc/{pid}"))  # collected: no zombie to read it from
        with pytest.raises(WorkerDiedError, match="killed by SIGKILL"):
            env.step(0)
        env.restore(snap)
        env.step(0)
    finally:
        env.close()


# --- how the env handles SIGCHLD -----------------------------------------------------------------------

@pytest.mark.parametrize("handler", ["ignore", "count"], ids=["SIG_IGN", "python-handler"])
@pytest.mark.parametrize("fork_tier", [True, False], ids=["fork-tier", "criu-dumps"])
def test_the_envs_own_sigchld_handling_continues_in_every_copy(tmp_path, fork_tier, handler):
    """A frozen snapshot handles SIGCHLD its own way (it collects its copies and writes down how
    they ended: gym_fork.worker.exits); the copies it forks -- restores, ``fork()`` children,
    and the process a persisted snapshot dumps -- must handle it as the env did. With SIG_IGN
    every tool's exit status reads 0; a copy left with SIG_DFL read the real ones (3 instead of
    0) and a Python handler never ran there."""
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.tool_exit, handler), fork_tier=fork_tier)
    env.reset(seed=0)
    env.step(1)
    snap = env.snapshot()
    assert type(snap._payload).__name__ == ("ForkPayload" if fork_tier else "CriuPayload")
    want = [step(env, 2) for _ in range(3)]
    assert want[0][0][1] == (0.0 if handler == "ignore" else 3000.0 + 2)
    env.restore(snap)
    assert_same_traj([step(env, 2) for _ in range(3)], want)
    [kid] = env.fork(snap, 1)
    assert_same_traj([step(kid, 2) for _ in range(3)], want)
    kid.close()
    loaded = gym_fork.load_snapshot(snap.save(str(tmp_path / "bundle")))  # a fork-tier one is dumped first
    env.restore(loaded)
    assert_same_traj([step(env, 2) for _ in range(3)], want)
    env.close()


# --- arrays that share memory --------------------------------------------------------------------------

@pytest.mark.parametrize("masked", [False, True], ids=["ndarray", "masked-array"])
def test_pickle_refuses_arrays_that_share_memory(masked):
    """A NumPy view kept beside the array it looks into (``self.row = self.grid[1]``) is pickled as
    an array of its own: after a restore, writes through the view no longer reached the grid, and
    the env went on differently -- while the first-snapshot check passed (both pickled copies were
    alike, and alike wrong). Every pickle snapshot now refuses it, naming both; an instance holding
    it is not shipped to a worker; process snapshots copy it exactly. The same for an ``ndarray``
    subclass (a masked array), which the check passed over."""
    factory = functools.partial(agent_envs.grid_view, masked)
    env = gym_fork.ForkableEnv(factory, backend="pickle")
    try:
        env.reset(seed=0)
        env.step(1)
        with pytest.raises(gym_fork.errors.UnsupportedEnvError,
                           match=r"env\.grid and env\.row \(arrays over the same memory.*self\.grid\[1\] at each use"):
            env.snapshot()
        assert env.step(2)[0][1] == 3.0  # untouched: the view still writes into the grid (1 + 2)
    finally:
        env.close()
    inst = agent_envs.grid_view(masked)
    inst.reset(seed=0)
    with pytest.raises(gym_fork.errors.EnvNotShippableError, match=r"env\.grid and env\.row"):
        gym_fork.ForkableEnv(inst)
    for fork_tier in (True, False):
        env = gym_fork.ForkableEnv(factory, fork_tier=fork_tier)
        try:
            env.reset(seed=0)
            env.step(1)
            snap = env.snapshot()
            want = [step(env, 2) for _ in range(3)]
            assert [float(o[1]) for o, *_ in want] == [3.0, 5.0, 7.0]
            env.restore(snap)
            assert_same_traj([step(env, 2) for _ in range(3)], want)
        finally:
            env.close()


# --- files the branches of explore() would share -------------------------------------------------------

def test_explore_refuses_branches_that_wrote_a_file_they_share(tmp_path):
    """Every branch runs a shell tool appending to one log outside any workspace and reads back
    how long it is: side by side, each branch sees the others' lines, so its returns are not its
    own. The branches are never snapshotted, so nothing looked: explore() returned them as if
    they were exact. Now it refuses, naming the file; declared untracked, the file is the user's
    business and explore() runs."""
    from gym_fork.errors import UncapturedFilesError

    log = str(tmp_path / "tool.log")
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.shell_log, log, True))
    try:
        env.reset(seed=0)
        snap = env.snapshot()  # before the tool ever ran: nothing to refuse yet
        with pytest.raises(UncapturedFilesError, match=r"explore\(\): branch \d+ wrote .*tool\.log.*untracked_paths") as ei:
            gym_fork.explore(env, snap, lambda obs: 0, n_branches=4, horizon=3)
        assert ei.value.paths == [log]
        with open(log) as f:
            assert len(f.readlines()) == 12  # the premise: 4 branches x 3 steps, one file
        env.step(0)  # the env explored steps on
    finally:
        env.close()
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.shell_log, log, True), untracked_paths=[log])
    try:
        env.reset(seed=0)
        res = gym_fork.explore(env, None, lambda obs: 0, n_branches=4, horizon=3)
        assert len(res.branches) == 4
    finally:
        env.close()


def test_a_set_iterating_by_memory_address_is_warned_about_at_the_first_snapshot():
    """No snapshot can copy an env exactly when it iterates a set of objects hashed by address
    (the order follows where objects lie in memory). The process backends cannot refuse what
    they cannot see used, so the first snapshot of a lineage warns, naming the set; later ones
    and envs without such a set say nothing."""
    import warnings

    env = gym_fork.ForkableEnv(agent_envs.entities, fork_tier=True)
    try:
        env.reset(seed=0)
        with pytest.warns(RuntimeWarning, match=r"env\.ents \(a set of Entity objects, hashed by their address"):
            env.snapshot()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            env.snapshot()
            [kid] = env.fork()  # the same lineage
            kid.snapshot()
            kid.close()
    finally:
        env.close()
    env = gym_fork.ForkableEnv(agent_envs.goals_left, fork_tier=True)  # a set of numbers: no hazard
    try:
        env.reset(seed=0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            env.snapshot()
    finally:
        env.close()


# --- hooks the env runs after a fork ---------------------------------------------------------------------

def test_an_env_hook_run_after_fork_makes_snapshots_process_dumps():
    """A generator the env reseeds in every forked child (``os.register_at_fork``) was reseeded
    in every fork-tier copy -- restores, fork() children, explore() branches -- and the original
    never: each went on with other noise, silently. The scan now reports hooks it does not know:
    ``fork_tier='auto'`` takes CRIU dumps (no hook runs), ``fork_tier=True`` refuses naming it."""
    env = gym_fork.ForkableEnv(agent_envs.fork_safe_rng)  # fork_tier="auto"
    try:
        env.reset(seed=0)
        env.step(0)
        snap = env.snapshot()
        assert type(snap._payload).__name__ == "CriuPayload"
        want = [step(env, 1) for _ in range(3)]
        env.restore(snap)
        assert_same_traj([step(env, 1) for _ in range(3)], want)
        [kid] = env.fork(snap)
        assert_same_traj([step(kid, 1) for _ in range(3)], want)
        kid.close()
    finally:
        env.close()
    assert_snapshot_refused(agent_envs.fork_safe_rng, r"ForkSafeRNGEnv\._reseed \(os\.register_at_fork", fork_tier=True)
    # hooks that only clear a cache or reset a library's locks keep the fork tier
    env = gym_fork.ForkableEnv(agent_envs.cache_clearing_hook)
    try:
        env.reset(seed=0)
        env.step(0)
        assert type(env.snapshot()._payload).__name__ == "ForkPayload"
    finally:
        env.close()


def test_a_cache_a_library_clears_after_fork_comes_back_as_the_original_holds_it():
    """Fork-tier copies are forked without Python's after-fork hooks (no hook runs in the
    original either). A cache that its library clears in a forked child (a hook known to be
    harmless, so the env keeps the fork tier) was cleared in the snapshot's process when the
    snapshot was taken: every restored copy and ``fork()`` child went on with an empty cache,
    and the sizes it showed differed from the original's, silently."""
    env = gym_fork.ForkableEnv(agent_envs.cached_lookup, fork_tier=True)
    try:
        env.reset(seed=0)
        for _ in range(5):
            step(env, 1)
        snap = env.snapshot()
        assert type(snap._payload).__name__ == "ForkPayload"
        want = [step(env, 2) for _ in range(3)]
        assert want[0][0][1] == 6.0  # the cache's size: five entries before the snapshot, one more
        env.restore(snap)
        assert_same_traj([step(env, 2) for _ in range(3)], want)
        [kid] = env.fork(snap)
        try:
            assert_same_traj([step(kid, 2) for _ in range(3)], want)
        finally:
            kid.close()
    finally:
        env.close()


def test_without_root_a_pty_of_the_envs_own_is_refused_with_the_reason():
    """CRIU in a user namespace cannot mount the devpts instance a restore of ptys needs: the
    snapshot is refused up front (not a restore that fails later)."""
    from gym_fork.backends.treecapture import check_tree
    from gym_fork.worker.resources import Resource, Scan

    scan = Scan(pid=42, ns_init=True, fork_processes=[], tree=[42, 43], resources=[
        Resource("pty", 42, "pty 0 (master end) between processes of the env", "criu", 5),
        Resource("child", 43, "process 43 (bash)", "criu")])
    with pytest.raises(UncapturableStateError, match="only by CRIU as root"):
        check_tree(scan, criu_ok=True, private_network=False, root=False)
    assert check_tree(scan, criu_ok=True, private_network=False) == [r.what for r in scan.resources]


def test_a_process_pool_of_the_fork_start_method():
    """Tool calls in a ``ProcessPoolExecutor`` ('fork' context): its process with its own state,
    the executor's threads, pipes and unlinked semaphores are one tree, which a CRIU dump
    captures (exact and isolated: each copy has its own pool process)."""
    check_exact_and_isolated(agent_envs.process_pool)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_process_pools_with_semaphores_in_dev_shm_are_refused_with_the_fix(method):
    """The 'spawn' and 'forkserver' start methods keep their semaphores in /dev/shm, where any
    process may open them and a restored copy would share them: refused, saying to use the 'fork'
    context; the env runs on."""
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.process_pool, method))
    try:
        env.reset(seed=0)
        env.step(1)
        with pytest.raises(UncapturableStateError, match=r"/dev/shm/sem\.mp-\S+ \(a multiprocessing semaphore\).*"
                                                         r"get_context\('fork'\)") as info:
            env.snapshot()
        assert "shared-memory shared memory" not in str(info.value)
        env.step(2)
    finally:
        env.close()


def test_a_server_child_whose_log_was_opened_without_append(tmp_path):
    """A tool server started with its output in a log opened with "w" (not append), which only the
    child holds (the env's ``with open(...)`` closed its own): declared untracked, it was refused
    ("a restored copy would write over what was written after the snapshot"). The worker now
    switches the child's file description to append mode (a copy of its descriptor through
    ``pidfd_getfd``), so every copy appends: exact, isolated, and no line overwritten."""
    log = str(tmp_path / "server.log")
    check_exact_and_isolated(functools.partial(agent_envs.server_log, log), untracked_paths=[log])
    with open(log) as f:
        lines = f.read().splitlines()
    assert lines and all(line.startswith("request ") and " -> " in line for line in lines), lines


@pytest.mark.parametrize("how", ["flock", "lockf"])
@pytest.mark.parametrize("fork_tier", ["auto", False], ids=["auto", "criu-dumps"])
def test_a_file_lock_held_between_steps_is_refused_by_name(tmp_path, how, fork_tier):
    """A lock the env keeps between steps would be every copy's at once (a fork-tier copy shares a
    flock; a POSIX lock is not inherited by fork at all), and CRIU refused the dump with its own
    words ("Some file locks are hold by dumping tasks"). Refused by name, with the fix; the env
    runs on and keeps its lock."""
    import fcntl

    path = str(tmp_path / "cache.lock")
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.locked_file, path, how), fork_tier=fork_tier)
    try:
        env.reset(seed=0)
        env.step(1)
        with pytest.raises(UncapturableStateError, match=rf"{path} \(locked: {'FLOCK' if how == 'flock' else 'POSIX'} "
                                                         r"WRITE\).*take the lock inside a step"):
            env.snapshot()
        env.step(2)
        with open(path, "a+") as f:  # still the env's
            with pytest.raises(OSError):
                (fcntl.flock if how == "flock" else fcntl.lockf)(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        env.close()


def _proc_file_env():
    import gymnasium as gym

    class ProcStatReader(gym.Env):
        """Keeps its own /proc/PID/stat open (as a monitor might); action 1 closes it."""

        observation_space = gym.spaces.Box(-1e9, 1e9, (1,), np.float64)
        action_space = gym.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.stat = open("/proc/self/stat", "rb")  # noqa: SIM115 - held on purpose
            self.t = 0
            return np.array([0.0]), {}

        def step(self, action):
            if action == 1 and self.stat is not None:
                self.stat.close()
                self.stat = None
            self.t += 1
            return np.array([float(self.t)]), 0.0, False, False, {}

    return ProcStatReader()


def test_a_proc_pid_file_held_at_a_dump_is_dumped_again_or_refused(monkeypatch):
    """CRIU reopens a file under /proc/PID/ by that path at restore, where the restored tree has a
    PID namespace of its own: the restore failed ("Can't open file proc/PID/stat on restore"). A
    CI run caught redis-server mid-read of its /proc/PID/stat (it reads it every 100 ms): that
    snapshot could never be restored. Now a dump that finds one is taken again; a file held for
    good is refused at the snapshot, naming it, and the env steps on."""
    from gym_fork.criu import client
    from gym_fork.errors import SnapshotError

    env = gym_fork.ForkableEnv(_proc_file_env, backend="criu", fork_tier=False)
    try:
        env.reset(seed=0)
        with pytest.raises(SnapshotError, match=r"holds /proc/[0-9]+/stat open"):
            env.snapshot()
        env.step(1)  # untouched; closes it
        real, calls = client.files_held, []

        def once(images_dir, held_paths=()):  # caught mid-read at the first dump only
            calls.append(images_dir)
            return (["/proc/1/stat"], []) if len(calls) == 1 else real(images_dir, held_paths)

        monkeypatch.setattr(client, "files_held", once)
        snap = env.snapshot()
        assert len(calls) == 2
        env.step(0)
        env.restore(snap)
        assert step(env, 0)[0][0] == 2.0
    finally:
        env.close()


@pytest.mark.parametrize("how", ["thread", "alarm"])
@pytest.mark.parametrize("op", ["restore", "fork"])
def test_a_file_written_between_steps_by_a_thread_or_a_signal_handler(tmp_path, how, op):
    """The env's own thread (or a SIGALRM handler on a timer it armed) writes a file outside any
    workspace 0.2 s after a step. The controller asked the worker again before going back only
    when the env had started processes: a restore or fork then went on from the file as written
    later, silently. A worker with another thread or an armed timer now says so with its reply,
    and the write is refused at the restore/fork like a child's (found by an audit)."""
    from gym_fork.errors import UncapturedFilesError

    path = str(tmp_path / "state.txt")
    with open(path, "w") as f:
        f.write("ORIGINAL")
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.late_writer, path, how), backend="criu")
    try:
        env.reset(seed=0)
        env.step(0)
        snap = env.snapshot()
        for a in (1, 0):
            env.step(a)  # (the 3rd step arms the writer)
        time.sleep(0.6)
        with open(path) as f:
            assert f.read() == "LATE"
        with pytest.raises(UncapturedFilesError, match="state.txt"):
            env.restore(snap) if op == "restore" else env.fork(snap)
        assert env.step(1)[4]["data"] == "LATE"  # untouched: it runs on
    finally:
        env.close()


@pytest.mark.parametrize("how", ["python", "shell"])
def test_a_file_in_dev_shm_is_refused_like_any_outside_file(how):
    """/dev/shm is a tmpfs of ordinary files, but both the audit hook and the kernel watch
    skipped everything under /dev: an env (or its shell) appending to /dev/shm/x restored and
    forked with the file as it was later, and forked copies shared it -- silently. Its writes
    are refused now, naming the file and the fix (found by an audit)."""
    from gym_fork.errors import UncapturedFilesError

    path = f"/dev/shm/gym-fork-test-{os.getpid()}-{how}.txt"
    open(path, "w").close()
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.shared_memory_file, path, how), backend="criu")
    try:
        env.reset(seed=0)
        env.step(1)
        with pytest.raises(UncapturedFilesError, match=path):
            env.snapshot()
        assert env.step(2)[4]["data"] == "12"  # untouched: it runs on
    finally:
        env.close()
        os.unlink(path)


def test_a_workspace_written_by_a_thread_while_it_is_snapshotted_is_refused(tmp_path):
    """The workspace is copied after the CRIU dump, when the env's processes run again: a thread
    that keeps a file in step with its memory wrote it meanwhile, and a restored copy found the
    file ahead of its memory (counter 11, file 10), silently; some such snapshots could never be
    restored ("bad size"). The files' stat signatures before the dump and after the copy now
    tell: such a snapshot is taken again once, then refused naming the file (found by an audit)."""
    ws = str(tmp_path / "ws")
    os.makedirs(ws)
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.workspace_thread, ws), workspace=ws, backend="criu")
    try:
        env.reset(seed=0)
        env.step(0)
        with pytest.raises(UncapturableStateError, match=r"(changed|holds file) .*count\.txt.*only\s+(inside|during a)\s+step"):
            env.snapshot()
        assert env.step(1)[0][1] == 0.0  # untouched: it runs on
    finally:
        env.close()
