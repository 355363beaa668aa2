"""The binding's CUDA kernels: every op against the library's CPU reference and against the op's definition in
float32 torch, forward and gradients, on fresh random inputs over poisoned memory; torch.compile and CUDA graphs
against eager; errors. Skipped where there is no GPU or the build has no CUDA kernels."""
import pytest
import torch

import definition as ref
import vsa_torch
from vsa_torch.fastvideo import video_sparse_attn

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and vsa_torch.has_cuda()),
                                reason="needs a CUDA GPU and a CUDA build of vsa_torch")
DEV = "cuda"
TOL = 1e-2  # bf16 / fp16 relative error against references computed in double or float32


def poison_cache():
    """Fills memory torch's caching allocator will hand out next with NaN: an output element never written stays NaN."""
    x = torch.full((64 << 20,), float("nan"), device=DEV)
    del x


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.isfinite(a).all(), "non-finite values (an unwritten element, or NaN)"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def inputs(grid, b, hq, hkv, d, dtype, seed, tiled=True):
    gen = torch.Generator().manual_seed(seed)
    s = ref.tile_counts(grid).numel() * 64 if tiled else grid[0] * grid[1] * grid[2]
    out = []
    for h in (hq, hkv, hkv, hq, hq):  # q, k, v, gate, dO
        x = torch.randn(b, s, h, d, generator=gen)
        if tiled:
            valid = ref._valid_slots(grid, "cpu")[0]
            x = x * valid[None, :, None, None]
        out.append(x.to(dtype))
    return out


CASES = [  # grid, batch, q heads, kv heads, head dim, dtype, layout, order
    ((9, 10, 11), 1, 2, 2, 128, torch.bfloat16, "bshd", "raster"),
    ((9, 10, 11), 2, 4, 2, 64, torch.float16, "bhsd", "raster"),
    ((8, 8, 8), 1, 2, 1, 128, torch.bfloat16, "bhsd", "tiled"),
    ((5, 9, 13), 2, 2, 2, 64, torch.bfloat16, "bshd", "tiled"),
]


def layout(x, lay):
    return x.transpose(1, 2).contiguous() if lay == "bhsd" else x.contiguous()


