"""A bounded front for a torch ``TCPStore`` server: caps on connections, value sizes and stored bytes.

torch's TCPStore server (libuv backend, torch 2.13) accepts every connection and stores whatever
it is sent: it refuses only a single key over 8 KiB or a single value over 8 MiB, so anyone who
reaches its port can hold thousands of connections open or fill its memory with many values. It
has no option to bound either. So the public listening socket is served here instead: a process
of its own (selectors, one thread) accepts, counts, and forwards each connection's bytes to the
real server, which listens on a loopback port of the hosting process. A process, not a thread:
a TCPStore call of the hosting process that keeps the GIL while it waits for its answer
(``list_keys`` hung so behind a front thread) would stop the thread that forwards its request. This file imports no torch and
runs as a script (``store_auth.serve_bounded`` starts it, handing it the listening socket).

What it enforces (docs/security.md, "Someone who reaches the rendezvous port"):

- at most ``max_connections`` connections at once, and at most ``max_per_host`` from any one
  address (loopback included); a connection over a cap is closed as soon as it is accepted;
- it reads the client side of TCPStore's wire protocol (a command byte, then per command
  uint64-length-prefixed keys and values, native little-endian; ``TCPStoreLibUvBackend.cpp``,
  ``UvClient::processBuf``) without buffering values, and closes the connection before the
  server sees the request when a value is longer than ``max_value`` bytes, when the keys and
  values written through it would hold more than ``max_total`` bytes in all, or when a command
  is one it does not know (a newer torch: fail closed rather than forward what it cannot bound).

What it refuses it logs in a few lines, whatever the rate (:class:`RefusalLog`): the first
refusal after a quiet interval at once, then per interval (10 s) one line with the counts per
kind and address. One line per connection made a flood of the log itself: 2000 idle connections
gave 1750 lines (issue 55, item 4).

The total is counted conservatively: per key its length, ``ENTRY`` bytes and the last size set
under it (a compare-and-set counts as if it succeeded, appends and queue pushes add up, a delete
frees), plus every byte of the requests not complete yet (the server buffers a request until it
has all of it). Bytes written through the server's own client (``BoundedServer.server``, in the
hosting process, straight to the loopback port) are not counted.
"""

from __future__ import annotations

import argparse
import logging
import resource
import selectors
import signal
import socket
import sys
import time

log = logging.getLogger("paratrain")

# TCPStore's QueryType (torch/csrc/distributed/c10d/TCPStoreBackend.hpp, torch 2.13).
(VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY, APPEND, MULTI_GET, MULTI_SET) = range(12)
CANCEL_WAIT, PING, QUEUE_PUSH, QUEUE_POP, QUEUE_LEN, LIST_KEYS, BARRIER = range(12, 19)
MAX_KEY = 8 * 1024  # torch's own limit on a key (MAX_STRING_LEN)
MAX_KEYS = 128 * 1024  # torch's own limit on a multi-key request (MAX_KEY_COUNT)
ENTRY = 128  # what the server spends on a key beyond its bytes (hash node, string, vector), about

MAX_CONNECTIONS = 4096  # lowered to what the descriptor limit allows (two per connection)
MAX_PER_HOST = 256  # one node's processes all come from one address (127.0.0.1 on one node)
MAX_VALUE = 1 << 20
MAX_TOTAL = 64 << 20
LOG_INTERVAL_S = 10  # refusals are summarised per this many seconds
LOG_ADDRESSES = 5  # addresses named per kind in a summary line; the rest are counted


class Refused(Exception):
    """A request over a bound: its connection is closed before the server sees it.

    ``kind`` names the bound without the figures of this request: refusals are counted per kind."""

    def __init__(self, detail: str, kind: str):
        super().__init__(detail)
        self.kind = kind


