"""`paratrain env`: runs on CPU, and its checks find the problems they are about."""

from __future__ import annotations

import json

from paratrain.hardware.env import collect, compare_ranks, find_problems
from paratrain.testing.dist_utils import paratrain_cli


def _info(**over) -> dict:
    base = {
        "host": "n1",
        "host_resolves_to": "10.0.0.1",
        "python": "3.11.7",
        "torch": "2.13.0",
        "cuda_build": "12.8",
        "cuda_available": True,
        "nccl": "2.27.3",
        "cpu_count": 32,
        "gpus": [{"index": i} for i in range(8)],
        "gpu_topology": "GPU0 X NV18",
        "variables": {},
        "interfaces": [
            {"name": "lo", "state": "unknown", "kind": "loopback", "addresses": []},
            {"name": "eth0", "state": "up", "kind": "ethernet/other", "addresses": ["10.0.0.1/24"]},
        ],
    }
    return {**base, **over}


def _problems(info, **kw) -> str:
    return "\n".join(p["problem"] + " -> " + p["advice"] for p in find_problems(info, **kw))


def test_a_clean_gpu_node_has_no_problem():
    assert find_problems(_info(), nnodes=2, nproc_per_node=8) == []


def test_several_interfaces_without_ifname():
    ifaces = _info()["interfaces"] + [
        {"name": "ib0", "state": "up", "kind": "infiniband", "addresses": ["192.168.1.2/24"]}
    ]
    text = _problems(_info(interfaces=ifaces))
    assert "NCCL_SOCKET_IFNAME is not set" in text and "GLOO_SOCKET_IFNAME is not set" in text
    ok = _info(interfaces=ifaces, variables={"NCCL_SOCKET_IFNAME": "ib", "GLOO_SOCKET_IFNAME": "ib0"})
    assert find_problems(ok) == []
    wrong = _problems(_info(variables={"NCCL_SOCKET_IFNAME": "enp1s0"}))
    assert "NCCL_SOCKET_IFNAME=enp1s0 matches no interface" in wrong


def test_p2p_disabled_gloo_on_gpus_and_other_problems():
    assert "peer-to-peer" in _problems(_info(variables={"NCCL_P2P_DISABLE": "1"}))
    assert "CUDA devices are visible but the backend is gloo" in _problems(_info(), backend="gloo")
    assert "no CUDA device" in _problems(_info(cuda_available=False, gpus=[]), backend="nccl")
    assert "only 8 GPU(s)" in _problems(_info(), nproc_per_node=16)
    assert "no NVLink" in _problems(_info(gpu_topology="GPU0 X PHB"))
    assert "loopback address" in _problems(_info(host_resolves_to="127.0.1.1"), nnodes=2)
    assert "InfiniBand" in _problems(_info(variables={"NCCL_IB_DISABLE": "1"}), nnodes=2)
    assert "every collective" in _problems(_info(variables={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}))
    assert "oversubscribe" in _problems(
        _info(cuda_available=False, gpus=[], cpu_count=4, variables={"OMP_NUM_THREADS": "4"}), nproc_per_node=2
    )


def test_mismatched_versions_across_ranks():
    ranks = [_info(), _info(), _info(host="n2", torch="2.12.1"), _info(host="n2", torch="2.12.1")]
    (p,) = compare_ranks(ranks)
    assert "mismatched torch versions" in p["problem"] and "2.12.1 on ranks 2,3" in p["problem"]
    assert compare_ranks([_info(), _info()]) == []


def test_collect_on_this_machine():
    info = collect()
    assert info["torch"] and info["gloo_available"] and isinstance(info["interfaces"], list)
    assert "MASTER_PORT (init_method env://, plain torchrun)" in info["rendezvous_defaults"]


def test_env_cli_runs_on_cpu_and_writes_json(tmp_path):
    r = paratrain_cli("env", env={"NCCL_P2P_DISABLE": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "torch" in r.stdout and "network interfaces" in r.stdout and "NCCL_P2P_DISABLE=1" in r.stdout
    assert "peer-to-peer" in r.stdout  # the problem is reported with its advice
    r = paratrain_cli("env", "--json")
    data = json.loads(r.stdout)
    assert {"info", "problems", "ranks"} <= data.keys() and data["info"]["torch"]


def test_env_under_the_launcher_compares_ranks(tmp_path):
    js = tmp_path / "env.json"
    r = paratrain_cli("env", "--nproc-per-node", "2", "--json", str(js))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ranks (2)" in r.stdout
    data = json.loads(js.read_text())
    assert len(data["ranks"]) == 2 and not any("mismatched" in p["problem"] for p in data["problems"])
    # What each rank listens on (docs/security.md): loopback for one node; the secret's value never shown.
    assert [r["listen"]["address"] for r in data["ranks"]] == ["127.0.0.1", "127.0.0.1"]
    assert all(r["listen"]["job_secret"] == "set" for r in data["ranks"])
    assert not any("SECRET" in k for rank in data["ranks"] for k in rank["variables"])
    assert "listens on 127.0.0.1" in r.stdout
