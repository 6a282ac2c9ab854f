"""Live migration of one env worker to a `gym-fork agent` (real CRIU, real agents as separate
processes, in network namespaces gfm* joined by a veth pair, or on loopback for fault proxies)."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time

import gymnasium as gym
import numpy as np
import pytest

import gym_fork
from gym_fork.migration import AgentUnreachableError, AuthenticationError, RemoteRestoreError, TransferError
from gym_fork.migration.client import NetworkHandle
from gym_fork.errors import MigratedEnvError
from gym_fork.testing.nodes import Nodes
from tests.conftest import assert_same_traj, run_actions

pytestmark = pytest.mark.criu
ENV = "LunarLander-v3"


def _actions(n: int, seed: int = 0) -> list[int]:
    return [int(a) for a in np.random.default_rng(seed).integers(0, 4, size=n)]


def _pair(prefix_actions: list[int]):
    """An env and a local reference, both stepped through the same prefix (mid-episode)."""
    envs = [gym_fork.make(ENV), gym_fork.make(ENV)]
    for e in envs:
        e.reset(seed=3)
        for a in prefix_actions:
            e.step(a)
    return envs


@pytest.fixture(scope="module")
def netnodes():
    with Nodes(["A", "B"]) as n:
        yield n
    assert not any(ns.startswith(n.prefix) for ns in subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


@pytest.fixture(scope="module")
def lo():
    with Nodes(["B"], use_netns=False) as n:
        yield n


def _clean(agent) -> None:
    """Nothing left behind on the agent: no child process, no received files."""
    def received() -> list[str]:
        return [d for d in os.listdir(agent.state_dir) if d.startswith("in-")]

    deadline = time.monotonic() + 10  # a transfer cut by the source is dropped when the agent notices
    while (agent.children() or received()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert agent.children() == [], "left on the agent: " + "; ".join(_describe(p) for p in agent.children())
    assert received() == []


def _describe(pid: int) -> str:
    """What a leftover process is (for the failure message): its command line, state and children."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        kids = subprocess.run(["ps", "-o", "pid=,stat=,args=", "--ppid", str(pid)], capture_output=True,
                              text=True).stdout.strip().replace("\n", " | ")
    except OSError as e:
        return f"{pid} ({e})"
    return f"{pid} [{state}] {cmd!r} children: {kids or 'none'}"


def test_migrate_mid_episode_bit_identical_across_netns(netnodes):
    env, ref = _pair(_actions(60))
    try:
        rep = env.migrate(netnodes.target["B"], token=netnodes.token, netns=netnodes.netns["A"])
        assert rep["node"] == "B" and rep["bytes"] > 1_000_000 and env.steps == 60
        if netnodes.use_netns:  # the restored worker lives in node B's network namespace
            assert os.stat(f"/proc/{rep['pid']}/ns/net").st_ino == os.stat(f"/run/netns/{netnodes.netns['B']}").st_ino
        acts = _actions(150, seed=1)  # crosses episode ends: resets go over the network too
        assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
        assert env.unwrapped.continuous is False  # attribute access is relayed as well
        with pytest.raises(MigratedEnvError):
            env.snapshot()
    finally:
        env.close()
        ref.close()
    _clean(netnodes.agents["B"])


@pytest.fixture
def rings_at_once(monkeypatch):
    """Envs stepped one request at a time get their shared-memory step ring at the first step
    (by default only after 64, and only with a CPU free to spin on)."""
    from gym_fork.backends.base import RemoteHandle
    from gym_fork.worker import ring as rings
    from gym_fork.worker import ring_slots

    if not rings.supported():
        pytest.skip("step rings need x86-64 Linux")
    monkeypatch.setattr(RemoteHandle, "RING_AFTER", 0)
    monkeypatch.setattr(rings, "wanted", lambda: True)
    monkeypatch.setattr(ring_slots, "claim", lambda: ring_slots.Slot(None))  # whatever else runs


def _ring_pair(prefix_actions: list[int]) -> tuple:
    """An env stepping through its ring, and the same env stepped in this process (no gym_fork,
    no ring, no worker), both through the same prefix."""
    env = gym_fork.make(ENV)
    ref = gym.make(ENV)
    for e in (env, ref):
        e.reset(seed=3)
        run_actions(e, prefix_actions)
    assert env.step_path == "ring"
    return env, ref


def test_migrate_with_a_step_ring_open_is_bit_identical(netnodes, rings_at_once):
    """The source worker drops its ring before the dump (it is answering `resources`), so the
    image holds none; on the target steps go over the network, bit-identical to an env that
    never left this process. A migration that fails drops the ring too, and the env that stays
    here gets one again."""
    env, ref = _ring_pair(_actions(60))
    try:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()  # nothing listens there: this migration fails, the env stays here
        with pytest.raises(AgentUnreachableError):
            env.migrate(f"127.0.0.1:{port}", token="x")
        acts = _actions(40, seed=2)
        assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
        assert env.step_path == "ring"
        rep = env.migrate(netnodes.target["B"], token=netnodes.token, netns=netnodes.netns["A"])
        assert rep["node"] == "B" and env.step_path == "network"
        acts = _actions(150, seed=1)  # crosses episode ends
        assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
    finally:
        env.close()
        ref.close()
    _clean(netnodes.agents["B"])


