"""A benchmark's probe, loaded into a daemon by ``PYTHONPATH`` (``scripts/bench_wire_kinds.py``), never by atoll.

With ``ATOLL_WIRE_PROBE`` set to a folder, counts the payload bytes of every p2p unary call this process makes
(hivemind's DHT RPCs ``rpc_find``, ``rpc_store``, ``rpc_ping``, and atoll's nudges): the request and the answer,
by RPC and by the kind of record the DHT operation that made it was for (``protocols.dht_io.key_kind`` of its
first key; "background" for hivemind's own: bucket refreshes, cache refreshes). Bytes are protobuf sizes, not
wire bytes: libp2p's framing and encryption and TCP/IP come on top. Each process writes
``<folder>/<pid>.json`` every 2 s and at exit.
"""

import os

_OUT = os.environ.get("ATOLL_WIRE_PROBE")

if _OUT:
    import atexit
    import contextvars
    import json
    import threading

    from hivemind.dht.node import DHTNode
    from hivemind.p2p import P2P

    _kind = contextvars.ContextVar("atoll_probe_kind", default="background")
    _counts: dict = {}
    _lock = threading.Lock()

    def _add(rpc, kind, sent, received):
        with _lock:
            c = _counts.setdefault(f"{rpc} {kind}", [0, 0, 0])
            c[0] += 1
            c[1] += sent
            c[2] += received

    def _with_kind(method):
        async def wrapped(self, keys, *args, **kwargs):
            # Imported here, not above: this file runs before ``python -m`` puts the working directory on the path,
            # and importing atoll now would take it from wherever it is installed, not from the checkout under test.
            from atoll.protocols.dht_io import key_kind

            keys = list(keys)
            token = _kind.set(key_kind(str(keys[0])) if keys else "none")
            try:
                return await method(self, keys, *args, **kwargs)
            finally:
                _kind.reset(token)
        return wrapped

    DHTNode.get_many = _with_kind(DHTNode.get_many)
    DHTNode.store_many = _with_kind(DHTNode.store_many)
    _call = P2P.call_protobuf_handler

    async def call_protobuf_handler(self, peer_id, name, input, output_protobuf_type):
        out = await _call(self, peer_id, name, input, output_protobuf_type)
        rpc = name.rsplit(".", 1)[-1]
        kind = "nudge" if rpc == "rpc_nudge" else _kind.get()
        _add(rpc, kind, input.ByteSize(), out.ByteSize() if hasattr(out, "ByteSize") else 0)
        return out

    P2P.call_protobuf_handler = call_protobuf_handler

    def _dump():
        with _lock:
            doc = {k: {"calls": c[0], "sent": c[1], "received": c[2]} for k, c in _counts.items()}
        if doc:
            os.makedirs(_OUT, exist_ok=True)
            path = os.path.join(_OUT, f"{os.getpid()}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(doc, f)
            os.replace(path + ".tmp", path)

    def _loop():
        import time
        while True:
            time.sleep(2.0)
            _dump()

    def _label_near():
        # In the DHT's process (forked once the daemon runs, so atoll now comes from the checkout under test):
        # atoll's small-swarm writes call the protocol directly, not through ``store_many``.
        try:
            from atoll.protocols import near
        except ImportError:
            return
        original = near.store_near

        async def store_near(key, *args, **kwargs):
            from atoll.protocols.dht_io import key_kind

            token = _kind.set(key_kind(str(key)))
            try:
                return await original(key, *args, **kwargs)
            finally:
                _kind.reset(token)

        near.store_near = store_near

    def _in_child():
        _counts.clear()
        _label_near()
        threading.Thread(target=_loop, daemon=True).start()

    threading.Thread(target=_loop, daemon=True).start()
    atexit.register(_dump)
    _fork_hook = getattr(os, "register_at_fork", None)
    if _fork_hook is not None:  # hivemind's DHT runs in a forked child: start its own writer there
        os.register_at_fork(after_in_child=_in_child)
