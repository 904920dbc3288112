"""A second sampler behind ``rl.engine`` for the tests (tests/distributed/test_engines.py,
docs/engines.md): transformers' own ``generate``, one request at a time, seeded from the
completion's key, on a copy of the weights synced at each round, in its own precision.

It shares no code with the built-in sampler (objectives/rl/rollout.py): its draws are
``torch.multinomial``'s under the global generator seeded with the key, its log-probabilities
come from its own forward (``output_logits``), in ``dtype`` (bfloat16 makes them differ from
the trainer's float32 ones, as an inference engine's do).

:func:`serve_fake_vllm` answers ``rl.engine = 'vllm'`` (engine.py ServerEngine) as a ``vllm
serve`` would, with the built-in sampler: the server engine's test and the CPU dry run of
benchmarks/gpu/gpu_engine.py.
"""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from paratrain.objectives.rl.engine import SamplingParams, hf_weights
from paratrain.objectives.rl.rollout import sample


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


class FakeVLLM(BaseHTTPRequestHandler):
    """vLLM's completions API and the dev endpoints that reload its weights (engine.py
    ServerEngine), answered by the built-in keyed sampler (objectives/rl/rollout.py ``sample``)
    with one request's seed as its key: set ``model`` (ids ``(B, T)`` -> logits) and ``load``
    (a state dict of the synced weights -> None) on a subclass (:func:`serve_fake_vllm`)."""

    model = None
    load = None
    calls: list = []

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):  # /health
        self._answer({})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        path = self.path.split("?")[0]
        self.calls.append(path)
        out = {}
        if path == "/collective_rpc":
            from safetensors.torch import load_file

            assert body["method"] == "reload_weights"
            type(self).load(load_file(os.path.join(body["kwargs"]["weights_path"], "model.safetensors")))
        elif path == "/v1/completions":
            assert body["ignore_eos"] and body["return_tokens_as_token_ids"] and body["logprobs"] == 0
            ids = body["prompt"]
            with torch.no_grad():
                tokens, logps, n = sample(
                    self.model,
                    torch.tensor([ids]),
                    torch.tensor([len(ids)]),
                    torch.tensor([body["seed"]]),
                    max_new_tokens=body["max_tokens"],
                    temperature=body["temperature"],
                    top_k=body["top_k"],
                    top_p=body["top_p"],
                    stop=tuple(body["stop_token_ids"]),
                    cached=hasattr(self.model, "new_cache"),
                )
            k = int(n[0])
            logprobs = {
                "tokens": [f"token_id:{t}" for t in tokens[0, :k].tolist()],
                "token_logprobs": logps[0, :k].tolist(),
            }
            out = {"choices": [{"logprobs": logprobs}]}
        self._answer(out)

    def _answer(self, out: dict) -> None:
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _Logits(torch.nn.Module):
    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, ids):
        return self.hf(input_ids=ids).logits


def serve_fake_vllm(model=None, *, hf_dir: str = ""):
    """A :class:`FakeVLLM` on a free loopback port in a daemon thread, sampling with ``model``
    (a module of ids -> logits, its state dict's names the synced ones) or the transformers model
    of ``hf_dir``; returns (server, its handler class: ``.calls``), ``server.shutdown()`` ends it."""
    if hf_dir:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
        model, load = _Logits(hf), lambda sd: hf.load_state_dict(sd, strict=False)
    else:
        load = model.load_state_dict
    handler = type("Fake", (FakeVLLM,), {"model": model, "load": staticmethod(load), "calls": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, handler