def test_live_migration_with_a_step_ring_open_is_bit_identical(netnodes, rings_at_once):
    """While the snapshot travels the env goes on stepping through its ring (the copy that is
    dumped was forked, and a fork drops the rings it inherits); the switch replays those steps
    on the target, bit-identical to an env that never left this process."""
    env, ref = _ring_pair(_actions(60))
    try:
        mig = env.migrate(netnodes.target["B"], token=netnodes.token, netns=netnodes.netns["A"], live=True)
        assert env.step_path == "ring"  # still stepping here, through the ring
        n = _step_until_done(env, ref, mig, _actions(20000, seed=1))
        rep = mig.result()
        assert rep["live"] and rep["replayed_ops"] >= n > 0 and env.step_path == "network"
        acts = _actions(150, seed=4)
        assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
    finally:
        env.close()
        ref.close()
    _clean(netnodes.agents["B"])


def test_agent_down_env_keeps_running():
    env, ref = _pair(_actions(30))
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    try:
        with pytest.raises(AgentUnreachableError, match=f"127.0.0.1:{port}"):
            env.migrate(f"127.0.0.1:{port}", token="x")
        acts = _actions(40, seed=2)
        assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
        env.snapshot()  # still a local, snapshottable env
    finally:
        env.close()
        ref.close()


def test_ctrl_c_right_after_the_migrations_directory_is_made_leaves_nothing_and_the_env_runs_on(monkeypatch):
    """Ctrl-C just after a migration made its images directory in the session dir (before its
    dump started): the directory is gone and the env goes on where it was, still snapshottable.
    Before, the directory was made before the block that removes it."""
    from gym_fork.snapshots import sessiondir

    env, ref = _pair(_actions(30))
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there: the connection would fail, after the interrupt
    made = sessiondir.private_mkdir

    def interrupted(path):  # Ctrl-C once the migration's directory exists, still inside the call
        made(path)
        if os.path.basename(path).startswith("mig-"):
            raise KeyboardInterrupt
        return path

    try:
        monkeypatch.setattr(sessiondir, "private_mkdir", interrupted)
        with pytest.raises(KeyboardInterrupt):
            env.migrate(f"127.0.0.1:{port}", token="x")
        monkeypatch.undo()
        assert [n for n in os.listdir(sessiondir.session_dir()) if n.startswith("mig-")] == []
        acts = _actions(40, seed=2)
        assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
        env.snapshot()
    finally:
        env.close()
        ref.close()


def test_wrong_token_refused_and_logged(lo):
    env, ref = _pair(_actions(30))
    try:
        with pytest.raises(AuthenticationError, match="refused"):
            env.migrate(lo.target["B"], token="not-the-token")
        acts = _actions(40, seed=2)
        assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
    finally:
        env.close()
        ref.close()
    assert "REFUSED" in lo.agents["B"].log()
    _clean(lo.agents["B"])


class _Proxy:
    """One-connection TCP proxy that cuts the client->agent stream after ``limit`` bytes
    (``mode="cut"``) or flips one byte there (``mode="flip"``)."""

    def __init__(self, upstream: str, limit: int, mode: str):
        host, port = upstream.rsplit(":", 1)
        self.up = (host, int(port))
        self.limit, self.mode = limit, mode
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.target = f"127.0.0.1:{self.srv.getsockname()[1]}"
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        c, _ = self.srv.accept()
        u = socket.create_connection(self.up)

        def back() -> None:
            try:
                while data := u.recv(65536):
                    c.sendall(data)
            except OSError:
                pass
            c.close()

        threading.Thread(target=back, daemon=True).start()
        seen = 0
        try:
            while data := c.recv(65536):
                if seen <= self.limit < seen + len(data):
                    if self.mode == "cut":
                        u.sendall(data[: self.limit - seen])
                        break
                    i = self.limit - seen
                    data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]
                seen += len(data)
                u.sendall(data)
        except OSError:
            pass
        for s in (u, c):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self.srv.close()


def test_transfer_cut_midway(lo):
    env, ref = _pair(_actions(30))
    proxy = _Proxy(lo.target["B"], 3_000_000, "cut")
    try:
        with pytest.raises(TransferError, match="broke"):
            env.migrate(proxy.target, token=lo.token)
        acts = _actions(40, seed=2)
        assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
    finally:
        env.close()
        ref.close()
    _clean(lo.agents["B"])
    assert "transfer cut" in lo.agents["B"].log()


@pytest.fixture(scope="module")
def lo_plain():
    """An agent on plain TCP (``--insecure``): a byte flipped on the wire reaches the agent's own
    checks (over TLS, TLS itself refuses it: tests/security)."""
    with Nodes(["B"], use_netns=False, insecure=True) as n:
        yield n


