"""The FP8 GEMM kernels in Triton's interpreter, against ``ds_comet/fp8.py`` and the reference
pipeline's emulation of the recipe (tests/support/fp8_gemm_cases.py has the cases and the bound).

Triton's interpreter computes each 128-deep FP8 product in fp32 (NumPy), so the bound's tensor-core
term is zero here; tests/gpu/test_fp8.py runs the same cases on the GPU. Each case runs in a child
process with TRITON_INTERPRET=1 (set before Triton is imported). Skipped where triton is not installed.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRELUDE = r"""
import sys, torch
import triton.runtime.interpreter as interpreter

# Triton 3.6's interpreter turns a loaded scalar into a Python int with int(array), which NumPy 2
# refuses for 1-element arrays; give it the element instead.
_patch_tensor = interpreter._patch_lang_tensor
def _patch_lang_tensor(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
interpreter._patch_lang_tensor = _patch_lang_tensor
sys.path.insert(0, sys.argv[1])
from tests.support import fp8_gemm_cases as cases
cpu = torch.device("cpu")
"""


def interpret(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", PRELUDE + code, REPO],
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout


def test_the_kernels_quantise_rows_as_fp8_py_does_bit_for_bit():
    """Every scale and every quantised value of both formats, on random tiles spread over 2**±40 and
    on the definition's corner cases (ties, a tile at its scale's limit, zeros, bf16 subnormals,
    infinities and NaNs): the explicit rounding makes the interpreter's truncating cast exact."""
    out = interpret("print('tiles', cases.quantisation_case(cpu, seed=1))")
    assert "tiles " in out


def test_the_rowwise_quantisation_kernel_is_fp8_pys_quantise_rows_bit_for_bit():
    """The rowwise recipe's rows for the library's FP8 GEMMs, one scale a row, in both formats: over
    several passes of the kernel along a row, a strided input, and the definition's corner cases."""
    out = interpret("print('rows', cases.rowwise_quantisation_case(cpu, seed=6))")
    assert "rows " in out


def test_the_rowwise_weight_copies_are_fp8_pys_bit_for_bit():
    """The rowwise copies of the experts' weights as the fused path makes them on a GPU (read where they
    lie, per row or per column written transposed, W1 and W3 together), against ``fp8.py``."""
    out = interpret("print('scales', cases.rowwise_weights_case(cpu))")
    assert "scales " in out


def test_the_weight_gradients_operands_are_fp8_pys_columns_of_each_expert_bit_for_bit():
    """FP8 weight gradients' operands, per column over each expert's rows, transposed and padded to
    whole 16s of rows for the library's grouped product, against ``fp8.quantise_columns``."""
    out = interpret("print('scales', cases.expert_columns_case(cpu, seed=8))")
    assert "scales " in out


def test_the_row_count_after_a_library_gemm2_is_what_the_combine_waits_for():
    """library_fp8's GEMM2 counts no rows; one kernel after it must give each column chunk's counter
    the received rows times the chunk's column tiles, as the Triton GEMM2's tiles would add them."""
    out = interpret("print('chunks', cases.row_count_case(cpu))")
    assert "chunks " in out


def test_the_dispatched_fp8_rows_are_fp8_pys_and_dequantise_to_the_emulations_bit_for_bit():
    """The packed rows the exchange sends in either format (e4m3 tokens, e5m2 gradients): values and
    scales as ``fp8.quantise_tiles``'s, and dequantised as the emulation's exchange holds them, on the
    corner cases too."""
    out = interpret("print('tiles', cases.packed_rows_case(cpu, seed=4))")
    assert "tiles " in out


@pytest.mark.parametrize(
    "gated, gradient_format, tiles",
    [
        (True, "e4m3", (16, 32, 32, 16)),
        (False, "e5m2", (32, 16, 64, 16)),  # GEMM2's tile in two row parts
    ],
    ids=["swiglu-e4m3", "gelu-bias-e5m2"],
)
def test_each_fp8_gemm_gives_the_emulations_numbers(gated, gradient_format, tiles):
    """GEMM1 and GEMM2, forward and backward, on skewed row counts (an expert without rows, odd
    counts) against the emulation within float32's summation-order noise and one bf16 rounding; the
    forward GEMM1 also on the rows packed in FP8 as ``"dispatch": "fp8"`` delivers them, equal to its
    outputs on the bf16 rows bit for bit; the backward GEMM1 also on output gradients packed in the
    gradient format with each route's gate folded into their scales, against the gate times the
    emulation's product."""
    out = interpret(f"print(cases.GemmCase(cpu, {gated}, {gradient_format!r}, seed=2, tiles={tiles}).run())")
    assert "\nok gated=" in out, out
