"""Fault tests: servers that refuse a restored connection (real redis-server, real CRIU).

What gym_fork must show, case by case:

* **The server is not part of the env** (another process's Redis, over TCP or a unix socket): the
  other side of the connection is never snapshotted, so a copy could only be wrong.  Every
  snapshot, ``fork()`` and migration is refused up front with ``UncapturableStateError`` naming
  the peer (address or pid) and the fix; the env keeps running, untouched.
* **The server is the env's child and resets the connection a restored copy holds** (``CLIENT
  KILL``, or the copy's server dies): the copy's next ``step()`` raises the env's own
  ``redis.ConnectionError`` (its type kept across the process boundary) when its client does not
  reconnect, or, when it does, continues exactly (the copy's server still holds the copy's data).
  The original and the other branches are never affected; a restore brings the copy back.
* **The original's server dies between snapshot and restore**: the original's step raises, the
  snapshot still holds its own server, and a restore continues exactly.

Afterwards no process and no network namespace of any copy is left.
"""

from __future__ import annotations

import functools
import os
import re
import signal

import pytest
import redis
from conftest import assert_same_traj, process_states
from test_agent_envs import _netns_fds, _tree, assert_gone, step

import agent_envs
import gym_fork
from gym_fork.backends.netns import in_netns
from gym_fork.errors import UncapturableStateError

pytestmark = pytest.mark.criu


@pytest.fixture
def outside_redis(tmp_path):
    """A redis-server that is the test's child, not the env's: on a free TCP port of this network
    namespace and on a unix socket path."""
    port, sock = agent_envs.free_port(), str(tmp_path / "outside.sock")
    proc = agent_envs.start_redis(port=port, unix_socket=sock)
    try:
        agent_envs.wait_until(lambda: _ping(port))
        yield proc, port, sock
    finally:
        proc.kill()
        proc.wait()


def _ping(port: int) -> bool:
    with redis.Redis(host="127.0.0.1", port=port) as db:
        return db.ping()


def _total(port: int) -> int:
    with redis.Redis(host="127.0.0.1", port=port) as db:
        return int(db.get("total"))


@pytest.mark.parametrize("opts", [{}, {"backend": "criu", "fork_tier": False}], ids=["auto", "criu-dumps"])
def test_outside_server_over_tcp_is_refused_naming_the_peer(outside_redis, opts):
    proc, port, _sock = outside_redis
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.ExternalRedisEnv, port=port), **opts)
    try:
        env.reset(seed=0)
        env.step(1)
        total = _total(port)
        with pytest.raises(UncapturableStateError, match=rf"-> 127\.0\.0\.1:{port} .*outside the env's process tree") as ei:
            env.snapshot()
        peers = [r for r in ei.value.resources if r.detail.get("peer") == f"127.0.0.1:{port}"]
        assert peers and all(r.capture == "none" and r.pid == env.worker_pid for r in peers)
        with pytest.raises(UncapturableStateError, match=f"127.0.0.1:{port}"):
            env.fork()
        # nothing was copied: the env's next step is the very next write to the one server
        obs, *_ = env.step(2)
        after = _total(port)
        assert after >= total + 2 and obs[1] == after * 100 + 1 + 2
        assert proc.poll() is None  # the outside server was not touched
    finally:
        env.close()
    assert proc.poll() is None  # and closing the env does not stop another process's server


def test_outside_server_over_unix_socket_is_refused_with_private_network(outside_redis):
    """A private network does not make a server outside the env part of it: a unix socket path
    reaches across network namespaces, and the peer is named by pid."""
    proc, _port, sock = outside_redis
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.ExternalRedisEnv, unix_socket=sock), private_network=True)
    try:
        env.reset(seed=0)
        env.step(1)
        with pytest.raises(UncapturableStateError, match=rf"connected to process\(es\) \[{proc.pid}\] outside the env"):
            env.snapshot()
        env.step(2)
    finally:
        env.close()


def test_outside_server_migration_is_refused_before_anything_moves(outside_redis, agent):
    proc, port, _sock = outside_redis
    env = gym_fork.ForkableEnv(functools.partial(agent_envs.ExternalRedisEnv, port=port))
    try:
        env.reset(seed=0)
        env.step(1)
        pid = env.worker_pid
        with pytest.raises(UncapturableStateError, match=f"127.0.0.1:{port}"):
            env.migrate(agent.target["B"], token=agent.token)
        assert env.worker_pid == pid and agent.agents["B"].children() == []
        env.step(3)  # still the local worker, on the same server
    finally:
        env.close()


# --- the env's own server resets the connection a restored copy holds ---------------------------

def _server(env) -> int:
    """Host pid of the redis-server below ``env``'s worker."""
    for pid in process_states(env.worker_pid, tree=True):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "redis-server":
                    return pid
        except OSError:
            continue
    raise LookupError(f"no redis-server below {env.worker_pid}")


def _admin(env, fn):
    """``fn(client)`` on a fresh admin connection to the Redis of ``env``'s copy, from inside that
    copy's own network namespace (the same address 127.0.0.1:6391 is another server in each copy)."""
    def run():
        db = redis.Redis(host="127.0.0.1", port=6391)
        try:
            return fn(db)
        finally:
            db.close()

    return in_netns(f"/proc/{env.worker_pid}/ns/net", run)


