"""The package as users get it: an sdist and a wheel built from it, installed without the
checkout, ship the CLI, the type marker and the CRIU installer with its patches."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHIPPED = ["gym_fork/py.typed", "gym_fork/criu/install/install_criu.sh",
           "gym_fork/criu/install/criu-patches/0001-sockets-sockopt-passcred-passsec-family.patch"]


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, pathlib.Path]:
    """``python -m build``: the sdist from the checkout, then the wheel from that sdist (so a file
    missing from the sdist is missing from the wheel too)."""
    out = tmp_path_factory.mktemp("dist")
    p = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (sdist,) = out.glob("gym_fork-*.tar.gz")
    (wheel,) = out.glob("gym_fork-*.whl")
    return {"sdist": sdist, "wheel": wheel}


def test_wheel_and_sdist_ship_the_installer(dists):
    names = set(zipfile.ZipFile(dists["wheel"]).namelist())
    for f in SHIPPED:
        assert f in names, f"{f} is not in the wheel"
    assert not any(n.startswith(("tests/", "benchmarks/", "scripts/")) for n in names)
    entry = zipfile.ZipFile(dists["wheel"]).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "gym-fork = gym_fork.cli:main" in entry
    with tarfile.open(dists["sdist"]) as t:
        snames = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    for f in SHIPPED + ["setup.cfg", "README.md"]:
        assert f in snames, f"{f} is not in the sdist"


def test_installed_wheel_runs_without_the_checkout(dists, tmp_path):
    """Install the wheel (no deps) into a fresh venv that sees the dependencies of this one but not
    the checkout: the console script works and finds the installer inside the installed package."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # A plain path line (not site.addsitedir): this venv's packages are importable, its .pth files
    # (the editable install that maps gym_fork to the checkout) are not run.
    pathlib.Path(site, "deps-from-test-venv.pth").write_text(sysconfig.get_path("purelib") + "\n")
    p = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index",
                        str(dists["wheel"])], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    gf = venv / "bin" / "gym-fork"

    def run(*args: str) -> str:
        r = subprocess.run([str(gf), *args], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
        assert r.returncode == 0, f"gym-fork {' '.join(args)}: {r.stdout}{r.stderr}"
        return r.stdout

    where = subprocess.run([str(py), "-c", "import gym_fork; print(gym_fork.__file__)"], capture_output=True,
                           text=True, cwd=tmp_path, env=env, check=True).stdout.strip()
    assert where.startswith(site), f"gym_fork was imported from {where}, not from the installed wheel"
    assert "install-criu" in run("--help")
    assert "PREFIX" in run("install-criu", "--help")
    script = pathlib.Path(run("install-criu", "--script").strip())
    assert str(script).startswith(site) and script.is_file()
    assert (script.parent / "criu-patches").is_dir()
    assert any((script.parent / "criu-patches").glob("*.patch"))
    # bash can read it (a syntax error would show here, before any root-only step)
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=60)


def test_the_suite_has_one_conftest():
    # Env workers built from test factories import helpers as `conftest`; a second conftest.py
    # (pytest puts its folder first on sys.path) would shadow tests/conftest.py in the workers.
    tests = pathlib.Path(__file__).parent
    found = sorted(str(p.relative_to(tests)) for p in tests.rglob("conftest.py"))
    assert found == ["conftest.py"], f"move fixtures into tests/conftest.py instead of {found}"
