"""Ctrl-C (SIGINT) at random moments of steps, rollouts, snapshots and restores, checked against the worker.

Each call is interrupted half of the time, 5 us - 5 ms in (log-uniform; with ``--store``, up to 100 ms). After every call that
returns, the env's accounting must be the worker's: its step count, and the recorded actions
since its parent snapshot hashed from that snapshot's state must give the worker's hash. Prints
the calls that broke that (and the error that ended a run) and ``(bad, interrupted)`` per seed.
``--store``: a SnapshotStore takes the snapshots (two in memory, the rest spilled to disk), and
calls that write, load, remove and collect its entries join in; after every interrupted call the
store must hold no damaged entry, an index that is its directory's, and no leftover of a write.

    .venv/bin/python scripts/ctrl_c_campaign.py --seeds 1-8 --calls 150 [--criu-dumps | --pickle | --store]
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import tempfile
import warnings

import gymnasium as gym
import numpy as np

import gym_fork
from gym_fork.testing.campaigns import parse_seeds, parser, report
from gym_fork.testing.interrupts import interrupt_after


class EchoEnv(gym.Env):
    """Observation ``[t, action, h]``: the step count and a running hash of the actions."""

    observation_space = gym.spaces.Box(-1e12, 1e12, (3,), np.float64)
    action_space = gym.spaces.Discrete(1000)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.h = 0, 0
        return np.array([0, -1, 0], dtype=np.float64), {}

    def step(self, action):
        self.t += 1
        self.h = (self.h * 31 + int(action)) % 1_000_003
        return np.array([self.t, action, self.h], dtype=np.float64), 0.0, False, False, {}


def history_fault(env: gym_fork.ForkableEnv, t: int, h: int, out: np.ndarray) -> str | None:
    """What is wrong with the env's accounting, given ``out``, its worker's last EchoEnv
    observation, and ``(t, h)`` at its parent snapshot: its step count and its recorded actions
    since that snapshot, hashed on from there, must give the worker's."""
    for x in env._actions:
        h = (h * 31 + int(x)) % 1_000_003
    if env.steps == int(out[0]) == t + len(env._actions) and h == int(out[2]):
        return None
    return (f"the env counts {env.steps} steps ({t} + {len(env._actions)} actions), the worker is at step "
            f"{int(out[0])} with hash {int(out[2])} (the history's: {h})")


#: the store's disk budget: a few of EchoEnv's spilled workers, so that writes evict older ones
STORE_BYTES = 36 << 20


def store_faults(store: gym_fork.SnapshotStore) -> str | None:
    """What is wrong with ``store`` after a call: a damaged (quarantined) entry, an index that is
    not the directory's, or a write's or a removal's leftovers a Ctrl-C did not clean up."""
    store.check()
    if store.damaged():
        return f"damaged entries: {store.damaged()}"
    on_disk = set(os.listdir(os.path.join(store.path, "snaps")))
    if set(store.list()) != on_disk:
        return f"the index lists {sorted(store.list())}, the directory holds {sorted(on_disk)}"
    left = [n for n in os.listdir(store.path) if n.startswith(".tmp-") or store._index.is_temp(n)]
    left += [f"chunks/{d}/{n}" for d, _, names in os.walk(os.path.join(store.path, "chunks"))
             for n in names if ".tmp-" in n]
    return f"leftovers in the store: {left}" if left else None


