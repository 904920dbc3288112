"""A second sampler behind ``rl.engine`` for the tests (tests/distributed/test_engines.py,
docs/engines.md): transformers' own ``generate``, one request at a time, seeded from the
completion's key, on a copy of the weights synced at each round, in its own precision.

It shares no code with the built-in sampler (objectives/rl/rollout.py): its draws are
``torch.multinomial``'s under the global generator seeded with the key, its log-probabilities
come from its own forward (``output_logits``), in ``dtype`` (bfloat16 makes them differ from
the trainer's float32 ones, as an inference engine's do).
"""

from __future__ import annotations

import torch

from paratrain.objectives.rl.engine import SamplingParams, hf_weights


class GenerateEngine:
    def __init__(self, model: str, dtype: str = "float32"):
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
        self.syncs = 0

    def sync(self, model) -> None:
        weights = hf_weights(model)
        _, unexpected = self.hf.load_state_dict(weights, strict=False)  # strict=False: a tied lm_head
        if unexpected:
            raise RuntimeError(f"weights the engine's model does not hold: {unexpected[:3]}")
        self.syncs += 1

    @torch.no_grad()
    def sample(self, prompts: list[list[int]], keys: torch.Tensor, params: SamplingParams):
        tokens = torch.full((len(prompts), params.max_new_tokens), -1, dtype=torch.long)
        logps = torch.zeros(len(prompts), params.max_new_tokens)
        for i, (ids, key) in enumerate(zip(prompts, keys.tolist(), strict=True)):
            with torch.random.fork_rng(devices=[]):  # the request's own seed, the run's RNG untouched
                torch.manual_seed(int(key))
                out = self.hf.generate(
                    torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    do_sample=True,
                    max_new_tokens=params.max_new_tokens,
                    temperature=params.temperature,
                    top_k=params.top_k,
                    top_p=params.top_p,
                    eos_token_id=list(params.stop) or None,
                    pad_token_id=0,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
            new = out.sequences[0, len(ids) :]
            raw = torch.cat(out.logits).float() / params.temperature  # (n, V): the forward's, before filtering
            tokens[i, : len(new)] = new
            logps[i, : len(new)] = raw.log_softmax(-1).gather(-1, new[:, None])[:, 0]
        return tokens, logps


def generate_engine(model: str, dtype: str = "float32") -> GenerateEngine:
    """``rl.engine = 'paratrain.testing.engines:generate_engine'``, ``rl.engine_args = {model = DIR}``."""
    return GenerateEngine(model, dtype)
