"""The elementwise activation kernels (the library's first layer and every backward use them)
against torch in fp32, and the fused layer with the first layer on the library's grouped GEMM
(alone in the group, stacked bf16 experts, sm_90) against the same layer on the Triton GEMM1
(skipped without CUDA, Triton or transformers)."""

import pytest
import torch
import torch.nn.functional as F

from tests.support.moe_helpers import rel

ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
BF16_REL = 1e-2  # a few bf16 roundings of the same fp32 values


def _cuda_and_triton():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_gated_activation_kernels_match_torch_and_stop_at_the_received_rows(activation, packed):
    """z and u as two [R, F] tensors (the library's products) or as the halves of one [R, 2F]
    (the Triton GEMM1's saved products)."""
    _cuda_and_triton()
    from ds_comet.kernels.triton_activation import activation_backward_kernel, activation_kernel
    from ds_comet.kernels.triton_gemm import ACTIVATION_CODES

    seed = torch.randint(1, 10**6, ()).item()
    torch.manual_seed(seed)
    rows, received, ffn = 301, 259, 392  # odd sizes; rows past `received` are not this call's
    z, u, g = ((3 * torch.randn(rows, ffn, device="cuda")).to(torch.bfloat16) for _ in range(3))
    pre = torch.cat([z, u], 1)
    zu = (pre, pre[:, ffn:], 2 * ffn) if packed else (z, u, ffn)  # z, u and their row stride
    total = torch.tensor([received], dtype=torch.int32, device="cuda")
    h, h_again, h_unasked = (torch.full((rows, ffn), 7.0, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    grad_pre, grad_pre_again = (torch.full((rows, 2 * ffn), 7.0, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    grid, blocks = (-(-rows // 32), -(-ffn // 128)), dict(BM=32, BN=128)
    code = ACTIVATION_CODES[activation]
    activation_kernel[grid](*zu, h, total, ffn, ACTIVATION=code, GATED=True, **blocks)
    activation_backward_kernel[grid](
        g, *zu, grad_pre, h_again, total, ffn, ACTIVATION=code, GATED=True, STORE_ACT=True, **blocks
    )
    activation_backward_kernel[grid](
        g, *zu, grad_pre_again, h_unasked, total, ffn, ACTIVATION=code, GATED=True, STORE_ACT=False, **blocks
    )

    zf, uf = z.float().requires_grad_(), u.float().requires_grad_()
    want = ACTIVATIONS[activation](zf) * uf
    dz, du = torch.autograd.grad(want, [zf, uf], g.float())
    n = received
    assert rel(h[:n], want[:n].detach()) < BF16_REL, seed
    assert torch.equal(h_again, h), seed
    assert rel(grad_pre[:n, :ffn], dz[:n]) < BF16_REL and rel(grad_pre[:n, ffn:], du[:n]) < BF16_REL, seed
    assert (h[n:] == 7).all() and (grad_pre[n:] == 7).all(), seed
    assert torch.equal(grad_pre_again, grad_pre) and (h_unasked == 7).all(), seed


@pytest.mark.parametrize("activation", ["gelu", "relu", "silu"])
def test_activation_backward_kernel_without_gate_matches_torch(activation):
    """A GELU, ReLU or SiLU expert's forward, act(z), and backward: dz = g act'(z) and act(z)
    again, from GEMM1's [R, F] products, only on the received rows; without STORE_ACT the same dz
    and no activations."""
    _cuda_and_triton()
    from ds_comet.kernels.triton_activation import activation_backward_kernel, activation_kernel
    from ds_comet.kernels.triton_gemm import ACTIVATION_CODES

    seed = torch.randint(1, 10**6, ()).item()
    torch.manual_seed(seed)
    rows, received, ffn = 301, 259, 392
    z, g = ((3 * torch.randn(rows, ffn, device="cuda")).to(torch.bfloat16) for _ in range(2))
    total = torch.tensor([received], dtype=torch.int32, device="cuda")
    grad_pre, h, grad_pre_again, h_unasked, h_forward = (
        torch.full((rows, ffn), 7.0, dtype=torch.bfloat16, device="cuda") for _ in range(5)
    )
    grid, code = (-(-rows // 32), -(-ffn // 128)), ACTIVATION_CODES[activation]
    activation_kernel[grid](z, z, ffn, h_forward, total, ffn, ACTIVATION=code, GATED=False, BM=32, BN=128)
    activation_backward_kernel[grid](
        g, z, z, ffn, grad_pre, h, total, ffn, ACTIVATION=code, GATED=False, STORE_ACT=True, BM=32, BN=128
    )
    activation_backward_kernel[grid](
        g,
        z,
        z,
        ffn,
        grad_pre_again,
        h_unasked,
        total,
        ffn,
        ACTIVATION=code,
        GATED=False,
        STORE_ACT=False,
        BM=32,
        BN=128,
    )

    zf = z.float().requires_grad_()
    want = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}[activation](zf)
    (dz,) = torch.autograd.grad(want, [zf], g.float())
    n = received
    assert rel(h[:n], want[:n].detach()) < BF16_REL and torch.equal(h_forward, h), seed
    assert rel(grad_pre[:n], dz[:n]) < BF16_REL, seed
    assert (h[n:] == 7).all() and (grad_pre[n:] == 7).all(), seed
    assert torch.equal(grad_pre_again, grad_pre) and (h_unasked == 7).all(), seed


def library_against_triton_case(seed: int):
    """One forward and backward of an AutoEP block on ds_comet at EP=1 (every rank its own group)
    with the library's first layer, and again with the Triton GEMM1 (same weights and tokens): how
    far apart the output, input and parameter gradients are, and how often the library's products
    ran."""
    from ds_comet.bench.autoep import autoep_layer
    from ds_comet.kernels.gemm_phases import Phase
    from ds_comet.kernels.library_phases import LibraryGemm

    device = torch.device("cuda", torch.cuda.current_device())
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.randn(1, 333, 256, generator=generator, device=device).to(torch.bfloat16)
    grad_out = torch.randn(1, 333, 256, generator=generator, device=device).to(torch.bfloat16)
    library_calls = []
    products, needs = LibraryGemm.products, LibraryGemm.needs

    def counted(self, call, rows, *names):
        library_calls.append(names)
        return products(self, call, rows, *names)

    results = {}
    for library in (True, False):
        layer = autoep_layer(
            "mixtral", 256, 384, 8, 2, 1, device, torch.bfloat16, seed, {"backend": "comet", "overlap": "fused"}
        ).train()
        x = tokens.clone().requires_grad_()
        LibraryGemm.products = counted
        if not library:  # the first layer on the Triton GEMM1; the weight gradients stay the library's
            LibraryGemm.needs = {Phase.WEIGHT_GRADIENTS: needs[Phase.WEIGHT_GRADIENTS]}
        try:
            out = layer(x)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(grad_out)
        finally:
            LibraryGemm.products, LibraryGemm.needs = products, needs
        results[library] = {"out": out.detach(), "x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    errors = {name: rel(results[True][name], value) for name, value in results[False].items() if value is not None}
    return errors, len(library_calls), torch.cuda.get_device_capability()


def test_library_first_layer_matches_the_triton_gemm1(gpu_pool):
    _cuda_and_triton()
    pytest.importorskip("transformers")
    seed = torch.randint(1, 10**6, ()).item()
    for errors, calls, capability in gpu_pool.run(library_against_triton_case, seed=seed):
        if capability != (9, 0):
            pytest.skip(f"the library's first layer is for sm_90; this GPU is sm_{capability[0]}{capability[1]}")
        assert calls == 2, f"the library's products ran {calls} times, not once forward and once backward (seed {seed})"
        assert len(errors) >= 5, errors  # output, input and the experts' and router's gradients
        worse = {name: e for name, e in errors.items() if e > 2 * BF16_REL}
        assert not worse, (seed, worse)
