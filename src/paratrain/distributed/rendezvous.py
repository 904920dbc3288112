"""The ``paratrain`` rendezvous backend for torch elastic: JSON state, HMAC-signed, bound stores.

torch elastic's c10d backend keeps the rendezvous state as a base64 *pickle* in the agent's
TCPStore and every agent unpickles it on each sync (keep-alive every 5 s): whoever reaches the
store's port, which listens on all interfaces even for ``--standalone``, runs code as the user
(``torch/distributed/elastic/rendezvous/dynamic_rendezvous.py``, ``_BackendRendezvousStateHolder.sync``).

This backend keeps the same protocol (torch's ``DynamicRendezvousHandler`` and its op
executor, unchanged) and changes what travels: the state's fields as JSON, signed with
HMAC-SHA256 under the job secret (:mod:`paratrain.distributed.store_auth`). A value that fails
the check is refused: a node that has never verified a state (wrong secret, or a store written
by someone else first) stops with one line; a node of a running job logs one line and keeps its
last verified state, so its next write replaces the forged value. The only pickle left is the
one torch's state holder applies to bytes this backend itself made from verified JSON
(``RendezvousBackend`` trades in pickled bytes); the bytes it is handed come from this process
and still go through an unpickler that admits only the state's classes.

Every value is bound to its launch: each state names its nodes by descriptors unique to their
launch (a random ``local_id``), each complete round carries a key drawn when it completed, and
torch's own values under that round are signed with it (:class:`SignedStore`): a value signed in
an earlier launch of the same job, same secret and same round number, is refused.

Stores bind to one address (``store_auth.bound_tcp_store``): the rendezvous store to the
endpoint's address, the store the workers share (``TORCHELASTIC_USE_AGENT_STORE``) to the
node's ``local_addr``, which the launcher sets to 127.0.0.1 for one node.

Who hosts the rendezvous store (``_create_store``): ``is_host`` in ``--rdzv-conf`` decides when
given (``paratrain train`` passes ``is_host=false`` to every node with ``--node-rank`` > 0);
otherwise the node whose machine has the endpoint's address. ``is_host=false`` on every node
and :func:`serve` (``paratrain rendezvous serve``) somewhere: no training node hosts it, so the
loss of any of them is survived by an elastic job.

A client reconnects (``ParatrainRendezvousBackend._call``): a TCPStore client does not, and
its connection to a restarted server stays broken. A restarted server holds nothing: the first
node to reconnect writes back the last state it verified (signed, so every node accepts it),
and the job goes on. While the store is unreachable, a running job trains on (no new node can
join: ``num_nodes_waiting`` answers 0), and a node that needs a new round retries until
``join_timeout``, then stops with one line.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import os
import pickle
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta


def handler_creator():
    """The ``torchrun.handlers`` entry point: torch elastic calls it for the creator to register.

    Defined above the torch imports: importing torch's rendezvous package loads the entry points,
    this one included, while this module is still being imported (when it is imported first, as
    by ``paratrain rendezvous serve``); so it must exist by then, and the creator it returns looks
    ``create_handler`` up only when called.
    """
    return lambda params: create_handler(params)


import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousTimeout,
    Token,
    _NodeDesc,
    _RendezvousState,
)
from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname, parse_rendezvous_endpoint

from paratrain.config import ConfigError
from paratrain.distributed.store_auth import (
    SECRET_ENV,
    TamperedValue,
    bound_tcp_store,
    load_secret,
    resolve,
    serve_bounded,
    sign,
    verify,
)

log = logging.getLogger("paratrain")

NAME = "paratrain"
DEFAULT_PORT = 29400
_SENTINEL = "paratrain:no-state"  # what the key holds before the first state (a store get blocks on a missing key)
_agent_secret: str | None = None


def set_agent_secret(secret: str | None) -> None:
    """Hand the job secret to the backend in this process (the launcher's agent), not via a file or argv."""
    global _agent_secret
    _agent_secret = secret


# --- the state as JSON -------------------------------------------------------------------------


def _node(n: _NodeDesc) -> list:
    return [n.addr, n.pid, n.local_id]


def _time(t: datetime) -> str:
    return t.isoformat()


def encode_state(state: _RendezvousState) -> dict:
    """Every field of ``_RendezvousState`` as JSON types (sets sorted, so equal states encode equally)."""
    return {
        "round": state.round,
        "complete": state.complete,
        "deadline": None if state.deadline is None else _time(state.deadline),
        "closed": state.closed,
        "participants": sorted([_node(n), r] for n, r in state.participants.items()),
        "wait_list": sorted(_node(n) for n in state.wait_list),
        "redundancy_list": sorted(_node(n) for n in state.redundancy_list),
        "last_heartbeats": sorted([_node(n), _time(t)] for n, t in state.last_heartbeats.items()),
    }


def _parse_node(v) -> _NodeDesc:
    addr, pid, local_id = v
    if not isinstance(addr, str) or type(pid) is not int or type(local_id) is not int:
        raise ValueError(f"bad node descriptor {v!r}")
    return _NodeDesc(addr, pid, local_id)


def decode_state(obj: dict) -> _RendezvousState:
    """The inverse of :func:`encode_state`; ValueError on anything else."""
    if not isinstance(obj, dict) or set(obj) != set(encode_state(_RendezvousState())):
        raise ValueError("not a rendezvous state")
    state = _RendezvousState()
    if type(obj["round"]) is not int or type(obj["complete"]) is not bool or type(obj["closed"]) is not bool:
        raise ValueError("bad round/complete/closed")
    state.round, state.complete, state.closed = obj["round"], obj["complete"], obj["closed"]
    state.deadline = None if obj["deadline"] is None else datetime.fromisoformat(obj["deadline"])
    state.participants = {_parse_node(n): int(r) for n, r in obj["participants"]}
    state.wait_list = {_parse_node(n) for n in obj["wait_list"]}
    state.redundancy_list = {_parse_node(n) for n in obj["redundancy_list"]}
    state.last_heartbeats = {_parse_node(n): datetime.fromisoformat(t) for n, t in obj["last_heartbeats"]}
    return state


class _StateUnpickler(pickle.Unpickler):
    """Admits only what ``pickle.dumps(_RendezvousState())`` contains (the same rule as our DCP metadata reader)."""

    _ALLOWED = {
        ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState"),
        ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc"),
        ("datetime", "datetime"),
        ("datetime", "timezone"),
        ("datetime", "timedelta"),
        ("builtins", "set"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"rendezvous state may not contain {module}.{name}")
        return super().find_class(module, name)


def _loads_local_state(bits: bytes) -> _RendezvousState:
    state = _StateUnpickler(io.BytesIO(bits)).load()
    if not isinstance(state, _RendezvousState):
        raise RendezvousStateError("the rendezvous state to write is not a _RendezvousState")
    return state


class SignedStore(dist.Store):
    """A store whose values are signed on the way in and verified on the way out, for one round.

    torch elastic keeps values of its own on the rendezvous store (through the handler's
    ``_get_store``): ``MASTER_ADDR``/``MASTER_PORT`` of the workers' bootstrap, each node's role
    info and the rank each node is assigned (JSON), the exit barrier's keys. Through this
    wrapper each such value is ``sign``-ed under the job secret and its full key, and a value
    that fails the check is refused (:class:`TamperedStoreValue`, one line), never used: a peer
    that reaches the port cannot point the workers at another address or hand out ranks.
    Counters (``add``: the exit barrier's arrivals) and the existence of keys (``wait``,
    ``check``) cannot be signed: a peer can make a barrier end early or wait for its timeout,
    nothing more.

    Each value is signed together with ``launch``, the key of the round it belongs to (drawn when
    the round completed, in the signed state: ``ParatrainRendezvousBackend.launch``). The key and
    secret alone do not tell launches apart: a requeued job (same config, same secret, same
    rendezvous id) whose state key a peer deleted starts again at round 0 under the same keys, and
    a peer replayed launch 1's signed ``MASTER_ADDR``/``MASTER_PORT`` into launch 2 and took its
    workers' bootstrap (issue 55, item 1). A value of another launch is refused now.

    A node that refuses a value writes why under ``paratrain.refused.<launch>`` (signed too), and a
    read here that waits for a key (``get``, ``multi_get``: torch's rank assignment waits for each
    node's role info) ends with that line once it is there: the refusing node never writes its
    keys, so every node of the round stops with one line instead of waiting for the store timeout.

    ``current`` returns the store to use now (the rendezvous backend's client, which it replaces
    after a server restart; a client a caller kept from before would stay broken). Keep a
    Python reference to this object as long as a C++ store (a PrefixStore) wraps it: torch
    finds the Python methods through it.
    """

    def __init__(self, current, secret: str, launch: str, node: str = "?"):
        super().__init__()
        self._current, self._secret, self._launch, self._node = current, secret, launch, node
        self._refused_key = "paratrain.refused." + launch

    def _seal(self, key: str, value) -> str:
        data = value.encode() if isinstance(value, str) else bytes(value)
        return sign(self._secret, key, {"launch": self._launch, "value": base64.b64encode(data).decode("ascii")})

    def _open(self, key: str, raw) -> bytes:
        try:
            body = verify(self._secret, key, bytes(raw))
            if not isinstance(body, dict) or set(body) != {"launch", "value"}:
                raise ValueError("not a value of a paratrain round")
            data = base64.b64decode(body["value"], validate=True)
        except (TamperedValue, ValueError, TypeError) as e:
            why = (
                "it fails the job-secret check (written by someone who reaches the port without the secret,"
                " or by a node with another secret)"
            )
            raise self._refuse(key, why) from e
        if body["launch"] != self._launch:
            raise self._refuse(
                key, "it was signed by this job for another launch or round (a replay by someone who reaches the port)"
            )
        return data

    def _refuse(self, key: str, why: str) -> TamperedStoreValue:
        line = (
            f"refused the value of {key} on the rendezvous store: {why}; nothing was used from it. Keep the"
            " rendezvous port reachable by the job's nodes only (docs/security.md) and start the job again"
        )
        try:  # the round's other nodes may wait for a key this node will now never write
            self._current().set(self._refused_key, self._seal(self._refused_key, f"node {self._node} {line}"))
        except (RuntimeError, ValueError):
            pass  # the store is gone: they stop on its error
        return TamperedStoreValue(line)

    def refusal(self) -> str | None:
        """The line of a node of this round that refused a value (None if none did)."""
        store = self._current()
        if not store.check([self._refused_key]):
            return None
        return "the rendezvous stopped: " + self._open(self._refused_key, store.get(self._refused_key)).decode()

    def _wait_for(self, keys: list[str]) -> None:
        """Until ``keys`` exist (at most the store's timeout, as its get), or a node of this round refused a value."""
        store = self._current()
        deadline = time.monotonic() + store.timeout.total_seconds()
        while not store.check(keys) and time.monotonic() < deadline:
            if (line := self.refusal()) is not None:
                raise TamperedStoreValue(line)
            time.sleep(0.05)

    def set(self, key, value):
        self._current().set(key, self._seal(key, value))

    def get(self, key):
        self._wait_for([key])
        return self._open(key, self._current().get(key))

    def multi_set(self, keys, values):
        self._current().multi_set(list(keys), [self._seal(k, v) for k, v in zip(keys, values)])

    def multi_get(self, keys):
        self._wait_for(list(keys))
        return [self._open(k, v) for k, v in zip(keys, self._current().multi_get(list(keys)))]

    def compare_set(self, key, expected, desired):
        raise NotImplementedError("compare_set on a SignedStore: sign the state itself (rendezvous.py)")

    def add(self, key, amount):
        return self._current().add(key, amount)

    def wait(self, keys, *timeout):
        return self._current().wait(keys, *timeout)

    def check(self, keys):
        return self._current().check(keys)

    def delete_key(self, key):
        return self._current().delete_key(key)

    def num_keys(self):
        return self._current().num_keys()


class TamperedStoreValue(TamperedValue, RendezvousStateError):
    """A signed store value that fails the check: a rendezvous error (the launcher's one line)."""


# --- the backend -------------------------------------------------------------------------------


class ParatrainRendezvousBackend(RendezvousBackend):
    """Like torch's ``C10dRendezvousBackend`` (compare-and-set on one key), with JSON + HMAC values."""

    def __init__(
        self,
        store: dist.Store,
        run_id: str,
        *,
        secret: str,
        endpoint: str,
        reconnect: Callable[[], dist.Store] | None = None,
        job: str = "",
        retry_s: float | None = None,
    ) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._store, self._secret, self._endpoint = store, secret, endpoint
        # Which job this node belongs to (job_fingerprint of its config; "" when not known):
        # written into each state so that a node refused by the HMAC can tell a node of its own job
        # with another secret from another job that uses the same rendezvous id.
        self._job = job
        # The newest (round, version) verified here: every state written carries the version of
        # the state it replaces plus one (compare-and-set makes that history linear), so an older
        # one read back is a replay (or a restarted server given an older state) and is refused.
        self._seen: tuple[int, int] = (-1, -1)
        # (round, key) of the last verified state when its round is complete: the key every value
        # torch keeps under that round is signed with (SignedStore). Drawn by the node whose write
        # completes the round and kept while it stays complete, so a round's key is newer than
        # each of its participants' joins: nothing signed in an earlier launch carries it.
        self._launch: tuple[int, str] | None = None
        self._reconnect = reconnect  # a new client of the store (None: this node hosts it)
        self._broken = False  # the client failed once: it never recovers, the next call reconnects
        self._retry_s = retry_s  # how often torch's keep-alive calls (and so retries), for the log line
        self._down_since: float | None = None  # when the store became unreachable (logged once)
        self._key = "paratrain.rendezvous." + run_id
        self._last_good: bytes | None = None  # pickled bytes of the last verified state (made here)
        self._last_raw: bytes | None = None  # the store value they came from (most reads find it unchanged)
        self._refused: set[bytes] = set()
        self._call("compare_set", self._key, "", _SENTINEL)

    @property
    def name(self) -> str:
        return NAME

    def get_state(self) -> tuple[bytes, Token] | None:
        return self._decode(self._call("get", self._key))

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        new = _loads_local_state(state)
        launch = None
        if new.complete:
            launch = self._launch[1] if self._launch and self._launch[0] == new.round else secrets.token_hex(16)
        body = {"job": self._job, "version": self._seen[1] + 1, "launch": launch, "state": encode_state(new)}
        value = sign(self._secret, self._key, body)
        if token is not None and not isinstance(token, bytes):
            result = self.get_state()
            return None if result is None else (*result, False)
        raw = self._call("compare_set", self._key, token.decode() if token else _SENTINEL, value)
        decoded = self._decode(raw)
        if decoded is None:
            return None
        return decoded[0], decoded[1], raw == value.encode()

    @property
    def store(self) -> dist.Store:
        """The store as now connected (a new client after a reconnect)."""
        return self._store

    @property
    def secret(self) -> str:
        return self._secret

    @property
    def launch(self) -> str | None:
        """The key of the round of the last verified state (None while it is not complete)."""
        return self._launch[1] if self._launch else None

    def _call(self, op: str, *args):
        """``op`` on the store; a client that failed is replaced by a new one (at most once per call).

        Quiet while the store is down: one line when it is lost, one when it is back (and the
        join timeout's error if it never comes back). A failed client is not used again (each op
        on it had torch's C++ log a warning with a stack trace), and a new one is made only once
        the port accepts a connection (each failed connect of a TCPStore client logged two
        errors and two stack traces: 260-390 lines per node for a server down for a minute).
        """
        error: BaseException | None = None
        if not self._broken:
            try:
                return getattr(self._store, op)(*args)
            except (ValueError, RuntimeError, TimeoutError) as exc:
                error = exc
                self._broken = self._reconnect is not None
        if self._reconnect is not None:
            try:
                # A TCPStore client never reconnects by itself: a new one, and on a restarted
                # (empty) server the last verified state back under the key, before any other op.
                store = self._reconnect()
                store.compare_set(self._key, "", self._last_raw or _SENTINEL)
                self._store, self._broken = store, False
                result = getattr(store, op)(*args)
            except (ValueError, RuntimeError, TimeoutError, OSError) as exc:
                error = exc
            else:
                # Logged at every reconnect: a server back before this node noticed it was gone
                # (its first call after the restart reconnects at once) is worth a line too.
                down = "" if self._down_since is None else f" after {time.monotonic() - self._down_since:.0f} s"
                log.warning("paratrain: reconnected to the rendezvous store at %s%s", self._endpoint, down)
                self._down_since = None
                return result
        first = str(error).splitlines()[0] if str(error) else type(error).__name__  # no C++ frames
        if self._down_since is None:
            self._down_since = time.monotonic()
            every = f" every {self._retry_s:g} s" if self._retry_s else ""
            log.warning(
                "paratrain: the rendezvous store at %s is unreachable (%s); reconnecting%s, the workers train on",
                self._endpoint,
                first,
                every,
            )
        raise RendezvousConnectionError(f"the rendezvous store at {self._endpoint} failed: {first}") from error

    def _decode(self, raw: bytes) -> tuple[bytes, Token] | None:
        if raw == _SENTINEL.encode():
            return None
        if raw == self._last_raw:
            return self._last_good, raw
        try:
            body = verify(self._secret, self._key, raw)
            if (
                not isinstance(body, dict)
                or set(body) != {"job", "version", "launch", "state"}
                or type(body["version"]) is not int
            ):
                raise ValueError("not a paratrain rendezvous value")
            state, version, launch = decode_state(body["state"]), body["version"], body["launch"]
            if not (launch is None or isinstance(launch, str)) or state.complete != (launch is not None):
                raise ValueError("a complete round without its key, or a key without one")
        except (TamperedValue, ValueError, TypeError, KeyError) as exc:
            bad = exc
        else:
            if (state.round, version) >= self._seen:
                self._seen = (state.round, version)
                self._launch = (state.round, launch) if state.complete else None
                bits = pickle.dumps(state)
                self._last_good, self._last_raw = bits, raw
                return bits, raw
            if raw not in self._refused:
                self._refused.add(raw)
                log.error(
                    "paratrain: refused a rendezvous state at %s (key %s) older than the one this node has seen"
                    " (round %d version %d, seen round %d version %d): a peer that reconnected to a restarted"
                    " server wrote back what it last saw, or a replay by someone who reaches the port; keeping"
                    " the newer state",
                    self._endpoint,
                    self._key,
                    state.round,
                    version,
                    *self._seen,
                )
            return self._last_good, raw  # as token: our next compare-and-set replaces it
        if self._last_good is None:
            # Never saw a state signed with our secret: this node is the odd one out (or the store
            # was written by someone else first). Joining would mean trusting an unverified state.
            raise RendezvousStateError(self._refusal(raw, bad))
        if raw not in self._refused:
            self._refused.add(raw)
            log.error(
                "paratrain: refused a rendezvous state written to %s (key %s) without the job secret; "
                "keeping the last verified state",
                self._endpoint,
                self._key,
            )
        # The forged value as token: our next compare-and-set replaces it with a signed state.
        return self._last_good, raw

    def _refusal(self, raw: bytes, bad: Exception) -> str:
        """Why a node that has verified nothing yet will not join: the line says which case it is.

        The ``job`` field of a value that fails the check is read, never trusted: it only picks
        the message (what is refused does not change).
        """
        where = f"the rendezvous {self._key.removeprefix('paratrain.rendezvous.')!r} at {self._endpoint}"
        job = _claimed_job(raw)
        if self._job and job and job != self._job:
            return (
                f"refused to join {where}: another job (another config) uses that rendezvous id there;"
                " give each job its own --rdzv-id"
            )
        if self._job and job == self._job:
            return (
                f"refused to join {where}: a node of this job signed its state with another job secret; give"
                f" every node the same {SECRET_ENV} or --job-secret-file (another job with the same config"
                " and its own secret: give it its own --rdzv-id)"
            )
        return (
            f"refused to join {where}: its state fails the job-secret check ({type(bad).__name__}): a node"
            f" with another secret, or another job with this --rdzv-id; give every node the same {SECRET_ENV}"
            " or --job-secret-file, and each job its own --rdzv-id"
        )


def _claimed_job(raw: bytes) -> str:
    """The ``job`` a value says it belongs to ("" if it says nothing readable); unverified."""
    try:
        obj = json.loads(raw.decode("utf-8", "replace").partition(":")[2])
    except ValueError:
        return ""
    job = obj.get("job") if isinstance(obj, dict) else None
    return job if isinstance(job, str) else ""


# What defines a run's math (checkpointer.config_changes): the same on every node of a job,
# whatever its paths (one shared run.out_dir may be mounted at another path on each machine).
JOB_KEYS = ("model", "data", "loss", "optim", "batch.global_batch_size", "run.seed", "run.steps")


def job_fingerprint(config: dict) -> str:
    """A training job's identity on a shared rendezvous server: a hash of what defines its math
    (``JOB_KEYS`` of the resolved config as a dict). Two jobs that differ in any of it (another
    model, data, learning rate, seed...) never share a default rendezvous id."""
    picked = {}
    for key in JOB_KEYS:
        section, _, name = key.partition(".")
        picked[key] = config.get(section, {}).get(name) if name else config.get(section)
    return hashlib.sha256(json.dumps(picked, sort_keys=True, default=str).encode()).hexdigest()[:16]


def default_rdzv_id(job: str) -> str:
    """The rendezvous id of a multi-node job without ``--rdzv-id``: its job's ("none" if unknown)."""
    return f"job-{job}" if job else "none"


class _LaunchNodeDescGenerator:
    """torch's node descriptor (address, pid, local_id) with a random local_id, unique to a launch.

    The descriptor is how a state names a node. torch counts local_id 0, 1, ... per process, and a
    requeued container often gets the same pid: the next launch's node would then be named exactly
    as in the previous launch's states, and one of those replayed would make it a participant of a
    round completed before it started (whose bootstrap values and key are the old launch's). A
    random local_id (63 bits) makes a round that names this node one it joined (issue 55, item 1).
    """

    def generate(self, local_addr: str | None = None) -> _NodeDesc:
        return _NodeDesc(local_addr or socket.getfqdn(), os.getpid(), secrets.randbits(63))


class ParatrainRendezvousHandler(DynamicRendezvousHandler):
    """torch's handler, with the store it shares with the workers bound to this node's address,
    and a rendezvous store that may go away for a while (a restarted ``rendezvous serve``)."""

    _node_desc_generator = _LaunchNodeDescGenerator()
    bind_addr: str = "127.0.0.1"
    backend: ParatrainRendezvousBackend | None = None

    def _create_tcp_store_server(self, master_addr, master_port) -> dist.TCPStore:
        return bound_tcp_store(master_addr, master_port, bind_addr=self.bind_addr, timeout=timedelta(seconds=300))

    def _get_store(self) -> dist.Store:
        """The store torch keeps its own values on (``MASTER_ADDR``/``MASTER_PORT``, each node's
        rank, the exit barrier), under ``torch.rendezvous.<id>.<round>/``: signed and verified with
        the round's key (SignedStore), and always the backend's current client (after a reconnect a
        client kept from before is a broken connection). torch asks for it once this node is a
        participant of a complete round, which always has a key."""
        if self.backend is None:
            return self._wrap_store(self._store)
        signed = self._signed_store()
        if signed is None:
            raise RendezvousStateError("the rendezvous round is not complete: it has no key to sign its values with")
        return self._wrap_store(signed)

    def _signed_store(self) -> SignedStore | None:
        """The SignedStore of the round of the last verified state (None while it is not complete)."""
        backend, launch = self.backend, self.backend.launch
        if launch is None:
            return None
        signed = vars(self).setdefault("_signed", {})  # referenced for as long as torch's PrefixStore wraps them
        if launch not in signed:
            node = f"{self._this_node.addr} pid {self._this_node.pid}"
            signed[launch] = SignedStore(lambda: backend.store, backend.secret, launch, node)
        return signed[launch]

    def _peer_refusal(self) -> str | None:
        """The line of a node that refused a value of this node's last complete round, if one did."""
        signed = self._signed_store() if self.backend is not None else None
        try:
            return signed.refusal() if signed is not None else None
        except RuntimeError:  # the store is gone: nothing more to say than torch's error
            return None

    def num_nodes_waiting(self) -> int:
        # The agent asks every monitor interval while the workers run: an unreachable store
        # (a restarting server) must not end a job that needs no new round. Nobody can join it meanwhile.
        try:
            return super().num_nodes_waiting()
        except RendezvousConnectionError:
            return 0

    def next_rendezvous(self):
        deadline = time.monotonic() + self._settings.timeout.join.total_seconds()
        while True:
            try:
                if not getattr(self, "_joined_once", False):
                    self._reopen_a_finished_launch()
                self._joined_once = True
                return super().next_rendezvous()
            except RendezvousClosedError:
                # A node that refused a value of the round closes the rendezvous on its way out,
                # often before this node (still waiting to join) saw the round complete: its line,
                # not torch's bare "closed" (issue 55, item 1).
                line = self._peer_refusal()
                if line is None:
                    raise
                raise TamperedStoreValue(line) from None
            except RendezvousConnectionError as exc:
                if time.monotonic() >= deadline:
                    raise RendezvousTimeoutError(
                        f"{exc} (unreachable for join_timeout, {self._settings.timeout.join.total_seconds():.0f} s);"
                        " start the rendezvous server again (or the node that hosts it) and resume the job"
                    ) from exc
                time.sleep(1.0)

    def _reopen_a_finished_launch(self) -> None:
        """A new launch of a job reopens the rendezvous its previous launch closed.

        torch's agents close the rendezvous when their workers are done, and a closed rendezvous
        refuses every later node (RendezvousClosedError). On a store of the job's own node that
        store went away with the job; on a long-lived ``rendezvous serve`` it stays, so the job's
        next launch (requeued after a preemption, or started again to go on) could never meet
        there. So a launcher's *first* join reopens a closed rendezvous as a new round with no
        one in it; joins after that (workers restarted within this launch) keep torch's rule.
        Nothing but the resume differs: a launch of a job that had finished resumes its final
        checkpoint and stops at once.
        """
        holder = self._state_holder
        holder.sync()
        state = holder.state
        if not state.closed:
            return
        log.warning(
            "the rendezvous of this job was closed by its previous launch (finished or preempted); opening round %d",
            state.round + 1,
        )
        state.round += 1
        state.complete, state.deadline, state.closed = False, None, False
        state.participants.clear()
        state.wait_list.clear()
        state.redundancy_list.clear()
        state.last_heartbeats.clear()
        holder.mark_dirty()
        holder.sync()  # compare-and-set: a node that reopened it first wins, and this one sees it open


def _create_store(params: RendezvousParameters, host: str, port: int) -> tuple[dist.TCPStore, bool]:
    """(the rendezvous store, whether this node hosts it): ``is_host`` when given, else host when
    the endpoint's address is this machine's; a client otherwise."""
    cfg_is_host = params.get_as_bool("is_host")
    is_host = cfg_is_host if cfg_is_host is not None else _matches_machine_hostname(host)
    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60))
    if is_host:
        try:
            return bound_tcp_store(host, port, bind_addr=_resolve(host), timeout=timeout, front=True), True
        except OSError:
            # Without is_host: another agent of this rendezvous on this machine (started with the
            # same --node-rank) or a `paratrain rendezvous serve` holds the port: be its client.
            if cfg_is_host:
                raise
            log.info("paratrain: %s:%s is already served on this machine; this node is its client", host, port)
    return dist.TCPStore(host, port, is_master=False, timeout=timeout), False


