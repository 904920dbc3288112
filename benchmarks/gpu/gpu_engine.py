"""On one CUDA GPU with vLLM in its own environment: GRPO with ``rl.engine = 'vllm'`` (issue 56
item 3's device check, docs/engines.md).

vLLM 0.34 pins torch 2.14 (this project: 2.13), so it runs as a server in its own environment
(``VLLM``: its ``vllm`` executable) and paratrain is its client. The script

1. saves a tiny Qwen2 (random weights, the tests' byte-level ChatML tokenizer beside them) and 64
   conversational prompts ``a+b=``;
2. starts ``VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --logprobs-mode processed_logprobs
   --generation-config vllm --enforce-eager --dtype bfloat16`` on a free port and waits for it;
3. runs GRPO for ``--steps`` steps (one step per round, so the weights are synced through
   ``weights_dir`` and ``reload_weights`` before every round) three times: with the vLLM engine
   twice (do the same keys give the same completions? vLLM seeds each request with its key) and
   with the built-in engine (``rl.check_logps``: its own gap, float rounding);
4. prints per step the largest and mean gap between vLLM's log-probabilities and the trainer's,
   the built-in sampler's largest gap, the rewards, and how many completions the two vLLM runs
   share; everything in ``$OUT/gpu_engine.json`` (``$OUT`` or ./gpu-out).

    VLLM=/opt/vllm-venv/bin/vllm PYTHONPATH=src python benchmarks/gpu/gpu_engine.py [--steps 4]
    PYTHONPATH=src python benchmarks/gpu/gpu_engine.py --dry-run

``--dry-run`` runs the same code on the CPU, smaller (2 steps of 8 completions of 6 tokens), with paratrain.testing.engines' fake server (the
built-in sampler behind vLLM's API, so its gap is float rounding) in place of ``vllm serve``.
Without CUDA or a ``vllm`` executable (and without ``--dry-run``) it says so and exits with code 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fixtures(root: str) -> tuple[str, str]:
    from paratrain.testing.hf_models import save_tiny
    from paratrain.testing.rl_data import addition_rows
    from paratrain.testing.sft_data import VOCAB, save_chat_tokenizer, write_jsonl

    model = save_tiny("qwen2", os.path.join(root, "model"), vocab_size=VOCAB, max_position_embeddings=512, seed=0)
    save_chat_tokenizer(model)  # vllm serve loads the tokenizer from the model's folder
    return model, write_jsonl(os.path.join(root, "prompts.jsonl"), addition_rows(64, conversational=True))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_vllm(vllm: str, model: str, out: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [vllm, "serve", model, "--port", str(port), "--host", "127.0.0.1", "--seed", "0"]
    cmd += ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", "--enforce-eager"]
    cmd += ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.3", "--max-model-len", "512"]
    print("$ VLLM_SERVER_DEV_MODE=1 " + " ".join(cmd), flush=True)
    log = open(os.path.join(out, "vllm.log"), "w")
    server = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        if server.poll() is not None:
            sys.exit(f"vllm serve exited with code {server.returncode}; see {out}/vllm.log")
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return server, url
        except OSError:
            time.sleep(1)
    server.kill()
    sys.exit(f"vllm serve did not answer /health in 300 s; see {out}/vllm.log")


def train(name: str, over: list[str], out: str) -> tuple[list[dict], list[dict]]:
    run_dir = os.path.join(out, name)
    sets = [a for o in [*over, f"run.out_dir='{run_dir}'"] for a in ("--set", o)]
    empty = os.path.join(out, "empty.toml")
    open(empty, "w").close()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "paratrain", "train", empty, *sets], env=env, capture_output=True, text=True
    )
    if done.returncode:
        sys.exit(f"{name}: paratrain train exited with code {done.returncode}:\n{done.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    with open(os.path.join(run_dir, "rollouts.jsonl")) as f:
        return rows, [json.loads(line) for line in f]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="on the CPU, a fake vLLM server")
    p.add_argument("--steps", type=int, default=4, help="GRPO steps per run (--dry-run: 2)")
    p.add_argument("--vllm", default=os.environ.get("VLLM", "vllm"), help="the vllm executable (its own venv)")
    args = p.parse_args()
    if args.dry_run:  # the code paths, small: 8 completions of 6 tokens a step (the full size took 9 min here)
        args.steps = min(args.steps, 2)
    import torch

    vllm = shutil.which(args.vllm)
    if not args.dry_run and (not torch.cuda.is_available() or vllm is None):
        print(f"no CUDA device ({torch.cuda.is_available()=}) or no vllm executable ({args.vllm!r}): nothing measured")
        return 0
    out = os.path.abspath(os.environ.get("OUT", "gpu-out"))
    os.makedirs(out, exist_ok=True)
    root = tempfile.mkdtemp(prefix="gpu_engine-")
    model, prompts = fixtures(root)
    if args.dry_run:
        from paratrain.testing.engines import serve_fake_vllm

        server, _ = serve_fake_vllm(hf_dir=model)
        url = f"http://127.0.0.1:{server.server_address[1]}"
    else:
        server, url = start_vllm(vllm, model, out)
    base = [
        f"model.hf='{model}'",
        "data.name='prompts'",
        f"data.args={{path = '{prompts}', max_prompt_length = 64}}",
        "loss.name='grpo'",
        f"rl.group_size={4 if args.dry_run else 8}",
        f"rl.max_new_tokens={6 if args.dry_run else 16}",
        "rl.rewards=['paratrain.testing.rl_data:byte_mix']",
        f"batch.global_batch_size={8 if args.dry_run else 32}",
        "optim.lr=1e-3",
        "optim.warmup_steps=0",
        f"run.steps={args.steps}",
        "run.progress=false",
        "metrics.plot=false",
    ]
    engine = [
        "rl.engine='vllm'",
        f"rl.engine_args={{url = '{url}', model = '{model}', weights_dir = '{root}/weights'}}",
    ]
    try:
        runs = {
            "vllm_a": train("vllm_a", [*base, *engine], out),
            "vllm_b": train("vllm_b", [*base, *engine], out),
            "builtin": train("builtin", [*base, "rl.check_logps=true"], out),
        }
    finally:
        if args.dry_run:
            server.shutdown()
        else:
            server.terminate()
            server.wait(60)
    (a, ra), (_, rb), (b, _) = runs["vllm_a"], runs["vllm_b"], runs["builtin"]
    same = sum(x["tokens"] == y["tokens"] for x, y in zip(ra, rb, strict=True))
    device = "cpu (dry run: the fake server)" if args.dry_run else torch.cuda.get_device_name()
    print(f"device: {device}, torch {torch.__version__}")
    print("step  vllm logp_gap  vllm logp_gap_mean  builtin logp_gap  reward (vllm)  reward (builtin)")
    for x, y in zip(a, b, strict=True):
        print(
            f"{x['step']:>4}  {x['logp_gap']:>13.3e}  {x['logp_gap_mean']:>18.3e}  {y['logp_gap']:>16.3e}"
            f"  {x['reward']:>13.4f}  {y['reward']:>16.4f}"
        )
    print(f"completions the two vLLM runs share, token for token: {same} of {len(ra)}")
    result = {"device": device, "vllm": a, "vllm_again": runs["vllm_b"][0], "builtin": b, "same_completions": same}
    result["completions"] = len(ra)
    with open(os.path.join(out, "gpu_engine.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
