import pathlib
import sys

try:
    import vsa_jax  # noqa: F401  (installed)
except ImportError:  # the source tree: examples/jax/vsa_jax beside this folder
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

try:
    import jax
except ImportError:
    jax = None
if jax is not None:
    # The tests' references are float32 jax.numpy; on the GPU jax may run float32 products as TF32 (10-bit
    # mantissas), an error as large as the bf16 kernels' own. Full float32 products keep the references exact.
    jax.config.update("jax_default_matmul_precision", "highest")
