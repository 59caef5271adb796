"""Every ZeroMQ connection of a job authenticated by the job's secret: CURVE on TCP, a checked password on ipc.

A job has one secret (``PARATRAIN_SECRET``, 32 random bytes that ``paratrain launch`` makes per job, or that the
user sets on every rank under torchrun or SLURM). Every key is derived from it, so ranks agree on them without
exchanging anything (:class:`JobKeys`):

* **TCP** (between hosts, and the rendezvous): ZeroMQ's CURVE. Every bound socket (PULL, ROUTER) is a CURVE
  server with the job's server key pair, every connecting socket (PUSH, DEALER) a CURVE client with the job's
  client key pair. A client must know the server's public key to even start the handshake, and the
  :class:`Guard` (this context's ZAP handler) accepts only the job's client keys. Without the secret a
  peer's handshake fails and nothing it sends is ever delivered. CURVE also encrypts and authenticates every
  message (XSalsa20-Poly1305), so an on-path attacker can neither read nor inject: a password alone (PLAIN) would
  cross the wire in clear and a hijacked TCP stream would carry unauthenticated frames after it.
* **ipc** (abstract unix sockets inside one host): ZeroMQ's PLAIN with a password the Guard checks. Abstract
  sockets have no file permissions (any process in the network namespace may connect), so ipc needs a check too,
  but the kernel carries the bytes: nobody without root reads or injects into a unix socket, so per-message
  cryptography would cost bandwidth and buy nothing. The password differs per endpoint (a keyed hash of the
  endpoint's name), so even a client tricked into connecting to an impostor (one that bound the abstract name of
  a dead rank) gives away only the password of that dead endpoint.
* **ranks**: a transport's links authenticate as their rank (:meth:`JobKeys.rank_client` on TCP, the user
  ``rank-R`` with a password for the endpoint and rank on ipc); its Guard (``ranks=``) accepts only those, and the
  rank becomes the connection's ``User-Id``, which ZeroMQ attaches to every message the connection delivers: the
  receiver drops a message whose sender field says otherwise. Every rank's credentials derive from the one secret,
  so this binds the peers that keep to their rank, not a malicious holder of the secret.
* **shared memory** (collectives inside a host) is unchanged: it carries no crypto, and its segments are created
  by ranks that met through the authenticated rendezvous.

Refusals (a handshake that failed or broke off: no secret, another job's secret, a forged greeting) are counted
and logged by the Guard, through :class:`RefusalLog`: the first at once, then at most one line per interval with
the count of those it held back, so that a flood of attempts cannot flood the log. (Bytes that are not even a
ZeroMQ greeting are dropped by ZeroMQ before any handshake, uncounted.)

What it costs (``paratrain bench auth``; ``benchmarks/recovery/auth.md``, 2 vCPUs, loopback, median of 7
interleaved rounds):

==================  ===========================  ==============================  ===================
link                4 KiB round trip             16 MiB one way                  connect
==================  ===========================  ==============================  ===================
TCP, CURVE          573 vs 574 us: no change     606 vs 1,926 MB/s: 0.27x        3.1 vs 1.3 ms
ipc, password       493 vs 506 us: no change     2,384 vs 2,325 MB/s: no change  1.1 vs 1.0 ms
==================  ===========================  ==============================  ===================

CURVE's price is bandwidth: ZeroMQ encrypts and decrypts in its I/O thread, one per connection on each side. A
1 Gbit/s link does not notice; on a faster network nothing else can reach, ``PARATRAIN_INSECURE=1`` buys the
bandwidth back, at the price of letting anyone who reaches a port in.

What this does not protect against: a process of the same user can read a rank's environment
(``/proc/PID/environ``) and so the secret, as it can read its memory; the secret keeps out other users, other
hosts and other jobs. A peer *with* the secret is trusted to authenticate, not to be correct: the transport still
validates every message (:mod:`.wire`) and never unpickles one.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

from paratrain.config import MIN_SECRET_BYTES
from paratrain.errors import ConfigError

__all__ = [
    "BROKEN_HANDSHAKE",
    "REFUSAL_EVENTS",
    "SECRET_BYTES",
    "Guard",
    "JobKeys",
    "RefusalLog",
    "new_secret",
    "refusal_reason",
]

log = logging.getLogger("paratrain.transport.auth")

#: Bytes of a secret made by :func:`new_secret` (``paratrain launch``).
SECRET_BYTES = 32
#: Socket-monitor events of a refused handshake (wrong mechanism, keys or credentials), on either side.
REFUSAL_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
#: ... and of a handshake that broke off (the other side hung up first). Both sides of a mechanism mismatch see
#: the mismatch, and whichever hangs up first leaves the other this event; a client with the wrong server key
#: sees only this. A peer dying mid-handshake looks the same, so a client does not take it as proof of a refusal
#: alone; a server counts it with the refusals (a connection that never authenticated).
BROKEN_HANDSHAKE = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_PLAIN_USER = b"paratrain"
_KDF_PREFIX = b"paratrain/auth/v1/"


#: Seconds a connection has to complete its handshake before a listener drops it.
HANDSHAKE_S = 4.0
#: Bytes a frame may exceed the wire's longest by: CURVE's MESSAGE command wraps each frame (nonce, flags, MAC).
_FRAMING_BYTES = 4096


def new_secret() -> bytes:
    """A fresh job secret: :data:`SECRET_BYTES` bytes from the OS's cryptographic generator."""
    return secrets.token_bytes(SECRET_BYTES)


