"""bench comm (arithmetic, value checks, end to end) and gradient compression (DDP comm hooks)."""

from __future__ import annotations

import json

import pytest
import torch

from paratrain.config import CommConfig, ConfigError, load_config
from paratrain.distributed.grad_compression import check_compression
from paratrain.hardware import bench_comm as bc
from paratrain.testing.dist_utils import paratrain_cli, plain_sgd, read_metrics, run_ranks

# ----------------------------------------------------------------------------- pure arithmetic


@pytest.mark.parametrize("n", [2, 4, 8])
def test_bus_factors_follow_nccl_tests(n):
    assert bc.bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bc.bus_factor(op, n) == pytest.approx((n - 1) / n)
    assert bc.bus_factor("broadcast", n) == 1.0
    assert bc.bus_factor("send_recv", n) == 1.0
    algbw, busbw = bc.bandwidths("all_reduce", 2 * 10**9, 0.5, n)
    assert algbw == pytest.approx(4.0)  # 2e9 bytes in 0.5 s = 4 GB/s
    assert busbw == pytest.approx(4.0 * 2 * (n - 1) / n)


def test_default_sizes_span_kib_to_64mib():
    sizes = bc.default_sizes()
    assert sizes[0] == 4096 and sizes[-1] == 64 * 2**20
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:]))
    assert bc.default_sizes(5000, 70000) == [8192, 16384, 32768, 65536]


def _simulate(op: str, n: int, numel: int) -> list[torch.Tensor]:
    """What each rank should hold, computed by doing the collective by hand on all inputs."""
    ins = [bc.make_input(op, r, n, numel) for r in range(n)]
    c = numel // n
    if op == "all_reduce":
        return [sum(ins)] * n
    if op == "broadcast":
        return [ins[0]] * n
    if op == "all_gather":
        return [torch.cat(ins)] * n
    if op == "reduce_scatter":
        total = sum(ins)
        return [total[r * c : (r + 1) * c] for r in range(n)]
    if op == "all_to_all":
        return [torch.cat([ins[s][r * c : (r + 1) * c] for s in range(n)]) for r in range(n)]
    if op == "send_recv":
        return [ins[(r - 1) % n] for r in range(n)]
    raise AssertionError(op)


@pytest.mark.parametrize("op", bc.OPS)
@pytest.mark.parametrize("n", [2, 3])
def test_closed_form_expectations_match_the_collective_done_by_hand(op, n):
    numel = bc.numel_for(op, 4096, n, 4)
    for r, want in enumerate(_simulate(op, n, numel)):
        exp = bc.expected_output(op, r, n, numel, peer=(r - 1) % n)
        assert bc.check_result(op, want, exp, rank=r, nbytes=4096) is None


def test_a_wrong_result_is_caught():
    n, numel = 4, 1024
    exp = bc.expected_output("all_reduce", 0, n, numel)
    # A sum that missed one rank's contribution.
    missing = sum(bc.make_input("all_reduce", r, n, numel) for r in range(n - 1))
    msg = bc.check_result("all_reduce", missing, exp, rank=0, nbytes=numel * 4)
    assert msg and "wrong values at 1024 of 1024" in msg
    # One corrupted element.
    bad = exp.clone()
    bad[17] += 1
    assert "first at 17" in bc.check_result("all_reduce", bad, exp, rank=0, nbytes=numel * 4)
    # all_to_all chunks delivered in the wrong order.
    a2a = bc.expected_output("all_to_all", 1, n, numel)
    swapped = torch.cat(list(reversed(a2a.chunk(n))))
    assert bc.check_result("all_to_all", swapped, a2a, rank=1, nbytes=numel * 4)
    # A message from the wrong peer.
    assert bc.check_result("send_recv", bc.pattern(2, 64), bc.pattern(1, 64), rank=0, nbytes=256)
    assert "shape" in bc.check_result("all_gather", exp[:10], exp, rank=0, nbytes=4096)