def _env_client_ids(db) -> set[int]:
    me = db.client_id()
    return {int(c["id"]) for c in db.client_list(_type="normal")} - {me}


def _reset_connection(env, *, then_require_auth: bool = False) -> set[int]:
    """The copy's server closes every client connection but the admin's (and, with
    ``then_require_auth``, refuses new ones that do not authenticate); returns their ids."""
    def kill(db):
        ids = _env_client_ids(db)
        if then_require_auth:
            db.config_set("requirepass", "only-the-admin-knows")
        assert db.client_kill_filter(_type="normal", skipme=True) == len(ids) >= 1
        return ids

    return _admin(env, kill)


def _kill_server(env) -> int:
    pid = _server(env)
    os.kill(pid, signal.SIGKILL)
    assert_gone({pid})
    return pid


def _started(factory, xs_n: int = 8):
    ns_before = _netns_fds()
    env = gym_fork.ForkableEnv(factory, private_network=True)
    env.action_space.seed(4)
    env.reset(seed=9)
    for _ in range(4):
        env.step(env.action_space.sample())
    xs = [int(env.action_space.sample()) for _ in range(xs_n)]
    return env, xs, ns_before


@pytest.mark.parametrize("fault", ["reconnect-refused", "server-killed"])
def test_restored_copy_whose_server_refuses_raises_the_env_error(fault):
    """The copy's server drops the restored connection and refuses a new one (it now requires a
    password), or dies: the faulty copy's step raises redis.ConnectionError (AuthenticationError
    is one), as the env's own type; the original and the sibling branch go on exactly; a restore
    brings the faulty copy back."""
    env, xs, ns_before = _started(agent_envs.redis_tcp_no_retry)
    pids: set[int] = set()
    kids: list = []
    try:
        snap = env.snapshot()
        kids = env.fork(snap, 2)
        pids = _tree(env.worker_pid) | _tree(kids[0].worker_pid) | _tree(kids[1].worker_pid)
        half = len(xs) // 2
        orig = [step(env, x) for x in xs[:half]]
        sib = [step(kids[1], x) for x in xs[:half]]
        assert_same_traj(orig, [step(kids[0], x) for x in xs[:half]])
        if fault == "reconnect-refused":
            _reset_connection(kids[0], then_require_auth=True)
        else:
            _kill_server(kids[0])
        with pytest.raises(redis.exceptions.ConnectionError) as ei:
            kids[0].step(xs[half])
        assert isinstance(ei.value, gym_fork.errors.WorkerError)  # and still gym_fork's, with the remote traceback
        if fault == "reconnect-refused":
            assert isinstance(ei.value, redis.exceptions.AuthenticationError)
            assert "NOAUTH" in str(ei.value) or "Authentication" in str(ei.value)
        else:
            assert re.search(r"Connection (refused|reset by peer|closed by server)", str(ei.value))
        assert "redis" in ei.value.remote_traceback
        orig += [step(env, x) for x in xs[half:]]
        sib += [step(kids[1], x) for x in xs[half:]]
        assert_same_traj(orig, sib)
        kids[0].restore(snap)  # its own server (and data) again, in a fresh namespace
        pids |= _tree(kids[0].worker_pid)
        assert_same_traj(orig, [step(kids[0], x) for x in xs])
    finally:
        for k in kids:
            k.close()
        env.close()
    assert_gone(pids)
    assert _netns_fds() == ns_before


def test_restored_copy_reconnects_and_stays_exact():
    """A client that reconnects (redis-py's default retries): the copy's server dropped the
    connection, the client opens a new one to the copy's own server (the same address in the
    copy's namespace), and the continuation is bit-identical; the other copies see nothing."""
    env, xs, ns_before = _started(agent_envs.redis_tcp)
    kids: list = []
    pids: set[int] = set()
    try:
        snap = env.snapshot()
        kids = env.fork(snap, 2)
        pids = _tree(env.worker_pid) | _tree(kids[0].worker_pid) | _tree(kids[1].worker_pid)
        before = _reset_connection(kids[0])
        sib_before = _admin(kids[1], _env_client_ids)
        orig, faulty, sib = [], [], []
        for x in xs:
            faulty.append(step(kids[0], x))
            orig.append(step(env, x))
            sib.append(step(kids[1], x))
        assert_same_traj(orig, faulty)
        assert_same_traj(orig, sib)
        after = _admin(kids[0], _env_client_ids)
        assert after and not after & before  # it really is a new connection
        assert _admin(kids[1], _env_client_ids) == sib_before  # the sibling kept its restored one
    finally:
        for k in kids:
            k.close()
        env.close()
    assert_gone(pids)
    assert _netns_fds() == ns_before


def test_original_server_killed_between_snapshot_and_restore():
    env, xs, ns_before = _started(agent_envs.redis_tcp_no_retry)
    pids: set[int] = set()
    try:
        snap = env.snapshot()
        pids = _tree(env.worker_pid)
        first = [step(env, x) for x in xs]
        killed = _kill_server(env)
        with pytest.raises(redis.exceptions.ConnectionError):
            env.step(0)
        env.restore(snap)  # the snapshot holds a server of its own
        pids |= _tree(env.worker_pid)
        assert _server(env) != killed
        assert_same_traj(first, [step(env, x) for x in xs])
    finally:
        env.close()
    assert_gone(pids)
    assert _netns_fds() == ns_before