def _client(host: str, port: int, read_timeout: float) -> Callable[[], dist.TCPStore]:
    """A function that connects a new client (a few seconds to connect, then the read timeout)."""

    def connect() -> dist.TCPStore:
        # A plain socket first: while the server is down it fails silently (OSError), where a
        # TCPStore client's failed connect logs errors and stack traces from torch's C++.
        socket.create_connection((host, port), timeout=3).close()
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=3))
        store.set_timeout(timedelta(seconds=read_timeout))
        return store

    return connect


def _resolve(host: str) -> str:
    return "127.0.0.1" if host == "localhost" else resolve(host)


def create_handler(params: RendezvousParameters) -> ParatrainRendezvousHandler:
    """The factory torch elastic calls for ``--rdzv-backend paratrain``."""
    _TorchStoreEcho.install()
    secret = _agent_secret or load_secret(params.get("secret_file", ""), required=True)
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    store, hosting = _create_store(params, host, port)
    reconnect = None if hosting else _client(host, store.port, params.get_as_int("read_timeout", 60))
    endpoint = f"{host}:{store.port}"
    backend = ParatrainRendezvousBackend(
        store,
        params.run_id,
        secret=secret,
        endpoint=endpoint,
        reconnect=reconnect,
        job=params.get("job", ""),
        retry_s=params.get_as_int("keep_alive_interval", 5),
    )
    timeout = RendezvousTimeout(
        *(
            None if params.get_as_int(k + "_timeout") is None else timedelta(seconds=params.get_as_int(k + "_timeout"))
            for k in ("join", "last_call", "close", "heartbeat")
        )
    )
    handler = ParatrainRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=params.get_as_int("keep_alive_interval", 5),
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 3),
    )
    handler.bind_addr = params.get("bind_addr", "") or params.local_addr or "127.0.0.1"
    handler.backend = backend
    return handler


