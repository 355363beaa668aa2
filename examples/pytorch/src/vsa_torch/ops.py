"""vsa's ops for PyTorch, differentiable: the whole op, tiling, sparse attention on caller lists, the linear branch.

Every function takes the caller's tensors as they are: [B, S, H, D] (layout="bshd") or [B, H, S, D]
(layout="bhsd"), any strides. The kernels run on the tensors' device (CUDA: the library's GPU kernels on torch's
current stream; CPU: the library's reference, any float dtype), with scratch from torch's allocator and no host
synchronisation, so the ops can be captured in CUDA graphs and traced by torch.compile."""
import torch

from ._layout import check_grid, from_bshd, head_contiguous, to_bshd

_ops = torch.ops.vsa


# ---- tiling -----------------------------------------------------------------------------------------------

class _Layout(torch.autograd.Function):
    """tile (to_tiled) or untile, each the other's backward: tile's padding slots hold constants, and the
    gradient of the slots untile drops is zero."""

    @staticmethod
    def forward(ctx, x, grid, to_tiled):
        ctx.grid, ctx.to_tiled = grid, to_tiled
        return (_ops.tile if to_tiled else _ops.untile)(x, grid)

    @staticmethod
    def backward(ctx, dy):
        return (_ops.untile if ctx.to_tiled else _ops.tile)(head_contiguous(dy), ctx.grid), None, None


def tile(x, grid, *, layout="bshd"):
    """Raster order (t, h, w) -> tiled order: x [B, T·H·W, H, D] -> [B, N·64, H, D], padding slots zero."""
    grid = check_grid(grid)
    return from_bshd(_Layout.apply(to_bshd(x, layout), grid, True), layout)


def untile(x, grid, *, layout="bshd"):
    """Tiled order -> raster order: x [B, N·64, H, D] -> [B, T·H·W, H, D], padding slots dropped."""
    grid = check_grid(grid)
    return from_bshd(_Layout.apply(to_bshd(x, layout), grid, False), layout)


# ---- the whole op -----------------------------------------------------------------------------------------

class _VideoSparseAttention(torch.autograd.Function):
    """The whole op on [B, S, H, D] views. In raster order the op takes the inputs as they are (the library's
    input_order): its block means write the tiled q, k, v and gate as they read them, its combine backward the tiled
    dO, and o and the gradients come out in raster order (output_order), so no layout pass runs of its own.
    keep_tiled: the backward reads the forward's tiled q, k, v and gate; otherwise the caller's raster tensors are
    kept and tiled again (less memory by the tiles' padding, four layout passes)."""

    @staticmethod
    def forward(ctx, q, k, v, gate, grid, top_k, sparsity, scale, raster, q2k, q2k_count, return_selection,
                keep_tiled, extra, extra_first):
        inputs = (q, k, v, gate)
        if raster:
            out, state, lists, counts, q, k, v, tiled_gate = _ops.forward_raster(
                q, k, v, gate, grid, top_k, sparsity, scale, q2k, q2k_count, return_selection, True)
            gate = tiled_gate if gate is not None else None
        else:
            out, state, lists, counts = _ops.forward(q, k, v, gate, grid, top_k, sparsity, scale, q2k, q2k_count,
                                                     return_selection, False, extra, extra_first)
        retile = raster and not keep_tiled
        ctx.args = (grid, top_k, sparsity, scale, raster, gate is not None, retile, extra, extra_first)
        ctx.save_for_backward(*(inputs if retile else (q, k, v, gate)), out, state, q2k, q2k_count)
        ctx.mark_non_differentiable(lists, counts)
        return out, lists, counts

    @staticmethod
    def backward(ctx, d_out, _lists, _counts):
        grid, top_k, sparsity, scale, raster, gated, retile, extra, extra_first = ctx.args
        q, k, v, gate, out, state, q2k, q2k_count = ctx.saved_tensors
        if retile:
            q, k, v = _ops.tile(q, grid), _ops.tile(k, grid), _ops.tile(v, grid)
            gate = _ops.tile(gate, grid) if gated else None
        d_o = head_contiguous(d_out)
        dq, dk, dv, dgate = _ops.backward(d_o, q, k, v, gate, out, state, grid, top_k, sparsity, scale, q2k,
                                          q2k_count, raster, extra, extra_first, raster)
        if not gated:
            dgate = None
        return dq, dk, dv, dgate, None, None, None, None, None, None, None, None, None, None, None


