"""Packed step frames: a step request or a step's result crosses the channel as raw bytes and
comes back as objects of the same types with bit-identical values (real socketpairs)."""

from __future__ import annotations

import math
import pickle
import socket
import struct
import threading

import numpy as np
import pytest

from gym_fork.worker.channel import ERR, OK, Channel, ChannelClosed

HEADER = struct.Struct("!Q")


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(20)
    b.settimeout(20)
    yield Channel(a), Channel(b)
    a.close()
    b.close()


def same(x, y) -> bool:
    """Same type, same value, same bytes (NaN payloads and -0.0 included)."""
    if type(x) is not type(y):
        return False
    if isinstance(x, np.ndarray):
        return (x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
                and y.flags.c_contiguous and y.flags.writeable)
    if isinstance(x, np.generic):
        return x.dtype == y.dtype and x.tobytes() == y.tobytes()
    if isinstance(x, float):
        return struct.pack("<d", x) == struct.pack("<d", y)
    if isinstance(x, (tuple, list)):
        return len(x) == len(y) and all(same(a, b) for a, b in zip(x, y))
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    return x == y


ACTIONS = [
    0, 1, -(1 << 63), (1 << 63) - 1, 1 << 70,  # the last one does not fit int64: pickled
    np.int64(3), np.int64(-(1 << 63)), np.int32(-2), np.uint8(255), np.bool_(True), np.bool_(False),
    np.float32(0.5), np.float64(-0.0), np.frombuffer(bytes.fromhex("0100000000f8ff7f"), np.float64)[0],
    np.array([0.1, -0.2, 0.3], dtype=np.float32), np.array(7), np.zeros((0, 3)), np.arange(6).reshape(2, 3),
    np.array([1, 2], dtype=">i4"), np.array([1 + 2j]), np.array([True, False]),
    np.arange(6.0).reshape(2, 3)[:, 1],  # not contiguous: pickled, still exact
    [1, 2], (0.5, 1), {"a": 1}, None, True, 2.5, float("nan"), "text",
]


@pytest.mark.parametrize("action", ACTIONS, ids=lambda a: type(a).__name__)
def test_step_request_round_trip(pair, action):
    ctl, wrk = pair
    ctl.send_step(action)
    cmd, args = wrk.recv()
    assert wrk.packed_in and cmd == "step" and len(args) == 1
    assert same(action, args[0]), (action, args[0])


RESULTS = [
    (np.array([0.01, -0.2, 0.03, 0.4], dtype=np.float32), 1.0, False, False, {}),
    (np.zeros((210, 160, 3), dtype=np.uint8), np.float64(-1.5), np.bool_(True), False,
     {"lives": 3, "frame_number": 1208}),
    (np.arange(17, dtype=np.float64), np.float32(0.25), False, True, {"x_position": np.float64(1.0)}),
    ({"pos": np.ones(2), "id": 3}, 0, True, False, {"terminal_observation": np.ones(3)}),
    (3, 0.0, False, False, {}),
    (np.array(float("nan")), float("-inf"), False, False, {}),
    (np.zeros(17), np.float64(0.5), False, False,  # MuJoCo's info: NumPy scalars under str keys
     {"x_position": np.float64(1.0), "reward_ctrl": np.float64(-0.1), "é": np.zeros((2, 2), np.float32),
      "nested": {"a": np.int64(1), "b": [1, 2]}, "plain": 3, "none": None}),
    (np.zeros(1), 0.0, False, False, {1: np.float64(1.0), "k": np.float64(2.0)}),  # a non-str key: pickled
    # dicts of scalars only: one schema and one struct of values (types and bits kept, key order too)
    (np.zeros(17), np.float64(0.5), False, False,
     {"x_position": np.float64(-0.0), "reward_ctrl": np.float32(-0.28), "ok": np.bool_(True), "n": np.int64(-(1 << 63)),
      "t": 1.5, "i": (1 << 63) - 1, "b": False, "ü": np.float64(float("inf"))}),
    (np.zeros(1), 0.0, False, False, {"f": np.frombuffer(bytes.fromhex("0100000000f8ff7f"), np.float64)[0]}),
    (np.zeros(1), 0.0, False, False, {"big": 1 << 64, "x": np.float64(1.0)}),  # beyond int64: key by key
    (np.zeros(1), 0.0, False, False,  # a float32 NaN (its payload might not survive a double): key by key
     {"nan32": np.frombuffer(bytes.fromhex("0100c07f"), np.float32)[0], "x": np.float32(2.0)}),
    (np.zeros(1), 0.0, False, False, {"k" * 16000 + str(i): 1.0 for i in range(8)}),  # schema too long: key by key
    (np.zeros(1), 0.0, False, False, {"b": 1.0, "a": np.float64(2.0)}),  # the same keys, another order
    (np.zeros(1), 0.0, False, False, {"a": np.float64(2.0), "b": 1.0}),
]


@pytest.mark.parametrize("result", RESULTS, ids=range(len(RESULTS)))
def test_step_reply_round_trip(pair, result):
    ctl, wrk = pair
    ctl.send_step(0)
    wrk.recv()
    wrk.reply((OK, result))
    reply = ctl.recv()
    assert ctl.packed_in
    assert reply[0] == OK and same(result, reply[1])


