"""vsa_jax on the GPU against the op's definition written here in float32 jax.numpy (a port of
examples/pytorch/tests/definition.py), forward and every gradient, under jax.jit; sparse attention on random caller
lists; tiling; the rejections, raised while tracing. Skipped without jax or the built library; the GPU tests also
without a CUDA device."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import vsa_jax  # noqa: E402
from vsa_jax import _library  # noqa: E402

pytestmark = pytest.mark.skipif(_library.path() is None, reason="libvsa_jax.so is not built (examples/jax/build.py)")


def has_gpu():
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


gpu = pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU under jax")
TOL = 1e-2  # bf16 / fp16 relative L2 error against float32 references


def rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert np.isfinite(a).all(), "non-finite values (an unwritten element, or NaN)"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ---- the op's definition in float32 jax.numpy, tiled [B, S, H, D] order -------------------------------------

def tile_extents(grid):
    return [-(-x // 4) for x in grid]


def tile_counts(grid):
    """Valid tokens of each tile, in tile order (t, h, w)."""
    dims = []
    for n, length in zip(tile_extents(grid), grid):
        d = np.full((n,), 4, dtype=np.int64)
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
                rows = [(t * h_len + h) * w_len + w for t in range(tt * 4, min(tt * 4 + 4, t_len))
                        for h in range(th * 4, min(th * 4 + 4, h_len)) for w in range(tw * 4, min(tw * 4 + 4, w_len))]
                out.extend(rows + [-1] * (64 - len(rows)))
    return np.array(out, dtype=np.int64)


def valid_slots(grid):
    counts = tile_counts(grid)
    slot = np.arange(counts.size * 64)
    return slot % 64 < counts[slot // 64], counts


def ref_tile(x, grid):
    idx = slot_to_raster(grid)
    valid = idx >= 0
    y = jnp.zeros((x.shape[0], idx.size, x.shape[2], x.shape[3]), x.dtype)
    return y.at[:, np.nonzero(valid)[0]].set(x[:, idx[valid]])


def ref_untile(x, grid):
    idx = slot_to_raster(grid)
    slots = np.nonzero(idx >= 0)[0]
    return x[:, slots[np.argsort(idx[slots])]]


def heads(x, hq):
    return jnp.repeat(x, hq // x.shape[2], axis=2)


def block_means(x, grid):
    valid, counts = valid_slots(grid)
    b, s, h, d = x.shape
    xt = (x * valid[None, :, None, None]).reshape(b, s // 64, 64, h, d)
    return xt.sum(2) / counts[None, :, None, None].astype(np.float32)


def masked_softmax(scores, allowed):
    """Softmax over the allowed entries; rows with none allowed are 0 (a finite stand-in for -inf keeps the
    gradients of those rows finite)."""
    p = jax.nn.softmax(jnp.where(allowed, scores, -1e30), axis=-1)
    return jnp.where(allowed, p, 0.0)


def allowed_pairs(grid, selected, tokens):
    """[B, Hq, S, S]: query slot i may see key slot j (j's tile selected by i's, j a valid token)."""
    valid, _ = valid_slots(grid)
    tiles = np.arange(tokens) // 64
    return selected[:, :, tiles][:, :, :, tiles] & valid[None, None, None, :]


def ref_sparse_attention(q, k, v, grid, scale, selected):
    """selected [B, Hq, N, N] bool: query tile i attends to key tile j. Padding query rows and rows with nothing
    selected give 0."""
    valid, _ = valid_slots(grid)
    hq = q.shape[2]
    k, v = heads(k, hq), heads(v, hq)
    scores = jnp.einsum("bihd,bjhd->bhij", q, k) * scale
    p = masked_softmax(scores, allowed_pairs(grid, selected, q.shape[1]))
    return jnp.einsum("bhij,bjhd->bihd", p, v) * valid[None, :, None, None]


def ref_lse(q, k, grid, scale, selected):
    """The log-sum-exp of every query row over its allowed keys; +inf for padding rows and empty lists."""
    valid, _ = valid_slots(grid)
    scores = jnp.einsum("bihd,bjhd->bhij", q, heads(k, q.shape[2])) * scale
    allowed = allowed_pairs(grid, selected, q.shape[1])
    lse = jax.nn.logsumexp(jnp.where(allowed, scores, -jnp.inf), axis=-1)
    return jnp.where(allowed.any(-1) & valid[None, None, :], lse, jnp.inf)


def lists_to_selection(q2k, counts, n):
    q2k, counts = np.asarray(q2k), np.asarray(counts)
    b, h, _, cap = q2k.shape
    used = np.arange(cap)[None, None, None, :] < counts[..., None]
    sel = np.zeros((b, h, n, n + 1), dtype=bool)
    np.put_along_axis(sel, np.where(used, q2k, n).astype(np.int64), True, axis=-1)
    return sel[..., :n]


def coarse_scores(q, k, grid, scale):
    return jnp.einsum("bihd,bjhd->bhij", block_means(q, grid), heads(block_means(k, grid), q.shape[2])) * scale


def ref_video_sparse_attention(q, k, v, gate, grid, scale, selected):
    """o = o_s + g ⊙ o_c in tiled order (g = 1 where gate is None), the fine pass over the selection given."""
    valid, _ = valid_slots(grid)
    scores = coarse_scores(q, k, grid, scale)
    o_s = ref_sparse_attention(q, k, v, grid, scale, selected)
    o_c = jnp.einsum("bhij,bjhd->bihd", jax.nn.softmax(scores, axis=-1), heads(block_means(v, grid), q.shape[2]))
    o_c = jnp.repeat(o_c, 64, axis=1) * valid[None, :, None, None]
    return o_s + (o_c if gate is None else gate * o_c)


# ---- inputs ---------------------------------------------------------------------------------------------------

def inputs(grid, b, hq, hkv, d, dtype, seed, tiled=True):
    """q, k, v, gate, dO; in tiled order with zeros in the padding slots."""
    rng = np.random.default_rng(seed)
    s = tile_counts(grid).size * 64 if tiled else int(np.prod(grid))
    valid = valid_slots(grid)[0]
    out = []
    for h in (hq, hkv, hkv, hq, hq):
        x = rng.standard_normal((b, s, h, d), dtype=np.float32)
        if tiled:
            x = x * valid[None, :, None, None]
        out.append(jnp.asarray(x, dtype=dtype))
    return out


CASES = [  # grid, batch, q heads, kv heads, head dim, dtype, order, gated
    ((9, 10, 11), 1, 2, 2, 128, jnp.bfloat16, "raster", True),
    ((9, 10, 11), 2, 4, 2, 64, jnp.float16, "raster", True),
    ((8, 8, 8), 1, 2, 1, 128, jnp.bfloat16, "tiled", False),
    ((5, 9, 13), 2, 2, 2, 64, jnp.bfloat16, "tiled", True),
]


def coarse_scores_f64(q, k, grid, scale):
    """The coarse scores in float64 numpy, apart from jax's matrix precision (on the GPU its float32 products may
    run as TF32, whose 10-bit mantissas move scores by far more than the kernels' fp32 rounding)."""
    valid, counts = valid_slots(grid)

    def means(x):
        x = np.asarray(x, dtype=np.float64) * valid[None, :, None, None]
        b, s, h, d = x.shape
        return x.reshape(b, s // 64, 64, h, d).sum(2) / counts[None, :, None, None]

    qm, km = means(q), means(k)
    km = np.repeat(km, qm.shape[2] // km.shape[2], axis=2)
    return np.einsum("bihd,bjhd->bhij", qm, km) * scale


def check_selection(q2k, counts, scores, top_k):
    """The lists are a top-k of the coarse scores: k ascending tiles a row, none scoring below an unselected tile
    (up to rounding: the kernels' fp32 means and products sum in another order)."""
    q2k, counts, scores = np.asarray(q2k), np.asarray(counts), np.asarray(scores)
    assert (counts == top_k).all()
    assert (np.diff(q2k, axis=-1) > 0).all(), "a row not strictly ascending"
    chosen = np.take_along_axis(scores, q2k.astype(np.int64), axis=-1)
    selected = lists_to_selection(q2k, counts, scores.shape[-1])
    rest = np.where(selected, -np.inf, scores).max(-1)
    spread = np.abs(scores).max()
    assert (chosen.min(-1) >= rest - 1e-4 * spread).all(), "a tile outside the top k was selected"


@gpu
@pytest.mark.parametrize("grid,b,hq,hkv,d,dtype,order,gated", CASES)
def test_whole_op_against_the_definition(grid, b, hq, hkv, d, dtype, order, gated):
    q, k, v, g, d_o = inputs(grid, b, hq, hkv, d, dtype, seed=sum(grid) + d, tiled=order == "tiled")
    n = tile_counts(grid).size
    top_k = max(1, n // 4)
    primals = (q, k, v, g) if gated else (q, k, v)

    @jax.jit
    def run(primals, d_o):
        def op(*xs):
            gate = xs[3] if gated else None
            return vsa_jax.video_sparse_attention(*xs[:3], grid, gate=gate, top_k=top_k, order=order,
                                                  return_selection=True)

        o, vjp, sel = jax.vjp(op, *primals, has_aux=True)
        return o, vjp(d_o), sel

    o, grads, (q2k, counts) = run(primals, d_o)
    assert o.dtype == dtype and o.shape == q.shape
    assert q2k.shape == (b, hq, n, top_k) and counts.shape == (b, hq, n)

    f32 = [x.astype(jnp.float32) for x in primals]
    tiled = [ref_tile(x, grid) for x in f32] if order == "raster" else f32
    scale = d ** -0.5
    check_selection(q2k, counts, coarse_scores_f64(tiled[0], tiled[1], grid, scale), top_k)

    selected = lists_to_selection(q2k, counts, n)

    def definition(*xs):
        if order == "raster":
            xs = [ref_tile(x, grid) for x in xs]
        gate = xs[3] if gated else None
        out = ref_video_sparse_attention(*xs[:3], gate, grid, scale, selected)
        return ref_untile(out, grid) if order == "raster" else out

    want, vjp = jax.vjp(definition, *f32)
    wgrads = vjp(d_o.astype(jnp.float32))
    for name, a, e in zip(["o", "dq", "dk", "dv", "dgate"], [o, *grads], [want, *wgrads]):
        assert a.dtype == dtype and a.shape == e.shape
        assert rel(a, e) < TOL, f"{name}: {rel(a, e):.2e} against the float32 definition"


def random_lists(b, hq, n, capacity, seed):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, capacity + 1, size=(b, hq, n)).astype(np.int32)
    q2k = np.full((b, hq, n, capacity), -1, dtype=np.int32)
    for index in np.ndindex(b, hq, n):
        c = counts[index]
        q2k[index][:c] = np.sort(rng.permutation(n)[:c])
    return q2k, counts


@gpu
@pytest.mark.parametrize("hkv,d,dtype", [(2, 128, jnp.bfloat16), (4, 64, jnp.float16)])
def test_sparse_attention_on_random_lists(hkv, d, dtype):
    grid, b, hq = (9, 10, 11), 2, 4
    q, k, v, _, d_o = inputs(grid, b, hq, hkv, d, dtype, seed=3)
    n = tile_counts(grid).size
    q2k, counts = random_lists(b, hq, n, 5, seed=4)
    vsa_jax.check_lists(q2k, counts, grid)

    @jax.jit
    def run(q, k, v, q2k, counts, d_o):
        (o, lse), vjp = jax.vjp(lambda *xs: vsa_jax.sparse_attention(*xs, q2k, counts, grid, return_lse=True), q, k, v)
        return o, lse, vjp((d_o, jnp.zeros_like(lse)))

    o, lse, grads = run(q, k, v, jnp.asarray(q2k), jnp.asarray(counts), d_o)
    selected = lists_to_selection(q2k, counts, n)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want, vjp = jax.vjp(lambda *xs: ref_sparse_attention(*xs, grid, d ** -0.5, selected), *f32)
    wgrads = vjp(d_o.astype(jnp.float32))
    for name, a, e in zip(["o_s", "dq", "dk", "dv"], [o, *grads], [want, *wgrads]):
        assert a.dtype == dtype
        assert rel(a, e) < TOL, f"{name}: {rel(a, e):.2e}"
    # The log-sum-exp of the rows that attend to something; +inf elsewhere (padding rows, empty lists).
    lse, want_lse = np.asarray(lse), np.asarray(ref_lse(f32[0], f32[1], grid, d ** -0.5, selected))
    finite = np.isfinite(want_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    assert np.abs(lse[finite] - want_lse[finite]).max() < 5e-2


@gpu
def test_tile_and_untile_are_the_definition_and_each_others_gradient():
    grid = (9, 10, 11)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 990, 3, 64)), dtype=jnp.float16)
    t = jax.jit(lambda x: vsa_jax.tile(x, grid))(x)
    assert np.array_equal(np.asarray(t), np.asarray(ref_tile(x, grid)))
    assert np.array_equal(np.asarray(vsa_jax.untile(t, grid)), np.asarray(x))
    w = jnp.asarray(np.random.default_rng(6).standard_normal(t.shape), dtype=jnp.float16)
    grad = jax.grad(lambda x: (vsa_jax.tile(x, grid) * w).astype(jnp.float32).sum())(x)
    assert np.array_equal(np.asarray(grad), np.asarray(ref_untile(w, grid)))


