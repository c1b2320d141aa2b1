"""Pipeline selection, the fused parameter rule and the workspace bound, without a GPU."""

import pytest
import torch
from deepspeed.moe.sharded_moe import TopKGate

import ds_comet
import ds_comet.pipelines.selection as selection_module
from ds_comet.config import CometMoEConfig
from ds_comet.experts import FeedForward, GatedFeedForward, fused_expert
from ds_comet.kernels import constants
from ds_comet.kernels.launch import PointerTables
from ds_comet.kernels.ops import describe_error_record
from ds_comet.kernels.workspace import BufferShape
from ds_comet.pipelines.chunked import rule_chunks
from ds_comet.pipelines.expert_weights import ModuleExperts, ModuleFusedExperts
from ds_comet.pipelines.parameters import choose_parameters, max_received_rows, offsets_overflow
from ds_comet.pipelines.policy import hooks_reason, runtime_reason, structure_reason
from ds_comet.pipelines.routing import plan_routes


def layer(overlap):
    return ds_comet.MoE(
        16, FeedForward(16, 32), num_experts=4, k=2, config={"moe": {"backend": "comet", "overlap": overlap}}
    )


class _Said:
    """What the selection logs, by level."""

    def __init__(self, monkeypatch):
        self.lines = []
        monkeypatch.setattr(selection_module, "log_dist", lambda message, ranks=None: self.lines.append(message))
        monkeypatch.setattr(selection_module.logger, "warning", lambda message: self.lines.append(message))


def test_auto_falls_back_and_says_why_once(monkeypatch):
    said = _Said(monkeypatch)
    moe = layer("auto").deepspeed_moe
    tokens = torch.randn(8, 16)
    assert moe.pipelines.pipeline_for(tokens) is moe.pipelines.reference
    assert moe.pipelines.pipeline_for(tokens) is moe.pipelines.reference
    assert "tokens are on cpu" in moe.pipelines.reason
    assert len(said.lines) == 1 and "runs the reference pipeline: the tokens are on cpu" in said.lines[0]
    assert said.lines[0].startswith(f"ds_comet: {moe.pipelines.name} ")


def test_fused_asked_for_but_unavailable_is_an_error():
    moe = layer("fused").deepspeed_moe
    with pytest.raises(RuntimeError, match=r'"overlap": "fused" was asked for, but the tokens are on cpu'):
        moe.pipelines.pipeline_for(torch.randn(8, 16))


def test_none_runs_the_reference():
    moe = layer("none").deepspeed_moe
    assert moe.pipelines.pipeline_for(torch.randn(8, 16)) is moe.pipelines.reference
    assert moe.pipelines.reason == '"overlap" is "none"'


def test_expert_recognition():
    assert fused_expert(FeedForward(8, 16, "gelu_tanh")).activation == "gelu_tanh"
    gated = fused_expert(GatedFeedForward(8, 16))
    assert gated.gate is not None and gated.activation == "silu"
    sequential = fused_expert(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU("tanh"), torch.nn.Linear(16, 8))
    )
    assert sequential.activation == "gelu_tanh"
    assert isinstance(
        fused_expert(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))), str
    )
    assert isinstance(fused_expert(torch.nn.Linear(8, 8)), str)


def _local_experts(*modules):
    return ModuleExperts(torch.nn.ModuleList(modules), modules)


def test_experts_whose_layers_differ_in_bias_are_refused():
    expert = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16, bias=False))
    fused = structure_reason(_local_experts(expert), 16, 2)
    assert "differ in having a bias" in fused.tensors_reason(16, torch.float32, torch.device("cpu"))


def test_more_routes_per_token_than_the_combine_stages_is_refused():
    too_many = constants.MAX_COMBINE_TOP_K + 1
    reason = structure_reason(_local_experts(FeedForward(16, 32)), 16, too_many)
    assert reason == f"k = {too_many}: the fused combine takes at most 3000 routes per token"


def test_triton_without_tensor_descriptors_is_refused(monkeypatch):
    triton = pytest.importorskip("triton")
    monkeypatch.delattr(triton.language, "make_tensor_descriptor")
    reason = runtime_reason()
    assert "older than 3.4" in reason and "triton>=3.4" in reason


def test_workspaces_past_32_bit_offsets_are_refused():
    assert offsets_overflow(65536, 16384, 4096, 14336, gated=False) is None
    assert "32-bit" in offsets_overflow(80000, 16384, 4096, 14336, gated=True)  # 80000 x 28672 >= 2^31
    assert "32-bit" in offsets_overflow(1000, 300000, 8192, 1024, gated=False)


