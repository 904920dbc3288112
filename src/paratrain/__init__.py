"""paratrain: train any PyTorch model across processes, GPUs and machines on torch.distributed."""

from paratrain.config import Config, ConfigError, load_config

__all__ = ["Config", "ConfigError", "load_config", "train"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # `paratrain.train` loads the trainer (and torch) on first use only (PEP 562), so commands that
    # need neither, such as `paratrain prepare`, start in a fraction of a second.
    if name == "train":
        from paratrain.trainer import train  # lazy: see the comment above

        globals()["train"] = train
        return train
    raise AttributeError(f"module 'paratrain' has no attribute {name!r}")
