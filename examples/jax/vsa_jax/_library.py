"""libvsa_jax.so through ctypes: where it is, and the host functions the ops call at trace time (the library's
argument checks and the sizes of the state and scratch XLA is asked for). No jax here, so that the checks can be
used, and tested, without it."""
import ctypes
import os
import pathlib

ENV = "VSA_JAX_LIBRARY"  # a path to the library, taking precedence over the places below
NAME = "libvsa_jax.so"
HERE = pathlib.Path(__file__).resolve().parent

# vsa::errc: unsupported and runtime_error are failures of the run, the other codes rejected arguments.
_RUNTIME_CODES = {14, 15}
_MESSAGE_BYTES = 256  # vsa::status keeps 192


class Problem(ctypes.Structure):
    """vsa_jax_problem of csrc/vsa_jax.cu: vsa::problem as plain numbers (dtype as vsa::dtype's value)."""
    _fields_ = [(name, ctypes.c_int64)
                for name in ("batch", "q_heads", "kv_heads", "head_dim", "grid_t", "grid_h", "grid_w", "dtype")]


def candidates():
    """Where the library is looked for, in order: $VSA_JAX_LIBRARY, beside the package (an installed copy), and
    examples/jax/build/ (what build.py writes)."""
    given = os.environ.get(ENV)
    places = [pathlib.Path(given)] if given else []
    return places + [HERE / NAME, HERE.parent / "build" / NAME]


def path():
    """The library's path, or None where none of the candidates exists."""
    return next((p for p in candidates() if p.is_file()), None)


_lib = None


def load():
    """The loaded library (loaded once). OSError naming the places looked at where it is missing."""
    global _lib
    if _lib is not None:
        return _lib
    found = path()
    if found is None:
        where = ", ".join(str(p) for p in candidates())
        raise OSError(f"vsa_jax: {NAME} not found (looked at {where}); build it with examples/jax/build.py "
                      f"or set {ENV}")
    lib = ctypes.CDLL(str(found))
    problem, i64, msg = ctypes.POINTER(Problem), ctypes.c_int64, ctypes.c_char_p
    i64s, i32s = ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int32)
    signatures = {
        "vsa_jax_check_problem": [problem, msg, i64],
        "vsa_jax_check_tensor": [problem, ctypes.c_char_p, i64, i64, i64, msg, i64],
        "vsa_jax_op_sizes": [problem, i64, ctypes.c_double, ctypes.c_float, i64s, msg, i64],
        "vsa_jax_sparse_sizes": [problem, i64, ctypes.c_float, i64s, msg, i64],
        "vsa_jax_check_lists": [problem, i32s, i32s, i64, msg, i64],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    _lib = lib
    return lib


def _call(op, name, *args):
    """Calls a host function; its rejection becomes ValueError (a runtime failure RuntimeError) with the
    library's message, as the PyTorch binding raises them."""
    message = ctypes.create_string_buffer(_MESSAGE_BYTES)
    code = getattr(load(), name)(*args, message, _MESSAGE_BYTES)
    if code != 0:
        error = RuntimeError if code in _RUNTIME_CODES else ValueError
        raise error(f"vsa.{op}: {message.value.decode(errors='replace')}")


def check_problem(op, p):
    """vsa::check_problem for the GPU kernels."""
    _call(op, "vsa_jax_check_problem", ctypes.byref(p))


def check_tensor(op, p, name, tokens, heads, expected_tokens):
    """vsa::check_tensor of a dense [B, tokens, heads, D] array whose grid needs expected_tokens."""
    _call(op, "vsa_jax_check_tensor", ctypes.byref(p), name.encode(), tokens, heads, expected_tokens)


def op_sizes(op, p, top_k, sparsity, scale):
    """The whole op's (state bytes, forward scratch bytes, backward scratch bytes, k) for a problem."""
    sizes = (ctypes.c_int64 * 4)()
    _call(op, "vsa_jax_op_sizes", ctypes.byref(p), top_k, sparsity, scale, sizes)
    return tuple(sizes)


def sparse_sizes(op, p, capacity, scale):
    """The scratch bytes of sparse attention's backward on lists of `capacity` entries a row."""
    sizes = (ctypes.c_int64 * 1)()
    _call(op, "vsa_jax_sparse_sizes", ctypes.byref(p), capacity, scale, sizes)
    return sizes[0]


def check_lists(op, p, q2k, q2k_count):
    """vsa::check_q2k_host on host lists: q2k and q2k_count C-contiguous int32 numpy arrays."""
    as_ptr = ctypes.POINTER(ctypes.c_int32)
    _call(op, "vsa_jax_check_lists", ctypes.byref(p), q2k.ctypes.data_as(as_ptr), q2k_count.ctypes.data_as(as_ptr),
          q2k.shape[-1])
