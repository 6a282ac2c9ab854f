"""Ctrl-C in the middle of a call (a notebook's "interrupt", a signal handler that raises).

The worker got the request and runs it all the same; its reply waits in the channel and is read
and dropped by the next request.  What the env accounts for must follow the worker: a step the
worker took and the env did not count left ``steps`` and the recorded actions a step behind, so
a snapshot's ``actions`` replayed elsewhere gave another state, silently.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time

import gymnasium as gym
import numpy as np
import pytest

import gym_fork
from gym_fork.testing import interrupts as testing_interrupts

from conftest import campaign as load_campaign, eventually, same

SLOW = 99  # the action that takes a while: the alarm interrupts it


class SlowStepEnv(gym.Env):
    """Counts steps; action 99 (and a reset with options={"slow": True}) takes 0.6 s; action 98
    raises."""

    observation_space = gym.spaces.Box(-1e9, 1e9, (2,), np.float64)
    action_space = gym.spaces.Discrete(100)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if options and options.get("slow"):
            time.sleep(0.6)
        self.t = 0
        self.total = float(self.np_random.integers(1000))
        return self._obs(), {}

    def step(self, action):
        if action == 98:
            raise ValueError("action 98 is refused")
        if action == SLOW:
            time.sleep(0.6)
        self.t += 1
        self.total = self.total * 1.5 + action
        return self._obs(), 1.0, False, self.t >= 50, {}

    def _obs(self):
        return np.array([self.t, self.total], dtype=np.float64)


@contextlib.contextmanager
def interrupt_after(seconds: float):
    """Raise KeyboardInterrupt in this thread after ``seconds`` (as Ctrl-C does); the block must
    be interrupted."""
    with pytest.raises(KeyboardInterrupt), testing_interrupts.interrupt_after(seconds):
        yield


def _replayed(actions: list, seed: int = 3) -> np.ndarray:
    env = SlowStepEnv()
    obs, _ = env.reset(seed=seed)
    for a in actions:
        obs = env.step(a)[0]
    return obs


@pytest.fixture(params=[True, False], ids=["fork-tier", "criu-dumps"])
def env(request):
    e = gym_fork.ForkableEnv(SlowStepEnv, fork_tier=request.param, record_actions=True)
    e.reset(seed=3)
    yield e
    e.close()


@pytest.mark.criu
def test_an_interrupted_step_is_counted_when_the_worker_took_it(env):
    env.step(1)
    with interrupt_after(0.2):
        env.step(SLOW)
    assert same(env.step(2)[0], _replayed([1, SLOW, 2]))  # the worker took it
    snap = env.snapshot()
    assert env.steps == snap.steps == 3 and snap.actions == [1, SLOW, 2]  # before: 2, [1, 2]
    assert same(env.step(4)[0], _replayed(snap.actions + [4]))  # the actions replay the state


def test_a_step_the_in_process_env_raised_in_is_not_counted_after_step_send():
    """Before: with ``backend="pickle"`` the env's own exception comes as it is, not as a
    WorkerError, and step_receive() kept the step step_send() had counted: ``steps`` one ahead and
    the raising action in every later snapshot's ``actions``. step() never counted it."""
    env = gym_fork.ForkableEnv(SlowStepEnv, backend="pickle")
    try:
        env.reset(seed=3)
        env.step(1)
        env.step_send(98)
        with pytest.raises(ValueError, match="action 98 is refused"):
            env.step_receive()
        with pytest.raises(ValueError, match="action 98 is refused"):
            env.step(98)
        env.step_send(2)
        env.step_receive()
        assert env.steps == 2 and env.snapshot().actions == [1, 2]
    finally:
        env.close()


@pytest.mark.criu
def test_an_interrupted_step_that_the_env_refused_is_not_counted(env):
    env.step(1)
    env.step_send(98)
    time.sleep(0.3)  # (its error reply is there; the interrupt comes while receive waits on a slow one)
    with pytest.raises(gym_fork.errors.WorkerError):
        env.step_receive()
    assert env.steps == 1
    env.step_send(SLOW)
    with interrupt_after(0.2):
        env.step_receive()
    env.step(2)
    assert env.steps == 3 and env.snapshot().actions == [1, SLOW, 2]


@pytest.mark.criu
def test_an_interrupted_reset_starts_a_new_timeline(env):
    for a in (1, 2, 3):
        env.step(a)
    with interrupt_after(0.2):
        env.reset(seed=5, options={"slow": True})
    env.step(6)
    snap = env.snapshot()
    assert env.steps == snap.steps == 1 and snap.actions == [6]  # before: 4 steps, [1, 2, 3, 6]
    assert same(env.step(7)[0], _replayed([6, 7], seed=5))


@pytest.mark.criu
def test_an_interrupted_rollout_is_accounted_when_its_reply_comes(env):
    env.step(1)
    with interrupt_after(0.2):
        env.rollout([2, SLOW, 3])
    env.step(4)
    snap = env.snapshot()
    assert env.steps == snap.steps == 5 and snap.actions == [1, 2, SLOW, 3, 4]
    assert same(env.step(5)[0], _replayed(snap.actions + [5]))


def _interrupt_after(handle, method: str) -> None:
    """The next call of ``handle.<method>`` does its work, then raises KeyboardInterrupt (Ctrl-C
    landing right after the reply was read, or the request sent, before the env accounted for it)."""
    original = getattr(handle, method)

    def then_ctrl_c(*args):
        out = original(*args)
        delattr(handle, method)  # (once)
        del out
        raise KeyboardInterrupt

    setattr(handle, method, then_ctrl_c)


