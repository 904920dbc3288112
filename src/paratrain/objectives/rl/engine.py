"""Where a round's tokens come from: the sampler seam of GRPO (``rl.engine``, docs/engines.md).

An *engine* samples completions: ``sample(prompts, keys, params) -> (tokens, logps)`` with
``prompts`` the prompt token ids per row (a list of lists of ints), ``keys`` each completion's key
(int64 ``(B,)``, objectives/rl/rollout.py ``completion_keys``; an engine that honours per-request
seeds takes it as the request's seed), ``params`` the :class:`SamplingParams`; it returns the
tokens ``(B, T)`` (``T <= max_new_tokens``, -1 after a completion's end, its stop token kept) and
their log-probabilities ``(B, T)`` under the engine's own forward, the behaviour policy's. Its
``sync(model)`` is called on every rank once per round before sampling, with the trainer's model
as it is laid out (FSDP2, tensor parallel, DDP): :func:`hf_weights` gathers its full weights.

- ``"builtin"`` (rollout.py ``BuiltinEngine``): the trainer's model and the keyed draws, the exact
  default; its ``sync`` does nothing.
- ``"package.module:factory"`` / ``"file.py:factory"``: ``factory(**rl.engine_args)`` returns an
  engine of the user's.
- ``"vllm"``: :class:`ServerEngine`, a client of a ``vllm serve`` running in its own environment
  (vLLM 0.34 pins torch 2.14, not this project's 2.13): OpenAI completions with the prompt as token
  ids and the key as ``seed``, weights synced per round through a directory and the server's dev
  endpoints (``/collective_rpc`` ``reload_weights``, ``/reset_prefix_cache``).

Another engine than the built-in's log-probabilities differ from the trainer's (other kernels,
precision, batching: trl#4772, vllm#27059), so the round always recomputes the trainer's and
logs the gap (rollout.py ``_recompute``).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from paratrain.config import ConfigError, RLConfig, resolve_callable


@dataclass(frozen=True)
class SamplingParams:
    """What the round asks of an engine (``rl.*``): a completion ends after its first token in
    ``stop`` (kept) or at ``max_new_tokens``; ``temperature`` divides the logits, ``top_k`` (0:
    all) and ``top_p`` (1: all) filter the sampling only, as transformers' warpers do."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop: tuple[int, ...] = ()


def build_engine(cfg: RLConfig):
    """The user's engine (``rl.engine = 'package.module:factory'``) or the vLLM server client
    (``'vllm'``), built with ``rl.engine_args``; checked for ``sample`` and ``sync``."""
    args = dict(cfg.engine_args)
    if cfg.engine == "vllm":
        return ServerEngine(**args)
    factory = resolve_callable(cfg.engine, "rl.engine")
    try:
        engine = factory(**args)
    except Exception as e:  # noqa: BLE001 - the user's factory: its error in one line
        first = (str(e).strip().splitlines() or [""])[0][:160]
        raise ConfigError(f"rl.engine = {cfg.engine!r} raised {type(e).__name__}: {first}; fix it") from None
    missing = [m for m in ("sample", "sync") if not callable(getattr(engine, m, None))]
    if missing:
        raise ConfigError(
            f"rl.engine = {cfg.engine!r} returned {type(engine).__name__}, which has no {' or '.join(missing)} method;"
            " return an object with sample(prompts, keys, params) -> (tokens, logps) and sync(model)"
        )
    return engine


