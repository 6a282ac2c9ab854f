"""RayBranchPool vs local explore(): branches/s, Ray's cost per branch, first restore per node.

    .venv/bin/python benchmarks/ray_pool.py [--reps 3] [--horizon 100] [--address ADDR]

Without ``--address`` a ``ray.cluster_utils.Cluster`` (head + 2 worker nodes) is started on this
machine: all "nodes" share its CPUs, so the Ray columns show what Ray *costs*, not a speed-up.
Env: LunarLander-v3 (a ~25 MB worker), snapshot after 50 steps, branches of ``--horizon`` steps
(``stop_at_done=False``: every branch is full length), policy = a cheap function of the obs.

* local, c concurrent: ``gym_fork.explore(n_branches=c)`` repeated to M = max(16, 4c) branches
  (c branches in lockstep, forks of the copy-on-write tier);
* Ray, c in flight: ``pool.explore(n_branches=M, branches_per_call=1, max_in_flight=c)``:
  one actor call per branch, c calls at a time, spread over the nodes;
* Ray, batched: ``pool.explore(n_branches=M)``: one call per node (lockstep there);
* Ray cost per branch: round trip minus the time inside the actor, per call (c=1);
* first restore: per node, the first use of a new snapshot (object-store pull, write-out,
  ``load_snapshot`` verification, CRIU restore, fork-tier snapshot), plus the driver's
  ``save`` + ``ray.put``;
* migration downtime per hop (``env.migrate(RayNode(id))``, ``--hops`` hops round the nodes,
  head -> node1 -> node2 -> head ..., after one warm-up round that starts the host actors): from
  the call until the reply to the first step on the target, with where the time goes (export on
  the source: fork-tier snapshot, CRIU dump of the copy, bundle, pack, ``ray.put``; receive on the
  target: ``ray.get``, write-out, ``load_snapshot`` verification, CRIU restore; attach: TCP +
  challenge-response), and the per-step latency through the host's TCP bridge.
    ``--only-migration`` skips the branch sections.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks.common import busy_check, print_table, save_results  # noqa: E402


def policy(obs):
    return zlib.crc32(np.asarray(obs).tobytes()) % 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--horizon", type=int, default=100)
    ap.add_argument("--address", default=None, help="an existing Ray cluster (default: start head + 2 nodes here)")
    ap.add_argument("--conc", default="1,2,4,8")
    ap.add_argument("--hops", type=int, default=9, help="migration hops measured (>= 5)")
    ap.add_argument("--only-migration", action="store_true")
    args = ap.parse_args()
    load_before = busy_check()

    import ray

    import gym_fork
    from gym_fork.ray import RayBranchPool

    cluster = None
    t0 = time.perf_counter()
    if args.address:
        ray.init(address=args.address)
    else:
        from ray.cluster_utils import Cluster

        kw = dict(num_cpus=1, object_store_memory=128 << 20, include_dashboard=False)
        cluster = Cluster(initialize_head=True, head_node_args=dict(kw))
        cluster.add_node(**kw)
        cluster.add_node(**kw)
        cluster.wait_for_nodes()
        cluster.connect()
    t_cluster = time.perf_counter() - t0
    pool = RayBranchPool()
    t_pool = time.perf_counter() - t0 - t_cluster
    out: dict = {"horizon": args.horizon, "reps": args.reps, "nodes": len(pool.nodes),
                 "cluster_start_s": t_cluster, "pool_start_s": t_pool, "load_before": load_before}
    env = gym_fork.make("LunarLander-v3")
    try:
        env.reset(seed=0)
        for _ in range(50):
            env.step(0)
        H = args.horizon
        if args.only_migration:
            out["migration"] = migration_hops(env, args.hops)
            out["live_migration"] = live_hops(max(5, args.hops // 2))
            print("results:", save_results("ray_migration", out))
            return

        # --- first restore per node (3 fresh snapshots) ---------------------------------------
        firsts, puts = [], []
        for _ in range(args.reps):
            s = env.snapshot()
            t = time.perf_counter()
            pool.put(s)
            puts.append(time.perf_counter() - t)
            firsts.extend(pool.prepare(s).values())
            pool.forget(s)
            s.release()
        keys = ["get_s", "write_s", "verify_s", "restore_s", "fork_snapshot_s", "total_s"]
        out["first_restore"] = {k: statistics.median(f[k] for f in firsts) for k in keys}
        out["first_restore_range"] = {k: (min(f[k] for f in firsts), max(f[k] for f in firsts)) for k in keys}
        out["save_put_s"] = statistics.median(puts)
        out["bundle_bytes"] = firsts[0]["bytes"]

        snap = env.snapshot()
        pool.prepare(snap)  # the throughput runs below measure warm nodes
        gym_fork.explore(env, snap, policy, n_branches=2, horizon=H, rng="same", stop_at_done=False)  # warm-up
        pool.explore(snap, policy, n_branches=6, horizon=H, rng="same", stop_at_done=False, branches_per_call=1)

        rows, table = [], []
        for c in [int(x) for x in args.conc.split(",")]:
            M = max(16, 4 * c)
            loc, rc, rb, over = [], [], [], []
            for _ in range(args.reps):
                t = time.perf_counter()
                done = 0
                while done < M:
                    gym_fork.explore(env, snap, policy, n_branches=c, horizon=H, rng="reseed", stop_at_done=False)
                    done += c
                loc.append(done / (time.perf_counter() - t))
                t = time.perf_counter()
                r = pool.explore(snap, policy, n_branches=M, horizon=H, rng="reseed", stop_at_done=False,
                                 branches_per_call=1, max_in_flight=c)
                rc.append(M / (time.perf_counter() - t))
                over.append(r.ray_overhead_s / M)
                t = time.perf_counter()
                pool.explore(snap, policy, n_branches=M, horizon=H, rng="reseed", stop_at_done=False)
                rb.append(M / (time.perf_counter() - t))
            row = {"c": c, "M": M, "local_bps": statistics.median(loc), "ray_inflight_bps": statistics.median(rc),
                   "ray_batched_bps": statistics.median(rb), "ray_cost_ms_per_branch": 1e3 * statistics.median(over)}
            rows.append(row)
            table.append([c, M, f"{row['local_bps']:.1f}", f"{row['ray_inflight_bps']:.1f}",
                          f"{row['ray_batched_bps']:.1f}", f"{row['ray_cost_ms_per_branch']:.2f}"])
        out["throughput"] = rows
        out["load_after"] = busy_check()
        print_table(["c", "M", "local explore", "Ray, c calls in flight", "Ray, one call per node",
                     "Ray cost / branch (ms)"], table,
                    title=f"branches/s (LunarLander-v3, H={H}, {len(pool.nodes)} nodes on one machine)",
                    note="Ray cost = call round trip minus the time spent inside the actor (c calls in flight).")
        fr, rg = out["first_restore"], out["first_restore_range"]
        print_table(["phase", "median ms", "range ms"],
                    [[k[:-2], f"{fr[k] * 1e3:.1f}", f"{rg[k][0] * 1e3:.1f}-{rg[k][1] * 1e3:.1f}"] for k in keys]
                    + [["driver save + ray.put (once per snapshot)", f"{out['save_put_s'] * 1e3:.1f}", ""]],
                    title=f"first use of a snapshot on a node ({out['bundle_bytes'] / 1e6:.1f} MB bundle)")
        print(f"\ncluster start {t_cluster:.1f} s, pool start (3 host actors) {t_pool:.2f} s")
        out["migration"] = migration_hops(env, args.hops)
        print("results:", save_results("ray_pool", out))
    finally:
        env.close()
        pool.close()
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


def migration_hops(env, hops: int) -> dict:
    """Move ``env``'s worker round the nodes; downtime per hop and where it goes."""
    import ray

    from gym_fork.ray import RayNode
    from gym_fork.ray.hosts import close_hosts

    head = ray.get_runtime_context().get_node_id()
    ring = [head] + sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] != head)
    obs = env.step(0)[0]

    def steps_ms(n: int = 200) -> float:
        t = time.perf_counter()
        for _ in range(n):
            env.step(policy(obs))
        return 1e3 * (time.perf_counter() - t) / n

    local_step = steps_ms()
    try:
        for nid in ring[1:] + ring[:1]:  # warm-up round: starts each node's host actor
            env.migrate(RayNode(nid))
            env.step(0)
        recs, bridge = [], []
        for i in range(hops):
            nid = ring[(i + 1) % len(ring)]
            t = time.perf_counter()
            rep = env.migrate(RayNode(nid))
            env.step(0)
            down = time.perf_counter() - t
            recs.append(dict(rep["timings"], **rep["host_timings"], downtime_s=down, bytes=rep["bytes"]))
            bridge.append(steps_ms(100))
    finally:
        close_hosts()
    keys = [k for k in recs[0] if k.endswith("_s")]
    med = {k: statistics.median(r.get(k, 0.0) for r in recs) for k in keys}
    rng = {k: (min(r.get(k, 0.0) for r in recs), max(r.get(k, 0.0) for r in recs)) for k in keys}
    res = {"hops": hops, "bytes": recs[0]["bytes"], "median": med, "range": rng, "per_hop": recs,
           "step_ms_local": local_step, "step_ms_bridge": statistics.median(bridge)}
    labels = {
        "downtime_s": "**downtime** (migrate() + first step on the target)",
        "export_s": "export (driver view)", "export_pause_s": "  pause the source bridge",
        "export_snapshot_s": "  fork-tier snapshot", "export_dump_s": "  CRIU dump of the copy + manifest",
        "export_bundle_s": "  bundle.json (+ mapped files, HMAC), links", "export_pack_s": "  pack into arrays",
        "export_put_s": "  ray.put (source node)", "export_in_actor_s": "  (all of export inside the actor)",
        "receive_s": "receive (driver view, Ray call)", "receive_get_s": "  ray.get (cross-node pull)",
        "receive_write_s": "  write-out", "receive_verify_s": "  load_snapshot: HMAC, compat, sha256",
        "receive_restore_s": "  CRIU restore + ping", "receive_in_actor_s": "  (all of receive inside the actor)",
        "receive_call_to_start_s": "  Ray: call -> method starts", "receive_return_s": "  Ray: method returns -> driver has it", "attach_s": "attach: TCP + challenge-response",
        "switch_s": "switch handles, release the source", "total_s": "migrate() total"}
    print_table(["phase", "median ms", "range ms"],
                [[labels.get(k, k), f"{med[k] * 1e3:.1f}", f"{rng[k][0] * 1e3:.1f}-{rng[k][1] * 1e3:.1f}"]
                 for k in labels if k in med],
                title=f"migration by Ray node: {hops} hops round {len(ring)} nodes ({res['bytes'] / 1e6:.1f} MB bundle)",
                note=f"step latency: local {local_step:.3f} ms, through the host's TCP bridge "
                     f"{res['step_ms_bridge']:.3f} ms (median over hops). Export rows of hops that start "
                     "on the driver's own worker (none after the warm-up round: every hop starts on a host).")
    return res


