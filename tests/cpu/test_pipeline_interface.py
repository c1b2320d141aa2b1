"""One pipeline interface and one table of integrations, without a GPU.

The pipelines take ``Pipeline.forward``'s call; each integration's layer runs whatever pipeline
the selection hands it through that interface alone (a stand-in pipeline records the call); and
``convert_moe_layers`` converts what the integrations' table names, nothing else.
"""

import inspect
import sys
import types

import pytest
import torch
from deepspeed.moe.layer import MoE as StockMoE
from deepspeed.moe.sharded_moe import MOELayer
from torch import nn

import ds_comet
import ds_comet.integrations.layer_classes as layer_classes
import ds_comet.integrations.legacy.layer as legacy_layer
from ds_comet.config import CometMoEConfig
from ds_comet.experts import FeedForward
from ds_comet.integrations.legacy.gate import gate_routes
from ds_comet.pipelines.fused import FusedPipeline
from ds_comet.pipelines.hybrid import HybridPipeline, NodeSplit
from ds_comet.pipelines.interface import Pipeline
from ds_comet.pipelines.reference import ReferencePipeline

HIDDEN = 16


def _parameters(function) -> list[tuple]:
    """(name, kind, default, annotation) of each of ``function``'s parameters after ``self``."""
    parameters = list(inspect.signature(function).parameters.values())[1:]
    return [(p.name, p.kind, p.default, p.annotation) for p in parameters]


def test_both_pipelines_take_the_interfaces_call():
    protocol = _parameters(Pipeline.forward)
    assert [name for name, *_ in protocol] == ["tokens", "indices", "weights", "train", "scale_before"]
    assert all(
        kind is inspect.Parameter.KEYWORD_ONLY for name, kind, *_ in protocol if name in ("train", "scale_before")
    )
    assert _parameters(ReferencePipeline.forward) == protocol
    fused = _parameters(FusedPipeline.forward)
    # The fused pipeline's one addition, for the GPU test that writes into a poisoned tensor.
    assert fused[: len(protocol)] == protocol
    assert fused[len(protocol) :] == [("out", inspect.Parameter.KEYWORD_ONLY, None, torch.Tensor | None)]
    assert _parameters(HybridPipeline.forward) == protocol
    for pipeline in (ReferencePipeline, FusedPipeline, HybridPipeline):
        assert Pipeline in pipeline.__mro__, pipeline  # declared, not only alike


def test_each_pipeline_says_what_the_gate_before_it_may_do():
    reference = ReferencePipeline(None, num_experts=4, ep_size=1)
    assert reference.gate_op is None and reference.replays_gate is False
    op = object()
    fused = FusedPipeline(types.SimpleNamespace(op=op), None, None, num_experts=4, row_bounds={True: 8, False: 8})
    assert fused.gate_op is op and fused.replays_gate is True
    hybrid = HybridPipeline(fused, reference, NodeSplit(num_experts=8, nodes=2, node=0))
    assert hybrid.gate_op is op and hybrid.replays_gate is True, "the fused part's gate, as on one node"
    hybrid.layer_name = "blocks.3.moe"
    assert fused.layer_name == reference.layer_name == "blocks.3.moe"


def test_the_fused_pipeline_refuses_rows_scaled_before_the_experts():
    fused = FusedPipeline(None, None, None, num_experts=4, row_bounds={True: 8, False: 8})
    fused.layer_name = "layers.3.moe"
    tokens, indices, weights = torch.randn(5, HIDDEN), torch.zeros(2, 5, dtype=torch.int32), torch.ones(2, 5)
    with pytest.raises(ValueError, match=r"layers\.3\.moe: the fused pipeline weights the routes' outputs"):
        fused.forward(tokens, indices, weights, scale_before=True)


class RecordingPipeline(Pipeline):
    """Stands for whichever pipeline the selection hands a layer: records each call, returns
    ``2 * tokens``."""

    name = "stand-in"
    layer_name = "stand-in layer"

    def __init__(self, gate_op=None, replays_gate=False):
        self._gate_op, self._replays_gate = gate_op, replays_gate
        self.calls = []

    @property
    def gate_op(self):
        return self._gate_op

    @property
    def replays_gate(self):
        return self._replays_gate

    def forward(self, tokens, indices, weights, *, train=True, scale_before=False):
        self.calls.append(dict(tokens=tokens, indices=indices, weights=weights, train=train, scale_before=scale_before))
        return 2 * tokens


