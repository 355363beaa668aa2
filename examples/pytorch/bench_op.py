"""What the binding costs: vsa's whole op through torch against the same call in C++ (bench/bench_attention's
op_forward / op_backward, run beside this), the tiling and untiling of raster-order calls, and the host time of a
call. Wan 2.1 1.3B at 480p by default. JSON to --out (and a table on stdout).

    python3 examples/pytorch/bench_op.py --out op.json
"""
import argparse
import json
import statistics
import sys
import time

import torch

import vsa_torch


def gpu_ms(fn, reps, warmup=3):
    """Median milliseconds of fn() on the GPU (CUDA events around each call, after warm-up)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # the call's launches queue behind it: GPU time, as the C++ benchmark times
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_us(fn, calls=20):
    """Host microseconds per call, with the GPU kept busy so that no call waits for it."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued ahead of the calls
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", default="21,30,52")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", help="JSON file")
    args = ap.parse_args()
    if not (torch.cuda.is_available() and vsa_torch.has_cuda()):
        sys.exit("bench_op.py: needs a CUDA GPU and a CUDA build of vsa_torch")
    grid = tuple(int(x) for x in args.grid.split(","))
    h, d = args.heads, args.head_dim
    n = 1
    for x in grid:
        n *= -(-x // 4)
    raster_s, tiled_s = grid[0] * grid[1] * grid[2], n * 64
    dev, bf16 = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(s):
        return torch.randn(1, s, h, d, device=dev, dtype=bf16, generator=gen)

    q, k, v, g, d_o = (rnd(raster_s) for _ in range(5))
    tq, tk, tv, tg, td = (vsa_torch.tile(x, grid) for x in (q, k, v, g, d_o))
    ops = torch.ops.vsa
    lgrid = list(grid)
    results = {"shape": {"grid": grid, "heads": h, "head_dim": d, "sparsity": args.sparsity, "tiles": n}}
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, grid {grid}, {h} heads of {d}", flush=True)

    def record(name, ms, note=""):
        results[name] = ms
        print(f"{name:52s} {ms:9.3f} ms  {note}", flush=True)

    # As bench_attention's op_forward / op_backward: tiled tensors, no gate.
    o, state, _, _ = ops.forward(tq, tk, tv, None, lgrid, 0, args.sparsity, 0.0, None, None, False, False)
    fwd = lambda: ops.forward(tq, tk, tv, None, lgrid, 0, args.sparsity, 0.0, None, None, False, False)  # noqa: E731
    bwd = lambda: ops.backward(td, tq, tk, tv, None, o, state, lgrid, 0, args.sparsity, 0.0,  # noqa: E731
                               None, None, False)
    record("torch.ops.vsa.forward (tiled, no gate)", gpu_ms(fwd, args.reps))
    record("torch.ops.vsa.backward (tiled, no gate)", gpu_ms(bwd, args.reps))
    results["host_us_forward_call"] = host_us(fwd)
    results["host_us_backward_call"] = host_us(bwd)
    print(f"host time per call: forward {results['host_us_forward_call']:.1f} us, backward "
          f"{results['host_us_backward_call']:.1f} us (GPU kept busy)", flush=True)
    o, state, _, _ = ops.forward(tq, tk, tv, tg, lgrid, 0, args.sparsity, 0.0, None, None, False, False)
    record("torch.ops.vsa.forward (tiled, gated)",
           gpu_ms(lambda: ops.forward(tq, tk, tv, tg, lgrid, 0, args.sparsity, 0.0, None, None, False, False),
                  args.reps))
    record("torch.ops.vsa.backward (tiled, gated)",
           gpu_ms(lambda: ops.backward(td, tq, tk, tv, tg, o, state, lgrid, 0, args.sparsity, 0.0, None, None, False),
                  args.reps))

    xs = [x.clone().requires_grad_(True) for x in (q, k, v, g)]
    txs = [x.clone().requires_grad_(True) for x in (tq, tk, tv, tg)]

    def raster_fwd():
        return vsa_torch.video_sparse_attention(*xs[:3], grid, gate=xs[3], sparsity=args.sparsity)

    def tiled_fwd():
        return vsa_torch.video_sparse_attention(*txs[:3], grid, gate=txs[3], sparsity=args.sparsity, order="tiled")

    record("autograd, tiled, gated: forward", gpu_ms(lambda: tiled_fwd(), args.reps))
    record("autograd, tiled, gated: forward + backward", gpu_ms(lambda: tiled_fwd().backward(td), args.reps))
    record("autograd, raster, gated: forward", gpu_ms(lambda: raster_fwd(), args.reps))
    record("autograd, raster, gated: forward + backward", gpu_ms(lambda: raster_fwd().backward(d_o), args.reps))
    tiling = (results["autograd, raster, gated: forward + backward"] -
              results["autograd, tiled, gated: forward + backward"])
    record("tiling + untiling in a raster step", tiling, "(raster − tiled, forward + backward)")
    kept = [x.clone().requires_grad_(True) for x in (q, k, v, g)]
    record("autograd, raster, gated, keep_tiled=True: fwd + bwd", gpu_ms(
        lambda: vsa_torch.video_sparse_attention(*kept[:3], grid, gate=kept[3], sparsity=args.sparsity,
                                                 keep_tiled=True).backward(d_o), args.reps))
    record("tiling + untiling, keep_tiled=True", results["autograd, raster, gated, keep_tiled=True: fwd + bwd"] -
           results["autograd, tiled, gated: forward + backward"])

    one_tile = gpu_ms(lambda: ops.tile(q, lgrid), args.reps)
    one_untile = gpu_ms(lambda: ops.untile(tq, lgrid), args.reps)
    copy = gpu_ms(lambda: tq.clone(), args.reps)
    moved = (raster_s + tiled_s) * h * d * 2
    record("tile, one tensor", one_tile, f"{moved / one_tile / 1e6:.0f} GB/s")
    record("untile, one tensor", one_untile, f"{2 * raster_s * h * d * 2 / one_untile / 1e6:.0f} GB/s "
           "(reads the valid slots only)")
    record("copy of a tiled tensor (torch clone)", copy, f"{2 * tiled_s * h * d * 2 / copy / 1e6:.0f} GB/s")
    record("9 layout passes of a raster step", 9 * one_tile,
           "(q, k, v, gate and dO; q, k, v, gate again in the backward; o and gradients come out raster)")
    record("5 layout passes of a keep_tiled=True step", 5 * one_tile, "(the forward's tiled copies kept)")

    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
