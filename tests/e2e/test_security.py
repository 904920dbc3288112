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


def test_a_diagnosis_asks_for_last_collectives_and_a_silent_rank_is_named():
    """Beats carry no flight-recorder dump (its torch reader races with a main thread that makes
    groups); a diagnosis asks, a beating rank answers within two beats, a silent one is named."""
    from paratrain.distributed.hang import HangWatch

    store = dist.HashStore()
    watch = HangWatch(store, rank=0, world_size=3, timeout_s=1, secret="s")
    beating = HangWatch(store, rank=1, world_size=3, timeout_s=1, secret="s").start()
    HangWatch(store, rank=2, world_size=3, timeout_s=1, secret="s").start().stop()  # beat once, then silent
    try:
        assert "last" not in watch.heartbeats()[1]
        beats = watch.ask()
        assert "last" in beats[1] and beats[1]["answered"] == 1 and "last" not in beats[2]
        text = watch.diagnose(RuntimeError("gloo: Timed out"))
    finally:
        beating.stop()
    assert "rank 2: did not answer" in text and "ranks without a recent heartbeat: [2]" in text, text
    # A second diagnosis does not take rank 1's earlier answer for a new one.
    assert "rank 1: did not answer" in watch.diagnose(RuntimeError("gloo: Timed out"))


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


# --- a launch's values are its own (issue 55, item 1) ------------------------------

_BOOTSTRAP = ["torch.rendezvous.job.0/MASTER_ADDR", "torch.rendezvous.job.0/MASTER_PORT"]


def _launch_handlers(port: int, nodes: int = 2) -> list:
    """The rendezvous handlers of one launch of a job of ``nodes`` nodes on the server at ``port``:
    the same run id and secret at every launch (a requeue, or a cluster's secret)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    params = RendezvousParameters(
        "paratrain", f"127.0.0.1:{port}", "job", nodes, nodes, is_host="false", local_addr="127.0.0.1",
        bind_addr="127.0.0.1", join_timeout=30, read_timeout=10,
    )  # fmt: skip
    rendezvous.set_agent_secret("the-job-secret")
    try:
        return [rendezvous.create_handler(params) for _ in range(nodes)]
    finally:
        rendezvous.set_agent_secret(None)


def _join(handlers: list) -> list:
    """Each handler's ``next_rendezvous`` at once, in threads: its RendezvousInfo or what it raised."""
    import threading

    out: list = [None] * len(handlers)

    def one(i: int) -> None:
        try:
            out[i] = handlers[i].next_rendezvous()
        except Exception as e:  # noqa: BLE001 - the outcome under test
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


def _shutdown(handlers: list) -> None:
    for h in handlers:
        try:
            h.shutdown()
        except Exception:  # noqa: BLE001 - a handler whose rendezvous failed may have nothing to close
            pass


@pytest.mark.timeout(120)
def test_bootstrap_values_replayed_from_an_earlier_launch_are_refused():
    """The attack of issue 55 (item 1), in one process: launch 1 of a two-node job
    meets on a rendezvous server; a peer without the secret copies its signed MASTER_ADDR and
    MASTER_PORT, deletes the job's state key (so launch 2 starts again at round 0, under the same
    keys) and writes the copies back every 2 ms while launch 2 meets. No node of launch 2 takes the
    old address, and each stops with one line naming the replay: the node that read a copy, and
    its peer at its next read of the round (torch's rank assignment waits for the other node's role
    info, which the refusing node never writes). Before the fix both nodes took launch 1's address."""
    import threading

    from torch.distributed.elastic.rendezvous.api import RendezvousInfo

    from paratrain.distributed.store_auth import serve_bounded

    server = serve_bounded("127.0.0.1", 0, timedelta(seconds=30))  # as `paratrain rendezvous serve`
    peer = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    first, second, stop = _launch_handlers(server.port), [], threading.Event()
    try:
        infos = _join(first)
        assert all(isinstance(i, RendezvousInfo) for i in infos), infos
        old = (infos[0].bootstrap_store_info.master_addr, infos[0].bootstrap_store_info.master_port)
        copies = peer.multi_get(_BOOTSTRAP)
        _shutdown(first)
        peer.delete_key("paratrain.rendezvous.job")

        def replay() -> None:
            for _ in range(15_000):  # 30 s at most
                if stop.is_set():
                    return
                peer.multi_set(_BOOTSTRAP, copies)
                time.sleep(0.002)

        threading.Thread(target=replay, daemon=True).start()
        second = _launch_handlers(server.port)
        outcomes = _join(second)
        taken = [(o.rank, o.bootstrap_store_info.master_port) for o in outcomes if isinstance(o, RendezvousInfo)]
        assert all(
            (o.bootstrap_store_info.master_addr, o.bootstrap_store_info.master_port) != old
            for o in outcomes
            if isinstance(o, RendezvousInfo)
        ), f"a node of launch 2 took launch 1's bootstrap address {old}: (rank, port) {taken}"
        lines = []
        for got in outcomes:
            if isinstance(got, RendezvousInfo):
                with pytest.raises(RendezvousStateError) as stopped:
                    got.store.get(f"torchelastic/role_info/{1 - got.rank}")
                got = stopped.value
            assert isinstance(got, RendezvousStateError), repr(got)
            lines.append(str(got))
    finally:
        stop.set()
        _shutdown([*first, *second])
        server.close()
    for line in lines:
        assert "\n" not in line and "refused the value of torch.rendezvous.job.0/MASTER_" in line, line
        assert "signed by this job for another launch or round" in line, line
    assert sum(line.startswith("refused") for line in lines) >= 1, lines  # at least one node read a copy


