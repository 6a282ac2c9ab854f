"""PPO on CartPole in one file (CleanRL style), with gym_fork's Gymnasium vector env, branching
mid-training.

The training loop is a plain Gymnasium 1.x loop: ``ForkableVectorEnv`` stands where
``gymnasium.vector.SyncVectorEnv`` would (``--vector sync`` runs exactly that, and with
``--no-branch`` both give the same numbers).  Once, at ``--branch-at`` of the run, it takes the
sub-env whose current episode has lasted longest, snapshots it, and copies it into the
``--copies`` slots whose episodes are shortest: those slots continue from the good state, each
sampling its own actions from there.  The pole-balancing agent sees more of the late-episode
states it rarely reaches early in training.

    python examples/cleanrl_ppo_branching.py --total-timesteps 50000

The sub-envs step in parallel worker processes; the policy is a small torch MLP on the CPU.
Episode statistics come from Gymnasium's RecordEpisodeStatistics wrapper *inside* each sub-env,
so a snapshot carries them too (a vector wrapper on top would keep them in this process).
"""

from __future__ import annotations

import argparse
import random
import time

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical

from gym_fork.vector import ForkableVectorEnv


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env-id", default="CartPole-v1")
    p.add_argument("--total-timesteps", type=int, default=50000)
    p.add_argument("--num-envs", type=int, default=4)
    p.add_argument("--num-steps", type=int, default=128, help="steps per sub-env per rollout")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--learning-rate", type=float, default=2.5e-4)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--gae-lambda", type=float, default=0.95)
    p.add_argument("--num-minibatches", type=int, default=4)
    p.add_argument("--update-epochs", type=int, default=4)
    p.add_argument("--clip-coef", type=float, default=0.2)
    p.add_argument("--ent-coef", type=float, default=0.01)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--vector", choices=["forkable", "sync"], default="forkable",
                   help="the vector env: gym_fork's, or gymnasium's SyncVectorEnv (no branching)")
    p.add_argument("--no-branch", action="store_true", help="train without branching")
    p.add_argument("--branch-at", type=float, default=0.5, help="when to branch, as a fraction of the run")
    p.add_argument("--copies", type=int, default=None, help="slots overwritten by the branch (default num_envs // 2)")
    args = p.parse_args(argv)
    args.batch_size = args.num_envs * args.num_steps
    args.minibatch_size = args.batch_size // args.num_minibatches
    args.num_iterations = max(1, args.total_timesteps // args.batch_size)
    args.copies = args.num_envs // 2 if args.copies is None else args.copies
    if not 0 < args.copies < args.num_envs:
        raise SystemExit(f"--copies must be between 1 and num_envs - 1 = {args.num_envs - 1}")
    return args


def make_env(env_id: str):
    def thunk() -> gym.Env:
        # Inside the sub-env (its worker, for gym_fork): the statistics are part of its state.
        return gym.wrappers.RecordEpisodeStatistics(gym.make(env_id))

    return thunk


def layer(inp: int, out: int, std: float = np.sqrt(2)) -> nn.Linear:
    lin = nn.Linear(inp, out)
    nn.init.orthogonal_(lin.weight, std)
    nn.init.constant_(lin.bias, 0.0)
    return lin


class Agent(nn.Module):
    """Separate actor and critic MLPs (two tanh layers of 64)."""

    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()
        self.critic = nn.Sequential(layer(obs_dim, 64), nn.Tanh(), layer(64, 64), nn.Tanh(), layer(64, 1, 1.0))
        self.actor = nn.Sequential(layer(obs_dim, 64), nn.Tanh(), layer(64, 64), nn.Tanh(),
                                   layer(64, n_actions, 0.01))

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(obs).squeeze(-1)

    def act(self, obs: torch.Tensor, action: torch.Tensor | None = None):
        dist = Categorical(logits=self.actor(obs))
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action), dist.entropy(), self.value(obs)


