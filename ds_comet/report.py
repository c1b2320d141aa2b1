"""python -m ds_comet report: what DeepSpeed's ds_report cannot show about ds_comet.

The op's build status, the GPUs and the peer access between them, and which pipeline a Comet
layer with a given ds_config would run here, and why; under an enabled ``"fp8"`` recipe, where it
would run.
"""

import argparse
import importlib
import sys

import torch


def _version(module_name):
    try:
        return getattr(importlib.import_module(module_name), "__version__", "installed")
    except ImportError:
        return "not installed"


def pipeline_verdict(config) -> str:
    """Which pipeline a bf16 Comet layer on this machine's GPU would run, before any layer exists."""
    from ds_comet.config import moe_config_from
    from ds_comet.pipelines.policy import runtime_reason

    section = moe_config_from(config)
    if section.backend == "deepspeed":
        return 'stock DeepSpeed MoE ("moe": {"backend": "deepspeed"})'
    if section.overlap == "none":
        return 'reference pipeline ("overlap": "none")'
    # The layers' own software checks, so that the report and the layers' logs give one answer.
    reason = "no CUDA device is visible" if not torch.cuda.is_available() else runtime_reason()
    if reason is None:
        return (
            "fused pipeline (forward and backward) for bf16/fp16 FFN and gated FFN experts, if the "
            "expert-parallel group lies inside one node; each layer logs once what it runs and why"
        )
    if section.overlap == "fused":
        return f'error: "overlap": "fused" was asked for, but {reason}'
    return f"reference pipeline: {reason}"


def fp8_verdict(config) -> str | None:
    """Where an enabled ``"fp8"`` recipe would run here, from the config and this machine alone (each
    layer decides from its experts, sizes and group when it first runs, and logs it); None without one."""
    from ds_comet.config import moe_config_from

    section = moe_config_from(config)
    recipe = section.fp8
    if section.backend == "deepspeed" or not recipe.enabled:
        return None
    what = (  # the GEMMs in FP8 as the layers' own log line names them, then what crosses the exchange
        f"{recipe.described()}; rows crossing in {recipe.dispatch}, output gradients in {recipe.gradient_dispatch}"
    )
    emulated = "emulated in float on the reference pipeline"
    if section.overlap == "none":
        return f'{what}: {emulated} ("overlap": "none")'
    if not torch.cuda.is_available():
        return f"{what}: {emulated} (no CUDA device is visible)"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"{what}: {emulated} (the fused FP8 GEMMs run on sm_90, this GPU is not)"
    if recipe.scaling == "rowwise":
        if "fp8" in (recipe.dispatch, recipe.gradient_dispatch):
            return (
                f"{what}: {emulated} (rowwise scaling runs fused with rows and output gradients crossing in bf16: "
                '"dispatch": "bf16", "gradient_dispatch": "bf16")'
            )
        return (
            f"{what}: fused, on the library's FP8 GEMMs, for layers alone in their group (EP=1) with AutoEP's "
            "stacked gated experts; emulated elsewhere (each layer logs which)"
        )
    return (
        f"{what}: fused, on the Triton FP8 GEMMs, for layers whose hidden and FFN sizes are multiples of 128; "
        "emulated elsewhere (each layer logs which)"
    )


def report(config=None) -> str:
    import deepspeed

    from ds_comet.kernels.jit_build import build_state
    from ds_comet.op_builder import CometBuilder

    lines = ["ds_comet report", "-" * 60]
    lines.append(
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), deepspeed {deepspeed.__version__}, "
        f"triton {_version('triton')}"
    )
    builder = CometBuilder()
    reason = builder.incompatibility()
    try:
        importlib.import_module(builder.absolute_name())
        built = "built ahead of time"
    except ImportError:
        built = "not built" if reason else f"JIT-built on first use: {build_state(builder.NAME)}"
    lines.append(f"op {builder.NAME}: {'compatible' if reason is None else 'NOT compatible: ' + reason}; {built}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    lines.append(f"GPUs: {count}")
    for index in range(count):
        props = torch.cuda.get_device_properties(index)
        lines.append(
            f"  [{index}] {props.name}, compute capability {props.major}.{props.minor}, "
            f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB"
        )
    if count > 1:
        lines.append("peer access (row: from, column: to):")
        for i in range(count):
            row = " ".join(
                "-" if i == j else ("y" if torch.cuda.can_device_access_peer(i, j) else "n") for j in range(count)
            )
            lines.append(f"  [{i}] {row}")
    lines.append(f"pipeline: {pipeline_verdict(config)}")
    fp8 = fp8_verdict(config)
    if fp8 is not None:
        lines.append(f"fp8: {fp8}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ds_comet report", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help='a ds_config JSON (default: {"moe": {"backend": "comet"}})')
    args = parser.parse_args(argv)
    try:
        print(report(args.config or {"moe": {"backend": "comet"}}))
    except ValueError as invalid:  # the config's own error names the key and the fix
        sys.exit(f"ds_comet report: {invalid}")
