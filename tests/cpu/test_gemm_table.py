"""The GEMM table's choice of an implementation for each phase, the reasons it gives for those it
skips, the launch code's use of it, and the kernels package's imports, without a GPU."""

import ast
import itertools
import pathlib
from types import SimpleNamespace

import pytest
import torch

import ds_comet.kernels as kernels_package
from ds_comet.kernels import gemm_table
from ds_comet.kernels.gemm_phases import Fp8Facts, GemmFacts, GemmImplementation, Needs, Phase
from ds_comet.kernels.launch import FusedKernels

BF16, FP16 = torch.bfloat16, torch.float16
FIRST_LAYER_PHASES = (Phase.FIRST_LAYER, Phase.FIRST_LAYER_BACKWARD)


FORWARD = frozenset({Phase.FIRST_LAYER, Phase.GEMM2})
INPUT_GRADIENTS = frozenset({Phase.FIRST_LAYER_BACKWARD, Phase.GEMM2_BACKWARD})


def facts(dtype=BF16, capability=(9, 0), alone=True, gated=True, stacked=True, fp8=None) -> GemmFacts:
    return GemmFacts(dtype, dtype, capability, alone, gated, stacked, fp8)


def recipe(phases=FORWARD | INPUT_GRADIENTS, scaling="blockwise", hidden=256, ffn=384) -> Fp8Facts:
    return Fp8Facts(phases, scaling, "e4m3", hidden, ffn)


def chosen(call_facts: GemmFacts) -> dict[Phase, str]:
    return {phase: gemm_table.choose(phase, call_facts).name for phase in Phase}


def expected(first_layer: str, weight_gradients: str) -> dict[Phase, str]:
    return {
        Phase.FIRST_LAYER: first_layer,
        Phase.GEMM2: "triton",
        Phase.FIRST_LAYER_BACKWARD: first_layer,
        Phase.GEMM2_BACKWARD: "triton",
        Phase.WEIGHT_GRADIENTS: weight_gradients,
    }


@pytest.mark.parametrize(
    "call_facts, want",
    [
        (facts(), expected("library", "library")),  # bf16 on sm_90, alone, stacked gated experts
        (facts(dtype=FP16), expected("triton", "triton")),
        (facts(capability=(8, 0)), expected("triton", "triton")),
        (facts(capability=(10, 0)), expected("triton", "triton")),
        (facts(alone=False), expected("triton", "library")),  # EP > 1: GEMM1's tiles wait for the dispatch
        (facts(stacked=False), expected("triton", "library")),  # one module per expert
        (facts(alone=False, stacked=False, gated=False), expected("triton", "library")),
    ],
    ids=["bf16-sm90-alone-stacked", "fp16", "sm80", "sm100", "ep2", "modules", "ep2-modules-ungated"],
)
def test_the_table_gives_each_phase_todays_implementation(call_facts, want):
    assert chosen(call_facts) == want


def test_the_table_keeps_todays_rule_on_every_combination_of_facts():
    """The choices the launch code made before the table (its two flags), over every combination."""
    for dtype, capability, alone, gated, stacked in itertools.product(
        (BF16, FP16), ((8, 0), (9, 0), (10, 0)), (False, True), (False, True), (False, True)
    ):
        library_wgrad = dtype == BF16 and hasattr(torch, "_grouped_mm") and capability == (9, 0)
        library_first_layer = alone and gated and library_wgrad and stacked
        got = chosen(facts(dtype, capability, alone, gated, stacked))
        assert got == expected(
            "library" if library_first_layer else "triton", "library" if library_wgrad else "triton"
        ), (dtype, capability, alone, gated, stacked)


def test_an_implementation_that_refuses_the_dtype_is_skipped_with_its_reason():
    call_facts = facts(dtype=FP16)
    reasons = gemm_table.refusals(Phase.WEIGHT_GRADIENTS, call_facts)
    assert reasons == {
        "triton_fp8": "does not run the weight gradients",
        "library_fp8": "runs only phases an FP8 recipe puts in FP8",
        "library": "takes bfloat16 rows with bfloat16 weights, not float16 rows with float16 weights",
        "triton": None,
    }
    assert gemm_table.choose(Phase.WEIGHT_GRADIENTS, call_facts).name == "triton"


