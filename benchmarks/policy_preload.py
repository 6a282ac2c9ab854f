"""explore(policy_in_worker=True): what unpickling the policy costs each branch, and preloading.

    python benchmarks/policy_preload.py [--reps 5] [--branches 16] [--horizon 100] [--json F]

A policy pickled *by reference* (its class or function lives in an importable module, as in any
real project) makes every branch's worker import that module when it unpickles the policy: each
branch is a new copy of the snapshot, which never imported it. ``explore`` therefore has the first
branch unpickle the policy (timed with and without the imports) and, when the other branches would
spend at least ``PRELOAD_MIN_SAVING_S`` on it together, forks them from that branch's worker
instead of from the snapshot (``gym_fork.backends.criu.CriuBackend._clone_preloaded``).

Rows: LunarLander, ``--branches`` closed-loop branches x ``--horizon`` steps from a snapshot at
depth 100, the policy in the workers, for three policies:

* **by value**: a class defined in ``__main__`` (cloudpickle ships its code; no import);
* **module**: the same class in a module whose import costs ~20 ms (numpy-level work at import);
* **torch module**: a module that imports torch and holds a small ``nn.Module`` (the import alone
  takes ~1.5 s of CPU here).

Each is timed with preloading (the default) and without it (``PRELOAD_MIN_SAVING_S`` set to
infinity: every branch unpickles its own policy, as before), modes interleaved rep by rep;
medians and the ratio. Every branch's actions are checked equal between the two modes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import gym_fork  # noqa: E402
from gym_fork.backends import criu  # noqa: E402

MODULE = '''
import numpy as np
_t = np.random.default_rng(0).random((400, 400))
for _ in range(6):
    _t = _t @ _t / 400  # ~20 ms of import-time work, as a module with real dependencies has


class Greedy:
    """Fire the engine that pushes the lander towards the pad's centre line."""
    def __call__(self, obs):
        return int(2 if obs[1] < 0.5 else (1 if obs[0] > 0 else 3))
'''

TORCH_MODULE = '''
import torch


class TorchPolicy:
    """A small MLP over the observation (weights fixed by seed): argmax of its 4 outputs."""
    def __init__(self):
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))

    def __call__(self, obs):
        with torch.no_grad():
            return int(self.net(torch.as_tensor(obs, dtype=torch.float32)).argmax())
'''


class ByValue:
    """The module's ``Greedy``, defined here: cloudpickle ships it by value."""

    def __call__(self, obs):
        return int(2 if obs[1] < 0.5 else (1 if obs[0] > 0 else 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="repetitions per mode (default 5)")
    ap.add_argument("--branches", type=int, default=16, help="branches per explore() (default 16)")
    ap.add_argument("--horizon", type=int, default=100, help="steps per branch (default 100)")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch row (its import is slow)")
    ap.add_argument("--json", metavar="FILE", help="also write the numbers to FILE")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="gym_fork_preload_")
    Path(tmp, "bench_policy_module.py").write_text(MODULE)
    Path(tmp, "bench_torch_policy.py").write_text(TORCH_MODULE)
    sys.path.insert(0, tmp)  # before the env starts: its worker gets the learner's sys.path
    import bench_policy_module  # noqa: E402

    policies = {"by value": ByValue, "module": bench_policy_module.Greedy}
    if not args.no_torch:
        import bench_torch_policy  # noqa: E402

        policies["torch module"] = bench_torch_policy.TorchPolicy
    env = gym_fork.ForkableEnv("LunarLander-v3", backend="criu", fork_tier=True)
    rows, out = [], {}
    default = criu.PRELOAD_MIN_SAVING_S
    try:
        env.reset(seed=0)
        for _ in range(100):
            env.step(0)
        for name, cls in policies.items():
            times: dict[str, list[float]] = {"preloaded": [], "each branch": []}
            actions: dict[str, list] = {}
            for rep in range(args.reps):
                for mode, threshold in (("preloaded", default), ("each branch", float("inf"))):
                    criu.PRELOAD_MIN_SAVING_S = threshold
                    print(f"[{name}] rep {rep + 1}/{args.reps}: {mode}", file=sys.stderr, flush=True)
                    snap = env.snapshot()
                    t0 = time.perf_counter()
                    res = gym_fork.explore(env, snap, cls(), n_branches=args.branches, horizon=args.horizon,
                                           policy_in_worker=True, stop_at_done=False, progress=False, rng="same")
                    times[mode].append(time.perf_counter() - t0)
                    snap.release()
                    got = [b.actions for b in res.branches]
                    if actions.setdefault(mode, got) != got:
                        raise SystemExit(f"{name}, {mode}: branches differ between repetitions")
            criu.PRELOAD_MIN_SAVING_S = default
            if actions["preloaded"] != actions["each branch"]:
                raise SystemExit(f"{name}: the branches differ with and without preloading")
            pre, each = statistics.median(times["preloaded"]), statistics.median(times["each branch"])
            rows.append((name, each, pre))
            out[name] = {"each_branch_s": each, "preloaded_s": pre, "samples": times}
    finally:
        criu.PRELOAD_MIN_SAVING_S = default
        env.close()
    print(f"\nexplore(policy_in_worker=True), LunarLander, {args.branches} branches x {args.horizon} steps, "
          f"medians of {args.reps}; branches identical in both modes\n")
    print("| policy | each branch unpickles it | preloaded (default) | ratio |")
    print("|---|---|---|---|")
    for name, each, pre in rows:
        print(f"| {name} | {each * 1e3:.0f} ms | {pre * 1e3:.0f} ms | {pre / each:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