def op_step(q, k, v, g, d_o, grid):
    o, vjp = jax.vjp(lambda *xs: vsa_jax.video_sparse_attention(*xs[:3], grid, gate=xs[3], sparsity=0.8), q, k, v, g)
    return [o, *vjp(d_o)]


@gpu
def test_jit_equals_eager_and_the_backward_is_reproducible():
    grid = (9, 10, 11)
    q, k, v, g, d_o = inputs(grid, 1, 4, 2, 128, jnp.bfloat16, seed=7, tiled=False)
    jitted = jax.jit(op_step, static_argnums=5)
    first, second = jitted(q, k, v, g, d_o, grid), jitted(q * 1, k, v, g, d_o, grid)
    eager = op_step(q, k, v, g, d_o, grid)
    for a, b, c in zip(first, second, eager):
        assert np.array_equal(np.asarray(a), np.asarray(b))
        assert np.array_equal(np.asarray(a), np.asarray(c))


@gpu
def test_the_selection_feeds_sparse_attention():
    """The lists the whole op returns, given back to sparse attention: its fine pass alone, o_s = o − g ⊙ o_c
    with no gate and o_c from the definition."""
    grid, d = (8, 12, 12), 128
    q, k, v, _, _ = inputs(grid, 1, 2, 2, d, jnp.bfloat16, seed=8)
    o, (q2k, counts) = vsa_jax.video_sparse_attention(q, k, v, grid, sparsity=0.7, order="tiled",
                                                      return_selection=True)
    o_s = vsa_jax.sparse_attention(q, k, v, q2k, counts, grid)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    selected = lists_to_selection(q2k, counts, tile_counts(grid).size)
    want = ref_sparse_attention(*f32, grid, d ** -0.5, selected)
    assert rel(o_s, want) < TOL
    o_c = ref_video_sparse_attention(*f32, None, grid, d ** -0.5, selected) - want
    assert rel(o.astype(jnp.float32) - o_c, want) < TOL


