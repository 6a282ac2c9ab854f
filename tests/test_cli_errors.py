"""The ``gym-fork`` CLI's promise (docs/cli.md), run for real (no mocks): a bad argument or a
failure is a short message on stderr and exit status 1 (2 for a usage error), never a Python
traceback; `gym-fork run` says how its job ended and stops it on SIGTERM/SIGINT/SIGHUP."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import gym_fork
from gym_fork import SnapshotStore
from gym_fork.cli import main

from conftest import process_alive


def cli(*argv: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    """``python -m gym_fork.cli ARGV`` as a user runs it; its output must hold no traceback."""
    p = subprocess.run([sys.executable, "-m", "gym_fork.cli", *argv], capture_output=True, text=True,
                       timeout=timeout, **kw)
    assert "Traceback" not in p.stderr, p.stderr
    return p


def said(p: subprocess.CompletedProcess) -> str:
    """stderr without the INFO lines of the logging some commands set up."""
    return "\n".join(ln for ln in p.stderr.splitlines() if " INFO " not in ln)


# --- usage errors: exit status 2, the reason in one line -----------------------------------------
@pytest.mark.parametrize("steps", ["0", "-3"])
def test_check_wants_at_least_one_step(steps, capsys):
    assert main(["check", "CartPole-v1", "--steps", steps]) == 2
    err = capsys.readouterr().err
    assert f"--steps must be at least 1, got {steps}" in err


@pytest.mark.parametrize("backends", ["", ",", " , "])
def test_check_and_bench_want_a_backend(backends):
    for command in ("check", "bench"):
        p = cli(command, "CartPole-v1", "--backends", backends)
        assert p.returncode == 2
        assert "--backends names no backend; give at least one of fork, criu, pickle" in p.stderr
        assert "[]" not in p.stderr


@pytest.mark.parametrize("command", ["check", "bench"])
def test_import_of_a_missing_module_is_a_message(command):
    p = cli(command, "CartPole-v1", "--import", "nosuchmodule_xyz")
    assert p.returncode == 1
    assert p.stderr.count("\n") == 1, p.stderr  # one line
    assert f"gym-fork {command}: --import nosuchmodule_xyz failed: ModuleNotFoundError" in p.stderr
    assert "python -c 'import nosuchmodule_xyz'" in p.stderr  # what to do


@pytest.mark.parametrize("port", ["99999", "65536", "-1", "http"])
def test_agent_port_out_of_range_is_a_usage_error(port, tmp_path):
    state = tmp_path / "state"
    p = cli("agent", "--port", port, "--state-dir", str(state), "--insecure", timeout=30,
            env=dict(os.environ, GYM_FORK_TOKEN="t" * 32))
    assert p.returncode == 2
    assert "argument --port:" in p.stderr and "0..65535" in p.stderr
    assert not state.exists()  # refused before anything was made


@pytest.mark.parametrize("option", ["--max-connections", "--max-unauthenticated"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_agent_connection_limits_below_one_are_refused(option, value, tmp_path):
    """0 is not silently the default (it used to be, as `value or default`)."""
    p = cli("agent", "--port", "0", "--state-dir", str(tmp_path / "state"), "--insecure", option, value,
            timeout=30, env=dict(os.environ, GYM_FORK_TOKEN="t" * 32))
    assert p.returncode == 2
    assert f"argument {option}: must be at least 1, got {value}" in p.stderr


def test_agent_api_refuses_zero_connections(tmp_path):
    from gym_fork.migration.agent import Agent

    with pytest.raises(ValueError, match="at least 1"):
        Agent("127.0.0.1", 0, str(tmp_path / "state"), b"t" * 32, insecure=True, max_connections=0)


@pytest.mark.parametrize("budget", ["inf", "-inf", "nan", "-1", "-5G", "lots"])
def test_gc_budget_must_be_a_finite_size(budget, tmp_path):
    (tmp_path / "store" / "snaps").mkdir(parents=True)
    p = cli("snapshots", "gc", str(tmp_path / "store"), f"--max-bytes={budget}")
    assert p.returncode == 2
    assert f"argument --max-bytes: {budget!r} is not a disk budget: give a number of bytes >= 0" in p.stderr


def test_run_log_dir_that_cannot_be_made(tmp_path):
    p = cli("run", "--log-dir", "/proc/forbidden", "--", sys.executable, "-c", "print(1)")
    assert p.returncode == 1
    assert said(p) == ("gym-fork run: cannot write the job's logs in /proc/forbidden: No such file or directory; "
                       "give --log-dir a directory you can create and write to")


@pytest.mark.parametrize("timeout", ["0", "-1", "inf", "soon"])
def test_run_stop_timeout_must_be_positive(timeout, tmp_path):
    p = cli("run", "--log-dir", str(tmp_path), "--stop-timeout", timeout, "--", sys.executable, "-c", "print(1)")
    assert p.returncode == 2 and "argument --stop-timeout:" in p.stderr
    assert not (tmp_path / "stdout.log").exists()


# --- snapshots gc reports what its budget evicted -------------------------------------------------
@pytest.mark.criu
def test_gc_reports_the_snapshots_its_budget_evicted(tmp_path, capsys):
    st = SnapshotStore(tmp_path / "store")
    env = gym_fork.ForkableEnv("CartPole-v1", store=st)
    env.reset(seed=0)
    for a in (0, 1, 0):
        env.step(a)
        st.put(env.snapshot())
    env.close()
    assert len(st.list()) == 3
    before = st.disk_bytes()
    assert main(["snapshots", "gc", str(st.path), "--max-bytes", "0"]) == 0
    out = capsys.readouterr().out
    assert SnapshotStore(st.path).list() == {}
    m = re.search(r"evicted 3 least recently used snapshots \(([\d.]+) (B|KiB|MiB|GiB)\) to fit --max-bytes 0 B", out)
    assert m, out
    freed = float(m.group(1)) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[m.group(2)]
    assert 0.9 * before <= freed <= before * 1.1, (freed, before)
    assert "0 snapshots" in out


# --- gym-fork run: how the job ended, and stopping it ---------------------------------------------
@contextlib.contextmanager
def running_job(tmp_path, code: str, *options: str):
    """`gym-fork run -- python -c CODE`; yields (supervisor Popen, job pid, log dir) once the job
    wrote "ready" to its stdout; kills whatever still runs afterwards."""
    logs = tmp_path / "logs"
    out, err = open(tmp_path / "out.txt", "w"), open(tmp_path / "err.txt", "w")
    sup = subprocess.Popen([sys.executable, "-m", "gym_fork.cli", "run", "--log-dir", str(logs), *options, "--",
                            sys.executable, "-c", code], stdout=out, stderr=err, stdin=subprocess.DEVNULL)
    pid = None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = re.search(r"job pid (\d+)", (tmp_path / "out.txt").read_text())
            pid = pid or (int(m.group(1)) if m else None)
            if pid and "ready" in _read(logs / "stdout.log"):
                break
            assert sup.poll() is None, (tmp_path / "err.txt").read_text()
            time.sleep(0.05)
        else:
            pytest.fail("the job did not start")
        yield sup, pid, logs
    finally:
        for p in (pid, sup.pid):
            if p and process_alive(p):
                os.kill(p, signal.SIGKILL)  # the job too: SIGKILL from outside its namespace
        sup.wait(timeout=30)
        out.close()
        err.close()


def _read(path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def _ended(sup: subprocess.Popen, tmp_path, timeout: float = 30) -> tuple[int, str]:
    rc = sup.wait(timeout=timeout)
    err = (tmp_path / "err.txt").read_text()
    assert "Traceback" not in err, err
    return rc, "\n".join(ln for ln in err.splitlines() if " INFO " not in ln)


SLEEPER = "import time; print('ready', flush=True); time.sleep(60)"


@pytest.mark.criu
def test_run_says_a_killed_job_was_killed_and_shows_only_its_own_log(tmp_path):
    logs = tmp_path / "logs"
    earlier = cli("run", "--log-dir", str(logs), "--", sys.executable, "-c",
                  "import sys; print('an earlier job said this', file=sys.stderr)")
    assert earlier.returncode == 0
    code = "import sys, time; print('this job said this', file=sys.stderr, flush=True); " + SLEEPER
    with running_job(tmp_path, code) as (sup, pid, _):
        os.kill(pid, signal.SIGKILL)  # as the OOM killer would
        rc, err = _ended(sup, tmp_path)
    assert rc == 128 + signal.SIGKILL == 137
    assert f"the job was killed by SIGKILL (exit status 137); the end of {logs / 'stderr.log'}:\n" \
           "this job said this" in err
    assert "an earlier job said this" not in err
    assert "exited with code 247" not in err


@pytest.mark.criu
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_run_stops_its_job_on_a_signal(tmp_path, sig):
    """Ctrl-C (SIGINT), SIGTERM or SIGHUP to the supervisor: the job gets it and ends, the supervisor
    says so in one line (no KeyboardInterrupt traceback) and exits 128 + the signal's number."""
    with running_job(tmp_path, SLEEPER) as (sup, pid, _):
        sup.send_signal(sig)
        rc, err = _ended(sup, tmp_path)
        assert not process_alive(pid)
    assert rc == 128 + sig
    assert err == (f"gym-fork run: got {sig.name}: stopping the job (pid {pid}): {sig.name} sent to it, SIGKILL if "
                   "it still runs in 10 s")


