"""vsa's ops for JAX: the whole op, sparse attention on caller lists, tiling; each a jax.custom_vjp over XLA FFI
calls into libvsa_jax.so (the library's GPU kernels on XLA's stream, every byte of memory XLA's).

Arrays are [B, S, H, D] (bshd), row-major. Everything about a call is checked while it is traced, through the
library's own host-side checks where they apply, so a bad argument raises ValueError with the library's message
before anything runs; the calls then work under jax.jit and jax.grad like any other op."""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _library

TILE_TOKENS = 64  # a 4×4×4 tile

# vsa::dtype's values; the GPU kernels take the first two (check_problem says so for the others).
_DTYPE_CODES = {np.dtype(jnp.bfloat16): 0, np.dtype(jnp.float16): 1, np.dtype(jnp.float32): 2,
                np.dtype(jnp.float64): 3}

# FFI target name -> the handler's symbol in the library.
_TARGETS = {
    "vsa_forward": "vsa_jax_forward",
    "vsa_backward": "vsa_jax_backward",
    "vsa_sparse_forward": "vsa_jax_sparse_forward",
    "vsa_sparse_backward": "vsa_jax_sparse_backward",
    "vsa_tile": "vsa_jax_tile",
    "vsa_untile": "vsa_jax_untile",
}
_registered = False


def register():
    """Registers the library's handlers with XLA as CUDA FFI targets (once; every op does it when traced)."""
    global _registered
    if _registered:
        return
    lib = _library.load()
    for name, symbol in _TARGETS.items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="CUDA")
    _registered = True


# ---- trace-time checks --------------------------------------------------------------------------------------

def check_grid(grid):
    try:
        t, h, w = (int(x) for x in grid)
    except (TypeError, ValueError):
        raise ValueError(f"vsa: grid: must be (T, H, W), got {grid!r}") from None
    return t, h, w