@pytest.mark.parametrize("grid,b,hq,hkv,d,dtype,lay,order", CASES)
def test_whole_op_against_the_reference_and_the_definition(grid, b, hq, hkv, d, dtype, lay, order):
    q, k, v, g, d_o = inputs(grid, b, hq, hkv, d, dtype, seed=sum(grid) + d, tiled=order == "tiled")
    n = ref.tile_counts(grid).numel()
    top_k = max(1, n // 4)

    def run(device):
        xs = [layout(x, lay).to(device).requires_grad_(True) for x in (q, k, v, g)]
        poison_cache() if device == DEV else None
        o, sel = vsa_torch.video_sparse_attention(*xs[:3], grid, gate=xs[3], top_k=top_k, layout=lay, order=order,
                                                  return_selection=True)
        grads = torch.autograd.grad(o, xs, layout(d_o, lay).to(device))
        return [o, *grads], sel

    got, sel = run(DEV)
    exp, sel_cpu = run("cpu")
    assert torch.equal(sel[0].cpu(), sel_cpu[0]) and torch.equal(sel[1].cpu(), sel_cpu[1]), "selections differ"
    for name, a, e in zip(["o", "dq", "dk", "dv", "dgate"], got, exp):
        assert a.shape == e.shape and a.dtype == e.dtype and a.device.type == "cuda"
        assert rel(a, e) < TOL, f"{name}: {rel(a, e):.2e} against the CPU reference"

    # The definition in float32 torch, in tiled [B, S, H, D] order, on the kernels' selection.
    f32 = [x.float().to(DEV) for x in (q, k, v, g)]
    if order == "raster":
        f32 = [ref.tile(x, grid) for x in f32]
    f32 = [x.requires_grad_(True) for x in f32]
    want = ref.video_sparse_attention(*f32[:3], f32[3], grid, top_k, d**-0.5, lists=(sel[0], sel[1]))
    d_o32 = d_o.float().to(DEV)
    d_o32 = ref.tile(d_o32, grid) if order == "raster" else d_o32
    wgrads = torch.autograd.grad(want, f32, d_o32)
    for name, a, e in zip(["o", "dq", "dk", "dv", "dgate"], got, [want, *wgrads]):
        a = a.transpose(1, 2) if lay == "bhsd" else a
        e = ref.untile(e, grid) if order == "raster" else e
        assert rel(a, e) < TOL, f"{name}: {rel(a, e):.2e} against the float32 definition"


@pytest.mark.parametrize("extra,first", [(77, True), (256, False)])
def test_joint_op_with_extra_tokens_against_the_reference(extra, first):
    grid, b, hq, hkv, d, dtype = (9, 10, 11), 1, 4, 2, 128, torch.bfloat16
    tiled = inputs(grid, b, hq, hkv, d, dtype, seed=extra)
    gen = torch.Generator().manual_seed(extra + 1)
    ex = [torch.randn(b, extra, x.shape[2], d, generator=gen).to(dtype) for x in tiled]
    q, k, v, g, d_o = (torch.cat([e, x], 1) if first else torch.cat([x, e], 1) for x, e in zip(tiled, ex))
    top_k = max(1, ref.tile_counts(grid).numel() // 4)

    def run(device):
        xs = [x.to(device).requires_grad_(True) for x in (q, k, v, g)]
        poison_cache() if device == DEV else None
        o, sel = vsa_torch.video_sparse_attention(*xs[:3], grid, gate=xs[3], top_k=top_k, order="tiled",
                                                  return_selection=True, extra_tokens=extra, extra_first=first)
        return [o, *torch.autograd.grad(o, xs, d_o.to(device))], sel

    got, sel = run(DEV)
    exp, sel_cpu = run("cpu")
    assert torch.equal(sel[0].cpu(), sel_cpu[0]) and torch.equal(sel[1].cpu(), sel_cpu[1]), "selections differ"
    for name, a, e in zip(["o", "dq", "dk", "dv", "dgate"], got, exp):
        assert a.shape == e.shape and a.device.type == "cuda"
        assert rel(a, e) < TOL, f"{name}: {rel(a, e):.2e} against the CPU reference"


def test_sparse_attention_and_linear_attention_against_the_reference():
    grid, b, hq, hkv, d = (9, 10, 11), 2, 4, 2, 128
    q, k, v, _, d_o = inputs(grid, b, hq, hkv, d, torch.bfloat16, seed=3)
    n = ref.tile_counts(grid).numel()
    gen = torch.Generator().manual_seed(4)
    counts = torch.randint(0, 6, (b, hq, n), generator=gen, dtype=torch.int32)
    q2k = torch.full((b, hq, n, 5), -1, dtype=torch.int32)
    for bb in range(b):
        for h in range(hq):
            for i in range(n):
                c = int(counts[bb, h, i])
                q2k[bb, h, i, :c] = torch.randperm(n, generator=gen)[:c].sort().values.int()
    results = {}
    for device in (DEV, "cpu"):
        xs = [x.to(device).requires_grad_(True) for x in (q, k, v)]
        poison_cache() if device == DEV else None
        o = vsa_torch.sparse_attention(*xs, q2k.to(device), counts.to(device), grid)
        lo = vsa_torch.linear_attention(*xs, grid, phi="elu1", order="tiled")
        results[device] = [o, *torch.autograd.grad(o, xs, d_o.to(device)), lo,
                           *torch.autograd.grad(lo, xs, d_o.to(device))]
    names = ["o_s", "dq", "dk", "dv", "o_l", "dq_l", "dk_l", "dv_l"]
    for name, a, e in zip(names, results[DEV], results["cpu"]):
        assert rel(a, e) < TOL, f"{name}: {rel(a, e):.2e}"


def test_tile_and_untile_are_bitwise_the_reference():
    grid = (9, 10, 11)
    x = torch.randn(2, 990, 3, 64, dtype=torch.float16)
    for lay in ("bshd", "bhsd"):
        xs = layout(x, lay)
        poison_cache()
        t = vsa_torch.tile(xs.to(DEV), grid, layout=lay)
        assert torch.equal(t.cpu(), vsa_torch.tile(xs, grid, layout=lay))
        assert torch.equal(vsa_torch.untile(t, grid, layout=lay).cpu(), xs)


def test_backward_is_bitwise_reproducible():
    grid = (9, 10, 11)
    q, k, v, g, d_o = (x.to(DEV) for x in inputs(grid, 1, 4, 2, 128, torch.bfloat16, seed=5, tiled=False))
    runs = []
    for _ in range(2):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v, g)]
        poison_cache()
        o = vsa_torch.video_sparse_attention(*xs[:3], grid, gate=xs[3])
        runs.append([o, *torch.autograd.grad(o, xs, d_o)])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def op_step(q, k, v, g, d_o, grid):
    o = vsa_torch.video_sparse_attention(q, k, v, grid, gate=g, sparsity=0.8)
    return [o, *torch.autograd.grad(o, (q, k, v, g), d_o)]