@pytest.mark.parametrize("ep_size,warned", [(1, False), (2, False), (4, True), (8, True)])
def test_activations_sized_by_a_dropless_bound_warn_from_ep4(ep_size, warned):
    # AutoEP's dropless bound (k = 8 of 16 local experts) against what a balanced router sends a rank.
    k, tokens, row_bytes = 8, 4096, (2 * 2048 + 2 * 768) * 2
    rows = ep_size * min(k, 16) * tokens
    message = selection_module.bound_rows_warning(rows, k * tokens, row_bytes)
    assert (message is not None) == warned
    if warned:
        assert f"{ep_size}x the {k * tokens}" in message and '"activation_rows": "received"' in message
        assert f"{rows * row_bytes / 2**30:.2f} GiB" in message
    config = CometMoEConfig(activation_rows="received")
    assert config.activation_rows == "received"
    with pytest.raises(Exception, match="activation_rows"):
        ds_comet.config.moe_config_from({"moe": {"backend": "comet", "activation_rows": "exact"}})


def test_running_out_of_memory_with_bound_sized_activations_names_the_key():
    from ds_comet.pipelines.fused import FusedPipeline

    bound = FusedPipeline(None, None, None, num_experts=8, row_bounds={True: 4096, False: 8192})
    bound.layer_name = "blocks.1.moe"
    with pytest.raises(
        torch.OutOfMemoryError,
        match=r"(?s)CUDA out of memory.*blocks\.1\.moe .*4096 a call.*"
        r"\"activation_rows\": \"received\"",
    ):
        bound.raise_with_sizing_hint(torch.OutOfMemoryError("CUDA out of memory"), 4096)
    bound.raise_with_sizing_hint(ValueError("something else"), 4096)  # returns: the caller re-raises it
    received = FusedPipeline(
        None, None, None, num_experts=8, row_bounds={True: 4096, False: 8192}, size_by_received=True
    )
    received.raise_with_sizing_hint(torch.OutOfMemoryError("CUDA out of memory"), 4096)


