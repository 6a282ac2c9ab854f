"""The pickle backend refuses what it cannot copy exactly, also where two pickled copies agree
with each other and both differ from the original (found by an audit; each case went on silently
differently before).  The env is untouched by a refusal and steps on."""

from __future__ import annotations

import numpy as np
import pytest

import gym_fork
import pickle_hazards as hz
from gym_fork.errors import UnsupportedEnvError


def _obs(env, actions):
    return [env.step(a)[0].tolist() for a in actions]


def _refused(factory, match, steps=1):
    env = gym_fork.ForkableEnv(factory, backend="pickle")
    try:
        env.reset(seed=0)
        for _ in range(steps):
            env.step(0)
        with pytest.raises(UnsupportedEnvError, match=match):
            env.snapshot()
        env.step(1)  # untouched: steps on
    finally:
        env.close()


def test_a_sentinel_module_global_is_refused():
    _refused(hz.sentinel, r"env\.pending.*pickle_hazards\._UNSET")


def test_a_sentinel_in_an_env_instance_shipped_to_a_worker_is_refused():
    inst = hz.SentinelEnv()
    inst.reset(seed=0)
    with pytest.raises(gym_fork.errors.EnvNotShippableError, match=r"pickle_hazards\._UNSET"):
        gym_fork.ForkableEnv(inst, backend="criu")


def test_a_dict_keyed_by_id_is_refused():
    # two copies agree (both lost the ids); the original does not: compared against the original
    _refused(hz.id_keyed, r"the original and a pickled copy, stepped with the same actions, diverge: at step 1")


def test_state_a_getstate_leaves_out_is_refused():
    _refused(hz.dropped_state, r"env\['counter'\] \(slots \['count'\] set in one only\)")


@pytest.mark.parametrize("where", ["deque", "slots"])
@pytest.mark.parametrize("what", ["set", "view"])
def test_a_set_or_a_view_in_a_deque_or_slots_is_refused(where, what):
    at = {"deque": r"env\.box\[\d\]", "slots": r"env\.box\.(goals|row)"}[where]
    _refused(hz.hidden(where, what), at)


def test_a_dict_keyed_by_plain_objects_is_exact_not_refused():
    env = gym_fork.ForkableEnv(hz.object_keyed, backend="pickle")
    try:
        env.reset(seed=0)
        env.step(1)
        snap = env.snapshot()
        first = _obs(env, [0, 2, 1, 1])
        env.restore(snap)
        assert _obs(env, [0, 2, 1, 1]) == first
    finally:
        env.close()


@pytest.mark.parametrize("factory, rng", [(hz.occasional_global, "numpy"),
                                          (hz.occasional_module_rng, r"pickle_hazards\._RNG")])
def test_an_rng_outside_the_pickle_drawn_from_now_and_then(factory, rng):
    """The env draws only every 25th step: the behavioural checks (8 steps, at the 1st, 2nd, 4th,
    8th ... snapshot) never meet a draw. The draw itself is seen when it happens: later snapshots
    are refused, and so are restores of the earlier ones (they would go on differently there)."""
    env = gym_fork.ForkableEnv(factory, backend="pickle")
    try:
        env.reset(seed=0)
        env.step(0)
        first = env.snapshot()
        for _ in range(3):
            env.step(0)
            env.snapshot()
        for _ in range(26):
            env.step(0)  # (t = 25 drew)
        with pytest.raises(UnsupportedEnvError, match=rf"{rng}.*step 25"):
            env.snapshot()
        with pytest.raises(UnsupportedEnvError, match=rf"{rng}.*step 25"):
            env.restore(first)
        env.step(1)
    finally:
        env.close()


def test_the_learner_drawing_from_the_global_rngs_between_steps_is_not_the_env():
    import random

    env = gym_fork.ForkableEnv(hz.object_keyed, backend="pickle")
    try:
        env.reset(seed=0)
        for _ in range(30):
            random.random(), np.random.random()  # a learner's own draws
            env.step(0)
        snap = env.snapshot()
        env.restore(snap)
    finally:
        env.close()


def test_when_the_original_cannot_answer_the_check_says_it_compared_copies_only():
    env = gym_fork.ForkableEnv(hz.lock_in_info, backend="pickle")
    try:
        env.reset(seed=0)
        env.step(0)
        with pytest.warns(RuntimeWarning, match="could not compare a pickled copy with the original"):
            snap = env.snapshot()
        first = _obs(env, [1, 2])
        env.restore(snap)
        assert _obs(env, [1, 2]) == first
    finally:
        env.close()
