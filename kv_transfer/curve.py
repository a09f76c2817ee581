"""Authenticated, encrypted zmq sockets: CURVE with one key pair per cluster.

The key pair is made once per cluster (`CurveKeys.generate()`, at `tandem serve`) and reaches every
worker and client through Ray, whose own channel is token-authenticated. Every data-plane socket (KV
receivers and senders, token sinks and publishers) uses it both ways: a binding socket is a CURVE
server with the cluster's secret key, a connecting socket proves that it holds the same secret. The
one ZAP handler of each zmq context admits only clients whose public key is the cluster's, so a peer
without the secret can neither read the traffic nor get a single message delivered: its handshake
fails before any frame reaches the receiving loop. The rejected handshakes are counted.

Sharing one pair between servers and clients is deliberate: every process that may send may also
receive, and a per-socket pair would be handed to exactly the same processes.

Every binding socket goes through `secure_server`, with keys or without, so every port also bounds its
handshakes: a peer that connects and never finishes one (raw TCP, or a key the ZAP check refuses) holds a
descriptor of the receiving process for `HANDSHAKE_TIMEOUT_S`, not zmq's default 30 s. zmq has no cap on
a listening socket's connections, so what a stranger can hold is its connection rate times this bound.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import zmq
import zmq.auth.thread

# Honest peers finish the handshake (greeting, CURVE hello/initiate, the ZAP check) in milliseconds; one that
# misses it is dropped, and a connecting zmq socket simply reconnects. zmq's default, 30 s, let 4,000 idle
# connections per port take 4,000 descriptors of the target for half a minute each (issue 52).
HANDSHAKE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class CurveKeys:
    public: bytes  # z85-encoded, 40 bytes
    secret: bytes

    @classmethod
    def generate(cls) -> CurveKeys:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    def __repr__(self) -> str:  # the secret never reaches a log line or an error message
        return f"CurveKeys(public={self.public.decode()!r}, secret=<redacted>)"


def secure_server(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """Make a socket that binds accept only holders of `keys`; None leaves it open (plain NULL). Either way
    a peer gets `HANDSHAKE_TIMEOUT_S` to finish its handshake; before bind."""
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_TIMEOUT_S * 1000))
    if keys is None:
        return
    _gate(sock.context).allow(keys.public)
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def secure_client(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """Make a socket that connects present `keys` and expect a server holding them; before connect."""
    if keys is None:
        return
    sock.curve_serverkey = keys.public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret


def rejected_handshakes(context: zmq.Context | None = None) -> int:
    """CURVE handshakes this context's servers refused (a client key that is not a cluster's)."""
    gate = _gates.get((context or zmq.Context.instance()).underlying)
    return 0 if gate is None else gate.rejected


class _Gate:
    """The ZAP credentials check of one context: the public keys of the clusters it serves."""

    def __init__(self, context: zmq.Context):
        self._allowed: set[bytes] = set()
        self._lock = threading.Lock()
        self.rejected = 0
        # A plain context over the same one: an asyncio context's sockets share its one ZAP handler.
        self._authenticator = zmq.auth.thread.ThreadAuthenticator(zmq.Context.shadow(context.underlying))
        self._authenticator.start()
        self._authenticator.configure_curve_callback("*", credentials_provider=self)

    def allow(self, public: bytes) -> None:
        with self._lock:
            self._allowed.add(public)

    def callback(self, domain: str, client_key: bytes) -> bool:  # called by the ZAP thread
        with self._lock:
            ok = client_key in self._allowed
            self.rejected += not ok
        return ok


_gates: dict[int, _Gate] = {}  # a context's ZAP endpoint takes one handler (keyed by the C context)
_gates_lock = threading.Lock()


def _gate(context: zmq.Context) -> _Gate:
    with _gates_lock:
        gate = _gates.get(context.underlying)
        if gate is None:
            gate = _gates[context.underlying] = _Gate(context)
        return gate
