"""The ``gym-fork`` CLI, run for real (no mocks): doctor's checks and probes, --json, --help."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gym_fork import __version__
from gym_fork.cli import main
from gym_fork.criu.status import criu_candidates, criu_status, find_criu

pytestmark = pytest.mark.criu  # CRIU must be usable here (and in CI): see conftest.py


def run_main(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_doctor_human(capsys):
    code, out = run_main(capsys, "doctor")
    assert code == 0, out
    st = criu_status()
    lines = {ln.split(":", 1)[0].strip().lstrip("✔✘· ").strip(): ln for ln in out.splitlines() if " : " in ln}
    assert st.binary and st.binary in lines["criu binary"] and st.version in lines["criu binary"]
    assert lines["criu binary"].lstrip().startswith("✔")
    for label in ("criu check", "pycriu", "protobuf", "root", "CAP_SYS_ADMIN", "criu usable"):
        assert lines[label].lstrip().startswith("✔"), lines[label]
    for backend in ("criu", "fork", "pickle"):
        line = lines[f"probe {backend}"]
        assert line.lstrip().startswith("✔") and "ok:" in line and "bit-identical" in line, line
        assert "snapshot" in line and "restore" in line and " ms" in line
    assert "auto will use: criu because" in out
    assert "To fix:" not in out


def test_doctor_json(capsys):
    code, out = run_main(capsys, "doctor", "--json")
    assert code == 0
    rep = json.loads(out)
    assert rep["exit_code"] == 0 and rep["ok"] is True
    assert rep["gym_fork"] == __version__
    assert rep["criu"]["usable"] is True
    assert rep["criu"]["binary"] == criu_status().binary and os.path.isfile(rep["criu"]["binary"])
    assert int(rep["criu"]["version"].split(".")[0]) >= 4
    assert rep["checks"]["criu_binary"]["ok"] is True
    assert rep["checks"]["root"]["ok"] is True and rep["checks"]["cap_sys_admin"]["ok"] is True
    for backend in ("criu", "fork", "pickle"):
        p = rep["probes"][backend]
        assert p["ok"] is True, p
        assert p["error"] is None
        assert p["snapshot_ms"] > 0 and p["restore_ms"] > 0 and p["size_bytes"] > 0
        assert rep["works"][backend] is True
    assert rep["auto"]["backend"] == "criu"
    assert rep["criu"]["binary"] in rep["auto"]["because"]


def test_doctor_no_probe(capsys):
    code, out = run_main(capsys, "doctor", "--json", "--no-probe")
    rep = json.loads(out)
    assert code == 0
    assert rep["probes"] == {"criu": None, "fork": None, "pickle": None}
    assert rep["checks"]["probe_criu"]["ok"] is None
    assert rep["auto"]["backend"] == "criu"


def test_version(capsys):
    code, out = run_main(capsys, "--version")
    assert code == 0
    assert out.startswith(f"gym-fork {__version__}")


def test_no_command_prints_help(capsys):
    code, out = run_main(capsys)
    assert code == 2
    assert "doctor" in out


def test_module_help_subprocess():
    p = subprocess.run([sys.executable, "-m", "gym_fork.cli", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert "doctor" in p.stdout and "examples:" in p.stdout
    p = subprocess.run([sys.executable, "-m", "gym_fork.cli", "doctor", "--help"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "--no-probe" in p.stdout and "install_criu.sh" in p.stdout


def test_console_script():
    script = os.path.join(os.path.dirname(sys.executable), "gym-fork")
    if not os.path.exists(script):
        pytest.fail(f"{script} is missing: run `pip install -e .` to install the console script")
    p = subprocess.run([script, "doctor", "--no-probe"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "auto will use: criu" in p.stdout


def test_old_criu_is_listed_but_does_not_block(tmp_path, monkeypatch, capsys):
    """A criu 3.x found before the good one (say Debian's 3.17 on PATH) is ignored, not fatal."""
    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\necho 'Version: 3.17'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("GYM_FORK_CRIU", str(fake))
    path, version, notes = find_criu()
    assert path == criu_status().binary and int(version.split(".")[0]) >= 4
    assert any(str(fake) in n and "3.17" in n for n in notes)
    assert any(c["path"] == str(fake) and c["rejected"] for c in criu_candidates())
    fresh = criu_status.__wrapped__()  # uncached: sees $GYM_FORK_CRIU
    assert fresh.usable, fresh.reasons
    assert any("3.17" in r for r in fresh.rejected)
    code, out = run_main(capsys, "doctor", "--no-probe")
    assert code == 0
    assert "ignored criu" in out and "3.17" in out


@pytest.mark.parametrize("argv", [["snapshots", "ls", "{store}"], ["snapshots", "ls", "{store}", "--json"],
                                  ["--help"], ["install-criu", "--help"]])
def test_reader_that_left_is_no_error(tmp_path, argv):
    """`gym-fork ... | head`: when the reader has gone, the command ends quietly (no traceback,
    no 'Broken pipe' message). Here the pipe's read end is closed before the command writes."""
    (tmp_path / "store" / "snaps").mkdir(parents=True)
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "gym_fork.cli", *[a.format(store=tmp_path / "store") for a in argv]],
                           stdout=w, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(w)
    assert p.stderr == "", p.stderr
    assert p.returncode in (0, 1)