def register() -> None:
    """Make ``--rdzv-backend paratrain`` known to torch elastic in this process (idempotent)."""
    try:
        rendezvous_handler_registry.register(NAME, create_handler)
    except ValueError:
        pass  # already registered (same creator)
    _TorchStoreEcho.install()


class _TorchStoreEcho(logging.Filter):
    """torch elastic's own lines about a rendezvous store that went away, which the backend says
    once (lost, reconnected): its keep-alive's warning at every interval while the store is
    unreachable is dropped, and the traceback of an exit barrier on a client of a store that was
    restarted meanwhile (torch keeps the client it was given at the rendezvous) becomes one line."""

    LOGGERS = (
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
        "torch.distributed.elastic.agent.server.api",
    )

    @classmethod
    def install(cls) -> None:
        """On torch's loggers, once per process (register, and create_handler for plain torchrun)."""
        for name in cls.LOGGERS:
            logger = logging.getLogger(name)
            if not any(isinstance(f, cls) for f in logger.filters):
                logger.addFilter(cls())

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        if "failed to send a keep-alive heartbeat" in msg and "RendezvousConnectionError" in msg:
            return False
        if msg.startswith("Error waiting on exit barrier") and record.exc_info:
            exc = record.exc_info[1]
            cause = (str(exc).splitlines() or [type(exc).__name__])[0] if exc is not None else "?"
            record.msg = f"paratrain: the exit barrier of the rendezvous failed ({cause}); this node's workers are done"
            record.args, record.exc_info, record.exc_text = (), None, None
        return True


