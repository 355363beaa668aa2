"""One Wan transformer block, forward + backward, with its self-attention as dense SDPA (cuDNN, FlashAttention-2),
as vsa, and as FastVideo's VSA where its package is importable: step time, the attention's share of it, and peak
memory. Random bf16 weights; JSON to --out.

    python3 examples/pytorch/bench_block.py --out block.json
    python3 examples/pytorch/bench_block.py --model wan2.2-5b-720p --reps 10

Block (Wan 2.1/2.2): adaLN modulation from the timestep, LayerNorm, q/k/v projections with RMSNorm on q and k,
3D RoPE, self-attention, output projection; cross-attention to 512 text tokens; a GELU FFN. The VSA variants add
the gate projection of the coarse output (FastVideo's to_gate_compress) and take the model's raster tokens as they
are (vsa tiles and untiles inside; FastVideo's variant tiles with torch gathers, as FastVideo does).
"""
import argparse
import json
import math
import statistics
import sys

import torch
import torch.nn.functional as F
from torch import nn

MODELS = {
    "wan2.1-1.3b-480p": dict(dim=1536, heads=12, ffn=8960, grid=(21, 30, 52)),
    "wan2.2-5b-720p": dict(dim=3072, heads=24, ffn=14336, grid=(31, 22, 40)),
}
TEXT_TOKENS = 512


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(grid, head_dim, device):
    """e^(i·angle) [S, 1, D/2] of Wan's 3D RoPE: the head dim's pairs split between t, h and w frequencies."""
    half = head_dim // 2
    parts = [half - 2 * (half // 3), half // 3, half // 3]
    t, h, w = grid
    pos = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"), -1)
    pos = pos.reshape(-1, 3).double()
    angles = []
    for axis, n in enumerate(parts):
        freqs = 1.0 / (10000 ** (torch.arange(n, dtype=torch.float64) * 2 / (2 * n)))
        angles.append(pos[:, axis:axis + 1] * freqs[None, :])
    a = torch.cat(angles, -1)
    return torch.polar(torch.ones_like(a), a).to(torch.complex64)[:, None, :].to(device)


def apply_rope(x, freqs):
    """x [B, S, H, D], pairs (2i, 2i + 1) rotated by the position's angle (a complex product, as Wan does)."""
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(xc * freqs).flatten(-2).type_as(x)


# ---- self-attention variants: q, k, v [B, S, H, D] in raster order, gate (VSA) like q -------------------------

def dense(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}[backend]

    def attend(q, k, v, gate, grid):
        with sdpa_kernel(chosen):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return o.transpose(1, 2)

    return attend


def vsa_attention(sparsity, keep_tiled=False):
    import vsa_torch

    def attend(q, k, v, gate, grid):
        return vsa_torch.video_sparse_attention(q, k, v, grid, gate=gate, sparsity=sparsity, keep_tiled=keep_tiled)

    return attend


def fastvideo_attention(sparsity):
    from fastvideo_kernel.ops import video_sparse_attn
    from fastvideo_kernel.vsa_utils import build_vsa_metadata

    cache = {}

    def attend(q, k, v, gate, grid):
        if grid not in cache:
            cache[grid] = build_vsa_metadata(grid, device=q.device)
        meta = cache[grid]
        idx, rev, vbs, npi = (meta[x] for x in ("tile_partition_indices", "reverse_tile_partition_indices",
                                               "variable_block_sizes", "non_pad_index"))
        n = vbs.numel()

        def to_tiles(x):  # raster [B, S, H, D] -> tiled, padded [B, H, N·64, D] with torch gathers
            x = x[:, idx]
            y = x.new_zeros((x.shape[0], n * 64, x.shape[2], x.shape[3]))
            y[:, npi] = x
            return y.transpose(1, 2)

        topk = max(1, math.ceil((1 - sparsity) * n))
        o = video_sparse_attn(to_tiles(q), to_tiles(k), to_tiles(v), vbs, vbs, topk, block_size=(4, 4, 4),
                              compress_attn_weight=to_tiles(gate))
        return o.transpose(1, 2)[:, npi][:, rev]

    return attend


class WanBlock(nn.Module):
    def __init__(self, dim, heads, ffn, gated):
        super().__init__()
        self.heads = heads
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)
        self.norm1 = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.gate = nn.Linear(dim, dim) if gated else None
        self.norm_q, self.norm_k = RMSNorm(dim), RMSNorm(dim)
        self.norm3 = nn.LayerNorm(dim, eps=1e-6)
        self.cq, self.ck, self.cv, self.co = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_cq, self.norm_ck = RMSNorm(dim), RMSNorm(dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn), nn.GELU(approximate="tanh"), nn.Linear(ffn, dim))

    def heads_of(self, x):
        return x.unflatten(-1, (self.heads, -1))

    def forward(self, x, context, e, rope, grid, attend):
        shift, scale, gate_msa, c_shift, c_scale, c_gate = (self.modulation + e).chunk(6, dim=1)
        y = self.norm1(x) * (1 + scale) + shift
        q = apply_rope(self.heads_of(self.norm_q(self.q(y))), rope)
        k = apply_rope(self.heads_of(self.norm_k(self.k(y))), rope)
        v = self.heads_of(self.v(y))
        g = self.heads_of(self.gate(y)) if self.gate is not None else None
        x = x + self.o(attend(q, k, v, g, grid).flatten(2)) * gate_msa
        y = self.norm3(x)
        cq = self.heads_of(self.norm_cq(self.cq(y))).transpose(1, 2)
        ck = self.heads_of(self.norm_ck(self.ck(context))).transpose(1, 2)
        cv = self.heads_of(self.cv(context)).transpose(1, 2)
        x = x + self.co(F.scaled_dot_product_attention(cq, ck, cv).transpose(1, 2).flatten(2))
        y = self.norm2(x) * (1 + c_scale) + c_shift
        return x + self.ffn(y) * c_gate