def _call_then_ctrl_c(env, call: str) -> None:
    """``call`` (step 2, step_send 2, reset seed 5, rollout [2, 3]), with Ctrl-C right after the
    handle did its part: the reply read (the request sent, for step_send)."""
    method = {"step": "request", "reset": "request", "step_send": "send", "rollout": "receive"}[call]
    _interrupt_after(env._handle, method)
    with pytest.raises(KeyboardInterrupt):
        if call == "step":
            env.step(2)
        elif call == "step_send":
            env.step_send(2)
        elif call == "reset":
            env.reset(seed=5)
        else:
            env.rollout([2, 3])


@pytest.mark.criu
@pytest.mark.parametrize("call", ["step", "step_send", "reset", "rollout"])
def test_an_interrupt_right_after_the_reply_is_read_is_settled(env, call, monkeypatch):
    """Before: Ctrl-C between a reply's read (or a step_send()'s send) and the env's accounting
    left the step uncounted (or the reset unrecorded) for good -- nothing was pending any more, so
    nothing asked the worker -- and every later snapshot's ``actions`` replayed to another state.
    Settling asks the worker; the channel is resynced (a marker, then 20 ms of quiet) only when a
    reply may still be on its way: after step_send(), not after a reply was read whole."""
    from gym_fork.worker.channel import Channel

    resyncs = []
    skip_to = Channel.skip_to
    monkeypatch.setattr(Channel, "skip_to", lambda self, *a, **k: (resyncs.append(a), skip_to(self, *a, **k))[1])
    env.step(1)
    _call_then_ctrl_c(env, call)
    assert env.steps == {"step": 2, "step_send": 2, "reset": 0, "rollout": 3}[call]  # (asks the worker)
    assert len(resyncs) == (call == "step_send")
    if call == "step_send":  # given up: its reply is not read by step_receive()
        with pytest.raises(RuntimeError, match="nothing to receive"):
            env.step_receive()
    env.step(4)
    snap = env.snapshot()
    want = {"step": [1, 2, 4], "step_send": [1, 2, 4], "reset": [4], "rollout": [1, 2, 3, 4]}[call]
    assert (env.steps, snap.steps, snap.actions) == (len(want), len(want), want)
    assert same(env.step(7)[0], _replayed(want + [7], seed=5 if call == "reset" else 3))


@pytest.mark.criu
def test_an_interrupted_rollout_that_came_back_to_the_same_step_count_is_settled(env):
    """Before: settling an interrupted rollout compared the worker's step count with the env's. A
    rollout that crossed an episode end (the worker resets and goes on) and stopped at the count
    the env had before it looked like one that never ran: its steps were never accounted for, and
    snapshots' ``actions`` were those of the episode before (here [1, 1] instead of [7, 8])."""
    env.step(1)
    env.step(1)
    _interrupt_after(env._handle, "receive")  # the reply read, not yet accounted for
    with pytest.raises(KeyboardInterrupt):
        env.rollout([5] * 48 + [7, 8], stop_at_done=False)  # step 50 truncates: reset, then 2 steps
    assert env.steps == 2
    snap = env.snapshot()
    assert (snap.steps, snap.actions, snap.parent_id) == (2, [7, 8], None)
    assert same(env.step(9)[0][0], 3.0)


@pytest.mark.criu
def test_a_rollout_interrupted_before_it_was_sent_after_a_restore_accounts_nothing(env):
    """The worker names each rollout, and settling accounts for the one it names unless the env
    did already. A restored copy's last rollout is one from before the snapshot, which the env
    may no longer have as its last; so a snapshot makes the worker forget its last rollout, and
    a rollout interrupted before it was sent (nothing ran) accounts for nothing, even after a
    restore."""
    env.rollout([1, 2], stop_at_done=False)
    snap = env.snapshot()
    env.rollout([3, 4], stop_at_done=False)
    env.restore(snap)
    handle = env._handle
    send = handle._send

    def ctrl_c_first(*args):
        del handle._send  # (once)
        raise KeyboardInterrupt

    handle._send = ctrl_c_first
    with pytest.raises(KeyboardInterrupt):
        env.rollout([5, 6], stop_at_done=False)
    assert handle._send == send
    assert env.steps == 2
    snap2 = env.snapshot()
    assert (snap2.steps, snap2.parent_id, snap2.actions) == (2, snap.id, [])
    assert same(env.step(7)[0], _replayed([1, 2, 7]))


class HalfStepEnv(SlowStepEnv):
    """A step that updates its state in two halves, with action 99's wait between them."""

    def step(self, action):
        self.t += 1
        if action == SLOW:
            time.sleep(0.6)
        self.total = self.total * 1.5 + action
        return self._obs(), 1.0, False, self.t >= 50, {}


def test_an_in_process_env_cut_by_ctrl_c_in_its_own_code_refuses_to_go_on_until_reset():
    """``backend="pickle"`` runs the env in this process: Ctrl-C stops the env's own code where it
    is, here between the two halves of a step. Before, the env went on from that half-updated
    state, uncounted: a snapshot said 1 step while its pickled env had taken 2, so replaying its
    ``actions`` gave another state, silently. Now every call that would go on from it (a step, a
    rollout, a snapshot) raises IncompleteStepError, saying to reset() or restore() first; reads
    still answer."""
    env = gym_fork.ForkableEnv(HalfStepEnv, backend="pickle")
    try:
        env.reset(seed=3)
        snap = env.snapshot()
        env.step(1)
        with interrupt_after(0.2):
            env.step(SLOW)
        assert env.unwrapped.t == 2 and env.steps == 1  # half a step taken, not counted
        for call in (lambda: env.step(2), lambda: env.rollout([2]), env.snapshot, lambda: env.fork()):
            with pytest.raises(gym_fork.errors.IncompleteStepError, match=r"reset\(\) .*or restore\(\)"):
                call()
        assert env.steps == 1 and env.unwrapped.t == 2  # nothing went on
        env.restore(snap)  # a whole state again
        assert same(env.step(4)[0], _replayed([4]))
        with interrupt_after(0.2):
            env.step(SLOW)
        env.reset(seed=5)  # or a reset
        assert same(env.step(4)[0], _replayed([4], seed=5))
        assert env.snapshot().actions == [4]
    finally:
        env.close()


