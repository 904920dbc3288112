"""Many jobs on one rendezvous server: each its own id, replayed or unsigned states refused, and
the two refusals a joining node can meet (another secret, another job) told apart.

Loopback and in-process stores only (a HashStore, or a TCPStore on 127.0.0.1)."""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from paratrain import cli
from paratrain.config import ConfigError, load_config
from paratrain.distributed import rendezvous
from paratrain.distributed.store_auth import sign
from paratrain.launch.agent import LaunchSpec, torchrun_args

KEY = "paratrain.rendezvous.job"
A, B = _NodeDesc("node-a", 11, 0), _NodeDesc("node-b", 12, 0)


def _state(round_: int, *, participants=(), waiting=()) -> _RendezvousState:
    s = _RendezvousState()
    s.round = round_
    s.participants = {n: r for r, n in enumerate(participants)}
    s.wait_list = set(waiting)
    return s


def _backend(store, secret: str = "s", job: str = "j1", run_id: str = "job"):
    return rendezvous.ParatrainRendezvousBackend(store, run_id, secret=secret, endpoint="127.0.0.1:1", job=job)


def test_an_unsigned_json_state_is_refused(caplog):
    """JSON is what the nodes write, so an unsigned JSON state is the forgery closest to a real one."""
    store = dist.HashStore()
    node = _backend(store)
    bits, token, ok = node.set_state(pickle.dumps(_state(1, participants=[A])))
    assert ok
    forged = _state(7, participants=[A, B])
    for value in (
        json.dumps({"job": "j1", "version": 99, "state": rendezvous.encode_state(forged)}),  # our body, no HMAC
        json.dumps(rendezvous.encode_state(forged)),  # the bare state
        "0" * 64 + ":" + json.dumps({"job": "j1", "version": 99, "state": rendezvous.encode_state(forged)}),
    ):
        store.set(KEY, value)
        with pytest.raises(RendezvousStateError, match="refused to join"):
            _backend(store).get_state()  # a node that has verified nothing does not join on it
        caplog.clear()
        with caplog.at_level("ERROR", logger="paratrain"):
            got, token = node.get_state()  # a running node keeps its last verified state
        assert pickle.loads(got).round == 1 and "without the job secret" in caplog.text, value
    _, _, ok = node.set_state(pickle.dumps(_state(1, participants=[A])), token)
    assert ok and pickle.loads(_backend(store).get_state()[0]).round == 1  # replaced by a signed state


def test_a_replayed_state_is_refused_in_one_line(caplog):
    """An earlier validly signed state (round 1, with a wait list) written back after round 2."""
    store = dist.HashStore()
    a, b = _backend(store), _backend(store)
    _, token, ok = a.set_state(pickle.dumps(_state(1, participants=[A], waiting=[B])))
    assert ok
    old = store.get(KEY)
    _, token, ok = a.set_state(pickle.dumps(_state(1, participants=[A, B])), token)  # same round, newer
    assert ok
    _, token, ok = a.set_state(pickle.dumps(_state(2, participants=[A, B])), token)
    assert ok and pickle.loads(b.get_state()[0]).round == 2
    newer = store.get(KEY)
    for replay in (old, newer):  # an older round, and after the next write the same round's older version
        store.set(KEY, replay)
        caplog.clear()
        with caplog.at_level("ERROR", logger="paratrain"):
            got, token = b.get_state()
            b.get_state()  # said once per value
        if replay is old:
            assert pickle.loads(got).round == 2
            lines = caplog.text.strip().splitlines()
            assert len(lines) == 1 and "older than the one this node has seen" in lines[0], lines
            assert "round 1 version 0, seen round 2 version 2" in lines[0], lines[0]
            _, _, ok = b.set_state(pickle.dumps(_state(2, participants=[A, B])), token)  # the keep-alive
            assert ok and pickle.loads(a.get_state()[0]).round == 2  # a moved on to version 3
        else:
            assert "older than the one this node has seen" in caplog.text and "version 2, seen round 2 version 3" in (
                caplog.text
            )


