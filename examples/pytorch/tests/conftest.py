import pathlib
import sys

try:
    import vsa_torch  # noqa: F401  (installed)
except ImportError:  # built in place: python setup.py build_ext --inplace
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))
