"""Fixtures of the multi-rank tier."""

from __future__ import annotations

import os

import pytest


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
