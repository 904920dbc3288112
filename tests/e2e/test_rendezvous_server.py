"""`paratrain rendezvous serve`: the rendezvous store as a process of its own, so an elastic job
survives the loss of any training node (node 0 included) and a restart of the server itself.

The slow tests run loopback "nodes" (tests/test_resilience.start_node) and compare the survivor's
losses with the uninterrupted single-process run's, as the other elastic tests do."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from paratrain import cli
from paratrain.distributed.process_group import free_port
from paratrain.testing.dist_utils import REPO, kill_tree
from paratrain.testing.resilience import (
    GPT_ARGS,
    SERVED,
    assert_same_losses,
    run,
    start_node,
    start_server,
    wait_for_rows,
)


def test_serve_prints_its_address_serves_and_stops_on_sigterm(capsys):
    """In-process (fast): the ready line, a client's set/get, a second server on the port (one
    line, exit 2), then SIGTERM: serve returns 0 with its last line."""
    from paratrain.distributed.rendezvous import serve

    lines, seen = [], {}

    def ready(line: str) -> None:
        lines.append(line)
        if len(lines) > 1:
            return
        port = int(line.split("127.0.0.1:")[1].split()[0])
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        client.set("k", "v")
        seen["get"] = client.get("k")
        seen["rc"] = cli.main(["rendezvous", "serve", "--bind", "127.0.0.1", "--port", str(port)])
        os.kill(os.getpid(), signal.SIGTERM)  # the server's own handler is installed: it stops

    assert serve(0, "127.0.0.1", ready=ready) == 0
    assert lines[0].startswith("paratrain rendezvous: serving on 127.0.0.1:") and "is_host=false" in lines[0]
    assert lines[1:] == ["paratrain rendezvous: stopped (SIGTERM)"]
    assert seen["get"] == b"v" and seen["rc"] == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot listen there (Address already in use)" in err[0], err
    assert signal.getsignal(signal.SIGTERM) is not None  # the previous handler is back


@pytest.mark.parametrize(
    "args,message",
    [
        (["--bind", "nosuch.invalid"], "--bind nosuch.invalid --port 29400: cannot listen there"),
        (["--bind", "127.0.0.1", "--port", "70000"], "--port 70000: expected a port within 0..65535"),
    ],
)
def test_serve_bad_input_is_one_line_exit_2(capsys, args, message):
    assert cli.main(["rendezvous", "serve", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"paratrain: error: {message}"), err


def test_is_host_must_be_a_boolean(capsys):
    argv = ["train", "configs/debug.toml", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1"]
    assert cli.main([*argv, "--rdzv-conf", "is_host=maybe"]) == 2
    assert "is_host=maybe is not true or false" in capsys.readouterr().err


def test_only_node_rank_0_may_host_the_rendezvous_store():
    from paratrain.launch.agent import LaunchSpec, torchrun_args

    def conf(rank: int, extra: str = "") -> str:
        spec = LaunchSpec(nnodes=2, node_rank=rank, rdzv_endpoint="127.0.0.1:29500", rdzv_conf=extra)
        args = torchrun_args(spec, "m", [])
        return args[args.index("--rdzv-conf") + 1]

    assert "is_host" not in conf(0)  # the endpoint's machine decides (rendezvous._create_store)
    assert conf(1).endswith(",is_host=false")
    assert conf(1, "is_host=true").count("is_host") == 1  # the user's word stands


@pytest.fixture(scope="module")
def want(tmp_path_factory):
    return run(str(tmp_path_factory.mktemp("ref") / "one"), 1, ["run.steps=8"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_served_job_survives_the_loss_of_node_0(tmp_path, want):
    """A server hosts the rendezvous; nodes --node-rank 0 and 1 (is_host=false); node 0's whole
    tree (the node that would host the store without a server) is SIGKILLed after step 3: node 1
    finishes alone with the uninterrupted run's losses. Node 1's loss is the end of the next test,
    so one job per victim would launch the same job twice."""
    victim = 0
    server, port = start_server()
    out = str(tmp_path / "run")
    nodes = [start_node(out, port, [], args=("--node-rank", str(r), *SERVED)) for r in (0, 1)]
    survivor = nodes[1 - victim]
    try:
        wait_for_rows(out, 3, survivor, timeout=240)
        t_kill = time.time()
        kill_tree(nodes[victim].pid)
        nodes[victim].communicate()
        _, err = survivor.communicate(timeout=300)
        assert survivor.returncode == 0, err[-4000:]
        assert_same_losses(out, want)
        print(f"node {victim} killed -> job done alone: {time.time() - t_kill:.1f} s")
    finally:
        for p in [*nodes, server]:
            kill_tree(p.pid)
            p.communicate()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_served_job_survives_a_server_restart_then_a_node_loss(tmp_path, want):
    """The server is SIGKILLed after step 2 and started again on its port (empty): the job trains
    on, the agents reconnect and write back the last state they verified; node 1 is then killed
    and node 0 goes through a new rendezvous on the restarted server and finishes alone."""
    port = free_port()
    server, _ = start_server(port)
    out = str(tmp_path / "run")
    slower = [f"model.args={GPT_ARGS[:-1]}, forward_sleep_s = 2.0}}"]  # the job outlasts the restart
    nodes = [start_node(out, port, slower, args=("--node-rank", str(r), *SERVED)) for r in (0, 1)]
    try:
        wait_for_rows(out, 2, nodes[0], timeout=240)
        server.kill()
        server.communicate()
        time.sleep(2)  # the agents' keep-alives (every second) find the store gone
        server, _ = start_server(port)
        wait_for_rows(out, 4, nodes[0], timeout=120)  # trained on meanwhile
        assert all(n.poll() is None for n in nodes), [n.poll() for n in nodes]
        kill_tree(nodes[1].pid)
        nodes[1].communicate()
        _, err = nodes[0].communicate(timeout=300)
        assert nodes[0].returncode == 0, err[-4000:]
        assert "reconnected to the rendezvous store" in err, err[-4000:]
        assert_same_losses(out, want)
    finally:
        for p in [*nodes, server]:
            kill_tree(p.pid)
            p.communicate()


def test_importing_the_rendezvous_module_first_registers_its_handler_quietly():
    """`paratrain rendezvous serve` imports it before anything else: torch's rendezvous package then
    loads the entry point while the module is half imported. No warning, and the handler works."""
    code = (
        "import paratrain.distributed.rendezvous\n"
        "from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as r\n"
        "assert 'paratrain' in r._registry  # torch keeps no public lookup\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "src")])}
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert res.returncode == 0 and "Exception while registering" not in res.stderr, res.stderr[-2000:]