@pytest.mark.parametrize("call", ["step", "step_send", "reset", "rollout"])
def test_an_interrupt_right_after_an_in_process_call_is_settled(call):
    """``backend="pickle"``: Ctrl-C after the in-process env had done the call (its code whole),
    before the env accounted for it. Before: nothing settled it (there is no worker to ask), so
    the step stayed uncounted for good (found by ``scripts/ctrl_c_campaign.py --pickle``: 1 seed
    in 8). Now the next request asks this process's env first, as a worker is asked."""
    env = gym_fork.ForkableEnv(SlowStepEnv, backend="pickle")
    try:
        env.reset(seed=3)
        env.step(1)
        _call_then_ctrl_c(env, call)
        assert env.steps == {"step": 2, "step_send": 2, "reset": 0, "rollout": 3}[call]
        env.step(4)
        snap = env.snapshot()
        want = {"step": [1, 2, 4], "step_send": [1, 2, 4], "reset": [4], "rollout": [1, 2, 3, 4]}[call]
        assert (env.steps, snap.steps, snap.actions) == (len(want), len(want), want)
        assert same(env.step(7)[0], _replayed(want + [7], seed=5 if call == "reset" else 3))
    finally:
        env.close()


class EchoEnv(gym.Env):
    """Each observation names the step it answers: ``[t, action, a running hash of the actions]``."""

    observation_space = gym.spaces.Box(-1e12, 1e12, (3,), np.float64)
    action_space = gym.spaces.Discrete(1000)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.h = 0, int(seed or 0)
        return np.array([0, -1, self.h], dtype=np.float64), {}

    def step(self, action):
        self.t += 1
        self.h = (self.h * 31 + int(action)) % 1_000_003
        return np.array([self.t, action, self.h], dtype=np.float64), 0.0, False, False, {}


@pytest.mark.criu
@pytest.mark.parametrize("ring", [False, True], ids=["socket", "ring"])
def test_interrupts_at_random_moments_never_hand_a_call_another_calls_reply(ring, monkeypatch):
    """Steps (also step_send + step_receive), rollouts and resets interrupted at random moments
    (5 us - 3 ms in): every call that returns must return its own answer -- the step it asked for,
    one past the last one seen (plus any the interrupted calls took) -- never a reply left over
    from an interrupted one; and the env's accounting must follow the worker's: its step count and
    recorded actions those the worker took since its reset. Before: one interrupt in a few hundred
    fell after the send and before the reply was marked pending, and from then on every call got
    the previous call's reply; and one in a few hundred (mostly in step_send) left a step the
    worker took out of ``steps`` and ``actions``."""
    from gym_fork.backends.base import RemoteHandle
    from gym_fork.worker import ring as rings
    from gym_fork.worker import ring_slots

    if ring:  # every step through the shared-memory ring, from the first
        monkeypatch.setattr(RemoteHandle, "RING_AFTER", 0)
        monkeypatch.setattr(rings, "wanted", lambda: True)
        monkeypatch.setattr(ring_slots, "claim", lambda: ring_slots.Slot(None))
    rng = np.random.default_rng(7)
    env = gym_fork.ForkableEnv(EchoEnv)
    interrupted = answered = 0
    t = 0  # the last step count seen
    unseen = 0  # how many interrupted steps may have run since
    seed = 1
    try:
        env.reset(seed=seed)
        for i in range(600):
            kind = rng.choice(["step", "step", "sendrecv", "rollout", "reset"])
            a = int(rng.integers(1000))
            # (with a ring: the first call after an interrupt opens a new one, ~1 ms)
            # every other call is interrupted, somewhere from 5 us to 3 ms in (log-uniform)
            delay = float(np.exp(rng.uniform(np.log(5e-6), np.log(3e-3)))) if i % 2 else 0.0
            try:
                with _alarm(delay):
                    if kind == "step":
                        out = env.step(a)[0]
                    elif kind == "sendrecv":
                        env.step_send(a)
                        out = env.step_receive()[0]
                    elif kind == "rollout":
                        res = env.rollout([a, (a + 1) % 1000])
                        out = res["final_obs"]
                    else:
                        out = env.reset(seed=a)[0]
            except KeyboardInterrupt:
                interrupted += 1
                unseen += 2 if kind == "rollout" else 1
                if kind == "reset":
                    t, unseen, seed = None, 0, None  # (it may or may not have run)
                handle = env._handle
                if kind == "sendrecv" and handle._pending and not handle._abandoned:
                    env.step_receive()  # (interrupted between step_send() and step_receive())
                continue
            answered += 1
            acts = env._actions
            assert env.steps == int(out[0]) == len(acts), f"call {i}: {kind}: {env.steps} steps, {len(acts)} " \
                f"actions recorded, the worker took {int(out[0])}"
            if kind == "reset":
                assert list(out) == [0, -1, a], f"call {i}: reset(seed={a}) answered {out}"
                t, unseen, seed = 0, 0, a
                continue
            if seed is not None:  # (the seed of the last reset is known)
                h = seed
                for x in acts:
                    h = (h * 31 + int(x)) % 1_000_003
                assert h == int(out[2]), f"call {i}: the recorded actions are not those the worker took"
            want = (a + 1) % 1000 if kind == "rollout" else a
            assert out[1] == want, f"call {i}: {kind} with action {want} answered {out} (another call's reply)"
            steps = 2 if kind == "rollout" else 1
            if t is not None:
                assert t + steps <= out[0] <= t + steps + unseen, f"call {i}: {kind} answered step {out[0]} after {t}"
            t, unseen = int(out[0]), 0
        print(f"{interrupted} calls interrupted, {answered} answered")
        assert interrupted > 50 and answered > 250, (interrupted, answered)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        env.close()


