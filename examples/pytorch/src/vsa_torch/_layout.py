"""Shapes shared by the ops, their autograd and their fake kernels: the tile geometry and the output layout rule."""
import torch

TILE = 4  # a tile is TILE × TILE × TILE tokens
DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float64: 3}


def check_grid(grid):
    try:
        t, h, w = (int(x) for x in grid)
    except (TypeError, ValueError):
        raise ValueError(f"vsa: grid: must be (T, H, W), got {grid!r}") from None
    return t, h, w


def num_tiles(grid):
    t, h, w = grid
    return -(-t // TILE) * -(-h // TILE) * -(-w // TILE)


def tiled_tokens(grid):
    return num_tiles(grid) * TILE**3


def raster_tokens(grid):
    t, h, w = grid
    return t * h * w


def heads_major(x):
    """Whether a [B, S, H, D] view is [B, H, S, D] memory: its head stride exceeds its token stride."""
    return x.stride(2) > x.stride(1)


def empty_bshd(like, shape, heads_major, dtype=None):
    """A new [B, S, H, D] tensor on like's device, [B, H, S, D] memory where heads_major."""
    b, s, h, d = shape
    dtype = like.dtype if dtype is None else dtype
    if heads_major:
        return like.new_empty((b, h, s, d), dtype=dtype).transpose(1, 2)
    return like.new_empty((b, s, h, d), dtype=dtype)


def empty_like_layout(like, tokens, heads, dtype=None):
    """An output [B, tokens, heads, D] laid out as `like` is: [B, H, S, D] memory when like's head stride exceeds
    its token stride, [B, S, H, D] otherwise (the rule of the C++ kernels, csrc/common.hpp)."""
    return empty_bshd(like, (like.shape[0], tokens, heads, like.shape[3]), heads_major(like), dtype)


def to_bshd(x, layout):
    """The [B, S, H, D] view the ops take of a caller's tensor (no copy; the head dim made contiguous if it is not)."""
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"vsa: layout: must be 'bshd' or 'bhsd', got {layout!r}")
    if x.dim() != 4:
        raise ValueError(f"vsa: tensors must be 4-d ({layout}), got shape {tuple(x.shape)}")
    x = head_contiguous(x)
    return x.transpose(1, 2) if layout == "bhsd" else x


def head_contiguous(x):
    """x itself where its head dim is contiguous, as the kernels read it; a contiguous copy otherwise."""
    return x.contiguous() if x.stride(-1) != 1 and x.shape[-1] > 1 else x


def from_bshd(x, layout):
    return x.transpose(1, 2) if layout == "bhsd" else x
