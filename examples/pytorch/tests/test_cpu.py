"""The binding on its CPU kernels (the library's reference): against the op's definition in torch, gradcheck in
float64, layouts and orders, list reuse, the FastVideo drop-in, and the errors. Runs without a GPU."""
import pytest
import torch

import definition as ref
import vsa_torch
from vsa_torch.fastvideo import grid_from_counts, video_sparse_attn

F64 = torch.float64


def f32(x):
    """The library takes the scale as a float: the definition uses the same number."""
    return float(torch.tensor(x, dtype=torch.float32))


def randn(*shape, dtype=F64, seed=None, requires_grad=False):
    g = torch.Generator().manual_seed(seed if seed is not None else hash(shape) % 2**31)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(requires_grad)


def tiled_inputs(grid, b, hq, hkv, d, seed, gate=True, dtype=F64):
    s = ref.tile_counts(grid).numel() * 64
    valid = (torch.arange(s) % 64 < ref.tile_counts(grid)[torch.arange(s) // 64])[None, :, None, None]
    xs = [randn(b, s, h, d, dtype=dtype, seed=seed + i) * valid for i, h in enumerate((hq, hkv, hkv, hq))]
    xs = [x.detach().requires_grad_(True) for x in xs]
    return xs if gate else xs[:3]


CONFIGS = [  # grid, batch, q heads, kv heads, head dim
    ((5, 6, 7), 1, 2, 1, 8),
    ((4, 8, 4), 2, 2, 2, 16),
    ((3, 5, 9), 1, 4, 2, 8),
]


@pytest.mark.parametrize("grid,b,hq,hkv,d", CONFIGS)
@pytest.mark.parametrize("gated", [True, False])
def test_whole_op_matches_its_definition(grid, b, hq, hkv, d, gated):
    q, k, v, g = tiled_inputs(grid, b, hq, hkv, d, seed=1)
    gate = g if gated else None
    n = ref.tile_counts(grid).numel()
    top_k = max(1, n // 3)
    o = vsa_torch.video_sparse_attention(q, k, v, grid, gate=gate, top_k=top_k, order="tiled")
    want = ref.video_sparse_attention(q, k, v, gate, grid, top_k, f32(d**-0.5))
    torch.testing.assert_close(o, want, rtol=1e-10, atol=1e-10)
    d_o = randn(*o.shape, seed=7)
    inputs = [q, k, v] + ([g] if gated else [])
    got = torch.autograd.grad(o, inputs, d_o)
    exp = torch.autograd.grad(want, inputs, d_o)
    for name, a, e in zip("q k v gate".split(), got, exp):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-9, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("extra,first", [(77, False), (5, True), (130, True)])
def test_joint_op_with_extra_tokens_matches_its_definition(extra, first):
    grid, b, hq, hkv, d = (3, 5, 9), 1, 4, 2, 8
    tiled = tiled_inputs(grid, b, hq, hkv, d, seed=11)
    ex = [randn(b, extra, x.shape[2], d, seed=20 + i) for i, x in enumerate(tiled)]
    q, k, v, g = (torch.cat([e, x], 1) if first else torch.cat([x, e], 1) for x, e in zip(tiled, ex))
    q, k, v, g = (x.detach().requires_grad_(True) for x in (q, k, v, g))
    n = ref.tile_counts(grid).numel()
    top_k = max(1, n // 3)
    o = vsa_torch.video_sparse_attention(q, k, v, grid, gate=g, top_k=top_k, order="tiled", extra_tokens=extra,
                                         extra_first=first)
    want = ref.joint_video_sparse_attention(q, k, v, g, grid, top_k, f32(d**-0.5), extra, first)
    torch.testing.assert_close(o, want, rtol=1e-10, atol=1e-10)
    d_o = randn(*o.shape, seed=7)
    got = torch.autograd.grad(o, [q, k, v, g], d_o)
    exp = torch.autograd.grad(want, [q, k, v, g], d_o)
    for name, a, e in zip("q k v gate".split(), got, exp):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-9, msg=lambda m: f"d{name}: {m}")


def test_joint_op_without_extra_tokens_is_the_op():
    grid = (5, 6, 7)
    q, k, v, g = tiled_inputs(grid, 1, 2, 1, 8, seed=5)
    a = vsa_torch.video_sparse_attention(q, k, v, grid, gate=g, sparsity=0.6, order="tiled")
    b = vsa_torch.video_sparse_attention(q, k, v, grid, gate=g, sparsity=0.6, order="tiled", extra_tokens=0)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="tiled order only"):
        vsa_torch.video_sparse_attention(q, k, v, grid, extra_tokens=3)


def test_raster_order_is_tiling_around_the_tiled_op():
    grid = (5, 6, 7)
    q, k, v, g = (ref.untile(x, grid).detach().requires_grad_(True) for x in tiled_inputs(grid, 1, 2, 1, 8, seed=3))
    o = vsa_torch.video_sparse_attention(q, k, v, grid, gate=g, sparsity=0.6)
    tiled = [ref.tile(x, grid) for x in (q, k, v, g)]
    want = ref.untile(vsa_torch.video_sparse_attention(*tiled[:3], grid, gate=tiled[3], sparsity=0.6, order="tiled"),
                      grid)
    torch.testing.assert_close(o, want, rtol=0, atol=0)
    d_o = randn(*o.shape, seed=9)
    got = torch.autograd.grad(o, (q, k, v, g), d_o)
    exp = torch.autograd.grad(want, (q, k, v, g), d_o)
    for a, e in zip(got, exp):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    # Keeping the tiled copies instead of the raster inputs changes nothing but memory.
    o2 = vsa_torch.video_sparse_attention(q, k, v, grid, gate=g, sparsity=0.6, keep_tiled=True)
    torch.testing.assert_close(o2, o, rtol=0, atol=0)
    for a, e in zip(torch.autograd.grad(o2, (q, k, v, g), d_o), got):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_both_layouts_give_the_same_op():
    grid = (5, 6, 7)
    q, k, v, g = tiled_inputs(grid, 2, 2, 1, 8, seed=4)
    o = vsa_torch.video_sparse_attention(q, k, v, grid, gate=g, order="tiled")
    bh = [x.detach().transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v, g)]
    o2 = vsa_torch.video_sparse_attention(*bh[:3], grid, gate=bh[3], layout="bhsd", order="tiled")
    assert o2.shape == bh[0].shape
    torch.testing.assert_close(o2.transpose(1, 2), o, rtol=0, atol=0)
    d_o = randn(*o.shape, seed=5)
    got = torch.autograd.grad(o2, bh, d_o.transpose(1, 2))
    exp = torch.autograd.grad(o, (q, k, v, g), d_o)
    for a, e in zip(got, exp):
        torch.testing.assert_close(a.transpose(1, 2), e, rtol=0, atol=0)


def test_selected_lists_can_be_inspected_and_reused():
    grid = (5, 6, 7)
    q, k, v = tiled_inputs(grid, 1, 2, 2, 8, seed=6, gate=False)
    n = ref.tile_counts(grid).numel()
    o, (q2k, counts) = vsa_torch.video_sparse_attention(q, k, v, grid, top_k=3, order="tiled", return_selection=True)
    assert q2k.shape == (1, 2, n, 3) and q2k.dtype == torch.int32 and counts.shape == (1, 2, n)
    assert bool((counts == 3).all()) and bool((q2k[..., 1:] > q2k[..., :-1]).all())
    # The selection is the top 3 of the coarse scores.
    q_c, k_c = ref.block_means(q, grid), ref.block_means(k, grid)
    scores = torch.einsum("bihd,bjhd->bhij", q_c, k_c)
    assert torch.equal(ref.lists_to_selection(q2k, counts, n), ref.top_k_selection(scores, 3))
    # Passed back, the lists replace the coarse pass: o is the sparse pass alone.
    o2 = vsa_torch.video_sparse_attention(q, k, v, grid, order="tiled", q2k=(q2k, counts))
    o_s = vsa_torch.sparse_attention(q, k, v, q2k, counts, grid)
    torch.testing.assert_close(o2, o_s, rtol=0, atol=0)
    want = ref.sparse_attention(q, k, v, grid, f32(8**-0.5), ref.lists_to_selection(q2k, counts, n))
    torch.testing.assert_close(o2, want, rtol=1e-10, atol=1e-10)


def test_sparse_attention_matches_its_definition_with_ragged_lists():
    grid = (3, 5, 9)
    q, k, v = tiled_inputs(grid, 1, 4, 2, 8, seed=8, gate=False)
    n = ref.tile_counts(grid).numel()
    gen = torch.Generator().manual_seed(8)
    counts = torch.randint(0, 4, (1, 4, n), generator=gen, dtype=torch.int32)
    q2k = torch.full((1, 4, n, 3), -1, dtype=torch.int32)
    for h in range(4):
        for i in range(n):
            c = int(counts[0, h, i])
            q2k[0, h, i, :c] = torch.randperm(n, generator=gen)[:c].sort().values.int()
    o = vsa_torch.sparse_attention(q, k, v, q2k, counts, grid, scale=0.3)
    want = ref.sparse_attention(q, k, v, grid, f32(0.3), ref.lists_to_selection(q2k, counts, n))
    torch.testing.assert_close(o, want, rtol=1e-10, atol=1e-10)
    d_o = randn(*o.shape, seed=10)
    # The backward takes the forward's log-sum-exp as the fp32 tensor it returns: P carries its rounding.
    for a, e in zip(torch.autograd.grad(o, (q, k, v), d_o), torch.autograd.grad(want, (q, k, v), d_o)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("phi", ["softmax", "elu1", "relu"])
@pytest.mark.parametrize("order", ["raster", "tiled"])
def test_linear_attention_matches_its_definition(phi, order):
    grid = (5, 6, 7)
    q, k, v = tiled_inputs(grid, 2, 2, 1, 8, seed=11, gate=False)
    if order == "raster":
        q, k, v = (ref.untile(x, grid).detach().requires_grad_(True) for x in (q, k, v))
        valid = None
    else:
        valid = ref._valid_slots(grid, q.device)[0]
    if phi == "relu":  # keep every denominator away from 0
        q, k = (x.detach().abs().requires_grad_(True) for x in (q, k))
    o = vsa_torch.linear_attention(q, k, v, grid, phi=phi, eps=1e-3, order=order)
    want = ref.linear_attention(q, k, v, phi, 1e-3, valid)
    torch.testing.assert_close(o, want, rtol=1e-9, atol=1e-9)
    d_o = randn(*o.shape, seed=12)
    for a, e in zip(torch.autograd.grad(o, (q, k, v), d_o), torch.autograd.grad(want, (q, k, v), d_o)):
        torch.testing.assert_close(a, e, rtol=1e-8, atol=1e-8)


def test_tile_and_untile_are_the_layout_and_its_inverse():
    grid = (5, 6, 7)
    x = randn(2, 210, 3, 8, seed=13, requires_grad=True)
    t = vsa_torch.tile(x, grid)
    torch.testing.assert_close(t, ref.tile(x, grid), rtol=0, atol=0)
    torch.testing.assert_close(vsa_torch.untile(t, grid), x, rtol=0, atol=0)
    xb = x.detach().transpose(1, 2).contiguous()
    torch.testing.assert_close(vsa_torch.tile(xb, grid, layout="bhsd").transpose(1, 2), t, rtol=0, atol=0)


def test_gradcheck_float64():
    grid = (3, 5, 4)  # 2 tiles of 48 and 12 tokens
    q, k, v, g = (x.detach()[:, :, :, :4].contiguous().requires_grad_(True)
                  for x in tiled_inputs(grid, 1, 2, 1, 4, seed=14))
    raster = [ref.untile(x, grid).detach().requires_grad_(True) for x in (q, k, v, g)]
    checks = {
        "whole op, raster": (lambda a, b, c, d: vsa_torch.video_sparse_attention(a, b, c, grid, gate=d, top_k=1),
                             raster),
        "whole op, tiled, no gate": (lambda a, b, c: vsa_torch.video_sparse_attention(a, b, c, grid, top_k=2,
                                                                                     order="tiled"), (q, k, v)),
        "tile": (lambda a: vsa_torch.tile(a, grid), raster[:1]),
        "untile": (lambda a: vsa_torch.untile(a, grid), (q,)),
        "linear": (lambda a, b, c: vsa_torch.linear_attention(a, b, c, grid, phi="softmax"), raster[:3]),
    }
    lists = torch.tensor([[[[0, 1], [1, 0]], [[1, 0], [0, 1]]]], dtype=torch.int32)
    counts = torch.tensor([[[2, 1], [1, 2]]], dtype=torch.int32)
    checks["sparse"] = (lambda a, b, c: vsa_torch.sparse_attention(a, b, c, lists, counts, grid), (q, k, v))
    for name, (fn, inputs) in checks.items():
        assert torch.autograd.gradcheck(fn, tuple(inputs), eps=1e-6, atol=1e-7), name


def test_fastvideo_drop_in_is_the_tiled_op_on_bhsd():
    grid = (5, 6, 7)
    q, k, v, g = (x.detach().transpose(1, 2).contiguous() for x in tiled_inputs(grid, 1, 2, 2, 8, seed=15))
    counts = ref.tile_counts(grid).int()
    o = video_sparse_attn(q, k, v, counts, counts, 3, block_size=(4, 4, 4), compress_attn_weight=g)
    want = vsa_torch.video_sparse_attention(q, k, v, grid, gate=g, top_k=3, layout="bhsd", order="tiled")
    torch.testing.assert_close(o, want, rtol=0, atol=0)
    for grid in [(21, 30, 52), (31, 22, 40), (1, 1, 1), (8, 8, 8), (9, 10, 11)]:
        found = grid_from_counts(ref.tile_counts(grid))
        assert torch.equal(ref.tile_counts(found), ref.tile_counts(grid)), grid


def test_fastvideo_drop_in_rejects_what_it_cannot_run():
    q = torch.zeros(1, 2, 128, 8, dtype=F64)
    counts = torch.tensor([64, 64], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_size"):
        video_sparse_attn(q, q, q, counts, counts, 1, block_size=(4, 8, 8))
    with pytest.raises(ValueError, match="no T×H×W grid"):
        video_sparse_attn(q, q, q, torch.tensor([3, 64], dtype=torch.int32), torch.tensor([3, 64]), 1)
    with pytest.raises(ValueError, match="length"):
        video_sparse_attn(q, q, q, counts[:1], counts[:1], 1)


def test_rejected_arguments_raise_value_error_with_the_library_message():
    grid = (5, 6, 7)
    q, k, v, g = tiled_inputs(grid, 1, 2, 1, 8, seed=16)
    q, k, v, g = (x.detach() for x in (q, k, v, g))
    with pytest.raises(ValueError, match="q: holds 512 tokens, the grid needs 210"):
        vsa_torch.video_sparse_attention(q, k, v, grid)  # tiled tensors passed as raster
    with pytest.raises(ValueError, match="top_k"):
        vsa_torch.video_sparse_attention(q, k, v, grid, top_k=9, order="tiled")
    with pytest.raises(ValueError, match="kv_heads|heads"):
        vsa_torch.video_sparse_attention(q, torch.cat([k] * 3, 2), torch.cat([v] * 3, 2), grid, order="tiled")
    with pytest.raises(ValueError, match="dtype"):
        vsa_torch.video_sparse_attention(q.int(), k.int(), v.int(), grid, order="tiled")
    with pytest.raises(ValueError, match="dtype"):
        vsa_torch.video_sparse_attention(q, k.float(), v, grid, order="tiled")
    with pytest.raises(ValueError, match="grid"):
        vsa_torch.video_sparse_attention(q, k, v, (5, 6), order="tiled")
    _, sel = vsa_torch.video_sparse_attention(q, k, v, grid, order="tiled", return_selection=True)
    with pytest.raises(ValueError, match="gate: must be absent"):
        vsa_torch.video_sparse_attention(q, k, v, grid, gate=g, order="tiled", q2k=sel)
    with pytest.raises(ValueError, match="q2k"):
        vsa_torch.video_sparse_attention(q, k, v, grid, order="tiled", q2k=(sel[0].long(), sel[1]))
    bad = sel[0].clone()
    bad[0, 0, 0, 0] = 99
    with pytest.raises(ValueError, match="q2k"):
        vsa_torch.sparse_attention(q, k, v, bad, sel[1], grid)
    with pytest.raises(ValueError, match="phi"):
        vsa_torch.linear_attention(q, k, v, grid, phi="tanh", order="tiled")
    with pytest.raises(ValueError, match="eps"):
        vsa_torch.linear_attention(q, k, v, grid, eps=-1.0, order="tiled")
    with pytest.raises(ValueError, match="layout"):
        vsa_torch.tile(q, grid, layout="sbhd")
    with pytest.raises(ValueError, match="state"):
        torch.ops.vsa.backward(q, q, k, v, None, q, torch.zeros(3, dtype=torch.uint8), list(grid), 0, 0.9, 0.0, None,
                               None, False)


def test_the_example_runs():
    import pathlib
    import subprocess
    import sys

    example = pathlib.Path(__file__).resolve().parents[1] / "example.py"
    # The CPU path (quick), with the vsa_torch these tests import (installed, or built in place).
    package_root = str(pathlib.Path(vsa_torch.__file__).resolve().parents[1])
    env = dict(__import__("os").environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=package_root)
    run = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "vsa on cpu" in run.stdout
