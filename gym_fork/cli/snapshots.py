"""``gym-fork snapshots``: list, inspect, remove and garbage-collect a SnapshotStore directory."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

from gym_fork.errors import GymForkError
from gym_fork.snapshots import reclaim, sessiondir
from gym_fork.snapshots.store import SnapshotStore

HELP = "list, inspect, remove and garbage-collect the snapshots in a SnapshotStore directory"
DESCRIPTION = (
    "Work on a snapshot store directory: the DIR given to SnapshotStore(DIR, ...) (from "
    "ForkableEnv(..., store=SnapshotStore(DIR))).  Stored snapshots survive the process that took "
    "them; load one in Python with SnapshotStore(DIR).load(ID).\n\n"
    "ls lists them (id, steps, env, age, last use, logical size, pinned) and the bytes the store "
    "really occupies (page images are deduplicated in DIR/chunks); it also checks every entry's "
    "metadata: a damaged entry is moved to DIR/quarantine/ (never deleted) and listed with the "
    "reason, and entries whose HMAC does not verify with this machine's key are named.  inspect "
    "prints one snapshot's metadata as JSON (--verify also reassembles its images and checks the "
    "HMAC, that images/ holds exactly the signed files, and every sha256).  rm deletes snapshots "
    "and the chunks only they used.  gc removes what crashed writers left (temporary directories, "
    "unreferenced chunks), quarantines damaged entries, rebuilds the index from the snapshot "
    "directories and, with --max-bytes, deletes least recently used unpinned snapshots until the "
    "store fits; --drop-quarantined also deletes the quarantined entries (each one is named).  gc "
    "(with or without DIR) also removes the private session directories (CRIU images) of gym_fork "
    "processes that were killed (their lock is free; see $GYM_FORK_DIR).\n\n"
    "Exit status: 0 on success, 1 on an error (message on stderr)."
)
EPILOG = (
    "examples:\n"
    "  gym-fork snapshots ls ./store\n"
    "  gym-fork snapshots ls ./store --json\n"
    "  gym-fork snapshots inspect ./store 3f2a9c1e0b7d4e55 --verify\n"
    "  gym-fork snapshots rm ./store 3f2a9c1e0b7d4e55\n"
    "  gym-fork snapshots gc ./store --max-bytes 2G\n"
    "  gym-fork snapshots gc"
)


def _parse_bytes(text: str) -> int:
    """A disk budget for argparse: bytes, or with a unit (500M, 2G, 1.5GiB); a finite number
    >= 0 (inf, nan and negative budgets are usage errors, not a traceback or a silent no-op)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().rstrip("B").rstrip("I")
    num, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "")
    try:
        value = float(num) * units[unit]
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a disk budget: give a number of bytes >= 0, "
                                         "optionally with a unit (e.g. 500M, 2G)")
    return int(value)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def configure(p: Any) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    ls = sub.add_parser("ls", help="list the stored snapshots and the disk they use")
    ls.add_argument("dir", help="store directory")
    ls.add_argument("--json", action="store_true", help="print the index as JSON")
    ins = sub.add_parser("inspect", help="print one snapshot's metadata (JSON)")
    ins.add_argument("dir", help="store directory")
    ins.add_argument("id", help="snapshot id (see ls)")
    ins.add_argument("--verify", action="store_true", help="reassemble the images and check HMAC + sha256")
    rm = sub.add_parser("rm", help="delete snapshots")
    rm.add_argument("dir", help="store directory")
    rm.add_argument("ids", nargs="+", metavar="ID", help="snapshot ids")
    gc = sub.add_parser("gc", help="clean up after crashes (also the session directories of killed "
                                   "processes), rebuild the index, enforce a budget")
    gc.add_argument("dir", nargs="?", default=None,
                    help="store directory (without it: only the session directories of killed processes)")
    gc.add_argument("--max-bytes", type=_parse_bytes, default=None,
                    help="delete least recently used unpinned snapshots until the store fits (e.g. 500M, 2G)")
    gc.add_argument("--drop-quarantined", action="store_true",
                    help="also delete the damaged entries kept in DIR/quarantine/ (ls lists them)")


