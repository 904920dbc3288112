"""No code execution from the network: the paratrain rendezvous backend, signed stores, loopback binding.

Everything here runs against 127.0.0.1 only, and every wait is bounded in time.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import pickle
import signal
import socket
import time
from datetime import UTC, datetime, timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from paratrain.distributed import rendezvous
from paratrain.distributed.store_auth import TamperedValue, bound_tcp_store, sign, verify
from paratrain.testing.dist_utils import REPO, descendants
from paratrain.testing.resilience import metric_lines, start_job, wait_for


class _Payload:
    """A pickle that runs ``touch marker`` when loaded: what an attacker writes into an open store."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _state() -> _RendezvousState:
    s = _RendezvousState()
    a, b = _NodeDesc("node-a", 11, 0), _NodeDesc("node-b", 12, 3)
    s.round, s.complete, s.closed = 4, True, False
    s.deadline = datetime.now(UTC) + timedelta(seconds=30)
    s.participants = {a: 0, b: 1}
    s.wait_list = {b}
    s.redundancy_list = {a}
    s.last_heartbeats = {a: datetime.now(UTC), b: datetime.now(UTC) - timedelta(seconds=7)}
    return s


def test_state_round_trips_through_json_every_field():
    s = _state()
    assert vars(rendezvous.decode_state(rendezvous.encode_state(s))) == vars(s)
    assert vars(rendezvous.decode_state(rendezvous.encode_state(_RendezvousState()))) == vars(_RendezvousState())


def test_signed_values_refuse_tampering_and_replay():
    v = sign("k1", "key", {"a": 1})
    assert verify("k1", "key", v) == {"a": 1}
    body = v.partition(":")[2]
    forged = [
        ("k2", "key", v),  # another job's secret
        ("k1", "other", v),  # replayed under another key
        ("k1", "key", v.replace("1}", "2}")),  # the body changed
        ("k1", "key", ":" + body),  # no signature at all: a prefix check would accept it
        ("k1", "key", v[:20] + ":" + body),  # a truncated signature
        ("k1", "key", body),  # no separator
    ]
    for secret, key, value in forged:
        with pytest.raises(TamperedValue):
            verify(secret, key, value)