def test_doctor_says_whether_envs_get_step_rings_and_who_holds_them(capsys, monkeypatch, tmp_path):
    """The step-rings line: how many slots the machine has and which processes hold them now
    (an env steps through its socket while none is free), or why there are none."""
    from gym_fork.worker import ring_slots

    monkeypatch.setenv("GYM_FORK_RING_SLOTS_DIR", str(tmp_path / "slots"))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    code, out = run_main(capsys, "doctor", "--json", "--no-probe")
    ring = json.loads(out)["checks"]["step_rings"]
    assert ring["data"]["slots"] == 1 and ring["data"]["held_by"] == [] and ring["value"].startswith("on:")
    slot = ring_slots.claim()
    try:
        code, out = run_main(capsys, "doctor", "--no-probe")
        line = [ln for ln in out.splitlines() if "step rings" in ln][0]
        assert "1 held now" in line and str(os.getpid()) in line, line
    finally:
        slot.release()
    (tmp_path / "a_file").write_bytes(b"")
    monkeypatch.setenv("GYM_FORK_RING_SLOTS_DIR", str(tmp_path / "a_file"))  # cannot hold slots
    code, out = run_main(capsys, "doctor", "--json", "--no-probe")
    ring = json.loads(out)["checks"]["step_rings"]
    assert ring["value"].startswith("none:") and "a_file" in ring["value"] and "not a directory" in ring["value"]
    assert ring["data"]["dir_problem"] == "it is not a directory"
    monkeypatch.setenv("GYM_FORK_RING", "0")
    code, out = run_main(capsys, "doctor", "--json", "--no-probe")
    assert json.loads(out)["checks"]["step_rings"]["value"].startswith("off")


def test_run_says_why_a_job_did_not_run(tmp_path):
    """`gym-fork run` keeps the job's stdio in log files (CRIU moves the job with them), so a job
    that fails says nothing on the terminal by itself: the supervisor says it, with the log's end."""
    base = [sys.executable, "-m", "gym_fork.cli", "run", "--log-dir", str(tmp_path), "--"]
    missing = subprocess.run(base + ["no-such-trainer-xyz"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 127
    assert "cannot run 'no-such-trainer-xyz': no such executable" in missing.stderr
    assert not (tmp_path / "stderr.log").exists()  # refused before anything started
    script = "import sys; print('step 1'); print('lost the dataset', file=sys.stderr); sys.exit(3)"
    failed = subprocess.run(base + [sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert failed.returncode == 3
    assert f"the job exited with code 3; the end of {tmp_path / 'stderr.log'}:\nlost the dataset" in failed.stderr
    assert (tmp_path / "stdout.log").read_text() == "step 1\n"
    ok = subprocess.run(base + [sys.executable, "-c", "print('fine')"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "exited with code" not in ok.stderr
