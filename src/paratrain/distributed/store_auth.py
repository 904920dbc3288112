"""The job secret, HMAC-signed store values, and listening sockets bound to one address.

A torch ``TCPStore`` has no authentication: anyone who reaches its port can read and write
every key. paratrain therefore signs every value it (or its rendezvous backend) reads back
with HMAC-SHA256 under a per-job secret, and decodes only JSON after the signature checks
out, so a value written by a peer without the secret is refused, never interpreted as code.

The secret: one node generates it (:func:`new_secret`, handed to the agent in-process and to
its workers in ``PARATRAIN_JOB_SECRET``); several nodes share one delivered by the scheduler,
in ``PARATRAIN_JOB_SECRET`` or a file (``--job-secret-file``; a Kubernetes secret volume, a
Slurm-prolog file readable only by the user).

Binding: ``TCPStore(..., is_master=True)`` listens on every interface whatever host it is
given (libuv backend, torch 2.13); given ``master_listen_fd`` it serves on a socket we bound
ourselves, which is the one knob that limits it to an address (:func:`listen_socket`). The socket
we bind is served by a bounded front (store_front.py), the server itself listens on loopback.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import socket
import struct
import subprocess
import sys
from datetime import timedelta

import torch.distributed as dist

from paratrain.config import ConfigError
from paratrain.distributed import store_front

SECRET_ENV = "PARATRAIN_JOB_SECRET"
BIND_ENV = "PARATRAIN_BIND_ADDR"  # the launcher tells its workers what to listen on


class TamperedValue(ValueError):
    """A store value whose HMAC does not match: written without the job secret."""


def new_secret() -> str:
    return secrets.token_hex(32)


def load_secret(secret_file: str = "", *, required: bool, env: dict | None = None) -> str | None:
    """The job secret from ``secret_file`` or ``$PARATRAIN_JOB_SECRET``; None when neither and not required."""
    env = os.environ if env is None else env
    if secret_file:
        try:
            with open(secret_file, encoding="utf-8") as f:
                value = f.read().strip()
        except OSError as e:
            raise ConfigError(f"--job-secret-file {secret_file}: {e.strerror}; pass a readable file") from None
        if not value:
            raise ConfigError(f"--job-secret-file {secret_file} is empty; write the job secret into it")
        return value
    value = env.get(SECRET_ENV, "").strip()
    if value:
        return value
    if required:
        raise ConfigError(
            f"a job on several nodes needs one secret shared by every node: export {SECRET_ENV}"
            " (e.g. from the scheduler) or pass --job-secret-file FILE"
        )
    return None


def _mac(secret: str, key: str, body: str) -> str:
    # The key is part of the signed text, so a valid value cannot be replayed under another key.
    return hmac.new(secret.encode(), key.encode() + b"\0" + body.encode(), hashlib.sha256).hexdigest()


def sign(secret: str, key: str, obj) -> str:
    """``obj`` as JSON, prefixed by its HMAC-SHA256 under ``secret`` and ``key``."""
    body = json.dumps(obj, separators=(",", ":"), sort_keys=True)
    return _mac(secret, key, body) + ":" + body


def verify(secret: str, key: str, value: bytes | str):
    """The JSON object in a value made by :func:`sign`; TamperedValue if the signature does not match."""
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    mac, sep, body = text.partition(":")
    if not sep or not hmac.compare_digest(mac.encode(), _mac(secret, key, body).encode()):
        raise TamperedValue(f"the value under key {key!r} fails the job-secret check")
    return json.loads(body)


def signed_set(store: dist.Store, secret: str, key: str, obj) -> None:
    store.set(key, sign(secret, key, obj))


def signed_get(store: dist.Store, secret: str, key: str):
    return verify(secret, key, store.get(key))


# --- where to listen ---------------------------------------------------------------------------


def resolve(host: str) -> str:
    """The numeric address of ``host`` (the first one the resolver gives)."""
    return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]


def is_loopback(addr: str) -> bool:
    return ipaddress.ip_address(addr.split("%")[0]).is_loopback


def route_source(peer: str) -> str:
    """The local address the kernel would use to reach ``peer`` (no packet is sent)."""
    addr = resolve(peer)
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((addr, 9))
        return s.getsockname()[0]


def interface_of(addr: str) -> str | None:
    """The network interface that carries IPv4 address ``addr`` (for GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME)."""
    if is_loopback(addr):
        return "lo"
    siocgifaddr = 0x8915  # linux/sockios.h
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == addr:
                return name
    return None


def listen_socket(addr: str, port: int) -> socket.socket:
    """A TCP socket listening on ``addr:port`` only (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def bound_tcp_store(
    host: str, port: int, *, bind_addr: str, timeout: timedelta, world_size: int | None = None, front: bool = False
) -> dist.TCPStore:
    """A TCPStore server on ``bind_addr:port`` only (see the module docstring for why the fd).

    ``front``: behind a bounded front (the rendezvous store, which only the nodes' agents use);
    the server then listens on a loopback port and the returned store is a client connected
    through the front, so its ``port`` is the public one. The front and the server live as long
    as the process (``_FRONTS``): C++ holders of the client (a PrefixStore) outlive its Python
    object, so nothing tells when the last user is gone. The job's store, which every worker
    uses, has no front: its connections and torch's bootstrap bytes grow with the world size
    (gloo's full mesh writes O(world) bytes per rank and group), so fixed caps would break a
    large job (docs/security.md, "Bounds").
    """
    if front:
        server = serve_bounded(bind_addr, port, timeout, world_size)
        _FRONTS.append(server)
        return dist.TCPStore(host, server.port, world_size, False, timeout, wait_for_workers=False)
    sock = listen_socket(bind_addr, port)
    port = sock.getsockname()[1]
    # The store's event loop takes the descriptor over (uv_tcp_open) and closes it itself.
    fd = sock.detach()
    try:
        return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=fd, multi_tenant=True)
    except BaseException:
        os.close(fd)
        raise


class BoundedServer:
    """A TCPStore server on loopback, and the front process that serves the public socket for it."""

    def __init__(self, listener: socket.socket, timeout: timedelta, world_size: int | None = None, **limits: int):
        self.port = listener.getsockname()[1]
        back = listen_socket("127.0.0.1", 0)  # connections queue here until the server takes it over
        args = [f"--{k.replace('_', '-')}={v}" for k, v in limits.items()]
        # stdin: a pipe whose end tells the front this process (and so the server) is gone.
        self.front = subprocess.Popen(
            [sys.executable, store_front.__file__, str(listener.fileno()), str(back.getsockname()[1]), *args],
            stdin=subprocess.PIPE,
            pass_fds=[listener.fileno()],
        )
        fd = back.detach()
        try:  # a server given world_size waits here for the workers, who connect through the front
            self.server = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout, master_listen_fd=fd)
        except BaseException:
            os.close(fd)
            self.close()
            raise

    def close(self) -> None:
        if self.front.poll() is None:
            self.front.stdin.close()
            self.front.wait(timeout=10)


_FRONTS: list[BoundedServer] = []  # kept alive for the process's life (see bound_tcp_store)


def serve_bounded(bind_addr: str, port: int, timeout: timedelta, world_size: int | None = None, **limits: int):
    """A :class:`BoundedServer` on ``bind_addr:port`` (port 0: a free one); ``limits`` as store_front's options."""
    listener = listen_socket(bind_addr, port)
    try:
        return BoundedServer(listener, timeout, world_size, **limits)
    finally:
        listener.close()  # the front process holds its own copy
