"""A PPO job for `gym-fork run` that can be live-migrated (used by live_migration_demo.py and the
tests). Prints one JSON line per finished episode and a final line with a hash of the policy.

    gym-fork run --log-dir logs -- python examples/migration_train.py --target HOST:PORT --at 1500
    RAY_ADDRESS=HEAD:6379 gym-fork run --log-dir logs -- python examples/migration_train.py --ray-node NODE_ID --at 1500

(``--ray-node``: ``LiveMigrationCallback(RayNode(NODE_ID))``; the job moves into that Ray node's
migration host. The job itself never imports Ray: its final line says so.)
"""

import argparse
import hashlib
import json
import os
import sys
import time

import torch

torch.set_num_threads(1)
from stable_baselines3 import PPO  # noqa: E402
from stable_baselines3.common.callbacks import BaseCallback  # noqa: E402
from stable_baselines3.common.logger import KVWriter, Logger  # noqa: E402

from gym_fork.sb3 import LiveMigrationCallback  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--target", default=None, help="an agent's HOST:PORT (a comma-separated list: a route, one hop per trigger)")
p.add_argument("--ray-node", default=None, help="a Ray node id: migrate into that node's host actor "
               "(a comma-separated list: a route)")
p.add_argument("--at", default=None, help="migrate at this timestep (comma-separated: one per hop)")
p.add_argument("--notice-file", default=None)
p.add_argument("--hold-file", default=None,
               help="after arriving on a new node, wait (up to 120 s) until this file exists: lets a test "
                    "look at the job while it still runs there; training is unchanged")
p.add_argument("--total", type=int, default=3072)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--forkable", action="store_true",
               help="train on a gym_fork.ForkableEnv (its worker and snapshots move with the job)")
p.add_argument("--snap-at", type=int, default=None,
               help="with --forkable: snapshot the env at this timestep; at the end, restore it and report "
                    "a hash of 50 fixed steps from there")
args = p.parse_args()


class Progress(BaseCallback):
    def __init__(self, mig):
        super().__init__()
        self.mig, self.ep_ret, self.node = mig, 0.0, os.environ.get("GYM_FORK_NODE", "local")
        self.step_paths = []  # with --forkable: [node, how its steps travel], at each change

    def _on_step(self):
        if self.mig is not None and self.mig.history and self.mig.history[-1].get("status") == "arrived":
            if self.node != self.mig.history[-1]["node"] and args.hold_file:
                deadline = time.monotonic() + 120
                while not os.path.exists(args.hold_file) and time.monotonic() < deadline:
                    time.sleep(0.05)
            self.node = self.mig.history[-1]["node"]
        if fenv is not None and [self.node, fenv.step_path] not in self.step_paths[-1:]:
            self.step_paths.append([self.node, fenv.step_path])
        self.ep_ret += float(self.locals["rewards"][0])
        if self.locals["dones"][0]:
            print(json.dumps({"t": self.num_timesteps, "ret": self.ep_ret, "node": self.node, "wall": time.time()}), flush=True)
            self.ep_ret = 0.0
        return True


class Captured(KVWriter):
    """Keeps the ``migration/*`` values SB3's logger writes (no files: nothing for CRIU to track)."""

    def __init__(self):
        self.seen = {}

    def write(self, key_values, key_excluded, step=0):
        self.seen.update({k: v for k, v in key_values.items() if k.startswith("migration/")})

    def close(self):
        pass


fenv = None
if args.forkable:
    import gym_fork

    fenv = gym_fork.make("LunarLander-v3")


class SnapshotAt(BaseCallback):
    def __init__(self, at):
        super().__init__()
        self.at, self.snap = at, None

    def _on_step(self):
        if self.snap is None and self.num_timesteps >= self.at:
            self.snap = fenv.snapshot()
        return True


model = PPO("MlpPolicy", fenv or "LunarLander-v3", n_steps=512, batch_size=128, n_epochs=2, seed=args.seed,
            device="cpu", verbose=0)
captured = Captured()
model.set_logger(Logger(folder=None, output_formats=[captured]))
cbs = []
mig = None
target = args.target.split(",") if args.target and "," in args.target else args.target
if args.ray_node:
    from gym_fork.ray import RayNode  # import-light: no Ray in this process

    nodes = [RayNode(x) for x in args.ray_node.split(",")]
    target = nodes if len(nodes) > 1 else nodes[0]
if target:
    trig = ["SIGUSR1"] + ([int(x) for x in args.at.split(",")] if args.at is not None else []) + ([f"file:{args.notice_file}"] if args.notice_file else [])
    mig = LiveMigrationCallback(target, trigger=trig)
    cbs.append(mig)
progress = Progress(mig)
cbs.append(progress)
snap_cb = SnapshotAt(args.snap_at) if fenv is not None and args.snap_at is not None else None
if snap_cb:
    cbs.append(snap_cb)
model.learn(args.total, callback=cbs)
extra = {}
if fenv is not None:
    extra["backend"] = fenv.backend
    extra["step_paths"] = progress.step_paths
if snap_cb and snap_cb.snap is not None:  # taken before the move, restored after it
    obs, _ = fenv.restore(snap_cb.snap)
    traj = [obs.tobytes()] + [fenv.step(a % 4)[0].tobytes() for a in range(50)]
    extra["snap_sha"] = hashlib.sha256(b"".join(traj)).hexdigest()[:16]
h = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.policy.parameters())).hexdigest()[:16]
with open("/proc/self/stat") as f:  # the parent outside this job's PID namespace (where it runs now)
    host_ppid = int(f.read().rsplit(")", 1)[1].split()[1])
print(json.dumps({"done": True, "timesteps": model.num_timesteps, "policy_sha": h,
                  "migrations": [{k: v for k, v in m.items() if k in ("status", "node", "source", "downtime_s", "bytes", "timestep", "error", "timeline")} for m in (mig.history if mig else [])],
                  "logged": {k: (v if isinstance(v, (int, float, str)) else str(v)) for k, v in captured.seen.items()},
                  "ray_imported": "ray" in sys.modules, "host_ppid": host_ppid, **extra}), flush=True)