def test_each_refusal_names_the_need_that_is_not_met():
    reasons = {
        "capability": gemm_table.refusals(Phase.FIRST_LAYER, facts(capability=(8, 0)))["library"],
        "alone": gemm_table.refusals(Phase.FIRST_LAYER, facts(alone=False))["library"],
        "stacked": gemm_table.refusals(Phase.FIRST_LAYER, facts(stacked=False))["library"],
        "gated": gemm_table.refusals(Phase.FIRST_LAYER_BACKWARD, facts(gated=False))["library"],
        "phase": gemm_table.refusals(Phase.GEMM2, facts())["library"],
    }
    assert reasons == {
        "capability": "runs on sm_90, not sm_80",
        "alone": "needs a rank alone in its group (here a tile may wait for a dispatch)",
        "stacked": "needs stacked expert weights (here one module per expert)",
        "gated": "needs gated experts",
        "phase": "does not run the forward GEMM2",
    }


def test_a_torch_without_the_grouped_gemm_leaves_every_phase_to_triton(monkeypatch):
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    assert chosen(facts()) == expected("triton", "triton")
    assert gemm_table.refusals(Phase.WEIGHT_GRADIENTS, facts())["library"].startswith("needs torch._grouped_mm")


@pytest.mark.parametrize(
    "call_facts, want",
    [
        # Every phase the recipe puts in FP8 is triton_fp8's, the library's first layer included.
        (facts(fp8=recipe()), {**expected("triton_fp8", "library"), Phase.GEMM2: "triton_fp8",
                               Phase.GEMM2_BACKWARD: "triton_fp8"}),
        (facts(alone=False, stacked=False, gated=False, fp8=recipe()),
         {**expected("triton_fp8", "library"), Phase.GEMM2: "triton_fp8", Phase.GEMM2_BACKWARD: "triton_fp8"}),
        # The phases it leaves out keep today's choice.
        (facts(fp8=recipe(FORWARD)), {**expected("library", "library"), Phase.FIRST_LAYER: "triton_fp8",
                                      Phase.GEMM2: "triton_fp8"}),
        (facts(fp8=recipe(INPUT_GRADIENTS)), {**expected("library", "library"),
                                              Phase.FIRST_LAYER_BACKWARD: "triton_fp8",
                                              Phase.GEMM2_BACKWARD: "triton_fp8"}),
    ],
    ids=["all", "ep2-modules-ungated", "forward", "input-gradients"],
)  # fmt: skip
def test_the_phases_an_fp8_recipe_puts_in_fp8_run_on_triton_fp8(call_facts, want):
    assert chosen(call_facts) == want
    assert gemm_table.fp8_refusal(call_facts) is None


@pytest.mark.parametrize(
    "call_facts, why",
    [
        (facts(alone=False, fp8=recipe(scaling="rowwise")), "runs blockwise FP8 scaling, not rowwise; library_fp8 "
                                                             "needs a rank alone in its group"),
        (facts(capability=(8, 9), fp8=recipe()), "runs on sm_90, not sm_89"),
        (facts(capability=(10, 0), fp8=recipe()), "runs on sm_90, not sm_100"),
        (facts(dtype=FP16, fp8=recipe()), "takes bfloat16 rows with bfloat16 weights, not float16 rows"),
        (facts(fp8=recipe(hidden=200)), "needs hidden and FFN sizes that are multiples of 128 (blockwise scaling's "
                                        "tiles), not 200 and 384"),
    ],
    ids=["rowwise-ep2", "sm89", "sm100", "fp16", "hidden"],
)  # fmt: skip
def test_an_fp8_phase_no_fp8_gemm_runs_is_refused_with_the_fp8_implementations_reason(call_facts, why):
    """Never silently in bf16: a phase the recipe puts in FP8 has no implementation where triton_fp8
    refuses it, and fp8_refusal names the first such phase with triton_fp8's reason."""
    phase = Phase.FIRST_LAYER
    assert gemm_table.refusals(phase, call_facts)["library"] == (
        "does not compute in FP8, which the layer's recipe asks for here"
    )
    assert gemm_table.refusals(phase, call_facts)["triton"] == (
        "does not compute in FP8, which the layer's recipe asks for here"
    )
    with pytest.raises(RuntimeError, match="no GEMM implementation runs the forward first layer"):
        gemm_table.choose(phase, call_facts)
    refusal = gemm_table.fp8_refusal(call_facts)
    assert refusal.startswith("the fused pipeline has no FP8 GEMM for its forward first layer here (triton_fp8 ")
    assert why in refusal, refusal


