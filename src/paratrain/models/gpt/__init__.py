"""The built-in GPT: the model (model.py) and its tensor-parallel plan and layout checks (parallel.py)."""

from paratrain.models.gpt.model import GPT, GPTConfig, build_gpt, gpt_flops_per_token
from paratrain.models.gpt.parallel import GPT_SPEC, check_gpt_layout, gpt_tp_plan

__all__ = ["GPT", "GPTConfig", "GPT_SPEC", "build_gpt", "check_gpt_layout", "gpt_flops_per_token", "gpt_tp_plan"]