def test_image_corrupted_in_transfer_is_not_restored(lo_plain):
    lo = lo_plain
    env, ref = _pair(_actions(30))
    proxy = _Proxy(lo.target["B"], 12_000_000, "flip")  # inside the pages image
    try:
        with pytest.raises(RemoteRestoreError, match="sha256|corrupt") as ei:
            env.migrate(proxy.target, token=lo.token, insecure=True)
        assert ei.value.remote_type in ("SnapshotCorruptedError", "ReadError", "HeaderError")
        acts = _actions(40, seed=2)
        assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
    finally:
        env.close()
        ref.close()
    _clean(lo.agents["B"])


def test_no_disk_space_on_target(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "gfm-tmpfs", str(mnt)], check=True)
    try:
        with Nodes(["B"], use_netns=False) as n:
            ag = n.agents["B"]
            ag.stop()
            from gym_fork.testing.nodes import AgentProcess

            ag = AgentProcess("B", str(mnt / "state"), n.token_file, log_path=str(tmp_path / "b.log"))
            env, ref = _pair(_actions(30))
            try:
                with pytest.raises(RemoteRestoreError, match="bytes free") as ei:
                    env.migrate(ag.target, token=n.token)
                assert ei.value.remote_type == "NoSpaceError"
                acts = _actions(40, seed=2)
                assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
            finally:
                env.close()
                ref.close()
                _clean(ag)
                ag.stop()
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_tls_agent():
    with Nodes(["B"], use_netns=False, tls=True) as n:
        env, ref = _pair(_actions(20))
        try:
            with pytest.raises(AgentUnreachableError):  # a plain-TCP client cannot talk to a TLS agent
                env.migrate(n.target["B"], token=n.token, timeout=3, insecure=True)
            env.migrate(n.target["B"], token=n.token, tls=n.cert)
            acts = _actions(30, seed=4)
            assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
        finally:
            env.close()
            ref.close()
        _clean(n.agents["B"])


# --- whole-job live migration (gym-fork run + LiveMigrationCallback) ---------------------------------
import json  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

TRAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "migration_train.py")
TOTAL = 1536


def _lines(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(x) for x in f if x.startswith("{")]
    except OSError:
        return []