def median_ms(fn, reps, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), min(times), max(times)


def run(model_name, variant, attend, reps, warmup, seed=0):
    cfg = MODELS[model_name]
    dim, heads, grid = cfg["dim"], cfg["heads"], cfg["grid"]
    dev = "cuda"
    torch.manual_seed(seed)
    block = WanBlock(dim, heads, cfg["ffn"], gated=variant not in ("dense-cudnn", "dense-fa2")).to(dev, torch.bfloat16)
    for p in block.parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    s = grid[0] * grid[1] * grid[2]
    x = torch.randn(1, s, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    context = torch.randn(1, TEXT_TOKENS, dim, device=dev, dtype=torch.bfloat16)
    e = torch.randn(1, 6, dim, device=dev, dtype=torch.bfloat16) * 0.1
    rope = rope_tables(grid, dim // heads, dev)
    d_out = torch.randn(1, s, dim, device=dev, dtype=torch.bfloat16)

    def step():
        out = block(x, context, e, rope, grid, attend)
        out.backward(d_out)

    step_ms = median_ms(step, reps, warmup)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()

    # The self-attention alone, forward + backward, on inputs of the block's shapes.
    hd = dim // heads
    qkvg = [torch.randn(1, s, heads, hd, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(4)]
    gate = qkvg[3] if block.gate is not None else None
    d_o = torch.randn(1, s, heads, hd, device=dev, dtype=torch.bfloat16)
    attn_ms = median_ms(lambda: attend(*qkvg[:3], gate, grid).backward(d_o), reps, warmup)
    return {
        "model": model_name, "variant": variant, "tokens": s, "step_ms": step_ms[0], "step_ms_min": step_ms[1],
        "step_ms_max": step_ms[2], "attention_ms": attn_ms[0], "attention_share": attn_ms[0] / step_ms[0],
        "peak_gb": peak / 1e9, "step_peak_above_inputs_gb": (peak - base) / 1e9,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", choices=sorted(MODELS), help="default: both")
    ap.add_argument("--variant", action="append", help="dense-cudnn, dense-fa2, vsa, vsa-keep-tiled (keep_tiled=True), fastvideo (default: all)")
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", help="JSON file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_block.py: needs a CUDA GPU")
    variants = {"dense-cudnn": lambda: dense("cudnn"), "dense-fa2": lambda: dense("fa2"),
                "vsa": lambda: vsa_attention(args.sparsity),
                "vsa-keep-tiled": lambda: vsa_attention(args.sparsity, keep_tiled=True),
                "fastvideo": lambda: fastvideo_attention(args.sparsity)}
    chosen = args.variant or list(variants)
    results = []
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, sparsity {args.sparsity}, "
          f"median of {args.reps} after {args.warmup}", flush=True)
    print(f"{'model':18s} {'variant':12s} {'step ms':>9s} {'attn ms':>9s} {'share':>6s} {'peak GB':>8s} "
          f"{'vs cuDNN':>8s}", flush=True)
    for model in args.model or list(MODELS):
        dense_ms = None
        for name in chosen:
            try:
                attend = variants[name]()
            except ImportError as err:
                print(f"{model:18s} {name:12s} skipped: {err}", flush=True)
                continue
            r = run(model, name, attend, args.reps, args.warmup)
            dense_ms = r["step_ms"] if name == "dense-cudnn" else dense_ms
            r["speedup_vs_dense_cudnn"] = dense_ms / r["step_ms"] if dense_ms else None
            results.append(r)
            speed = f"{r['speedup_vs_dense_cudnn']:.2f}x" if dense_ms else "-"
            print(f"{model:18s} {name:12s} {r['step_ms']:9.2f} {r['attention_ms']:9.2f} {r['attention_share']:6.0%} "
                  f"{r['peak_gb']:8.2f} {speed:>8s}", flush=True)
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f,
                      indent=2)


if __name__ == "__main__":
    main()