def test_torch_compile_fullgraph_equals_eager():
    if not hasattr(torch, "compile"):
        pytest.skip("torch.compile needs torch 2")
    grid = (9, 10, 11)
    q, k, v, g, d_o = (x.to(DEV) for x in inputs(grid, 1, 2, 2, 128, torch.bfloat16, seed=6, tiled=False))

    def fresh():
        return [x.clone().requires_grad_(True) for x in (q, k, v, g)]

    # A module's forward compiled as a model's would be, with ops around the attention; the backward is the
    # one torch.compile builds from it.
    class Attention(torch.nn.Module):
        def forward(self, q, k, v, g):
            o = vsa_torch.video_sparse_attention(q * 1.5, k, v, grid, gate=torch.sigmoid(g), sparsity=0.8)
            return o + 1.0

    eager_model = Attention()
    torch._dynamo.reset()
    model = torch.compile(Attention(), fullgraph=True)
    xs, ys = fresh(), fresh()
    o = model(*xs)
    o.backward(d_o)
    want = eager_model(*ys)
    want.backward(d_o)
    for a, b in zip([o, *(x.grad for x in xs)], [want, *(y.grad for y in ys)]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)  # elementwise ops fused in other roundings
    # The attention alone: bitwise equal.
    torch._dynamo.reset()
    alone = torch.compile(lambda q, k, v, g: vsa_torch.video_sparse_attention(q, k, v, grid, gate=g), fullgraph=True)
    xs, ys = fresh(), fresh()
    o = alone(*xs)
    o.backward(d_o)
    want = vsa_torch.video_sparse_attention(*ys[:3], grid, gate=ys[3])
    want.backward(d_o)
    for a, b in zip([o, *(x.grad for x in xs)], [want, *(y.grad for y in ys)]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_cuda_graph_capture_and_replay_equal_eager():
    grid = (9, 10, 11)
    q, k, v, g, d_o = (x.to(DEV) for x in inputs(grid, 1, 2, 2, 128, torch.bfloat16, seed=7, tiled=False))
    static = [x.clone().requires_grad_(True) for x in (q, k, v, g)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch's graph capture asks
        for _ in range(2):
            op_step(*static, d_o, grid)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = op_step(*static, d_o, grid)
    # New inputs copied into the captured ones, then a replay.
    q2, k2, v2, g2 = (x * 0.5 + 0.1 for x in (q, k, v, g))
    with torch.no_grad():
        for s, x in zip(static, (q2, k2, v2, g2)):
            s.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    eager = op_step(*[x.clone().requires_grad_(True) for x in (q2, k2, v2, g2)], d_o, grid)
    for a, b in zip(outputs, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fastvideo_drop_in_on_the_gpu():
    grid = (9, 10, 11)
    q, k, v, g, _ = (layout(x, "bhsd").to(DEV) for x in inputs(grid, 1, 2, 2, 128, torch.bfloat16, seed=8))
    counts = ref.tile_counts(grid).int().to(DEV)
    o = video_sparse_attn(q, k, v, counts, counts, 4, block_size=(4, 4, 4), compress_attn_weight=g)
    want = vsa_torch.video_sparse_attention(q, k, v, grid, gate=g, top_k=4, layout="bhsd", order="tiled")
    assert torch.equal(o, want)


def test_rejected_arguments_on_the_gpu_raise_value_error():
    grid = (9, 10, 11)
    q, k, v, g, _ = (x.to(DEV) for x in inputs(grid, 1, 2, 2, 128, torch.bfloat16, seed=9, tiled=False))
    with pytest.raises(ValueError, match="head_dim"):
        vsa_torch.video_sparse_attention(q[..., :32], k[..., :32], v[..., :32], grid)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        vsa_torch.video_sparse_attention(q.float(), k.float(), v.float(), grid)
    with pytest.raises(ValueError, match="cpu|cuda"):
        vsa_torch.video_sparse_attention(q, k.cpu(), v, grid)
    with pytest.raises(ValueError, match="tokens"):
        vsa_torch.video_sparse_attention(q[:, :-1], k[:, :-1], v[:, :-1], grid)
