"""The agent's wire protocol, one module per concern: :mod:`.messages` (control messages),
:mod:`.auth` (token, mutual challenge-response), :mod:`.tls` (certificates, contexts),
:mod:`.accept` and :mod:`.connect` (the server's and the client's side of a connection, which
may connect from another network namespace: :func:`gym_fork.backends.netns.in_netns`),
:mod:`.streams` (image files sent while CRIU writes them) and :mod:`.relay` (a worker's channel
over the connection).

One TLS connection (plain TCP only where both sides say ``insecure``) per migration; ``B`` is
the sha256 of the server's certificate (:mod:`.tls`; absent on plain TCP)::

    agent  -> client   {"hello": "gym_fork-agent", "v": 1, "node": NAME, "nonce": A}
    client -> agent    {"nonce": C, "mac": HMAC(token, "client|A|C|B")}
    agent  -> client   {"ok": true, "mac": HMAC(token, "agent|C|A|B")}   (mutual: the client checks it)
    client -> agent    {"op": "env" | "job" | "ping", "stream": 3, "size": LIMIT, "hash": ALG, ...}
    agent  -> client   {"ok": true, "ready": true}  or an error (e.g. not enough disk space)
    client -> agent    OPEN / DATA / DONE frames: the image files, as CRIU writes them
    client -> agent    the signed metadata (bundle.json or the job's), its "images" = the digests sent
    agent  -> client   {"ok": true, ...} or {"ok": false, "error": TYPE, "message": ...}
    ("env" only)       from here on the connection carries the env worker's own channel bytes
"""
