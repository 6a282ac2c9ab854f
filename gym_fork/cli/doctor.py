"""``gym-fork doctor``: can gym_fork use CRIU here, what is missing and how to fix it."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from gym_fork import __version__
from gym_fork.criu.status import criu_candidates, criu_status

INSTALL_CMD = "sudo $(which gym-fork) install-criu"
PROBE_ENV = "CartPole-v1"
PROBE_WARMUP, PROBE_STEPS = 20, 10

# Linux capability bits (include/uapi/linux/capability.h).
CAP_SYS_ADMIN = 21
CAP_CHECKPOINT_RESTORE = 40  # Linux >= 5.9


# --------------------------------------------------------------------------------------------
# doctor: the checks
# --------------------------------------------------------------------------------------------
@dataclass
class Check:
    """One line of the doctor's report. ``ok``: True (✔), False (✘) or None (information only)."""

    key: str
    label: str
    ok: bool | None
    value: str
    fix: str | None = None
    data: dict = field(default_factory=dict)


def effective_caps() -> int | None:
    """This process's effective capability mask (``CapEff`` in /proc/self/status), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cap_last() -> int | None:
    """The highest capability number this kernel knows (``/proc/sys/kernel/cap_last_cap``)."""
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _module_version(name: str) -> tuple[str | None, str | None]:
    """(version, error): the module's version when it imports, else the import error."""
    try:
        if name == "protobuf":
            import google.protobuf as mod
        elif name == "pycriu":
            import pycriu as mod
            from pycriu import rpc_pb2  # noqa: F401  (the part gym_fork needs; fails on protobuf clashes)
        else:
            mod = __import__(name)
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {e}"
    ver = getattr(mod, "__version__", None)
    if ver is None:
        ver = getattr(getattr(mod, "version", None), "__version__", None)
    return str(ver or "installed"), None