_alarm = testing_interrupts.interrupt_after  # KeyboardInterrupt from a SIGALRM handler, unless the block ends first


def _describe(pid: int) -> str:
    import subprocess

    return subprocess.run(["ps", "-o", "pid=,stat=,etime=,args=", "-p", str(pid)], capture_output=True,
                          text=True).stdout.strip() or f"{pid} (gone)"


def _children() -> set[int]:
    """This process's child processes (zombies included)."""
    import subprocess

    out = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


@pytest.mark.criu
def test_a_request_cut_from_its_descriptor_fails_alone_and_the_channel_stays_in_step():
    """A signal handler that raises (not Ctrl-C, which gym_fork holds back there) can cut a request
    from the descriptor sent after it: the step-ring offer. The worker then read the start of the
    next request (the resync marker) as the descriptor's byte, answered an error, and waited
    forever inside the marker's frame while the learner waited for its answer (CI, Python 3.13,
    the ring case of the test above). Now it reads those bytes again as the next request."""
    env = gym_fork.ForkableEnv(EchoEnv)
    try:
        env.reset(seed=1)
        chan = env._handle.chan
        chan.send(("ring", (300000,)))  # ... and no descriptor after it
        chan.send(("ping", ()))
        chan.sock.settimeout(20)  # (before: the second reply never came)
        try:
            cut = chan.recv()
            ping = chan.recv()
        finally:
            chan.sock.settimeout(None)
        assert cut[0] != 0 and "file descriptor" in cut[2], cut
        assert ping[0] == 0, ping
        assert env.step(5)[0][1] == 5  # and the env goes on, in step
    finally:
        env.close()


@pytest.mark.criu
def test_interrupted_criu_restores_dumps_and_forks_leave_nothing_behind():
    """Ctrl-C during a CRIU restore (a restore, a fork of 3) or a dump: criu finishes (the client
    waits for it), and what it made is not kept: no restored worker left to exit into a zombie
    nobody waits for (before: one per interrupted restore), no images left in the session
    directory. The env goes on, exact."""
    from gym_fork.snapshots import sessiondir

    rng = np.random.default_rng(3)
    env = gym_fork.ForkableEnv(EchoEnv, fork_tier=False)
    try:
        env.reset(seed=1)
        env.step(5)
        root = env.snapshot()
        after_root = env.step(6)[0]
        before = _children()
        interrupted = 0
        for i in range(24):
            kids = []
            try:
                with _alarm(float(rng.uniform(0.002, 0.15))):
                    if i % 3 == 0:
                        env.restore(root)
                    elif i % 3 == 1:
                        kids = env.fork(root, 3)
                    else:
                        env.snapshot().release()
            except KeyboardInterrupt:
                interrupted += 1
            for k in kids:
                k.close()
            env.step(7)
        assert interrupted >= 4, interrupted
        import gc

        gc.collect()  # (what an interrupted call held is freed: its workers' channels close)
        # (a worker whose channel closed exits by itself: it would be a zombie within moments; a
        # criu the client let go is reaped in the background -- on a loaded machine, not at once)
        def left() -> set[int]:
            return _children() - before - {env.worker_pid}  # (restored: the env's worker is our child)

        time.sleep(0.5)
        eventually(lambda: not left(), timeout=5, every=0.1)
        assert not left(), "left behind: " + "; ".join(_describe(p) for p in sorted(left()))
        tmp = [n for n in os.listdir(sessiondir.session_dir()) if n.endswith(".tmp")]
        assert tmp == []
        env.restore(root)
        assert same(env.step(6)[0], after_root)
    finally:
        env.close()


@pytest.mark.criu
def test_ctrl_c_right_after_a_dumps_directory_is_made_leaves_no_directory(monkeypatch):
    """Ctrl-C that comes just after a CRIU dump made its directory in the session dir, before
    criu runs: the snapshot is not taken and the directory is gone. Before, it stayed (the
    directory was made before the block that removes it on an interrupt; found by
    test_interrupted_criu_restores_dumps_and_forks_leave_nothing_behind, once in a few runs)."""
    from gym_fork.snapshots import sessiondir

    env = gym_fork.ForkableEnv(EchoEnv, fork_tier=False)
    try:
        env.reset(seed=1)
        env.step(5)
        made = sessiondir.private_mkdir

        def interrupted(path):  # Ctrl-C once the dump's directory exists, still inside the call
            made(path)
            if path.endswith(".tmp"):
                raise KeyboardInterrupt
            return path

        monkeypatch.setattr(sessiondir, "private_mkdir", interrupted)
        with pytest.raises(KeyboardInterrupt):
            env.snapshot()
        monkeypatch.undo()
        assert [n for n in os.listdir(sessiondir.session_dir()) if n.endswith(".tmp")] == []
        snap = env.snapshot()  # and the env goes on
        after = env.step(6)[0]
        env.restore(snap)
        assert same(env.step(6)[0], after)
    finally:
        env.close()