def _derive(secret: bytes, label: bytes) -> bytes:
    """32 bytes of keyed BLAKE2b (a PRF) of ``label`` under ``secret``: independent keys for distinct labels."""
    key = secret if len(secret) <= 64 else hashlib.blake2b(secret).digest()
    return hashlib.blake2b(_KDF_PREFIX + label, key=key, digest_size=32).digest()


@dataclass(frozen=True, slots=True)
class JobKeys:
    """The job's keys, derived from its secret (every rank derives the same ones).

    Attributes:
        server_public: the CURVE public key of every bound TCP socket (Z85).
        server_secret: its secret key (Z85).
        client_public: the CURVE public key of every connecting TCP socket (Z85); the only one the Guard accepts.
        client_secret: its secret key (Z85).

    Example:
        >>> a, b = JobKeys.derive(b"k" * 32), JobKeys.derive(b"k" * 32)
        >>> a.client_public == b.client_public != JobKeys.derive(b"j" * 32).client_public
        True
    """

    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)
    _ipc_key: bytes = field(repr=False)
    _rank_key: bytes = field(repr=False)

    @classmethod
    def derive(cls, secret: bytes) -> JobKeys:
        """The keys of the job whose secret is ``secret``.

        Raises:
            ConfigError: the secret is too short, or this libzmq was built without CURVE.
        """
        if len(secret) < MIN_SECRET_BYTES:
            raise ConfigError(f"a job secret needs at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
        if not zmq.has("curve"):
            raise ConfigError(
                f"this libzmq ({zmq.zmq_version()}) was built without CURVE, so connections cannot be "
                "authenticated: install pyzmq's wheels (they bundle libsodium), or, on a network nothing else "
                "can reach, set PARATRAIN_INSECURE=1"
            )
        server_secret = z85.encode(_derive(secret, b"curve-server"))
        client_secret = z85.encode(_derive(secret, b"curve-client"))
        return cls(
            server_public=zmq.curve_public(server_secret),
            server_secret=server_secret,
            client_public=zmq.curve_public(client_secret),
            client_secret=client_secret,
            _ipc_key=_derive(secret, b"ipc-password"),
            _rank_key=_derive(secret, b"curve-rank-client"),
        )

    def ipc_password(self, endpoint: str, rank: int | None = None) -> bytes:
        """The PLAIN password of the ipc ``endpoint`` (differs per endpoint; see the module docstring), for the
        connections of ``rank`` (None: the rank-less password of older callers and tests)."""
        label = endpoint if rank is None else f"{endpoint}#rank-{rank}"
        return hashlib.blake2b(label.encode("utf-8"), key=self._ipc_key, digest_size=32).hexdigest().encode()

    def rank_client(self, rank: int) -> tuple[bytes, bytes]:
        """The CURVE key pair (public, secret; Z85) rank ``rank`` connects to its peers with: the Guard of a
        transport accepts only these, and tells the receiver which rank each connection authenticated as."""
        secret = z85.encode(hashlib.blake2b(f"rank-{rank}".encode(), key=self._rank_key, digest_size=32).digest())
        return zmq.curve_public(secret), secret

    @staticmethod
    def limit_strangers(sock: zmq.Socket[bytes], *, max_frame: int) -> None:
        """Bounds what a connection to the endpoints ``sock`` binds from now on may cost before it authenticates:
        a frame longer than ``max_frame`` (plus a mechanism's framing) cuts the connection off at its header, and
        a handshake not complete within :data:`HANDSHAKE_S` is dropped (ZeroMQ's default waits 30 s)."""
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame + _FRAMING_BYTES)
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))

    def serve_curve(self, sock: zmq.Socket[bytes], *, domain: str) -> None:
        """Makes the endpoints ``sock`` binds from now on CURVE servers, checked by the Guard under ``domain``.

        ZeroMQ copies a socket's options into each endpoint as it binds, so one socket may bind TCP as a CURVE
        server and then ipc with :meth:`serve_plain`.
        """
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())

    @staticmethod
    def serve_plain(sock: zmq.Socket[bytes], *, domain: str) -> None:
        """Makes the endpoints ``sock`` binds from now on PLAIN servers, checked by the Guard under ``domain``."""
        sock.setsockopt(zmq.PLAIN_SERVER, 1)
        sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())

    def authenticate_client(self, sock: zmq.Socket[bytes], address: str, *, rank: int | None = None) -> None:
        """Sets ``sock``'s credentials for connecting to ``address`` (CURVE on TCP, the password on ipc): as
        ``rank`` (a transport's links, whose receivers check every message's sender against it), or as a client
        of no rank (the rendezvous)."""
        if address.startswith("ipc://"):
            user = _PLAIN_USER if rank is None else f"rank-{rank}".encode()
            sock.setsockopt(zmq.PLAIN_USERNAME, user)
            sock.setsockopt(zmq.PLAIN_PASSWORD, self.ipc_password(address, rank))
            return
        public, secret = (self.client_public, self.client_secret) if rank is None else self.rank_client(rank)
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


