"""Ulysses sequence parallelism for vsa's whole op over a torch.distributed process group (NCCL, RCCL, gloo).

    import vsa_torch.sequence_parallel as sp
    q, k, v, g = (sp.shard(x, grid) for x in (q_full, k_full, v_full, g_full))   # this rank's frames
    o = sp.video_sparse_attention(q, k, v, grid, gate=g, sparsity=0.9)          # this rank's frames of o

Each rank holds whole frames of the clip in raster order, every head: rank r the frames
[f_0 + … + f_{r-1}, f_0 + … + f_r) of the latent grid (T, H, W), a [B, f_r·H·W, heads, D] tensor (frames None:
T split as evenly as possible, the first T mod P ranks one frame more). One all-to-all gives every rank the whole
sequence of 1/P of the heads (q, k, v and gate in one collective), the op runs on it unchanged, and a second
all-to-all returns o to the frames' owners; the backward runs the same exchanges in reverse (dO in, dq, dk, dv and
dgate out).

Sharding: the all-to-all happens before tiling, in raster order; the op tiles the gathered sequence inside, as on
one GPU, so every rank sees the whole grid and the tile geometry (4×4×4 tiles, partial ones at the grid's far
edges) is that of the single-GPU op. Sharding by whole tiles of 4 frames instead would save nothing (tiling is one
pass over the tokens either way) and would constrain the split: Wan's latent clips have 21 and 31 frames, not
multiples of 4, so their partial last time tile would have to sit on one rank and every other rank hold a multiple
of 4 frames (21 on 2 ranks: 12 + 9, not 11 + 10), unbalancing the model's per-token layers around the attention.
Here any split works: frames need not be whole tiles nor equal, a partial last tile in time is handled as the
single-GPU op handles it, and a rank may hold no frame at all.

Heads: q's heads must be divisible by the world size (ValueError otherwise); rank j computes q heads
[j·Hq/P, (j + 1)·Hq/P). GQA is kept: with Hkv divisible by P rank j gets the kv heads of exactly its q heads'
groups. Otherwise (e.g. one kv head on 2 ranks) each kv head is repeated r = P / gcd(Hkv, P) times before the
all-to-all, so that every rank gets the kv heads its q heads read (groups of Hq / (Hkv·r)): r times the k and v
traffic, and their gradients summed back through the repeat.

Every rank of the group must pass the same grid, frames and head counts, and tensors of the same dtype. A group of
one rank has nothing to exchange: the exchanges return the tensors they were given (not new ones: an in-place change
of one changes the caller's) and the wrapper is the op itself on the caller's tensors, so that a model written for
sequence parallelism pays nothing for it on one GPU (run through the exchanges as copies, the wrapper took
0.88-0.92x the op's layer time there: bench/NOTES-pytorch.md)."""
import math

import torch
import torch.distributed as dist

from ._layout import check_grid, empty_bshd, from_bshd, heads_major, to_bshd
from .ops import video_sparse_attention as _video_sparse_attention

__all__ = ["video_sparse_attention", "sequence_to_heads", "heads_to_sequence", "frame_split", "shard"]


def frame_split(frames, world_size):
    """The default split of `frames` frames over `world_size` ranks: as even as possible, the first ranks one more."""
    base, extra = divmod(int(frames), int(world_size))
    return tuple(base + (r < extra) for r in range(int(world_size)))


def _layout_of(grid, frames, group):
    """(tokens of each rank's shard, this rank) for `grid` split by `frames` over `group`."""
    t, h, w = check_grid(grid)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if frames is None:
        frames = frame_split(t, world)
    else:
        try:
            frames = tuple(int(f) for f in frames)
        except (TypeError, ValueError):
            raise ValueError(f"vsa.sequence_parallel: frames: must be a sequence of ints, got {frames!r}") from None
        if len(frames) != world or min(frames) < 0 or sum(frames) != t:
            raise ValueError(f"vsa.sequence_parallel: frames: {frames} must give each of the {world} ranks a "
                             f"number of frames >= 0, {t} (the grid's T) in all")
    return [f * h * w for f in frames], rank


def shard(x, grid, *, group=None, frames=None, layout="bshd"):
    """This rank's frames of a whole raster-order tensor x ([B, T·H·W, heads, D], or [B, heads, S, D] with
    layout='bhsd'): a view, the input sequence_to_heads and video_sparse_attention take."""
    tokens, rank = _layout_of(grid, frames, group)
    view = to_bshd(x, layout)
    if view.shape[1] != sum(tokens):
        raise ValueError(f"vsa.sequence_parallel: shard: {view.shape[1]} tokens, the grid {tuple(grid)} has "
                         f"{sum(tokens)}")
    return from_bshd(view.narrow(1, sum(tokens[:rank]), tokens[rank]), layout)


