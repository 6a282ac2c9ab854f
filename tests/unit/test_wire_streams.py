"""The migration image stream (frames OPEN / DATA / DONE after the agent's go): a round trip
through a real socketpair, and a receiver that refuses every malformed or hostile frame,
image names above all (they become file names in the agent's state dir)."""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import threading

import pytest

from gym_fork.errors import TransferError
from gym_fork.migration.wire.messages import recv_msg, send_msg
from gym_fork.migration.wire.streams import DumpThread, receive_images, send_images

FRAME = struct.Struct("!BIQ")  # kind, file number, length
OPEN, DATA, DONE = 1, 2, 3



def _open(num: int, name: bytes) -> bytes:
    return FRAME.pack(OPEN, num, len(name)) + name


def _data(num: int, payload: bytes) -> bytes:
    return FRAME.pack(DATA, num, len(payload)) + payload


def _receive(sock, dest, limit=1 << 20, alg="sha256"):
    return receive_images(sock, limit, str(dest), alg)


def test_round_trip(pair, tmp_path):
    """send_images -> receive_images: the same files, byte for byte, with matching digests and
    the signed trailer and verdict in order. Logs and the manifest are not images: not sent."""
    a, b = pair
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    files = {"pages-1.img": os.urandom(3 << 20), "core-42.img": b"core", "empty.img": b""}
    for name, data in files.items():
        (src / name).write_bytes(data)
    (src / "dump.log").write_text("not an image")
    (src / "MANIFEST.json").write_text("{}")
    done, failed = threading.Event(), threading.Event()
    done.set()
    got: dict = {}

    def agent():
        req = recv_msg(b)
        got["req"] = req
        send_msg(b, {"ok": True, "ready": True})
        got["digests"], got["bytes"] = receive_images(b, req["size"], str(dst), req["hash"])
        got["trailer"] = recv_msg(b)
        send_msg(b, {"ok": True, "node": "B"})

    t = threading.Thread(target=agent, daemon=True)
    t.start()
    reply, sent = send_images(a, {"op": "env"}, str(src), "B", lambda d: {"images": d}, done, failed,
                              limit=10 << 20, alg="sha256")
    t.join(30)
    assert reply == {"ok": True, "node": "B"}
    assert got["req"]["op"] == "env" and got["req"]["size"] == 10 << 20 and got["req"]["hash"] == "sha256"
    assert sorted(os.listdir(dst)) == sorted(files)
    for name, data in files.items():
        assert (dst / name).read_bytes() == data
        assert got["digests"][name] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        assert oct((dst / name).stat().st_mode & 0o777) == oct(0o600)
    assert got["trailer"] == {"images": got["digests"]}
    assert sent == got["bytes"] == sum(map(len, files.values()))


def test_sender_refuses_to_outgrow_its_limit(pair, tmp_path):
    a, b = pair
    (tmp_path / "pages-1.img").write_bytes(b"x" * 5000)
    done, failed = threading.Event(), threading.Event()
    done.set()
    send_msg(b, {"ok": True, "ready": True})  # the agent's go, queued before the request is read
    with pytest.raises(ValueError, match="outgrew"):
        send_images(a, {"op": "env"}, str(tmp_path), "B", lambda d: {}, done, failed, limit=4096, alg="sha256")


def test_receiver_refusal_before_the_stream_is_returned(pair, tmp_path):
    a, b = pair
    send_msg(b, {"ok": False, "error": "NoSpaceError", "message": "full"})
    done, failed = threading.Event(), threading.Event()
    done.set()
    reply, sent = send_images(a, {"op": "env"}, str(tmp_path), "B", lambda d: {}, done, failed, limit=1, alg="sha256")
    assert reply["error"] == "NoSpaceError" and sent == 0