def refusal_reason(event: int, value: int) -> str:
    """Why a handshake failed, in words, from a socket monitor's event and value."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"its credentials are not this job's (authentication refused, status {value})"
    if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "it does not use this job's security mechanism (no PARATRAIN_SECRET on one side?)"
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return "the handshake broke off (the peer closed or died mid-handshake, or lacks this job's PARATRAIN_SECRET)"
    if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return "it does not hold this job's keys (another PARATRAIN_SECRET?)"
    return f"its handshake broke the protocol (error {value:#x})"


class RefusalLog:
    """Logs refusals without letting a flood flood the log: the first at once, then one line per ``interval``.

    A held-back refusal is counted, and the next line says how many were; :meth:`flush` writes the count of those
    still held (the Guard calls it once ``interval`` has passed, and on close). Not thread-safe (one Guard thread).

    Example:
        >>> clock = iter([0.0, 1.0, 2.0, 11.0]).__next__
        >>> lines = []
        >>> refusals = RefusalLog(lines.append, interval=10.0, clock=clock)
        >>> for _ in range(4):
        ...     refusals.refused("refused x")
        >>> lines
        ['refused x', 'refused x (and 2 more refusals in the last 11s)']
    """

    def __init__(
        self,
        emit: Callable[[str], None],
        *,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        nouns: tuple[str, str] = ("refusals", "connections refused"),
    ) -> None:
        self._emit = emit
        self._nouns = nouns  # what the held-back lines were, in a line's tail and in flush()
        self.interval = interval
        self._clock = clock
        self._last: float | None = None
        self.held = 0

    def refused(self, text: str) -> None:
        """Records one refusal described by ``text``; writes it unless a line was written less than interval ago."""
        now = self._clock()
        if self._last is not None and now - self._last < self.interval:
            self.held += 1
            return
        if self.held and self._last is not None:
            text = f"{text} (and {self.held} more {self._nouns[0]} in the last {now - self._last:.0f}s)"
        self._emit(text)
        self._last, self.held = now, 0

    def due_in(self) -> float | None:
        """Seconds until held-back refusals should be reported (None: none held)."""
        if not self.held or self._last is None:
            return None
        return max(0.0, self._last + self.interval - self._clock())

    def flush(self, what: str) -> None:
        """Writes how many refusals are held back, if any (``what``: whose, e.g. ``rank 3``)."""
        if self.held and self._last is not None:
            self._emit(f"{what}: {self.held} more {self._nouns[1]} in the last {self._clock() - self._last:.0f}s")
            self._last, self.held = self._clock(), 0


class Guard:
    """The ZAP handler of one ZeroMQ context, and the monitor that counts and logs the refusals of its sockets.

    Create it before binding any server socket of ``ctx`` (ZeroMQ sends authentication requests to whatever
    handler the context has), :meth:`watch` the server sockets, :meth:`start`, and :meth:`close` it *after*
    closing them. It fails closed: requests it has not answered (before :meth:`start`, or if its thread died)
    hold the handshake until ZeroMQ gives up on it.

    Args:
        ctx: the context whose ZAP handler this is (one per context).
        keys: the job's keys (the client public key accepted on CURVE).
        name: who is guarded, for log lines (``rank 3``, ``rendezvous``).
        on_refused: called (in the Guard's thread) once per refused connection, e.g. to count it.
        log_interval: seconds between two refusal lines (see :class:`RefusalLog`).
        ranks: a transport's Guard: the job's world size now (called per request). Then only a rank's credentials
            are accepted (:meth:`JobKeys.rank_client`, the ``rank-R`` password on ipc), and the connection's
            ``User-Id`` (on every message it delivers) is that rank. None: the rank-less client (the rendezvous).

    Thread safety: :meth:`allow_plain`, :meth:`allow_ipc` and :meth:`watch` before :meth:`start`; :meth:`close`
    from any thread.
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        keys: JobKeys,
        *,
        name: str,
        on_refused: Callable[[], None] | None = None,
        log_interval: float = 10.0,
        ranks: Callable[[], int] | None = None,
    ) -> None:
        self.name = name
        self.refused = 0
        self._keys = keys
        self._ranks = ranks
        self._rank_keys: dict[bytes, int] = {}  # a rank's CURVE public key (raw) -> the rank (filled as needed)
        self._client_key = z85.decode(keys.client_public)
        self._passwords: dict[bytes, bytes] = {}
        self._ipc_endpoints: dict[bytes, str] = {}
        self._on_refused = on_refused
        self._log = RefusalLog(lambda line: log.warning("%s", line), interval=log_interval)
        self._last_denied = ""
        self._zap = ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(_ZAP_ENDPOINT)
        wake_addr = f"inproc://paratrain-guard-{id(self)}-{secrets.token_hex(4)}"
        self._wake_rx = ctx.socket(zmq.PAIR)
        self._wake_rx.bind(wake_addr)
        self._wake_tx = ctx.socket(zmq.PAIR)
        self._wake_tx.connect(wake_addr)
        self._monitors: list[zmq.Socket[bytes]] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self._close_lock = threading.Lock()

    def allow_plain(self, domain: str, password: bytes) -> None:
        """Accepts PLAIN connections under ``domain`` that give ``password``."""
        self._passwords[domain.encode()] = password

    def allow_ipc(self, domain: str, endpoint: str) -> None:
        """Accepts PLAIN connections under ``domain`` from a rank that gives its password for ``endpoint``."""
        self._ipc_endpoints[domain.encode()] = endpoint

    def watch(self, sock: zmq.Socket[bytes]) -> None:
        """Counts and logs the refused handshakes of server socket ``sock``."""
        self._monitors.append(sock.get_monitor_socket(REFUSAL_EVENTS | BROKEN_HANDSHAKE))

    def start(self) -> None:
        """Answers authentication requests in a daemon thread."""
        self._thread = threading.Thread(target=self._run, name=f"paratrain-guard-{self.name}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stops the thread, reports held-back refusals, releases the sockets (before the context's term)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._thread is not None:
            self._wake_tx.send(b"x")
            self._thread.join(timeout=10)
        self._log.flush(self.name)
        for sock in (*self._monitors, self._zap, self._wake_rx, self._wake_tx):
            sock.close(linger=0)

    # -- the thread ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in (self._wake_rx, self._zap, *self._monitors):
            poller.register(sock, zmq.POLLIN)
        try:
            while True:
                due = self._log.due_in()
                timeout_ms = 1000 if due is None else min(1000, int(due * 1000) + 1)
                events = dict(poller.poll(timeout_ms))
                if self._wake_rx in events:
                    return
                if self._zap in events:
                    self._answer(self._zap.recv_multipart())
                for mon in self._monitors:
                    if mon in events:
                        self._drain(mon)
                due = self._log.due_in()
                if due is not None and due <= 0:
                    self._log.flush(self.name)
        except Exception:  # stop answering: unanswered handshakes fail, so the guard fails closed
            log.exception("%s: the authentication thread failed; new connections will be refused", self.name)

    def _answer(self, request: list[bytes]) -> None:
        """Answers one ZAP request (RFC 27): 200 for the job's credentials, 400 for anything else."""
        if len(request) < 6:  # not from libzmq; a REP socket must answer before it can receive again
            self._zap.send_multipart([b"1.0", request[1] if len(request) > 1 else b"", b"500", b"malformed", b"", b""])
            return
        version, request_id, domain, address, _identity, mechanism, *credentials = request
        user = self._check(domain, mechanism, credentials)
        if user is None:
            peer = address.decode("utf-8", "replace")
            self._last_denied = f" (peer {peer}, {mechanism.decode('ascii', 'replace')})"
        status = (b"200", b"OK") if user is not None else (b"400", b"not this job's credentials")
        self._zap.send_multipart([version, request_id, *status, user or b"", b""])

    def _check(self, domain: bytes, mechanism: bytes, credentials: list[bytes]) -> bytes | None:
        """The User-Id of valid credentials (a rank's number, or ``paratrain`` for the rank-less client), else
        None."""
        if self._ranks is None:
            if mechanism == b"CURVE" and len(credentials) == 1:
                return b"paratrain" if hmac.compare_digest(credentials[0], self._client_key) else None
            if mechanism == b"PLAIN" and len(credentials) == 2 and domain in self._passwords:
                user, password = credentials
                ok = user == _PLAIN_USER and hmac.compare_digest(password, self._passwords[domain])
                return b"paratrain" if ok else None
            return None
        world = self._ranks()
        if mechanism == b"CURVE" and len(credentials) == 1:
            for rank in range(len(self._rank_keys), world):  # derived once per rank, as the job grows
                self._rank_keys[z85.decode(self._keys.rank_client(rank)[0])] = rank
            rank = self._rank_keys.get(credentials[0], world)
            return str(rank).encode() if rank < world else None
        endpoint = self._ipc_endpoints.get(domain)
        if mechanism != b"PLAIN" or len(credentials) != 2 or endpoint is None:
            return None
        user, password = credentials
        digits = user.removeprefix(b"rank-")
        if not (user.startswith(b"rank-") and digits.isdigit() and len(digits) <= 9 and int(digits) < world):
            return None
        expected = self._keys.ipc_password(endpoint, int(digits))
        return digits if hmac.compare_digest(password, expected) else None

    def _drain(self, mon: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = mon.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2 or len(frames[0]) != 6:
                continue
            event = int.from_bytes(frames[0][:2], "little")
            value = int.from_bytes(frames[0][2:], "little")
            if not event & (REFUSAL_EVENTS | BROKEN_HANDSHAKE):
                continue
            self.refused += 1
            if self._on_refused is not None:
                self._on_refused()
            endpoint = frames[1].decode("utf-8", "replace")
            detail = self._last_denied if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH else ""
            self._last_denied = ""
            self._log.refused(
                f"{self.name}: refused a connection to {endpoint}{detail}: {refusal_reason(event, value)}; "
                "nothing it sent was delivered"
            )
