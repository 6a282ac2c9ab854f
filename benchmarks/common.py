"""Shared helpers for the gym_fork benchmarks: timing, markdown tables, progress, results JSON.

Typical use in a benchmark script::

    from benchmarks.common import Progress, median_ms, print_table, save_results

    t = median_ms(lambda: env.snapshot(), reps=7, warmup=1, teardown=lambda s: s.release())
    print_table(["env", "snapshot ms"], [["CartPole-v1", fmt(t)]])
    save_results("my_bench", {"snapshot_ms": t})        # -> results/my_bench.json, or --out DIR

Run benchmark scripts from the repository root as modules (``python -m benchmarks.NAME``) or as
files (``python benchmarks/NAME.py``); both work.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
# Where results go: ``--out DIR`` (:func:`add_out_option`), else $GYM_FORK_RESULTS, else results/.
_results_dir = Path(os.environ.get("GYM_FORK_RESULTS") or REPO_ROOT / "results")


def results_dir() -> Path:
    """The directory results are written to (created by :func:`save_results`)."""
    return _results_dir


class _OutAction(argparse.Action):
    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        global _results_dir
        _results_dir = Path(values).resolve()
        setattr(namespace, self.dest, _results_dir)


def add_out_option(parser: argparse.ArgumentParser) -> None:
    """``--out DIR``: write this benchmark's results (JSON, figures) to DIR instead of results/."""
    parser.add_argument("--out", metavar="DIR", action=_OutAction, default=_results_dir,
                        help="directory for the results (default: $GYM_FORK_RESULTS, else results/ in the checkout)")

# --- timing ------------------------------------------------------------------------------------


def time_reps(fn: Callable[[], Any], reps: int = 7, warmup: int = 1, *,
              setup: Callable[[], Any] | None = None,
              teardown: Callable[[Any], Any] | None = None,
              collect: bool = True) -> list[float]:
    """Run ``fn`` ``warmup + reps`` times; return the ``reps`` timed durations in seconds.

    ``setup()`` runs untimed before every call; ``teardown(result_of_fn)`` untimed after it (e.g.
    releasing a snapshot).  With ``collect`` the garbage collector runs (untimed) before each call
    and stays disabled while it is timed, so a stray collection does not land in one sample.
    """
    out: list[float] = []
    for i in range(warmup + reps):
        if setup is not None:
            setup()
        if collect:
            gc.collect()
            gc.disable()
        try:
            t0 = time.perf_counter()
            res = fn()
            dt = time.perf_counter() - t0
        finally:
            if collect:
                gc.enable()
        if teardown is not None:
            teardown(res)
        if i >= warmup:
            out.append(dt)
    return out


def median_ms(fn: Callable[[], Any], reps: int = 7, warmup: int = 1, **kw: Any) -> float:
    """Median wall time of ``fn`` in milliseconds (see :func:`time_reps` for the options)."""
    return statistics.median(time_reps(fn, reps, warmup, **kw)) * 1e3


def summarize(samples_s: Sequence[float], unit: float = 1e3) -> dict:
    """Median/min/max/IQR of samples given in seconds, scaled by ``unit`` (1e3: ms, 1e6: µs)."""
    xs = sorted(x * unit for x in samples_s)
    if not xs:
        return {"median": None, "min": None, "max": None, "q1": None, "q3": None, "samples": []}
    if len(xs) >= 2:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    else:
        q1 = q3 = xs[0]
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "q1": q1, "q3": q3,
            "samples": [round(x, 6) for x in xs]}


# --- formatting --------------------------------------------------------------------------------


