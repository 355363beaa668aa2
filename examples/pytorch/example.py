"""vsa's whole op from PyTorch: forward and backward on raster-order tensors, as a model holds them.

    python3 examples/pytorch/example.py            # a Wan 2.1 1.3B layer at 480p on the GPU; a small one on the CPU
"""
import time

import torch

import vsa_torch

cuda = torch.cuda.is_available() and vsa_torch.has_cuda()
device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
grid = (21, 30, 52) if cuda else (5, 6, 7)  # latent T × H × W
heads, head_dim = (12, 128) if cuda else (2, 64)
tokens = grid[0] * grid[1] * grid[2]

q, k, v, gate = (torch.randn(1, tokens, heads, head_dim, device=device, dtype=dtype, requires_grad=True)
                 for _ in range(4))
start = time.perf_counter()
o, (q2k, counts) = vsa_torch.video_sparse_attention(q, k, v, grid, gate=gate, sparsity=0.9, return_selection=True)
o.backward(torch.randn_like(o))
if cuda:
    torch.cuda.synchronize()
print(f"vsa on {device}: grid {grid}, {heads} heads of {head_dim}, {tokens} tokens, "
      f"{q2k.shape[-1]} of {q2k.shape[-2]} key tiles per query tile; forward + backward "
      f"{(time.perf_counter() - start) * 1e3:.1f} ms (first call)")
print(f"|o| = {o.float().norm():.3f}, |dq| = {q.grad.float().norm():.3f}, |dgate| = {gate.grad.float().norm():.3f}")
