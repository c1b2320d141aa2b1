from setuptools import find_packages, setup

setup(
    name="ds_comet",
    version="0.1.0",
    description="COMET-style compute/communication overlap for DeepSpeed Mixture-of-Experts layers",
    packages=find_packages(include=["ds_comet", "ds_comet.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "deepspeed>=0.19.4", "tqdm"],
    extras_require={
        "test": ["pytest>=8"],
        "mpi": ["mpi4py>=4"],
        "triton": ["triton>=3.2"],
        "bench": ["matplotlib"],
    },
)