def _hand(layer, pipeline, monkeypatch):
    """Makes ``layer``'s selection hand it ``pipeline`` at every call."""
    monkeypatch.setattr(layer.pipelines, "pipeline_for", lambda tokens, train: pipeline)


class RecordingGraphs:
    """Stands for ``GateGraphs``: records the op it is given, routes as ``gate_routes`` does."""

    def __init__(self):
        self.ops = []

    def routes(self, gate, tokens, used_token, op):
        self.ops.append(op)
        return gate_routes(gate, tokens, used_token)


@pytest.mark.parametrize("replays_gate", [False, True])
@pytest.mark.parametrize("training", [True, False])
def test_the_legacy_layer_runs_the_pipeline_it_is_handed(monkeypatch, replays_gate, training):
    layer = ds_comet.MoE(HIDDEN, FeedForward(HIDDEN, 32), num_experts=4, k=2).train(training)
    moe = layer.deepspeed_moe
    op = object()  # the gate kernels' op this pipeline names: reaches the gate, never called here
    pipeline = RecordingPipeline(gate_op=op, replays_gate=replays_gate)
    _hand(moe, pipeline, monkeypatch)
    moe.gate_graphs = RecordingGraphs()
    eager_ops = []

    def eager_routes(gate, tokens, used_token=None, op=None):
        eager_ops.append(op)
        return gate_routes(gate, tokens, used_token)

    monkeypatch.setattr(legacy_layer, "gate_routes", eager_routes)
    hidden_states = torch.randn(2, 3, HIDDEN)
    output, _, _ = layer(hidden_states)

    (call,) = pipeline.calls
    assert torch.equal(call["tokens"], hidden_states.reshape(6, HIDDEN))
    assert call["indices"].shape == (2, 6) and call["weights"].shape == (2, 6)
    assert call["weights"].dtype == torch.float32
    assert call["train"] is training and call["scale_before"] is False
    assert torch.equal(output, 2 * hidden_states)
    # The gate took the pipeline's op, from the graphs only where the pipeline allows a replay.
    assert (moe.gate_graphs.ops, eager_ops) == (([op], []) if replays_gate else ([], [op]))


def _autoep_layer():
    """A Mixtral block converted by AutoEP (one rank, no process group), then by ds_comet."""
    pytest.importorskip("transformers")
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config

    from ds_comet.bench.autoep import model_for

    torch.manual_seed(0)
    model = model_for("mixtral", HIDDEN * 4, 96, 4, 2)
    config = {"enabled": True, "autoep_size": 1, "preset_model": "mixtral", "use_grouped_mm": False}
    auto_ep = AutoEP(model, parse_autoep_config(config))
    auto_ep.replace_moe_layers(auto_ep.ep_parser(), ep_size=1, ep_rank=0)
    assert ds_comet.convert_moe_layers(model, CometMoEConfig(backend="comet", overlap="none")) == ["model.layers.0.mlp"]
    (layer,) = layer_classes.moe_layers(model)
    assert type(layer).__name__ == "CometAutoEPMoELayer"
    return layer


@pytest.mark.parametrize("score_apply", ["post", "pre"])
@pytest.mark.parametrize("training", [True, False])
def test_the_autoep_layer_runs_the_pipeline_it_is_handed(monkeypatch, score_apply, training):
    layer = _autoep_layer().train(training)
    layer.score_apply = score_apply
    pipeline = RecordingPipeline()
    _hand(layer, pipeline, monkeypatch)
    hidden_states = torch.randn(2, 3, layer.hidden_size)
    output = layer(hidden_states)
    output = output[0] if isinstance(output, tuple) else output

    (call,) = pipeline.calls
    assert torch.equal(call["tokens"], hidden_states.reshape(6, layer.hidden_size))
    assert call["indices"].shape == (layer.top_k, 6) and call["weights"].shape == (layer.top_k, 6)
    assert call["train"] is training and call["scale_before"] is (score_apply == "pre")
    assert output.shape == hidden_states.shape