def live_hops(n: int) -> dict:
    """``env.migrate(RayNode(id), live=True)`` from the driver's own worker, ``n`` times (a fresh
    env each): the learner's pauses (downtime) vs the same move stop-and-copy, side by side."""
    import ray

    import gym_fork
    from gym_fork.ray import RayNode
    from gym_fork.ray.hosts import close_hosts

    head = ray.get_runtime_context().get_node_id()
    nid = sorted(x["NodeID"] for x in ray.nodes() if x.get("Alive") and x["NodeID"] != head)[0]
    live, stop = [], []
    try:
        for i in range(n + 1):  # the first of each is a warm-up (host start)
            for mode in ("live", "stop"):
                env = gym_fork.make("LunarLander-v3")
                try:
                    obs, _ = env.reset(seed=i)
                    for _ in range(50):
                        obs = env.step(policy(obs))[0]
                    t = time.perf_counter()
                    if mode == "live":
                        mig = env.migrate(RayNode(nid), live=True)
                        steps = 0
                        while not mig.done():
                            obs, _r, term, trunc, _ = env.step(policy(obs))
                            steps += 1
                            if term or trunc:
                                obs, _ = env.reset()
                        rep = mig.result()
                        rec = {"downtime_s": rep["downtime_s"], "until_switch_s": time.perf_counter() - t,
                               "steps": steps, "rounds": len(rep["rounds"])}
                    else:
                        env.migrate(RayNode(nid))
                        env.step(0)
                        rec = {"downtime_s": time.perf_counter() - t}
                    if i:
                        (live if mode == "live" else stop).append(rec)
                finally:
                    env.close()
    finally:
        close_hosts()
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    res = {"n": n, "live": live, "stop": stop}
    print_table(["move to a Ray node (25 MB worker)", "downtime median ms", "range ms", "ratio"],
                [["stop-and-copy (live=False)", f"{med(stop, 'downtime_s') * 1e3:.1f}",
                  f"{min(r['downtime_s'] for r in stop) * 1e3:.1f}-{max(r['downtime_s'] for r in stop) * 1e3:.1f}", "1.00×"],
                 ["pre-copy (live=True)", f"{med(live, 'downtime_s') * 1e3:.1f}",
                  f"{min(r['downtime_s'] for r in live) * 1e3:.1f}-{max(r['downtime_s'] for r in live) * 1e3:.1f}",
                  f"{med(live, 'downtime_s') / med(stop, 'downtime_s'):.3f}×"]],
                title=f"live migration to a Ray node from the driver's worker ({n} moves each)",
                note=f"live: the learner kept stepping for {med(live, 'until_switch_s') * 1e3:.0f} ms "
                     f"({med(live, 'steps'):.0f} steps, replayed in {med(live, 'rounds'):.0f} rounds) before the "
                     "switch; downtime = its two pauses (snapshot call + switch).")
    return res


if __name__ == "__main__":
    main()