def num_tiles(grid):
    t, h, w = grid
    return -(-t // 4) * -(-h // 4) * -(-w // 4)


def tiled_tokens(grid):
    return num_tiles(grid) * TILE_TOKENS


def raster_tokens(grid):
    t, h, w = grid
    return t * h * w


def _dtype_code(x, op, name):
    code = _DTYPE_CODES.get(np.dtype(x.dtype))
    if code is None:
        raise ValueError(f"vsa.{op}: {name}: dtype {x.dtype} is not one of bfloat16, float16, float32, float64")
    return code


def _check_bshd(x, like, op, name):
    """A [B, S, H, D] array of like's dtype, batch and head dim (what the PyTorch binding's check_bshd asks)."""
    if x.ndim != 4:
        raise ValueError(f"vsa.{op}: {name}: must be [B, S, H, D], got {x.ndim} dimensions")
    if x.dtype != like.dtype:
        raise ValueError(f"vsa.{op}: {name}: dtype {x.dtype}, q is {like.dtype}")
    if x.shape[0] != like.shape[0] or x.shape[3] != like.shape[3]:
        raise ValueError(f"vsa.{op}: {name}: shape {tuple(x.shape)} does not match q's batch and head dim "
                         f"{tuple(like.shape)}")


def _problem(q, k, grid, op):
    """The problem of q [B, S, Hq, D] and k [B, S, Hkv, D] over grid, accepted by vsa::check_problem."""
    _check_bshd(q, q, op, "q")
    _check_bshd(k, q, op, "k")
    b, _, hq, d = q.shape
    p = _library.Problem(b, hq, k.shape[2], d, *grid, _dtype_code(q, op, "q"))
    _library.check_problem(op, p)
    return p


def _check_tokens(p, op, name, x, heads, tokens):
    """x has `heads` heads and the token count the grid needs (vsa::check_tensor's message where it has not)."""
    if x.shape[2] != heads:
        raise ValueError(f"vsa.{op}: {name}: {x.shape[2]} heads, expected {heads}")
    _library.check_tensor(op, p, name, x.shape[1], heads, tokens)


def _check_operands(op, grid, tokens, q, k, v, gate=None):
    p = _problem(q, k, grid, op)
    _check_bshd(v, q, op, "v")
    for name, x, heads in (("q", q, p.q_heads), ("k", k, p.kv_heads), ("v", v, p.kv_heads)):
        _check_tokens(p, op, name, x, heads, tokens)
    if gate is not None:
        _check_bshd(gate, q, op, "gate")
        _check_tokens(p, op, "gate", gate, p.q_heads, tokens)
    return p


def _grid_attrs(grid):
    t, h, w = grid
    return dict(grid_t=np.int64(t), grid_h=np.int64(h), grid_w=np.int64(w))


def _empty(dtype):
    """The stand-in for an absent gate or an unrequested result: the handlers tell by its rank, 1."""
    return jax.ShapeDtypeStruct((0,), dtype)


def _bytes(n):
    return jax.ShapeDtypeStruct((int(n),), jnp.uint8)


# ---- tiling -------------------------------------------------------------------------------------------------

def _layout(x, grid, to_tiled):
    register()
    t = tiled_tokens(grid) if to_tiled else raster_tokens(grid)
    out = jax.ShapeDtypeStruct((x.shape[0], t, x.shape[2], x.shape[3]), x.dtype)
    return jax.ffi.ffi_call("vsa_tile" if to_tiled else "vsa_untile", out)(x, **_grid_attrs(grid))


def _check_layout(x, grid, op, tokens):
    _check_bshd(x, x, op, "x")
    b, _, h, d = x.shape
    p = _library.Problem(b, h, h, d, *grid, _dtype_code(x, op, "x"))
    _library.check_problem(op, p)
    _check_tokens(p, op, "x", x, h, tokens)


# tile and untile are linear, each the other's transpose: tile's padding slots are constants (zero), and the
# slots untile drops get a zero gradient.
@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _tile(x, grid):
    return _layout(x, grid, True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _untile(x, grid):
    return _layout(x, grid, False)


_tile.defvjp(lambda x, grid: (_layout(x, grid, True), None), lambda grid, _, dy: (_layout(dy, grid, False),))
_untile.defvjp(lambda x, grid: (_layout(x, grid, False), None), lambda grid, _, dy: (_layout(dy, grid, True),))


def tile(x, grid):
    """Raster order (t, h, w) -> tiled order: x [B, T·H·W, H, D] -> [B, N·64, H, D], padding slots zero."""
    grid = check_grid(grid)
    _check_layout(x, grid, "tile", raster_tokens(grid))
    return _tile(x, grid)


def untile(x, grid):
    """Tiled order -> raster order: x [B, N·64, H, D] -> [B, T·H·W, H, D], padding slots dropped."""
    grid = check_grid(grid)
    _check_layout(x, grid, "untile", tiled_tokens(grid))
    return _untile(x, grid)


# ---- the whole op -------------------------------------------------------------------------------------------

class _OpConfig(NamedTuple):
    grid: tuple
    top_k: int  # 0: from sparsity
    sparsity: float
    scale: float  # 0: 1/sqrt(D)
    return_selection: bool

    def attrs(self):
        return dict(_grid_attrs(self.grid), top_k=np.int64(self.top_k), sparsity=np.float64(self.sparsity),
                    scale=np.float32(self.scale))

    def sizes(self, q, k):
        """(state bytes, forward scratch, backward scratch, k) of the call on tiled q and k."""
        p = _problem(q, k, self.grid, "forward")
        return _library.op_sizes("forward", p, self.top_k, self.sparsity, self.scale)


def _op_forward(q, k, v, gate, cfg):
    register()
    state_bytes, scratch_bytes, _, k_sel = cfg.sizes(q, k)
    b, _, hq, _ = q.shape
    n = num_tiles(cfg.grid)
    lists = (jax.ShapeDtypeStruct((b, hq, n, k_sel), jnp.int32), jax.ShapeDtypeStruct((b, hq, n), jnp.int32))
    if not cfg.return_selection:
        lists = (_empty(jnp.int32), _empty(jnp.int32))
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), _bytes(state_bytes), *lists, _bytes(scratch_bytes))
    g = jnp.zeros((0,), q.dtype) if gate is None else gate
    o, state, q2k, counts, _ = jax.ffi.ffi_call("vsa_forward", results)(q, k, v, g, **cfg.attrs())
    return (o, q2k, counts), (q, k, v, gate, o, state)


