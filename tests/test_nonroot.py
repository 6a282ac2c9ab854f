"""gym_fork as an ordinary user: CRIU inside an unprivileged user namespace, the fork tier, and
the fall-back when user namespaces are disabled.

CI runs as root; these tests create an unprivileged user (``gymfork-test``, idempotent) and a
venv it can read (from Debian's /usr/bin/python3, with the packages copied from this venv: no
network; cached in $GYM_FORK_NONROOT_DIR, default /var/tmp/gym_fork_nonroot), then run
``tests/nonroot_driver.py`` as that user and check its JSON report.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig

import pytest

pytestmark = pytest.mark.criu

USER = "gymfork-test"
BASE = os.environ.get("GYM_FORK_NONROOT_DIR", "/var/tmp/gym_fork_nonroot")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what the workers import (no torch, no SB3): copied from the running venv
PACKAGES = ("gymnasium", "numpy", "numpy.libs", "Box2D", "cloudpickle", "farama_notifications",
            "typing_extensions.py", "pycriu", "google", "pygame", "pygame_ce.libs")


def _ensure_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
                        "--shell", "/usr/sbin/nologin", USER], check=True)
        return pwd.getpwnam(USER)


def _ensure_venv() -> str:
    """A venv the user can run (the pyenv interpreter under /root is mode 0700)."""
    venv = os.path.join(BASE, "venv")
    py = os.path.join(venv, "bin", "python")
    os.makedirs(BASE, exist_ok=True)
    os.chmod(BASE, 0o755)
    base_py = "/usr/bin/python3"
    ver = subprocess.run([base_py, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    if ver != "%d.%d" % sys.version_info[:2]:
        pytest.fail(f"{base_py} is Python {ver}, this venv {sys.version_info[:2]}: compiled packages "
                    "cannot be shared")
    site_src = sysconfig.get_paths()["purelib"]
    stamp = os.path.join(venv, ".gym_fork-nonroot-" + str(abs(hash(PACKAGES)) % 10**8))
    if not os.path.exists(stamp):
        if not os.path.exists(py):
            r = subprocess.run([base_py, "-m", "venv", "--without-pip", venv], capture_output=True, text=True)
            if r.returncode != 0:
                subprocess.run(["apt-get", "install", "-y", "-qq", "python3-venv"], check=True,
                               capture_output=True)
                subprocess.run([base_py, "-m", "venv", "--without-pip", venv], check=True)
        site_dst = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip()
        for name in PACKAGES:
            src = os.path.join(site_src, name)
            dst = os.path.join(site_dst, name)
            if os.path.isdir(src):
                shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
            elif os.path.isfile(src):
                shutil.copy2(src, dst)
        with open(stamp, "w") as f:
            f.write("ok\n")
    # gym_fork itself: fresh every session (the code under test), plus the driver
    site_dst = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
    shutil.rmtree(os.path.join(site_dst, "gym_fork"), ignore_errors=True)
    shutil.copytree(os.path.join(REPO, "gym_fork"), os.path.join(site_dst, "gym_fork"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(os.path.join(REPO, "tests", "nonroot_driver.py"), os.path.join(BASE, "nonroot_driver.py"))
    subprocess.run(["chmod", "-R", "a+rX", BASE], check=True)
    return py


@pytest.fixture(scope="module")
def as_user():
    if os.geteuid() != 0:
        pytest.skip("creating the test user needs root (CI runs as root)")
    pw = _ensure_user()
    py = _ensure_venv()

    def run(*args: str, timeout: float = 240) -> tuple[dict | None, subprocess.CompletedProcess]:
        from gym_fork.criu.status import criu_status

        env = {"PATH": f"{os.path.dirname(py)}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "HOME": "/tmp", "LANG": "C.UTF-8",
               # the criu build gym_fork found for root (e.g. /usr/local/sbin/criu)
               "GYM_FORK_CRIU": criu_status().binary or ""}
        p = subprocess.run(["runuser", "-u", pw.pw_name, "--", "/usr/bin/env", "-i",
                            *[f"{k}={v}" for k, v in env.items()], *args],
                           capture_output=True, text=True, timeout=timeout, cwd="/")
        lines = p.stdout.strip().splitlines()
        try:
            return json.loads(lines[-1]) if lines else None, p
        except json.JSONDecodeError:
            return None, p

    run.py = py
    return run


def _ok(res: dict, key: str) -> dict:
    assert "error" not in res[key], res[key]["error"]
    return res[key]


def test_userns_criu_and_fork_tier_as_plain_user(as_user):
    res, p = as_user(as_user.py, os.path.join(BASE, "nonroot_driver.py"), "userns")
    assert res is not None, p.stdout[-3000:] + p.stderr[-3000:]
    assert res["uid"] != 0
    assert res["usable"] and res["mode"] == "userns", res["reasons"]
    assert "without root" in res["log"] and "user namespace" in res["log"], res["log"]
    for key in ("fork_tier", "criu_dumps"):
        for name, r in _ok(res, key).items():
            assert r["same"], (key, name, r)
    assert _ok(res, "criu_dumps")["CartPole-v1"]["ends"] >= 1  # crossed an episode end
    for key in ("tree_auto", "tree_criu"):  # an env whose state is in a child process (a shell)
        r = _ok(res, key)["ShellSum"]
        assert r["same"] and r["snap_backend"] == "criu" and r["ends"] >= 1, (key, r)
    br = _ok(res, "branching")
    assert br["same"] and br["n"] == 4 and br["distinct_pids"] == 4, br
    ps = _ok(res, "persist")  # fork tier -> persist (promote + CRIU dump in the userns) -> evict
    assert ps["fork_payload"] and ps["persisted"] and ps["evicted"], ps
    assert ps["restore_same"] and ps["fork2_same"], ps  # restores from the images
    # save + load + from_snapshot (and restore into a fresh env) in a fresh interpreter of the user
    assert "error" not in ps["fresh"], ps["fresh"]["error"]
    assert ps["fresh_same"], ps
    to = _ok(res, "timeout")
    assert to["message"] and "did not finish within" in to["message"], to
    assert to["leaked"] == [], to
    # a copy that would work in the original's workspace (no mount namespaces without root): a
    # kept-running tool started there is refused at the fork, the env's own use of a path it derived
    # before the copy in its step; the original's notes stay its own either way
    ws = _ok(res, "ws_server")
    assert ws["refused"] and "UnsupportedEnvError" in ws["refused"] and "working directory" in ws["refused"], ws
    assert "without root" in ws["refused"], ws
    wd = _ok(res, "ws_derived")
    assert wd["refused"] and "ForeignWorkspaceError" in wd["refused"] and "Derive paths" in wd["refused"], wd
    for r in (ws, wd):
        assert r["original_notes"] == ["1:1"] and r["original_goes_on"] == [2.0, 2.0], r


def test_userns_disabled_falls_back_to_fork_tier(as_user):
    res, p = as_user(as_user.py, os.path.join(BASE, "nonroot_driver.py"), "nouserns")
    assert res is not None, p.stdout[-3000:] + p.stderr[-3000:]
    assert res["uid"] != 0 and res["max_user_namespaces"] == "0"
    assert not res["usable"] and res["mode"] is None
    assert any("user namespaces are unavailable" in r for r in res["reasons"]), res["reasons"]
    assert "max_user_namespaces" in " ".join(res["reasons"] + res["advice"])
    assert "fork-only mode" in res["log"], res["log"]
    for name, r in _ok(res, "fork_tier").items():
        assert r["same"], (name, r)
    assert "CRIU is unavailable for this user" in res["persist"], res["persist"]
    assert res["fork4_same"]
    # a worker with a thread: not forkable and no CRIU -> the pickle backend, exact, one log line
    th = _ok(res, "threaded")
    assert th["backend"] == "pickle" and th["snap_backend"] == "pickle" and th["same"], th
    lines = [ln for ln in res["log"].splitlines() if "ThreadedWalk" in ln]
    assert len(lines) == 1 and "using backend 'pickle'" in lines[0] and "2 threads" in lines[0], res["log"]
    # ... refused at start-up, naming the env and the administrator's fix, where pickle is not exact
    for name, why in (("ThreadedHolder", "cloudpickle cannot capture"), ("ThreadedEz", "EzPickle")):
        msg = res["refused"][name]
        assert msg and name in msg and why in msg, (name, msg)
        assert "user namespaces" in msg and "max_user_namespaces" in msg, msg


def test_doctor_as_plain_user(as_user):
    _res, p = as_user(as_user.py, "-m", "gym_fork.cli", "doctor", "--json")
    rep = json.loads(p.stdout)
    assert rep["criu"]["is_root"] is False
    checks = rep["checks"]
    assert checks["userns"]["ok"] is True, checks["userns"]
    assert rep["probes"]["criu"]["ok"], rep["probes"]["criu"]
    assert rep["probes"]["fork"]["ok"], rep["probes"]["fork"]
    assert rep["auto"]["backend"] == "criu" and "user namespace" in rep["auto"]["because"]
    assert "lazy" in json.dumps(checks).lower()  # says lazy-pages migration needs root
