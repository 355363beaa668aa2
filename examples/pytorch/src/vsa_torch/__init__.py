"""vsa for PyTorch: video sparse attention (and its stages) as torch ops, CUDA and CPU.

    import vsa_torch
    o = vsa_torch.video_sparse_attention(q, k, v, grid=(21, 30, 52), gate=g)   # raster [B, S, H, D] in and out

The ops are registered with the dispatcher as torch.ops.vsa.* (forward and backward kernels); the functions
here add autograd. vsa_torch.fastvideo.video_sparse_attn is a drop-in for FastVideo's op;
vsa_torch.sequence_parallel runs the whole op over a torch.distributed group (Ulysses)."""
import torch

from . import _C  # registers torch.ops.vsa.*
from . import _fake  # noqa: F401  (fake kernels for torch.compile)
from . import sequence_parallel
from .ops import linear_attention, sparse_attention, tile, untile, video_sparse_attention

__all__ = ["video_sparse_attention", "sparse_attention", "linear_attention", "tile", "untile", "has_cuda",
           "sequence_parallel"]
__version__ = "0.1.0"


def has_cuda():
    """Whether this build has the CUDA kernels (else only the CPU reference runs)."""
    return _C.has_cuda()
