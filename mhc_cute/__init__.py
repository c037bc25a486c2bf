"""mhc_cute: GPU kernels for DeepSeek-V4's mHC boundary op (hyper-connection post fused with pre) and V4.1's
delayed seam."""

from .api import mhc_fused_hc, mhc_fused_hc_delayed
from .ops import mhc_collapse, mhc_head, mhc_post
from .problem import MhcFusedHcDelayedOutput, MhcFusedHcOutput
from .backends import BACKENDS, available
from .version import __version__
from .weights import clear as clear_prepared_weights

__all__ = ["mhc_fused_hc", "mhc_fused_hc_delayed", "mhc_post", "mhc_head", "mhc_collapse", "MhcFusedHcOutput",
           "MhcFusedHcDelayedOutput", "BACKENDS", "available", "clear_prepared_weights", "__version__"]
