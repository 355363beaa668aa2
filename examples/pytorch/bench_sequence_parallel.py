"""Ulysses sequence parallelism of vsa's whole op (vsa_torch.sequence_parallel) on 1 and N GPUs: one self-attention
layer of Wan 2.1 1.3B at 480p and of Wan 2.2 5B at 720p, each also on a clip 4× as long; forward + backward time
per layer on N GPUs beside one GPU's, and the share spent in the all-to-alls. JSON to --out (rank 0).

    torchrun --nproc-per-node 1 examples/pytorch/bench_sequence_parallel.py --out sp1.json
    torchrun --nproc-per-node 2 examples/pytorch/bench_sequence_parallel.py --out sp2.json

The layer: the q, k, v and gate projections of the rank's tokens (RMSNorm on q and k), the attention, the output
projection; bf16, random weights, no RoPE (elementwise, per token: it scales with the shard like the projections).
On N GPUs each rank holds its frames (vsa_torch.sequence_parallel.frame_split) and the attention is the wrapper; the
one-GPU figures are the plain op over every token, measured by rank 0 alone in the same run (--no-one-gpu skips
them). Times are medians over --reps of CUDA events, the slowest rank's. Per layer:

- layer_ms, attention_ms: forward + backward of the layer, and of the attention alone (the wrapper on N GPUs);
- op_on_head_shard_ms: the plain op on the whole sequence of one rank's heads, what each GPU computes;
- exchange_ms: the wrapper's four exchanges alone (q, k, v and gate in, o out, dO in, their gradients out) with their
  packing copies, as the wrapper runs them; collectives_ms: the four all-to-all calls alone on ready buffers;
- exchange_share: exchange_ms / layer_ms (exchange_share_of_attention: over attention_ms); all four 0 on one GPU,
  where the wrapper exchanges nothing;
- layer_speedup, attention_speedup: one GPU's time over N GPUs'.

The 4× clip has 4× the video frames: 1 + 4·(T − 1) latent frames (Wan's VAE keeps the first frame and packs 4 a
latent frame). NVLink multicast is off (NCCL_NVLS_ENABLE=0): an all-to-all gains nothing from it.
"""
import argparse
import json
import os
import statistics
import sys

os.environ["NCCL_NVLS_ENABLE"] = "0"  # before NCCL reads its environment (at the first communicator)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from bench_block import MODELS, RMSNorm, median_ms  # noqa: E402  (the same models and timing as the block bench)

DEV = "cuda"


