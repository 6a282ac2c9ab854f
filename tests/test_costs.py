"""``gym_fork.measure_costs`` and ``gym-fork bench``: real envs on every backend, measured for real.

Timings are never asserted (they are the machine's); what is checked is that every backend that
can work here is measured, that the break-even depth is the one its own measurements give, that
a backend that refuses the env says why instead of printing numbers, and the command's exits."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import gym_fork
from gym_fork.costs import CostReport

pytestmark = pytest.mark.criu  # CRIU must be usable here (and in CI): see conftest.py


def _break_even(report: CostReport, row) -> float:
    inproc = report.rows[0].step_us * 1e-6
    depth = (row.restore_ms * 1e-3 + report.horizon * (row.step_us * 1e-6 - inproc) - report.reset_us * 1e-6) / inproc
    return max(0.0, depth)


def test_every_backend_is_measured_and_the_break_even_depth_follows_from_its_numbers():
    report = gym_fork.measure_costs("CartPole-v1", backends=["fork", "criu", "pickle"], steps=60, reps=3,
                                    horizon=50, verbose=False)
    assert [r.backend for r in report.rows] == ["in process", "fork tier (copy-on-write)", "CRIU dumps", "pickle"]
    assert report.rows[0].step_us > 0 and report.reset_us > 0
    for row in report.rows[1:]:
        assert not row.note, row.note
        assert row.step_us > 0 and row.snapshot_ms > 0 and row.restore_ms > 0, row
        assert row.overhead_us == pytest.approx(row.step_us - report.rows[0].step_us)
        assert len(row.snapshot_samples_ms) == len(row.restore_samples_ms) == 3
        assert row.break_even_depth == pytest.approx(_break_even(report, row))
    table = str(report)
    assert "CartPole-v1" in table and "CRIU dumps" in table and "50-step branch" in table
    json.dumps(report.as_dict())  # --json prints it


def test_a_backend_that_refuses_the_env_says_why_instead_of_numbers():
    report = gym_fork.measure_costs("LunarLander-v3", backends=["pickle"], steps=20, reps=1, verbose=False)
    row = report.rows[1]
    assert row.step_us is None and row.restore_ms is None and row.break_even_depth is None
    assert row.note.startswith("refuses the env:") and "EzPickle" in row.note
    assert "see (1)" in str(report) and "(1) pickle: refuses the env" in str(report)


def test_an_env_instance_is_refused_with_what_to_pass_instead():
    env = gym_fork.make("CartPole-v1", backend="pickle")
    try:
        with pytest.raises(TypeError, match="env id or a zero-argument factory"):
            gym_fork.measure_costs(env, verbose=False)
    finally:
        env.close()


@pytest.mark.parametrize("kwargs, message", [
    ({"backends": ["fork", "nope"]}, "unknown backend"),
    ({"steps": 0}, "steps must be an int >= 1"),
    ({"reps": 1.5}, "reps must be an int >= 1"),
])
def test_bad_arguments_are_refused_before_anything_starts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        gym_fork.measure_costs("CartPole-v1", verbose=False, **kwargs)


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gym_fork.cli", "bench", *args], capture_output=True,
                          text=True, timeout=300)


def test_the_command_prints_the_table_or_json_and_refuses_bad_input():
    out = _bench("CartPole-v1", "--backends", "fork", "--steps", "40", "--reps", "2")
    assert out.returncode == 0, out.stderr
    assert "fork tier (copy-on-write)" in out.stdout and "break-even depth (100-step branch)" in out.stdout
    assert "[gym-fork bench] fork tier" in out.stderr  # progress goes to stderr

    out = _bench("CartPole-v1", "--backends", "fork", "--steps", "40", "--reps", "2", "--horizon", "20", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["horizon"] == 20 and [r["backend"] for r in data["rows"]] == ["in process", "fork tier (copy-on-write)"]

    bad = _bench("CartPole-v1", "--backends", "fork,nope")
    assert bad.returncode == 2 and "unknown backend(s) nope; choose from fork, criu, pickle" in bad.stderr
    bad = _bench("CartPole-v1", "--reps", "0")
    assert bad.returncode == 2 and "--reps must be at least 1" in bad.stderr
    unknown = _bench("NoSuchEnv-v0", "--backends", "fork")
    assert unknown.returncode == 1 and "Traceback" not in unknown.stderr
    assert "gym-fork bench: cannot make NoSuchEnv-v0:" in unknown.stderr and "doesn't exist" in unknown.stderr
    # nothing measured (the only backend refuses the env): exit 1, and the table says why
    refused = _bench("LunarLander-v3", "--backends", "pickle", "--steps", "10", "--reps", "1")
    assert refused.returncode == 1 and "refuses the env" in refused.stdout