# --- the standalone server ---------------------------------------------------------------------

_PREFIX = "paratrain.rendezvous."
_MAX_LOGGED_VALUE = 1 << 20  # larger values are no state a node wrote: not read


class JobLog:
    """What ``rendezvous serve`` says about the jobs it holds: a line per change of a job's nodes.

    The server has no job secret, so it reads each job's state as it claims to be (the JSON
    after the HMAC, unverified): the log is for the operator, the nodes decide on verified states.
    """

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, frozenset, bool]] = {}

    def poll(self, store: dist.Store) -> list[str]:
        lines = []
        try:
            keys = [k for k in store.list_keys() if k.startswith(_PREFIX)]
        except (RuntimeError, ValueError, AttributeError):
            return lines
        for key in sorted(keys):
            now = _claimed_state(store, key)
            if now is None:
                continue
            job, (round_, nodes, closed) = key.removeprefix(_PREFIX), now
            before = self._seen.get(job)
            self._seen[job] = now
            if before is None and not nodes and not closed:
                lines.append(f"paratrain rendezvous: job {job}: waiting for nodes")
                continue
            old_round, old_nodes, old_closed = before or (round_, frozenset(), False)
            joined, left = sorted(nodes - old_nodes), sorted(old_nodes - nodes)
            count = f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}"
            if joined:
                lines.append(f"paratrain rendezvous: job {job}: round {round_}: {', '.join(joined)} joined ({count})")
            if left:
                lines.append(f"paratrain rendezvous: job {job}: round {round_}: {', '.join(left)} left ({count})")
            if closed and not old_closed:
                lines.append(f"paratrain rendezvous: job {job}: closed by its nodes (finished or stopped)")
        return lines