@pytest.mark.criu
def test_run_kills_a_job_that_does_not_stop(tmp_path):
    code = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " + SLEEPER
    with running_job(tmp_path, code, "--stop-timeout", "1") as (sup, pid, _):
        t0 = time.monotonic()
        sup.send_signal(signal.SIGTERM)
        rc, err = _ended(sup, tmp_path)
        assert not process_alive(pid)
    assert rc == 143 and 1 <= time.monotonic() - t0 < 20
    assert err.splitlines()[-1] == "gym-fork run: it did not stop within 1 s: killed the job (SIGKILL)"


@pytest.mark.criu
def test_launcher_relays_signals_to_the_job(tmp_path):
    """The job is PID 1 of its namespace: the kernel drops a signal it does not handle. The launcher
    (its parent) relays SIGTERM: to the job's handler when it has one, else by ending the job."""
    handler = ("import signal, sys\n"
               "def bye(sig, _f):\n    print('got', signal.Signals(sig).name, flush=True); sys.exit(5)\n"
               "signal.signal(signal.SIGTERM, bye)\n" + SLEEPER)
    with running_job(tmp_path, handler) as (sup, pid, logs):
        launcher = _parent(pid)
        os.kill(launcher, signal.SIGTERM)
        rc, err = _ended(sup, tmp_path)
    assert "got SIGTERM" in (logs / "stdout.log").read_text()
    assert rc == 5 and "the job exited with code 5" in err
    (tmp_path / "again").mkdir()
    with running_job(tmp_path / "again", SLEEPER) as (sup, pid, _):  # no handler: ended as SIGTERM's default would
        os.kill(_parent(pid), signal.SIGTERM)
        rc, err = _ended(sup, tmp_path / "again")
        assert not process_alive(pid)
    assert rc == 143 and "the job was killed by SIGTERM (exit status 143)" in err


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(ln.split()[1] for ln in f if ln.startswith("PPid:")))


def test_ctrl_c_is_one_line_and_status_130(tmp_path):
    """Ctrl-C in any command (here while `check` imports a slow --import module): one line, 130."""
    (tmp_path / "slowmod.py").write_text(f"import time\nopen({str(tmp_path / 'started')!r}, 'w').close()\n"
                                         "time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-m", "gym_fork.cli", "check", "CartPole-v1", "--import", "slowmod"],
                         cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "started").exists() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130
    assert err == "gym-fork check: interrupted\n"
