"""The agent's wire protocol: authenticated control messages, bundle streaming, netns helpers.

One TCP connection (optionally TLS) per migration::

    agent  -> client   {"hello": "gym_fork-agent", "v": 1, "node": NAME, "nonce": A}
    client -> agent    {"nonce": C, "mac": HMAC(token, "client|A|C")}
    agent  -> client   {"ok": true, "mac": HMAC(token, "agent|C|A")}     (mutual: the client checks it)
    client -> agent    {"op": "env" | "job" | "ping", "size": N, ...}
    agent  -> client   {"ok": true, "ready": true}  or an error (e.g. not enough disk space)
    client -> agent    N bytes: an uncompressed tar of the bundle
    agent  -> client   {"ok": true, ...} or {"ok": false, "error": TYPE, "message": ...}
    ("env" only)       from here on the connection carries the env worker's own channel bytes

Control messages are 4-byte big-endian length + UTF-8 JSON (at most 1 MiB).  The bundle inside
the tar is signed with a key derived from the token (:func:`bundle_key`), so the agent checks
the HMAC and every image's sha256 (``gym_fork.load_snapshot``) before anything is restored.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import io
import json
import os
import re
import socket
import ssl
import struct
import tarfile
import threading
import time
from typing import Any

from gym_fork.errors import AgentUnreachableError, AuthenticationError, TransferError

PROTOCOL = 1
MAX_CONTROL = 1 << 20
_LEN = struct.Struct("!I")
CLONE_NEWNET = 0x40000000


# --- token and keys ---------------------------------------------------------------------------
def load_token(token: str | bytes | None = None, token_file: str | None = None) -> bytes:
    """The shared token: explicit, else ``token_file``, else ``$GYM_FORK_TOKEN``, else
    ``$GYM_FORK_TOKEN_FILE``. Raises ValueError when there is none (agents never run without)."""
    if token:
        return token if isinstance(token, bytes) else token.encode()
    path = token_file or os.environ.get("GYM_FORK_TOKEN_FILE")
    if token_file is None and os.environ.get("GYM_FORK_TOKEN"):
        return os.environ["GYM_FORK_TOKEN"].encode()
    if path:
        with open(path, "rb") as f:
            data = f.read().strip()
        if not data:
            raise ValueError(f"token file {path} is empty")
        return data
    raise ValueError("no token: pass --token-file FILE or set $GYM_FORK_TOKEN")


def bundle_key(token: bytes) -> bytes:
    """The HMAC key for bundles shipped between agents (derived, so the token itself never
    signs data an attacker chose)."""
    return hmac.new(token, b"gym_fork bundle key v1", hashlib.sha256).digest()


def _mac(token: bytes, *parts: str) -> str:
    return hmac.new(token, "|".join(parts).encode(), hashlib.sha256).hexdigest()


# --- framing ------------------------------------------------------------------------------------
def send_msg(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    while view:
        k = sock.recv_into(view)
        if k == 0:
            raise EOFError(f"connection closed after {n - len(view)} of {n} bytes")
        view = view[k:]
    return bytes(buf)


def recv_msg(sock: socket.socket) -> dict:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > MAX_CONTROL:
        raise ValueError(f"control message of {n} bytes refused (limit {MAX_CONTROL})")
    obj = json.loads(recv_exact(sock, n))
    if not isinstance(obj, dict):
        raise ValueError("control message is not a JSON object")
    return obj


# --- handshake ----------------------------------------------------------------------------------
def server_handshake(sock: socket.socket, token: bytes, node: str) -> str:
    """Raises AuthenticationError (after telling the peer) unless the peer knows the token.
    Returns this session's agent nonce (a streamed bundle's signed ``session`` must equal it)."""
    nonce_a = os.urandom(32).hex()
    send_msg(sock, {"hello": "gym_fork-agent", "v": PROTOCOL, "node": node, "nonce": nonce_a})
    msg = recv_msg(sock)
    nonce_c, mac = str(msg.get("nonce", "")), str(msg.get("mac", ""))
    if len(nonce_c) < 32 or not hmac.compare_digest(_mac(token, "client", nonce_a, nonce_c), mac):
        try:
            send_msg(sock, {"ok": False, "error": "AuthenticationError",
                            "message": "the agent refused the token (challenge-response failed)"})
        except OSError:
            pass
        raise AuthenticationError("peer failed the challenge-response (wrong token or not a gym_fork client)")
    send_msg(sock, {"ok": True, "mac": _mac(token, "agent", nonce_c, nonce_a)})
    return nonce_a


def client_handshake(sock: socket.socket, token: bytes) -> dict:
    """Authenticates both ways; returns the agent's hello (has ``node``)."""
    hello = recv_msg(sock)
    if hello.get("hello") != "gym_fork-agent" or hello.get("v") != PROTOCOL:
        raise AuthenticationError(f"the peer is not a gym_fork agent of protocol {PROTOCOL}: {hello!r:.200}")
    nonce_c = os.urandom(32).hex()
    send_msg(sock, {"nonce": nonce_c, "mac": _mac(token, "client", hello["nonce"], nonce_c)})
    reply = recv_msg(sock)
    if not reply.get("ok"):
        raise AuthenticationError(f"agent {hello.get('node')!r} refused us: {reply.get('message')}")
    if not hmac.compare_digest(_mac(token, "agent", nonce_c, hello["nonce"]), str(reply.get("mac", ""))):
        raise AuthenticationError(f"agent {hello.get('node')!r} could not prove it knows the token")
    return hello