# ---- rejections, raised while tracing (no GPU needed) ---------------------------------------------------------

def shapes(s, hq=2, hkv=2, d=128, dtype=jnp.bfloat16, b=1):
    return [jax.ShapeDtypeStruct((b, s, h, d), dtype) for h in (hq, hkv, hkv)]


def lists(capacity=3, tiles=27, count_shape=(1, 2, 27), dtype=jnp.int32):
    return [jax.ShapeDtypeStruct((1, 2, tiles, capacity), dtype), jax.ShapeDtypeStruct(count_shape, jnp.int32)]


G, RASTER, TILED = (9, 10, 11), 990, 27 * 64  # 27 tiles
vsa, sparse = vsa_jax.video_sparse_attention, vsa_jax.sparse_attention
gate_of_one_head = shapes(RASTER, hq=1)[0]


@pytest.mark.parametrize("fn,args,message", [
    (lambda q, k, v: vsa(q, k, v, G), shapes(RASTER, d=32), "head_dim"),
    (lambda q, k, v: vsa(q, k, v, G), shapes(RASTER, dtype=jnp.float32), "bf16 or fp16"),
    (lambda q, k, v: vsa(q, k, v, G), shapes(RASTER, dtype=jnp.int32), "is not one of"),
    (lambda q, k, v: vsa(q, k, v, G), shapes(RASTER - 1), "q: holds 989 tokens, the grid needs 990"),
    (lambda q, k, v: vsa(q, k, v, G, order="tiled"), shapes(RASTER), "q: holds 990 tokens, the grid needs 1728"),
    (lambda q, k, v: vsa(q, k, v, G), shapes(RASTER, hq=3), "kv_heads: 2 does not divide q_heads 3"),
    (lambda q, k, v: vsa(q, k, v, G, top_k=28), shapes(RASTER), "top_k: 28 is outside 1..27"),
    (lambda q, k, v: vsa(q, k, v, G, sparsity=1.0), shapes(RASTER), "sparsity"),
    (lambda q, k, v: vsa(q, k, v, G, scale=-1.0), shapes(RASTER), "scale: must be positive"),
    (lambda q, k, v: vsa(q, k, v, (9, 10)), shapes(RASTER), "grid: must be"),
    (lambda q, k, v: vsa(q, k, v, G, order="bhsd"), shapes(RASTER), "order"),
    (lambda q, k, v, g: vsa(q, k, v, G, gate=g), [*shapes(RASTER), gate_of_one_head], "gate: 1 heads, expected 2"),
    (lambda q, k, v: vsa(q[0], k, v, G), shapes(RASTER), "q: must be \\[B, S, H, D\\]"),
    (lambda q, k, v: vsa(q, k, v, G), [*shapes(RASTER)[:2], shapes(RASTER, b=2)[2]], "batch and head dim"),
    (lambda q, k, v, a, c: sparse(q, k, v, a, c, G), [*shapes(TILED), *lists(dtype=jnp.float32)], "int32"),
    (lambda q, k, v, a, c: sparse(q, k, v, a, c, G), [*shapes(TILED), *lists(capacity=28)], "q2k_capacity"),
    (lambda q, k, v, a, c: sparse(q, k, v, a, c, G), [*shapes(TILED), *lists(tiles=26)], "q2k: must be"),
    (lambda q, k, v, a, c: sparse(q, k, v, a, c, G), [*shapes(TILED), *lists(count_shape=(1, 2))], "q2k_count"),
    (lambda q, k, v, a, c: sparse(q, k, v, a, c, G), [*shapes(RASTER), *lists()], "q: holds 990 tokens"),
    (lambda x: vsa_jax.tile(x, G), shapes(RASTER + 1)[:1], "x: holds 991 tokens, the grid needs 990"),
    (lambda x: vsa_jax.untile(x, G), shapes(RASTER)[:1], "x: holds 990 tokens, the grid needs 1728"),
])
def test_rejected_arguments_raise_value_error_while_tracing(fn, args, message):
    # eval_shape traces without running anything: the checks need neither a GPU nor real arrays.
    with pytest.raises(ValueError, match=message):
        jax.eval_shape(fn, *args)


def test_check_lists_names_the_bad_entry():
    q2k, counts = random_lists(1, 2, 27, 3, seed=9)
    vsa_jax.check_lists(q2k, counts, (9, 10, 11))
    counts[0, 1, 5] = 4
    with pytest.raises(ValueError, match="q2k_count\\[32\\] = 4 is outside 0..3"):
        vsa_jax.check_lists(q2k, counts, (9, 10, 11))
