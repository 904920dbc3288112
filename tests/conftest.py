import atexit
import logging
import os
import shutil
import tempfile

import pytest

# pytest puts the repository root on sys.path (tests/ is a package), so factory paths into test
# modules (``tests.distributed.test_pipeline:layered_lm``) resolve here and in spawned ranks; the
# CLI subprocesses the tests start find them through PYTHONPATH.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)

# Each test process compiles into a fresh inductor cache (issue 53), as on a new machine: a cache
# left by earlier runs (under other ATen kernels, `make test-kernels`) crashed the compile test
# here with "malloc(): unaligned tcache chunk detected", and passed with a fresh one. Spawned
# ranks and CLI subprocesses inherit it; TORCHINDUCTOR_CACHE_DIR set by hand is kept.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _INDUCTOR_CACHE = tempfile.mkdtemp(prefix="paratrain-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE
    atexit.register(shutil.rmtree, _INDUCTOR_CACHE, True)

# A worker's entry point ends its process with os._exit (distributed/process_group.run_then_exit).
# Run inside pytest's own process by mistake, it would end the session with exit code 0 and no
# summary, hiding every test after it: in this process os._exit raises instead (forked children,
# e.g. tests/e2e/test_docs.py's runner, have another pid and exit for real).
_PYTEST_PID = os.getpid()
_real_exit = os._exit


def _guarded_exit(code: int = 0):
    if os.getpid() == _PYTEST_PID:
        raise RuntimeError(f"os._exit({code}) called in pytest's own process; a worker entry point ran in-process")
    _real_exit(code)


os._exit = _guarded_exit


@pytest.fixture(autouse=True)
def _restore_logging():
    """Each test leaves the root and ``paratrain`` loggers as it found them. A run in this process
    (paratrain.train, cli.main) gives the ``paratrain`` logger a handler on the sys.stderr of that
    moment, which is a test's capture stream: left in place, a later test's warnings go to a closed
    file and each prints a "--- Logging error ---" trace instead of one line."""
    loggers = [logging.getLogger(), logging.getLogger("paratrain")]
    saved = [(lg.handlers[:], lg.level, lg.propagate, lg.disabled) for lg in loggers]
    yield
    for lg, (handlers, level, propagate, disabled) in zip(loggers, saved):
        lg.handlers[:] = handlers
        lg.level, lg.propagate, lg.disabled = level, propagate, disabled
