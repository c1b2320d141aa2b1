"""ds_comet: COMET-style compute/communication overlap for DeepSpeed MoE layers.

    pip install -e .                                  # JIT-builds the CUDA op on first use
    DS_BUILD_COMET=1 pip install --no-build-isolation .   # builds it now (needs torch, nvcc)

The op builder lives at the top of the repository (``op_builder/``, as in DeepSpeed's own tree)
and installs as ``ds_comet.op_builder``, so it neither shadows nor is shadowed by DeepSpeed's
``op_builder``; in a checkout ``ds_comet/op_builder`` is a link to it.
"""

import importlib.util
import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithSources(build_py):
    """Ship csrc/ inside ds_comet.op_builder, where CometBuilder looks when not in a checkout."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "ds_comet", "op_builder", "csrc")
        shutil.copytree(os.path.join(HERE, "csrc"), target, dirs_exist_ok=True)


def _load_builder_module():
    """op_builder/comet.py loaded by path (setup.py runs before the package is importable)."""
    spec = importlib.util.spec_from_file_location(
        "ds_comet_op_builder_comet", os.path.join(HERE, "op_builder", "comet.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cmdclass = {"build_py": BuildPyWithSources}
ext_modules = []
if os.environ.get("DS_BUILD_COMET") == "1":
    from torch.utils.cpp_extension import BuildExtension

    builder_module = _load_builder_module()
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = builder_module.plain_arch_list(os.environ["TORCH_CUDA_ARCH_LIST"])
    ext_modules.append(builder_module.CometBuilder().builder())
    cmdclass["build_ext"] = BuildExtension

packages = find_packages(include=["ds_comet", "ds_comet.*"], exclude=["ds_comet.op_builder"])
setup(
    name="ds_comet",
    version="0.1.0",
    description="COMET-style compute/communication overlap for DeepSpeed Mixture-of-Experts layers",
    packages=packages + ["ds_comet.op_builder"],
    package_dir={"ds_comet.op_builder": "op_builder"},
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "deepspeed>=0.19.4", "tqdm", "hjson"],
    extras_require={
        "test": ["pytest>=8"],
        # README's test command checks the code with these exact versions (CI runs it).
        "lint": ["ruff==0.17.6", "clang-format==23.1.5"],
        "mpi": ["mpi4py>=4"],
        "triton": ["triton>=3.4"],  # tl.make_tensor_descriptor
        "bench": ["matplotlib"],
        # What DeepSpeed 0.19.8's AutoEP works with (5.23 fails in deepspeed.initialize).
        "hf": ["transformers==5.16.1", "accelerate==1.16.0"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