def test_without_an_fp8_recipe_triton_fp8_runs_nothing():
    reasons = {phase: gemm_table.refusals(phase, facts())["triton_fp8"] for phase in Phase}
    assert reasons == {
        **{phase: "runs only phases an FP8 recipe puts in FP8" for phase in FORWARD | INPUT_GRADIENTS},
        Phase.WEIGHT_GRADIENTS: "does not run the weight gradients",
    }
    assert gemm_table.fp8_refusal(facts()) is None


class Float8Rows(GemmImplementation):
    """A registration that takes rows and weights the fused path does not have today."""

    name = "float8"
    needs = {phase: Needs(dtypes=((torch.float8_e4m3fn, torch.float8_e4m3fn),)) for phase in Phase}


def test_a_registered_implementation_is_chosen_only_where_it_admits_the_call(monkeypatch):
    monkeypatch.setattr(gemm_table, "IMPLEMENTATIONS", (Float8Rows(), *gemm_table.IMPLEMENTATIONS))
    assert chosen(facts()) == expected("library", "library")
    assert gemm_table.refusals(Phase.GEMM2, facts(dtype=FP16))["float8"] == (
        "takes float8_e4m3fn rows with float8_e4m3fn weights, not float16 rows with float16 weights"
    )
    assert chosen(facts(dtype=torch.float8_e4m3fn)) == {phase: "float8" for phase in Phase}


def test_a_call_no_implementation_admits_raises_with_every_reason():
    with pytest.raises(RuntimeError) as raised:
        gemm_table.choose(Phase.GEMM2, facts(dtype=torch.float32))
    assert str(raised.value) == (
        "ds_comet: no GEMM implementation runs the forward GEMM2 of this call: triton_fp8 runs only phases an FP8 "
        "recipe puts in FP8; library_fp8 runs only phases an FP8 recipe puts in FP8; library does not run the forward "
        "GEMM2; triton takes bfloat16 rows with bfloat16 weights or float16 rows with float16 weights, not float32 "
        "rows with float32 weights"
    )


class Recording(GemmImplementation):
    """Runs every phase for every call, recording what the launch code hands it."""

    name = "recording"
    needs = {phase: Needs(dtypes=((BF16, BF16), (FP16, FP16))) for phase in Phase}

    def __init__(self):
        self.calls = []

    def stored_dtype(self, phase, facts):
        return torch.float32

    def first_layer(self, call, rows, h, keep_pre):
        self.calls.append(("first_layer", keep_pre))
        return "products"

    def first_layer_backward(self, call, rows, grad_pre, pre, want_act):
        self.calls.append(("first_layer_backward", pre))

    def gemm2(self, call, rows, out):
        self.calls.append(("gemm2",))

    def gemm2_backward(self, call, rows, out):
        self.calls.append(("gemm2_backward",))

    def weight_gradients(self, call, a, b):
        self.calls.append(("weight_gradients",))
        return "weights"