# --- refusals are counted, not logged one line each (issue 55, item 4) ---------------


def _front_counts(lines: list[str]) -> dict[str, int]:
    """{address: refused connections} said by the front's lines: the first one's address, then the counts."""
    import re

    counts: dict[str, int] = {}
    for line in lines:
        if first := re.match(r"paratrain: refused a store connection from (\S+): over the connection cap$", line):
            counts[first[1]] = counts.get(first[1], 0) + 1
        for host, n in re.findall(r"(\d+\.\d+\.\d+\.\d+) x(\d+)", line):
            counts[host] = counts.get(host, 0) + int(n)
    return counts


@pytest.mark.timeout(60)
def test_store_front_summarises_refused_connections(capfd):
    """2000 connections over the caps (1500 from an address at its own cap, 500 from one over the
    cap in all) give a handful of lines: the first refusal at once, then one line per interval (1 s
    here, 10 s by default) with the counts per address; the counts add up to every refusal.
    Before: one line per connection (1750 lines for 2000 idle connections)."""
    from paratrain.distributed.store_auth import serve_bounded

    server = serve_bounded(
        "127.0.0.1", 0, timedelta(seconds=10), max_connections=6, max_per_host=4, log_interval_s=1
    )  # fmt: skip
    want = {"127.0.0.2": 1500, "127.0.0.4": 500}
    try:
        held = [_raw_client(server.port, "127.0.0.2") for _ in range(4)]
        held += [_raw_client(server.port, "127.0.0.3") for _ in range(2)]
        assert not any(_closed_by_server(s, 0.3) for s in held)  # the caps are full
        capfd.readouterr()
        start = time.monotonic()
        for host, n in want.items():
            for _ in range(n):
                socket.create_connection(("127.0.0.1", server.port), timeout=5, source_address=(host, 0)).close()
        flood_s = time.monotonic() - start
        out = ""
        for _ in range(100):  # 10 s at most: the last count comes at the end of its interval
            out += capfd.readouterr().err
            lines = [line for line in out.splitlines() if line.startswith("paratrain: ")]
            if _front_counts(lines) == want:
                break
            time.sleep(0.1)
    finally:
        server.close()
    assert _front_counts(lines) == want, "\n".join(lines)
    assert len(lines) <= 3 + flood_s, f"{len(lines)} lines for a flood of {flood_s:.1f} s:\n" + "\n".join(lines)
    assert len(lines) <= 8, "\n".join(lines)
    assert "refused or closed" in lines[-1] and "over the connection cap: 127.0.0.2 x" in out, "\n".join(lines)