class StandInLayer(nn.Module):
    """A DeepSpeed MoE layer class of a stand-in integration."""


class CometStandInLayer(StandInLayer):
    """Its comet class: ``adopt`` turns a layer of exactly ``StandInLayer`` into it, with a selection."""

    @classmethod
    def adopt(cls, layer, config):
        layer.__class__ = cls
        layer.pipelines = types.SimpleNamespace(pipeline_for=None, name=None, config=config)
        return layer


@pytest.fixture
def stand_in_table(monkeypatch):
    """The integrations' table with one stand-in row, and one whose DeepSpeed class is missing."""
    module = types.ModuleType("stand_in_integration")
    module.StandInLayer, module.CometStandInLayer = StandInLayer, CometStandInLayer
    module.notes = lambda ds_config, config: [f"stand-in notes on {sorted(ds_config)}"]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    rows = (
        layer_classes.Integration(
            deepspeed_class="stand_in_integration:StandInLayer",
            comet_class="stand_in_integration:CometStandInLayer",
            absent="no stand-in layer",
            notes="stand_in_integration:notes",
        ),
        layer_classes.Integration(
            deepspeed_class="no_such_deepspeed_module:Layer",
            comet_class="no_such_comet_module:Layer",
            absent="no missing layer",
            notes="no_such_comet_module:notes",
        ),
    )
    monkeypatch.setattr(layer_classes, "INTEGRATIONS", rows)


def test_the_table_drives_the_conversion(stand_in_table):
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(StandInLayer()), StandInLayer())
    assert layer_classes.deepspeed_classes() == (StandInLayer,)
    assert layer_classes.moe_layers(model) == [model[1][0], model[2]]
    assert ds_comet.convert_moe_layers(model, CometMoEConfig(backend="comet")) == ["1.0", "2"]
    assert [type(module) for module in model.children()] == [nn.Linear, nn.Sequential, CometStandInLayer]
    assert type(model[1][0]) is CometStandInLayer
    assert model[1][0].pipelines.name == "1.0"
    # Converted layers are the table's too (their classes derive from DeepSpeed's), and stay as they are.
    assert layer_classes.moe_layers(model) == [model[1][0], model[2]]
    assert ds_comet.convert_moe_layers(model, CometMoEConfig(backend="comet")) == ["1.0", "2"]
    assert layer_classes.conversion_notes({"moe": {}}, CometMoEConfig()) == ["stand-in notes on ['moe']"]


def test_a_model_without_the_tables_layers_is_told_what_it_lacks(stand_in_table):
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"has no MoE layer to run it: no stand-in layer and no missing layer$"):
        ds_comet.convert_moe_layers(model, CometMoEConfig(backend="comet", overlap="fused"))
    assert type(model[0]) is nn.Linear


def test_the_real_table_converts_stock_deepspeed_layers():
    torch.manual_seed(0)
    stock = StockMoE(HIDDEN, FeedForward(HIDDEN, 32), num_experts=4, k=2)
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), stock)
    assert layer_classes.moe_layers(model) == [stock.deepspeed_moe]
    assert ds_comet.convert_moe_layers(model, CometMoEConfig(backend="deepspeed")) == []
    assert type(stock.deepspeed_moe) is MOELayer
    assert ds_comet.convert_moe_layers(model, CometMoEConfig(backend="comet")) == ["1.deepspeed_moe"]
    assert type(stock.deepspeed_moe) is ds_comet.CometMOELayer and type(model[0]) is nn.Linear
    assert stock.deepspeed_moe.pipelines.name == "1.deepspeed_moe"


def test_the_autoep_rows_notes_come_through_the_table():
    pytest.importorskip("deepspeed.module_inject.auto_ep_layer")
    comet = CometMoEConfig(backend="comet")
    assert (
        layer_classes.conversion_notes({"expert_parallel": {"enabled": False, "combine_impl": "weighted_sum"}}, comet)
        == []
    )
    (message,) = layer_classes.conversion_notes(
        {"expert_parallel": {"enabled": True, "combine_impl": "weighted_sum"}}, comet
    )
    assert "combine_impl" in message and "take no effect" in message
