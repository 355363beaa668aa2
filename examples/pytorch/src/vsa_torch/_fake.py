"""Fake kernels of the ops, for torch.compile: output shapes, dtypes and strides without running anything.

Each mirrors its C++ kernel's allocation (csrc/ops_impl.hpp) exactly, strides included; the whole op's state size
comes from the library itself (vsa_torch._C.op_sizes), for the device the call runs on."""
import torch

from . import _C
from ._layout import DTYPE_CODES, empty_like_layout, raster_tokens, tiled_tokens, num_tiles


def _register(name):
    register = getattr(torch.library, "register_fake", None) or getattr(torch.library, "impl_abstract", None)
    if register is None:  # torch < 2.2: no torch.compile support for custom ops to register with
        return lambda fn: fn
    return register(f"vsa::{name}")


def _grid(grid):
    return tuple(int(x) for x in grid)


@_register("tile")
def _tile(x, grid):
    return empty_like_layout(x, tiled_tokens(_grid(grid)), x.shape[2])


@_register("untile")
def _untile(x, grid):
    return empty_like_layout(x, raster_tokens(_grid(grid)), x.shape[2])


@_register("forward")
def _forward(q, k, v, gate, grid, top_k, sparsity, scale, q2k, q2k_count, return_selection, raster_out, extra=0,
             extra_first=False):
    grid = _grid(grid)
    b, _, hq, d = (int(s) for s in q.shape)
    capacity = int(q2k.shape[3]) if q2k is not None else 0
    state_bytes, chosen = _C.op_sizes(b, hq, int(k.shape[2]), d, list(grid), DTYPE_CODES[q.dtype], int(top_k),
                                      float(sparsity), capacity, q.device.type == "cuda", int(extra),
                                      bool(extra_first))
    o = empty_like_layout(q, (raster_tokens(grid) if raster_out else tiled_tokens(grid)) + int(extra), hq)
    state = q.new_empty((state_bytes,), dtype=torch.uint8)
    if return_selection and q2k is None:
        n = num_tiles(grid)
        lists = q.new_empty((b, hq, n, chosen), dtype=torch.int32)
        counts = q.new_empty((b, hq, n), dtype=torch.int32)
    else:
        lists = q.new_empty((0,), dtype=torch.int32)
        counts = q.new_empty((0,), dtype=torch.int32)
    return o, state, lists, counts


@_register("forward_raster")
def _forward_raster(q, k, v, gate, grid, top_k, sparsity, scale, q2k, q2k_count, return_selection, raster_out):
    o, state, lists, counts = _forward(q, k, v, gate, grid, top_k, sparsity, scale, q2k, q2k_count,
                                       return_selection, raster_out)
    s = tiled_tokens(_grid(grid))
    tgate = empty_like_layout(gate, s, q.shape[2]) if gate is not None else q.new_empty((0,))
    return (o, state, lists, counts, empty_like_layout(q, s, q.shape[2]), empty_like_layout(k, s, k.shape[2]),
            empty_like_layout(v, s, v.shape[2]), tgate)


@_register("backward")
def _backward(d_o, q, k, v, gate, o, state, grid, top_k, sparsity, scale, q2k, q2k_count, raster_out, extra=0,
              extra_first=False, raster_in=False):
    s = (raster_tokens(_grid(grid)) if raster_out else tiled_tokens(_grid(grid))) + int(extra)
    dgate = empty_like_layout(gate, s, q.shape[2]) if gate is not None else q.new_empty((0,))
    return (empty_like_layout(q, s, q.shape[2]), empty_like_layout(k, s, k.shape[2]),
            empty_like_layout(v, s, v.shape[2]), dgate)


@_register("sparse_attention")
def _sparse(q, k, v, q2k, q2k_count, grid, scale):
    s = tiled_tokens(_grid(grid))
    return empty_like_layout(q, s, q.shape[2]), q.new_empty((q.shape[0], q.shape[2], s), dtype=torch.float32)


@_register("sparse_attention_backward")
def _sparse_backward(d_o, q, k, v, o, lse, q2k, q2k_count, grid, scale):
    s = tiled_tokens(_grid(grid))
    return (empty_like_layout(q, s, q.shape[2]), empty_like_layout(k, s, k.shape[2]),
            empty_like_layout(v, s, v.shape[2]))


@_register("linear_attention")
def _linear(q, k, v, grid, phi, eps, raster):
    return empty_like_layout(q, q.shape[1], q.shape[2])


@_register("linear_attention_backward")
def _linear_backward(d_o, q, k, v, grid, phi, eps, raster):
    return (empty_like_layout(q, q.shape[1], q.shape[2]), empty_like_layout(k, k.shape[1], k.shape[2]),
            empty_like_layout(v, v.shape[1], v.shape[2]))