def system_checks() -> tuple[list[Check], Any]:
    """Everything doctor reports without running an env. Returns (checks, CriuStatus)."""
    st = criu_status()
    checks: list[Check] = []

    # criu binary, and the ones passed over
    cands = criu_candidates()
    if st.binary:
        checks.append(Check("criu_binary", "criu binary", True, f"{st.binary} (CRIU {st.version})",
                            data={"path": st.binary, "version": st.version}))
    else:
        checks.append(Check("criu_binary", "criu binary", False, "no criu >= 4.0 found",
                            fix=f"run `{INSTALL_CMD}` to build and install CRIU 4.1.1 into /usr/local "
                                "(or point $GYM_FORK_CRIU at a criu >= 4.0)",
                            data={"path": None, "version": None}))
    for c in cands:
        if c["rejected"]:
            checks.append(Check("criu_rejected", "ignored criu", None if st.binary else False,
                                f"{c['path']}: {c['rejected']}", data=dict(c)))

    # criu check
    if st.binary and st.is_root:
        good = not any("criu check" in r for r in st.reasons)
        last = st.check_output.splitlines()[-1] if st.check_output else "(no output)"
        checks.append(Check("criu_check", "criu check", good, last,
                            fix=None if good else "read the full `criu check` output above (run it yourself as "
                            "root for details); a kernel without the needed features cannot be fixed from here",
                            data={"output": st.check_output}))
    elif st.binary and not st.is_root:
        checks.append(Check("criu_check", "criu check", None, "not run (as non-root, `criu check` does not "
                            "predict whether CRIU works in a user namespace; the criu probe below decides)",
                            data={"output": ""}))
    else:
        why = "no criu binary" if not st.binary else "needs root"
        checks.append(Check("criu_check", "criu check", False if st.binary else None, f"not run ({why})",
                            data={"output": ""}))

    # Python side
    pv, perr = _module_version("pycriu")
    checks.append(Check("pycriu", "pycriu", pv is not None, pv or f"does not import ({perr})",
                        fix=None if pv else f"run `{INSTALL_CMD}` (it installs pycriu into that Python's "
                        "environment); if it says protobuf, see the protobuf line",
                        data={"version": pv, "error": perr}))
    bv, berr = _module_version("protobuf")
    checks.append(Check("protobuf", "protobuf", bv is not None, bv or f"does not import ({berr})",
                        fix=None if bv else "pip install 'protobuf>=3.20,<7'",
                        data={"version": bv, "error": berr}))

    # privileges
    euid = os.geteuid()
    checks.append(Check("root", "root", True if euid == 0 else None,
                        "yes" if euid == 0 else f"no (euid {euid}): CRIU runs in an unprivileged user namespace "
                        "instead (see the userns line), the fork tier needs no privilege",
                        data={"euid": euid}))
    if euid != 0:
        from gym_fork.criu.userns import userns_blockers

        us = st.userns
        found, admin_fix = userns_blockers()
        if us is None:  # criu_status stopped earlier (no binary, no pycriu): test the namespace anyway
            from gym_fork.criu.userns import userns_support

            us = userns_support()
        checks.append(Check("userns", "user namespaces", us.ok,
                            "unprivileged user + mount namespaces work (CRIU runs there with --unprivileged)"
                            if us.ok else f"unavailable: {us.error}" + (f" ({'; '.join(us.blockers)})"
                                                                          if us.blockers else ""),
                            fix=None if us.ok else "an administrator can: " + "; ".join(us.admin_fix or admin_fix)
                            + ". Until then only the fork tier (in-memory snapshots) works for this user",
                            data={"ok": us.ok, "error": us.error, "blockers": list(us.blockers),
                                  "admin_fix": list(us.admin_fix), "sysctls_found": found}))
        checks.append(Check("nonroot_limits", "without root", None,
                            "lazy-pages (post-copy) migration needs root: CRIU 4.1 disables userfaultfd with "
                            "--unprivileged; CRIU snapshots, restores, fork() and save/load work in the user "
                            "namespace (each worker is PID 1 of its own PID namespace there, so images restore "
                            "concurrently); file-capability criu (setcap) is not needed",
                            data={"lazy_pages": False}))
    caps, last = effective_caps(), _cap_last()
    docker_hint = ("in a container: run it with --privileged, or --cap-add SYS_ADMIN "
                   "--cap-add CHECKPOINT_RESTORE --security-opt seccomp=unconfined")
    has_admin = caps is not None and bool(caps >> CAP_SYS_ADMIN & 1)
    checks.append(Check("cap_sys_admin", "CAP_SYS_ADMIN", has_admin if caps is not None else None,
                        "unknown (no /proc/self/status)" if caps is None else ("yes" if has_admin else "no"),
                        fix=None if has_admin or caps is None or euid else docker_hint,
                        data={"present": has_admin, "cap_eff": None if caps is None else f"{caps:016x}"}))
    has_cr = caps is not None and bool(caps >> CAP_CHECKPOINT_RESTORE & 1)
    if caps is None:
        cr_ok, cr_val = None, "unknown"
    elif has_cr:
        cr_ok, cr_val = True, "yes"
    elif last is not None and last < CAP_CHECKPOINT_RESTORE:
        cr_ok, cr_val = (None if has_admin else False), "not known to this kernel (Linux < 5.9)"
    else:
        cr_ok, cr_val = (None if has_admin else False), "no"
    if cr_ok is None and has_admin and not has_cr:
        cr_val += "; not needed, CAP_SYS_ADMIN covers it"
    if euid:  # not needed: CRIU runs in a user namespace where we have every capability
        has_admin = has_admin or None  # type: ignore[assignment]
        checks[-1].ok = None
        cr_ok = None
    checks.append(Check("cap_checkpoint_restore", "CAP_CHECKPOINT_RESTORE", cr_ok, cr_val,
                        fix=None if cr_ok is not False or euid else docker_hint,
                        data={"present": has_cr}))

    # files written below Python (children, native code): the worker's fanotify watch
    from gym_fork.worker import fswatch

    watching = fswatch.start(refresh=True)
    unwatched = fswatch.unwatched()
    fswatch.forget()
    if watching:
        fw_val = "yes (fanotify: writes by the env's child processes and native code are seen)"
        if unwatched:
            fw_val += "; not watched: " + ", ".join(unwatched)
    else:
        fw_val = ("no: only the env's Python-level writes outside its workspace are seen (fanotify "
                  "filesystem marks need root and Linux >= 5.9); keep files the env's children write in "
                  "its workspace")
    checks.append(Check("file_watch", "writes below Python", True if watching else None, fw_val,
                        data={"fanotify": watching, "unwatched": unwatched}))

    # the shared-memory step rings (gym_fork.worker.ring): whether an env will get one
    from gym_fork.worker import ring as rings, ring_slots

    setting, slots, holders = os.environ.get("GYM_FORK_RING", "1"), ring_slots.count(), ring_slots.held()
    slot_problem = ring_slots.problem()
    if setting == "0":
        ring_val = "off (GYM_FORK_RING=0): every step goes through the worker's socket"
    elif not rings.supported():
        ring_val = "none: rings need x86-64 Linux with memfd_create; steps go through the worker's socket"
    elif slots == 0:
        ring_val = "none: one CPU (a ring spins on a CPU beside the learner's); steps go through the socket"
    elif slot_problem is not None:
        ring_val = (f"none: the ring slot directory {ring_slots.directory()} cannot be used: {slot_problem}; "
                    "set GYM_FORK_RING_SLOTS_DIR to a directory only you can write (mode 700)")
    else:
        ring_val = (f"on: an env stepped one request at a time gets one after 64 steps while a slot is free; "
                    f"{slots} slot(s) on this machine, {len(holders)} held now"
                    + (f" (pids {', '.join(map(str, holders))})" if holders else "")
                    + f"; see env.step_path")
    checks.append(Check("step_rings", "step rings", None, ring_val,
                        data={"setting": setting, "supported": rings.supported(), "slots": slots,
                              "held_by": holders, "dir": ring_slots.directory(),
                              "dir_problem": slot_problem}))

    # system
    checks.append(Check("kernel", "kernel", None, f"{platform.system()} {platform.release()} ({platform.machine()})",
                        data={"release": platform.release(), "machine": platform.machine()}))
    checks.append(Check("criu_usable", "criu usable", st.usable,
                        "yes" if st.usable else "no: " + "; ".join(st.reasons),
                        # the lines above already say what to do; repeat criu_status's advice only
                        # when none of them does
                        fix=None if st.usable or any(c.ok is False and c.fix for c in checks)
                        else "; ".join(dict.fromkeys(st.advice)) or None,
                        data={"reasons": list(st.reasons), "advice": list(st.advice)}))
    return checks, st


