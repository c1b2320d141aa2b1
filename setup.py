"""ds_comet: COMET-style compute/communication overlap for DeepSpeed MoE layers.

    pip install -e .                                  # JIT-builds the CUDA op on first use
    DS_BUILD_COMET=1 pip install --no-build-isolation .   # builds it now (needs torch, nvcc)
"""

import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithSources(build_py):
    """Ship csrc/ inside the op_builder package, where CometBuilder looks when not in a checkout."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "op_builder", "csrc")
        shutil.copytree(os.path.join(HERE, "csrc"), target, dirs_exist_ok=True)


cmdclass = {"build_py": BuildPyWithSources}
ext_modules = []
if os.environ.get("DS_BUILD_COMET") == "1":
    from torch.utils.cpp_extension import BuildExtension

    from op_builder.comet import CometBuilder, plain_arch_list

    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = plain_arch_list(os.environ["TORCH_CUDA_ARCH_LIST"])
    ext_modules.append(CometBuilder().builder())
    cmdclass["build_ext"] = BuildExtension

setup(
    name="ds_comet",
    version="0.1.0",
    description="COMET-style compute/communication overlap for DeepSpeed Mixture-of-Experts layers",
    packages=find_packages(include=["ds_comet", "ds_comet.*", "op_builder"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "deepspeed>=0.19.4", "tqdm"],
    extras_require={
        "test": ["pytest>=8"],
        "mpi": ["mpi4py>=4"],
        "triton": ["triton>=3.4"],  # tl.make_tensor_descriptor
        "bench": ["matplotlib"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