def test_big_observation_crosses_the_socket_buffer(pair):
    """An observation several times the socket buffer goes out in pieces and arrives whole."""
    ctl, wrk = pair
    obs = np.random.default_rng(0).integers(0, 255, size=(4, 1024, 1024), dtype=np.uint8)
    ctl.send_step(1)
    wrk.recv()
    t = threading.Thread(target=wrk.reply, args=((OK, (obs, 1.0, False, False, {})),), daemon=True)
    t.start()
    reply = ctl.recv()
    t.join()
    assert same(obs, reply[1][0])


def test_replies_are_pickled_unless_the_request_was_packed(pair):
    """A worker answers packed only to a packed request: an older controller never sees one."""
    ctl, wrk = pair
    ctl.send(("step", (1,)))
    assert wrk.recv() == ("step", (1,)) and not wrk.packed_in
    result = (np.zeros(2, dtype=np.float32), 1.0, False, False, {})
    wrk.reply((OK, result))
    (n,) = HEADER.unpack(ctl.sock.recv(HEADER.size, socket.MSG_WAITALL))
    assert n < 1 << 63  # no packed flag: a plain pickle follows
    body = ctl.sock.recv(n, socket.MSG_WAITALL)
    assert same((OK, result), pickle.loads(body))


def test_errors_and_other_replies_stay_pickled(pair):
    ctl, wrk = pair
    for reply in [(ERR, "ValueError", "bad action", "tb"), (OK, None), (OK, (1, 2, 3))]:
        ctl.send_step(0)
        wrk.recv()
        wrk.reply(reply)
        assert ctl.recv() == reply and not ctl.packed_in


def test_pickled_and_packed_frames_interleave(pair):
    ctl, wrk = pair
    for i in range(50):
        if i % 3:
            ctl.send_step(np.int64(i))
        else:
            ctl.send(("getattr", ("x", "unwrapped")))
        cmd, args = wrk.recv()
        if cmd == "step":
            wrk.reply((OK, (np.full(3, i, dtype=np.float32), float(i), False, False, {})))
            out = ctl.recv()[1]
            assert same(out[0], np.full(3, i, dtype=np.float32)) and out[1] == float(i)
        else:
            wrk.reply((OK, "x"))
            assert ctl.recv() == (OK, "x")


def test_reply_that_does_not_pickle_raises_before_sending(pair):
    """An info that cannot be pickled raises in reply() and nothing is sent: the worker's loop
    then answers with the error, and the channel stays in step."""
    ctl, wrk = pair
    ctl.send_step(0)
    wrk.recv()
    with pytest.raises(Exception):
        wrk.reply((OK, (np.zeros(1), 0.0, False, False, {"f": lambda: 0})))
    wrk.send((ERR, "PicklingError", "no", ""))
    assert ctl.recv()[0] == ERR


def test_corrupt_packed_frame_is_channel_closed(pair):
    ctl, wrk = pair
    ctl.sock.sendall(HEADER.pack(2 | (1 << 63)) + b"Zz")
    with pytest.raises(ChannelClosed, match="corrupt packed frame"):
        wrk.recv()


def test_scalar_dicts_travel_as_one_schema():
    """An info of scalars packs as ``K`` + schema + one struct (not key by key), and a schema whose
    type code is unknown is a corrupt frame, not a crash."""
    from gym_fork.worker.channel import _pack_dict, _unpack

    parts: list = [b""]
    _pack_dict({"x": np.float64(1.0), "c": np.float32(0.5)}, parts)
    frame = b"".join(parts[1:])
    assert frame[:1] == b"K" and len(parts) == 2
    assert same(_unpack(memoryview(frame), 0)[0], {"x": np.float64(1.0), "c": np.float32(0.5)})
    bad = bytearray(frame)
    bad[bad.index(b"x") + 1] = ord("?")  # the type code after the key "x"
    with pytest.raises(ChannelClosed, match="dict schema"):
        _unpack(memoryview(bytes(bad)), 0)


def test_values_survive_bit_for_bit():
    """NaN payloads and signed zeros: the bytes travel, not the values."""
    a, b = socket.socketpair()
    try:
        ctl, wrk = Channel(a), Channel(b)
        odd = np.frombuffer(struct.pack("<d", math.nan)[:-1] + b"\x7f", dtype=np.float64).copy()
        ctl.send_step(odd)
        assert wrk.recv()[1][0].tobytes() == odd.tobytes()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("action", ACTIONS, ids=lambda a: type(a).__name__)
def test_a_step_request_that_resets_at_the_episodes_end_round_trip(pair, action):
    """Kind "A" (version 3): the same action, and the worker is asked to reset right after a
    step that ends the episode -- ``("step", (action, True))`` -- on both the int fast path and
    the general one; a plain step frame still decodes to one argument."""
    ctl, wrk = pair
    ctl.send_step(action, True)
    cmd, args = wrk.recv()
    assert wrk.packed_in and cmd == "step" and len(args) == 2 and args[1] is True
    assert same(action, args[0]), (action, args[0])
    ctl.send_step(action)
    assert len(wrk.recv()[1]) == 1


def test_a_controller_learns_which_frames_the_worker_reads():
    """Version 2 workers (an older gym_fork's, restored from a bundle) get packed steps but no
    kind "A"; a version this module does not write gets pickles."""
    from gym_fork.backends.base import RemoteHandle

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        h = RemoteHandle(Channel(a), None, 0)
        for version, packed, autoreset in ((2, True, False), (3, True, True), (4, False, False), (1, False, False),
                                           (None, False, False), ("3", False, False)):
            h.learn_packed(version)
            assert (h.packed, h.autoreset_steps) == (packed, autoreset), version
    finally:
        a.close()
        b.close()