def kernels_for(dtype=BF16, capability=(9, 0), ep_size=1, stacked=True, fp8=None) -> FusedKernels:
    """FusedKernels whose workspace and experts answer only what the GEMM table reads (and GEMM2's
    output check): any launch would fail."""
    buffer = SimpleNamespace(shape=SimpleNamespace(dtype=dtype, ep_size=ep_size), capability=capability)
    weights = (torch.empty(0),) * 3 if stacked else None
    experts = SimpleNamespace(
        gated=True, has_bias=False, weight_dtype=lambda: dtype, stacked=lambda: weights, num_local=2, ffn=4
    )
    return FusedKernels(buffer=buffer, experts=experts, params=None, tables={}, hidden=8, fp8=fp8)


def test_the_launch_code_reads_the_layers_fp8_recipe_into_the_facts():
    kernels = kernels_for(fp8=recipe(FORWARD))
    assert kernels.facts == facts(fp8=recipe(FORWARD))
    assert [kernels.implementation(phase).name for phase in Phase] == [
        "triton_fp8",
        "triton_fp8",
        "library",
        "triton",
        "library",
    ]


@pytest.mark.parametrize(
    "ep_size, stacked, first_layer", [(1, True, "library"), (2, True, "triton"), (1, False, "triton")]
)
def test_the_launch_code_reads_the_calls_facts_and_asks_the_table(ep_size, stacked, first_layer):
    kernels = kernels_for(ep_size=ep_size, stacked=stacked)
    assert kernels.facts == facts(alone=ep_size == 1, stacked=stacked)
    assert kernels.implementation(Phase.FIRST_LAYER).name == first_layer
    assert kernels.implementation(Phase.WEIGHT_GRADIENTS).name == "library"
    assert kernels.stored_dtype(Phase.FIRST_LAYER) == BF16
    assert kernels_for(dtype=FP16).stored_dtype(Phase.GEMM2) == FP16


def test_every_gemm_phase_of_the_launch_code_runs_on_the_chosen_implementation(monkeypatch):
    recording = Recording()
    monkeypatch.setattr(gemm_table, "IMPLEMENTATIONS", (recording, *gemm_table.IMPLEMENTATIONS))
    kernels = kernels_for()
    rows = torch.empty(3, 8)
    assert kernels.first_layer(rows, torch.empty(3, 4), keep_pre=True) == "products"
    kernels.gemm2(torch.empty(3, 4), torch.empty(3, 8), backward=False)
    kernels.first_layer_backward(rows, torch.empty(3, 8), "products", want_act=False)
    kernels.gemm2(torch.empty(3, 8), torch.empty(3, 8), backward=True)
    assert kernels.wgrad(rows, torch.empty(3, 4)) == ("weights", None)  # no biases: no column sums
    assert recording.calls == [
        ("first_layer", True),
        ("gemm2",),
        ("first_layer_backward", "products"),
        ("gemm2_backward",),
        ("weight_gradients",),
    ]
    assert kernels.stored_dtype(Phase.FIRST_LAYER) == torch.float32


def imported_modules(path: pathlib.Path, package: str) -> set[str]:
    """Every module ``path`` imports (type-checking imports too), relative ones resolved against
    ``package``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.update([module] if node.module else [f"{module}.{alias.name}" for alias in node.names])
    return names


def test_the_kernels_package_imports_nothing_from_the_layers_above_it():
    root = pathlib.Path(kernels_package.__file__).parent
    files = sorted(root.glob("*.py"))
    assert len(files) > 10
    above = ("ds_comet.pipelines", "ds_comet.integrations")
    offending = {
        path.name: sorted(name for name in imported_modules(path, "ds_comet.kernels") if name.startswith(above))
        for path in files
    }
    assert {name: found for name, found in offending.items() if found} == {}


def test_the_import_check_sees_relative_and_absolute_imports(tmp_path):
    source = tmp_path / "module.py"
    source.write_text(
        "from ..pipelines.fused import FusedPipeline\nfrom . import layout\nimport ds_comet.integrations.legacy\n"
        "from .. import pipelines\n"
    )
    assert imported_modules(source, "ds_comet.kernels") == {
        "ds_comet.pipelines.fused",
        "ds_comet.kernels.layout",
        "ds_comet.integrations.legacy",
        "ds_comet.pipelines",
    }