def test_refusal_log_names_kinds_and_the_busiest_addresses(caplog):
    from paratrain.distributed.store_front import RefusalLog

    refusals = RefusalLog(interval=60)
    with caplog.at_level("WARNING", logger="paratrain"):
        refusals.note(
            "paratrain: closed a store connection from 10.0.0.1: a value of 9 bytes", "a value over 8 bytes", "10.0.0.1"
        )
        for i in range(8):
            for _ in range(i + 1):
                refusals.note("-", "over the connection cap", f"10.0.1.{i}")
        refusals.note("-", "a value over 8 bytes", "10.0.0.1")
        assert len(caplog.records) == 1 and refusals.wait_s() > 50  # counted until the interval ends
        refusals.flush(force=True)
    first, summary = (r.getMessage() for r in caplog.records)
    assert first.endswith("from 10.0.0.1: a value of 9 bytes")
    assert summary.startswith("paratrain: refused or closed 37 more store connections in the last 0.0 s (")
    assert "a value over 8 bytes: 10.0.0.1 x1; over the connection cap: 10.0.1.7 x8, 10.0.1.6 x7, " in summary
    assert summary.endswith("10.0.1.3 x4, 3 more addresses x6)"), summary


@pytest.mark.slow  # > 12 s: two launches of a two-node job
@pytest.mark.timeout(600)
def test_a_requeued_job_refuses_bootstrap_values_replayed_from_its_last_launch(tmp_path):
    """The attack of issue 55 (item 1) on real launches: a two-node job on
    `paratrain rendezvous serve` runs to its end; a peer without the secret copies the signed
    MASTER_ADDR/MASTER_PORT of round 0, deletes the job's state key, starts its own TCPStore on
    the old port and writes the copies back every 2 ms; the job is launched again with the same
    config, secret and id. Before: rank 1's worker set up its process group through the peer's
    store and rank 0 hung without a word. Now each node exits 2 with one line naming the replay,
    and nobody connects to the peer's store."""
    import json
    import subprocess
    import sys
    import threading

    from paratrain.testing.resilience import start_server

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "src")]), "OMP_NUM_THREADS": "1"}
    env["PARATRAIN_JOB_SECRET"] = "the-secret-of-every-launch"
    server, port = start_server()

    def node(rank: int, out) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "paratrain", "train", "configs/debug.toml", "--nnodes", "2"]
        cmd += ["--nproc-per-node", "1", "--node-rank", str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}"]
        cmd += ["--rdzv-conf", "is_host=false", "--rdzv-id", "requeued"]
        cmd += ["--set", "run.steps=2", "--set", "run.progress=false", "--set", f"run.out_dir='{out}'"]
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    keys = ["torch.rendezvous.requeued.0/MASTER_ADDR", "torch.rendezvous.requeued.0/MASTER_PORT"]
    stop, nodes, attacker = threading.Event(), [], None
    try:
        nodes = [node(r, tmp_path / "launch1") for r in (0, 1)]
        outs = [p.communicate(timeout=150)[0] for p in nodes]  # 2 x 150 + 2 x 120 s: inside the case's 600 s
        assert [p.returncode for p in nodes] == [0, 0], "\n".join(o[-2000:] for o in outs)

        peer = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        copies = peer.multi_get(keys)
        body = json.loads(copies[1].partition(b":")[2])  # signed, not secret: HMAC:JSON of base64
        old_port = int(base64.b64decode(body["value"] if isinstance(body, dict) else body))
        peer.delete_key("paratrain.rendezvous.requeued")
        attacker = dist.TCPStore("127.0.0.1", old_port, is_master=True, wait_for_workers=False)

        def replay() -> None:
            for _ in range(150_000):  # 300 s at most
                if stop.is_set():
                    return
                peer.multi_set(keys, copies)
                time.sleep(0.002)

        threading.Thread(target=replay, daemon=True).start()
        nodes = [node(r, tmp_path / "launch2") for r in (0, 1)]
        outs = []
        for p in nodes:
            try:
                outs.append(p.communicate(timeout=120)[0])
            except subprocess.TimeoutExpired:
                p.kill()
                outs.append("(hung: killed after 120 s)\n" + p.communicate()[0])
        redirected = attacker.list_keys()
    finally:
        stop.set()
        for p in [*nodes, server]:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert not redirected, f"a worker of launch 2 used the peer's store: {redirected}"
    for p, out in zip(nodes, outs):
        errors = [line for line in out.splitlines() if line.startswith("paratrain: error:")]
        assert p.returncode == 2 and len(errors) == 1 and "Traceback" not in out, out[-3000:]
        assert "signed by this job for another launch or round" in errors[0], errors[0]
    assert not (tmp_path / "launch2" / "metrics.jsonl").exists()