def test_a_dump_that_fails_mid_stream_raises_its_own_error(pair, tmp_path):
    """The writer (DumpThread) writes one image, then fails: the stream stops with a ValueError
    and raise_error() gives the caller the dump's own exception."""
    a, b = pair
    send_msg(b, {"ok": True, "ready": True})
    go = threading.Event()

    def dump():
        (tmp_path / "pages-1.img").write_bytes(b"x" * 100)
        go.wait(10)
        raise OSError("criu dump: no space left")

    seen = []
    dumper = DumpThread(dump, on_end=lambda: seen.append("end"))
    threading.Timer(0.05, go.set).start()
    with pytest.raises(OSError, match="no space left"):
        try:
            send_images(a, {"op": "env"}, str(tmp_path), "B", lambda d: {}, dumper.done, dumper.failed,
                        limit=1 << 20, alg="sha256")
        except ValueError as e:
            assert "dump failed" in str(e)
            dumper.raise_error()
            raise
    dumper.join()
    assert seen == ["end"] and dumper.failed.is_set() and dumper.result is None


def test_dump_thread_keeps_what_the_dump_returned():
    dumper = DumpThread(lambda: "image")
    dumper.join()
    dumper.raise_error()  # nothing to raise
    assert dumper.result == "image" and dumper.done.is_set() and not dumper.failed.is_set()


@pytest.mark.parametrize("name", [
    b"..",
    b".",
    b"../escape.img",
    b"a/b.img",
    b"/etc/passwd",
    b"a b.img",
    b"img\n",            # a trailing newline ('$' alone would accept it)
    b"img\x00.img",
    b"",
    "é.img".encode(),
])
def test_refused_image_names(pair, tmp_path, name):
    a, b = pair
    dest = tmp_path / "dest"
    dest.mkdir()
    a.sendall(_open(0, name) + _data(0, b"evil") + FRAME.pack(DONE, 0, 0))
    with pytest.raises(TransferError, match="refusing"):
        _receive(b, dest)
    assert os.listdir(dest) == []
    assert sorted(os.listdir(tmp_path)) == ["dest"]


def test_name_not_utf8_refused(pair, tmp_path):
    a, b = pair
    a.sendall(_open(0, b"\xff\xfe.img"))
    with pytest.raises(TransferError, match="UTF-8"):
        _receive(b, tmp_path)
    assert os.listdir(tmp_path) == []


def test_overlong_name_refused_before_reading_it(pair, tmp_path):
    a, b = pair
    a.sendall(FRAME.pack(OPEN, 0, 256))  # no name bytes follow: refused from the header alone
    with pytest.raises(TransferError, match="bad OPEN frame"):
        _receive(b, tmp_path)


def test_repeated_name_refused(pair, tmp_path):
    a, b = pair
    a.sendall(_open(0, b"core.img") + _data(0, b"one") + _open(1, b"core.img"))
    with pytest.raises(TransferError, match="refusing"):
        _receive(b, tmp_path)


@pytest.mark.parametrize("frames,match", [
    (_open(1, b"core.img"), "bad OPEN frame"),                    # file numbers must count up from 0
    (_data(0, b"x"), "unknown file"),                             # DATA before its OPEN
    (_open(0, b"core.img") + _data(1, b"x"), "unknown file"),
    (FRAME.pack(9, 0, 0), "unknown frame kind"),
])
def test_malformed_frames_refused(pair, tmp_path, frames, match):
    a, b = pair
    a.sendall(frames)
    with pytest.raises(TransferError, match=match):
        _receive(b, tmp_path)


def test_more_than_announced_refused(pair, tmp_path):
    """The agent checked its disk space against the announced size: a sender that sends more is
    refused from the DATA header, before the bytes are written."""
    a, b = pair
    a.sendall(_open(0, b"pages.img") + _data(0, b"x" * 100) + FRAME.pack(DATA, 0, 1 << 40))
    with pytest.raises(TransferError, match="outgrow"):
        _receive(b, tmp_path, limit=200)
    assert (tmp_path / "pages.img").stat().st_size == 100


def test_cut_mid_data_is_eof(pair, tmp_path):
    a, b = pair
    a.sendall(_open(0, b"pages.img") + FRAME.pack(DATA, 0, 1000) + b"x" * 10)
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(EOFError):
        _receive(b, tmp_path)


def test_unknown_digest_refused(pair, tmp_path):
    a, b = pair
    a.sendall(_open(0, b"core.img"))
    with pytest.raises(TransferError, match="unknown image digest"):
        _receive(b, tmp_path, alg="md5")
