"""gym_fork.worker.prefault: a copy learns what a sibling touched and faults exactly that in,
without changing a byte."""

import os
import mmap

import numpy as np
import pytest

from conftest import run_in_child

from gym_fork.worker import prefault


def _pagemap_entry(pid: int, addr: int) -> int:
    with open(f"/proc/{pid}/pagemap", "rb") as f:
        f.seek(addr // prefault.PAGE * 8)
        return int.from_bytes(f.read(8), "little")


def test_learns_what_a_sibling_wrote_and_a_copy_faults_it_in_unchanged():
    pages = 64
    buf = mmap.mmap(-1, pages * prefault.PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(buf, dtype=np.uint8)
    arr[:] = np.arange(arr.size) % 251  # every page present (and, before any fork, ours alone)
    base = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    written = [3, 4, 5, 40]

    # a sibling (forked from this state) writes a few pages and waits to be learned from
    r, w = os.pipe()
    go_r, go_w = os.pipe()
    sib = os.fork()
    if sib == 0:
        for p in written:
            arr[p * prefault.PAGE] ^= 0  # a write of the same value: copy-on-write breaks
        os.write(w, b"x")
        os.read(go_r, 1)
        os._exit(0)
    os.read(r, 1)
    try:
        plan = prefault.learn(sib)
    finally:
        os.write(go_w, b"x")
        os.waitpid(sib, 0)
    inside = [(a, b) for a, b in plan.write if a < base + pages * prefault.PAGE and b > base]
    learned = sorted({(a - base) // prefault.PAGE + i for a, b in inside for i in range((b - a) // prefault.PAGE)
                      if base <= a + i * prefault.PAGE < base + pages * prefault.PAGE})
    assert learned == written

    def copy() -> bytes:  # a new copy: shares every page until it applies the plan
        before = [bool(_pagemap_entry(os.getpid(), base + p * prefault.PAGE) & prefault._EXCLUSIVE) for p in written]
        n = prefault.apply(plan)
        after = [bool(_pagemap_entry(os.getpid(), base + p * prefault.PAGE) & prefault._EXCLUSIVE) for p in written]
        other = bool(_pagemap_entry(os.getpid(), base + 20 * prefault.PAGE) & prefault._EXCLUSIVE)
        same = bool((arr == np.arange(arr.size) % 251).all())
        return repr((before, after, other, same, n > 0)).encode()

    before, after, other, same, did = eval(run_in_child(copy))  # noqa: S307 - our own child's repr
    assert before == [False] * len(written)  # shared with this process after the fork
    assert after == [True] * len(written)  # faulted in for writing: its own now
    assert other is False  # a page the sibling did not write stays shared
    assert same and did  # not a byte changed


def test_code_pages_a_sibling_ran_are_mapped_in_a_copy():
    plan = prefault.learn(os.getpid())
    assert plan.read  # this interpreter's code pages
    runs = sorted(plan.read + plan.write)
    assert all(a < b for a, b in runs)
    assert all(runs[i][1] <= runs[i + 1][0] for i in range(len(runs) - 1))  # no overlaps


def test_a_gone_process_teaches_nothing():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    plan = prefault.learn(pid)
    assert plan.read == [] and plan.write == []
    assert prefault.apply(plan) == 0


def test_apply_stops_when_asked_and_leaves_the_rest_shared_and_unchanged():
    """A ready copy taken before it finished faulting in (restores a few ms apart) must serve at
    once: apply() asks ``stop`` between calls and leaves what is left."""
    pages = 4096  # 16 MB: far more than one call's worth (STEP_PAGES)
    buf = mmap.mmap(-1, pages * prefault.PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(buf, dtype=np.uint8)
    arr[:: prefault.PAGE] = np.arange(pages) % 251
    base = arr.ctypes.data
    plan = prefault.Plan(write=[(base, base + pages * prefault.PAGE)])

    def copy(stop) -> bytes:
        asked = []

        def ask() -> bool:
            asked.append(1)
            return stop

        n = prefault.apply(plan, stop=ask)
        own = sum(bool(_pagemap_entry(os.getpid(), base + p * prefault.PAGE) & prefault._EXCLUSIVE) for p in range(pages))
        same = bool((arr[:: prefault.PAGE] == np.arange(pages) % 251).all())
        return repr((n, own, len(asked), same)).encode()

    n, own, asked, same = eval(run_in_child(lambda: copy(True)))  # noqa: S307 - our own child's repr
    assert asked == 1 and n < pages and own == n and same  # stopped at the first question
    n, own, asked, same = eval(run_in_child(lambda: copy(False)))  # noqa: S307
    assert n == pages and own == pages and same  # never told to stop: all of it


@pytest.mark.alone  # keeps every CPU busy: the other test process would crawl meanwhile
def test_cpu_watch_sees_every_cpu_taken_and_freed_again():
    """CpuWatch counts the machine's runnable tasks: busy loops on every CPU make it say no CPU
    is free, and once they end a CPU is free again."""
    import subprocess
    import sys

    from conftest import eventually

    with prefault.CpuWatch() as cpus:
        loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cpus.cpus + 1)]
        try:
            assert eventually(lambda: not cpus.free(), timeout=10)
        finally:
            for p in loops:
                p.kill()
                p.wait()
        assert eventually(cpus.free, timeout=10)
    assert cpus.free()  # closed: no count to read, every CPU counts as free


def test_a_copy_stopped_by_full_cpus_goes_on_where_it_stopped_once_one_is_free():
    """Right after a restore the CPUs fill up for a moment (the old worker's exit, the next ready
    copy's fork, the learner's steps): a ready copy faulting in then must pause and go on, not
    give up for good (its first step then took every copy-on-write fault it would have saved)."""
    pages = 4096  # many madvise calls' worth (STEP_PAGES): the CPUs fill up after the first
    buf = mmap.mmap(-1, pages * prefault.PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(buf, dtype=np.uint8)
    arr[:: prefault.PAGE] = np.arange(pages) % 251
    base = arr.ctypes.data
    plan = prefault.Plan(write=[(base, base + pages * prefault.PAGE)])

    def copy() -> bytes:
        import socket

        from gym_fork.worker import loop  # (in the child: it sets thread-count defaults on import)
        from gym_fork.worker.channel import Channel

        answers = [True, False]  # free to start; full at its first look while faulting in; then free

        class Cpus:
            looked = 0

            def __init__(self) -> None:
                pass

            def free(self) -> bool:
                Cpus.looked += 1
                return answers.pop(0) if answers else True

            def __enter__(self):
                return self

            def __exit__(self, *exc) -> None:
                pass

        prefault.CpuWatch = Cpus  # (this child's module only)
        ours, theirs = socket.socketpair()  # a channel nobody writes to: no request comes
        loop._prefault_on_a_free_cpu(Channel(theirs), plan)
        own = sum(bool(_pagemap_entry(os.getpid(), base + p * prefault.PAGE) & prefault._EXCLUSIVE) for p in range(pages))
        same = bool((arr[:: prefault.PAGE] == np.arange(pages) % 251).all())
        return repr((own, Cpus.looked, same)).encode()

    own, looked, same = eval(run_in_child(copy))  # noqa: S307 - our own child's repr
    assert looked >= 3  # it did see the CPUs full in the middle, and looked again
    assert own == pages and same  # all of the plan in the end, not a byte changed
