"""The op written from its definition in plain torch, differentiable by autograd: what the tests hold the kernels
to. Dense [B, S, H, D] tensors in tiled order (S = N·64); float32 or float64."""
import torch


def tile_extents(grid):
    t, h, w = grid
    return [-(-x // 4) for x in (t, h, w)]


def tile_counts(grid):
    """Valid tokens of each tile, in tile order (t, h, w)."""
    nt, nh, nw = tile_extents(grid)
    dims = []
    for n, length in zip((nt, nh, nw), grid):
        d = torch.full((n,), 4, dtype=torch.int64)
        d[-1] = length - 4 * (n - 1)
        dims.append(d)
    return (dims[0][:, None, None] * dims[1][None, :, None] * dims[2][None, None, :]).reshape(-1)


def slot_to_raster(grid):
    """For each tiled slot, its raster token (t·H + h)·W + w, or -1 for padding: a tile's valid tokens fill its first
    slots in row-major order over the tile's own extent."""
    t_len, h_len, w_len = grid
    nt, nh, nw = tile_extents(grid)
    out = []
    for tt in range(nt):
        for th in range(nh):
            for tw in range(nw):
                rows = []
                for t in range(tt * 4, min(tt * 4 + 4, t_len)):
                    for h in range(th * 4, min(th * 4 + 4, h_len)):
                        for w in range(tw * 4, min(tw * 4 + 4, w_len)):
                            rows.append((t * h_len + h) * w_len + w)
                out.extend(rows + [-1] * (64 - len(rows)))
    return torch.tensor(out, dtype=torch.int64)


def tile(x, grid):
    idx = slot_to_raster(grid).to(x.device)
    y = x.new_zeros((x.shape[0], idx.numel(), x.shape[2], x.shape[3]))
    valid = idx >= 0
    y[:, valid] = x[:, idx[valid]]
    return y


def untile(x, grid):
    idx = slot_to_raster(grid).to(x.device)
    valid = idx >= 0
    y = x.new_zeros((x.shape[0], int(valid.sum()), x.shape[2], x.shape[3]))
    y[:, idx[valid]] = x[:, valid]
    return y


def _valid_slots(grid, device):
    counts = tile_counts(grid).to(device)
    slot = torch.arange(counts.numel() * 64, device=device)
    return slot % 64 < counts[slot // 64], counts


def _heads(x, hq):
    return x.repeat_interleave(hq // x.shape[2], dim=2)


def block_means(x, grid):
    valid, counts = _valid_slots(grid, x.device)
    b, s, h, d = x.shape
    xt = (x * valid[None, :, None, None]).view(b, s // 64, 64, h, d)
    return xt.sum(2) / counts[None, :, None, None].to(x.dtype)


def sparse_attention(q, k, v, grid, scale, selected):
    """selected [B, Hq, N, N] bool: query tile i attends to key tile j. Padding query rows and rows with nothing
    selected give 0."""
    valid, _ = _valid_slots(grid, q.device)
    hq = q.shape[2]
    k, v = _heads(k, hq), _heads(v, hq)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    tiles = torch.arange(q.shape[1], device=q.device) // 64
    allowed = selected[:, :, tiles][:, :, :, tiles] & valid[None, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # rows with no key at all
    o = torch.einsum("bhij,bjhd->bihd", p, v)
    return o * valid[None, :, None, None]


def top_k_selection(scores, k):
    idx = scores.topk(k, dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)


def lists_to_selection(q2k, counts, n):
    b, h, _, cap = q2k.shape
    sel = torch.zeros((b, h, n, n + 1), dtype=torch.bool, device=q2k.device)
    used = torch.arange(cap, device=q2k.device)[None, None, None, :] < counts[..., None]
    idx = torch.where(used, q2k.long(), torch.full_like(q2k.long(), n))
    sel.scatter_(-1, idx, True)
    return sel[..., :n]


def video_sparse_attention(q, k, v, gate, grid, top_k, scale, lists=None):
    """o = o_s + g ⊙ o_c in tiled order (g = 1 where gate is None). lists: (q2k, counts) to select the key tiles
    instead of the top-k of the coarse scores (the coarse branch still adds o_c: the op given its own selection)."""
    valid, _ = _valid_slots(grid, q.device)
    hq = q.shape[2]
    q_c, k_c, v_c = block_means(q, grid), _heads(block_means(k, grid), hq), _heads(block_means(v, grid), hq)
    scores = torch.einsum("bihd,bjhd->bhij", q_c, k_c) * scale
    n = scores.shape[-1]
    selected = top_k_selection(scores.detach(), top_k) if lists is None else lists_to_selection(*lists, n)
    o_s = sparse_attention(q, k, v, grid, scale, selected)
    o_c = torch.einsum("bhij,bjhd->bihd", torch.softmax(scores, dim=-1), v_c)
    o_c = o_c.repeat_interleave(64, dim=1) * valid[None, :, None, None]
    return o_s + (o_c if gate is None else gate * o_c)


def joint_video_sparse_attention(q, k, v, gate, grid, top_k, scale, extra, first):
    """The op with `extra` tokens (joint attention) after the video's N·64 tiled slots (first: before them), every
    tensor holding N·64 + extra tokens: the coarse branch, the selection and the gate on the video part; a video
    query attends to its selected tiles' valid tokens and to every extra token, an extra query to every valid token;
    o = o_s + g ⊙ o_c on the video rows, o_s on the extra rows."""
    s = q.shape[1] - extra
    video = slice(extra, extra + s) if first else slice(0, s)
    valid, _ = _valid_slots(grid, q.device)
    hq = q.shape[2]
    qv, kv, vv = q[:, video], k[:, video], v[:, video]
    q_c, k_c, v_c = block_means(qv, grid), _heads(block_means(kv, grid), hq), _heads(block_means(vv, grid), hq)
    scores_c = torch.einsum("bihd,bjhd->bhij", q_c, k_c) * scale
    selected = top_k_selection(scores_c.detach(), top_k)
    # Which keys each query sees, over the joint token axis.
    is_extra = torch.ones(q.shape[1], dtype=torch.bool, device=q.device)
    is_extra[video] = False
    tile = torch.zeros(q.shape[1], dtype=torch.long, device=q.device)
    tile[video] = torch.arange(s, device=q.device) // 64
    key_ok = is_extra.clone()
    key_ok[video] = valid
    sel = selected[:, :, tile][:, :, :, tile]  # [B, Hq, S, S] by tile
    allowed = (sel | is_extra[None, None, :, None] | is_extra[None, None, None, :]) & key_ok[None, None, None, :]
    allowed = allowed & key_ok[None, None, :, None]  # padding query rows attend to nothing
    kk, vv2 = _heads(k, hq), _heads(v, hq)
    scores = torch.einsum("bihd,bjhd->bhij", q, kk) * scale
    p = torch.nan_to_num(torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1), nan=0.0)
    o = torch.einsum("bhij,bjhd->bihd", p, vv2)
    o_c = torch.einsum("bhij,bjhd->bihd", torch.softmax(scores_c, dim=-1), v_c)
    o_c = o_c.repeat_interleave(64, dim=1) * valid[None, :, None, None]
    coarse = o_c if gate is None else gate[:, video] * o_c
    return torch.cat([o[:, :extra], o[:, extra:] + coarse], 1) if first else torch.cat([o[:, :s] + coarse, o[:, s:]], 1)


def linear_attention(q, k, v, phi, eps, valid=None):
    """φ(q_i)·(Σ_j φ(k_j)ᵀ v_j) / (φ(q_i)·Σ_j φ(k_j) + eps) over the tokens j with valid[j]; invalid rows 0."""
    def feature(x):
        if phi == "softmax":
            return torch.softmax(x, dim=-1)
        if phi == "elu1":
            return torch.where(x > 0, x + 1, torch.exp(x))
        return torch.relu(x)

    hq = q.shape[2]
    fq, fk, v = feature(q), feature(_heads(k, hq)), _heads(v, hq)
    if valid is not None:
        fk = fk * valid[None, :, None, None]
    kv = torch.einsum("bjhd,bjhe->bhde", fk, v)
    ksum = fk.sum(1)  # [B, H, D]
    num = torch.einsum("bihd,bhde->bihe", fq, kv)
    den = torch.einsum("bihd,bhd->bih", fq, ksum)[..., None] + eps
    o = num / den
    return o if valid is None else o * valid[None, :, None, None]