def test_another_secret_and_another_job_are_two_different_lines():
    store = dist.HashStore()
    _backend(store, secret="s1", job="j1").set_state(pickle.dumps(_state(1, participants=[A])))
    with pytest.raises(RendezvousStateError) as same_job:
        _backend(store, secret="s2", job="j1").get_state()
    with pytest.raises(RendezvousStateError) as other_job:
        _backend(store, secret="s2", job="j2").get_state()
    same, other = str(same_job.value), str(other_job.value)
    assert "\n" not in same and "\n" not in other
    assert "a node of this job signed its state with another job secret" in same, same
    assert "PARATRAIN_JOB_SECRET or --job-secret-file" in same
    assert "another job (another config) uses that rendezvous id there" in other, other
    assert "give each job its own --rdzv-id" in other
    # A value that says nothing readable: the line names both causes.
    store.set(KEY, "garbage")
    with pytest.raises(RendezvousStateError, match="a node with another secret, or another job with this --rdzv-id"):
        _backend(store, secret="s2", job="j1").get_state()


def test_each_job_gets_its_own_rendezvous_id(tmp_path):
    """The default id comes from what defines the job's math: the nodes of a job share it even
    with node-local out_dirs, and two jobs that differ in anything of it never do."""

    def rdzv(*sets: str, **kw) -> tuple[str, str]:
        spec = LaunchSpec(nnodes=2, rdzv_endpoint="127.0.0.1:29400", **kw)
        spec.validate()
        a = torchrun_args(spec, "m", [], job=load_config("configs/debug.toml", list(sets)))
        return a[a.index("--rdzv-id") + 1], a[a.index("--rdzv-conf") + 1]

    node0, conf = rdzv(f"run.out_dir='{tmp_path / 'node0'}'")
    node1, _ = rdzv(f"run.out_dir='{tmp_path / 'node1'}'")
    assert node0 == node1 and node0.startswith("job-") and f"job={node0.removeprefix('job-')}" in conf
    others = {
        rdzv(s)[0] for s in ("optim.lr=0.01", "run.seed=1", "batch.global_batch_size=16", "data.args.max_bytes=1")
    }
    assert len(others) == 4 and node0 not in others
    assert rdzv(rdzv_id="team-7")[0] == "team-7"
    with pytest.raises(ConfigError, match="--rdzv-id 'a b': use 1 to 64 letters"):
        LaunchSpec(nnodes=2, rdzv_endpoint="127.0.0.1:29400", rdzv_id="a b").validate()