def test_ctrl_c_right_after_a_restores_directory_is_made_leaves_no_directory(monkeypatch):
    """Ctrl-C just after a CRIU restore made its work directory in the session dir, before criu
    runs: no ``restore-*`` directory is left, the env is where it was, and the next restore works.
    Before, the directory was made before the block that removes it."""
    from gym_fork.snapshots import sessiondir

    env = gym_fork.ForkableEnv(EchoEnv, fork_tier=False)
    try:
        env.reset(seed=1)
        env.step(5)
        snap = env.snapshot()
        at_snap = env.step(6)[0]
        before = env.step(7)[0]
        mkdir = os.mkdir

        def interrupted(path, *args, **kw):  # Ctrl-C once the restore's directory exists
            mkdir(path, *args, **kw)
            if os.path.basename(str(path)).startswith("restore-"):
                raise KeyboardInterrupt

        monkeypatch.setattr(os, "mkdir", interrupted)
        with pytest.raises(KeyboardInterrupt):
            env.restore(snap)
        monkeypatch.undo()
        assert [n for n in os.listdir(sessiondir.session_dir()) if n.startswith("restore-")] == []
        assert env.step(8)[0][1] == 8 and env.step(8)[0][0] == before[0] + 2  # (where it was)
        env.restore(snap)
        assert same(env.step(6)[0], at_snap)
    finally:
        env.close()


def test_ctrl_c_right_after_a_bundles_directory_is_made_leaves_no_directory(monkeypatch, tmp_path):
    """Ctrl-C just after ``save_snapshot`` made its bundle's temporary directory: nothing is left
    next to the bundle's path, no bundle is there, and the snapshot saves afterwards. Before, the
    directory was made before the block that removes it."""
    from gym_fork.snapshots import sessiondir

    env = gym_fork.ForkableEnv(EchoEnv, backend="pickle")
    try:
        env.reset(seed=1)
        env.step(5)
        snap = env.snapshot()
        made = sessiondir.private_mkdir

        def interrupted(path):  # Ctrl-C once the directory exists, still inside the call
            made(path)
            raise KeyboardInterrupt

        monkeypatch.setattr(sessiondir, "private_mkdir", interrupted)
        with pytest.raises(KeyboardInterrupt):
            snap.save(str(tmp_path / "b"))
        monkeypatch.undo()
        assert os.listdir(tmp_path) == []
        snap.save(str(tmp_path / "b"))
        assert os.listdir(tmp_path) == ["b"]
    finally:
        env.close()


class EndingEchoEnv(EchoEnv):
    """:class:`EchoEnv` whose episodes end after 5 steps."""

    def step(self, action):
        obs, reward, _terminated, truncated, info = super().step(action)
        return obs, reward, self.t == 5, truncated, info


@pytest.mark.criu
@pytest.mark.parametrize("api,ends", [("sb3", False), ("gymnasium", False), ("sb3", True), ("gymnasium", True)])
def test_an_interrupted_vector_step_asks_for_a_reset_and_never_mixes_replies(api, ends):
    """Ctrl-C in a vector env's step: some sub-envs stepped (and reset at an episode's end) and the
    caller holds none of their results. The next step raises IncompleteStepError until reset();
    after it, every sub-env answers its own action, and counts the steps its worker took. Before: the next step read the interrupted
    batch's replies (or was refused for good: its sends still held their channels). ``ends``:
    episodes end every 5 steps, and the workers reset right after such a step, in the same
    request (SB3's auto-reset; Gymnasium's in SAME_STEP mode): an interrupt may fall between."""
    from gymnasium.vector import AutoresetMode

    from gym_fork.errors import IncompleteStepError
    from gym_fork.vector import ForkableVectorEnv

    n = 3
    source = EndingEchoEnv if ends else EchoEnv
    if api == "sb3":
        pytest.importorskip("stable_baselines3")  # (the full suite's Python has it)
        from gym_fork.vec_env import ForkableVecEnv

        venv = ForkableVecEnv(source, n_envs=n)
    else:
        venv = ForkableVectorEnv([source] * n, autoreset_mode=AutoresetMode.SAME_STEP if ends else
                                 AutoresetMode.NEXT_STEP)
    rng = np.random.default_rng(11)

    def step(actions):
        """The observations, each with the action it answers put back where an episode ended
        (an episode's last observation, kept in the infos: the one returned starts the next)."""
        if api == "sb3":
            obs, _r, dones, infos = venv.step(np.array(actions))
            ended = [infos[j].get("terminal_observation") if dones[j] else None for j in range(n)]
        else:
            obs, _r, term, _trunc, infos = venv.step(np.array(actions))
            ended = [infos["final_obs"][j] if term[j] else None for j in range(n)]
        for j, final in enumerate(ended):
            if final is not None:
                assert final[0] == 5 and obs[j][0] == 0 and venv.envs[j].steps == 0
                obs[j] = final
        return obs

    try:
        venv.reset()
        interrupted = refused = answered = 0
        # Until every path was taken often enough: how many steps an alarm cuts depends on the load
        # (in CI, 168 of 200 once), so a fixed count of steps can leave too few answered to check.
        i = 0
        while (i < 400 or not (interrupted > 20 and refused > 5 and answered > 80)) and i < 3000:
            i += 1
            actions = [int(a) for a in rng.integers(1000, size=n)]
            try:
                with _alarm(float(np.exp(rng.uniform(np.log(5e-6), np.log(2e-3)))) if i % 2 else 0.0):
                    obs = step(actions)
            except KeyboardInterrupt:
                interrupted += 1
                continue
            except IncompleteStepError as e:  # (the step after one interrupted in the middle)
                assert "reset() first" in str(e)
                refused += 1
                venv.reset()
                continue
            answered += 1
            assert [int(o[1]) for o in obs] == actions, f"step {i}: {obs} for actions {actions}"
            for j, (o, env) in enumerate(zip(obs, venv.envs)):  # the accounting follows each worker
                if ends and o[0] == 5:  # (reset since: checked in step())
                    continue
                h = 0  # (every reset here is unseeded)
                for x in env._actions:
                    h = (h * 31 + int(x)) % 1_000_003
                assert (env.steps, len(env._actions), h) == (int(o[0]), int(o[0]), int(o[2])), \
                    f"step {i}: sub-env {j} counts {env.steps} steps, the worker took {int(o[0])}"
        assert interrupted > 20 and refused > 5 and answered > 80, (interrupted, refused, answered)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        venv.close()