def test_slow_pairs_ranks_and_node_pairs_are_flagged_against_their_own_kind():
    nodes = ["a", "a", "b", "b"]
    times = {p: (1e-3 if nodes[p[0]] == nodes[p[1]] else 10e-3) for p in bc.rank_pairs(4)}
    # inter-node pairs are 10x slower by design: nothing is flagged
    assert bc.analyse_pairs(times, nodes, 2.0)["flags"] == []
    times[(0, 2)] = 50e-3  # one bad cross-node link
    flags = bc.analyse_pairs(times, nodes, 2.0)["flags"]
    assert [f["ranks"] for f in flags if f["what"] == "pair"] == [[0, 2]]
    # A slow rank: every pair it is in is slow.
    nodes8 = ["x"] * 8
    t8 = {p: (9e-3 if 5 in p else 1e-3) for p in bc.rank_pairs(8)}
    flags = bc.analyse_pairs(t8, nodes8, 2.0)["flags"]
    assert [f["rank"] for f in flags if f["what"] == "rank"] == [5]
    assert len(bc.rank_pairs(64)) < 64 * 63 // 2  # large jobs scan a subset


# ----------------------------------------------------------------------------- with a process group
# One spawned world-2 job runs every multi-rank check of this file (a broken collective, then
# the debug GPT under each compression) in the same processes: spawning costs more than training.

DEBUG = [
    "model.args={n_layer = 2, n_head = 2, d_model = 32, block_size = 32}",
    "data.args={block_size = 32, max_bytes = 50_000}",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=2",
    "run.steps=6",
    "run.progress=false",
    "run.save_model=false",
    "metrics.plot=false",
    "optim.lr=1e-3",
    "optim.warmup_steps=2",
]
SETTINGS = {
    "none": [],
    "bf16": ["comm.compression='bf16'"],
    "fp16": ["comm.compression='fp16'"],
    # rank 1: the debug GPT's 32-wide matrices need it for 10x (rank r sends (n+m)r of n*m numbers)
    "powersgd": ["comm.compression='powersgd'", "comm.powersgd_rank=1", "comm.powersgd_start_step=2"],
    # No compression under plain SGD, compared with one process to 1e-5 over 6 steps (AdamW, the
    # others' optimiser, grows the reduction order's rounding step by step past such a bound).
    "none_sgd": plain_sgd(0.3),
}


def _broken_all_reduce(env: bc.Env) -> str:
    import torch.distributed as dist

    def max_instead_of_sum(op, env, inp, out, shift=1):
        dist.all_reduce(inp, op=dist.ReduceOp.MAX)

    try:
        bc.measure("all_reduce", 4096, env, warmup=0, iters=1, run_op=max_instead_of_sum)
    except bc.BenchError as e:
        return str(e)
    return "not caught"


def _world2_job(out_dir: str) -> dict:
    import torch.distributed as dist

    import paratrain

    dist.init_process_group("gloo")  # shared by every run below (train() reuses an existing group)
    try:
        result = {"broken": _broken_all_reduce(bc.Env(dist.get_rank(), 2, torch.device("cpu"), torch.float32))}
        for name, extra in SETTINGS.items():
            cfg = paratrain.load_config("configs/debug.toml", [*DEBUG, f"run.out_dir='{out_dir}/{name}'", *extra])
            result[name] = paratrain.train(cfg)["losses"]
        return result
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    out = tmp_path_factory.mktemp("world2")
    ranks = run_ranks(_world2_job, 2, str(out))
    for name in SETTINGS:
        assert ranks[1][name] == ranks[0][name]  # every rank agrees on the (all-reduced) loss
    return {name: (ranks[0][name], read_metrics(str(out / name))) for name in SETTINGS} | {
        "broken": [r["broken"] for r in ranks]
    }


def test_a_broken_collective_is_an_error_on_every_rank(world2):
    assert all("wrong values" in m for m in world2["broken"]), world2["broken"]


