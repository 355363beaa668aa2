"""A drop-in for FastVideo's VSA op: `from vsa_torch.fastvideo import video_sparse_attn` in place of
`from fastvideo_kernel.ops import video_sparse_attn`, same arguments, order, layouts and output.

FastVideo passes tiled [B, H, S, D] tensors and per-tile valid counts instead of the latent grid; vsa needs the
grid, so it is recovered from the counts once per counts tensor (one device-to-host copy the first time a tensor
is seen; FastVideo builds it once per forward and passes the same tensor to every layer). Any grid whose tiles
have exactly these counts gives the same op in tiled order, which depends on the counts only.

Differences from FastVideo's op, all by design:
- the coarse scores are formed from fp32 tile means in fp32 (FastVideo: bf16 means, bf16 matmul), so rows with
  near-tied scores can select a different tile;
- the tile means are over each tile's valid tokens (FastVideo sums the whole 64-slot block, so non-zero values in
  its padding slots leak into its means; vsa ignores them);
- padding slots of the output are 0 (FastVideo writes the coarse output there too), and so are the gradients at
  padding slots;
- the backward is vsa's deterministic one; GQA (fewer k/v heads than q heads) is accepted;
- only 4×4×4 tiles (block_size 64); FastVideo's 256-token blocks raise ValueError.
"""
import torch

from .ops import video_sparse_attention

_grids = {}


def _counts_key(t):
    return (t.device, t.data_ptr(), t._version, t.numel(), t.dtype)


def _separable_counts(nt, nh, nw, rt, rh, rw):
    def sizes(n, r):
        s = torch.full((n,), 4, dtype=torch.int64)
        s[-1] = r
        return s

    return (sizes(nt, rt)[:, None, None] * sizes(nh, rh)[None, :, None] * sizes(nw, rw)[None, None, :]).reshape(-1)


def grid_from_counts(counts):
    """A latent grid (T, H, W) whose 4×4×4 tiles, in tile order, hold exactly `counts` valid tokens each."""
    c = torch.as_tensor(counts).detach().to("cpu", torch.int64).reshape(-1)
    n = c.numel()
    if n == 0 or int(c.min()) < 1 or int(c.max()) > 64:
        raise ValueError("vsa: variable_block_sizes: every tile needs 1..64 valid tokens")
    last = int(c[-1])
    for nt in range(1, n + 1):
        if n % nt:
            continue
        for nh in range(1, n // nt + 1):
            if (n // nt) % nh:
                continue
            nw = n // nt // nh
            for rt in range(1, 5):
                for rh in range(1, 5):
                    for rw in range(1, 5):
                        if rt * rh * rw != last:
                            continue
                        if torch.equal(_separable_counts(nt, nh, nw, rt, rh, rw), c):
                            return 4 * (nt - 1) + rt, 4 * (nh - 1) + rh, 4 * (nw - 1) + rw
    raise ValueError("vsa: variable_block_sizes: no T×H×W grid has these per-tile counts (vsa takes video "
                     "grids cut into 4×4×4 tiles, valid tokens first in each tile)")


def _grid_of(variable_block_sizes, q_variable_block_sizes):
    key = (_counts_key(variable_block_sizes), _counts_key(q_variable_block_sizes))
    grid = _grids.get(key)
    if grid is None:
        grid = grid_from_counts(variable_block_sizes)
        if q_variable_block_sizes is not variable_block_sizes and not torch.equal(
                variable_block_sizes.detach().cpu().long(), q_variable_block_sizes.detach().cpu().long()):
            raise ValueError("vsa: q_variable_block_sizes must equal variable_block_sizes (self-attention over "
                             "one video grid)")
        if len(_grids) > 64:
            _grids.clear()
        _grids[key] = grid
    return grid


def video_sparse_attn(q, k, v, variable_block_sizes, q_variable_block_sizes, topk, block_size=64,
                      compress_attn_weight=None):
    """FastVideo's `video_sparse_attn`: tiled [B, H, S, D] q, k, v (S = N·64), the valid tokens of each tile,
    top-k key tiles per query tile, and the gate of the coarse output. Returns o [B, H, S, D]."""
    if isinstance(block_size, int):
        block_size = (block_size,) * 3 if block_size != 64 else (4, 4, 4)
    if tuple(block_size) != (4, 4, 4):
        raise ValueError(f"vsa: block_size: only 4×4×4 tiles (64 tokens), got {block_size!r}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("vsa: q, k, v must be [B, H, S, D]")
    if q.shape[2] % 64 or k.shape[2] != q.shape[2] or v.shape[2] != q.shape[2]:
        raise ValueError(f"vsa: q, k, v: S must be the same multiple of 64, got {q.shape[2]}, {k.shape[2]}, "
                         f"{v.shape[2]}")
    if variable_block_sizes.numel() != q.shape[2] // 64:
        raise ValueError(f"vsa: variable_block_sizes must have length S / 64 = {q.shape[2] // 64}, got "
                         f"{variable_block_sizes.numel()}")
    grid = _grid_of(variable_block_sizes, q_variable_block_sizes)
    return video_sparse_attention(q, k, v, grid, gate=compress_attn_weight, top_k=int(topk), layout="bhsd",
                                  order="tiled")