@pytest.mark.criu
def test_an_interrupt_after_a_vector_reset_reply_is_read_is_settled():
    """Ctrl-C in ForkableVecEnv.reset() after a sub-env's reply was read: every worker reset, and
    each sub-env now counts from that reset. Before: the sub-env whose reply was read but not yet
    accounted kept its old count and actions, and the next step ran on without a word."""
    pytest.importorskip("stable_baselines3")
    from gym_fork.errors import IncompleteStepError
    from gym_fork.vec_env import ForkableVecEnv

    venv = ForkableVecEnv(EchoEnv, n_envs=2)
    try:
        venv.reset()
        venv.step(np.array([1, 2]))
        _interrupt_after(venv.envs[1]._handle, "receive")
        with pytest.raises(KeyboardInterrupt):
            venv.reset()
        with pytest.raises(IncompleteStepError, match="reset"):  # (the caller holds no observation)
            venv.step(np.array([3, 4]))
        assert [e.steps for e in venv.envs] == [0, 0] and [e._actions for e in venv.envs] == [[], []]
        obs = venv.step(np.array([3, 4]) if venv.reset() is not None else None)[0]
        assert [e.steps for e in venv.envs] == [int(o[0]) for o in obs] == [1, 1]
    finally:
        venv.close()


def _ctrl_c_inside(monkeypatch, owner, name: str) -> None:
    """The next call of ``owner.name`` gets Ctrl-C (SIGINT, as a terminal sends it) on entry,
    before it does its work: unheld, KeyboardInterrupt comes right there."""
    original = getattr(owner, name)

    def with_ctrl_c(*args, **kwargs):
        monkeypatch.setattr(owner, name, original)  # (once)
        os.kill(os.getpid(), signal.SIGINT)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, with_ctrl_c)


@pytest.mark.criu
def test_ctrl_c_while_a_restore_switches_workers_waits_until_the_switch_is_whole(env, monkeypatch):
    """Before: Ctrl-C between the switch to the restored worker and its bookkeeping left the env
    running the restored worker while it counted the old one's steps and actions (silently: the
    next snapshot's ``actions`` replayed elsewhere gave another state), the old worker left running."""
    from gym_fork.backends.base import RemoteHandle

    env.step(1)
    snap = env.snapshot()
    for a in (2, 3, 4):
        env.step(a)
    old = env._handle
    old_pid = old.pid
    _ctrl_c_inside(monkeypatch, RemoteHandle, "adopt_pace")  # (the first thing after the switch)
    with pytest.raises(KeyboardInterrupt):
        env.restore(snap)
    assert env._handle.pid != old_pid and env.steps == snap.steps == 1  # the restore is whole
    env.step(5)
    after = env.snapshot()
    assert after.actions == [5] and after.parent_id == snap.id
    assert same(env.step(6)[0], _replayed([1, 5, 6]))
    assert old.closed  # the old worker was let go, as after any restore


@pytest.mark.criu
def test_ctrl_c_while_a_frozen_snapshot_is_cloned_keeps_the_snapshot():
    """Ctrl-C between a ``clone`` request to a frozen snapshot and the descriptor sent after it:
    the exchange is made whole before KeyboardInterrupt comes (the frozen process must never wait
    for a descriptor that does not come), the restore completes before KeyboardInterrupt comes,
    and the snapshot still restores exactly."""
    from gym_fork.backends import criu as criu_backend

    env = gym_fork.ForkableEnv(SlowStepEnv, fork_tier=True)
    try:
        env.reset(seed=3)
        env.step(1)
        snap = env.snapshot()
        env.step(2)
        while True:  # take its ready copy (and any other) away: the next restore clones
            taken = criu_backend.CriuBackend._take_ready(snap._payload)
            if taken is None:
                break
            taken.kill()
        mp = pytest.MonkeyPatch()
        try:
            _ctrl_c_inside(mp, criu_backend, "send_fds")
            with pytest.raises(KeyboardInterrupt):
                env.restore(snap)
        finally:
            mp.undo()
        assert env.steps == 1 and same(env.step(3)[0], _replayed([1, 3]))  # the restore is whole
        env.restore(snap)  # and so is the snapshot
        assert same(env.step(4)[0], _replayed([1, 4]))
    finally:
        env.close()


# A Ctrl-C that lands in the hooks CPython runs around fork() (here: right after logging's, in the
# parent) raises inside a hook, where CPython reports it as "Exception ignored" and drops it.
_ctrl_c_in_fork_hook = {"armed": False}


def _ctrl_c_after_fork_in_parent() -> None:
    if _ctrl_c_in_fork_hook["armed"]:
        _ctrl_c_in_fork_hook["armed"] = False
        os.kill(os.getpid(), signal.SIGINT)