def advantages(rewards, values, terminated, ended, valid, next_value, gamma, lam):
    """GAE for next-step autoreset.  Step ``t`` is *invalid* when its observation was the last of
    an episode: the vector env ignored its action and reset (reward 0); it gets no advantage and
    is left out of the loss.  After a termination nothing is bootstrapped; after a truncation the
    next observation -- the episode's last, which next-step autoreset hands back -- is."""
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[0])):
        v_next = next_value if t == rewards.shape[0] - 1 else values[t + 1]
        delta = rewards[t] + gamma * v_next * (1.0 - terminated[t]) - values[t]
        last = (delta + gamma * lam * (1.0 - ended[t]) * last) * valid[t]
        adv[t] = last
    return adv


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    env_fns = [make_env(args.env_id) for _ in range(args.num_envs)]
    if args.vector == "sync":
        envs = gym.vector.SyncVectorEnv(env_fns)
    else:
        envs = ForkableVectorEnv(env_fns)  # the drop-in: same arguments, same results
    branching = args.vector == "forkable" and not args.no_branch
    obs_dim = int(np.prod(envs.single_observation_space.shape))
    agent = Agent(obs_dim, int(envs.single_action_space.n))
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

    shape = (args.num_steps, args.num_envs)
    obs_buf = torch.zeros(shape + envs.single_observation_space.shape)
    act_buf = torch.zeros(shape, dtype=torch.long)
    logp_buf, rew_buf, val_buf = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)
    term_buf, end_buf, valid_buf = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)

    next_obs_np, _ = envs.reset(seed=args.seed)
    next_obs = torch.as_tensor(next_obs_np, dtype=torch.float32)
    next_ended = np.zeros(args.num_envs, dtype=bool)  # obs is an episode's last: next step resets
    episode_len = np.zeros(args.num_envs, dtype=int)  # steps into each slot's current episode
    branch_iteration = max(1, round(args.branch_at * args.num_iterations)) if branching else None
    returns: list[float] = []
    branch: dict | None = None
    global_step = 0
    losses: dict[str, float] = {}
    start = time.time()

    for iteration in range(1, args.num_iterations + 1):
        frac = 1.0 - (iteration - 1.0) / args.num_iterations
        optimizer.param_groups[0]["lr"] = frac * args.learning_rate
        if iteration == branch_iteration:  # between rollouts: the last one bootstrapped already
            branch = branch_out(envs, episode_len, next_ended, args.copies, global_step)
            next_obs = torch.as_tensor(branch.pop("obs"), dtype=torch.float32)
            next_ended = envs.pending_reset  # the copies inherit the source's (none: it is mid-episode)
            episode_len[branch["targets"]] = episode_len[branch["source"]]

        for step in range(args.num_steps):
            global_step += args.num_envs
            obs_buf[step] = next_obs
            valid_buf[step] = torch.as_tensor(~next_ended, dtype=torch.float32)
            with torch.no_grad():
                action, logp, _, value = agent.act(next_obs)
            act_buf[step], logp_buf[step], val_buf[step] = action, logp, value

            next_obs_np, reward, terminated, truncated, infos = envs.step(action.numpy())
            rew_buf[step] = torch.as_tensor(reward, dtype=torch.float32)
            term_buf[step] = torch.as_tensor(terminated, dtype=torch.float32)
            next_ended = terminated | truncated
            end_buf[step] = torch.as_tensor(next_ended, dtype=torch.float32)
            # a reset step starts a new episode at length 0; a real step adds one
            episode_len = np.where(valid_buf[step].numpy() > 0, episode_len + 1, 0)
            next_obs = torch.as_tensor(next_obs_np, dtype=torch.float32)
            if "episode" in infos:
                for i in np.flatnonzero(infos["_episode"]):
                    returns.append(float(infos["episode"]["r"][i]))

        with torch.no_grad():
            next_value = agent.value(next_obs)
        adv = advantages(rew_buf, val_buf, term_buf, end_buf, valid_buf, next_value, args.gamma, args.gae_lambda)
        ret = adv + val_buf
        losses = update(agent, optimizer, args, obs_buf, act_buf, logp_buf, val_buf, adv, ret, valid_buf)

        recent = returns[-20:]
        print(f"iteration {iteration}/{args.num_iterations}  step {global_step}  episodes {len(returns)}  "
              f"mean return (last 20) {np.mean(recent) if recent else float('nan'):.1f}  "
              f"policy loss {losses['policy']:.4f}  value loss {losses['value']:.4f}", flush=True)

    envs.close()
    summary = {
        "vector": args.vector, "global_step": global_step, "iterations": args.num_iterations,
        "episodes": len(returns), "returns": returns, "losses": losses, "branch": branch,
        "seconds": time.time() - start,
    }
    return summary