def _run_job(nodes, target: str, logd: str, at: int, *, train_args: tuple = (), run_args: tuple = (),
             total: int = TOTAL) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """`gym-fork run` of TRAIN on node A moving to ``target`` at ``at``; returns once the job ended
    (wherever it ran) with the supervisor's result and the job's JSON lines."""
    cmd = [sys.executable, "-m", "gym_fork.cli", "run", "--node", "A", "--log-dir", logd,
           "--token-file", nodes.token_file, *run_args, "--", sys.executable, TRAIN, "--target", target,
           "--at", str(at), "--total", str(total), *train_args]
    if nodes.netns.get("A"):
        cmd = ["nsenter", f"--net=/run/netns/{nodes.netns['A']}", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(x.get("done") for x in _lines(f"{logd}/stdout.log")):
        time.sleep(0.2)
    return r, _lines(f"{logd}/stdout.log")


@pytest.fixture(scope="module")
def reference_job(tmp_path_factory):
    """The same PPO job without migration: its final policy hash and timesteps."""
    out = subprocess.run([sys.executable, TRAIN, "--total", str(TOTAL)], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return [json.loads(x) for x in out.splitlines() if x.startswith("{")]


def test_job_live_migration_zero_lost_timesteps(netnodes, reference_job, tmp_path):
    r, lines = _run_job(netnodes, netnodes.target["B"], str(tmp_path / "logs"), at=700)
    assert r.returncode == 0, r.stderr
    assert "now runs on the target agent" in r.stdout
    src_pid = int(re.search(r"job pid (\d+)", r.stdout).group(1))
    assert not os.path.exists(f"/proc/{src_pid}")  # the source stopped (after the target confirmed)
    done = [x for x in lines if x.get("done")]
    assert done, lines[-3:]
    mig = done[0]["migrations"]
    assert [m["status"] for m in mig] == ["arrived"] and mig[0]["node"] == "B" and mig[0]["source"] == "A"
    assert mig[0]["timestep"] == 700 and mig[0]["bytes"] > 0 and mig[0]["downtime_s"] > 0
    # Zero lost timesteps, RNG and optimizer state continue exactly: same result as never moving.
    ref = [x for x in reference_job if x.get("done")][0]
    assert done[0]["timesteps"] == ref["timesteps"] == TOTAL
    assert done[0]["policy_sha"] == ref["policy_sha"]
    eps = [x for x in lines if "ret" in x]
    assert [(x["t"], x["ret"]) for x in eps] == [(x["t"], x["ret"]) for x in reference_job if "ret" in x]
    assert {x["node"] for x in eps if x["t"] > 700} == {"B"}
    _clean(netnodes.agents["B"])


def test_job_migration_failure_keeps_training(netnodes, reference_job, tmp_path):
    host = netnodes.target["B"].rsplit(":", 1)[0]
    r, lines = _run_job(netnodes, f"{host}:1", str(tmp_path / "logs"), at=500)  # no agent on port 1
    assert r.returncode == 0, r.stderr
    assert "failed" in r.stderr and "AgentUnreachableError" in r.stderr
    done = [x for x in lines if x.get("done")][0]
    assert done["migrations"][0]["status"] == "failed" and "AgentUnreachableError" in done["migrations"][0]["error"]
    ref = [x for x in reference_job if x.get("done")][0]
    assert (done["timesteps"], done["policy_sha"]) == (ref["timesteps"], ref["policy_sha"])


def _descendant_running(root: int, needle: bytes) -> int | None:
    """A process under ``root`` (up to 6 levels) whose command line holds ``needle``."""
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if needle not in f.read():
                    continue
            q = int(p)
            for _ in range(6):
                with open(f"/proc/{q}/stat") as f:
                    q = int(f.read().rsplit(")", 1)[1].split()[1])
                if q == root:
                    return int(p)
                if q <= 1:
                    break
        except (OSError, ValueError, IndexError):
            pass
    return None


def test_job_migration_to_a_slow_target_runs_one_copy(netnodes, reference_job, tmp_path):
    """The target restores the job, then is slow to answer (paused here 14 s: a large job's
    restore, a busy machine). The source gave up waiting for the verdict after its connection
    timeout (10 s) and trained on, while the target ran its restored copy too: two copies of one
    job, silently (found by an audit). Now the restored copy waits for the source's commit, and
    the source waits for the verdict: exactly one copy runs, and ends as the unmoved job does."""
    agent = netnodes.agents["B"]
    logd = str(tmp_path / "logs")
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(out=_run_job(netnodes, netnodes.target["B"], logd, at=700)))
    runner.start()
    paused = False
    try:
        deadline = time.monotonic() + 100
        while runner.is_alive() and time.monotonic() < deadline:
            if _descendant_running(agent.proc.pid, b"migration_train") is not None:
                os.kill(agent.proc.pid, signal.SIGSTOP)
                paused = True
                time.sleep(14)
                os.kill(agent.proc.pid, signal.SIGCONT)
                break
            time.sleep(0.002)
    finally:
        if paused:
            os.kill(agent.proc.pid, signal.SIGCONT)
        runner.join(200)
    assert paused, "the job never reached the target"
    r, lines = result["out"]
    time.sleep(2)  # (a second copy would still be writing)
    lines = _lines(f"{logd}/stdout.log")
    done = [x for x in lines if x.get("done")]
    assert len(done) == 1, [x.get("migrations") for x in done]
    assert [m["status"] for m in done[0]["migrations"]] == ["arrived"], done[0]["migrations"]
    ref = [x for x in reference_job if x.get("done")][0]
    assert (done[0]["timesteps"], done[0]["policy_sha"]) == (ref["timesteps"], ref["policy_sha"])
    assert {x["node"] for x in lines if "ret" in x and x["t"] > 700} == {"B"}
    _clean(agent)


# --- streamed images (hashed in one pass on each side; trailer signed for this session) -----------
@pytest.fixture(params=["sha256", "blake3"])
def alg(request):
    """Both digests a stream may use: sha256 (images dumped earlier), BLAKE3 (dumped while sent)."""
    return request.param


def _streamed(lo, mutate, alg="blake3", check=None):
    """Dump a snapshot, stream it to agent B with the trailer ``mutate(meta, digests, hello)``
    returns (signed with the right key), and return the agent's reply (``check(sock, reply)``
    runs before the connection closes)."""
    from gym_fork.backends.criu import image_meta
    from gym_fork.migration.wire.auth import bundle_key
    from gym_fork.migration.wire.connect import connect
    from gym_fork.migration.wire.streams import send_images
    from gym_fork.snapshots import bundle as B
    from gym_fork.snapshots import sessiondir

    env = gym_fork.make(ENV)
    env.reset(seed=3)
    snap = env.snapshot()
    tmp = sessiondir.private_mkdir(os.path.join(sessiondir.session_dir(), f"t-{os.urandom(3).hex()}"))
    try:
        image = snap._backend.dump_transient(snap.payload(), os.path.join(tmp, "images"))
        assert not os.path.exists(os.path.join(image.path, sessiondir.MANIFEST))  # no manifest pass, no fsync
        base = B.bundle_meta(snap, **image_meta(image))
        tok = lo.token.encode()
        sock, hello = connect(lo.target["B"], tok)

        def trailer(digests):
            return B.sign_meta(mutate(dict(base, images=digests, session=hello["nonce"]), digests, hello),
                               bundle_key(tok))

        try:
            done = threading.Event()
            done.set()
            reply, _n = send_images(sock, {"op": "env"}, image.path, lo.target["B"], trailer,
                                    done, threading.Event(), 1 << 30, alg)
            if check is not None:
                check(sock, reply)
        finally:
            sock.close()
        return reply
    finally:
        snap.release()
        env.close()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def test_streamed_bundle_signed_for_another_session_is_refused(lo, alg):
    reply = _streamed(lo, lambda m, d, h: dict(m, session=os.urandom(32).hex()), alg)  # a replay's session
    assert not reply["ok"] and reply["error"] == "BundleError" and "another session" in reply["message"]
    _clean(lo.agents["B"])


def test_streamed_image_not_in_signed_list_is_refused(lo, alg):
    def drop_one(meta, digests, hello):  # sign all but one image: that one arrives unsigned
        name = sorted(digests)[0]
        return dict(meta, images={k: v for k, v in digests.items() if k != name})

    reply = _streamed(lo, drop_one, alg)
    assert not reply["ok"] and reply["error"] == "SnapshotCorruptedError" and "signed list" in reply["message"]
    _clean(lo.agents["B"])


def test_streamed_digest_mismatch_is_refused(lo, alg):
    def lie(meta, digests, hello):
        name = max(digests, key=lambda k: digests[k]["size"])
        return dict(meta, images=dict(digests, **{name: dict(digests[name], **{alg: "0" * 64})}))

    reply = _streamed(lo, lie, alg)
    assert not reply["ok"] and f"{alg} check" in reply["message"]
    _clean(lo.agents["B"])


def test_stream3_beyond_the_announced_size_or_with_a_bad_name_is_refused(lo):
    """A sender that announces less than it sends, or names a file '../x', gets nothing written."""
    import struct

    from gym_fork.migration.wire.connect import connect
    from gym_fork.migration.wire.messages import recv_msg, send_msg

    for name, n in ((b"pages-1.img", 8192), (b"../escape", 10)):
        sock, hello = connect(lo.target["B"], lo.token.encode())
        try:
            send_msg(sock, {"op": "env", "size": 4096, "stream": 3, "hash": "blake3"})
            assert recv_msg(sock)["ok"]
            frame = struct.Struct("!BIQ")
            sock.sendall(frame.pack(1, 0, len(name)) + name + frame.pack(2, 0, n) + b"x" * n)
            reply = recv_msg(sock)
            assert not reply["ok"] and ("announced" in reply["message"] or "refusing" in reply["message"]), reply
        finally:
            sock.close()
        _clean(lo.agents["B"])
        assert not os.path.exists(os.path.join(lo.agents["B"].state_dir, "..", "escape"))


def test_agent_refuses_another_stream_format(lo):
    """The tar forms of older senders (stream 1, 2) are refused before anything is sent."""
    from gym_fork.migration.wire.connect import connect
    from gym_fork.migration.wire.messages import recv_msg, send_msg

    for stream in (None, 2):
        sock, _hello = connect(lo.target["B"], lo.token.encode())
        try:
            send_msg(sock, {"op": "env", "size": 4096, **({} if stream is None else {"stream": stream})})
            reply = recv_msg(sock)
            assert not reply["ok"] and "stream format" in reply["message"], reply
        finally:
            sock.close()
    _clean(lo.agents["B"])


def test_streamed_worker_channel_is_relayed(lo):
    """A hand-driven stream (sha256, as for images dumped earlier) is restored, and the
    connection then carries the worker's own channel."""
    ref = gym_fork.make(ENV)
    ref.reset(seed=3)
    steps = []

    def step_through(sock, reply):
        assert reply["ok"], reply
        h = NetworkHandle(sock, reply["pid"], "B", lo.target["B"])  # the relayed worker channel
        for a in _actions(20, seed=5):
            steps.append(np.array_equal(h.request("step", a)[0], ref.step(a)[0]))

    try:
        _streamed(lo, lambda m, d, h: m, "sha256", check=step_through)
    finally:
        ref.close()
    assert steps and all(steps)
    _clean(lo.agents["B"])


# --- live (pre-copy) migration of one env worker ----------------------------------------------------
class _ReadsTheClock(gym.Env):
    """Its observations depend on something outside the process (the wall clock): the target's
    replay cannot match, so live migration must refuse to switch."""

    observation_space = gym.spaces.Box(0, np.inf, (1,), np.float64)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.array([time.time_ns() % 10**9], dtype=np.float64), {}

    def step(self, action):
        return np.array([time.time_ns() % 10**9], dtype=np.float64), 0.0, False, False, {}


def _step_until_done(env, ref, mig, acts):
    """Step env (and ref in lockstep, checking every answer) until the live migration ends."""
    i = 0
    for i, a in enumerate(acts):
        out = env.step(a)
        if ref is not None:
            want = ref.step(a)
            assert_same_traj([out], [want])
            if out[2] or out[3]:
                env.reset()
                ref.reset()
        if mig.done():
            break
    return i


def test_live_migration_switches_mid_episode_bit_identical(netnodes):
    env, ref = _pair(_actions(60))
    try:
        mig = env.migrate(netnodes.target["B"], token=netnodes.token, netns=netnodes.netns["A"], live=True)
        assert not mig.done()  # the env keeps running here while the snapshot travels
        n = _step_until_done(env, ref, mig, _actions(20000, seed=1))
        rep = mig.result()
        assert rep["live"] and rep["node"] == "B" and rep["replayed_ops"] >= n > 0
        assert isinstance(env._handle, NetworkHandle)
        if netnodes.use_netns:
            assert os.stat(f"/proc/{rep['pid']}/ns/net").st_ino == os.stat(f"/run/netns/{netnodes.netns['B']}").st_ino
        acts = _actions(150, seed=4)  # on the target now, crossing episode ends
        assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
        assert env.steps == ref.steps
    finally:
        env.close()
        ref.close()
    _clean(netnodes.agents["B"])


def test_live_migration_result_switches_without_further_steps(netnodes):
    env, ref = _pair(_actions(40))
    try:
        mig = env.migrate(netnodes.target["B"], token=netnodes.token, netns=netnodes.netns["A"], live=True)
        rep = mig.result(timeout=60)  # nothing stepped meanwhile: switch right away
        assert rep["replayed_ops"] == 0 and mig.done()
        acts = _actions(50, seed=6)
        assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
    finally:
        env.close()
        ref.close()
    _clean(netnodes.agents["B"])


@pytest.mark.parametrize("call", ["snapshot", "fork", "explore"])
def test_a_snapshot_during_a_live_migration_cancels_it(lo, call):
    """The live module's promise: a snapshot (also fork()/explore() from the current state) cancels
    the migration and the env runs on here (it raised a bare AssertionError: the backend was
    handed the migration's recording handle)."""
    from gym_fork.migration import MigrationError

    env, ref = _pair(_actions(30))
    try:
        mig = env.migrate(lo.target["B"], token=lo.token, live=True)
        acts = _actions(5, seed=2)
        assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
        if call == "snapshot":
            snap = env.snapshot()
        elif call == "fork":
            [kid], [ref_kid] = env.fork(), ref.fork()
            assert_same_traj(run_actions(kid, acts)[0], run_actions(ref_kid, acts)[0])
            kid.close()
            ref_kid.close()
        else:
            res = gym_fork.explore(env, None, None, actions=[acts], n_branches=1, horizon=5)
            assert res.branches[0].length == 5
        assert mig.state == "cancelled" and env._live is None
        with pytest.raises(MigrationError, match=r"cancelled: a snapshot was taken"):
            mig.result()
        assert not isinstance(env._handle, NetworkHandle)  # local, and exact
        acts = _actions(40, seed=3)
        assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
        if call == "snapshot":
            env.restore(snap)
            ref.reset(seed=3)
            run_actions(ref, _actions(30) + _actions(5, seed=2))
            assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
    finally:
        env.close()
        ref.close()
    _clean(lo.agents["B"])


def test_live_migration_of_an_env_that_reads_the_clock_is_refused(netnodes):
    from gym_fork.errors import DivergedError

    env = gym_fork.ForkableEnv(_ReadsTheClock)
    try:
        env.reset(seed=0)
        mig = env.migrate(netnodes.target["B"], token=netnodes.token, netns=netnodes.netns["A"], live=True)
        _step_until_done(env, None, mig, [0] * 200000)
        with pytest.raises(DivergedError, match="depends on something outside its"):
            mig.result()
        assert mig.state == "failed" and env._live is None
        assert not isinstance(env._handle, NetworkHandle)  # still local
        env.step(0)
        env.snapshot()
    finally:
        env.close()
    _clean(netnodes.agents["B"])


def test_live_migration_cancelled_by_restore_keeps_the_env(netnodes):
    from gym_fork.migration import MigrationError

    env, ref = _pair(_actions(30))
    try:
        snap = env.snapshot()
        rsnap = ref.snapshot()
        mig = env.migrate(netnodes.target["B"], token=netnodes.token, netns=netnodes.netns["A"], live=True)
        for a in _actions(5, seed=8):
            env.step(a)
        env.restore(snap)  # replaces the worker: cannot be replayed, so the migration is cancelled
        ref.restore(rsnap)
        with pytest.raises(MigrationError, match="cancelled: restore"):
            mig.result()
        acts = _actions(60, seed=9)
        assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
    finally:
        env.close()
        ref.close()
    _clean(netnodes.agents["B"])


def test_live_migration_to_a_dead_agent_keeps_stepping_locally():
    from gym_fork.migration.live import LiveMigration

    env, ref = _pair(_actions(30))
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    try:
        mig = env.migrate(f"127.0.0.1:{port}", token="x", live=True)
        assert isinstance(mig, LiveMigration)
        acts = _actions(300, seed=2)
        assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
        with pytest.raises(AgentUnreachableError):
            mig.result(timeout=30)
        assert env._live is None and not isinstance(env._handle, NetworkHandle)
        env.snapshot()
    finally:
        env.close()
        ref.close()


def test_close_during_live_migration_leaves_nothing(netnodes):
    env = gym_fork.make(ENV)
    env.reset(seed=1)
    mig = env.migrate(netnodes.target["B"], token=netnodes.token, netns=netnodes.netns["A"], live=True)
    env.step(0)
    env.close()
    assert mig.done() and mig.state == "cancelled"
    _clean(netnodes.agents["B"])


def test_job_two_hops_signal_then_notice_file(netnodes, reference_job, tmp_path):
    """A -> B on SIGUSR1 to `gym-fork run`, then B -> A when a preemption notice file appears:
    still the same training as never moving."""
    logd, notice = str(tmp_path / "logs"), str(tmp_path / "preempt-notice")
    cmd = [sys.executable, "-m", "gym_fork.cli", "run", "--node", "A", "--log-dir", logd,
           "--token-file", netnodes.token_file, "--", sys.executable, TRAIN,
           "--target", f"{netnodes.target['B']},{netnodes.target['A']}", "--notice-file", notice,
           "--total", str(TOTAL)]
    if netnodes.netns.get("A"):
        cmd = ["nsenter", f"--net=/run/netns/{netnodes.netns['A']}", *cmd]
    sup = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_for(pred, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {_lines(f'{logd}/stdout.log')[-3:]}"
            time.sleep(0.05)

    try:
        wait_for(lambda: any(x.get("t", 0) >= 150 for x in _lines(f"{logd}/stdout.log")), "training on A")
        sup.send_signal(signal.SIGUSR1)  # forwarded to the job: move at the next step boundary
        out, err = sup.communicate(timeout=60)  # the source supervisor exits once B runs the job
        assert sup.returncode == 0, err
        assert "now runs on the target agent" in out
        wait_for(lambda: any(x.get("node") == "B" for x in _lines(f"{logd}/stdout.log")), "an episode on B")
        with open(notice, "w") as f:
            f.write("preempted\n")
        wait_for(lambda: any(x.get("done") for x in _lines(f"{logd}/stdout.log")), "the end of training", 120)
    finally:
        if sup.poll() is None:
            sup.kill()
    lines = _lines(f"{logd}/stdout.log")
    done = [x for x in lines if x.get("done")][0]
    hops = done["migrations"]
    assert [(m["status"], m["source"], m["node"]) for m in hops] == [("arrived", "A", "B"), ("arrived", "B", "A")]
    assert hops[0]["timestep"] < hops[1]["timestep"] < TOTAL
    ref = [x for x in reference_job if x.get("done")][0]
    assert done["timesteps"] == ref["timesteps"] == TOTAL and done["policy_sha"] == ref["policy_sha"]
    eps = [x for x in lines if "ret" in x]
    assert [(x["t"], x["ret"]) for x in eps] == [(x["t"], x["ret"]) for x in reference_job if "ret" in x]
    assert {x["node"] for x in eps if x["t"] > hops[1]["timestep"]} <= {"A"}
    assert done["logged"]["migration/source"] == "B" and done["logged"]["migration/target"] == "A"
    _clean(netnodes.agents["A"])
    _clean(netnodes.agents["B"])


def test_job_migrates_to_a_tls_agent(reference_job, tmp_path):
    with Nodes(["B"], use_netns=False, tls=True) as n:
        r, lines = _run_job(n, n.target["B"], str(tmp_path / "logs"), 400, run_args=("--tls-ca", n.cert))
        assert r.returncode == 0, r.stderr
        done = [x for x in lines if x.get("done")][0]
        assert [(m["status"], m["node"]) for m in done["migrations"]] == [("arrived", "B")]
        ref = [x for x in reference_job if x.get("done")][0]
        assert (done["timesteps"], done["policy_sha"]) == (ref["timesteps"], ref["policy_sha"])
        _clean(n.agents["B"])


def test_job_with_forkable_env_moves_with_its_worker_and_snapshots(netnodes, tmp_path, monkeypatch):
    """A job training on a ForkableEnv: inside `gym-fork run` its worker has no PID namespace of
    its own (CRIU cannot dump nested ones), so worker and fork-tier snapshots move with the job;
    a snapshot taken on A is restored on B, bit-identical to a run that never moved."""
    args = ["--forkable", "--snap-at", "200", "--total", "1024"]
    # ring slots of its own: a ring held by anything else on this machine would leave it none
    monkeypatch.setenv("GYM_FORK_RING_SLOTS_DIR", str(tmp_path / "ring-slots"))
    out = subprocess.run([sys.executable, TRAIN, *args], capture_output=True, text=True, timeout=120, check=True)
    ref = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{") and '"done"' in x][0]
    r, lines = _run_job(netnodes, netnodes.target["B"], str(tmp_path / "logs"), 600,
                        train_args=("--forkable", "--snap-at", "200"), total=1024)
    assert r.returncode == 0 and "now runs on the target agent" in r.stdout, (r.stdout, r.stderr)
    done = [x for x in lines if x.get("done")][0]
    assert [(m["status"], m["node"]) for m in done["migrations"]] == [("arrived", "B")]
    assert done["backend"] == "criu" and done["snap_sha"] == ref["snap_sha"]
    assert (done["timesteps"], done["policy_sha"]) == (ref["timesteps"], ref["policy_sha"])
    if len(os.sched_getaffinity(0)) >= 2:  # steps went through the worker's shared-memory ring
        # before the move and after it (CRIU moved the ring's memory with the job)
        paths = done["step_paths"]
        assert ["A", "ring"] in paths and paths[-1] == ["B", "ring"], paths
        assert paths.index(["A", "ring"]) == len(paths) - 2, paths
    _clean(netnodes.agents["B"])


def test_inside_a_job_criu_only_workers_are_refused_with_the_reason(monkeypatch):
    from gym_fork.errors import BackendUnavailableError

    monkeypatch.setenv("GYM_FORK_CONTROL_FD", "999")  # what `gym-fork run` gives its job
    with pytest.raises(BackendUnavailableError, match="nested PID namespaces"):
        gym_fork.ForkableEnv("CartPole-v1", backend="criu", fork_tier=False)
    env = gym_fork.ForkableEnv("CartPole-v1", backend="criu")
    try:
        assert env._backend.mode == "fork" and "gym-fork run" in env._backend.unavailable
        env.reset(seed=0)
        s = env.snapshot()
        a = [env.step(i % 2)[0] for i in range(20)]
        env.restore(s)
        assert all(np.array_equal(x, env.step(i % 2)[0]) for i, x in enumerate(a))
        with pytest.raises(gym_fork.errors.BackendUnavailableError, match="gym-fork run"):
            s.persist()
    finally:
        env.close()


def test_env_with_a_workspace_is_refused_before_anything_moves(lo, tmp_path):
    from gym_fork.migration import MigrationError

    env = gym_fork.ForkableEnv("CartPole-v1", workspace=str(tmp_path / "ws"))
    try:
        env.reset(seed=0)
        for live in (False, True):
            with pytest.raises(MigrationError, match="workspace"):
                env.migrate(lo.target["B"], token=lo.token, live=live)
        assert env._live is None and not isinstance(env._handle, NetworkHandle)
        env.step(0)
    finally:
        env.close()
    _clean(lo.agents["B"])


def test_an_env_with_an_interactive_shell_on_a_pty_migrates(lo):
    """The worker and its bash on a pty the env opened move together; on the agent the tree is
    restored with a devpts of its own (the pty keeps its number) and the shell goes on exactly."""
    from tests import agent_envs

    env, ref = gym_fork.ForkableEnv(agent_envs.terminal), gym_fork.ForkableEnv(agent_envs.terminal)
    try:
        for e in (env, ref):
            e.reset(seed=3)
            for a in (1, 2, 3):
                e.step(a)
        rep = env.migrate(lo.target["B"], token=lo.token)
        assert rep["node"] == "B" and env.steps == 3
        acts = _actions(12, seed=2)
        assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
    finally:
        env.close()
        ref.close()
    _clean(lo.agents["B"])


def test_bad_targets_fail_at_once_and_leave_the_env_alone():
    from gym_fork.migration import MigrationError

    env, ref = _pair(_actions(10))
    try:
        for live in (False, True):
            for bad in ("not-an-address", "127.0.0.1:notaport", ""):
                with pytest.raises(ValueError, match="host:port"):
                    env.migrate(bad, token="x", live=live)
            with pytest.raises(TypeError, match="RayNode"):
                env.migrate(123, live=live)
        assert env._live is None and not isinstance(env._handle, NetworkHandle)
        acts = _actions(20, seed=3)
        assert_same_traj(run_actions(env, acts)[0], run_actions(ref, acts)[0])
    finally:
        env.close()
        ref.close()
    single = gym_fork.ForkableEnv(ENV, fork_tier=False)
    try:
        single.reset(seed=0)
        with pytest.raises(MigrationError, match="fork tier"):
            single.migrate("127.0.0.1:1", token="x", live=True)
        single.step(0)
    finally:
        single.close()


def test_a_step_from_another_thread_during_a_migration_is_refused_not_lost(lo):
    """A stop-and-copy move freezes the worker, ships it (a second or so) and switches over: a
    step another thread made meanwhile ran on the worker left behind and was lost (the moved env
    went on from before it). Such steps are refused now; those before and after are exact."""
    import threading

    from gym_fork.errors import ConcurrentUseError

    env, ref = _pair(_actions(30))
    done, refused, took = threading.Event(), [0], []
    acts = iter(_actions(100000, seed=4))

    def stepper() -> None:
        while not done.is_set():
            a = next(acts)
            try:
                env.step(a)
                took.append(a)
            except ConcurrentUseError:
                refused[0] += 1
            time.sleep(0.002)

    t = threading.Thread(target=stepper)
    try:
        t.start()
        time.sleep(0.1)
        # The move itself is refused while the other thread's step is in flight. On a loaded
        # machine a step can hold the channel most of the time (its worker waits for a CPU), so
        # the move is tried until a deadline, not a fixed number of times (50 tries 1 ms apart
        # were all refused once in CI).
        rep, tries, deadline = None, 0, time.monotonic() + 30
        while rep is None and time.monotonic() < deadline:
            tries += 1
            try:
                rep = env.migrate(lo.target["B"], token=lo.token)
            except ConcurrentUseError:
                time.sleep(0.001 * (1 + tries % 5))  # (varied, so as not to keep pace with the stepper)
        time.sleep(0.1)
        done.set()
        t.join(30)
        assert rep is not None, f"the move was refused {tries} times in 30 s: another thread's step always in flight?"
        assert rep["node"] == "B" and refused[0] > 0, (rep, refused)
        assert env.steps == 30 + len(took)
        for a in took:  # the reference takes the steps that were taken, in order
            ref.step(a)
        after = _actions(20, seed=5)
        assert_same_traj(run_actions(env, after)[0], run_actions(ref, after)[0])
    finally:
        done.set()
        env.close()
        ref.close()
    _clean(lo.agents["B"])