def _op_backward(cfg, residuals, cotangents):
    register()
    q, k, v, gate, o, state = residuals
    d_o = cotangents[0].astype(o.dtype)
    _, _, scratch_bytes, _ = cfg.sizes(q, k)
    like = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    dgate = _empty(q.dtype) if gate is None else jax.ShapeDtypeStruct(gate.shape, gate.dtype)
    g = jnp.zeros((0,), q.dtype) if gate is None else gate
    dq, dk, dv, dg, _ = jax.ffi.ffi_call("vsa_backward", (*like, dgate, _bytes(scratch_bytes)))(
        d_o, q, k, v, g, o, state, **cfg.attrs())
    return dq, dk, dv, None if gate is None else dg


# The op on tiled arrays: (o, q2k, counts), the lists empty unless cfg.return_selection (they are integers: no
# gradient flows through them).
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _op(q, k, v, gate, cfg):
    return _op_forward(q, k, v, gate, cfg)[0]


_op.defvjp(_op_forward, _op_backward)


def video_sparse_attention(q, k, v, grid, *, gate=None, top_k=None, sparsity=0.9, scale=None, order="raster",
                           return_selection=False):
    """Video sparse attention: o = o_s + gate ⊙ o_c over the 4×4×4 tiles of the latent grid (T, H, W).

    q [B, S, Hq, D], k and v [B, S, Hkv, D] (Hkv divides Hq), gate like q or None (g = 1); bf16 or fp16, D 64 or
    128. S = T·H·W in raster order (the model's own token order; tiled and untiled inside) or N·64 in tiled order
    (order="tiled", padding slots of every tile after its valid tokens). Each query tile attends to its top_k key
    tiles (top_k None: ceil((1 - sparsity)·N)); scale None: 1/sqrt(D).

    return_selection=True also returns the selected lists (q2k [B, Hq, N, k] int32, counts [B, Hq, N]), which
    sparse_attention takes as they are."""
    grid = check_grid(grid)
    if order not in ("raster", "tiled"):
        raise ValueError(f"vsa: order: must be 'raster' or 'tiled', got {order!r}")
    raster = order == "raster"
    _check_operands("forward", grid, raster_tokens(grid) if raster else tiled_tokens(grid), q, k, v, gate)
    cfg = _OpConfig(grid, 0 if top_k is None else int(top_k), float(sparsity), 0.0 if scale is None else float(scale),
                    bool(return_selection))
    # The sizes' own checks (top_k, sparsity, scale) raise here, before anything is traced into XLA; they depend on
    # the problem alone, not on the token order.
    cfg.sizes(q, k)
    if raster:
        q, k, v = _tile(q, grid), _tile(k, grid), _tile(v, grid)
        gate = None if gate is None else _tile(gate, grid)
    o, q2k, counts = _op(q, k, v, gate, cfg)
    if raster:
        o = _untile(o, grid)
    return (o, (q2k, counts)) if return_selection else o


# ---- sparse attention on caller lists ------------------------------------------------------------------------

class _SparseConfig(NamedTuple):
    grid: tuple
    scale: float

    def attrs(self):
        return dict(_grid_attrs(self.grid), scale=np.float32(self.scale))


def _sparse_forward(q, k, v, q2k, q2k_count, cfg):
    register()
    b, s, hq, _ = q.shape
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, hq, s), jnp.float32))
    o, lse = jax.ffi.ffi_call("vsa_sparse_forward", results)(q, k, v, q2k, q2k_count, **cfg.attrs())
    return (o, lse), (q, k, v, q2k, q2k_count, o, lse)


