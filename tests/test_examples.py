"""Smoke tests of the example scripts (tiny budgets: seconds, not minutes)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
from conftest import started_elsewhere

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.criu
def test_go_explore_smoke(tmp_path):
    pytest.importorskip("matplotlib")
    ge = _load("go_explore")
    out = tmp_path / "ge.png"
    budget = 1000
    res = ge.main(["--budget", str(budget), "--seeds", "0", "--out", str(out)])

    assert res["budget"] == budget and res["seeds"] == [0]
    rows = {r["method"]: r for r in res["results"]}
    assert set(rows) == {"random", "go-explore"}
    for r in rows.values():
        assert r["steps"] == budget  # the same env-step budget, spent exactly
        assert -1.2 <= r["max_pos"] <= 0.6 and math.isfinite(r["max_pos"])
        assert r["goal_reached"] == (r["goal_at_step"] is not None)
        if r["goal_reached"]:
            assert 1 <= r["goal_at_step"] <= budget and r["verified"] is True
            assert r["solution_len"] <= 200
    g = rows["go-explore"]
    assert g["cells"] >= 2 and g["snapshots"] >= g["cells"] and g["returns"] >= 1
    assert out.is_file() and out.stat().st_size > 10_000
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.criu
def test_agent_workspace_smoke(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the example's workspace and its branches land here
    monkeypatch.syspath_prepend(str(EXAMPLES))  # the worker imports the env class from the module
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    aw = _load("agent_workspace")
    aw.main()  # asserts that restore brings back exactly the snapshot's files and rows
    out = capsys.readouterr().out
    assert "snapshot at step 4: ['home.py', 'login.py'], 1 user(s)" in out
    assert out.count("branch ") == 2
    assert "restore brings back exactly the files and rows of the snapshot: True" in out
    # closed branches took their DIR.branch-* directories with them; the main workspace stays
    assert not [p for p in tmp_path.iterdir() if ".branch-" in p.name]
    assert [p for p in tmp_path.iterdir() if p.name.startswith("agent-ws-")]


@pytest.mark.criu
def test_live_migration_demo_end_to_end(tmp_path, monkeypatch):
    """The demo as a user runs it (short): a PPO job moves A -> B mid-episode and finishes there,
    one env worker moves stop-and-copy and one live; everything it made is gone afterwards."""
    import os
    import subprocess

    demo = _load("live_migration_demo")
    monkeypatch.chdir(tmp_path)
    before = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    out = demo.main(["--total", "1536", "--episodes-before", "3", "--out", str(tmp_path / "lm.png")])
    assert out["job"]["timesteps"] == 1536 and out["job"]["migrations"][0]["status"] == "arrived"
    assert out["env"]["identical"] and out["env_live"]["identical"]
    assert out["env_live"]["report"]["live"] and out["env_live"]["report"]["downtime_s"] < out["env_live"]["report"]["timings"]["total_s"]
    assert os.path.getsize(tmp_path / "lm.png") > 10_000
    after = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    assert after <= before  # its namespaces are gone


@pytest.mark.criu
def test_cleanrl_ppo_branching_smoke(capsys):
    """The CleanRL-style PPO trains with ForkableVectorEnv, branches once mid-training, and --
    without the branch -- gives exactly the numbers gymnasium's SyncVectorEnv gives."""
    pytest.importorskip("torch")
    ppo = _load("cleanrl_ppo_branching")
    budget = ["--total-timesteps", "1536", "--num-envs", "4", "--num-steps", "128"]
    res = ppo.main(budget)
    assert res["global_step"] == 1536 and res["iterations"] == 3
    branch = res["branch"]
    assert branch["step"] == 512 and branch["same_state"]
    assert len(branch["targets"]) == 2 and branch["source"] not in branch["targets"]
    assert res["episodes"] > 0 and all(math.isfinite(v) for v in res["losses"].values())
    out = capsys.readouterr().out
    assert f"branch at step 512: slot {branch['source']} is" in out and out.count("iteration ") == 3
    plain = ppo.main(budget + ["--no-branch"])
    sync = ppo.main(budget + ["--vector", "sync"])
    assert plain["branch"] is None and sync["branch"] is None
    assert plain["returns"] == sync["returns"] and plain["losses"] == sync["losses"]


@pytest.mark.criu
@pytest.mark.parametrize("files", ["private", "workspace"])
def test_agent_webapp_end_to_end(tmp_path, capsys, files):
    """The flagship example, 3 branches: each branch has its own files, app server and Redis;
    restore brings every part back exactly; no process of any copy is left afterwards.  The app
    directory in private_dirs (same path in every copy) and as a workspace (a directory each)."""
    pytest.importorskip("matplotlib")
    pytest.importorskip("redis")
    import os

    app = _load("agent_webapp")

    def servers() -> set[int]:
        out = set()
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if (b"redis-server" in cmd and b"6390" in cmd or b"serve_forever" in cmd) and not started_elsewhere(int(pid)):
                out.add(int(pid))
        return out

    before = servers()
    res = app.main(["--branches", "3", "--files", files, "--out", str(tmp_path / "tree.png")])
    assert res["restored_exact"] and res["isolated"] and res["continues_like_branch"]
    assert len(res["branches"]) == 3 and len({b["workspace"] for b in res["branches"]}) == 3
    assert all(len(b["world"]["users"]) == len(res["at_snapshot"]["users"]) + 1 for b in res["branches"])
    assert res["snapshot_s"] > 0 and res["replay_s"] > 0
    out = capsys.readouterr().out
    assert "restore brings back files, app server and Redis exactly: True" in out and "replay prefix" in out
    assert (tmp_path / "tree.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import time

    deadline = time.monotonic() + 10
    while servers() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not servers() - before, "the example left server processes behind"