# ---- the two exchanges, each the other's backward ------------------------------------------------------------
# Both move one buffer per call, whatever the number of tensors: one collective for q, k, v and gate, one for their
# gradients. The buffers are sequence-major ([tokens, B, heads, D]), so that a rank's slice of the whole sequence is
# a contiguous block of the collective's buffer, whatever B: the gathered tensors are views of the receive buffer
# (the op takes strided tensors), and one packing copy is all each exchange adds.

def _to_heads(xs, tokens, rank, group):
    """[B, tokens[rank], P·h_x, D] each (this rank's frames, all heads) -> [B, Σ tokens, h_x, D] views of one
    buffer (the whole sequence, this rank's heads)."""
    p, b, d = len(tokens), xs[0].shape[0], xs[0].shape[3]
    heads = [x.shape[2] // p for x in xs]
    # [B, S_r, P, h, D] -> [P, S_r, B, h, D]: the block for rank j first, each sequence-major.
    blocks = [x.unflatten(2, (p, h)).permute(2, 1, 0, 3, 4) for x, h in zip(xs, heads)]
    if len(xs) == 1:
        send = blocks[0].contiguous()
    else:
        send = xs[0].new_empty((p, tokens[rank], b, sum(heads), d))
        _copy_into_heads(send, blocks)
    recv = xs[0].new_empty((sum(tokens), b, sum(heads), d))
    _all_to_all(recv, send.view(p * tokens[rank], b, sum(heads), d), tokens, [tokens[rank]] * p, group)
    return [y.transpose(0, 1) for y in _split_heads(recv, heads)]


def _to_sequence(ys, tokens, rank, group, majors):
    """[B, Σ tokens, h_y, D] each (the whole sequence, this rank's heads) -> [B, tokens[rank], P·h_y, D] (this
    rank's frames, all heads), [B, H, S, D] memory where majors says so."""
    p, b, d = len(tokens), ys[0].shape[0], ys[0].shape[3]
    heads = [y.shape[2] for y in ys]
    if len(ys) == 1:
        send = ys[0].transpose(0, 1).contiguous()  # no copy for B = 1 and the op's own output layout
    else:
        send = ys[0].new_empty((sum(tokens), b, sum(heads), d))
        _copy_into_heads(send, [y.transpose(0, 1) for y in ys])
    recv = ys[0].new_empty((p * tokens[rank], b, sum(heads), d))
    _all_to_all(recv, send, [tokens[rank]] * p, tokens, group)
    outs = []
    for block, h, major in zip(_split_heads(recv.view(p, tokens[rank], b, sum(heads), d), heads), heads, majors):
        out = empty_bshd(ys[0], (b, tokens[rank], p * h, d), major)
        out.unflatten(2, (p, h)).copy_(block.permute(2, 1, 0, 3, 4))
        outs.append(out)
    return outs


def _all_to_all(recv, send, recv_tokens, send_tokens, group):
    # The exchange only moves bytes: bf16 goes as bytes, which every backend takes (torch 1.13's gloo has no bf16).
    if send.dtype == torch.bfloat16:
        recv, send = recv.view(torch.uint8), send.view(torch.uint8)
    dist.all_to_all_single(recv, send, recv_tokens, send_tokens, group=group)


def _copy_into_heads(buf, parts):
    """Copies parts side by side into buf's head dim (its second last)."""
    for part, dst in zip(parts, _split_heads(buf, [x.shape[-2] for x in parts])):
        dst.copy_(part)


def _split_heads(buf, heads):
    return buf.split(heads, dim=-2)


class _ToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, rank, group, *xs):
        ctx.args = (tokens, rank, group, [heads_major(x) for x in xs])
        return tuple(_to_heads(xs, tokens, rank, group))

    @staticmethod
    def backward(ctx, *dys):
        tokens, rank, group, majors = ctx.args
        return (None, None, None, *_to_sequence(dys, tokens, rank, group, majors))


class _ToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, rank, group, majors, *ys):
        ctx.args = (tokens, rank, group)
        return tuple(_to_sequence(ys, tokens, rank, group, majors))

    @staticmethod
    def backward(ctx, *dxs):
        tokens, rank, group = ctx.args
        return (None, None, None, None, *_to_heads(dxs, tokens, rank, group))


def _check(q, xs, names, world, tokens, rank, heads=True):
    for x, name in zip(xs, names):  # [B, S, H, D] views (to_bshd checked they are 4-d)
        if heads and x.shape[2] % world:
            raise ValueError(f"vsa.sequence_parallel: {name}: {x.shape[2]} heads, not divisible by the world size "
                             f"{world} (each rank computes an equal share of the heads)")
        if x.shape[1] != tokens[rank]:
            raise ValueError(f"vsa.sequence_parallel: {name}: {x.shape[1]} tokens on rank {rank}, its frames hold "
                             f"{tokens[rank]} (shards of {tokens} tokens)")
        if x.dtype != q.dtype or x.device != q.device or x.shape[0] != q.shape[0] or x.shape[3] != q.shape[3]:
            raise ValueError(f"vsa.sequence_parallel: {name}: {x.dtype} {tuple(x.shape)} on {x.device} does not "
                             f"match q's dtype, batch, head dim and device ({q.dtype} {tuple(q.shape)} on {q.device})")


