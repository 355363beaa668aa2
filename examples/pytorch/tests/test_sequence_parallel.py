"""vsa_torch.sequence_parallel against the single-process op: on the CPU kernels over gloo with 1, 2 and 4 processes,
and on GPUs over NCCL (one GPU with world size 1, two GPUs; skipped without them). Each rank builds the same whole
inputs from a seed, runs the wrapper on its frames and the plain op on everything, and compares its frames of o and
of every gradient. One spawn per world size runs all its cases (starting processes that import torch is the slow
part); each case is a test of its own, reading what every rank recorded."""
import datetime
import json
import os
import socket
import traceback
from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import vsa_torch
import vsa_torch.sequence_parallel as sp


@dataclass(frozen=True)
class Case:
    grid: tuple
    b: int
    hq: int
    hkv: int
    d: int
    dtype: str = "float64"
    gated: bool = True
    frames: tuple = None  # None: sp.frame_split
    layout: str = "bshd"
    top_k: int = None  # None: sparsity 0.6 of the whole grid's tiles
    pairs: bool = False  # run on two groups of 2 ranks ({0, 2} and {1, 3}) at once, not on the world


CPU_CASES = {
    1: {  # a group of one rank: the wrapper is the op itself, the exchanges return their tensors
        "one-rank-gqa-partial-tiles-b2": Case((7, 6, 5), 2, 4, 2, 8),
        "one-rank-bhsd-float32-no-gate": Case((5, 4, 6), 1, 2, 2, 16, "float32", False, layout="bhsd"),
    },
    2: {
        "whole-tiles": Case((8, 5, 6), 1, 4, 4, 8),
        "gqa-partial-last-tile-b2": Case((7, 6, 5), 2, 4, 2, 8),  # frames 4 + 3: the last time tile is 3 deep
        "mqa-kv-repeated-float32": Case((6, 5, 7), 1, 4, 1, 8, "float32"),  # 3 + 3 frames: a tile straddles them
        "uneven-frames-bhsd-float32-no-gate": Case((5, 4, 6), 1, 2, 2, 16, "float32", False, (1, 4), "bhsd", 2),
        "bfloat16": Case((5, 8, 4), 1, 4, 4, 8, "bfloat16"),  # exchanged as bytes (gloo has no bf16)
    },
    4: {
        "gqa-partial-last-tile": Case((9, 5, 4), 1, 8, 4, 8),  # frames 3, 2, 2, 2; tiles of 4, 4 and 1 frames
        "gqa-kv-repeated": Case((6, 4, 5), 1, 8, 2, 8, frames=(2, 2, 1, 1)),
        "a-rank-without-frames": Case((3, 4, 4), 2, 4, 4, 8),  # frames 1, 1, 1, 0
        "two-groups-of-two": Case((5, 6, 4), 1, 4, 2, 8, "float32", pairs=True),  # group ranks differ from global
    },
}
# On the CPU the wrapper runs the whole op's arithmetic head by head, so o and the gradients are bitwise the op's,
# except dk and dv where kv heads are repeated (not divisible by the world size): their sums over the q heads of a
# group are added in two parts (each rank's, then over the copies), reassociated: a few ulps of the largest element
# (measured 1e-15 relative in float64). On GPUs: bf16, the tolerance of test_cuda.py.
REASSOCIATED = {"float64": 1e-12, "float32": 1e-5}
GPU_TOL = 1e-2


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def whole_inputs(case, device, seed):
    """q, k, v, gate and dO over the whole grid, in the case's layout; the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    s = case.grid[0] * case.grid[1] * case.grid[2]
    out = []
    for h in (case.hq, case.hkv, case.hkv, case.hq, case.hq):
        x = torch.randn(case.b, s, h, case.d, generator=gen, dtype=torch.float64)
        x = x.transpose(1, 2).contiguous() if case.layout == "bhsd" else x
        out.append(x.to(device, getattr(torch, case.dtype)))
    return out


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    assert torch.isfinite(a).all(), "non-finite values"
    if b.numel() == 0:  # a rank without frames
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def run_case(case, group, device, seed):
    """Raises AssertionError where this rank's frames of the wrapper's o or gradients differ from the whole op's."""
    q, k, v, g, d_o = whole_inputs(case, device, seed)
    names = ["q", "k", "v"] + (["gate"] if case.gated else [])
    whole = [x.requires_grad_(True) for x in (q, k, v, g)[:len(names)]]
    kw = dict(top_k=case.top_k, sparsity=0.6, layout=case.layout)
    o = vsa_torch.video_sparse_attention(*whole[:3], case.grid, gate=whole[3] if case.gated else None, **kw)
    want = [o] + list(torch.autograd.grad(o, whole, d_o))

    def cut(x):
        return sp.shard(x.detach(), case.grid, group=group, frames=case.frames, layout=case.layout)

    shards = [cut(x).clone().requires_grad_(True) for x in whole]
    o = sp.video_sparse_attention(*shards[:3], case.grid, gate=shards[3] if case.gated else None, group=group,
                                  frames=case.frames, **kw)
    got = [o] + list(torch.autograd.grad(o, shards, cut(d_o)))
    world = dist.get_world_size(group)
    repeated = case.hkv % world != 0  # the wrapper repeats kv heads
    for name, a, e in zip(["o"] + [f"d{n}" for n in names], got, want):
        e = cut(e)
        assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)}, expected {tuple(e.shape)}"
        if device != "cpu":
            tol = GPU_TOL
        else:
            tol = REASSOCIATED[case.dtype] if repeated and name in ("dk", "dv") else 0.0
        err = rel_err(a, e)
        assert err <= tol, f"{name}: max error {err:.3g} of the largest element, over {tol}"


