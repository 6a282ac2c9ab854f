"""canonical_digest: live migration's check that the target answered a replayed command exactly
as the source did. Equal answers (also after a pickle round trip) must digest the same; answers
that differ in any bit, dtype, shape or container type must not."""

from __future__ import annotations

import math
import pickle
import struct

import numpy as np
import pytest

from gym_fork.worker.channel import canonical_digest as digest


def _step_result(seed: int = 0):
    rng = np.random.default_rng(seed)
    obs = {"pos": rng.standard_normal(3).astype(np.float32), "img": rng.integers(0, 255, (4, 4, 3), dtype=np.uint8),
           "flags": (np.int64(3), True)}
    return obs, 1.5, False, False, {"lives": 3, "frame": np.int32(12), "tags": ["a", "b"], "x": None}


def test_is_16_bytes_and_deterministic():
    d = digest(_step_result())
    assert isinstance(d, bytes) and len(d) == 16
    assert digest(_step_result()) == d


@pytest.mark.parametrize("obj", [
    _step_result(),
    np.arange(12, dtype=np.float64).reshape(3, 4),
    {"a": np.zeros(2, np.float32), "b": (1, 2.0, "3", b"4", None)},
    [np.float32(0.1), np.bool_(True), np.int8(-1)],
    np.array([{"k": 1}, None, "s"], dtype=object),
    np.array([(1, 2.0)], dtype=[("i", "<i4"), ("f", "<f8")]),
])
def test_equal_after_pickle_round_trip(obj):
    """What the worker answered and its unpickled copy on the other side digest the same (pickle's
    own bytes would not: they depend on which objects are shared)."""
    copy = pickle.loads(pickle.dumps(obj, protocol=5))
    assert digest(copy) == digest(obj)


def test_equal_where_pickle_bytes_differ():
    """The reason for a canonical digest: an answer and its unpickled copy can pickle to
    different bytes (numpy dtype objects shared in one, not in the other)."""
    obj = ({"a": np.zeros(2, np.float32), "b": np.ones(3, np.float32)}, np.float32(1))
    copy = pickle.loads(pickle.dumps(obj, protocol=5))
    assert pickle.dumps(copy, protocol=5) != pickle.dumps(obj, protocol=5)
    assert digest(copy) == digest(obj)


def test_memory_layout_does_not_matter():
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    assert digest(a.T) == digest(np.ascontiguousarray(a.T))
    assert digest(np.asfortranarray(a)) == digest(a)
    assert digest(a[:, ::2]) == digest(a[:, ::2].copy())


def test_one_bit_of_a_float_changes_it():
    x = 0.1
    y = struct.unpack("!d", (struct.unpack("!Q", struct.pack("!d", x))[0] ^ 1).to_bytes(8, "big"))[0]
    assert x != y and abs(x - y) < 1e-16
    assert digest(x) != digest(y)
    assert digest((1, x)) != digest((1, y))
    a = np.full(4, x)
    b = a.copy()
    b[2] = y
    assert digest(a) != digest(b)
    assert digest(np.float32(x)) != digest(np.nextafter(np.float32(x), np.float32(1)))


def test_signed_zero_is_told_apart():
    assert 0.0 == -0.0
    assert digest(0.0) != digest(-0.0)
    assert digest(np.array([0.0])) != digest(np.array([-0.0]))


def test_nan_digests_equal_to_itself_and_bit_exactly():
    """NaN != NaN, but an answer holding a NaN must still match its replay: the digest compares
    bits, so the same NaN digests the same, and NaNs with other payloads do not."""
    nan = float("nan")
    assert digest(nan) == digest(float("nan"))
    assert digest((1, nan)) == digest(pickle.loads(pickle.dumps((1, nan))))
    arr = np.array([1.0, np.nan, 3.0], dtype=np.float32)
    assert digest(arr) == digest(arr.copy())
    assert digest(np.float64(np.nan)) == digest(np.float64(np.nan))
    other = np.frombuffer(np.uint64(0x7FF8000000000001).tobytes(), dtype=np.float64)[0]
    assert math.isnan(other)
    assert digest(np.array([other])) != digest(np.array([np.nan]))
    assert digest(nan) != digest(0.0) and digest(nan) != digest(math.inf)


@pytest.mark.parametrize("a,b", [
    (np.zeros(3, np.float32), np.zeros(3, np.float64)),     # dtype
    (np.zeros(3, np.int32), np.zeros(3, np.uint32)),        # signedness
    (np.zeros(3, "<i4"), np.zeros(3, ">i4")),               # byte order (same values)
    (np.zeros(6, np.uint8), np.zeros((2, 3), np.uint8)),    # shape
    (np.zeros((2, 3), np.uint8), np.zeros((3, 2), np.uint8)),
    (np.float32(1.0), np.float64(1.0)),                     # numpy scalar types
    (np.int64(1), np.int32(1)),
    (1, 1.0),                                               # Python types
    (1, True),
    (0, False),
    (None, 0),
    ("1", 1),
    ("ab", b"ab"),
    ((1, 2), [1, 2]),                                       # container type
    ((1, 2), (1, 2, 0)),
    (((1, 2), 3), (1, (2, 3))),                             # nesting
    ({"a": 1}, {"a": 1.0}),
    ({"a": 1}, {"b": 1}),
    (np.array([1, 2]), [1, 2]),
])
def test_different_answers_digest_differently(a, b):
    assert digest(a) != digest(b)


def test_sequence_boundaries_are_unambiguous():
    assert digest(["ab", "c"]) != digest(["a", "bc"])
    assert digest([b"ab", b"c"]) != digest([b"a", b"bc"])
    assert digest(((), ())) != digest(((),))


def test_other_objects_digest_by_value():
    class_value = pickle.loads(pickle.dumps(complex(1, 2)))
    assert digest(class_value) == digest(complex(1, 2))
    assert digest(complex(1, 2)) != digest(complex(1, 3))
    assert digest({1, 2}) == digest({2, 1})
