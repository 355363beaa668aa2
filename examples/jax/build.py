#!/usr/bin/env python3
"""Builds examples/jax/build/libvsa_jax.so: the XLA FFI handlers and the trace-time host functions of vsa_jax.

    python3 examples/jax/build.py                          # XLA's headers from the installed jaxlib
    python3 examples/jax/build.py --ffi-include DIR        # or from DIR (holding xla/ffi/api/ffi.h): no jax needed
    python3 examples/jax/build.py --arch 90a --arch 80     # the GPU architectures (default 90a: Hopper's kernels)

One nvcc call compiles csrc/*.cu: every kernel of the op, a few minutes on a small machine. nvcc is taken from
$NVCC, PATH or /usr/local/cuda/bin."""
import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
INCLUDE = HERE.parent.parent / "include"  # the library's headers, in this source tree


def find_nvcc():
    for candidate in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise SystemExit("build.py: nvcc not found (set NVCC, put it on PATH, or install the CUDA toolkit)")


def ffi_include(given):
    if given is None:
        try:
            import jax.ffi
        except ImportError:
            raise SystemExit("build.py: jax is not installed: pass --ffi-include DIR (a folder holding "
                             "xla/ffi/api/ffi.h, as jax.ffi.include_dir() gives)") from None
        given = jax.ffi.include_dir()
    path = pathlib.Path(given).resolve()
    if not (path / "xla" / "ffi" / "api" / "ffi.h").is_file():
        raise SystemExit(f"build.py: {path} has no xla/ffi/api/ffi.h")
    return path


def gencode(arch):
    arch = arch.removeprefix("sm_")
    return f"-gencode=arch=compute_{arch},code=sm_{arch}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ffi-include", metavar="DIR", help="XLA's FFI headers (default: jax.ffi.include_dir())")
    parser.add_argument("--arch", action="append", metavar="ARCH",
                        help="a GPU architecture, e.g. 90a or 80 (repeatable; default 90a)")
    parser.add_argument("--output", metavar="FILE", default=str(HERE / "build" / "libvsa_jax.so"))
    parser.add_argument("--verbose", action="store_true", help="print the nvcc command and all its output")
    args = parser.parse_args()

    out = pathlib.Path(args.output).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    sources = sorted(str(p) for p in (HERE / "csrc").glob("*.cu"))
    # XLA's headers as system headers: their warnings are not this build's to fix.
    cmd = [find_nvcc(), "-std=c++17", "-O3", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC", "-shared",
           *(gencode(a) for a in (args.arch or ["90a"])), f"-I{INCLUDE}", "-isystem",
           str(ffi_include(args.ffi_include)), *sources, "-o", str(out)]
    if args.verbose:
        print(" ".join(cmd), flush=True)
    print(f"build.py: compiling {len(sources)} file(s) for {', '.join(args.arch or ['90a'])} into {out} "
          "(a few minutes)", flush=True)

    # A line every 30 s, so that a long compile does not look like a hang.
    start = time.monotonic()
    done = threading.Event()

    def progress():
        while not done.wait(30):
            print(f"build.py: still compiling ({time.monotonic() - start:.0f} s)", flush=True)

    ticker = threading.Thread(target=progress, daemon=True)
    ticker.start()
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done.set()
    if result.returncode != 0 or args.verbose:
        sys.stdout.write(result.stdout)
    if result.returncode != 0:
        raise SystemExit(f"build.py: nvcc failed (exit {result.returncode})")
    print(f"build.py: built {out} in {time.monotonic() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
