"""The Triton backend (``backend="triton"``): main + reduce kernels for AMD (MI355X gfx950, MI300X gfx942),
NVIDIA, and Triton's CPU interpreter. Import ``mhc_cute.triton.fused_hc`` for ``run``; this package only names
the tactic type so that users can build one without importing Triton."""

from .configs import TritonTactic

__all__ = ["TritonTactic"]
