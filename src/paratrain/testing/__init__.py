"""Helpers shared by paratrain's tests and benchmarks: ranks on gloo (``dist_utils``), tiny
transformers models (``hf_models``), fine-tuning and RL data (``sft_data``, ``sft``, ``rl_data``,
``corpus``), user-side toy models named by factory paths (``toy``, ``cp_auto``), the
mixture-of-experts and resilience runs (``moe_utils``, ``resilience``), the combination sweep
(``sweep``), and what the benchmarks share: paired statistics (``paired``), a job runner
(``bench``), the hand-written DDP baseline (``baseline_ddp``), the peers' optimiser settings and
launchers (``peers``), and the measurements the tests check (``lora_memory``, ``moe_ep``,
``pipeline_memory``).

Nothing is imported here, so ``import paratrain.testing`` is cheap; transformers and TRL are
imported inside the functions that use them. The library itself never imports this package
(tests/unit/test_structure.py checks it).
"""