def run(calls: int, seed: int, fork_tier: bool, backend: str = "auto", store_dir: str | None = None,
        stats: dict | None = None) -> tuple[int, int]:
    rng = np.random.default_rng(seed)
    # with a store: at most 2 snapshots in memory (older ones spill to disk as CRIU images), and
    # calls that write, load, remove and collect its entries
    store = gym_fork.SnapshotStore(store_dir, max_in_memory=2, max_bytes=STORE_BYTES) if store_dir else None
    env = gym_fork.ForkableEnv(EchoEnv, fork_tier=fork_tier, record_actions=True, backend=backend, store=store)
    bad = interrupted = 0
    kinds = ["step", "step", "restore", "restore", "snapshot", "rollout", "sendrecv"]
    if store is not None:
        kinds += ["put", "load", "remove", "gc"]
    removing: set[str] = set()  # snapshots whose removal a Ctrl-C cut: gone or not
    try:
        env.reset(seed=0)
        first = env.snapshot()
        if store is not None:
            first.pin()  # (never evicted: the run's way back)
        snaps = {first.id: (first, 0, 0)}  # id -> (snapshot, t, h) at the snapshot
        taken = dict(snaps)  # every snapshot taken, also those removed since (the env's parent may be one)
        for i in range(calls):
            kind = rng.choice(kinds)
            a = int(rng.integers(1000))
            # (a store's calls write and read CRIU images: tens of milliseconds, so up to 100 ms in)
            delay = float(np.exp(rng.uniform(np.log(5e-6), np.log(1e-1 if store else 5e-3)))) if i % 2 else 0.0
            sid = list(snaps)[int(rng.integers(len(snaps)))]
            try:
                with interrupt_after(delay, sigint=True):
                    if kind == "restore":
                        try:
                            out = env.restore(snaps[sid][0])[0]
                        except gym_fork.errors.RestoreError:
                            why = getattr(snaps[sid][0], "_released_why", None) or ""
                            if sid not in removing and "evicted" not in why:
                                raise
                            del snaps[sid]  # (its removal had gone through, or the disk budget evicted it)
                            continue
                    elif kind in ("put", "load", "remove", "gc"):
                        if kind == "put" and sid not in removing and not snaps[sid][0].released:
                            store.put(snaps[sid][0])
                        elif kind == "load" and sid in store.list():
                            loaded = store.load(sid)
                            out = env.restore(loaded)[0]
                            if loaded is not snaps[sid][0]:
                                snaps[sid] = (loaded, *snaps[sid][1:])
                        elif kind == "remove" and sid != first.id and sid in store.list():
                            removing.add(sid)
                            store.remove(sid)
                            del snaps[sid]
                        elif kind == "gc":
                            store.gc()
                        else:
                            continue  # (nothing to do: no observation to check)
                        if kind != "load":
                            continue
                    elif kind == "rollout":
                        out = env.rollout([a, a + 1, a + 2])["final_obs"]
                    elif kind == "sendrecv":
                        env.step_send(a)
                        out = env.step_receive()[0]
                    else:
                        out = env.step(a)[0]
                        if kind == "snapshot":
                            s = env.snapshot()
                            snaps[s.id] = taken[s.id] = (s, int(out[0]), int(out[2]))
            except KeyboardInterrupt:
                interrupted += 1
                fault = store_faults(store) if store is not None else None
                if fault:
                    bad += 1
                    print(f"  call {i} {kind} (interrupted): {fault}")
                if kind == "sendrecv" and env._handle._send_holds:
                    # Ctrl-C between step_send() and step_receive(): the step was sent and its reply
                    # waits, as documented (a step() now would raise ConcurrentUseError): read it
                    env.step_receive()
                continue
            except gym_fork.errors.IncompleteStepError:
                # (backend="pickle": an interrupt cut the env's own code; it refuses until a restore)
                env.restore(first)
                continue
            parent = taken.get(env._parent_id)
            if parent is None:
                bad += 1
                print(f"  call {i} {kind}: the env's parent snapshot is not one taken here")
                continue
            fault = history_fault(env, parent[1], parent[2], out)
            if fault:
                bad += 1
                print(f"  call {i} {kind}: {fault} (parent {env._parent_id}, call on {sid})")
                env.restore(first)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        env.close()
        if store is not None and stats is not None:
            stats.update(store.stats)  # (spilled, evicted, written, ...: what the run exercised)
    return bad, interrupted


def main() -> int:
    ap = parser(__doc__, seeds="1-5", count="calls", per_seed=150)
    ap.add_argument("--criu-dumps", action="store_true", help="every snapshot a CRIU dump (default: the fork tier)")
    ap.add_argument("--pickle", action="store_true", help="backend='pickle': the env runs in this process")
    ap.add_argument("--store", action="store_true",
                    help="a SnapshotStore (2 snapshots in memory, the rest spilled to disk) and calls that write, "
                         "load, remove and collect its entries, each checked for damage and leftovers")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message=".*over its disk budget")  # (the pinned first snapshot's)

    def one(seed: int) -> tuple[bool, str]:
        with tempfile.TemporaryDirectory() as tmp:
            stats: dict = {}
            bad, n = run(args.calls, seed, not args.criu_dumps, "pickle" if args.pickle else "auto",
                         os.path.join(tmp, "store") if args.store else None, stats)
        return bad > 0, (f"{bad} calls answered with the accounting off, {n} interrupted"
                         + (f"; store: {stats}" if args.store else ""))

    return report((f"seed {seed}", functools.partial(one, seed)) for seed in parse_seeds(args.seeds))


if __name__ == "__main__":
    sys.exit(main())