@pytest.mark.parametrize("ep_size", [2, 4, 8])
@pytest.mark.parametrize(
    "k,drop_tokens,capacity_factor,skew",
    [(1, True, 1.0, 0.0), (2, True, 1.25, 3.0), (4, True, 0.5, 0.0), (2, False, 1.0, 4.0), (8, False, 1.0, 0.0)],
)
def test_workspace_bound_holds_for_real_routes(ep_size, k, drop_tokens, capacity_factor, skew):
    num_experts, hidden = 4 * ep_size, 12
    torch.manual_seed(k)
    gate = TopKGate(hidden, num_experts, k, capacity_factor, capacity_factor, 4, None, drop_tokens, True)
    sources, staged = [], torch.zeros(ep_size, ep_size, dtype=torch.int64)  # [source, destination]
    for rank in range(ep_size):
        tokens = (64, 50, 64, 17)[rank % 4]  # uneven token counts, at most 64
        x = torch.randn(tokens, hidden) + skew * gate.wg.weight[0].detach()
        indices = gate(x, None, True)[3]
        sources.append(plan_routes(indices, num_experts).expert_counts)
        # The fused dispatch stages each token once on every other rank holding one of its routes.
        kept = indices.long()  # [k, S], -1 where dropped
        for d in range(ep_size):
            if d != rank:
                on_d = (kept >= d * (num_experts // ep_size)) & (kept < (d + 1) * (num_experts // ep_size))
                staged[rank, d] = int(on_d.any(dim=0).sum())
    received = torch.stack(sources).view(ep_size, ep_size, num_experts // ep_size).sum(dim=(0, 2))
    bound = max_received_rows(64, k, num_experts, ep_size, drop_tokens, capacity_factor, capacity_factor, 4)
    assert received.max().item() <= bound, (received.tolist(), bound)
    shape = BufferShape(
        ep_size=ep_size,
        num_experts=num_experts,
        hidden=hidden,
        dtype=torch.bfloat16,
        max_tokens=64,
        max_recv_rows=bound,
        top_k=k,
        tile_m=128,
    )
    staged_here = staged.sum(dim=0)
    assert (staged_here <= received).all() and staged_here.max().item() <= shape.max_staged_rows, (
        staged_here.tolist(),
        shape.max_staged_rows,
    )
    # Each source's rows arrive in pieces of STAGE_PIECE_ROWS, its last one possibly part full.
    pieces = (-(-staged // constants.STAGE_PIECE_ROWS)).sum(dim=0)
    assert pieces.max().item() <= shape.max_stage_pieces, (pieces.tolist(), shape.max_stage_pieces)


def test_parameter_rule():
    config = CometMoEConfig(backend="comet")
    small = choose_parameters(config, 4096, 14336, False, 2, 2, 8192, 2, 132)
    heavy = choose_parameters(config, 7168, 2048, False, 8, 2, 4096, 2, 132)
    assert 8 <= small.comm_blocks <= heavy.comm_blocks <= 132 // 6
    assert small.n_chunks == 4 and heavy.n_chunks == 8
    # The rule keeps two column tiles a chunk (H2048: 8 tiles, 4 chunks; H256: 1 chunk); a pinned
    # count is only capped at one tile a chunk.
    assert [
        choose_parameters(config, hidden, 1408, True, 4, 2, 8192, 2, 132).n_chunks
        for hidden in (256, 512, 1000, 2048, 7168)
    ] == [1, 1, 2, 4, 8]
    assert choose_parameters(CometMoEConfig(n_chunks=8), 2048, 1408, True, 4, 2, 8192, 2, 132).n_chunks == 8
    # Alone in the group nothing overlaps GEMM2, so the rule takes one chunk; a pinned count stays.
    assert [
        choose_parameters(config, 2048, 1408, True, 4, ep_size, 8192, 2, 132).n_chunks for ep_size in (1, 2, 8)
    ] == [1, 4, 4]
    assert choose_parameters(CometMoEConfig(n_chunks=4), 2048, 1408, True, 4, 1, 8192, 2, 132).n_chunks == 4
    # More ranks send a larger share of the routes over the links: never fewer communication blocks.
    for shape in ((4096, 14336, False, 2), (7168, 2048, False, 8), (2048, 1408, True, 4)):
        blocks = [choose_parameters(config, *shape, ep_size, 8192, 2, 132).comm_blocks for ep_size in (1, 2, 4, 8)]
        assert blocks == sorted(blocks) and 8 <= blocks[0] and blocks[-1] <= 132 // 6, (shape, blocks)
    pinned = choose_parameters(
        CometMoEConfig(comm_blocks=20, n_chunks=64, tile_n=256), 512, 1024, True, 2, 2, 100, 2, 132
    )
    assert pinned.comm_blocks == 20 and pinned.n_chunks == 2 and pinned.tile_n == 256
    # A gated GEMM1's two 256-column accumulators need more shared memory than an SM has.
    assert pinned.gemm1_tile_n == 128
    ungated = choose_parameters(CometMoEConfig(tile_n=256), 512, 1024, False, 2, 2, 100, 2, 132)
    assert ungated.tile_n == ungated.gemm1_tile_n == 256
    narrow = choose_parameters(CometMoEConfig(tile_n=64), 512, 1024, True, 2, 2, 100, 2, 132)
    assert narrow.tile_n == narrow.gemm1_tile_n == 64
    ruled = choose_parameters(CometMoEConfig(), 4096, 14336, False, 2, 2, 8192, 2, 132)
    assert (ruled.gemm1_tile_n, ruled.tile_n) == (256, 256)
    # The combine's blocks: enough to keep pace with GEMM2 (more where GEMM2 is short against the
    # bytes to combine), never more than the dispatch's, and as pinned when pinned.
    combine = [
        choose_parameters(config, hidden, ffn, False, k, 2, 4096, 2, 132).combine_blocks
        for hidden, ffn, k in ((4096, 14336, 2), (7168, 4096, 8), (7168, 2048, 8), (7168, 1024, 8))
    ]
    assert combine == sorted(combine) and combine[0] < combine[-1], combine
    for shape in ((4096, 14336, False, 2), (7168, 2048, False, 8), (2048, 1408, True, 4), (64, 64, False, 1)):
        params = choose_parameters(config, *shape, 2, 8192, 2, 132)
        assert 1 <= params.combine_blocks <= params.comm_blocks, (shape, params)
    assert (
        choose_parameters(CometMoEConfig(combine_blocks=5), 4096, 14336, False, 2, 2, 8192, 2, 132).combine_blocks == 5
    )
    # More than the dispatch's blocks is lowered to them (they could otherwise starve GEMM1).
    lowered = choose_parameters(CometMoEConfig(combine_blocks=30), 4096, 14336, False, 2, 2, 8192, 2, 132)
    assert lowered.combine_blocks == lowered.comm_blocks < 30
    pinned = choose_parameters(
        CometMoEConfig(comm_blocks=500, combine_blocks=500), 4096, 14336, False, 2, 2, 8192, 2, 132
    )
    assert pinned.comm_blocks == pinned.combine_blocks == 131
    assert choose_parameters(CometMoEConfig(), 4096, 14336, True, 2, 2, 8192, 2, 132).gemm1_tile_n == 128


def test_error_record_messages():
    record = torch.zeros(constants.ERROR_RECORD_WORDS, dtype=torch.int64)
    assert describe_error_record(record) is None
    fields = (
        constants.ERROR_FILLED,
        constants.ERROR_RANK,
        constants.ERROR_KIND,
        constants.ERROR_INDEX,
        constants.ERROR_TARGET,
        constants.ERROR_OBSERVED,
        constants.ERROR_WAITED_NS,
    )
    record[list(fields)] = torch.tensor([1, 1, constants.WAIT_COMBINE_CHUNK, 3, 975, 0, 20 * 10**9])
    message = describe_error_record(record)
    assert "rank 1 waited 20.0 s for the expert outputs of column chunk 3 to reach 975" in message
    record[constants.ERROR_KIND] = constants.WAIT_COMBINE_REDUCE
    assert "waited 20.0 s for its own GEMM2's rows of other ranks' tokens in column chunk 3" in describe_error_record(
        record
    )
    record[list(fields[2:6])] = torch.tensor([constants.WORKSPACE_OVERFLOW, 0, 100, 130])
    assert "max_tokens_per_rank" in describe_error_record(record)


@pytest.mark.parametrize("gated", [False, True])
def test_grouped_weight_gradients_map_to_their_parameters(gated):
    # The fused backward's grouped results ([L, F, H] per first-layer projection, [L, H, F] and
    # biases) become each expert parameter's gradient, in the order the autograd function takes
    # the parameters.
    experts = [fused_expert(GatedFeedForward(8, 12, bias=True) if gated else FeedForward(8, 12)) for _ in range(3)]
    dw1, db1, dw2, db2 = torch.randn(3, 12, 8), torch.randn(3, 12), torch.randn(3, 8, 12), torch.randn(3, 8)
    dw3, db3 = (torch.randn(3, 12, 8), torch.randn(3, 12)) if gated else (None, None)
    fused = ModuleFusedExperts(experts)
    grads = fused.gradients(dw1, db1, dw3, db3, dw2, db2)
    expected = {}
    for l, e in enumerate(experts):
        expected.update({e.first.weight: dw1[l], e.first.bias: db1[l], e.second.weight: dw2[l], e.second.bias: db2[l]})
        if gated:
            expected.update({e.gate.weight: dw3[l], e.gate.bias: db3[l]})
    params = fused.parameters()
    assert len(grads) == len(params) == len(expected)
    for param, grad in zip(params, grads):
        assert torch.equal(grad, expected[param])


@pytest.mark.parametrize("gated", [False, True])
def test_expert_tables_follow_the_modules(gated):
    # The pointer tables hold every expert's weights by name, see a parameter the user replaced
    # (they are read from the modules on every call), and refuse misaligned weights.
    modules = [GatedFeedForward(8, 16) if gated else FeedForward(8, 16) for _ in range(3)]
    experts = [fused_expert(m) for m in modules]
    fused = ModuleFusedExperts(experts)
    tables, tokens = PointerTables(), torch.empty(0, 8)

    def expected():
        names = {"w1": "first", "w3": "gate", "w2": "second"}
        want = {}
        for name, attr in names.items():
            linears = [getattr(e, attr) for e in experts]
            want[name] = [0 if lin is None else lin.weight.data_ptr() for lin in linears]
            want["b" + name[1]] = [0 if lin is None or lin.bias is None else lin.bias.data_ptr() for lin in linears]
        return want

    got = tables.get(fused, tokens)
    assert {name: t.tolist() for name, t in got.items()} == expected()
    replaced = modules[1].down_proj if gated else modules[1].fc2
    replaced.weight = torch.nn.Parameter(torch.randn(8, 16))
    got = tables.get(fused, tokens)
    assert got["w2"].tolist()[1] == replaced.weight.data_ptr()
    assert {name: t.tolist() for name, t in got.items()} == expected()
    ordered, registered = fused.parameters(), [p for m in modules for p in m.parameters()]
    assert len(ordered) == len(registered) and all(a is b for a, b in zip(ordered, registered))
    replaced.weight = torch.nn.Parameter(torch.randn(8 * 16 + 1)[1:].view(8, 16))  # 4 bytes past alignment
    with pytest.raises(ValueError, match=r"\['w2'\] are not 16-byte aligned"):
        tables.get(fused, tokens)


def test_rows_for_kernels_aligns_views():
    from ds_comet.pipelines.fused import rows_for_kernels

    base = torch.randn(5 * 16 + 3, dtype=torch.bfloat16)
    aligned = base[:80].view(5, 16)
    assert aligned.data_ptr() % 16 == 0
    assert rows_for_kernels(aligned).data_ptr() == aligned.data_ptr()  # no copy when none is needed
    shifted = base[3:].view(5, 16)  # starts 6 bytes into a 16-byte vector
    fixed = rows_for_kernels(shifted)
    assert fixed.data_ptr() % 16 == 0 and torch.equal(fixed, shifted)
    strided = torch.randn(16, 5, dtype=torch.bfloat16).t()
    assert rows_for_kernels(strided).is_contiguous() and torch.equal(rows_for_kernels(strided), strided)


class _Scaled(FeedForward):
    def forward(self, x):
        return 0.5 * super().forward(x)


class _QuickGELU(torch.nn.GELU):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class _LoRALinear(torch.nn.Linear):
    def __init__(self, fan_in, fan_out):
        super().__init__(fan_in, fan_out)
        self.down = torch.nn.Parameter(torch.randn(2, fan_in))
        self.up = torch.nn.Parameter(torch.randn(fan_out, 2))

    def forward(self, x):
        return super().forward(x) + x @ self.down.t() @ self.up.t()


def test_experts_that_compute_something_else_are_not_fused():
    # The kernels compute an expert from its weights without calling it: a subclass's forward, a
    # replaced layer or a parametrized weight would be skipped, so each is refused by name.
    weight_normed = FeedForward(8, 16)
    torch.nn.utils.parametrizations.weight_norm(weight_normed.fc1)
    replaced = FeedForward(8, 16)
    replaced.fc2 = _LoRALinear(16, 8)
    cases = {
        "the expert is a _Scaled": _Scaled(8, 16),
        "the expert is a Sequential": torch.nn.Sequential(torch.nn.Linear(8, 16), _QuickGELU(), torch.nn.Linear(16, 8)),
        "the expert's layer is a _LoRALinear": replaced,
        "the expert's layer is a ParametrizedLinear": weight_normed,
    }
    for start, expert in cases.items():
        reason = fused_expert(expert)
        assert isinstance(reason, str) and reason.startswith(start) and "not subclasses" in reason, (start, reason)
    assert not isinstance(fused_expert(FeedForward(8, 16)), str)


def test_expert_weights_the_kernels_would_misread_are_refused():
    from ds_comet.experts import expert_tensors_reason

    def specs(*modules):
        return [fused_expert(m) for m in modules]

    ok = specs(FeedForward(8, 16), FeedForward(8, 16))
    assert expert_tensors_reason(ok, 8, torch.float32, torch.device("cpu")) is None
    assert "maps 8 -> 8 features, the tokens have 12" in expert_tensors_reason(
        ok, 12, torch.float32, torch.device("cpu")
    )
    assert "FFN width differs" in expert_tensors_reason(
        specs(FeedForward(8, 16), FeedForward(8, 24)), 8, torch.float32, torch.device("cpu")
    )
    mixed = FeedForward(8, 16).bfloat16()
    mixed.fc1.bias.data = mixed.fc1.bias.data.float()
    assert "expert 0's bias is torch.float32 on cpu, the tokens torch.bfloat16" in expert_tensors_reason(
        specs(mixed), 8, torch.bfloat16, torch.device("cpu")
    )
    transposed = FeedForward(8, 16)
    transposed.fc2.weight = torch.nn.Parameter(torch.randn(16, 8).t())
    assert "expert 0's weight is not contiguous" in expert_tensors_reason(
        specs(transposed), 8, torch.float32, torch.device("cpu")
    )
    assert "on cpu, the tokens torch.float32 on meta" in expert_tensors_reason(
        ok, 8, torch.float32, torch.device("meta")
    )
    gated_wide = GatedFeedForward(8, 16)
    gated_wide.up_proj = torch.nn.Linear(8, 24, bias=False)
    assert "FFN width differs" in expert_tensors_reason(specs(gated_wide), 8, torch.float32, torch.device("cpu"))


class _FusedStandIn:
    """Stands for the fused pipeline, which needs a GPU: the selection hands it out or not."""


def _fusable(pipelines, monkeypatch):
    """The selection as it stands once the group agreed on the fused pipeline (which needs a GPU):
    only the per-call hook check is left to decide."""
    monkeypatch.setattr(pipelines, "_agree", lambda tokens, why: None)
    pipelines.fused = _FusedStandIn()


def test_hooks_after_the_agreement_are_skipped_with_a_warning_not_a_switch(monkeypatch):
    # One rank cannot leave the fused pipeline alone: its peers would wait in the fused exchange
    # while it waited in the reference one. DeepSpeed's flops profiler hooks rank 0 only, mid-run.
    said = _Said(monkeypatch)
    moe = layer("auto").deepspeed_moe
    pipelines, tokens = moe.pipelines, torch.randn(8, 16)
    _fusable(pipelines, monkeypatch)
    assert pipelines.pipeline_for(tokens) is pipelines.fused
    handle = moe.experts.deepspeed_experts[1].fc1.register_forward_hook(lambda module, args, out: out * 2)
    for _ in range(2):
        assert pipelines.pipeline_for(tokens) is pipelines.fused
    warned = [line for line in said.lines if "They are skipped on this rank" in line]
    assert len(warned) == 1 and "an expert's Linear has forward_hooks" in warned[0], said.lines
    assert '"overlap": "none"' in warned[0] and "before the layer's first call" in warned[0]
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
    try:
        assert pipelines.pipeline_for(tokens) is pipelines.fused
    finally:
        handle.remove()
    assert any("a global module hook is registered (forward_pre_hooks)" in line for line in said.lines)


class _KernelsCanRun:
    """What ``local_reason`` returns when the kernels can compute the experts (not a reason)."""


@pytest.mark.parametrize("overlap", ["auto", "fused"])
def test_hooks_at_the_agreement_keep_the_group_on_the_reference_pipeline(monkeypatch, overlap):
    # Every rank sends its answer, hooks included, to the one agreement: a hooked rank keeps the
    # whole group on the reference pipeline, which runs the hooks; "fused" makes that an error.
    moe = layer(overlap).deepspeed_moe
    monkeypatch.setattr(selection_module, "local_reason", lambda *args: _KernelsCanRun())
    moe.experts.deepspeed_experts[0].register_forward_pre_hook(lambda module, args: None)
    tokens = torch.randn(8, 16)
    if overlap == "fused":
        with pytest.raises(
            RuntimeError,
            match=r"\"fused\" was asked for, but an expert's FeedForward has "
            r"forward_pre_hooks",
        ):
            moe.pipelines.pipeline_for(tokens)
    else:
        assert moe.pipelines.pipeline_for(tokens) is moe.pipelines.reference
        assert "an expert's FeedForward has forward_pre_hooks" in moe.pipelines.reason


def test_hooks_on_the_experts_container_are_named_and_do_not_keep_the_layer_off_the_fused_pipeline(monkeypatch):
    # Stock calls its Experts container on the capacity buffer, which comet does not build: neither
    # pipeline calls the container, so its hooks cannot be run, and holding the group on the
    # reference pipeline for them would only cost speed. The user is told where hooks do run.
    said = _Said(monkeypatch)
    moe = layer("auto").deepspeed_moe
    calls = []
    moe.experts.register_forward_hook(lambda module, args, out: calls.append(module))
    monkeypatch.setattr(selection_module, "local_reason", lambda *args: _KernelsCanRun())
    assert hooks_reason(moe.pipelines._hookable()) is None
    moe.pipelines.pipeline_for(torch.randn(8, 16))
    moe.pipelines.pipeline_for(torch.randn(8, 16))
    warned = [line for line in said.lines if "container has forward_hooks" in line]
    assert len(warned) == 1 and "deepspeed_experts[i]" in warned[0], said.lines
    moe.pipelines.reference.forward(torch.randn(8, 16), torch.zeros(1, 8, dtype=torch.long), torch.ones(1, 8))
    assert calls == [], "the reference pipeline calls each expert, not the container"


def test_a_call_without_tokens_on_any_rank_defers_the_workspace(monkeypatch):
    # The workspace is sized by the most tokens a rank feeds at the agreement: sized by a call on
    # which no rank has any, it would refuse the next call that has some. Such a call runs the
    # reference pipeline (nothing to compute) and the group agrees again at the next call.
    from types import SimpleNamespace

    pipelines = layer("fused").deepspeed_moe.pipelines
    pipelines.set_group(object())
    monkeypatch.setattr(selection_module, "local_reason", lambda *args: _KernelsCanRun())
    monkeypatch.setattr(selection_module, "gather_objects", lambda local, waits, what: [local, local])
    monkeypatch.setattr(selection_module, "group_reason", lambda gpus: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="GPU-0"))
    built = []

    def build(tokens, experts, most_tokens, shared_device):
        built.append(most_tokens)
        pipelines.fused = _FusedStandIn()

    monkeypatch.setattr(pipelines, "_build_fused", build)
    for _ in range(2):
        assert pipelines.pipeline_for(torch.randn(0, 16)) is pipelines.reference
        assert pipelines.reason == selection_module.NO_TOKENS_YET and built == []
    assert pipelines.pipeline_for(torch.randn(5, 16)) is pipelines.fused
    assert pipelines.reason is None and built == [5]
    assert pipelines.pipeline_for(torch.randn(0, 16)) is pipelines.fused, "once agreed, an empty call stays fused"
    # An empty call in another dtype agrees again and defers; the agreement for float32 still stands.
    assert pipelines.pipeline_for(torch.randn(0, 16).double()) is pipelines.reference
    assert pipelines.pipeline_for(torch.randn(5, 16)) is pipelines.fused and pipelines.reason is None
    assert built == [5]
    # A pinned "max_tokens_per_rank" sizes the workspace without any tokens.
    pinned = ds_comet.MoE(
        16,
        FeedForward(16, 32),
        num_experts=4,
        k=2,
        config={"moe": {"backend": "comet", "overlap": "fused", "max_tokens_per_rank": 64}},
    )
    pipelines = pinned.deepspeed_moe.pipelines
    pipelines.set_group(object())
    monkeypatch.setattr(pipelines, "_build_fused", build)
    assert pipelines.pipeline_for(torch.randn(0, 16)) is pipelines.fused and built == [5, 0]


def test_a_call_without_tokens_leaves_the_internode_chunks_to_the_next_call(monkeypatch):
    # The reference pipeline's chunks across nodes follow the most tokens a rank feeds: a first call
    # on which no rank has any must not fix them at the rule's fewest for the layer's life, nor may
    # an empty call in another dtype change those of the standing agreement.
    pipelines = layer("auto").deepspeed_moe.pipelines
    pipelines.set_group(object())
    monkeypatch.setattr(
        selection_module,
        "gather_objects",
        lambda local, waits, what: [local, local[:2] + ("another-node",) + local[3:]],
    )
    assert pipelines.pipeline_for(torch.randn(0, 16)) is pipelines.reference
    assert pipelines.reason == selection_module.NO_TOKENS_YET and pipelines.reference.chunks == 1
    pipelines.pipeline_for(torch.randn(16384, 16))
    assert pipelines.reference.chunks == rule_chunks(2, 16384) == 8
    pipelines.pipeline_for(torch.randn(0, 16).double())
    assert pipelines.reason == selection_module.NO_TOKENS_YET
    pipelines.pipeline_for(torch.randn(16, 16))
    assert pipelines.reference.chunks == 8 and pipelines.reason != selection_module.NO_TOKENS_YET


def test_static_checks_run_again_for_new_dtype_or_width(monkeypatch):
    # The workspace and the weight checks were made for the first call's tokens: other tokens
    # (say after model.half()) are checked again, by the whole group, before the kernels run.
    moe = layer("auto").deepspeed_moe
    pipelines = moe.pipelines
    agreed = []
    monkeypatch.setattr(pipelines, "_agree", lambda t, why: agreed.append((t.dtype, t.shape[-1])) or "stub")
    for tokens in (
        torch.randn(8, 16),
        torch.randn(5, 16),
        torch.randn(8, 16).half(),
        torch.randn(8, 16).half(),
        torch.randn(8, 16),
    ):
        assert pipelines.pipeline_for(tokens) is pipelines.reference
    assert agreed == [(torch.float32, 16), (torch.float16, 16), (torch.float32, 16)]


def test_tokens_on_another_gpu_than_the_current_one_are_a_reason(monkeypatch):
    # The workspace is allocated on the current device: tokens elsewhere would meet it in the
    # exchange as an error about mixed devices rather than this one, which says what to call.
    from types import SimpleNamespace

    from ds_comet.pipelines.policy import tokens_reason

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    on_gpu_1 = SimpleNamespace(device=torch.device("cuda", 1), dtype=torch.bfloat16)
    assert "call torch.cuda.set_device(1) first" in tokens_reason(on_gpu_1)
    assert tokens_reason(SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16)) is None


def test_the_group_agrees_again_when_the_gates_capacity_changes(monkeypatch):
    # The fused workspace's row bound comes from the gate's capacity factors at the agreement: a
    # raised factor must be agreed again (and the workspace sized for it), not overflow the old one.
    moe = layer("auto").deepspeed_moe
    pipelines, tokens = moe.pipelines, torch.randn(8, 16)
    bounds, whys = [], []
    monkeypatch.setattr(
        pipelines,
        "_agree",
        lambda t, why: whys.append(why) or bounds.append(pipelines.spec.row_bound(64, True)) or "stub",
    )
    moe.gate.capacity_factor = moe.gate.eval_capacity_factor = 0.25
    pipelines.pipeline_for(tokens)
    pipelines.pipeline_for(tokens)
    moe.gate.capacity_factor = 4.0
    pipelines.pipeline_for(tokens)
    pipelines.pipeline_for(tokens)
    assert len(bounds) == 2 and bounds[1] > bounds[0], bounds
    # What the agreement's wait says, should it time out (a peer that did not change goes on to the call).
    assert whys == [
        "the group's agreement at its first call",
        "the group's agreement again: on this rank capacity_factor changed from 0.25 to 4.0 since the last one",
    ], whys


def test_expert_tables_refuse_weights_converted_after_the_choice():
    modules = [FeedForward(8, 16) for _ in range(2)]
    fused = ModuleFusedExperts([fused_expert(m) for m in modules])
    tables, tokens = PointerTables(), torch.empty(0, 8)
    tables.get(fused, tokens)
    modules[1].fc1.weight = torch.nn.Parameter(modules[1].fc1.weight.detach().double())
    with pytest.raises(ValueError, match=r"cannot read the experts' weights: expert 1's weight is torch.float64"):
        tables.get(fused, tokens)


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({}, None),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "expandable segments"),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64, expandable_segments:True"}, "expandable segments"),
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, "expandable segments"),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, None),
        # torch reads PYTORCH_ALLOC_CONF alone when it is set, and the last value of a key
        (
            {"PYTORCH_ALLOC_CONF": "expandable_segments:False", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
            None,
        ),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,expandable_segments:False"}, None),
        ({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, "cudaMallocAsync"),
        ({"PYTORCH_CUDA_ALLOC_CONF": "backend:native,max_split_size_mb:128"}, None),
    ],
)
def test_allocator_settings_that_cuda_ipc_cannot_share(monkeypatch, settings, expected):
    # Ranks that share a GPU pass their workspace through CUDA IPC; the choice refuses these by name.
    from ds_comet.kernels.workspace import allocator_ipc_refusal

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    refusal = allocator_ipc_refusal()
    assert (refusal is None) if expected is None else (expected in refusal), refusal


