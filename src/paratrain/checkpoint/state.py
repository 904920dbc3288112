"""What a checkpoint holds: the ``Stateful`` adapters of the model, the optimiser and the trainer's
dataclasses, and every RNG state. When and where it is written is checkpointer.py's.

Why the model and optimiser go through ``torch.distributed.checkpoint.state_dict``
(get/set_state_dict): they key every tensor by its fully qualified name with DDP's ``module.``
prefix removed and every DTensor shard described by its global shape, so a checkpoint written by
one layout (2 DDP ranks, FSDP, TP) loads into any other, DCP resharding on load.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from paratrain.distributed.pipeline_parallel import PipelineModel


def rng_state(device: torch.device) -> dict:
    """Python, numpy and torch RNG states as values torch.load(weights_only=True) accepts."""

    np_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {
            **np_state,
            "state": {"key": np_state["state"]["key"].tolist(), "pos": int(np_state["state"]["pos"])},
        },
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:

    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = dict(state["numpy"])
    np_state["state"] = {"key": np.asarray(np_state["state"]["key"], dtype=np.uint32), "pos": np_state["state"]["pos"]}
    np.random.set_state(np_state)
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# A PipelineModel (distributed/pipeline_parallel.py) holds this rank's stages in ``parts``; each
# stage keeps the whole model's parameter names (the split keeps the module tree), so removing the
# ``parts.K.`` container prefix gives the names a one-process model has. Saved under those names,
# a pp = 2 checkpoint loads at pp = 1, under FSDP/TP or exports, and back (torchtitan does the same).
_STAGE_PREFIX = re.compile(r"^((?:state|param_groups)\.)?parts\.\d+\.")


def _own_names(sd: dict, model: torch.nn.Module) -> tuple[dict, dict[str, str]]:
    """``sd`` with the model's own names, and the map back to the keys ``model`` uses."""
    if not isinstance(model, PipelineModel):
        return sd, {}
    back = {_STAGE_PREFIX.sub(r"\1", k): k for k in sd}
    return {_STAGE_PREFIX.sub(r"\1", k): v for k, v in sd.items()}, back


class ModelState(Stateful):
    """The model through DCP's get/set_model_state_dict: names without DDP's ``module.`` prefix
    (nor a pipeline's ``parts.K.``), DTensor shards described by their global shape, so any layout
    loads into any other.

    ``keep``: saves only the entries whose name it accepts and loads them into a model whose other
    entries are already set (a LoRA run: the adapters; its frozen base is read as at start).
    """

    def __init__(self, model: torch.nn.Module, keep: Callable[[str], bool] | None = None):
        self.model = model
        self.keep = keep
        self._back: dict[str, str] = {}

    def state_dict(self) -> dict:
        sd, self._back = _own_names(get_model_state_dict(self.model), self.model)
        return {k: v for k, v in sd.items() if self.keep(k)} if self.keep else sd

    def load_state_dict(self, state_dict: dict) -> None:
        if self._back:
            state_dict = {self._back[k]: v for k, v in state_dict.items()}
        set_model_state_dict(self.model, state_dict, options=StateDictOptions(strict=self.keep is None))


# Flattened (``state.<name>.<key>``, ``param_groups.<name>.<key>``): every value is keyed by a
# parameter name, so pipeline stages that hold different parameters never write the same key
# (nested, ``param_groups`` is a list indexed by group number and the stages' lists collide).
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class OptimizerState(Stateful):
    """The optimiser, keyed by parameter names (get/set_optimizer_state_dict), resharded on load."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self._back: dict[str, str] = {}

    def state_dict(self) -> dict:
        sd, self._back = _own_names(get_optimizer_state_dict(self.model, self.optimizer, options=_FLAT), self.model)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        if self._back:
            state_dict = {self._back[k]: v for k, v in state_dict.items()}
        # The kernels (optim.implementation) belong to this run's layout, not to the training state:
        # a checkpoint of plain tensors (fused) resumed on FSDP2's DTensors must keep the loop.
        kernels = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in self.optimizer.param_groups]
        set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=_FLAT)
        for group, kept in zip(self.optimizer.param_groups, kernels):
            group.update(kept)


class DataclassState(Stateful):
    """A dataclass (the trainer's TrainState) saved with ``asdict`` and restored field by field:
    fields added later are checkpointed without touching this module, and a field an older
    checkpoint lacks keeps its default (``partial``: the Checkpointer loads only what it has)."""

    partial = True

    def __init__(self, obj):
        self.obj = obj

    def state_dict(self) -> dict:
        return dataclasses.asdict(self.obj)

    def load_state_dict(self, state_dict: dict) -> None:
        for k, v in state_dict.items():
            setattr(self.obj, k, v)
