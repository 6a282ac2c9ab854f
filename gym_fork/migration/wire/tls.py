"""TLS for every connection to an agent (or a plugin's host), on unless a side says ``insecure``.

The agent needs no certificate from anyone: without ``--cert/--key`` it makes a fresh
self-signed one when it starts. Clients do not have to trust it through a CA: the token
challenge-response (:mod:`.auth`) covers the *channel binding* -- the sha256 of the server's
certificate as each side sees it, as in RFC 5929's ``tls-server-end-point`` -- in both
directions. So:

- a relay that passes TLS through can neither read nor change a byte (TLS's own integrity);
- a relay that ends TLS itself shows the client its own certificate, the two bindings differ,
  and both sides' proofs fail: it cannot complete the handshake without the token, and what it
  learns (one MAC each way) is as useful to it as on any failed login.

A CA (``tls=True`` or a CA file on the client) is checked on top, when given.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import ssl
from dataclasses import dataclass

BINDING = "tls-server-end-point"


def binding_of(der: bytes) -> str:
    """The channel binding of a server certificate (DER bytes)."""
    return f"{BINDING}:{hashlib.sha256(der).hexdigest()}"


def fingerprint_of(der: bytes) -> str:
    """``AB:CD:...``: the certificate's sha256, as ``openssl x509 -fingerprint -sha256`` prints it."""
    return ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())


def generate_certificate(name: str) -> tuple[bytes, bytes]:
    """A fresh self-signed certificate for ``name`` and its private key (ECDSA P-256), both PEM."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name[:64] or "gym-fork agent")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=3650))
            .sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def _leaf_der(pem: bytes) -> bytes:
    """The first certificate of a PEM chain (the one the server sends first), as DER."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    certs = x509.load_pem_x509_certificates(pem)
    return certs[0].public_bytes(serialization.Encoding.DER)


@dataclass
class ServerTLS:
    """A listener's TLS: its context and the binding clients will see.

    Attributes:
        context: wraps accepted sockets (``server_side=True``).
        binding: :func:`binding_of` the certificate it presents.
        fingerprint: the certificate's sha256, for people (printed by ``gym-fork agent``).
        generated: the certificate was made at start (no ``--cert``).
    """

    context: ssl.SSLContext
    binding: str
    fingerprint: str
    generated: bool


def server_tls(cert: str | None = None, key: str | None = None, *, name: str = "gym-fork agent") -> ServerTLS:
    """The TLS of a listener: ``cert``/``key`` (PEM files) when given, else a certificate made now.

    A generated key never touches a file system: it is loaded from an anonymous memory file.

    Raises:
        ValueError: only one of ``cert``/``key``.
        OSError, ssl.SSLError: the files cannot be read or do not match.
    """
    if bool(cert) != bool(key):
        raise ValueError("TLS needs both a certificate and its key (--cert and --key)")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert:
        ctx.load_cert_chain(cert, key)
        with open(cert, "rb") as f:
            der = _leaf_der(f.read())
        generated = False
    else:
        cert_pem, key_pem = generate_certificate(name)
        fds = [os.memfd_create("gym_fork-cert"), os.memfd_create("gym_fork-key")]
        try:
            for fd, data in zip(fds, (cert_pem, key_pem)):
                os.write(fd, data)
            ctx.load_cert_chain(f"/proc/self/fd/{fds[0]}", f"/proc/self/fd/{fds[1]}")
        finally:
            for fd in fds:
                os.close(fd)
        der = _leaf_der(cert_pem)
        generated = True
    return ServerTLS(ctx, binding_of(der), fingerprint_of(der), generated)


def client_context(verify: bool | str = False) -> ssl.SSLContext:
    """A client's TLS context.

    Args:
        verify: False: the certificate is checked by the token handshake's channel binding only
            (the default: agents make their own); True: also against the system CAs, with the
            host name; a path: also against that CA (or pinned certificate) file, without the
            host name (whoever holds that certificate's key is the agent).
    """
    if verify:
        ctx = ssl.create_default_context(cafile=verify if isinstance(verify, str) else None)
        if isinstance(verify, str):
            ctx.check_hostname = False
    else:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # the handshake's binding authenticates the certificate
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def peer_binding(sock: ssl.SSLSocket) -> str:
    """The binding of the certificate the server presented on ``sock`` (client side).

    Raises:
        ssl.SSLError: the server presented none.
    """
    der = sock.getpeercert(binary_form=True)
    if not der:
        raise ssl.SSLError("the server presented no certificate")
    return binding_of(der)
