"""The CUDA op's builder and sources, checked without a GPU."""

import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest
import torch
from deepspeed.ops.op_builder.all_ops import ALL_OPS
from deepspeed.ops.op_builder.builder import CUDAOpBuilder
from torch.utils.cpp_extension import include_paths

import ds_comet.op_builder as op_builder
from ds_comet.kernels import constants, layout
from ds_comet.op_builder import CometBuilder
from ds_comet.op_builder.comet import plain_arch_list
from ds_comet.report import report
from tests.support.op_calls import launch_keywords

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(os.path.dirname(TESTS_DIR), "csrc")
CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")
CUDA_INCLUDE, CUDA_LIB = os.path.join(CUDA_HOME, "include"), os.path.join(CUDA_HOME, "lib64")


def test_builder_names_absolute_existing_sources():
    builder = CometBuilder()
    assert builder.NAME not in ALL_OPS, "the op name must not clash with a DeepSpeed op"
    for path in builder.sources() + builder.include_paths():
        assert os.path.isabs(path) and os.path.exists(path), path


def test_builder_compiles_every_source_in_csrc():
    # A stage's kernels left out of the build leave launchers undefined: the op would build, then fail to load.
    sources = {os.path.basename(path) for path in CometBuilder().sources()}
    on_disk = {
        os.path.basename(path) for pattern in ("*.cu", "*.cpp") for path in glob.glob(os.path.join(CSRC, pattern))
    }
    assert sources == on_disk


def test_op_builder_package_does_not_claim_to_be_deepspeeds():
    # DeepSpeed's accelerator takes an importable op_builder with __deepspeed__ for its own.
    assert not hasattr(op_builder, "__deepspeed__")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without CUDA")
def test_incompatible_without_cuda_says_why():
    builder = CometBuilder()
    assert builder.is_compatible() is False
    assert "without CUDA" in builder.error_log or "no CUDA device" in builder.error_log
    with pytest.raises(RuntimeError, match="not being compatible"):
        builder.jit_load(verbose=False)


@pytest.mark.parametrize(
    "given,expected",
    [("9.0a", "9.0"), ("9.0a;8.0 10.0f+PTX", "9.0;8.0;10.0+PTX"), ("8.0 8.0", "8.0"), ("9.0+PTX", "9.0+PTX")],
)
def test_plain_arch_list(given, expected):
    assert plain_arch_list(given) == expected


def test_filter_keeps_ampere_and_newer():
    assert CometBuilder().filter_ccs(["7.0", "8.0", "9.0+PTX"]) == [["8", "0"], ["9", "0+PTX"]]


CUDA_SOURCES = sorted(glob.glob(os.path.join(CSRC, "*.cu")))
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