def branch_out(envs: ForkableVectorEnv, episode_len: np.ndarray, ended: np.ndarray, copies: int,
               global_step: int) -> dict:
    """Copy the slot furthest into its episode into the ``copies`` slots least far into theirs."""
    # A slot whose episode has just ended is no state to branch from.
    candidates = np.where(ended, -1, episode_len)
    source = int(np.argmax(candidates))
    order = [int(i) for i in np.argsort(episode_len, kind="stable") if i != source]
    targets = sorted(order[:copies])
    t0 = time.perf_counter()
    snap = envs.snapshot(source)
    obs, _ = envs.fork_into(snap, targets)  # each target continues from slot `source`'s state
    ms = (time.perf_counter() - t0) * 1000
    same = all(np.array_equal(obs[t], obs[source]) for t in targets)
    print(f"branch at step {global_step}: slot {source} is {int(episode_len[source])} steps into its "
          f"episode; snapshot + fork into slots {targets} (were {[int(episode_len[t]) for t in targets]} "
          f"steps in) took {ms:.1f} ms; they now hold slot {source}'s state: {same}; from here each "
          "samples its own actions", flush=True)
    return {"step": global_step, "source": source, "targets": targets,
            "source_episode_len": int(episode_len[source]), "same_state": same, "obs": obs}


def update(agent, optimizer, args, obs, actions, logps, values, adv, ret, valid) -> dict[str, float]:
    """The PPO update on the valid steps of one rollout: clipped policy loss, clipped value loss,
    entropy bonus, ``update_epochs`` passes over shuffled minibatches."""
    keep = valid.reshape(-1) > 0
    b_obs = obs.reshape((-1,) + obs.shape[2:])[keep]
    b_act, b_logp = actions.reshape(-1)[keep], logps.reshape(-1)[keep]
    b_adv, b_ret, b_val = adv.reshape(-1)[keep], ret.reshape(-1)[keep], values.reshape(-1)[keep]
    n = b_obs.shape[0]
    mb = max(1, n // args.num_minibatches)
    stats = {"policy": 0.0, "value": 0.0, "entropy": 0.0}
    for _ in range(args.update_epochs):
        perm = torch.randperm(n)
        for lo in range(0, n, mb):
            idx = perm[lo:lo + mb]
            _, logp, entropy, value = agent.act(b_obs[idx], b_act[idx])
            ratio = (logp - b_logp[idx]).exp()
            a = b_adv[idx]
            a = (a - a.mean()) / (a.std(unbiased=False) + 1e-8)
            policy_loss = torch.max(-a * ratio, -a * ratio.clamp(1 - args.clip_coef, 1 + args.clip_coef)).mean()
            v_clipped = b_val[idx] + (value - b_val[idx]).clamp(-args.clip_coef, args.clip_coef)
            value_loss = 0.5 * torch.max((value - b_ret[idx]) ** 2, (v_clipped - b_ret[idx]) ** 2).mean()
            ent = entropy.mean()
            loss = policy_loss - args.ent_coef * ent + args.vf_coef * value_loss
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            optimizer.step()
            stats = {"policy": policy_loss.item(), "value": value_loss.item(), "entropy": ent.item()}
    return stats


if __name__ == "__main__":
    main()