class RefusalLog:
    """Refused and closed connections as a few lines: the first after a quiet ``interval`` at once
    (with its detail), the others counted per (kind, address) and said in one line per interval."""

    def __init__(self, interval: float = LOG_INTERVAL_S):
        self.interval = interval
        self.counts: dict[tuple[str, str], int] = {}
        self.since = self.until = 0.0  # the interval being counted: [since, until)

    def note(self, line: str, kind: str, host: str) -> None:
        now = time.monotonic()
        if not self.counts and now >= self.until:
            log.warning("%s", line)
            self.since, self.until = now, now + self.interval
            return
        self.counts[(kind, host)] = self.counts.get((kind, host), 0) + 1

    def wait_s(self) -> float | None:
        """How long the front may wait for an event before :meth:`flush` is due (None: no count pending)."""
        return max(0.0, self.until - time.monotonic()) if self.counts else None

    def flush(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.counts or (now < self.until and not force):
            return
        kinds: dict[str, list[tuple[int, str]]] = {}
        for (kind, host), n in self.counts.items():
            kinds.setdefault(kind, []).append((n, host))
        parts = []
        for kind, hosts in sorted(kinds.items()):
            hosts.sort(key=lambda item: (-item[0], item[1]))
            named = ", ".join(f"{host} x{n}" for n, host in hosts[:LOG_ADDRESSES])
            rest = hosts[LOG_ADDRESSES:]
            more = f", {len(rest)} more addresses x{sum(n for n, _ in rest)}" if rest else ""
            parts.append(f"{kind}: {named}{more}")
        log.warning(
            "paratrain: refused or closed %d more store connections in the last %.1f s (%s)",
            sum(self.counts.values()),
            now - self.since,
            "; ".join(parts),
        )
        self.counts.clear()
        self.since, self.until = now, now + self.interval


def _u64():
    raw = yield 8, True
    return int.from_bytes(raw, "little")


def _key():
    n = yield from _u64()
    if n > MAX_KEY:
        raise Refused(f"a key of {n} bytes", f"a key over {MAX_KEY} bytes")
    return (yield n, True) if n else b""


def _length(limit: int):
    n = yield from _u64()
    if n > limit:
        raise Refused(f"a value of {n} bytes (at most {limit})", f"a value over {limit} bytes")
    return n


def _count():
    n = yield from _u64()
    if n > MAX_KEYS:
        raise Refused(f"{n} keys in one request", f"over {MAX_KEYS} keys in one request")
    return n


class _Parser:
    """One connection's requests, fed its bytes as they arrive; ``feed`` raises Refused."""

    def __init__(self, front: StoreFront):
        self.front = front
        self.pending = 0  # bytes of the current request: the server buffers them until it is complete
        self.steps = self._requests()
        self.want, self.keep, self.buf = *next(self.steps), b""

    def feed(self, data: bytes) -> None:
        i = 0
        while i < len(data):
            take = min(self.want - len(self.buf) if self.keep else self.want, len(data) - i)
            if self.keep:  # a command byte, a length, a key (a value's bytes were counted at its header)
                self._spend(take)
                self.buf += data[i : i + take]
                if len(self.buf) < self.want:
                    return
                got, self.buf = self.buf, b""
            else:
                self.want -= take
                if self.want:
                    return
                got = None
            i += take
            self.want, self.keep = self.steps.send(got)

    def _within(self, total: int, n: int) -> None:
        """Refused if the store would hold more than ``max_total`` (``total`` counted, ``n`` more in flight)."""
        if total + self.front.inflight + n > self.front.max_total:
            raise Refused(f"the store would hold more than {self.front.max_total} bytes", "the store's byte budget")

    def _spend(self, n: int) -> None:
        self._within(self.front.total, n)
        self.pending += n
        self.front.inflight += n

    def release(self) -> None:
        """The current request is complete (or its connection closed): its bytes left the buffer."""
        self.front.inflight -= self.pending
        self.pending = 0

    def _hold(self, key: bytes, n: int, how: str = "set") -> None:
        """Count ``key`` as holding ``n`` bytes (``set``), ``n`` more (``add``) or at least ``n`` (``max``),
        the ``n`` bytes about to arrive as in flight too; refused if that makes more than ``max_total``."""
        front, old = self.front, self.front.sizes.get(key)
        new = {"set": n, "add": (old or 0) + n, "max": max(n, old or 0)}[how]
        total = front.total + new + len(key) + ENTRY - (0 if old is None else old + len(key) + ENTRY)
        self._within(total, n)
        front.total, front.sizes[key] = total, new
        self._spend(n)

    def _stored(self, key: bytes, how: str = "set"):
        n = yield from _length(self.front.max_value)
        self._hold(key, n, how)  # at the header: refused before the value's bytes reach the server
        if n:
            yield n, False

    def _skip_value(self):
        n = yield from _length(self.front.max_value)
        self._spend(n)
        if n:
            yield n, False

    def _requests(self):
        while True:
            self.release()  # what came before this command byte was a complete request
            cmd = (yield 1, True)[0]
            if cmd in (VALIDATE, PING):
                yield 4, False
            elif cmd in (SET, APPEND):
                yield from self._stored((yield from _key()), "add" if cmd == APPEND else "set")
            elif cmd == QUEUE_PUSH:  # popped values are not seen here: pushes only add up
                yield from self._stored(b"queue\0" + (yield from _key()), "add")
            elif cmd == COMPARE_SET:
                key = yield from _key()
                yield from self._skip_value()
                yield from self._stored(key, "max")  # counted as if it succeeded
            elif cmd == MULTI_SET:
                for _ in range((yield from _count())):
                    yield from self._stored((yield from _key()))
            elif cmd in (ADD, BARRIER):  # the server stores the counter as decimal text
                key = yield from _key()
                yield 8, False
                self._hold(key, 20, "max")  # on a key that is not a number it fails: the value stays
            elif cmd == DELETE_KEY:
                key = yield from _key()
                old = self.front.sizes.pop(key, None)
                self.front.total -= 0 if old is None else old + len(key) + ENTRY
            elif cmd in (GET, QUEUE_POP, QUEUE_LEN):
                yield from _key()
            elif cmd in (CHECK, WAIT, MULTI_GET):
                for _ in range((yield from _count())):
                    yield from _key()
            elif cmd not in (GETNUMKEYS, CANCEL_WAIT, LIST_KEYS):
                raise Refused(f"an unknown command {cmd}", "an unknown command")


class StoreFront:
    """Serves the public socket ``listener``: forwards each connection to ``backend`` (host, port)."""

    def __init__(
        self,
        listener: socket.socket,
        backend: tuple[str, int],
        *,
        max_connections: int = MAX_CONNECTIONS,
        max_per_host: int = MAX_PER_HOST,
        max_value: int = MAX_VALUE,
        max_total: int = MAX_TOTAL,
        log_interval_s: float = LOG_INTERVAL_S,
    ):
        self.listener, self.backend_addr = listener, backend
        self.refusals = RefusalLog(log_interval_s)
        self.max_connections, self.max_per_host = max_connections, max_per_host
        self.max_value, self.max_total = max_value, max_total
        self.sizes: dict[bytes, int] = {}  # key -> bytes its value holds, as counted
        self.total = 0  # sum of sizes, keys and ENTRY per key
        self.inflight = 0  # bytes of requests not complete yet, on every connection
        self.per_host: dict[str, int] = {}
        self._peer: dict[socket.socket, socket.socket] = {}
        self._out: dict[socket.socket, bytearray] = {}
        self._parser: dict[socket.socket, _Parser] = {}  # client side only
        self._host: dict[socket.socket, str] = {}
        self._sel = selectors.DefaultSelector()
        listener.setblocking(False)
        self._sel.register(listener, selectors.EVENT_READ)

    def run(self, parent) -> None:
        """Serve until ``parent`` (the read end of a pipe from the hosting process) reaches EOF."""
        self._sel.register(parent, selectors.EVENT_READ)
        try:
            while True:
                events_now = self._sel.select(self.refusals.wait_s())
                self.refusals.flush()
                for key, events in events_now:
                    sock = key.fileobj
                    if sock is parent:
                        return  # the hosting process (and its server) is gone
                    if sock is self.listener:
                        self._accept()
                    elif sock in self._peer:  # not closed by an earlier event of this round
                        if events & selectors.EVENT_WRITE:
                            self._flush(sock)
                        if events & selectors.EVENT_READ and sock in self._peer:
                            self._read(sock)
        finally:
            self.refusals.flush(force=True)  # what was counted since the last line
            for sock in [*self._peer, self.listener]:
                sock.close()

    def _accept(self) -> None:
        try:
            client, addr = self.listener.accept()
        except OSError:  # e.g. out of descriptors: the connection waits in the backlog
            time.sleep(0.05)  # the listener stays readable: do not spin
            return
        host = addr[0]
        if len(self._parser) >= self.max_connections or self.per_host.get(host, 0) >= self.max_per_host:
            line = f"paratrain: refused a store connection from {host}: over the connection cap"
            self.refusals.note(line, "over the connection cap", host)
            client.close()
            return
        try:
            backend = socket.create_connection(self.backend_addr, timeout=5)
        except OSError:
            client.close()
            return
        for s in (client, backend):
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._out[s] = bytearray()
        self._peer[client], self._peer[backend] = backend, client
        self._parser[client] = _Parser(self)
        self._host[client] = host
        self.per_host[host] = self.per_host.get(host, 0) + 1
        self._sel.register(client, selectors.EVENT_READ)
        self._sel.register(backend, selectors.EVENT_READ)

    def _read(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            return self._close(sock)
        parser = self._parser.get(sock)
        if parser is not None:
            try:
                parser.feed(data)
            except Refused as e:
                host = self._host[sock]
                self.refusals.note(f"paratrain: closed a store connection from {host}: {e}", e.kind, host)
                return self._close(sock)
        peer = self._peer[sock]
        self._out[peer] += data
        self._flush(peer)

    def _flush(self, sock: socket.socket) -> None:
        out = self._out[sock]
        try:
            if out:
                del out[: sock.send(out)]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            return self._close(sock)
        self._watch(sock)
        self._watch(self._peer[sock])

    def _watch(self, sock: socket.socket) -> None:
        """Write to ``sock`` while bytes wait for it; read it only while none wait for its peer
        (back-pressure: a peer that does not read cannot make the front buffer without bound)."""
        mask = (0 if self._out[self._peer[sock]] else selectors.EVENT_READ) | (
            selectors.EVENT_WRITE if self._out[sock] else 0
        )
        if sock not in self._sel.get_map():
            if mask:
                self._sel.register(sock, mask)
        elif mask:
            self._sel.modify(sock, mask)
        else:
            self._sel.unregister(sock)

    def _close(self, sock: socket.socket) -> None:
        peer = self._peer.pop(sock)
        del self._peer[peer]
        for s in (sock, peer):
            if s in self._sel.get_map():
                self._sel.unregister(s)
            self._out.pop(s)
            parser = self._parser.pop(s, None)
            if parser is not None:
                parser.release()
            host = self._host.pop(s, None)
            if host is not None:
                self.per_host[host] -= 1
                if not self.per_host[host]:
                    del self.per_host[host]
            s.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("listen_fd", type=int)
    p.add_argument("backend_port", type=int)
    for name, default in [
        ("max-connections", MAX_CONNECTIONS),
        ("max-per-host", MAX_PER_HOST),
        ("max-value", MAX_VALUE),
        ("max-total", MAX_TOTAL),
        ("log-interval-s", LOG_INTERVAL_S),
    ]:
        p.add_argument("--" + name, type=int, default=default)
    a = p.parse_args(argv)
    # The front lives exactly as long as the process that hosts its server (run's EOF): a Ctrl-C
    # or a SIGTERM to the whole process group (Slurm, a launcher) must not end it while that
    # process still writes its last values (torch elastic closes the rendezvous on the way out).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:  # a front needs two descriptors per connection: take what the system allows
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    except (ValueError, OSError):
        pass
    logging.basicConfig(format="%(message)s", stream=sys.stderr)
    listener = socket.socket(fileno=a.listen_fd)
    front = StoreFront(
        listener,
        ("127.0.0.1", a.backend_port),
        max_connections=min(a.max_connections, (soft - 32) // 2),
        max_per_host=a.max_per_host,
        max_value=a.max_value,
        max_total=a.max_total,
        log_interval_s=a.log_interval_s,
    )
    front.run(sys.stdin)


if __name__ == "__main__":
    main()