def test_bad_rdzv_id_is_one_line_exit_2(tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text("")
    argv = ["train", str(config), "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "x/y"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("paratrain: error: --rdzv-id 'x/y'"), err


def test_the_server_logs_joins_and_leaves_per_job():
    """In-process `rendezvous serve`: two jobs write their states through loopback clients."""
    lines: list[str] = []

    def jobs(port: int) -> None:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        one = _backend(client, secret="s1", job="j1", run_id="job-one")
        two = _backend(client, secret="s2", job="j2", run_id="job-two")
        _, t1, _ = one.set_state(pickle.dumps(_state(1, participants=[A, B])))
        two.set_state(pickle.dumps(_state(1, participants=[A])))
        time.sleep(1.6)
        one.set_state(pickle.dumps(_state(1, participants=[B])), t1)
        time.sleep(1.6)
        os.kill(os.getpid(), signal.SIGTERM)

    def ready(line: str) -> None:
        lines.append(line)
        if len(lines) == 1:
            port = int(line.split("127.0.0.1:")[1].split()[0])
            threading.Thread(target=jobs, args=(port,), daemon=True).start()

    assert rendezvous.serve(0, "127.0.0.1", ready=ready) == 0
    body = [line.removeprefix("paratrain rendezvous: ") for line in lines[1:-1]]
    assert sorted(body) == sorted(
        [
            "job job-one: round 1: node-a pid 11, node-b pid 12 joined (2 nodes)",
            "job job-two: round 1: node-a pid 11 joined (1 node)",
            "job job-one: round 1: node-a pid 11 left (1 node)",
        ]
    ), lines
    assert body[-1] == "job job-one: round 1: node-a pid 11 left (1 node)"


def test_the_server_log_skips_what_is_not_a_state():
    store = dist.HashStore()
    store.set(KEY, "x" * 100)
    store.set("paratrain.rendezvous.big", "y" * (rendezvous._MAX_LOGGED_VALUE + 1))
    store.set("torch.rendezvous.job.1/MASTER_ADDR", "10.0.0.1")
    assert rendezvous.JobLog().poll(store) == []
    store.set(KEY, sign("s", KEY, {"job": "", "version": 0, "state": rendezvous.encode_state(_state(1))}))
    assert rendezvous.JobLog().poll(store) == ["paratrain rendezvous: job job: waiting for nodes"]


@pytest.mark.timeout(120)
def test_a_server_down_is_one_line_not_a_flood(capfd, caplog):
    """A client node while its `rendezvous serve` is down, then back on the same port: one line
    when lost, one when back; no stream of torch's C++ connect errors and stack traces (each
    failed connect of a TCPStore client logged 2 errors and 2 traces: 260-390 lines a minute)."""
    from paratrain.distributed.process_group import free_port
    from paratrain.testing.dist_utils import kill_tree
    from paratrain.testing.resilience import start_server

    port = free_port()
    server, _ = start_server(port)
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    node = rendezvous.ParatrainRendezvousBackend(
        client,
        "job",
        secret="s",
        endpoint=f"127.0.0.1:{port}",
        reconnect=rendezvous._client("127.0.0.1", port, 10),
        retry_s=1,
    )
    try:
        node.set_state(pickle.dumps(_state(1, participants=[A])))
        kill_tree(server.pid)
        server.communicate()
        capfd.readouterr()
        caplog.set_level(logging.INFO, logger="paratrain")
        for _ in range(8):  # the keep-alives of 8 s down
            with pytest.raises(rendezvous.RendezvousConnectionError):
                node.get_state()
        down, ours = capfd.readouterr().err.splitlines(), [r.getMessage() for r in caplog.records]
        caplog.clear()
        server, _ = start_server(port)
        assert pickle.loads(node.get_state()[0]).round == 1  # the last verified state written back
        back, ours_back = capfd.readouterr().err.splitlines(), [r.getMessage() for r in caplog.records]
    finally:
        kill_tree(server.pid)
        server.communicate()
    assert len(ours) == 1 and "is unreachable" in ours[0] and "reconnecting every 1 s" in ours[0], down
    # torch's C++ warns once, on the first op of the dead client (its one trace); nothing after.
    assert sum(line.startswith("Exception raised from") for line in down) <= 1, "\n".join(down)
    assert len(down) < 40, "\n".join(down)
    assert len(ours_back) == 1 and ours_back[0].startswith("paratrain: reconnected to the rendezvous store"), ours_back
    assert not any(line.startswith("Exception raised from") for line in back), "\n".join(back)


def test_torchs_keep_alive_warning_and_exit_barrier_traceback_are_quiet(caplog):
    rendezvous.register()
    keep_alive = logging.getLogger("torch.distributed.elastic.rendezvous.dynamic_rendezvous")
    agent = logging.getLogger("torch.distributed.elastic.agent.server.api")
    caplog.set_level(logging.WARNING)
    keep_alive.warning(
        "The node 'n' has failed to send a keep-alive heartbeat to the rendezvous 'job' due to an error of type"
        " RendezvousConnectionError."
    )
    try:
        raise dist.DistNetworkError("Broken pipe\nException raised from sendBytes ...\nframe #0: ...")
    except dist.DistNetworkError:
        agent.exception("Error waiting on exit barrier. Elapsed: %s seconds", 0.01)
    (record,) = caplog.records
    assert record.getMessage() == (
        "paratrain: the exit barrier of the rendezvous failed (Broken pipe); this node's workers are done"
    )
    assert record.exc_info is None


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_two_jobs_on_one_server_each_survive_a_node_loss(tmp_path):
    """One `rendezvous serve`, two elastic jobs of two nodes each, with their own secrets and ids
    (job A's from its config, job B's `--rdzv-id`); a node of each is SIGKILLed after step 3. Both
    finish alone with their uninterrupted single-process runs' losses, and the server's log names
    both jobs' joins and leaves."""
    import subprocess
    import sys

    from paratrain.testing.dist_utils import REPO, kill_tree
    from paratrain.testing.resilience import (
        ELASTIC,
        SERVED,
        SGD,
        SLOW,
        TOY,
        assert_same_losses,
        run,
        start_server,
        wait_for_rows,
    )

    jobs = {"a": ([], "secret-of-a", ()), "b": (["run.seed=3"], "secret-of-b", ("--rdzv-id", "team-b"))}
    want = {j: run(str(tmp_path / f"ref-{j}"), 1, [*extra, "run.steps=8"]) for j, (extra, _, _) in jobs.items()}

    def node(job: str, rank: int, port: int) -> subprocess.Popen:
        extra, secret, args = jobs[job]
        sets = [*[a for a in TOY if not a.startswith(("model.", "run.steps"))], *SLOW, "run.steps=8", *SGD]
        sets += [f"run.out_dir='{tmp_path / job}'", "checkpoint.interval=2", *extra]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "src")]), "OMP_NUM_THREADS": "1"}
        env["PARATRAIN_JOB_SECRET"] = secret
        cmd = [sys.executable, "-m", "paratrain", "train", "configs/debug.toml", "--nproc-per-node", "1", *ELASTIC]
        cmd += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--node-rank", str(rank), *SERVED, *args]
        cmd += [x for s in sets for x in ("--set", s)]
        return subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )

    server, port = start_server()
    nodes = {(j, r): node(j, r, port) for j in jobs for r in (0, 1)}
    try:
        for j in jobs:
            wait_for_rows(str(tmp_path / j), 3, nodes[(j, 0)], timeout=300)
            kill_tree(nodes[(j, 1)].pid)
            nodes[(j, 1)].communicate()
        for j in jobs:
            _, err = nodes[(j, 0)].communicate(timeout=400)
            assert nodes[(j, 0)].returncode == 0, err[-4000:]
            assert_same_losses(str(tmp_path / j), want[j])
    finally:
        for p in [*nodes.values(), server]:
            kill_tree(p.pid)
        log = server.communicate()[0]
        for p in nodes.values():
            p.communicate()
    lines = log.splitlines()
    for job in ("team-b", "job-"):  # B's own id, A's from its config
        assert any(f"job {job}" in line and "joined (2 nodes)" in line for line in lines), log
        assert any(f"job {job}" in line and " left (1 node)" in line for line in lines), log