def test_wall_clock_breakdown_times_the_comet_layer_as_stock_does():
    # DeepSpeed's engine sets wall_clock_breakdown on every MOELayer and prints the sum of their
    # time_moe as fwd_moe: a comet layer must record its own, as stock's forward does.
    moe = layer("none")
    inner = moe.deepspeed_moe
    inner.wall_clock_breakdown = True
    assert inner.time_moe == 0.0
    out, _, _ = moe(torch.randn(2, 64, 16))
    assert out.shape == (2, 64, 16) and inner.time_moe > 0.0


def test_a_group_made_after_a_reinitialisation_gets_its_own_workspace(monkeypatch):
    # torch numbers group names from 0 again after destroy_process_group: a new group with a dead
    # one's name must not be handed the dead group's workspace (its peers' memory, its rendezvous).
    import ds_comet.kernels.workspace as workspace

    class Group:
        group_name = "1"

    monkeypatch.setattr(workspace, "_BUFFERS", {})
    monkeypatch.setattr(workspace, "CometBuffer", lambda group, shape, timeout_s, shared: (group, shape))
    shape = "a buffer shape"
    dead, alive = Group(), Group()
    assert workspace.get_buffer(dead, shape, 60.0) is workspace.get_buffer(dead, shape, 60.0)
    assert workspace.get_buffer(alive, shape, 60.0)[0] is alive


