"""How the channel reads a message in fewer system calls without ever taking more than is its:
``recv`` reads at most a step request's length before it knows a frame's length (a file
descriptor sent after a message must stay in the socket for ``recv_fds``), and ``recv_reply``
reads ahead (only where nothing follows a reply) and keeps what belongs to the next frame.
Real socketpairs, real descriptors."""

from __future__ import annotations

import os
import pickle
import struct

import numpy as np
import pytest

from gym_fork.worker import output
from gym_fork.worker.channel import (OK, READY, WAKE, Channel, ChannelClosed, recv_fds, reply_parts, send_fds,
                                     step_parts)

HEADER = struct.Struct("!Q")
PACKED = 1 << 63



def _packed(parts: list) -> bytes:
    body = b"".join(bytes(p) for p in parts[1:])
    return HEADER.pack(len(body) | PACKED) + body


@pytest.mark.parametrize("msg", [("fork_snapshot", ()), ("ring", (20000,)), ("clone", ()), (READY, None),
                                 (READY, 12345)])
def test_a_descriptor_after_a_message_survives_recv(pair, msg):
    """What the controller does with fork_snapshot/ring/clone (and a frozen snapshot with READY):
    the message and its descriptor back to back; recv() must leave the descriptor's byte alone."""
    a, b = pair
    b.settimeout(5)  # a descriptor lost to a read-ahead shows as a timeout here
    r, w = os.pipe()
    try:
        Channel(a).send(msg)
        send_fds(a, b"F", [r])
        rx = Channel(b)
        assert rx.recv() == msg
        data, fds = recv_fds(b, 1)
        assert data == b"F" and len(fds) == 1
        os.write(w, b"x")
        assert os.read(fds[0], 1) == b"x"  # the very pipe
        os.close(fds[0])
    finally:
        os.close(r)
        os.close(w)


def test_short_frames_back_to_back(pair):
    """Frames shorter than the first read (a wake frame, a step with action None) followed by
    others: what was read past one frame is the start of the next."""
    a, b = pair
    frames = [WAKE, _packed(step_parts(None)), WAKE, WAKE, _packed(step_parts(True)),
              HEADER.pack(len(p := pickle.dumps(("reset", (None, None)), protocol=5))) + p,
              _packed(step_parts(np.int64(7))), _packed(step_parts(3))]
    a.sendall(b"".join(frames))
    rx = Channel(b)
    got = [rx.recv() for _ in range(5)]
    assert got[0] == ("step", (None,)) and got[1] == ("step", (True,))
    assert got[2] == ("reset", (None, None))
    assert got[3] == ("step", (np.int64(7),)) and type(got[3][1][0]) is np.int64
    assert got[4] == ("step", (3,)) and type(got[4][1][0]) is int
    b.setblocking(False)
    with pytest.raises(BlockingIOError):  # everything was read, nothing more
        b.recv(1)


def test_int_step_request_in_one_read(pair):
    a, b = pair
    tx, rx = Channel(a), Channel(b)
    for action in (np.int64(-3), 5, np.int64(2**62), -(2**63)):
        tx.send_step(action)
        cmd, (got,) = rx.recv()
        assert cmd == "step" and got == action and type(got) is type(action) and rx.packed_in


def _reply_frame(result: tuple) -> bytes:
    return _packed(reply_parts((OK, result)))


def test_recv_reply_output_frame_then_reply(pair, capsys):
    """The worker's output (its prints) and the reply in one read: both are taken apart."""
    a, b = pair
    out = pickle.dumps((output.OUTPUT, 4242, "CartPole-v1", [("stdout", "hello\n")]), protocol=5)
    obs = np.arange(4, dtype=np.float32)
    a.sendall(HEADER.pack(len(out)) + out + _reply_frame((obs, 1.0, False, True, {})))
    rx = Channel(b)
    status, (o, r, term, trunc, info) = rx.recv_reply()
    assert status == OK and o.tobytes() == obs.tobytes() and o.flags.writeable and o.flags.owndata
    assert (r, term, trunc, info) == (1.0, False, True, {})
    assert "hello" in capsys.readouterr().out
    b.setblocking(False)
    with pytest.raises(BlockingIOError):
        b.recv(1)


def test_recv_reply_large_and_split(pair):
    """A reply larger than the receive buffer, arriving in pieces: read whole, bit for bit."""
    a, b = pair
    obs = np.random.default_rng(0).integers(0, 255, (210, 160, 3), dtype=np.uint8)
    frame = _reply_frame((obs, np.float64(-1.5), np.bool_(True), False, {"lives": 3}))
    rx = Channel(b)
    for cut in (3, 8, 20, 4096, len(frame) - 1):
        a.sendall(frame[:cut])
        import threading

        t = threading.Thread(target=a.sendall, args=(frame[cut:],))
        t.start()
        status, (o, r, term, trunc, info) = rx.recv_reply()
        t.join()
        assert status == OK and o.tobytes() == obs.tobytes() and o.shape == obs.shape
        assert type(r) is np.float64 and r == -1.5 and type(term) is np.bool_ and term and info == {"lives": 3}


def test_recv_reply_pickled_and_wake(pair):
    """A wake frame ahead of a pickled reply (an error): skipped, the reply read whole."""
    a, b = pair
    err = pickle.dumps((1, "ValueError", "bad action", "tb"), protocol=5)
    a.sendall(WAKE + HEADER.pack(len(err)) + err)
    assert Channel(b).recv_reply() == (1, "ValueError", "bad action", "tb")


def test_recv_reply_closed(pair):
    a, b = pair
    a.close()
    with pytest.raises(ChannelClosed):
        Channel(b).recv_reply()


def test_usual_tail_is_what_pack_writes():
    """The shortcut for (bool, bool, {}) writes the very bytes the general encoder does."""
    from gym_fork.worker import channel

    for term in (False, True):
        for trunc in (False, True):
            parts = []
            for v in (term, trunc, {}):
                channel._pack(v, parts)
            assert channel._TAILS[term, trunc] == b"".join(parts)
