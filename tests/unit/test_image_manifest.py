"""The manifest of image directories of our own: identities recorded at the dump, sha256 added
when images leave, and the check a migration makes after streaming them (nothing read again)."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from gym_fork.errors import SnapshotCorruptedError
from gym_fork.snapshots import sessiondir


@pytest.fixture
def dumped(tmp_path):
    d = tmp_path / "snap"
    d.mkdir()
    (d / "pages-1.img").write_bytes(os.urandom(10000))
    (d / "core-1.img").write_bytes(b"core")
    (d / "dump.log").write_text("not an image\n")
    sessiondir.write_manifest(str(d), {"id": "x"})
    return d


def _streamed(d) -> dict:
    return {n: {"size": (d / n).stat().st_size, "sha256": hashlib.sha256((d / n).read_bytes()).hexdigest()}
            for n in ("pages-1.img", "core-1.img")}


def test_identity_at_the_dump_sha256_when_they_leave(dumped):
    files = sessiondir.read_manifest(str(dumped))["files"]
    assert set(files) == {"pages-1.img", "core-1.img"} and all("sha256" not in f for f in files.values())
    sessiondir.verify(str(dumped))  # identity only: unchanged
    assert sessiondir.verify(str(dumped), digests=True)["files"] == _streamed(dumped)
    assert all("sha256" in f for f in sessiondir.read_manifest(str(dumped))["files"].values())  # kept


def test_streamed_images_are_checked_against_the_dump_without_reading_them(dumped):
    streamed = _streamed(dumped)
    assert sessiondir.streamed_as_dumped(str(dumped), streamed)
    assert not sessiondir.streamed_as_dumped(str(dumped), {**streamed, "extra.img": {"size": 1}})
    time.sleep(0.02)  # a clock tick later (kernels without fine-grained timestamps: 4 ms ticks)
    with open(dumped / "core-1.img", "r+b") as f:  # same size, other bytes, a new mtime
        f.write(b"CORE")
    assert not sessiondir.streamed_as_dumped(str(dumped), streamed)
    with pytest.raises(SnapshotCorruptedError, match="changed after it was dumped"):
        sessiondir.verify(str(dumped))


def test_a_recorded_sha256_must_equal_the_streamed_one(dumped):
    sessiondir.verify(str(dumped), digests=True)  # the sha256 are recorded now
    streamed = _streamed(dumped)
    assert sessiondir.streamed_as_dumped(str(dumped), streamed)
    streamed["core-1.img"] = {"size": 4, "sha256": "0" * 64}  # corrupted in transfer
    assert not sessiondir.streamed_as_dumped(str(dumped), streamed)