def test_forwarding_inside_nodes_needs_nodes_filled_in_order(monkeypatch):
    warned = []
    monkeypatch.setattr(selection_module.logger, "warning", warned.append)
    monkeypatch.setattr(selection_module.torch_dist, "get_rank", lambda group=None: 0)  # the group's first rank
    moe = ds_comet.MoE(
        16, FeedForward(16, 32), num_experts=4, k=2, config={"moe": {"backend": "comet", "internode_forwarding": True}}
    )
    pipelines = moe.deepspeed_moe.pipelines
    assert pipelines._forwarding_ranks(["a", "a", "b", "b"]) == 2
    assert pipelines._forwarding_ranks(["a", "a", "a", "a"]) is None  # one node: nothing crosses
    assert pipelines._forwarding_ranks(["a", "b", "c", "d"]) is None  # one rank a node: the same rows
    assert warned == []
    for nodes in (["a", "b", "a", "b"], ["a", "a", "a", "b"]):  # interleaved; nodes of unequal size
        assert pipelines._forwarding_ranks(nodes) is None
    assert len(warned) == 2 and all("fill its nodes in order" in line for line in warned), warned
    off = ds_comet.MoE(16, FeedForward(16, 32), num_experts=4, k=2, config={"moe": {"backend": "comet"}})
    assert off.deepspeed_moe.pipelines._forwarding_ranks(["a", "a", "b", "b"]) is None