def test_local_state_unpickler_admits_only_the_state_classes(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(pickle.UnpicklingError):
        rendezvous._loads_local_state(pickle.dumps(_Payload(str(marker))))
    assert not marker.exists()


def test_backend_refuses_forged_state_and_wrong_secret(tmp_path, caplog):
    store, state = dist.HashStore(), _state()
    good = rendezvous.ParatrainRendezvousBackend(store, "job", secret="s", endpoint="127.0.0.1:1")
    other = rendezvous.ParatrainRendezvousBackend(store, "job", secret="s", endpoint="127.0.0.1:1")
    bits, token, ok = good.set_state(pickle.dumps(state))
    assert ok and vars(pickle.loads(bits)) == vars(state)
    assert vars(pickle.loads(other.get_state()[0])) == vars(state)
    # A node with another secret is refused before it writes anything.
    with pytest.raises(RendezvousStateError, match="refused to join"):
        rendezvous.ParatrainRendezvousBackend(store, "job", secret="wrong", endpoint="127.0.0.1:1").get_state()
    # A forged value (torch c10d's format: base64 pickle) is refused; the last verified state stays.
    marker = tmp_path / "ran"
    store.set("paratrain.rendezvous.job", base64.b64encode(pickle.dumps(_Payload(str(marker)))))
    with caplog.at_level("ERROR", logger="paratrain"):
        bits, token = good.get_state()
    assert "refused a rendezvous state" in caplog.text and "127.0.0.1:1" in caplog.text
    assert vars(pickle.loads(bits)) == vars(state) and not marker.exists()
    # ... and the next compare-and-set (the keep-alive) replaces the forged value with a signed one.
    _, _, ok = good.set_state(pickle.dumps(state), token)
    assert ok and vars(pickle.loads(other.get_state()[0])) == vars(state)


def test_bound_store_listens_on_loopback_only():
    store = bound_tcp_store("127.0.0.1", 0, bind_addr="127.0.0.1", timeout=timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"
    # The public socket is served by the front process, the server listens on loopback too.
    assert _listening_ports_of([os.getpid(), *descendants(os.getpid())])[store.port] == "127.0.0.1"


def test_the_rendezvous_store_has_a_front_and_the_job_store_none():
    """The rendezvous store (agents only) is served through the bounded front; the job's store,
    which every worker uses and whose bytes grow with the world size, is not (store_auth)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from paratrain.distributed import rendezvous, store_auth

    fronts = len(store_auth._FRONTS)  # fronts of earlier tests in this process live on
    params = RendezvousParameters("paratrain", "127.0.0.1:0", "t", 1, 1, is_host=True, read_timeout=10)
    store, hosted = rendezvous._create_store(params, "127.0.0.1", 0)
    assert len(store_auth._FRONTS) == fronts + 1
    front = store_auth._FRONTS.pop()
    try:
        assert hosted and front.port == store.port and front.front.poll() is None
        job = store_auth.bound_tcp_store("127.0.0.1", 0, bind_addr="127.0.0.1", timeout=timedelta(seconds=10))
        assert len(store_auth._FRONTS) == fronts and job.port != store.port
    finally:
        front.close()


# --- a real job --------------------------------------------------------------------------------


def _hex_addr(text: str) -> str:
    raw = bytes.fromhex(text)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    # /proc/net/tcp6: four little-endian 32-bit words
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))


def _listening_ports_of(pids: list[int]) -> dict[int, str]:
    """{port: local address} of every listening TCP socket owned by ``pids`` (from /proc/net/tcp{,6})."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    addr, port = cols[1].split(":")
                    out[int(port, 16)] = _hex_addr(addr)
    return out


@pytest.mark.slow  # > 12 s: make test stays under 10 minutes
@pytest.mark.timeout(240)
def test_single_node_job_listens_on_loopback_and_ignores_forged_state(tmp_path):
    out, marker = tmp_path / "run", tmp_path / "code-ran"
    job = start_job(out, 100_000, "--nproc-per-node", "2")
    try:
        wait_for(lambda: metric_lines(out) >= 2, 120, "the job's first steps")
        pids = descendants(job.pid)
        listening = _listening_ports_of(pids)
        assert len(listening) >= 2, listening  # the agent's stores, the workers' gloo listeners
        assert all(ipaddress.ip_address(a).is_loopback for a in listening.values()), listening

        # The attack of issue 15: a crafted pickle under every key of every store the agent serves.
        payload = base64.b64encode(pickle.dumps(_Payload(str(marker))))
        attacked = 0
        for port in _listening_ports_of([job.pid]):
            client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
            for key in client.list_keys():
                client.set(key, payload)
                attacked += 1
        assert attacked >= 1
        before = metric_lines(out)
        time.sleep(12)  # past the 5 s keep-alive, when torch's c10d backend would unpickle it
        assert not marker.exists(), "a forged store value ran code"
        assert job.poll() is None, job.communicate(timeout=10)[0][-3000:]
        assert metric_lines(out) > before  # still training
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGTERM)
        text = job.communicate(timeout=60)[0]
    assert "refused a rendezvous state" in text, text[-3000:]
    assert not marker.exists()


def test_heartbeats_are_signed_and_forged_ones_refused(caplog):
    from paratrain.distributed.hang import HangWatch

    store = dist.HashStore()
    watch = HangWatch(store, rank=0, world_size=2, timeout_s=10, secret="s")
    HangWatch(store, rank=1, world_size=2, timeout_s=10, secret="s").beat()
    watch.beat()
    assert set(watch.heartbeats()) == {0, 1} and all(v is not None for v in watch.heartbeats().values())
    store.set("paratrain/heartbeat/1", '{"time": 0, "pid": 1, "last": {}}')  # unsigned JSON from a peer
    with caplog.at_level("ERROR", logger="paratrain"):
        beats = watch.heartbeats()
    assert beats[1] is None and beats[0] is not None
    assert "refused the heartbeat of rank 1" in caplog.text


def _json_collectives_rank():
    from paratrain.distributed.json_collectives import all_gather_json, broadcast_json

    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        got = broadcast_json({"path": "/ckpt/step-3", "n": [1, 2.5, None]} if rank == 1 else None, src=1)
        gathered = all_gather_json({"rank": rank, "name": "x" * (rank * 7)})
        return got, gathered
    finally:
        dist.destroy_process_group()


def test_json_collectives_carry_data_without_pickle():
    from paratrain.testing.dist_utils import run_ranks

    results = run_ranks(_json_collectives_rank, 3)
    for got, gathered in results:
        assert got == {"path": "/ckpt/step-3", "n": [1, 2.5, None]}
        assert gathered == [{"rank": r, "name": "x" * (r * 7)} for r in range(3)]


def test_multi_node_without_a_secret_exits_2_before_starting(monkeypatch, capsys):
    from paratrain.cli import main

    monkeypatch.delenv("PARATRAIN_JOB_SECRET", raising=False)
    base = ["train", "configs/debug.toml", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1"]
    monkeypatch.chdir(REPO)
    for extra, needle in [([], "needs one secret shared by every node"), (["--job-secret-file", "/nonexistent"], "")]:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("paratrain: error:") and needle in err, err


def test_launch_arguments_use_the_paratrain_backend_and_one_address():
    from paratrain.config import ConfigError
    from paratrain.launch.agent import LaunchSpec, torchrun_args

    one = LaunchSpec(nproc_per_node=2)
    args = torchrun_args(one, "paratrain.train", ["c.toml"], bind=one.bind_addr())
    assert one.bind_addr() == "127.0.0.1" and "--standalone" not in args
    assert args[args.index("--rdzv-backend") + 1] == "paratrain"
    assert args[args.index("--rdzv-endpoint") + 1] == "127.0.0.1:0"
    assert args[args.index("--local-addr") + 1] == "127.0.0.1"
    two = LaunchSpec(nnodes=2, rdzv_endpoint="127.0.0.1:29400")
    assert two.bind_addr() == "127.0.0.1"  # the local address that reaches the endpoint
    assert LaunchSpec(nnodes=2, rdzv_endpoint="127.0.0.1:29400", bind="10.9.8.7").bind_addr() == "10.9.8.7"
    with pytest.raises(ConfigError, match="loopback only"):
        LaunchSpec(bind="10.9.8.7").validate()
    rendezvous.register()  # what the launcher and the torchrun.handlers entry point both register
    creator = rendezvous.handler_creator()  # defers to create_handler (rendezvous.py says why)
    real, rendezvous.create_handler = rendezvous.create_handler, lambda params: ("made", params)
    try:
        assert creator("params") == ("made", "params")
    finally:
        rendezvous.create_handler = real


# --- the bounds of a store's server (distributed/store_front.py) -------------------------------

_MAGIC = (0x3C85F7CE).to_bytes(4, "little")  # TCPStore's validation number (TCPStoreBackend.hpp)


def _raw_client(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A bare TCP connection to a store from ``source``, past TCPStore's validation message."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
    s.sendall(b"\0" + _MAGIC)
    return s


def _closed_by_server(s: socket.socket, within: float = 3.0) -> bool:
    s.settimeout(within)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def _set_request(key: bytes, size: int) -> bytes:
    """The header of TCPStore's SET (command 1): the key, then the value's length (value bytes follow)."""
    return b"\1" + len(key).to_bytes(8, "little") + key + size.to_bytes(8, "little")


def test_store_server_caps_connections_per_host_and_in_all():
    from paratrain.distributed.store_auth import serve_bounded

    server = serve_bounded("127.0.0.1", 0, timedelta(seconds=10), max_connections=6, max_per_host=4)
    try:
        held = [_raw_client(server.port, "127.0.0.2") for _ in range(4)]
        assert not any(_closed_by_server(s, 0.3) for s in held)
        over_host = _raw_client(server.port, "127.0.0.2")
        assert _closed_by_server(over_host), "a 5th connection from one host was served"
        held += [_raw_client(server.port, "127.0.0.3") for _ in range(2)]
        over_all = _raw_client(server.port, "127.0.0.4")
        assert _closed_by_server(over_all), "a 7th connection in all was served"
        held.pop(0).close()  # a slot frees: a legitimate client (another host) connects and works
        client = wait_for(lambda: _store_client(server.port), 10, "a free connection slot")
        client.set("k", "v")
        assert server.server.get("k") == b"v" and client.get("k") == b"v"
    finally:
        server.close()


def _store_client(port: int) -> dist.TCPStore | None:
    try:
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=3))
    except RuntimeError:
        return None


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_store_server_refuses_oversized_values_and_too_many_bytes():
    from paratrain.distributed.store_auth import serve_bounded

    mib = 1 << 20
    server = serve_bounded("127.0.0.1", 0, timedelta(seconds=10), max_value=mib, max_total=6 * mib)
    try:
        # One value of 2.5 MiB (under torch's own 8 MiB, and the total): closed at its header, never stored.
        before = _rss_bytes()
        attacker = _raw_client(server.port)
        attacker.sendall(_set_request(b"big", 5 * mib // 2))
        chunk = b"x" * (64 << 10)
        try:
            for _ in range(5 * mib // 2 // len(chunk)):
                attacker.sendall(chunk)
        except OSError:
            pass  # closed under it
        closed = _closed_by_server(attacker)  # (3 s if not: time for the server to store it)
        assert _rss_bytes() - before < 3 * mib // 2, "the server's memory grew by the refused value"
        assert closed and not server.server.check(["big"])

        # Many values each under the cap: refused once the store would hold more than 6 MiB
        # (what it holds, plus the request that arrives: the server buffers it until complete).
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=5))
        for i in range(4):
            client.set(f"k{i}", b"y" * mib)
        client.set("k0", b"z" * mib)  # rewriting a key holds no more bytes
        assert client.get("k0")[:1] == b"z"  # through the same connection: after the set
        filler = _raw_client(server.port)
        filler.sendall(_set_request(b"k4", mib) + b"y" * mib)
        assert _closed_by_server(filler)
        assert not client.check(["k4"])
        assert client.get("k1") == b"y" * mib  # legitimate traffic goes on
    finally:
        server.close()
