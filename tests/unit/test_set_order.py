"""``set_order_problem``: where a pickled copy would iterate a set in another order than the
original (the pickle backend refuses such snapshots; see ``tests/test_agent_envs.py``)."""

from __future__ import annotations

import cloudpickle
import numpy as np

from gym_fork.snapshots.set_order import set_order_problem


class Holder:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class Room:  # hashed by its address
    def __init__(self, n: int):
        self.n = n


def _shrunk() -> set:
    s = set(range(0, 1000, 7))
    for x in list(s):
        if x not in (700, 14, 35):
            s.discard(x)
    return s


def test_what_is_reported_is_what_pickling_changes():
    shrunk = _shrunk()
    assert list(shrunk) != list(cloudpickle.loads(cloudpickle.dumps(shrunk)))  # the premise
    env = Holder(cfg={"levels": [Holder(), Holder(goals=shrunk)]})
    assert set_order_problem(env) == "env.cfg['levels'][1].goals (a set whose order changes when it is pickled)"
    grown = set(range(10))  # added in order, never shrank: a copy iterates alike
    assert list(grown) == list(cloudpickle.loads(cloudpickle.dumps(grown)))
    assert set_order_problem(Holder(a=grown, b=frozenset({(1, 2), (3, 4)}), c={"x"}, d=set())) is None


def test_objects_hashed_by_address_are_reported():
    rooms = {Room(i) for i in range(8)}
    assert set_order_problem(Holder(rooms=rooms)) == (
        "env.rooms (a set of Room objects, hashed by their address, which a copy's objects do not share)")
    assert set_order_problem(Holder(one={Room(1)})) is None  # a single element has one order


def _round_trips(make) -> set:
    """The first set ``make(i)`` makes that a pickled copy iterates alike in this process (string
    hashes follow the process's seed, so which one that is varies from run to run)."""
    for i in range(1000):
        s = make(i)
        if list(s) == list(cloudpickle.loads(cloudpickle.dumps(s))):
            return s
    raise AssertionError("no such set")


def test_in_another_process_any_set_of_non_numbers_is_reported():
    items = _round_trips(lambda i: {"lamp", f"key{i}"})
    words = Holder(items=items, ids={3, 1, 2}, pairs={(1, 2.0), (3, 4.0)})
    assert set_order_problem(words) is None
    assert set_order_problem(words, cross_process=True) == (
        "env.items (a set of strs, whose order follows the hash seed)")
    assert set_order_problem(Holder(ids={3, 1, 2}, pairs={(1, 2.0), (3, 4.0)}), cross_process=True) is None


def test_cycles_and_depth_are_bounded():
    a = Holder()
    a.me = a  # a cycle
    deep = Holder(s=_shrunk())
    for _ in range(20):
        deep = Holder(inner=deep)
    a.deep = deep
    assert set_order_problem(a) == "env.deep" + ".inner" * 20 + ".s (a set whose order changes when it is pickled)"
    for _ in range(20):
        deep = Holder(inner=deep)
    assert set_order_problem(Holder(deep=deep)) is None  # beyond 32 levels: not looked at


def test_rows_of_plain_values_are_skipped_but_a_set_among_them_is_found():
    """Lists and tuples of plain values (a replay buffer's rows) are passed over at C speed; a
    set hidden in one row is still found."""
    rows = [(i, float(i), i % 2 == 0) for i in range(10000)]
    env = Holder(buffer=rows, nested=[[1.0, 2.0], ("a", b"b", None)])
    assert set_order_problem(env) is None
    rows[4321] = (4321, _shrunk())
    assert set_order_problem(env) == "env.buffer[4321][1] (a set whose order changes when it is pickled)"


# --- arrays that share memory (copy_problem) ---------------------------------------------------------

def _write_reaches_grid(holder) -> bool:
    """Whether, in a pickled copy of ``holder``, a write through ``row`` still shows in ``grid``."""
    copy = cloudpickle.loads(cloudpickle.dumps(holder))
    copy.row[0] += 1.0
    return bool(copy.grid.sum() == holder.grid.sum() + 1.0)


def test_arrays_over_the_same_memory_are_reported():
    from gym_fork.snapshots.set_order import copy_problem

    grid = np.zeros((4, 4))
    found = copy_problem(Holder(grid=grid, row=grid[1]))
    assert found is not None and found[0].startswith("env.grid and env.row (arrays over the same memory")
    assert not _write_reaches_grid(Holder(grid=grid, row=grid[1]))  # the premise: pickling holds them apart
    buf = np.zeros(100)
    assert copy_problem(Holder(a=buf[:10], b=buf[50:])) is not None  # two views of a buffer held nowhere else
    history = [np.zeros(3) for _ in range(5)]
    assert copy_problem(Holder(history=history, last=history[-1][:2]))[0].startswith("env.last (a view of an array in a list")
    ring = np.zeros((8, 2))
    assert copy_problem(Holder(stack=[ring[i] for i in range(4)])) is not None  # frames: views of one ring


def test_arrays_a_copy_holds_alike_are_not_reported():
    from gym_fork.snapshots.set_order import copy_problem

    grid = np.zeros((4, 4))
    assert copy_problem(Holder(grid=grid, same=grid)) is None  # one object twice: the pickle memoizes it
    assert copy_problem(Holder(row=np.zeros((4, 4))[1])) is None  # a view of memory held nowhere else
    assert copy_problem(Holder(grid=grid, row=grid[1].copy())) is None
    frozen = np.arange(6.0)
    frozen.flags.writeable = False
    assert copy_problem(Holder(table=frozen, head=frozen[:2])) is None  # read-only: nothing writes through
    assert copy_problem(Holder(history=[np.zeros(3) for _ in range(1000)])) is None


def test_what_an_object_array_holds_is_looked_at():
    from gym_fork.snapshots.set_order import copy_problem

    cells = np.empty((2, 2), dtype=object)
    cells[:] = [[{1}, None], [_shrunk(), 3]]
    found = copy_problem(Holder(cells=cells))  # (items by flat index)
    assert found is not None and found[0] == "env.cells[2] (a set whose order changes when it is pickled)"
    cells[1, 0] = {14, 35}
    assert copy_problem(Holder(cells=cells)) is None