@pytest.fixture(scope="module")
def kernel_objects(tmp_path_factory):
    """Each .cu file compiled for sm_90a: {source: (nvcc's result, object path)}."""
    built = {}
    for source in CUDA_SOURCES:
        obj = tmp_path_factory.mktemp("kernels") / (os.path.basename(source) + ".o")
        result = subprocess.run(
            [
                "nvcc",
                "-std=c++17",
                "-c",
                "-o",
                str(obj),
                "-Xcompiler",
                "-fPIC",
                "-gencode",
                "arch=compute_90a,code=sm_90a",
                "-I",
                CSRC,
                source,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        built[source] = (result, obj)
    return built


@needs_nvcc
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=os.path.basename)
def test_cuda_sources_compile_for_hopper(source, kernel_objects):
    # The .cu files include no torch headers, so a toolkit without cuBLAS or torch's CUDA headers
    # (CI's) still catches a build break.
    result, _ = kernel_objects[source]
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_gate_kernels_round_as_torch_under_the_builders_flags(monkeypatch, tmp_path):
    # DeepSpeed's CUDAOpBuilder adds --use_fast_math, under which logf is an approximation and
    # compares flush denormals to zero: the gate kernels would then round and order unlike torch.
    monkeypatch.setattr(CUDAOpBuilder, "nvcc_args", lambda self: ["-O3", "--use_fast_math", "-std=c++17"])
    args = [arg for arg in CometBuilder().nvcc_args() if arg]
    assert "--use_fast_math" not in args and "-O3" in args
    ptx = tmp_path / "gate_kernels.ptx"
    result = subprocess.run(
        ["nvcc", *args, "-ptx", "-arch=sm_90a", "-I", CSRC, "-o", str(ptx), os.path.join(CSRC, "gate_kernels.cu")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    text = ptx.read_text()
    assert "lg2.approx" not in text and ".ftz" not in text


needs_binding_toolchain = pytest.mark.skipif(
    shutil.which("g++") is None or not os.path.exists(os.path.join(CUDA_INCLUDE, "cuda_runtime.h")),
    reason="needs g++ and the CUDA runtime headers",
)


@pytest.fixture(scope="module")
def binding_object(tmp_path_factory):
    """comet_binding.cpp compiled against CPU torch's headers: (g++'s result, object path)."""
    # CPU torch has no CUDA headers: a stand-in for the one the binding includes (tests/stubs).
    includes = [
        os.path.join(TESTS_DIR, "stubs"),
        *include_paths(),
        sysconfig.get_paths()["include"],
        CUDA_INCLUDE,
        CSRC,
    ]
    binding = tmp_path_factory.mktemp("binding") / "binding.o"
    result = subprocess.run(
        [
            "g++",
            "-std=c++17",
            "-c",
            "-fPIC",
            "-O0",
            "-w",
            "-DTORCH_EXTENSION_NAME=ds_comet_ops",
            *[f"-I{path}" for path in includes],
            os.path.join(CSRC, "comet_binding.cpp"),
            "-o",
            str(binding),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return result, binding


@needs_binding_toolchain
@needs_nvcc
def test_torch_binding_compiles_and_links_to_the_kernels(kernel_objects, binding_object):
    result, binding = binding_object
    assert result.returncode == 0, result.stderr[-4000:]
    # Every launcher the binding calls must be defined, with the same signature, by the kernels: a
    # declaration in comet.h that drifts from its definition builds, and fails only when the op loads.
    assert all(compiled.returncode == 0 for compiled, _ in kernel_objects.values())

    def symbols(flag, *objects):
        listed = subprocess.run(["nm", flag, *map(str, objects)], capture_output=True, text=True, check=True).stdout
        return {line.split()[-1] for line in listed.splitlines() if line.split() and "_ZN8ds_comet" in line.split()[-1]}

    needed = symbols("--undefined-only", binding)
    assert needed, "the binding calls no ds_comet launcher"
    missing = needed - symbols("--defined-only", *(obj for _, obj in kernel_objects.values()))
    assert not missing, sorted(missing)


# Loads the op (it loads without a GPU) and prints, as JSON, the keywords of its Workspace and of the
# launches the fused pipeline calls.
BINDING_KEYWORDS = r"""
import json, re, sys
import torch
sys.path.insert(0, sys.argv[1])
import ds_comet_ops as op

def keywords(function):
    listed = re.fullmatch(r"\w+\((.*)\) -> .*", function.__doc__.splitlines()[0]).group(1)
    return sorted(set(re.findall(r"(\w+): ", listed)) - {"self"})

binding = {name: keywords(getattr(op, name)) for name in ("exchange", "dispatch", "combine")}
binding["Workspace"] = sorted(name for name in dir(op.Workspace) if isinstance(getattr(op.Workspace, name), property))
binding["Workspace.with_peer_recv"] = keywords(op.Workspace.with_peer_recv)
print(json.dumps(binding))
"""


@needs_binding_toolchain
@needs_nvcc
@pytest.mark.skipif(not os.path.exists(os.path.join(CUDA_LIB, "libcudart.so")), reason="needs the CUDA runtime")
def test_the_fused_pipeline_passes_the_bindings_keywords(kernel_objects, binding_object, tmp_path):
    """The op loads without a GPU (its launches need one): the keywords its Workspace and launches
    take must be the ones the fused pipeline passes them, every one and no other."""
    assert binding_object[0].returncode == 0 and all(result.returncode == 0 for result, _ in kernel_objects.values())
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    objects = [str(binding_object[1]), *(str(obj) for _, obj in kernel_objects.values())]
    linked = subprocess.run(
        ["g++", "-shared", "-o", str(tmp_path / "ds_comet_ops.so"), *objects, f"-L{torch_lib}", f"-L{CUDA_LIB}"]
        + ["-ltorch", "-ltorch_cpu", "-lc10", "-ltorch_python", "-lcudart"]
        + [f"-Wl,-rpath,{torch_lib}", f"-Wl,-rpath,{CUDA_LIB}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert linked.returncode == 0, linked.stderr[-4000:]
    listed = subprocess.run(
        [sys.executable, "-c", BINDING_KEYWORDS, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert listed.returncode == 0, listed.stderr[-4000:]
    binding = {function: set(keywords) for function, keywords in json.loads(listed.stdout.splitlines()[-1]).items()}
    assert launch_keywords() == binding


def test_constants_match_the_compiled_header(tmp_path):
    # Python reads csrc/comet.h's DS_COMET_CONSTANTS lines; compiled, the same list must give the same
    # values (the binding's codes() exports them with this very macro, checked again at load).
    source = tmp_path / "constants.cpp"
    source.write_text(
        '#include <cstdio>\n#include "comet.h"\n'
        '#define PRINT(name, value) std::printf("%s %lld\\n", #name, (long long)ds_comet::k##name);\n'
        "int main() { DS_COMET_CONSTANTS(PRINT) return 0; }\n"
    )
    binary = tmp_path / "constants"
    built = subprocess.run(
        ["g++", "-std=c++17", f"-I{CSRC}", f"-I{CUDA_INCLUDE}", str(source), "-o", str(binary)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    printed = subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout.split("\n")
    compiled = {name: int(value) for name, value in (line.split() for line in printed if line)}
    assert compiled == constants.CONSTANTS
    assert (constants.TOTAL_ERROR_CLAIM, constants.WAIT_DISPATCH_TILE, constants.MAX_COMBINE_TOP_K) == (
        compiled["TotalErrorClaim"],
        compiled["WaitDispatchTile"],
        compiled["MaxCombineTopK"],
    )


def test_layout_parts_do_not_overlap():
    offsets = layout.layout_offsets(num_local=3, num_experts=6)
    starts = sorted((v, k) for k, v in vars(offsets).items() if k != "total")
    assert starts[0][0] == 0 and offsets.total > starts[-1][0]
    assert offsets.stage_dest_row - offsets.stage_send == 2 and offsets.totals - offsets.stage_recv_piece == 3
    meta = layout.meta_offsets(ep_size=2, num_experts=6, max_tiles=10, max_chunks=4, max_stage_pieces=5)
    assert meta.exchange_flag - meta.counts == 2 * 2 * (6 + 2) and meta.chunk_counter - meta.tile_counter == 10
    # The exchange zeroes the four arrival counters as one run: max_tiles + 2 max_chunks + max_stage_pieces words.
    assert (meta.stage_counter - meta.chunk_counter, meta.reduce_counter - meta.stage_counter) == (4, 5)
    assert meta.generation - meta.tile_counter == 10 + 2 * 4 + 5
    # Each call parity and source: its exchange header, after the owner's generation word.
    assert (meta.header - meta.generation, meta.total - meta.header) == (1, 2 * 2 * constants.HEADER_WORDS)


def test_report_runs_and_names_the_pipeline():
    text = report({"moe": {"backend": "comet"}})
    assert "op ds_comet_ops" in text and "pipeline:" in text
    if not torch.cuda.is_available():
        assert "reference pipeline" in text


@pytest.mark.parametrize(
    "recipe, capability, words",
    [
        (None, None, None),
        (
            {"enabled": True},
            None,
            "blockwise: forward, input gradients; rows crossing in fp8, output gradients in bf16: emulated",
        ),
        (
            {"enabled": True, "scaling": "rowwise", "weight_gradients": True, "gemm2": False, "dispatch": "bf16"},
            None,
            "rowwise: forward, input gradients, weight gradients, GEMM2 in high precision; rows crossing in bf16",
        ),
        ({"enabled": True}, (8, 0), "(the fused FP8 GEMMs run on sm_90, this GPU is not)"),
        ({"enabled": True}, (9, 0), "fused, on the Triton FP8 GEMMs, for layers whose hidden and FFN sizes are"),
        ({"enabled": True, "scaling": "rowwise"}, (9, 0), 'crossing in bf16: "dispatch": "bf16", "gradient_dispatch"'),
        ({"enabled": True, "scaling": "rowwise", "dispatch": "bf16"}, (9, 0), "fused, on the library's FP8 GEMMs"),
    ],
    ids=["off", "cpu", "cpu-gemms", "sm80", "blockwise", "rowwise-fp8-rows", "rowwise"],
)
def test_report_says_where_an_fp8_recipe_would_run(monkeypatch, recipe, capability, words):
    """Without a recipe no line; on CPU (or another GPU) emulated, with why; on sm_90 fused where the
    layers meet each path's needs, naming a rowwise config that could never run fused."""
    import ds_comet.report as report_module

    if capability is not None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    else:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = {"moe": {"backend": "comet", **({"fp8": recipe} if recipe else {})}}
    verdict = report_module.fp8_verdict(config)
    assert verdict is None if words is None else words in verdict, verdict


def test_report_names_a_config_error_in_one_line(tmp_path, capsys):
    import ds_comet.report as report_module

    path = tmp_path / "bad.json"
    path.write_text('{"moe": {"backend": "comet", "fp8": {"scalling": "rowwise"}}}')
    with pytest.raises(SystemExit) as raised:
        report_module.main(["--config", str(path)])
    assert "did you mean 'scaling'?" in str(raised.value) and "\n" not in str(raised.value).strip(), raised.value


def test_report_verdict_where_the_fused_pipeline_can_run(monkeypatch):
    """The verdict on a machine where everything is there (faked here): the fused pipeline, which
    runs training steps too since its backward landed, and an error only under "fused"."""
    pytest.importorskip("triton")
    import ds_comet.kernels.ops
    import ds_comet.report as report_module

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ds_comet.kernels.ops, "op_unavailable_reason", lambda: None)
    verdict = report_module.pipeline_verdict({"moe": {"backend": "comet"}})
    assert verdict.startswith("fused pipeline (forward and backward)"), verdict
    assert "reference pipeline" not in verdict
    assert report_module.pipeline_verdict({"moe": {"backend": "comet", "overlap": "none"}}).startswith("reference")
    monkeypatch.setattr(ds_comet.kernels.ops, "op_unavailable_reason", lambda: "nvcc not found")
    assert report_module.pipeline_verdict({"moe": {"backend": "comet", "overlap": "fused"}}) == (
        'error: "overlap": "fused" was asked for, but nvcc not found'
    )


def test_report_verdict_names_a_triton_too_old_as_the_layers_do(monkeypatch):
    """A Triton without tensor descriptors (older than 3.4): the report gives the reason each layer
    logs, not "fused pipeline"."""
    triton = pytest.importorskip("triton")
    import ds_comet.kernels.ops
    import ds_comet.report as report_module

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ds_comet.kernels.ops, "op_unavailable_reason", lambda: None)
    monkeypatch.delattr(triton.language, "make_tensor_descriptor")
    verdict = report_module.pipeline_verdict({"moe": {"backend": "comet"}})
    assert verdict.startswith("reference pipeline: triton") and "older than 3.4" in verdict, verdict


def test_a_jit_build_says_why_it_compiles(tmp_path):
    """Not built, or built before a source changed (a pull, an edit): the build is announced with
    the reason, since it takes a minute; built after every source: it only loads, silently."""
    from ds_comet.kernels.ops import build_needed

    library, header, kernels = tmp_path / "op.so", tmp_path / "comet.h", tmp_path / "dispatch_kernels.cu"
    header.write_text("")
    kernels.write_text("")
    sources = [str(header), str(kernels)]
    assert build_needed(str(library), sources) == "not built yet"
    library.write_text("")
    os.utime(header, (1000, 1000))
    os.utime(kernels, (1000, 1000))
    os.utime(library, (2000, 2000))
    assert build_needed(str(library), sources) is None
    os.utime(header, (3000, 3000))
    assert build_needed(str(library), sources) == "its sources changed since the last build: comet.h"