class AttentionLayer(nn.Module):
    """Wan's self-attention on [B, S, dim] tokens: projections, attention of [B, S, heads, D], output projection."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.gate, self.o = (nn.Linear(dim, dim) for _ in range(5))
        self.norm_q, self.norm_k = RMSNorm(dim), RMSNorm(dim)

    def forward(self, x, attend):
        def heads(y):
            return y.unflatten(-1, (self.heads, -1))

        q, k = heads(self.norm_q(self.q(x))), heads(self.norm_k(self.k(x)))
        return self.o(attend(q, k, heads(self.v(x)), heads(self.gate(x))).flatten(2))


def slowest(ms):
    """The largest of every rank's ms: the group's step waits for its slowest rank."""
    t = torch.tensor([ms], device=DEV, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def fwd_bwd(fn, inputs, d_out):
    def step():
        torch.autograd.backward(fn(*inputs), d_out)
    return step


def bench_layer(name, clip, args, world, rank):
    import vsa_torch
    import vsa_torch.sequence_parallel as sp

    cfg = MODELS[name]
    dim, heads = cfg["dim"], cfg["heads"]
    t, h, w = cfg["grid"]
    grid = (1 + clip * (t - 1), h, w)
    hd = dim // heads
    if heads % world:
        return None
    dev, bf16 = DEV, torch.bfloat16
    frames = sp.frame_split(grid[0], world)
    s, s_r = grid[0] * h * w, frames[rank] * h * w
    torch.manual_seed(0)  # the same weights on every rank
    layer = AttentionLayer(dim, heads).to(dev, bf16)
    for p in layer.parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    op = dict(sparsity=args.sparsity)

    def plain(q, k, v, g):
        return vsa_torch.video_sparse_attention(q, k, v, grid, gate=g, **op)

    def wrapped(q, k, v, g):
        return sp.video_sparse_attention(q, k, v, grid, gate=g, **op)

    def rand(*shape):
        return torch.randn(*shape, device=dev, dtype=bf16)

    def leaves(n, tokens, hh):
        return [rand(1, tokens, hh, hd).requires_grad_(True) for _ in range(n)]

    def timed(step):
        return slowest(median_ms(step, args.reps, args.warmup)[0])

    r = {"model": name, "clip": clip, "grid": grid, "tokens": s, "dim": dim, "heads": heads, "head_dim": hd,
         "sparsity": args.sparsity, "world_size": world, "frames": frames}
    if args.one_gpu:
        if rank == 0:  # the one-GPU layer over every token, alone on the host's first GPU
            x = rand(1, s, dim).requires_grad_(True)
            one = {"layer_ms": median_ms(fwd_bwd(lambda x: layer(x, plain), [x], rand(1, s, dim)), args.reps,
                                         args.warmup)[0],
                   "attention_ms": median_ms(fwd_bwd(plain, leaves(4, s, heads), rand(1, s, heads, hd)), args.reps,
                                             args.warmup)[0]}
            del x
            torch.cuda.empty_cache()
            r["one_gpu"] = one
        dist.barrier()

    x = rand(1, s_r, dim).requires_grad_(True)
    r["layer_ms"] = timed(fwd_bwd(lambda x: layer(x, wrapped), [x], rand(1, s_r, dim)))
    del x
    r["attention_ms"] = timed(fwd_bwd(wrapped, leaves(4, s_r, heads), rand(1, s_r, heads, hd)))
    hp = heads // world
    r["op_on_head_shard_ms"] = timed(fwd_bwd(plain, leaves(4, s, hp), rand(1, s, hp, hd)))

    def exchange_times():
        """The wrapper's four exchanges with their packing, and the four all-to-all calls alone on ready buffers."""
        shards, o_heads = leaves(4, s_r, heads), leaves(1, s, hp)
        d_parts, d_out = [rand(1, s, hp, hd) for _ in range(4)], rand(1, s_r, heads, hd)

        def exchanges():
            parts = sp.sequence_to_heads(shards, grid)  # q, k, v, gate in
            (out,) = sp.heads_to_sequence(o_heads, grid)  # o out
            torch.autograd.backward(parts + [out], d_parts + [d_out])  # dO in, dq, dk, dv, dgate out

        tokens = [f * h * w for f in frames]
        bufs = {n: (rand(s, 1, n, hd), rand(world * s_r, 1, n, hd)) for n in (4 * hp, hp)}

        def collectives():
            for n, to_heads in ((4 * hp, True), (hp, False), (hp, True), (4 * hp, False)):
                whole, mine = bufs[n]
                if to_heads:  # the wrapper's own call
                    sp._all_to_all(whole, mine, tokens, [s_r] * world, None)
                else:
                    sp._all_to_all(mine, whole, [s_r] * world, tokens, None)

        return timed(exchanges), timed(collectives)

    # A group of one exchanges nothing (the wrapper calls the op): nothing to time.
    r["exchange_ms"], r["collectives_ms"] = exchange_times() if world > 1 else (0.0, 0.0)
    r["exchange_share"] = r["exchange_ms"] / r["layer_ms"]
    r["exchange_share_of_attention"] = r["exchange_ms"] / r["attention_ms"]
    if "one_gpu" in r:
        r["layer_speedup"] = r["one_gpu"]["layer_ms"] / r["layer_ms"]
        r["attention_speedup"] = r["one_gpu"]["attention_ms"] / r["attention_ms"]
    torch.cuda.empty_cache()
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", choices=sorted(MODELS), help="default: both")
    ap.add_argument("--clip", action="append", type=int, help="clip length factors (default: 1 and 4)")
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-one-gpu", dest="one_gpu", action="store_false", help="skip the one-GPU figures")
    ap.add_argument("--out", help="JSON file (written by rank 0)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_sequence_parallel.py: needs CUDA GPUs (run it under torchrun, one process a GPU)")
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)  # a plain `python3 bench_sequence_parallel.py` is one rank
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"# {world} × {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, sparsity {args.sparsity}, "
        f"median of {args.reps} after {args.warmup}, the slowest rank's", flush=True)
    say(f"{'model':18s} {'clip':>4s} {'tokens':>7s} {'layer ms':>9s} {'1 GPU':>8s} {'speedup':>7s} {'attn ms':>8s} "
        f"{'1 GPU':>8s} {'a2a ms':>7s} {'share':>6s}", flush=True)
    results = []
    for name in args.model or list(MODELS):
        for clip in args.clip or [1, 4]:
            r = bench_layer(name, clip, args, world, rank)
            if r is None:
                say(f"{name:18s} {clip:4d} skipped: {MODELS[name]['heads']} heads, not divisible by {world}")
                continue
            results.append(r)
            one = r.get("one_gpu", {})
            say(f"{name:18s} {clip:4d} {r['tokens']:7d} {r['layer_ms']:9.2f} {one.get('layer_ms', float('nan')):8.2f} "
                f"{r.get('layer_speedup', float('nan')):6.2f}x {r['attention_ms']:8.2f} "
                f"{one.get('attention_ms', float('nan')):8.2f} {r['exchange_ms']:7.2f} {r['exchange_share']:6.1%}",
                flush=True)
    if args.out and rank == 0:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "gpus": world, "torch": torch.__version__,
                       "nccl": str(torch.cuda.nccl.version()), "results": results}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