os.register_at_fork(after_in_parent=_ctrl_c_after_fork_in_parent)  # (a no-op unless armed)


def test_a_ctrl_c_during_the_pickle_checks_fork_is_raised_after_it_and_leaves_no_child():
    """``backend="pickle"`` checks a first snapshot against the original env, stepped in a
    ``fork()`` child of this process. A Ctrl-C inside that fork's hooks was lost (the snapshot
    went on: the user had to press it again; found by ``ctrl_c_campaign.py --pickle``'s
    "Exception ignored in _releaseLock"), and one between the fork and the wait for the child's
    answer left the child behind. Now it is held through the fork and raised after it: the
    snapshot stops, the child is gone, and the env steps on untouched."""
    env = gym_fork.ForkableEnv(EchoEnv, backend="pickle")
    try:
        env.reset(seed=3)
        env.step(7)
        before = set(_children_of_me())
        _ctrl_c_in_fork_hook["armed"] = True
        with pytest.raises(KeyboardInterrupt):
            env.snapshot()
        assert not _ctrl_c_in_fork_hook["armed"]  # (the hook fired)
        assert set(_children_of_me()) <= before
        assert env.steps == 1
        obs = env.step(9)[0]
        assert list(obs) == [2, 9, ((3 * 31 + 7) * 31 + 9) % 1_000_003]
        snap = env.snapshot()  # (checked again: the first check never finished)
        env.step(1)
        assert list(env.restore(snap)[0]) == list(obs)
    finally:
        _ctrl_c_in_fork_hook["armed"] = False
        env.close()


def _children_of_me() -> list[int]:
    me = os.getpid()
    with open(f"/proc/{me}/task/{me}/children") as f:
        return [int(p) for p in f.read().split()]


def _copies_besides(env) -> set[int]:
    """Worker processes below this test process, other than ``env``'s own worker."""
    from gym_fork.testing.campaigns import worker_processes

    return worker_processes() - {env.worker_pid}


def _ctrl_c_at(cls, name: str, monkeypatch, nth: int = 1) -> list:
    """Make the ``nth`` call of ``cls.name`` start with a real Ctrl-C (SIGINT to this process,
    as a terminal sends it); returns the list its calls are counted in."""
    real, calls = getattr(cls, name), []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == nth:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(cls, name, wrapped)
    return calls


@pytest.mark.criu
@pytest.mark.parametrize("where", ["fork: a child made", "explore: branches closed"])
def test_ctrl_c_while_branches_are_made_or_closed_leaves_no_copy_behind(where, monkeypatch):
    """Ctrl-C in fork() after some children were made (here: the second), or in explore()'s
    closing of its branches (here: the first's): the copies not yet returned, or not yet closed,
    lived on -- each waiting for requests nobody would send, also after the env and its snapshot
    were closed (found by a campaign of Ctrl-C at random moments of explore()). Now none is left,
    and the env steps on untouched."""
    from gym_fork.env import ForkableEnv

    env = gym_fork.make("CartPole-v1")
    ref = gym.make("CartPole-v1")
    try:
        for e in (env, ref):
            e.reset(seed=4)
            for a in (0, 1, 1):
                e.step(a)
        before = _copies_besides(env)  # (before the snapshot: its frozen process and ready copies go with it)
        snap = env.snapshot()
        if where.startswith("fork"):
            calls = _ctrl_c_at(ForkableEnv, "_from_handle", monkeypatch, nth=2)
            with pytest.raises(KeyboardInterrupt):
                env.fork(snap, 3)
        else:
            calls = _ctrl_c_at(ForkableEnv, "_begin_close", monkeypatch)
            with pytest.raises(KeyboardInterrupt):
                gym_fork.explore(env, snap, lambda o: int(o[2] > 0), n_branches=3, horizon=5, rng="same")
        assert len(calls) >= 2  # (the interrupt came where meant: after one child, inside the loop)
        monkeypatch.undo()
        snap.release()
        assert eventually(lambda: _copies_besides(env) <= before, timeout=5), _copies_besides(env) - before
        assert env.steps == 3
        assert same(env.step(0)[0], ref.step(0)[0])
    finally:
        env.close()
        ref.close()


def _cartpole(steps: int = 3):
    return gym.make("CartPole-v1", max_episode_steps=steps)


