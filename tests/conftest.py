import os

import pytest

# pytest puts the repository root on sys.path (tests/ is a package), so factory paths into test
# modules (``tests.distributed.test_pipeline:layered_lm``) resolve here and in spawned ranks; the
# CLI subprocesses the tests start find them through PYTHONPATH.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)

# A worker's entry point ends its process with os._exit (distributed/process_group.run_then_exit).
# Run inside pytest's own process by mistake, it would end the session with exit code 0 and no
# summary, hiding every test after it: in this process os._exit raises instead (forked children,
# e.g. tests/test_docs.py's runner, have another pid and exit for real).
_PYTEST_PID = os.getpid()
_real_exit = os._exit


def _guarded_exit(code: int = 0):
    if os.getpid() == _PYTEST_PID:
        raise RuntimeError(f"os._exit({code}) called in pytest's own process; a worker entry point ran in-process")
    _real_exit(code)


os._exit = _guarded_exit


# The supervised fine-tuning corpus and the GPT's packed one-process run, shared by the SFT,
# chunked-loss, context-parallel and MoE compile tests (each module builds its own).
@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """A tokenizer with a chat template, 24 conversations, a tiny Llama of the tokenizer's
    vocabulary, and two corpora: every conversation in train, and every one in val."""
    from paratrain.testing.sft import sft_corpus

    return sft_corpus(tmp_path_factory.mktemp("sft"))


@pytest.fixture(scope="module")
def gpt_reference(sft):
    """The GPT's packed run in one process (the layouts below must give its numbers)."""
    import paratrain
    from paratrain.testing.sft import losses_and_norms, sft_gpt

    name = "gpt_ref"
    paratrain.train(paratrain.load_config(None, sft_gpt(sft, name, "batch.micro_batch_size=8")))
    return losses_and_norms(os.path.join(sft["root"], name))