def _sparse_backward(cfg, residuals, cotangents):
    register()
    q, k, v, q2k, q2k_count, o, lse = residuals
    d_o = cotangents[0].astype(o.dtype)
    p = _problem(q, k, cfg.grid, "sparse_attention")
    scratch = _library.sparse_sizes("sparse_attention", p, q2k.shape[3], cfg.scale)
    like = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    dq, dk, dv, _ = jax.ffi.ffi_call("vsa_sparse_backward", (*like, _bytes(scratch)))(
        d_o, q, k, v, o, lse, q2k, q2k_count, **cfg.attrs())
    return dq, dk, dv, None, None


# (o, lse) on tiled arrays; lse is a statistic of the forward, not differentiated through.
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _sparse(q, k, v, q2k, q2k_count, cfg):
    return _sparse_forward(q, k, v, q2k, q2k_count, cfg)[0]


_sparse.defvjp(_sparse_forward, _sparse_backward)


def _check_list_shapes(q2k, q2k_count, b, hq, n, op):
    for x in (q2k, q2k_count):
        if x.dtype != jnp.int32:
            raise ValueError(f"vsa.{op}: q2k lists: must be int32, got {x.dtype}")
    if q2k.ndim != 4 or tuple(q2k.shape[:3]) != (b, hq, n):
        raise ValueError(f"vsa.{op}: q2k: must be [B, Hq, N, capacity] = [{b}, {hq}, {n}, k], got "
                         f"{tuple(q2k.shape)}")
    if tuple(q2k_count.shape) != (b, hq, n):
        raise ValueError(f"vsa.{op}: q2k_count: must be [B, Hq, N] = [{b}, {hq}, {n}], got "
                         f"{tuple(q2k_count.shape)}")


def sparse_attention(q, k, v, q2k, q2k_count, grid, *, scale=None, return_lse=False):
    """Exact attention of every query tile over the key tiles of its list, in tiled order (S = N·64).

    q2k [B, Hq, N, capacity] int32 (ascending tiles in each row's first q2k_count[b, h, i] slots), q2k_count
    [B, Hq, N] int32. Padding rows and rows with empty lists give o = 0 (lse = +inf). The GPU kernels take the
    lists on trust (check_lists checks host copies); return_lse also returns the fp32 log-sum-exp [B, Hq, N·64]."""
    op = "sparse_attention"
    grid = check_grid(grid)
    p = _check_operands(op, grid, tiled_tokens(grid), q, k, v)
    _check_list_shapes(q2k, q2k_count, p.batch, p.q_heads, num_tiles(grid), op)
    cfg = _SparseConfig(grid, float(q.shape[3]) ** -0.5 if scale is None else float(scale))
    _library.sparse_sizes(op, p, q2k.shape[3], cfg.scale)  # the capacity and the scale
    o, lse = _sparse(q, k, v, q2k, q2k_count, cfg)
    return (o, lse) if return_lse else o


def check_lists(q2k, q2k_count, grid):
    """vsa::check_q2k_host on concrete lists (copied to the host): ValueError naming the first bad entry, a count
    outside [0, capacity], a tile outside [0, N), or a row not strictly ascending."""
    grid = check_grid(grid)
    q2k, q2k_count = np.ascontiguousarray(q2k), np.ascontiguousarray(q2k_count)
    if q2k.ndim != 4:
        raise ValueError(f"vsa.check_lists: q2k: must be [B, Hq, N, capacity], got shape {q2k.shape}")
    b, hq = q2k.shape[:2]
    _check_list_shapes(q2k, q2k_count, b, hq, num_tiles(grid), "check_lists")
    _library.check_lists("check_lists", _library.Problem(b, hq, hq, 64, *grid, 0), q2k, q2k_count)
