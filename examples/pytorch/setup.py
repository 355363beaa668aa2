"""Builds vsa_torch: torch ops over the vsa headers (CUDA kernels where torch has CUDA, the CPU reference always).

    pip install --no-build-isolation examples/pytorch

Environment:
  VSA_TORCH_CUDA=0|1     force the CPU-only build, or insist on CUDA (default: CUDA when torch has it and nvcc is found)
  VSA_CUDA_ARCHS=90a;80  the GPU architectures (default: those of the visible GPUs, 9.0 as sm_90a, else 80;90a)
  MAX_JOBS=N             parallel compile jobs (torch's build)
"""
import os
import pathlib

from setuptools import setup
from torch.utils import cpp_extension

HERE = pathlib.Path(__file__).resolve().parent
INCLUDE = HERE.parent.parent / "include"  # the library's headers, in this source tree


def want_cuda():
    flag = os.environ.get("VSA_TORCH_CUDA")
    import torch

    available = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if flag == "1" and not available:
        raise SystemExit("VSA_TORCH_CUDA=1, but torch has no CUDA or nvcc was not found (set CUDA_HOME)")
    return available if flag is None else flag == "1"


def cuda_archs():
    """-gencode flags: sm_90a where Hopper's kernels apply (wgmma, the copy engine), else the plain arch."""
    given = os.environ.get("VSA_CUDA_ARCHS")
    if given:
        archs = [a.strip() for a in given.replace(",", ";").split(";") if a.strip()]
    else:
        import torch

        archs = []
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                major, minor = torch.cuda.get_device_capability(i)
                archs.append("90a" if (major, minor) == (9, 0) else f"{major}{minor}")
        archs = sorted(set(archs)) or ["80", "90a"]
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]


def extension():
    cxx = ["-O3", "-std=c++17", "-Wno-deprecated-declarations"]  # the last for torch's own headers
    sources = ["csrc/ops.cpp"]
    if not want_cuda():
        return cpp_extension.CppExtension("vsa_torch._C", sources, include_dirs=[str(INCLUDE)],
                                          extra_compile_args={"cxx": cxx})
    # With -gencode flags among the nvcc arguments torch adds none of its own (TORCH_CUDA_ARCH_LIST is ignored).
    nvcc = ["-O3", "-std=c++17", "--expt-relaxed-constexpr"] + cuda_archs()
    return cpp_extension.CUDAExtension("vsa_torch._C", sources + ["csrc/ops_cuda.cpp", "csrc/gpu_kernels.cu"],
                                       include_dirs=[str(INCLUDE)], extra_compile_args={"cxx": cxx, "nvcc": nvcc})


setup(
    name="vsa_torch",
    version="0.1.0",
    description="PyTorch ops for vsa, video sparse attention kernels",
    packages=["vsa_torch"],
    package_dir={"": "src"},  # not importable from this folder unbuilt: examples and scripts here get the installed one
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    zip_safe=False,
)