def test_torchs_own_keys_on_the_rendezvous_store_are_signed():
    """MASTER_ADDR/MASTER_PORT (and every value torch elastic keeps on the rendezvous store) go
    through the job secret: unreadable as plain text there, and a value written without the secret
    is refused in one line (a rendezvous error) instead of pointing the workers elsewhere."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousStoreInfo

    from paratrain.distributed.process_group import free_port

    port = free_port()
    params = RendezvousParameters(
        "paratrain", f"127.0.0.1:{port}", "job", 1, 1, is_host="true", bind_addr="127.0.0.1", local_addr="127.0.0.1"
    )
    rendezvous.set_agent_secret("s")
    try:
        handler = rendezvous.create_handler(params)
    finally:
        rendezvous.set_agent_secret(None)
    done = _state(0, participants=[A])
    done.complete = True
    handler.backend.set_state(pickle.dumps(done))  # a complete round: its key signs the round's values
    store = handler._get_store()
    info = RendezvousStoreInfo.build(0, store, "127.0.0.1", 4321)
    assert (info.master_addr, info.master_port) == ("127.0.0.1", 4321)
    peer = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))  # no secret
    key = "torch.rendezvous.job.0/MASTER_ADDR"
    assert peer.get(key) != b"127.0.0.1"  # signed: HMAC:JSON, not the bare address
    store.multi_set(["a", "b"], ["1", b"2"])
    assert store.multi_get(["a", "b"]) == [b"1", b"2"] and store.add("n", 2) == 2
    peer.set(key, "10.6.6.6")  # a peer that reaches the port redirects the workers' bootstrap
    with pytest.raises(RendezvousError) as e:
        RendezvousStoreInfo.build(1, store, "127.0.0.1")
    assert "refused the value of torch.rendezvous.job.0/MASTER_ADDR" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(NotImplementedError):
        store.compare_set("a", "1", "2")