# --- network namespaces -------------------------------------------------------------------------
def _setns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"setns({path}): {os.strerror(e)}")
    finally:
        os.close(fd)


def netns_path(netns: str) -> str:
    return netns if netns.startswith("/") else f"/run/netns/{netns}"


def in_netns(netns: str | None, fn, *args: Any) -> Any:
    """Run ``fn(*args)`` in a short-lived thread that joined network namespace ``netns``, so the
    sockets it creates belong there (setns only affects the calling thread)."""
    if not netns:
        return fn(*args)
    box: dict = {}

    def run() -> None:
        try:
            _setns(netns_path(netns))
            box["v"] = fn(*args)
        except BaseException as e:  # noqa: BLE001
            box["e"] = e

    t = threading.Thread(target=run, name="gym_fork-netns")
    t.start()
    t.join()
    if "e" in box:
        raise box["e"]
    return box["v"]


# --- client connection --------------------------------------------------------------------------
def parse_target(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"target must be 'host:port', not {target!r}")
    return host.strip("[]"), int(port)


def connect(target: str, token: bytes, *, tls: bool | str = False, timeout: float = 10.0,
            netns: str | None = None) -> tuple[socket.socket, dict]:
    """Connect and authenticate. ``tls``: False, True (system CAs) or a CA file path."""
    host, port = parse_target(target)

    def mk() -> socket.socket:
        return socket.create_connection((host, port), timeout=timeout)

    try:
        sock = in_netns(netns, mk)
    except OSError as e:
        raise AgentUnreachableError(f"no gym_fork agent reachable at {target}: {e}") from e
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls:
            ctx = ssl.create_default_context(cafile=tls if isinstance(tls, str) else None)
            if isinstance(tls, str):
                ctx.check_hostname = False  # pinned CA file: the peer is the cert's holder
            sock = ctx.wrap_socket(sock, server_hostname=host)
        hello = client_handshake(sock, token)
    except AuthenticationError:
        sock.close()
        raise
    except (OSError, EOFError, ValueError, ssl.SSLError) as e:
        sock.close()
        raise AgentUnreachableError(f"agent at {target} did not complete the handshake: {e}") from e
    return sock, hello


class _Background:
    """``fn(*args, **kw)`` -- a connect that returns ``(sock, ...)`` -- running in a thread;
    ``result()`` joins it (re-raising its error), ``discard()`` closes the socket it made."""

    def __init__(self, fn: Any, *args: Any, **kw: Any):
        self.box: dict = {}
        self.elapsed = 0.0

        def run() -> None:
            t0 = time.monotonic()
            try:
                self.box["v"] = fn(*args, **kw)
            except BaseException as e:  # noqa: BLE001
                self.box["e"] = e
            self.elapsed = time.monotonic() - t0

        self.t = threading.Thread(target=run, name="gym_fork-connect", daemon=True)
        self.t.start()

    def result(self) -> tuple:
        self.t.join()
        if "e" in self.box:
            raise self.box["e"]
        return self.box["v"]

    def discard(self) -> None:
        """Close the connection if it was made (the caller failed before using it)."""
        self.t.join()
        if "v" in self.box:
            self.box["v"][0].close()


