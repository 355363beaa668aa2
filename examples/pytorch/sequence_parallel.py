"""Ulysses sequence parallelism with vsa: each rank holds its frames of a clip, vsa_torch.sequence_parallel runs the
whole op over the group, forward and backward, and each rank checks its frames against the op on one process.

    torchrun --nproc-per-node 2 examples/pytorch/sequence_parallel.py       # GPUs: NCCL, bf16
    python3 examples/pytorch/sequence_parallel.py --cpu 2                   # CPU: 2 processes over gloo, float32
"""
import argparse
import os
import socket

os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off: an all-to-all gains nothing from it

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import vsa_torch  # noqa: E402
import vsa_torch.sequence_parallel as sp  # noqa: E402

GRID = (21, 12, 16)  # Wan's 21 latent frames (a partial last tile in time), a small frame
HEADS, HEAD_DIM = 4, 64


def main(rank, world, init, device, dtype):
    dist.init_process_group("nccl" if device != "cpu" else "gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)  # the same whole clip on every rank
    s = GRID[0] * GRID[1] * GRID[2]
    q, k, v, g, d_o = (torch.randn(1, s, HEADS, HEAD_DIM, device=device, dtype=dtype) for _ in range(5))

    # This rank's frames (sp.frame_split: 21 frames on 2 ranks are 11 + 10), every head.
    mine = [sp.shard(x, GRID).detach().requires_grad_(True) for x in (q, k, v, g)]
    o = sp.video_sparse_attention(*mine[:3], GRID, gate=mine[3], sparsity=0.75)
    o.backward(sp.shard(d_o, GRID))

    # The same op on one process, over everything.
    whole = [x.requires_grad_(True) for x in (q, k, v, g)]
    want = vsa_torch.video_sparse_attention(*whole[:3], GRID, gate=whole[3], sparsity=0.75)
    want.backward(d_o)
    # Relative to each tensor's largest element: the exchanges move values unchanged, so what differs is the kv
    # sums' order (repeated kv heads) and, in bf16, the kernels' rounding of a different head order.
    errs = {name: float((a - sp.shard(b, GRID)).abs().max() / sp.shard(b, GRID).abs().max())
            for name, a, b in [("o", o, want)] + [(f"d{n}", x.grad, w.grad) for n, x, w in zip("qkvg", mine, whole)]}
    print(f"rank {rank}/{world}: frames {sp.frame_split(GRID[0], world)[rank]}, max |difference| from one process "
          "(relative): " + ", ".join(f"{n} {e:.2g}" for n, e in errs.items()), flush=True)
    dist.destroy_process_group()
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    bad = [n for n, e in errs.items() if not e <= tolerance]  # NaN fails too
    if bad:
        raise RuntimeError(f"rank {rank}: {', '.join(bad)} differ from one process by more than {tolerance}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", type=int, metavar="N", help="run N processes on the CPU (gloo) instead of torchrun's")
    args = ap.parse_args()
    if args.cpu:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(main, (args.cpu, f"tcp://127.0.0.1:{port}", "cpu", torch.float32), nprocs=args.cpu)
    elif "LOCAL_RANK" not in os.environ:
        ap.error("run it under torchrun (one process a GPU), or pass --cpu N")
    else:
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", f"cuda:{local}", torch.bfloat16)