def _reclaim() -> None:
    base = sessiondir.base_dir()
    out = reclaim.reclaim_orphans(base, keep=sessiondir.current_session())
    print(f"removed {len(out['reclaimed'])} session directories of killed gym_fork processes "
          f"({_human(out['bytes'])}) in {base}")
    if out["legacy"]:
        print(f"left {len(out['legacy'])} session directories without an owner lock (from an older gym_fork; "
              f"delete them by hand once no such process runs): {', '.join(out['legacy'][:10])}")


def run(args: Any) -> int:
    d = args.dir
    if args.action == "gc":
        _reclaim()
        if d is None:
            return 0
    if not os.path.isdir(os.path.join(d, "snaps")):
        print(f"gym-fork snapshots: {d} is not a snapshot store (no snaps/ directory)", file=sys.stderr)
        return 1
    try:
        st = SnapshotStore(d, max_bytes=getattr(args, "max_bytes", None))
        if args.action == "ls":
            unverified = st.check()  # damaged entries go to quarantine (logged), listed below
            snaps = st.list()
            damaged = st.damaged()
            if args.json:
                print(json.dumps({"snapshots": snaps, "disk_bytes": st.disk_bytes(), "damaged": damaged,
                                  "unverified": unverified}, indent=1, sort_keys=True))
                return 0
            now = time.time()
            print(f"{'ID':16}  {'STEPS':>6}  {'ENV':18}  {'CREATED':>9}  {'USED':>9}  {'SIZE':>10}  PINNED")
            for sid, e in sorted(snaps.items(), key=lambda kv: kv[1].get("created") or 0):
                print(f"{sid:16}  {e.get('steps') or 0:>6}  {str(e.get('env_id'))[:18]:18}  "
                      f"{now - (e.get('created') or now):>8.0f}s  {now - (e.get('last_used') or now):>8.0f}s  "
                      f"{_human(e.get('logical_bytes', 0)):>10}  {'yes' if e.get('pinned') else ''}")
            logical = sum(e.get("logical_bytes", 0) for e in snaps.values())
            disk = st.disk_bytes()
            print(f"{len(snaps)} snapshots, {_human(logical)} of images, {_human(disk)} on disk"
                  + (f" (deduplicated {logical / disk:.1f}x)" if disk else ""))
            for sid, why in sorted(unverified.items()):
                print(f"UNVERIFIED {sid}: {why}")
            if damaged:
                print(f"{len(damaged)} damaged entries in quarantine (kept; `gym-fork snapshots gc {d} "
                      "--drop-quarantined` deletes them):")
                for e in damaged:
                    print(f"DAMAGED {e['id']}  {e['path']}  {e['reason']}")
        elif args.action == "inspect":
            meta = st.verify(args.id) if args.verify else st.meta(args.id)
            meta = dict(meta, pinned=os.path.exists(os.path.join(st.snapshot_dir(args.id), "PINNED")),
                        path=st.snapshot_dir(args.id))
            if args.verify:
                meta["verified"] = True
            print(json.dumps(meta, indent=1, sort_keys=True))
        elif args.action == "rm":
            for sid in args.ids:
                st.remove(sid)
                print(f"removed {sid}")
        elif args.action == "gc":
            out = st.gc(drop_quarantined=args.drop_quarantined)
            for e in out["quarantine_dropped"]:
                print(f"deleted quarantined entry {e['path']} ({e['reason']})")
            if out["chunks_kept_for"]:
                print(f"kept unreferenced chunks: the quarantined entries {', '.join(out['chunks_kept_for'])} have "
                      f"unreadable recipes, so their chunks cannot be told apart (`gym-fork snapshots gc {d} "
                      "--drop-quarantined` deletes those entries and then the chunks)")
            if out["evicted"]:  # the budget's evictions (least recently used, unpinned)
                print(f"evicted {out['evicted']} least recently used snapshots ({_human(out['evicted_bytes'])}) "
                      f"to fit --max-bytes {_human(args.max_bytes)}")
            print(f"removed {out['tmp_removed']} temporary entries and {out['chunks_removed']} unreferenced "
                  f"chunks; {out['snapshots']} snapshots, {_human(out['disk_bytes'])} on disk"
                  + (f"; {out['quarantined']} damaged entries in quarantine" if out["quarantined"] else ""))
    except BrokenPipeError:  # `... | head`: the reader left; main() ends quietly
        raise
    except (GymForkError, ValueError, OSError) as e:
        print(f"gym-fork snapshots {args.action}: {e}", file=sys.stderr)
        return 1
    return 0