def test_ctrl_c_as_a_gymnasium_vector_slot_switches_leaves_the_slot_whole(monkeypatch):
    """Ctrl-C while a ForkableVectorEnv slot switched to its restored worker was raised as the
    switch ended, before the vector env recorded the slot's new state (found by
    ``scripts/ctrl_c_vector_campaign.py``): a slot whose episode had ended, restored to a
    mid-episode snapshot, kept its pending autoreset, and its next step reset the snapshot away.
    Now the interrupt comes after the record, and the slot goes on from the snapshot."""
    from gymnasium.vector import AutoresetMode

    from gym_fork.env import ForkableEnv
    from gym_fork.vector import ForkableVectorEnv

    envs = ForkableVectorEnv([_cartpole] * 2, autoreset_mode=AutoresetMode.NEXT_STEP)
    try:
        envs.reset(seed=0)
        envs.step(np.array([1, 1]))
        snap = envs.snapshot(1)  # mid-episode
        envs.step(np.array([1, 1]))
        envs.step(np.array([1, 1]))  # the episodes end (3 steps): both slots owe a reset
        assert envs.pending_reset.all()
        calls = _ctrl_c_at(ForkableEnv, "_switch_to", monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            envs.restore(0, snap)
        assert calls
        monkeypatch.undo()
        assert not envs.pending_reset[0], "slot 0 holds a mid-episode snapshot but would be reset"
        envs.restore(1, snap)  # (uninterrupted: the reference)
        obs = envs.step(np.array([0, 0]))[0]
        assert same(obs[0], obs[1]), "slot 0 did not go on from the snapshot"
    finally:
        envs.close()


@pytest.mark.parametrize("call", ["restore", "fork_into"])
def test_ctrl_c_as_an_sb3_vector_slot_switches_leaves_the_slots_whole(call, monkeypatch):
    """Ctrl-C while ForkableVecEnv slots switched to restored workers (found by
    ``scripts/ctrl_c_vector_campaign.py``): raised as the first slot's switch ended, it left
    ``current_obs`` -- what SB3 acts on next -- the old state's, and a fork_into's later slots
    never took their restored workers, which ran on with no owner. Now the interrupt comes once
    every slot has switched and recorded its observation."""
    pytest.importorskip("stable_baselines3")  # (the full suite's Python has it)
    from gym_fork.env import ForkableEnv
    from gym_fork.testing.campaigns import worker_processes
    from gym_fork.vec_env import ForkableVecEnv

    venv = ForkableVecEnv(functools.partial(_cartpole, 50), n_envs=3)
    try:
        venv.seed(0)
        venv.reset()
        venv.step(np.array([1, 1, 1]))
        snap = venv.snapshot(2)
        want = venv.current_obs[2].copy()
        venv.restore(2, snap)  # (slot 2 on a copy now: no switch of its own before the copies below)
        venv.step(np.array([0, 0, 0]))
        before = worker_processes()
        calls = _ctrl_c_at(ForkableEnv, "_switch_to", monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            venv.restore(0, snap) if call == "restore" else venv.fork_into(snap, [0, 1])
        assert calls
        monkeypatch.undo()
        slots = [0] if call == "restore" else [0, 1]
        for i in slots:
            assert same(venv.current_obs[i], want), f"slot {i}'s observation is not the snapshot's"
        for e in venv.envs:  # (a replaced worker is told to end with its slot's next request)
            e.get_wrapper_attr("_elapsed_steps")
        snap.release()
        owned = set(venv.worker_pids)
        assert eventually(lambda: worker_processes() - owned <= before - owned, timeout=5), \
            worker_processes() - owned - before
        obs = venv.step(np.array([1, 1, 1]))[0]
        assert same(obs[0], obs[slots[-1]])
    finally:
        venv.close()


@pytest.mark.parametrize("api", ["gymnasium", "sb3"])
def test_the_vector_ctrl_c_campaign_finds_nothing_on_a_seed(api):
    """``scripts/ctrl_c_vector_campaign.py`` on one seed (its own checks: every slot whole after
    each interrupted restore or fork_into, every step bit for bit the model's, no worker left):
    the campaign stays runnable, and what it found stays mended."""
    from gymnasium.vector import AutoresetMode

    campaign = load_campaign("ctrl_c_vector_campaign")
    with testing_interrupts.interrupt_after(0):  # (SIGALRM's handler put back after)
        if api == "gymnasium":
            bad, interrupted = campaign.run(campaign.Gymnasium, 4, 60, AutoresetMode.NEXT_STEP)
        else:
            pytest.importorskip("stable_baselines3")  # (the full suite's Python has it)
            bad, interrupted = campaign.run(campaign.SB3, 4, 60, None)
    assert bad == 0
    assert interrupted > 0  # (the SIGINTs came inside the calls)


@pytest.mark.criu
def test_ctrl_c_while_a_stored_snapshot_is_removed_leaves_no_files_and_releases_it(tmp_path, monkeypatch):
    """Ctrl-C in ``SnapshotStore.remove()`` after the entry was renamed aside (found by
    ``scripts/ctrl_c_campaign.py --store``): its files stayed in the store as an uncounted
    ``.tmp-rm-*`` directory until a ``gc()``, and its snapshot looked restorable. Now the removal
    ends whole before the interrupt is raised."""
    import shutil

    store = gym_fork.SnapshotStore(str(tmp_path / "store"))
    env = gym_fork.ForkableEnv("CartPole-v1", store=store)
    try:
        env.reset(seed=0)
        env.step(0)
        snap = env.snapshot()
        store.put(snap)
        calls = _ctrl_c_at(shutil, "rmtree", monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            store.remove(snap.id)
        assert calls
        monkeypatch.undo()
        assert not [n for n in os.listdir(store.path) if n.startswith(".tmp")], os.listdir(store.path)
        assert snap.id not in store.list()
        with pytest.raises(gym_fork.errors.RestoreError, match="removed from the store"):
            env.restore(snap)
        assert store.gc()["tmp_removed"] == 0
    finally:
        env.close()


@pytest.mark.criu
def test_the_migration_ctrl_c_campaign_finds_nothing_on_a_seed(agent):
    """``scripts/ctrl_c_migration_campaign.py`` on one seed against a real local agent: moves
    (stop and copy, live) cut by SIGINT at random moments leave the env answering what its history
    says wherever it runs, and no worker behind on either side once it is closed."""
    campaign = load_campaign("ctrl_c_migration_campaign")
    rng = np.random.default_rng(3)
    totals = np.zeros(3, int)
    with testing_interrupts.interrupt_after(0):  # (SIGALRM's handler put back after)
        for k in range(6):
            totals += campaign.round_(agent, rng, 3, k)
    bad, interrupted, moved = totals
    assert bad == 0
    assert interrupted > 0 and moved > 0, totals