def checked(engine_ref: str, out, rows: int, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """An engine's answer as the round takes it: int64 tokens and float32 log-probabilities on the
    CPU, ``(rows, max_new_tokens)``, -1 / 0 after each completion's end; a wrong shape is one line."""
    try:
        tokens, logps = (torch.as_tensor(x).cpu() for x in out)
    except (TypeError, ValueError):
        tokens = logps = None
    n = params.max_new_tokens
    if tokens is None or tokens.dim() != 2 or tokens.shape != logps.shape or len(tokens) != rows or tokens.shape[1] > n:
        raise ConfigError(
            f"rl.engine = {engine_ref!r} returned no (tokens, logps) pair of ({rows}, <= {n}) tensors for {rows}"
            " prompts; return the tokens (-1 after the end) and their log-probabilities, one row per prompt"
        )
    tokens = torch.nn.functional.pad(tokens.long(), (0, n - tokens.shape[1]), value=-1)
    logps = torch.nn.functional.pad(logps.float(), (0, n - logps.shape[1]))
    return tokens, torch.where(tokens >= 0, logps, 0.0)


def hf_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainer's full weights on every rank under transformers' names (an engine's ``sync``):
    gathered from FSDP2 / tensor-parallel shards (a collective: every rank calls it), DDP's wrapper
    dropped by torch's own state-dict names; a model.hf wrapper's names mapped by its ``hf_name``."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    inner = getattr(model, "module", model)  # DDP: the module holds hf_name
    rename = getattr(inner, "hf_name", None)
    return {(rename(k) if rename else k): v.detach() for k, v in sd.items()}


class ServerEngine:
    """``rl.engine = 'vllm'``: completions from a ``vllm serve`` (or any server of its API) over HTTP.

    Each completion is one request of ``/v1/completions`` with the prompt as token ids and the
    completion's key as ``seed`` (vLLM seeds that request's sampler with it, so a completion is a
    function of its key and the weights, up to the batch-dependent kernels of vllm#27059),
    ``logprobs = 0`` (the sampled token's) and ``return_tokens_as_token_ids`` (tokens as
    ``token_id:N``); ``ignore_eos`` with ``stop_token_ids`` = ``rl.stop`` so that a completion
    ends where the built-in sampler's would. The server must run with ``--logprobs-mode
    processed_logprobs`` for log-probabilities at the temperature (docs/engines.md).

    ``sync``: rank 0 writes the trainer's weights (:func:`hf_weights`, safetensors) into
    ``weights_dir``, which the server must see, and asks the server to reload them: ``/pause``,
    ``/collective_rpc`` with ``reload_weights(weights_path=...)``, ``/reset_prefix_cache`` (its
    cached prefixes were computed with the old weights), ``/resume`` (vLLM 0.34's endpoints, with
    ``VLLM_SERVER_DEV_MODE=1``); the other ranks wait at a barrier. ``weights_dir = ''``: no sync
    (a server whose weights never change, e.g. a check of the gap at step 0)."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        model: str = "",
        weights_dir: str = "",
        timeout_s: float = 600,
        concurrency: int = 1,
    ):
        self.url, self.model, self.weights_dir, self.timeout_s = url.rstrip("/"), model, weights_dir, timeout_s
        # Requests in flight at once: more lets the server batch them (its throughput), and then a
        # completion may depend on its batch through the server's kernels (vllm#27059).
        self.concurrency = max(1, int(concurrency))

    def _post(self, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as r:
                text = r.read().decode()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace").strip().replace("\n", " ")[:200]
            raise ConfigError(
                f"rl.engine = 'vllm': {self.url}{path} answered {e.code}: {detail}; check the server"
            ) from None
        except (urllib.error.URLError, OSError) as e:
            raise ConfigError(
                f"rl.engine = 'vllm': cannot reach {self.url}{path} ({e}); start `vllm serve` there or set"
                " rl.engine_args.url"
            ) from None
        return json.loads(text) if text.strip() else {}

    def sync(self, model: nn.Module) -> None:
        if not self.weights_dir:
            return
        from safetensors.torch import save_file  # only a syncing run needs it

        weights = hf_weights(model)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if rank0:
            os.makedirs(self.weights_dir, exist_ok=True)
            # one file; tied weights (embedding and lm_head) are one tensor, which safetensors refuses twice
            seen, out = set(), {}
            for k, v in weights.items():
                out[k] = v.contiguous().clone() if v.data_ptr() in seen else v.contiguous()
                seen.add(v.data_ptr())
            save_file(out, os.path.join(self.weights_dir, "model.safetensors"))
            self._post("/pause?mode=wait")
            self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": self.weights_dir}})
            self._post("/reset_prefix_cache")
            self._post("/resume")
        if dist.is_initialized():
            dist.barrier()  # no rank samples before the server holds the round's weights

    def sample(self, prompts: list[list[int]], keys: torch.Tensor, params: SamplingParams):
        n = params.max_new_tokens
        tokens = torch.full((len(prompts), n), -1, dtype=torch.long)
        logps = torch.zeros(len(prompts), n)

        def request(ids: list[int], key: int) -> dict:
            body = {
                "model": self.model,
                "prompt": list(ids),
                "max_tokens": n,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k,  # 0: all (vLLM's default too)
                "seed": int(key),
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
                "ignore_eos": True,
                "stop_token_ids": list(params.stop),
                "skip_special_tokens": False,
            }
            return self._post("/v1/completions", body)["choices"][0]

        with ThreadPoolExecutor(self.concurrency) as pool:
            choices = list(pool.map(request, prompts, keys.tolist()))
        for i, choice in enumerate(choices):
            got = [int(t.rpartition(":")[2]) for t in choice["logprobs"]["tokens"]][:n]
            tokens[i, : len(got)] = torch.tensor(got, dtype=torch.long)
            logps[i, : len(got)] = torch.tensor(choice["logprobs"]["token_logprobs"][: len(got)], dtype=torch.float32)
        return tokens, logps