def sequence_to_heads(tensors, grid, *, group=None, frames=None, layout="bshd"):
    """The first all-to-all, differentiable: each of `tensors` this rank's frames with every head ([B, f_r·H·W,
    heads, D]) -> the whole sequence of this rank's heads ([B, T·H·W, heads/P, D]), one collective for all."""
    tokens, rank = _layout_of(grid, frames, group)
    tensors = list(tensors)  # read twice below (a generator would be spent by the first)
    xs = [to_bshd(x, layout) for x in tensors]
    _check(xs[0], xs, [f"tensors[{i}]" for i in range(len(xs))], dist.get_world_size(group), tokens, rank)
    if len(tokens) == 1:  # one rank holds the whole sequence of every head already: the tensors themselves
        return tensors
    return [from_bshd(y, layout) for y in _ToHeads.apply(tokens, rank, group, *xs)]


def heads_to_sequence(tensors, grid, *, group=None, frames=None, layout="bshd"):
    """The second all-to-all, differentiable, sequence_to_heads' inverse: the whole sequence of this rank's heads
    -> this rank's frames with every head, in the layout of the tensors given."""
    tokens, rank = _layout_of(grid, frames, group)
    tensors = list(tensors)
    ys = [to_bshd(y, layout) for y in tensors]
    for i, y in enumerate(ys):
        if y.shape[1] != sum(tokens):
            raise ValueError(f"vsa.sequence_parallel: tensors[{i}]: {y.shape[1]} tokens, the grid has {sum(tokens)}")
    if len(tokens) == 1:
        return tensors
    return [from_bshd(x, layout) for x in _ToSequence.apply(tokens, rank, group, [heads_major(y) for y in ys], *ys)]


def video_sparse_attention(q, k, v, grid, *, gate=None, group=None, frames=None, top_k=None, sparsity=0.9,
                           scale=None, layout="bshd", keep_tiled=False):
    """vsa_torch.video_sparse_attention on a frame shard of each rank of `group` (default: the world), raster order.

    q [B, f_r·H·W, Hq, D], k and v [B, f_r·H·W, Hkv, D], gate like q or None: this rank's frames of the clip's
    latent grid (T, H, W) (`shard` cuts them from whole tensors; `frames` as in frame_split when None); Hq divisible
    by the world size. Returns this rank's frames of o, all heads, in q's layout. top_k, sparsity, scale,
    keep_tiled: as the op takes them (the selection is over the whole clip's tiles, as on one GPU)."""
    grid = check_grid(grid)
    world = dist.get_world_size(group)
    tokens, rank = _layout_of(grid, frames, group)
    xs = [to_bshd(x, layout) for x in (q, k, v)] + ([to_bshd(gate, layout)] if gate is not None else [])
    _check(xs[0], xs[:1] + xs[3:], ["q", "gate"], world, tokens, rank)
    hq, hkv = xs[0].shape[2], xs[1].shape[2]
    if hkv == 0 or hq % hkv or xs[2].shape[2] != hkv:
        raise ValueError(f"vsa.sequence_parallel: k and v: shapes {tuple(k.shape)} and {tuple(v.shape)} must have "
                         f"the same number of heads, dividing q's {hq}")
    # k and v as the caller passed them; their heads need not divide the world size: hkv · repeat = lcm(hkv, P) does.
    _check(xs[0], xs[1:3], ["k", "v"], world, tokens, rank, heads=False)
    if world == 1:  # nothing to exchange: the op on the caller's tensors, as on one GPU without the wrapper
        return _video_sparse_attention(q, k, v, grid, gate=gate, top_k=top_k, sparsity=sparsity, scale=scale,
                                       layout=layout, keep_tiled=keep_tiled)
    repeat = world // math.gcd(hkv, world)
    if repeat > 1:  # kv heads not divisible by the world size: see the module's docstring
        xs[1], xs[2] = xs[1].repeat_interleave(repeat, dim=2), xs[2].repeat_interleave(repeat, dim=2)
    parts = _ToHeads.apply(tokens, rank, group, *xs)
    o = _video_sparse_attention(*parts[:3], grid, gate=parts[3] if gate is not None else None, top_k=top_k,
                                sparsity=sparsity, scale=scale, keep_tiled=keep_tiled)
    (out,) = _ToSequence.apply(tokens, rank, group, [heads_major(xs[0])], o)
    return from_bshd(out, layout)
