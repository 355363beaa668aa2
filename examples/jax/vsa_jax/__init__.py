"""vsa for JAX: video sparse attention as XLA FFI calls into the library's GPU kernels, differentiable.

    import vsa_jax
    o = vsa_jax.video_sparse_attention(q, k, v, grid=(21, 30, 52), gate=g)   # raster [B, S, H, D] in and out

The kernels live in libvsa_jax.so (examples/jax/build.py builds it; $VSA_JAX_LIBRARY points elsewhere), loaded and
registered with XLA the first time an op is traced. Every function works under jax.jit and jax.grad.

The ops (and jax with them) are imported on first use, so that the library's host-side checks in
vsa_jax._library can be used without jax."""
from ._library import path as library_path

_OPS = ("video_sparse_attention", "sparse_attention", "tile", "untile", "check_lists", "register")
__all__ = [*_OPS, "library_path"]
__version__ = "0.1.0"


def __getattr__(name):
    if name in _OPS:
        from . import ops

        return getattr(ops, name)
    raise AttributeError(f"module 'vsa_jax' has no attribute {name!r}")