def video_sparse_attention(q, k, v, grid, *, gate=None, top_k=None, sparsity=0.9, scale=None, layout="bshd",
                           order="raster", return_selection=False, q2k=None, keep_tiled=False, extra_tokens=0,
                           extra_first=False):
    """Video sparse attention: o = o_s + gate ⊙ o_c over the 4×4×4 tiles of the latent grid (T, H, W).

    q [B, S, Hq, D], k and v [B, S, Hkv, D] (Hkv divides Hq), gate like q or None (g = 1); S = T·H·W in raster
    order (the model's own token order; tiled and untiled inside) or N·64 in tiled order. Each query tile attends
    to its top_k key tiles (top_k None: ceil((1 - sparsity)·N)), scale None: 1/sqrt(D).

    return_selection=True also returns the selected lists (q2k [B, Hq, N, k] int32, counts [B, Hq, N]); passing
    them back as q2k=(q2k, counts) skips the coarse pass and the selection (o = o_s then, and gate must be None).

    keep_tiled (raster order): False (the default) keeps the caller's tensors for the backward, which tiles them
    again; True keeps the tiled copies of q, k, v and gate the forward made instead: four layout passes fewer
    (~0.2 ms a step at Wan 2.1), more memory held between the passes (the tiles' padding: 22% at 21×30×52).
    In raster order o and the gradients come out of the kernels in raster order, with no untile pass.

    extra_tokens (joint attention: text or condition tokens in the same sequence, HunyuanVideo-style): every tensor
    holds that many more tokens after the video's (extra_first=True: before them), unpadded; a video query attends
    to its selected tiles and to every extra token, an extra query to every token, and the coarse branch, the
    selection and the gate see the video part only. Tiled order only so far (S = N·64 + extra_tokens)."""
    grid = check_grid(grid)
    if order not in ("raster", "tiled"):
        raise ValueError(f"vsa: order: must be 'raster' or 'tiled', got {order!r}")
    extra_tokens = int(extra_tokens)
    if extra_tokens < 0:
        raise ValueError(f"vsa: extra_tokens: must be >= 0, got {extra_tokens}")
    if extra_tokens and order != "tiled":
        raise ValueError("vsa: extra_tokens: the op takes them in tiled order only so far (order='tiled')")
    lists, counts = (None, None) if q2k is None else q2k
    views = [to_bshd(x, layout) for x in (q, k, v)]
    g = to_bshd(gate, layout) if gate is not None else None
    out, sel, sel_counts = _VideoSparseAttention.apply(*views, g, grid, 0 if top_k is None else int(top_k),
                                                       float(sparsity), 0.0 if scale is None else float(scale),
                                                       order == "raster", lists, counts, bool(return_selection),
                                                       bool(keep_tiled), extra_tokens, bool(extra_first))
    out = from_bshd(out, layout)
    if not return_selection:
        return out
    return out, ((sel, sel_counts) if q2k is None else (lists, counts))


# ---- sparse attention on caller lists ---------------------------------------------------------------------

class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q2k, q2k_count, grid, scale):
        o, lse = _ops.sparse_attention(q, k, v, q2k, q2k_count, grid, scale)
        ctx.args = (grid, scale)
        ctx.save_for_backward(q, k, v, o, lse, q2k, q2k_count)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, d_o, _lse):
        grid, scale = ctx.args
        q, k, v, o, lse, q2k, q2k_count = ctx.saved_tensors
        d_o = head_contiguous(d_o)
        dq, dk, dv = _ops.sparse_attention_backward(d_o, q, k, v, o, lse, q2k, q2k_count, grid, scale)
        return dq, dk, dv, None, None, None, None


def sparse_attention(q, k, v, q2k, q2k_count, grid, *, scale=None, layout="bshd", return_lse=False):
    """Exact attention of every query tile over the key tiles of its list, in tiled order (S = N·64).

    q2k [B, Hq, N, capacity] int32 (ascending tiles in each row's first q2k_count[b, h, i] slots), q2k_count
    [B, Hq, N] int32. Padding rows and rows with empty lists give o = 0 (lse = +inf). On the GPU the lists are
    trusted as given; the CPU kernel checks them."""
    grid = check_grid(grid)
    views = [to_bshd(x, layout) for x in (q, k, v)]
    d = views[0].shape[3]
    o, lse = _SparseAttention.apply(*views, q2k, q2k_count, grid, float(d) ** -0.5 if scale is None else float(scale))
    o = from_bshd(o, layout)
    return (o, lse) if return_lse else o


# ---- the linear-attention branch --------------------------------------------------------------------------

_PHI = {"softmax": 0, "elu1": 1, "relu": 2}


class _LinearAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, grid, phi, eps, raster):
        ctx.args = (grid, phi, eps, raster)
        ctx.save_for_backward(q, k, v)
        return _ops.linear_attention(q, k, v, grid, phi, eps, raster)

    @staticmethod
    def backward(ctx, d_o):
        grid, phi, eps, raster = ctx.args
        q, k, v = ctx.saved_tensors
        d_o = head_contiguous(d_o)
        dq, dk, dv = _ops.linear_attention_backward(d_o, q, k, v, grid, phi, eps, raster)
        return dq, dk, dv, None, None, None, None


def linear_attention(q, k, v, grid, *, phi="elu1", eps=1e-6, layout="bshd", order="raster"):
    """o_i = φ(q_i)·(Σ_j φ(k_j)ᵀ v_j) / (φ(q_i)·Σ_j φ(k_j) + eps) over the valid tokens of each sequence;
    φ one of 'softmax', 'elu1', 'relu'; raster (S = T·H·W) or tiled (S = N·64, padding slots excluded) order."""
    grid = check_grid(grid)
    if phi not in _PHI:
        raise ValueError(f"vsa: phi: must be one of {sorted(_PHI)}, got {phi!r}")
    if order not in ("raster", "tiled"):
        raise ValueError(f"vsa: order: must be 'raster' or 'tiled', got {order!r}")
    views = [to_bshd(x, layout) for x in (q, k, v)]
    return from_bshd(_LinearAttention.apply(*views, grid, _PHI[phi], float(eps), order == "raster"), layout)