def check_exchanges(group):
    """sequence_to_heads gives this rank the whole sequence of its heads, heads_to_sequence takes it back, and the
    gradient of the round trip is the identity (both layouts; tensors of different head counts in one exchange)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    grid = (5, 3, 4)
    for layout in ("bshd", "bhsd"):
        whole = whole_inputs(Case(grid, 2, 2 * world, world, 8, layout=layout), "cpu", 1)[:2]
        mine = [sp.shard(x, grid, group=group, layout=layout).clone().requires_grad_(True) for x in whole]
        gathered = sp.sequence_to_heads(iter(mine), grid, group=group, layout=layout)  # any iterable
        assert len(gathered) == len(whole), f"{layout}: {len(gathered)} tensors back for {len(whole)}"
        head_dim = 1 if layout == "bhsd" else 2
        for x, y in zip(whole, gathered):
            assert torch.equal(y, x.chunk(world, head_dim)[rank]), f"{layout}: not this rank's heads"
        back = sp.heads_to_sequence(iter(gathered), grid, group=group, layout=layout)
        assert len(back) == len(mine), f"{layout}: {len(back)} tensors back for {len(mine)}"
        for x, y in zip(mine, back):
            assert torch.equal(y, x), f"{layout}: the round trip changed the shard"
        weights = [torch.randn_like(x) for x in mine]
        grads = torch.autograd.grad(sum((y * w).sum() for y, w in zip(back, weights)), mine)
        for gr, w in zip(grads, weights):
            assert torch.equal(gr, w), f"{layout}: the round trip's gradient is not the identity"


def check_rejections(group):
    """Arguments every rank gets wrong alike (a rank alone raising would leave the others in the collective)."""
    world = dist.get_world_size(group)
    case = Case((4, 4, 4), 1, 2 * world, 2 * world, 8)
    q, k, v, g, _ = whole_inputs(case, "cpu", 0)
    mine = [sp.shard(x, case.grid, group=group) for x in (q, k, v, g)]
    longer = [torch.cat([x, x[:, :1]], 1) for x in mine]  # a token more than this rank's frames hold
    more_heads = [torch.cat([x, x[:, :, :1]], 2) for x in mine[1:3]]
    wrong = {
        "its frames hold": lambda: sp.video_sparse_attention(*longer[:3], case.grid, gate=longer[3], group=group),
        "frames:": lambda: sp.video_sparse_attention(*mine[:3], case.grid, frames=(5,) + (0,) * (world - 1),
                                                     group=group),  # 5 frames of a grid of 4
        "does not match q's": lambda: sp.video_sparse_attention(mine[0], mine[1].float(), mine[2], case.grid,
                                                                group=group),
        "dividing q's": lambda: sp.video_sparse_attention(mine[0], *more_heads, case.grid,
                                                          group=group),  # 2·world + 1 kv heads for 2·world q heads
    }
    if world > 1:  # every head count divides a world of one
        wrong["not divisible by the world size"] = lambda: sp.video_sparse_attention(
            torch.cat([mine[0], mine[0][:, :, :1]], 2), *mine[1:3], case.grid, group=group)
    for fragment, call in wrong.items():
        with pytest.raises(ValueError, match=fragment):
            call()


def worker(rank, world, port, backend, cases, out_dir):
    torch.set_num_threads(1)  # the ranks share the machine's cores
    if backend == "nccl":
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # a desynchronised bug fails, not hangs
    pairs = None
    if world == 4:  # every rank creates every group, in the same order
        pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    results = {}
    for i, (name, case) in enumerate(sorted(cases.items())):
        try:
            if case == "rejections":
                check_rejections(None)
            elif case == "exchanges":
                check_exchanges(None)
            else:
                run_case(case, pairs if case.pairs else None, device, seed=100 + i)
            results[name] = "ok"
        except Exception:  # recorded: the next case's collectives still meet every rank's
            results[name] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


_runs = {}


def results_of(world, backend, cases, tmp_path_factory):
    """{case: [each rank's outcome]}, from one spawn of `world` processes (cached per world and backend)."""
    if (world, backend) not in _runs:
        out_dir = str(tmp_path_factory.mktemp(f"sp-{backend}-{world}"))
        mp.spawn(worker, (world, free_port(), backend, cases, out_dir), nprocs=world)
        ranks = []
        for r in range(world):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
        _runs[(world, backend)] = {name: [rk[name] for rk in ranks] for name in cases}
    return _runs[(world, backend)]


def check(outcomes):
    failed = [f"rank {r}:\n{o}" for r, o in enumerate(outcomes) if o != "ok"]
    assert not failed, "\n".join(failed)


GLOO = {world: dict(cases, rejections="rejections", exchanges="exchanges") for world, cases in CPU_CASES.items()}


@pytest.mark.parametrize("world,name", [(w, n) for w, cases in GLOO.items() for n in cases])
def test_gloo_wrapper_equals_the_whole_op(world, name, tmp_path_factory):
    check(results_of(world, "gloo", GLOO[world], tmp_path_factory)[name])


def test_frame_split_is_balanced_and_whole():
    assert sp.frame_split(21, 2) == (11, 10)
    assert sp.frame_split(31, 4) == (8, 8, 8, 7)
    assert sp.frame_split(3, 4) == (1, 1, 1, 0)


# ---- GPUs: NCCL ---------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and vsa_torch.has_cuda()
                                     and dist.is_nccl_available()),
                                reason="needs a CUDA GPU, a CUDA build of vsa_torch and NCCL")
# The GPU kernels take bf16 or fp16 and head dim 64 or 128.
GPU_CASES = {
    "gqa-partial-last-tile": Case((9, 10, 11), 1, 4, 2, 128, "bfloat16"),
    "mqa-kv-repeated-bhsd": Case((6, 8, 8), 2, 4, 1, 64, "bfloat16", layout="bhsd"),
    "no-gate": Case((7, 9, 12), 1, 2, 2, 128, "bfloat16", False),
}
GPU_CASES_2 = dict(GPU_CASES, **{"no-gate": replace(GPU_CASES["no-gate"], frames=(2, 5))})  # uneven frames


@needs_cuda
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_nccl_world_size_one(name, tmp_path_factory):
    check(results_of(1, "nccl", GPU_CASES, tmp_path_factory)[name])


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_nccl_two_gpus(name, tmp_path_factory):
    check(results_of(2, "nccl", GPU_CASES_2, tmp_path_factory)[name])
