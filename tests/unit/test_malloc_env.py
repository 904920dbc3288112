"""The launcher's allocator settings for its workers (launch/agent.py MALLOC_ENV, docs/overhead.md):
set unless the user set them, restored after, and they do keep a step's large tensors from
faulting their pages back in (glibc only)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from paratrain.launch.agent import MALLOC_ENV, LaunchSpec, prepare_node

# A step's two 32 MiB tensors made and freed 10 times: the minor page faults per round.
FAULTS = """
import resource, torch
x = torch.randn(2048, 4096)
def rounds(n):
    for _ in range(n):
        y = torch.log_softmax(x, -1); z = y * 2; del y, z
rounds(1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds(10)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


def test_workers_get_the_settings_unless_the_user_set_them(monkeypatch):
    for key in MALLOC_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "12345")  # the user's own: kept
    _, restore = prepare_node(LaunchSpec(nproc_per_node=2))
    try:
        assert os.environ["MALLOC_MMAP_THRESHOLD_"] == MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]
        assert os.environ["MALLOC_TRIM_THRESHOLD_"] == "12345"
    finally:
        restore()
    assert "MALLOC_MMAP_THRESHOLD_" not in os.environ and os.environ["MALLOC_TRIM_THRESHOLD_"] == "12345"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_the_settings_keep_large_tensors_from_faulting_back_in():
    def faults(extra: dict) -> float:
        env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV}
        out = subprocess.run(
            [sys.executable, "-c", FAULTS],
            env={**env, **extra, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            check=True,
        )
        return float(out.stdout.split()[-1])

    plain, tuned = faults({}), faults(MALLOC_ENV)
    # Each 32 MiB tensor is 8192 pages: glibc maps both anew every round (16,386 faults here);
    # kept in the heap, a quarter of that remains (4,096).
    assert plain > 8192 and tuned < plain / 2, (plain, tuned)