# --------------------------------------------------------------------------------------------
# doctor: the probe (a real snapshot / restore round trip)
# --------------------------------------------------------------------------------------------
def _same(a: Any, b: Any) -> bool:
    import numpy as np

    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# probe name -> ForkableEnv arguments
PROBE_KINDS = {
    "criu": {"backend": "criu", "fork_tier": False},  # every snapshot a CRIU dump
    "fork": {"backend": "auto", "fork_tier": True},  # copy-on-write fork() snapshots (also fork-only, non-root)
    "pickle": {"backend": "pickle"},
}


def probe(backend: str) -> dict:
    """Run CartPole through snapshot -> 10 steps -> restore -> the same 10 steps, for real.

    Returns ``{"backend", "ok", "error", "snapshot_ms", "restore_ms", "start_ms", "size_bytes"}``;
    ``ok`` means the replayed steps gave bit-identical observations, rewards and flags.
    """
    import gym_fork

    res: dict[str, Any] = {"backend": backend, "ok": False, "error": None, "env": PROBE_ENV,
                           "start_ms": None, "snapshot_ms": None, "restore_ms": None, "size_bytes": None}
    actions = [i % 2 for i in range(PROBE_STEPS)]  # alternating pushes keep the pole up
    env = None
    try:
        t0 = time.perf_counter()
        env = gym_fork.ForkableEnv(PROBE_ENV, **PROBE_KINDS[backend])
        res["start_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        env.reset(seed=0)
        for i in range(PROBE_WARMUP):
            env.step(i % 2)
        t0 = time.perf_counter()
        snap = env.snapshot()
        res["snapshot_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        res["size_bytes"] = snap.size_bytes if backend != "fork" else snap.memory_bytes()
        first = [env.step(a) for a in actions]
        t0 = time.perf_counter()
        env.restore(snap)
        res["restore_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        again = [env.step(a) for a in actions]
        for i, (x, y) in enumerate(zip(first, again)):
            if not (_same(x[0], y[0]) and _same(x[1], y[1]) and x[2:4] == y[2:4]):
                res["error"] = (f"step {i} after restore differs: obs {x[0]!r} then {y[0]!r} "
                                f"(reward {x[1]}/{y[1]}, terminated {x[2]}/{y[2]})")
                break
        else:
            res["ok"] = True
        snap.release()
    except Exception as e:  # noqa: BLE001 - the doctor reports every failure
        msg = str(e).strip()
        res["error"] = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    finally:
        if env is not None:
            try:
                env.close()
            except Exception:  # noqa: BLE001
                pass
    return res


def _probe_check(res: dict | None, backend: str, skipped_why: str | None = None) -> Check:
    label = f"probe {backend}"
    if res is None:
        return Check(f"probe_{backend}", label, None, f"not run ({skipped_why})", data={"ran": False})
    data = {"ran": True, **res}
    if res["ok"]:
        size = res["size_bytes"]
        size_s = f"{size / 1e6:.1f} MB" if size and size >= 1e6 else f"{size} B"
        return Check(f"probe_{backend}", label, True,
                     f"ok: snapshot {res['snapshot_ms']:.1f} ms, restore {res['restore_ms']:.1f} ms "
                     f"({size_s}; {PROBE_STEPS} replayed {PROBE_ENV} steps bit-identical)", data=data)
    fix = ("the pickle backend needs only gymnasium, numpy and cloudpickle: reinstall them "
           "(pip install -e . in the gym_fork checkout)")
    if backend == "criu":
        fix = ("check the ✘ lines above; if all look fine, the CRIU log named in the error says why "
               f"(re-install with `{INSTALL_CMD}` if the binary or pycriu is broken)")
    return Check(f"probe_{backend}", label, False, f"FAILED: {res['error']}", fix=fix, data=data)


# --------------------------------------------------------------------------------------------
# doctor: the command
# --------------------------------------------------------------------------------------------
def doctor_report(probe_mode: bool | None = None) -> dict:
    """The doctor's findings as a JSON-able dict (what ``gym-fork doctor --json`` prints).

    ``probe_mode``: True runs the real probes, False none, None (default) probes pickle always
    and criu only when CRIU looks usable.
    """
    checks, st = system_checks()
    pickle_res = None if probe_mode is False else probe("pickle")
    if probe_mode is True or (probe_mode is None and st.usable):
        criu_res: dict | None = probe("criu")
        fork_res: dict | None = probe("fork")
        criu_skip = None
    else:
        criu_res = fork_res = None
        criu_skip = "--no-probe" if probe_mode is False else "CRIU is not usable here; --probe forces it"
        if probe_mode is None and not st.is_root:
            fork_res = probe("fork")  # non-root without CRIU: the fork tier still works
    checks.append(_probe_check(criu_res, "criu", criu_skip))
    checks.append(_probe_check(fork_res, "fork", criu_skip))
    checks.append(_probe_check(pickle_res, "pickle", "--no-probe"))

    # which backends work: the probe's verdict when it ran, else the static one
    works = {
        "criu": criu_res["ok"] if criu_res is not None else st.usable,
        "fork": fork_res["ok"] if fork_res is not None else st.usable,
        "pickle": pickle_res["ok"] if pickle_res is not None else _module_version("cloudpickle")[0] is not None,
    }

    # what backend="auto" does (the same rule as gym_fork.backends.get_backend)
    if st.usable and st.mode == "userns":
        auto = "criu"
        because = (f"not root, but CRIU {st.version} at {st.binary} runs in an unprivileged user namespace "
                   "(--unprivileged, through a holder process); in-memory snapshots use the copy-on-write fork "
                   "tier when the env worker is single-threaded, CRIU images when persisted, saved or when it is "
                   "not; lazy-pages migration needs root")
    elif st.usable:
        auto = "criu"
        because = (f"CRIU {st.version} at {st.binary} is usable (criu check passed, running as root, "
                   "pycriu imports); in-memory snapshots use the copy-on-write fork tier when the env "
                   "worker is single-threaded, CRIU images when persisted or when it is not")
        if criu_res is not None and not criu_res["ok"]:
            because += "; BUT the criu probe failed, so envs will fail to snapshot: fix that, or pass backend='pickle'"
    elif not st.is_root and hasattr(os, "fork"):
        auto = "criu (fork-only)"
        because = ("CRIU cannot run for this user (" + "; ".join(st.reasons) + "), but copy-on-write fork() "
                   "snapshots need no privilege: in-memory snapshot/restore/fork() work for single-threaded "
                   "env workers; persist() and save/load do not; a multi-threaded (torch) worker's env uses "
                   "backend 'pickle' if it pickles exactly (not EzPickle), else is refused at start-up")
    else:
        auto = "pickle"
        because = ("CRIU is not usable: " + "; ".join(st.reasons)
                   + ". The pickle backend copies only pure-Python/NumPy envs exactly and refuses the "
                   "others (Box2D, MuJoCo, Atari)")
    ok = any(works.values())
    return {
        "gym_fork": __version__,
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "checks": {c.key if c.key != "criu_rejected" else f"criu_rejected:{c.data['path']}": asdict(c)
                   for c in checks},
        "criu": {"usable": st.usable, "binary": st.binary, "version": st.version, "pycriu": st.pycriu,
                 "is_root": st.is_root, "check_output": st.check_output, "reasons": list(st.reasons),
                 "advice": list(st.advice), "rejected": list(st.rejected)},
        "probes": {"criu": criu_res, "fork": fork_res, "pickle": pickle_res},
        "works": works,
        "auto": {"backend": auto, "because": because},
        "ok": ok,
        "exit_code": 0 if ok else 1,
    }


def _markers() -> tuple[str, str, str]:
    enc = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        "✔✘·".encode(enc)
        return "✔", "✘", "·"
    except (UnicodeEncodeError, LookupError):
        return "OK", "XX", "--"


def format_report(rep: dict) -> str:
    yes, no, info = _markers()
    checks = list(rep["checks"].values())
    width = max(len(c["label"]) for c in checks)
    lines = [f"gym-fork doctor: gym_fork {rep['gym_fork']}, Python {rep['python']} ({rep['executable']})", ""]
    for c in checks:
        mark = yes if c["ok"] is True else no if c["ok"] is False else info
        lines.append(f"  {mark} {c['label']:<{width}} : {c['value']}")
        if c["key"] == "criu_check" and c["ok"] is False and c["data"].get("output"):
            lines += [f"      | {ln}" for ln in c["data"]["output"].splitlines()[-8:]]
    fixes = [(c["label"], c["fix"]) for c in checks if c["ok"] is False and c["fix"]]
    if fixes:
        lines += ["", "To fix:"]
        seen: set[str] = set()
        for label, fix in fixes:
            if fix not in seen:
                seen.add(fix)
                lines.append(f"  - {label}: {fix}")
    works = [b for b, w in rep["works"].items() if w]
    lines += ["", f"working backends: {', '.join(works) if works else 'none'}",
              f"auto will use: {rep['auto']['backend']} because {rep['auto']['because']}"]
    return "\n".join(lines)


def cmd_doctor(args: argparse.Namespace) -> int:
    rep = doctor_report(args.probe)
    if args.json:
        print(json.dumps(rep, indent=2, default=str))
    else:
        print(format_report(rep))
    return rep["exit_code"]


def _configure_doctor(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (checks, probe timings, auto's choice) instead of text")
    p.add_argument("--probe", action=argparse.BooleanOptionalAction, default=None,
                   help="run a real snapshot/restore round trip with CartPole for each backend "
                        "(default: pickle always, criu when CRIU looks usable; --probe forces the criu "
                        "probe to see its actual error, --no-probe skips both)")


# --------------------------------------------------------------------------------------------
# the command table and main()
# --------------------------------------------------------------------------------------------


HELP = "check whether gym_fork can use CRIU here, and what to fix if not"
DESCRIPTION = (
    "Check everything the 'criu' backend needs: the criu binary (>= 4.0; older ones such as "
    "Debian's 3.17 are listed as ignored, with the reason), `criu check`, the pycriu and "
    "protobuf Python packages, root / CAP_SYS_ADMIN / CAP_CHECKPOINT_RESTORE and the kernel. "
    "Then, for real, start CartPole-v1 in each backend (CRIU dumps, the fork tier, pickle), take a snapshot, "
    "step, restore and replay the same actions, and check the observations are bit-identical "
    "(with snapshot and restore timings). Finally say which backend backend='auto' will pick "
    "and why, and for each problem what to do about it.\n\n"
    "Exit status: 0 when at least one backend works, 1 when none does."
)
EPILOG = (
    "examples:\n"
    "  gym-fork doctor                 human-readable report (with probes)\n"
    "  gym-fork doctor --no-probe      only the static checks (no env is started)\n"
    "  gym-fork doctor --probe         also probe criu when the checks say it cannot work\n"
    "  gym-fork doctor --json | jq .auto\n\n"
    "legend: ✔ ok   ✘ problem (a 'To fix' hint follows)   · information\n\n"
    "CRIU missing or too old?\n"
    f"  {INSTALL_CMD}\n"
    "  (in a gym_fork checkout the same is: sudo PYTHON=$(which python) scripts/install_criu.sh)"
)


configure = _configure_doctor
run = cmd_doctor
