"""paratrain: train any PyTorch model across processes, GPUs and machines on torch.distributed."""

from paratrain.config import Config, ConfigError, load_config
from paratrain.trainer import train

__all__ = ["Config", "ConfigError", "load_config", "train"]
__version__ = "0.1.0"
