"""vsa for JAX: video sparse attention as XLA FFI calls into the library's GPU kernels, differentiable.

    import vsa_jax
    o = vsa_jax.video_sparse_attention(q, k, v, grid=(21, 30, 52), gate=g)   # raster [B, S, H, D] in and out

The kernels live in libvsa_jax.so (examples/jax/build.py builds it; $VSA_JAX_LIBRARY points elsewhere), loaded and
registered with XLA the first time an op is traced. Every function works under jax.jit and jax.grad."""
from ._library import path as library_path
from .ops import check_lists, register, sparse_attention, tile, untile, video_sparse_attention

__all__ = ["video_sparse_attention", "sparse_attention", "tile", "untile", "check_lists", "register", "library_path"]
__version__ = "0.1.0"
