"""ds_comet: a DeepSpeed MoE backend that overlaps the expert-parallel all-to-all with the experts."""

from . import experts
from .config import CometMoEConfig, moe_config_from
from .layer import CometMOELayer, MoE, build_moe

__version__ = "0.1.0"

__all__ = ["experts", "CometMoEConfig", "CometMOELayer", "MoE", "build_moe", "moe_config_from", "__version__"]
