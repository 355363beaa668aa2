"""The library's trace-time host functions through ctypes, without jax: the sizes XLA is asked for and the
library's checks with their messages. Skipped where libvsa_jax.so is not built."""
import pytest

from vsa_jax import _library

pytestmark = pytest.mark.skipif(_library.path() is None, reason="libvsa_jax.so is not built (examples/jax/build.py)")

GRID = (9, 10, 11)  # 3 × 3 × 3 tiles, every one but the first partial
N = 27


def problem(batch=1, q_heads=2, kv_heads=2, head_dim=128, grid=GRID, dtype=0):
    return _library.Problem(batch, q_heads, kv_heads, head_dim, *grid, dtype)


def test_the_whole_op_sizes():
    state, forward, backward, k = _library.op_sizes("forward", problem(), 0, 0.9, 0.0)
    assert k == 3  # ceil(0.1 · 27)
    assert state > 0 and forward > state and backward > state
    # The scratch results hold an aligned copy of the state and 256 bytes of slack for aligning it.
    assert forward % 256 == 0 and backward % 256 == 0
    assert _library.op_sizes("forward", problem(), 3, 0.5, 0.0)[3] == 3  # top_k wins over sparsity
    bigger = _library.op_sizes("forward", problem(batch=2), 0, 0.9, 0.0)
    assert bigger[0] > state and bigger[2] > backward


def test_the_sparse_backward_size_grows_with_the_capacity():
    small = _library.sparse_sizes("sparse_attention", problem(), 1, 0.1)
    large = _library.sparse_sizes("sparse_attention", problem(), N, 0.1)
    assert 256 < small < large


@pytest.mark.parametrize("call,message", [
    (lambda: _library.check_problem("forward", problem(head_dim=32)), "head_dim: the GPU kernels take 64 or 128"),
    (lambda: _library.check_problem("forward", problem(dtype=2)), "bf16 or fp16, got f32"),
    (lambda: _library.check_problem("forward", problem(q_heads=3)), "kv_heads: 2 does not divide q_heads 3"),
    (lambda: _library.check_problem("forward", problem(batch=0)), "batch: must be >= 1"),
    (lambda: _library.check_problem("forward", problem(grid=(0, 1, 1))), "grid: every dimension must be >= 1"),
    (lambda: _library.check_tensor("forward", problem(), "q", 990, 2, N * 64), "q: holds 990 tokens"),
    (lambda: _library.op_sizes("forward", problem(), 28, 0.9, 0.0), "top_k: 28 is outside 1..27"),
    (lambda: _library.op_sizes("forward", problem(), 0, 1.0, 0.0), "sparsity: 1 is outside"),
    (lambda: _library.op_sizes("forward", problem(), 0, 0.9, -1.0), "scale: must be positive"),
    (lambda: _library.sparse_sizes("sparse_attention", problem(), 28, 0.1), "q2k_capacity: must be in 1..27"),
    (lambda: _library.sparse_sizes("sparse_attention", problem(), 3, float("inf")), "scale: must be positive"),
])
def test_rejections_raise_value_error_with_the_library_message(call, message):
    with pytest.raises(ValueError, match="^vsa\\.[a-z_]+: .*" + message.replace("(", "\\(")):
        call()


def test_accepted_arguments_pass():
    _library.check_problem("forward", problem())
    _library.check_tensor("forward", problem(), "q", N * 64, 2, N * 64)


def test_host_list_check():
    np = pytest.importorskip("numpy")
    q2k = np.full((1, 2, N, 3), -1, dtype=np.int32)
    counts = np.zeros((1, 2, N), dtype=np.int32)
    q2k[0, 0, 0, :2] = (4, 9)
    counts[0, 0, 0] = 2
    p = problem()
    _library.check_lists("check_lists", p, q2k, counts)
    q2k[0, 0, 0, :2] = (9, 4)
    with pytest.raises(ValueError, match="repeated or not ascending"):
        _library.check_lists("check_lists", p, q2k, counts)
    q2k[0, 0, 0, :2] = (4, 27)
    with pytest.raises(ValueError, match="is not a tile"):
        _library.check_lists("check_lists", p, q2k, counts)
    counts[0, 0, 0] = 4
    with pytest.raises(ValueError, match="is outside 0..3"):
        _library.check_lists("check_lists", p, q2k, counts)
