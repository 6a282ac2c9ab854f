"""The cloudpickle backend: the env runs in this process; a snapshot is a pickle of it.

For machines without CRIU.  It is exact only for envs whose whole state is plain Python and
NumPy (classic control, toy text, most custom envs).  It *refuses* Gymnasium's ``EzPickle``
envs (Box2D, MuJoCo, ALE): their pickle holds only constructor arguments, so a naive pickle
"restores" a fresh, different env without any error.  Every first snapshot of an env is also
round-trip checked: the copy must pickle to the very same bytes as the original.
"""

from __future__ import annotations

import cloudpickle
import gymnasium as gym

from gym_fork.backends.base import Backend, Handle, LocalHandle
from gym_fork.errors import SnapshotCorruptedError, SnapshotError, UnsupportedEnvError
from gym_fork.server import EnvServer, EnvSource, build_env


def refuse_if_ezpickle(env: gym.Env) -> None:
    layer = env
    while True:
        if isinstance(layer, gym.utils.EzPickle):
            raise UnsupportedEnvError(
                f"the pickle backend cannot snapshot {type(env.unwrapped).__name__} "
                f"({env.spec.id if env.spec else type(env.unwrapped).__module__}): it is a gymnasium EzPickle "
                "env, whose pickle holds only its constructor arguments, so a copy would be a fresh, "
                "different env. Use backend='criu' (see `gym-fork doctor`), which snapshots the "
                "whole process."
            )
        if not isinstance(layer, gym.Wrapper):
            return
        layer = layer.env


class _PickleHandle(LocalHandle):
    verified = False  # the round-trip check ran for this env lineage

    def kill(self) -> None:
        if not self.closed:
            try:
                self.server.env.close()
            finally:
                self.closed = True


class PickleBackend(Backend):
    name = "pickle"

    def start(self, source: EnvSource) -> tuple[Handle, dict]:
        env = build_env(source)
        try:
            refuse_if_ezpickle(env)
        except UnsupportedEnvError:
            env.close()
            raise
        server = EnvServer(env)
        return _PickleHandle(server), server.cmd_meta()

    def snapshot(self, handle: Handle, snap_id: str) -> tuple[bytes, int]:
        assert isinstance(handle, _PickleHandle)
        s = handle.server
        try:
            blob = cloudpickle.dumps((s.env, s.last_obs, s.last_info, s.steps))
        except Exception as e:  # noqa: BLE001
            raise SnapshotError(
                f"cloudpickle cannot capture this env ({type(e).__name__}: {e}); use backend='criu'"
            ) from e
        if not handle.verified:
            # A faithful copy pickles back to the same bytes; a copy that lost state does not.
            again = cloudpickle.dumps(cloudpickle.loads(blob))
            if again != blob:
                raise UnsupportedEnvError(
                    f"a pickled copy of {type(s.env.unwrapped).__name__} differs from the original "
                    "(its state does not survive pickling); use backend='criu'"
                )
            handle.verified = True
        return blob, len(blob)

    def restore(self, payload: bytes) -> Handle:
        try:
            env, obs, info, steps = cloudpickle.loads(payload)
        except Exception as e:  # noqa: BLE001
            raise SnapshotCorruptedError(f"the pickle snapshot does not load: {type(e).__name__}: {e}") from e
        server = EnvServer(env)
        server.last_obs, server.last_info, server.steps = obs, info, steps
        h = _PickleHandle(server)
        h.verified = True
        return h

    def release(self, payload: bytes) -> None:
        pass  # plain bytes: the garbage collector frees them
