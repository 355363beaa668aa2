import pathlib
import sys

try:
    import vsa_jax  # noqa: F401  (installed)
except ImportError:  # the source tree: examples/jax/vsa_jax beside this folder
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