def _claimed_state(store: dist.Store, key: str) -> tuple[int, frozenset, bool] | None:
    """(round, participants as "addr pid N", closed) that a state under ``key`` claims; None if unreadable."""
    try:
        raw = store.get(key)
        if len(raw) > _MAX_LOGGED_VALUE or raw == _SENTINEL.encode():
            return None
        state = decode_state(json.loads(raw.decode("utf-8", "replace").partition(":")[2])["state"])
    except (RuntimeError, ValueError, TypeError, KeyError):
        return None
    nodes = frozenset(f"{n.addr} pid {n.pid}" for n in state.participants)
    return state.round, nodes, state.closed


def serve(port: int = DEFAULT_PORT, bind: str = "", *, ready: Callable[[str], None] = print) -> int:
    """``paratrain rendezvous serve``: host the rendezvous store until SIGTERM/SIGINT; returns 0.

    A plain TCPStore: the nodes sign and verify every value (the job secret never reaches it),
    so one server can serve several jobs (each its own ``--rdzv-id``/run id key); it prints a line
    when a job's nodes join or leave (:class:`JobLog`). ``bind`` "": the address this machine's
    host name resolves to (never every interface unless asked: 0.0.0.0)."""
    bind = bind or socket.gethostname()
    try:
        addr = _resolve(bind)
        server = serve_bounded(addr, port, timedelta(seconds=60))
    except OSError as e:
        raise ConfigError(
            f"--bind {bind} --port {port}: cannot listen there ({e.strerror or e}); pass another --bind or --port"
        ) from None
    port, store = server.port, server.server
    stop = threading.Event()
    got: list[int] = []

    def on_signal(signum, frame) -> None:
        got.append(signum)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        host = f"[{addr}]" if ":" in addr else addr
        ready(
            f"paratrain rendezvous: serving on {host}:{port} (nodes: --rdzv-endpoint HOST:{port} --rdzv-conf is_host=false)"
        )
        jobs = JobLog()
        while not stop.wait(1.0):
            for line in jobs.poll(store):
                ready(line)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        server.close()  # the port is free again when serve returns (a test serves in-process)
    ready(f"paratrain rendezvous: stopped ({signal.Signals(got[0]).name})" if got else "paratrain rendezvous: stopped")
    return 0
