"""Each process's intra-op CPU threads are a function of the config and the world size, not of the node's shape."""

from __future__ import annotations

import pytest
import torch

from paratrain.config import ConfigError, load_config
from paratrain.launch import worker


def test_the_thread_rule():
    assert worker.cpu_threads(0, world_size=1) is None  # torch's default for a one-process job
    assert worker.cpu_threads(0, world_size=2) == 1
    assert worker.cpu_threads(0, world_size=8) == 1
    assert worker.cpu_threads(3, world_size=1) == 3
    assert worker.cpu_threads(3, world_size=8) == 3
    with pytest.raises(ConfigError, match="dist.cpu_threads = -1 must be >= 0"):
        load_config(None, ["dist.cpu_threads=-1"])


@pytest.mark.parametrize("omp", [None, "1", "4"])  # torchrun sets 1 only on a node of several processes
def test_a_one_process_node_of_a_two_process_job_runs_one_thread(tmp_path, monkeypatch, omp):
    seen = []
    monkeypatch.setattr(worker, "train", lambda cfg: seen.append(torch.get_num_threads()) or {})
    monkeypatch.setenv("WORLD_SIZE", "2")
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    config = tmp_path / "c.toml"
    config.write_text("")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # what a one-process node of torchrun gets on a 2-core machine
        assert worker.main([str(config)]) == 0
        assert worker.main([str(config), "--set", "dist.cpu_threads=2"]) == 0
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2]