def connect_in_background(target: str, token: bytes, **kw: Any) -> _Background:
    """Start :func:`connect` (same arguments) in a thread, so the handshake overlaps the dump."""
    return _Background(connect, target, token, **kw)


def in_background(fn: Any, *args: Any) -> _Background:
    """Start any connect-like ``fn(*args)`` returning ``(sock, ...)`` in a thread (see :class:`_Background`)."""
    return _Background(fn, *args)


def _tar_members(path: str) -> list[tuple[str, str, int]]:
    out = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            rel = os.path.relpath(full, path)
            if len(rel) >= 100:
                raise ValueError(f"bundle member name too long for a plain tar header: {rel}")
            out.append((full, rel, os.path.getsize(full)))
    return out


def tar_size(members: list[tuple[str, str, int]]) -> int:
    """Exact size of the GNU-format tar :func:`send_bundle` writes (names < 100 chars, no dirs)."""
    n = sum(512 + (size + 511) // 512 * 512 for _f, _r, size in members) + 1024
    return (n + tarfile.RECORDSIZE - 1) // tarfile.RECORDSIZE * tarfile.RECORDSIZE


def _send_tar_header(sock: socket.socket, rel: str, fsize: int) -> int:
    """One tar member header (mode 0600) into the socket; returns its length."""
    ti = tarfile.TarInfo(rel)
    ti.size, ti.mode, ti.mtime = fsize, 0o600, int(time.time())
    hdr = ti.tobuf(tarfile.GNU_FORMAT)
    sock.sendall(hdr)
    return len(hdr)


def send_bundle(sock: socket.socket, header: dict, path: str, target: str) -> tuple[dict, int]:
    """Send ``header`` (+ size), wait for the agent's go, stream a tar of the files under ``path``
    straight into the socket (headers from ``tarfile``, contents by ``sendfile``: no copy in
    memory), wait for the verdict. Returns (reply, bytes); raises TransferError when the
    connection breaks."""
    members = _tar_members(path)
    size = tar_size(members)
    sent = 0
    try:
        send_msg(sock, dict(header, size=size))
        go = recv_msg(sock)  # the agent checks space etc. before we stream
        if not go.get("ok"):
            return go, size
        for full, rel, fsize in members:
            sent += _send_tar_header(sock, rel, fsize)
            with open(full, "rb") as f:
                if isinstance(sock, ssl.SSLSocket):  # no sendfile through TLS
                    while chunk := f.read(1 << 20):
                        sock.sendall(chunk)
                        sent += len(chunk)
                else:
                    sent += sock.sendfile(f)
            pad = -fsize % 512
            sock.sendall(b"\0" * pad)
            sent += pad
        sock.sendall(b"\0" * (size - sent))  # end-of-archive blocks and record padding
        sent = size
        return recv_msg(sock), size
    except (OSError, EOFError, ValueError) as e:
        raise _transfer_error(target, e, sent, size, sent >= size) from e


def _transfer_error(target: str, e: BaseException, sent: int, size: int | None, all_sent: bool) -> TransferError:
    """The error of a stream to an agent that broke: before everything was sent (the agent restores
    nothing) or while waiting for its verdict."""
    if all_sent:
        return TransferError(f"the connection to the agent at {target} broke while waiting for its "
                             f"confirmation ({type(e).__name__}: {e})")
    of = f" of {size}" if size is not None else ""
    return TransferError(f"the connection to the agent at {target} broke after {sent}{of} bytes "
                         f"({type(e).__name__}: {e}); nothing was restored there")


def image_members(images: str) -> list[tuple[str, str, int]]:
    """The CRIU image files of a dump dir (no logs, stats or manifest), as tar members."""
    from gym_fork.snapshots.sessiondir import _NOT_IMAGES

    return [(os.path.join(images, n), n, os.path.getsize(os.path.join(images, n)))
            for n in sorted(os.listdir(images))
            if not _NOT_IMAGES.search(n) and os.path.isfile(os.path.join(images, n))]


def send_images(sock: socket.socket, header: dict, images: str, target: str, trailer) -> tuple[dict, int]:
    """The streamed form of :func:`send_bundle` (``header["stream"] = 2``): a tar of the image
    files only, each hashed (sha256) in the same pass that sends it, then one control message
    ``trailer(digests)`` -- the signed bundle/job metadata whose ``images`` are those digests --
    then the agent's verdict.  The agent hashes what it receives as it arrives and compares it
    with the signed trailer before restoring anything: no manifest is written and nothing is
    read twice on either side.  (A hashing thread next to ``sendfile`` measured no faster on
    this 2-core machine, where both ends share the CPUs.)  Returns (reply, tar bytes); raises
    TransferError."""
    members = image_members(images)
    size = tar_size(members)
    sent = 0
    digests: dict[str, dict] = {}
    buf = memoryview(bytearray(1 << 20))
    try:
        send_msg(sock, dict(header, size=size, stream=2))
        go = recv_msg(sock)
        if not go.get("ok"):
            return go, size
        for full, rel, fsize in members:
            sent += _send_tar_header(sock, rel, fsize)
            h = hashlib.sha256()
            n = 0
            with open(full, "rb", buffering=0) as f:
                while n < fsize:
                    k = f.readinto(buf[: min(len(buf), fsize - n)])
                    if not k:
                        raise ValueError(f"image {rel} shrank while it was sent")
                    h.update(buf[:k])  # what is hashed is exactly what is sent
                    sock.sendall(buf[:k])
                    n += k
                    sent += k
            digests[rel] = {"size": fsize, "sha256": h.hexdigest()}
            pad = -fsize % 512
            sock.sendall(b"\0" * pad)
            sent += pad
        sock.sendall(b"\0" * (size - sent))
        sent = size
        send_msg(sock, trailer(digests))
        return recv_msg(sock), size
    except (OSError, EOFError, ValueError) as e:
        raise _transfer_error(target, e, sent, size, sent >= size) from e


# --- stream 3: images sent while CRIU is still writing them ----------------------------------------
# After the go, frames ``!BIQ`` (kind, file number, length): OPEN (+ the name), DATA (+ bytes),
# DONE; then the trailer message and the verdict, as in stream 2.  CRIU writes every image file
# once, front to back (appends only), so what has been read of a file is final: the sender can
# ship (and hash) each file's bytes as they appear, overlapping dump and transfer.
_FRAME = struct.Struct("!BIQ")
_F_OPEN, _F_DATA, _F_DONE = 1, 2, 3


def stream_hash() -> str:
    """The digest for streamed images: BLAKE3 (2.6 GB/s on one core here, sha256 1.0 GB/s; both
    ends hash every byte, so this is most of the CPU a transfer costs), sha256 without it."""
    try:
        import blake3  # noqa: F401
    except ImportError:
        return "sha256"
    return "blake3"


def _new_hash(alg: str) -> Any:
    if alg == "blake3":
        import blake3

        return blake3.blake3()
    if alg == "sha256":
        return hashlib.sha256()
    raise tarfile.ReadError(f"unknown image digest {alg!r} (this node knows sha256 and blake3)")


def send_images_while_dumping(sock: socket.socket, header: dict, images: str, target: str, trailer,
                              dump_done: threading.Event, dump_failed: threading.Event,
                              limit: int, alg: str | None = None) -> tuple[dict, int]:
    """Stream the image files of ``images`` while a CRIU dump into it is still running (set
    ``dump_done`` when it returned, ``dump_failed`` too when it failed): each file is read and
    hashed (sha256) as it grows, then the signed ``trailer(digests)``, then the agent's verdict.
    ``limit``: the most bytes this may send (announced to the agent, which checks its disk
    space against it; more raises). Returns (reply, bytes); raises TransferError, or
    ValueError when the dump failed (the caller closes ``sock``: the agent drops what it got).
    ``alg``: the digest (default :func:`stream_hash`)."""
    from gym_fork.snapshots.sessiondir import _NOT_IMAGES

    files: dict[str, list] = {}  # name -> [fd, offset, hash, number]
    sent = 0
    buf = memoryview(bytearray(1 << 20))
    alg = alg or stream_hash()
    all_sent = False
    try:
        send_msg(sock, dict(header, size=limit, stream=3, hash=alg))
        go = recv_msg(sock)
        if not go.get("ok"):
            return go, 0
        while True:
            last = dump_done.is_set()  # read before the pass: a pass after the dump sees everything
            if dump_failed.is_set():
                raise ValueError("the CRIU dump failed")
            progressed = False
            try:
                names = sorted(os.listdir(images))
            except FileNotFoundError:  # not made yet (or removed by a failed dump: checked next pass)
                names = []
            for name in names:
                ent = files.get(name)
                if ent is None:
                    if _NOT_IMAGES.search(name) or not _SAFE_NAME.match(name) or "/" in name:
                        continue
                    try:
                        fd = os.open(os.path.join(images, name), os.O_RDONLY | os.O_NOFOLLOW)
                    except (FileNotFoundError, IsADirectoryError):
                        continue
                    ent = files[name] = [fd, 0, _new_hash(alg), len(files)]
                    raw = name.encode()
                    sock.sendall(_FRAME.pack(_F_OPEN, ent[3], len(raw)) + raw)
                while True:
                    k = os.preadv(ent[0], [buf], ent[1])
                    if not k:
                        break
                    if sent + k > limit:
                        raise ValueError(f"the images outgrew the announced {limit} bytes")
                    ent[2].update(buf[:k])  # what is hashed is exactly what is sent
                    sock.sendall(_FRAME.pack(_F_DATA, ent[3], k))
                    sock.sendall(buf[:k])
                    ent[1] += k
                    sent += k
                    progressed = True
            if last:
                break
            if not progressed:
                dump_done.wait(0.002)
        for name, ent in files.items():  # write-once files: nothing may have vanished or shrunk
            if os.fstat(ent[0]).st_size != ent[1] or not os.path.exists(os.path.join(images, name)):
                raise ValueError(f"image {name} changed after it was sent")
        sock.sendall(_FRAME.pack(_F_DONE, 0, 0))
        digests = {name: {"size": ent[1], alg: ent[2].hexdigest()} for name, ent in files.items()}
        send_msg(sock, trailer(digests))
        all_sent = True
        return recv_msg(sock), sent
    except (OSError, EOFError) as e:
        raise _transfer_error(target, e, sent, None, all_sent) from e
    finally:
        for ent in files.values():
            os.close(ent[0])


def receive_images_while_dumped(sock: socket.socket, limit: int, dest: str, digests: dict,
                                alg: str = "sha256") -> int:
    """The receiving end of :func:`send_images_while_dumping`: files land in ``dest`` (mode
    0600, plain names only), hashed (``alg``: the request's ``hash``) as they arrive into
    ``digests[name] = {"size", alg}``.
    Returns the bytes received. Raises EOFError (cut), tarfile.ReadError (malformed, or over ``limit``)."""
    fds: list[int] = []
    names: list[str] = []
    hashes: list[Any] = []
    sizes: list[int] = []
    total = 0
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    try:
        while True:
            kind, num, n = _FRAME.unpack(recv_exact(sock, _FRAME.size))
            if kind == _F_DONE:
                break
            if kind == _F_OPEN:
                if num != len(fds) or n > 255:
                    raise tarfile.ReadError(f"bad OPEN frame (file {num}, name length {n})")
                name = recv_exact(sock, n).decode("utf-8", "strict")
                if not _SAFE_NAME.match(name) or "/" in name or name in names:
                    raise tarfile.ReadError(f"refusing image name {name!r}")
                fds.append(os.open(os.path.join(dest, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
                names.append(name)
                hashes.append(_new_hash(alg))
                sizes.append(0)
            elif kind == _F_DATA:
                if num >= len(fds):
                    raise tarfile.ReadError(f"DATA frame for unknown file {num}")
                if total + n > limit:
                    raise tarfile.ReadError(f"the images outgrow the announced {limit} bytes")
                total += n
                sizes[num] += n
                while n:
                    k = sock.recv_into(view[: min(len(buf), n)])
                    if k == 0:
                        raise EOFError(f"transfer cut after {total - n} bytes")
                    chunk = view[:k]
                    hashes[num].update(chunk)  # what is hashed is exactly what is written
                    while chunk:
                        chunk = chunk[os.write(fds[num], chunk):]
                    n -= k
            else:
                raise tarfile.ReadError(f"unknown frame kind {kind}")
    finally:
        for fd in fds:
            os.close(fd)
    for name, h, size in zip(names, hashes, sizes):
        digests[name] = {"size": size, alg: h.hexdigest()}
    return total


_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+){0,3}$")


def receive_tar(sock: socket.socket, size: int, dest: str, digests: dict | None = None) -> None:
    """Unpack exactly ``size`` bytes of tar from ``sock`` into ``dest``: regular files only,
    plain relative names (no '..', no absolute paths, no links, no devices), mode 0600.
    With ``digests`` (a dict), also hash each file as it arrives: ``digests[name] = {"size",
    "sha256"}`` (one pass: nothing is re-read to verify). Raises EOFError when the stream ends
    early, tarfile.TarError on a malformed archive."""
    left = size
    buf = bytearray(1 << 20)
    view = memoryview(buf)

    def read_exact(n: int) -> bytes:
        nonlocal left
        if n > left:
            raise tarfile.ReadError(f"tar member runs past the announced {size} bytes")
        try:
            out = recv_exact(sock, n)
        except EOFError:
            raise EOFError(f"transfer cut after {size - left} of {size} bytes") from None
        left -= n
        return out

    while left >= 512:
        hdr = read_exact(512)
        if hdr == b"\0" * 512:
            break
        ti = tarfile.TarInfo.frombuf(hdr, "utf-8", "strict")
        name = ti.name
        if not ti.isreg() or not _SAFE_NAME.match(name) or any(p in (".", "..") for p in name.split("/")):
            raise tarfile.ReadError(f"refusing tar member {name!r} (type {ti.type!r})")
        full = os.path.join(dest, name)
        os.makedirs(os.path.dirname(full), mode=0o700, exist_ok=True)
        n = ti.size
        padded = n + (-n % 512)
        if padded > left:
            raise tarfile.ReadError(f"tar member {name!r} runs past the announced {size} bytes")
        h = hashlib.sha256() if digests is not None else None
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            todo = padded
            while todo:
                k = sock.recv_into(view[: min(len(buf), todo)])
                if k == 0:
                    raise EOFError(f"transfer cut after {size - left} of {size} bytes")
                left -= k
                real = min(k, max(0, n - (padded - todo)))
                chunk = view[:real]
                if h is not None:
                    h.update(chunk)  # what is hashed is exactly what is written
                while chunk:
                    chunk = chunk[os.write(fd, chunk):]
                todo -= k
        finally:
            os.close(fd)
        if digests is not None:  # (a repeated name already failed O_EXCL)
            digests[name] = {"size": n, "sha256": h.hexdigest()}
    while left:  # end-of-archive blocks and record padding
        k = sock.recv_into(view[: min(len(buf), left)])
        if k == 0:
            raise EOFError(f"transfer cut after {size - left} of {size} bytes")
        left -= k


class LimitedReader(io.RawIOBase):
    """Reads exactly ``n`` bytes from a socket, then EOF; raises EOFError when the peer goes early."""

    def __init__(self, sock: socket.socket, n: int):
        self.sock, self.left, self.total = sock, n, n

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if self.left <= 0:
            return 0
        view = memoryview(b)[: min(len(b), self.left)]
        k = self.sock.recv_into(view)
        if k == 0:
            raise EOFError(f"transfer cut after {self.total - self.left} of {self.total} bytes")
        self.left -= k
        return k