@pytest.mark.slow  # > 12 s: make test stays under 10 minutes
def test_bench_comm_end_to_end_writes_json_and_png(tmp_path):
    js, png = tmp_path / "comm.json", tmp_path / "comm.png"
    r = paratrain_cli(
        "bench",
        "comm",
        "--nproc-per-node",
        "2",
        "--max-bytes",
        "65536",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--json",
        str(js),
        "--plot",
        str(png),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "busbw" in r.stdout and "all_reduce" in r.stdout
    report = json.loads(js.read_text())
    rows = report["results"]
    assert {row["op"] for row in rows} == set(bc.OPS)
    assert sorted({row["bytes"] for row in rows if row["op"] == "all_reduce"}) == [2**k for k in range(12, 17)]
    for row in rows:
        assert {"op", "bytes", "time_s", "algbw_gbps", "busbw_gbps"} <= row.keys() and row["checked"]
        assert row["time_min_s"] <= row["time_s"] <= row["time_max_s"]
        assert row["algbw_gbps"] == pytest.approx(row["bytes"] / row["time_s"] / 1e9)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * bc.bus_factor(row["op"], 2))
    assert report["pairs"] and report["pairs"][0]["ranks"] == [0, 1]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_comm_bad_option_exits_2():
    r = paratrain_cli("bench", "comm", "--ops", "all_reduce,allreduce")
    assert r.returncode == 2 and "--ops" in r.stderr and "Traceback" not in r.stderr


# ----------------------------------------------------------------------------- gradient compression


def deviation_over_change(losses: list[float], ref: list[float]) -> float:
    """The largest per-step loss difference as a fraction of the reference's loss change over the
    run (5.56 -> 5.30 here): a bound relative to the loss itself (5% of 5.5 = 0.28) would exceed
    the whole change and pass any compression."""
    change = abs(ref[0] - ref[-1])
    assert change > 0.2, ref  # the loss moved: there is something to compare against
    return max(abs(a - b) for a, b in zip(losses, ref)) / change


def test_none_keeps_the_exact_math(tmp_path, world2):
    """'none' is DDP's own bucket all-reduce (no hook): the same losses as one process, bytes counted."""
    import paratrain

    one = [*DEBUG, *SETTINGS["none_sgd"], f"run.out_dir='{tmp_path}'"]
    ref = paratrain.train(paratrain.load_config("configs/debug.toml", one))["losses"]
    losses, rows = world2["none_sgd"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=0)
    assert all("comm_bytes" not in r for r in read_metrics(str(tmp_path)))  # one process: nothing sent
    n_params = 2 * (4 * 32 * 32 + 3 * 32 + 2 * 32 * 128 + 128 + 32 + 4 * 32) + 2 * 256 * 32 + 32 * 32 + 2 * 32
    assert all(r["comm_bytes"] == 4 * n_params for r in rows)  # every fp32 gradient, once per step


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_half_precision_compression_stays_close_and_halves_bytes(world2, kind):
    ref, ref_rows = world2["none"]
    losses, rows = world2[kind]
    assert len(losses) == len(ref) == 6
    assert deviation_over_change(losses, ref) < 0.01  # measured 3e-5 (bf16), 1e-5 (fp16)
    assert losses != ref  # it did compress
    assert all(r["comm_bytes"] * 2 == rr["comm_bytes"] for r, rr in zip(rows, ref_rows))


def test_powersgd_stays_close_and_sends_ten_times_fewer_bytes(world2):
    ref, ref_rows = world2["none"]
    losses, rows = world2["powersgd"]
    assert deviation_over_change(losses, ref) < 0.1  # measured 0.033 (rank 1, from step 2)
    assert losses[3:] != ref[3:]
    full = ref_rows[0]["comm_bytes"]
    assert [r["comm_bytes"] for r in rows[:2]] == [full, full]  # plain all-reduce before the start step
    for r in rows[2:]:
        assert r["comm_bytes"] * 10 <= full, (r["comm_bytes"], full)


def test_compression_config_errors():
    with pytest.raises(ConfigError, match="dp_shard"):
        check_compression(CommConfig(compression="powersgd"), dp_replicate=1, dp_shard=2)
    check_compression(CommConfig(compression="bf16"), dp_replicate=1, dp_shard=2)  # via reduce_dtype
    with pytest.raises(ConfigError, match="powersgd_start_step"):
        check_compression(CommConfig(compression="powersgd", powersgd_start_step=1), dp_replicate=2, dp_shard=1)
    with pytest.raises(ConfigError, match="comm.bucket_mb"):
        load_config(None, ["parallel.ddp_bucket_mb=10"])
    with pytest.raises(ConfigError, match="comm.compression"):
        load_config(None, ["comm.compression='int8'"])
    assert load_config(None, ["comm.bucket_mb=4"]).comm.bucket_mb == 4.0