def fmt(x: float | None, digits: int | None = None) -> str:
    """A number for a table: ``—`` for missing; 3 significant-ish digits unless told."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if digits is not None:
        return f"{x:.{digits}f}"
    ax = abs(x)
    if ax >= 100:
        return f"{x:.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    if ax >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt_ratio(a: float | None, b: float | None) -> str:
    r = ratio(a, b)
    return "—" if r is None else f"{r:.2f}×" if r < 10 else f"{r:.0f}×"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]],
                   align: str | None = None) -> str:
    """A GitHub markdown table. ``align``: one char per column, ``l``/``r``/``c`` (default: first
    column left, the rest right)."""
    rows = [[str(c) for c in r] for r in rows]
    headers = [str(h) for h in headers]
    n = len(headers)
    align = align or ("l" + "r" * (n - 1))
    widths = [max([len(headers[i])] + [len(r[i]) for r in rows]) for i in range(n)]

    def cell(s: str, i: int) -> str:
        return s.ljust(widths[i]) if align[i] == "l" else s.center(widths[i]) if align[i] == "c" else s.rjust(widths[i])

    def rule(i: int) -> str:
        w = max(widths[i], 3)
        return {"l": ":" + "-" * (w - 1), "r": "-" * (w - 1) + ":", "c": ":" + "-" * (w - 2) + ":"}[align[i]]

    lines = ["| " + " | ".join(cell(h, i) for i, h in enumerate(headers)) + " |",
             "| " + " | ".join(rule(i) for i in range(n)) + " |"]
    lines += ["| " + " | ".join(cell(r[i], i) for i in range(n)) + " |" for r in rows]
    return "\n".join(lines)


def print_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, title: str | None = None,
                note: str | None = None, align: str | None = None, file=None) -> str:
    """Print a markdown table (with an optional ``### title`` and a note under it) to stdout."""
    file = file or sys.stdout
    text = markdown_table(headers, rows, align)
    if title:
        print(f"\n### {title}\n", file=file)
    print(text, file=file)
    if note:
        print(f"\n{note}", file=file)
    file.flush()
    return text


# --- progress (stderr) -------------------------------------------------------------------------


class Progress:
    """A tqdm bar on stderr when it is a terminal, else one plain line per step.

    >>> with Progress(3, "demo") as p:          # doctest: +SKIP
    ...     p.step("first"); p.step("second"); p.step("third")
    """

    def __init__(self, total: int, desc: str = ""):
        self.total, self.desc, self.n = total, desc, 0
        self.t0 = time.perf_counter()
        self._bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=True, dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, label: str = "") -> None:
        self.n += 1
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=False)
            self._bar.update(1)
        else:
            el = time.perf_counter() - self.t0
            print(f"[{self.desc} {self.n}/{self.total} {el:6.1f}s] {label}", file=sys.stderr, flush=True)

    def write(self, msg: str) -> None:
        """A note on stderr that does not break the bar."""
        if self._bar is not None:
            self._bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --- results -----------------------------------------------------------------------------------


def machine_info() -> dict:
    """Where the numbers came from: host, Python, key package versions, CRIU."""
    info: dict[str, Any] = {
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "kernel": platform.release(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "argv": sys.argv,
        "loadavg_at_save": list(os.getloadavg()),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    from importlib import metadata

    versions = {}
    for pkg in ("gym_fork", "gymnasium", "numpy", "cloudpickle", "stable_baselines3", "mujoco", "box2d",
                "ale_py", "torch"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    info["versions"] = versions
    try:
        from gym_fork.criu.status import criu_status

        st = criu_status()
        info["criu"] = {"usable": st.usable, "binary": st.binary, "version": st.version,
                        "reasons": st.reasons}
    except Exception as e:  # noqa: BLE001 - informational only
        info["criu"] = {"error": f"{type(e).__name__}: {e}"}
    return info


def _jsonable(o: Any) -> Any:
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:
        pass
    if isinstance(o, Path):
        return str(o)
    return repr(o)


def save_results(name: str, data: dict, *, with_machine: bool = True) -> Path:
    """Write ``data`` (plus ``machine`` info) to ``<results dir>/<name>.json`` (see
    :func:`results_dir`); returns the path."""
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    payload = dict(data)
    if with_machine and "machine" not in payload:
        payload["machine"] = machine_info()
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, default=_jsonable)
        f.write("\n")
    os.replace(tmp, path)
    return path


def busy_check(threshold: float = 0.5) -> dict:
    """Load on this machine now, and a warning on stderr when it is busy (numbers will be noisy).

    Busy = the 1-minute load average is above ``threshold`` × the CPUs we may use.  Store the
    returned dict with the results so a reader can tell a quiet run from a contended one.
    """
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    load = os.getloadavg()
    busy = load[0] > threshold * ncpu
    if busy:
        print(f"warning: this machine is busy (load average {load[0]:.2f} on {ncpu} CPUs): timings will be "
              "noisy; rerun when it is idle for clean numbers", file=sys.stderr, flush=True)
    return {"loadavg": list(load), "cpus": ncpu, "busy": busy}


def ensure_repo_on_path() -> None:
    """Let ``python benchmarks/NAME.py`` import ``benchmarks.common`` and ``gym_fork``."""
    root = str(REPO_ROOT)
    if root not in sys.path:
        sys.path.insert(0, root)
