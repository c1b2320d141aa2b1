"""The ds_config switch: the "moe" section, its errors, and which class a config builds."""

import argparse
import base64
import importlib
import json

import deepspeed
import pytest
import torch
from deepspeed import comm as dist
from deepspeed.runtime.config import DeepSpeedConfig

import ds_comet
from ds_comet import CometMoEConfig, CometMOELayer, build_moe, moe_config_from
from ds_comet.config import closest_key
from ds_comet.experts import FeedForward
from tests.support.dist_pool import cpu_world_size

MOE_KWARGS = dict(hidden_size=16, num_experts=4, ep_size=1, k=2)


def expert():
    return FeedForward(16, 32)


def test_default_is_stock():
    assert moe_config_from({}).backend == "deepspeed"
    assert moe_config_from(None).overlap == "auto"
    assert moe_config_from({"moe": None}).backend == "deepspeed"


def test_same_model_code_two_classes():
    stock = build_moe({"moe": {"backend": "deepspeed"}}, expert=expert(), **MOE_KWARGS)
    comet = build_moe({"moe": {"backend": "comet"}}, expert=expert(), **MOE_KWARGS)
    assert type(stock) is deepspeed.moe.layer.MoE
    assert type(comet) is ds_comet.MoE
    assert type(stock.deepspeed_moe) is deepspeed.moe.sharded_moe.MOELayer
    assert type(comet.deepspeed_moe) is CometMOELayer
    assert list(stock.state_dict()) == list(comet.state_dict())


def test_comet_class_follows_the_config():
    assert type(ds_comet.MoE(expert=expert(), **MOE_KWARGS).deepspeed_moe) is CometMOELayer
    stock_inside = ds_comet.MoE(expert=expert(), config={"moe": {"backend": "deepspeed"}}, **MOE_KWARGS)
    assert type(stock_inside.deepspeed_moe) is deepspeed.moe.sharded_moe.MOELayer


def test_same_seed_same_weights():
    torch.manual_seed(3)
    stock = build_moe({}, expert=expert(), **MOE_KWARGS)
    torch.manual_seed(3)
    comet = build_moe({"moe": {"backend": "comet"}}, expert=expert(), **MOE_KWARGS)
    for (name, a), b in zip(stock.state_dict().items(), comet.state_dict().values()):
        assert torch.equal(a, b), name


def test_expert_parameter_attributes_are_stock():
    layer = build_moe({"moe": {"backend": "comet"}}, expert=expert(), **MOE_KWARGS)
    for name, param in layer.named_parameters():
        if ".experts." in name:
            assert param.allreduce is False and param.group_name == "ep_size_1", name
        else:
            assert getattr(param, "allreduce", True), name


def test_config_forms(tmp_path):
    ds_config = {"train_batch_size": 8, "moe": {"backend": "comet", "overlap": "none"}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds_config))
    expected = CometMoEConfig(backend="comet", overlap="none")
    assert moe_config_from(ds_config) == expected
    assert moe_config_from(str(path)) == expected
    assert moe_config_from(path) == expected
    assert moe_config_from(DeepSpeedConfig(ds_config)) == expected
    assert moe_config_from(expected) is expected

    class Engine:  # what moe_config_from reads of a DeepSpeedEngine
        config = ds_config

    assert moe_config_from(Engine()) == expected


def test_deepspeed_accepts_the_section():
    # DeepSpeed itself must keep ignoring the section (and never confuse it with its "comet" monitor).
    parsed = DeepSpeedConfig({"train_batch_size": 8, "moe": {"backend": "comet"}})
    assert parsed.monitor_config.comet.enabled is False


@pytest.mark.parametrize(
    "section,words",
    [
        ({"backend": "auto"}, ["moe.backend", "'deepspeed', 'comet'"]),
        ({"backend": "Comet"}, ["moe.backend", "'deepspeed', 'comet'"]),
        ({"overlap": "always"}, ["moe.overlap", "'auto', 'fused', 'none'"]),
        (
            {"backend": "comet", "overlapp": "none"},
            ["unknown key 'moe.overlapp'; did you mean 'overlap'?", "backend, overlap"],
        ),
        ([1, 2], ["'moe' must be a JSON object"]),
        # JSON values of the wrong type are errors, not converted.
        ({"backend": "comet", "comm_blocks": True}, ["'moe.comm_blocks' is True"]),
        ({"backend": "comet", "n_chunks": "4"}, ["'moe.n_chunks' is '4'"]),
        ({"backend": "comet", "max_tokens_per_rank": 1024.0}, ["'moe.max_tokens_per_rank' is 1024.0"]),
        ({"backend": "comet", "cuda_graph_gate": "yes"}, ["'moe.cuda_graph_gate' is 'yes'"]),
        # The kernels count the wait in 64-bit nanoseconds.
        ({"backend": "comet", "wait_timeout_s": float("inf")}, ["'moe.wait_timeout_s' is inf"]),
        ({"backend": "comet", "wait_timeout_s": 1e10}, ["'moe.wait_timeout_s' is 10000000000.0", "1000000"]),
        # Below a second, healthy jobs would time out (MIN_WAIT_TIMEOUT_S).
        ({"backend": "comet", "wait_timeout_s": 0.01}, ["'moe.wait_timeout_s' is 0.01", "greater than or equal to 1"]),
    ],
)
def test_bad_config_names_key_and_choices(section, words):
    with pytest.raises(ValueError) as error:
        moe_config_from({"moe": section})
    for word in words:
        assert word in str(error.value)


def test_the_default_wait_and_its_roll_call_end_before_the_nccl_watchdog():
    """The watchdog aborts the process after 10 minutes (torch's default for DeepSpeed's expert
    groups) without naming a rank: the bounded wait, then the roll call as long again, must end first."""
    from ds_comet.pipelines.collective_waits import STORE_SLACK_S

    default = CometMoEConfig(backend="comet").wait_timeout_s
    assert 2 * default + STORE_SLACK_S < 600, default
    assert default >= 120, default  # and a rank a minute or two behind its peers does not end the job


def test_a_whole_number_of_seconds_is_a_timeout():
    assert moe_config_from({"moe": {"backend": "comet", "wait_timeout_s": 5}}).wait_timeout_s == 5.0


def test_config_files_read_as_deepspeed_reads_them(tmp_path):
    # HJSON (comments, trailing commas) and base64 strings, as DeepSpeedConfig takes them; a key
    # given twice is an error naming the file.
    commented = tmp_path / "commented.json"
    commented.write_text('{\n  // the comet backend\n  "moe": {"backend": "comet", "overlap": "none",},\n}\n')
    assert moe_config_from(str(commented)) == CometMoEConfig(backend="comet", overlap="none")
    encoded = base64.urlsafe_b64encode(json.dumps({"moe": {"backend": "comet"}}).encode()).decode()
    assert moe_config_from(encoded) == CometMoEConfig(backend="comet")
    twice = tmp_path / "twice.json"
    twice.write_text('{"moe": {"backend": "comet"}, "moe": {"backend": "deepspeed"}}')
    with pytest.raises(ValueError, match=r"invalid ds_config file .*twice.json: Duplicate keys"):
        moe_config_from(twice)
    with pytest.raises(FileNotFoundError, match=r"'missing.json' is neither an existing file nor a base64"):
        moe_config_from("missing.json")
    with pytest.raises(FileNotFoundError, match=r"neither an existing file"):
        moe_config_from("abcd")  # valid base64 of bytes that are no JSON object


def test_read_ds_config(tmp_path):
    # The public reader: HJSON with comments and quoteless keys, as DeepSpeed accepts it, or base64.
    commented = tmp_path / "commented.json"
    commented.write_text(
        '// a comment\n{\n  # another\n  train_micro_batch_size_per_gpu: 4\n  moe: {backend: "comet"}\n}\n'
    )
    expected = {"train_micro_batch_size_per_gpu": 4, "moe": {"backend": "comet"}}
    assert ds_comet.read_ds_config(str(commented)) == expected
    assert ds_comet.read_ds_config(commented) == expected
    encoded = base64.urlsafe_b64encode(json.dumps(expected).encode()).decode()
    assert ds_comet.read_ds_config(encoded) == expected
    # A key given twice is an error that names it and the file, also inside a section.
    twice = tmp_path / "twice.json"
    twice.write_text('{"zero_optimization": {"stage": 1, "stage": 2}}')
    with pytest.raises(ValueError, match=r"twice\.json: Duplicate keys in DeepSpeed config: \['stage'\]"):
        ds_comet.read_ds_config(str(twice))
    # A file that holds no object is not a config (HJSON reads a bare word as a string).
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"list\.json: it holds a list, not a JSON object"):
        ds_comet.read_ds_config(str(listed))
    with pytest.raises(FileNotFoundError, match="neither an existing file nor a base64-encoded JSON config"):
        ds_comet.read_ds_config(str(tmp_path / "absent.json"))


def test_comet_keys_under_the_deepspeed_backend_are_reported(monkeypatch):
    import ds_comet.config as config

    said = []
    monkeypatch.setattr(config.logger, "warning", said.append)
    monkeypatch.setattr(config, "_warned_ignored", set())
    for _ in range(2):  # once, not once per layer
        assert moe_config_from({"moe": {"overlap": "fused", "comm_blocks": 8}}).backend == "deepspeed"
    assert said == [
        'ds_config \'moe\' keys comm_blocks, overlap only apply to "backend": "comet"; this job '
        "runs stock DeepSpeed's MoE and ignores them"
    ]
    moe_config_from({"moe": {"backend": "deepspeed"}})
    assert len(said) == 1


def test_bad_config_type():
    with pytest.raises(TypeError, match="cannot read a ds_config"):
        moe_config_from(42)


def test_build_moe_rejects_config_keyword():
    with pytest.raises(TypeError, match="first argument"):
        build_moe({}, config={}, expert=expert(), **MOE_KWARGS)


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        (dict(use_tutel=True), ValueError, "use_tutel"),
        (dict(enable_expert_tensor_parallelism=True), NotImplementedError, "expert tensor parallelism"),
        (dict(k=5), ValueError, "k (5)"),
        (dict(k=0), ValueError, "k (0)"),
        (dict(ep_size=3), ValueError, "multiple of ep_size"),
    ],
)
def test_unsupported_refused_at_construction(kwargs, error, words):
    with pytest.raises(error) as raised:
        ds_comet.MoE(**{**MOE_KWARGS, "expert": expert(), **kwargs})
    assert words in str(raised.value)


def test_a_stock_layer_with_more_routes_than_experts_stays_stock():
    # Stock's top-2 gate with one expert routes a token to it twice: ds_comet.initialize's conversion
    # refuses it as the comet MoE's constructor does, and the refused layer is left as it was.
    stock = build_moe({"moe": {"backend": "deepspeed"}}, expert=expert(), **{**MOE_KWARGS, "num_experts": 1})
    with pytest.raises(ValueError, match=r"k \(2\) must be between 1 and num_experts \(1\)"):
        CometMOELayer.adopt(stock.deepspeed_moe, CometMoEConfig(backend="comet"))
    assert type(stock.deepspeed_moe) is deepspeed.moe.sharded_moe.MOELayer


def test_forward_without_group_says_what_to_do():
    layer = ds_comet.MoE(16, expert(), num_experts=4, ep_size=2, k=1)
    with pytest.raises(RuntimeError, match="set_deepspeed_parallelism"):
        layer(torch.randn(1, 8, 16))


def test_inputs_the_layer_cannot_take_are_named():
    layer = ds_comet.MoE(16, expert(), num_experts=4, k=2, config={"moe": {"backend": "comet"}})
    with pytest.raises(ValueError, match=r"takes hidden states \[\.\.\., 16\].*got a tensor of shape \(\)"):
        layer(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"takes hidden states \[\.\.\., 16\].*shape \(2, 8, 12\)"):
        layer(torch.randn(2, 8, 12))
    # Stock's gate reads used_token with k=1 only: with k=2 it would be ignored, so it is refused.
    applies = "used_token is given, but DeepSpeed's gate applies it only with k=1; with k=2 stock DeepSpeed ignores it"
    with pytest.raises(ValueError, match=applies):
        layer(torch.randn(2, 8, 16), used_token=torch.ones(16))
    top1 = ds_comet.MoE(16, expert(), num_experts=4, k=1, config={"moe": {"backend": "comet"}})
    with pytest.raises(ValueError, match=r"used_token must hold one entry per token \(16\), got shape \(15,\)"):
        top1(torch.randn(2, 8, 16), used_token=torch.ones(15))
    assert top1(torch.randn(2, 8, 16), used_token=torch.ones(16))[0].shape == (2, 8, 16)
    with pytest.raises(ValueError, match="got hidden states on the meta device, which hold no values"):
        layer(torch.randn(2, 8, 16, device="meta"))


def test_a_bad_moe_section_fails_before_deepspeed_builds_the_engine(monkeypatch):
    initialize_module = importlib.import_module("ds_comet.initialize")

    def engine_built(*args, **kwargs):
        raise AssertionError('deepspeed.initialize ran before the "moe" section was checked')

    monkeypatch.setattr(initialize_module, "_deepspeed_initialize", engine_built)
    with pytest.raises(ValueError, match="overlap"):
        ds_comet.initialize(model=torch.nn.Linear(2, 2), config={"moe": {"backend": "comet", "overlap": "fuse"}})
    args = argparse.Namespace(deepspeed_config={"moe": {"backend": "comet", "wait_timeout_s": -1}})
    with pytest.raises(ValueError, match="wait_timeout_s"):
        ds_comet.initialize(args=args, model=torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="tile_m"):
        ds_comet.initialize(model=torch.nn.Linear(2, 2), config=None, config_params={"moe": {"tile_m": 3}})
    args = argparse.Namespace(deepspeed_config=None, deepscale_config={"moe": {"backend": "comet", "n_chunks": 0}})
    with pytest.raises(ValueError, match="n_chunks"):
        ds_comet.initialize(args=args, model=torch.nn.Linear(2, 2))


def test_comet_layers_built_with_other_settings_than_the_section_are_named():
    from ds_comet.initialize import refuse_other_settings

    model = torch.nn.ModuleDict(
        {
            "plain": ds_comet.MoE(**MOE_KWARGS, expert=expert()),  # the defaults
            "tuned": ds_comet.MoE(
                **MOE_KWARGS, expert=expert(), config={"moe": {"backend": "comet", "overlap": "none"}}
            ),
        }
    )
    refuse_other_settings(model.plain, CometMoEConfig(backend="comet"))
    refuse_other_settings(model.tuned, CometMoEConfig(backend="comet", overlap="none"))
    with pytest.raises(ValueError) as raised:
        refuse_other_settings(model, CometMoEConfig(backend="comet", overlap="none", wait_timeout_s=300))
    message = str(raised.value)
    default = CometMoEConfig(backend="comet").wait_timeout_s
    assert (
        f"plain.deepspeed_moe (overlap: 'auto' (the ds_config: 'none'), wait_timeout_s: {default!r} (the "
        "ds_config: 300.0))"
    ) in message, message
    assert f"tuned.deepspeed_moe (wait_timeout_s: {default!r} (the ds_config: 300.0))" in message, message
    assert "ds_comet.MoE(..., config=ds_config)" in message, message
    with pytest.raises(
        ValueError,
        match=r"plain.deepspeed_moe \(backend: 'comet' \(the ds_config: 'deepspeed'\)\).*"
        r"deepspeed.moe.layer.MoE",
    ):
        refuse_other_settings(model, CometMoEConfig(backend="deepspeed"))


def initialize_built_layer_case(section):
    """A comet layer built without a config, then ds_comet.initialize with ``section`` as the ds_config's
    "moe" section (None: no section): the layer's overlap afterwards, or the error."""
    world = dist.get_world_size()
    model = ds_comet.MoE(16, expert(), num_experts=2 * world, ep_size=world, k=1)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if section is not None:
        config["moe"] = section
    try:
        engine, *_ = ds_comet.initialize(model=model, model_parameters=model.parameters(), config=config)
    except ValueError as error:
        return str(error)
    return engine.module.deepspeed_moe.pipelines.config.overlap


def test_initialize_refuses_a_section_its_comet_layers_were_not_built_with(cpu_pool):
    assert cpu_pool.run(initialize_built_layer_case, section=None) == ["auto"] * cpu_world_size()
    assert cpu_pool.run(initialize_built_layer_case, section={"backend": "comet"}) == ["auto"] * cpu_world_size()
    for message in cpu_pool.run(initialize_built_layer_case, section={"backend": "comet", "overlap": "none"}):
        assert "differs from what these comet layers were built with" in message, message
        assert "deepspeed_moe (overlap: 'auto' (the ds_config: 'none'))" in message, message


@pytest.fixture
def warnings_said(monkeypatch):
    """The warnings ds_comet.config logs from now on (each said once a process, so the record starts empty)."""
    import ds_comet.config as config

    said = []
    monkeypatch.setattr(config.logger, "warning", said.append)
    monkeypatch.setattr(config, "_warned_unread", set())
    return said


@pytest.mark.parametrize("key", ["MoE", "Moe", "moe ", "comet_moe", "moes"])
def test_a_section_key_that_looks_like_moe_is_named(warnings_said, monkeypatch, key):
    """A misspelled section would run stock DeepSpeed without a word: build_moe and ds_comet.initialize,
    where the engine's ds_config is read, name the key."""
    layer = build_moe({key: {"backend": "comet"}}, expert=expert(), **MOE_KWARGS)
    assert type(layer) is deepspeed.moe.layer.MoE  # the section is not read: stock, as asked
    expected = (
        f'ds_config key {key!r} is not read: the MoE backend\'s section is spelled "moe" (lower case, no '
        "spaces), and without one the job runs stock DeepSpeed's MoE"
    )
    assert warnings_said == [expected], warnings_said
    initialize_module = importlib.import_module("ds_comet.initialize")
    monkeypatch.setattr(initialize_module, "_deepspeed_initialize", lambda *a, **k: pytest.fail("not reached"))
    monkeypatch.setattr(importlib.import_module("ds_comet.config"), "_warned_unread", set())
    with pytest.raises(BaseException, match="not reached"):
        ds_comet.initialize(model=torch.nn.Linear(2, 2), config={key: {"backend": "comet"}, "moe": {}})
    assert warnings_said[-1] == f'ds_config key {key!r} is not read: only "moe" is, whose settings stand'


@pytest.mark.parametrize("key", ["fp8", "Overlap"])
def test_a_setting_of_the_section_written_beside_it_is_named(warnings_said, key):
    """A recipe beside "moe" instead of inside it would not run, without a word."""
    config = moe_config_from({key: {"enabled": True}, "moe": {"backend": "comet"}})
    assert not config.fp8.enabled
    setting = key.lower()
    assert warnings_said == [
        f'ds_config key {key!r} is not read at the top level: "{setting}" is a setting of the "moe" section, '
        f'and goes inside it ("moe": {{"{setting}": ...}})'
    ], warnings_said


def test_the_closest_key_ignores_case_first():
    known = ["enabled", "scaling", "fp8", "gemm2"]
    assert closest_key("FP8", known) == "fp8" and closest_key("Enabled", known) == "enabled"
    assert closest_key("scalng", known) == "scaling" and closest_key("SCALNG", known) == "scaling"
    assert closest_key("colour", known) is None


def test_keys_of_other_sections_are_not_taken_for_moe(warnings_said):
    moe_config_from({"comet": {"enabled": False}, "zero_optimization": {}, "moe": {}, "train_batch_size": 8})
    assert warnings_said == []


def test_unknown_expert_parallel_keys_are_named_with_the_closest_known_key(warnings_said):
    """DeepSpeed's AutoEP parser reads the keys it knows and ignores the rest: a misspelled
    autoep_size would run AutoEP at EP 1 without a word."""
    from ds_comet.config import autoep_section_keys

    # Read from DeepSpeed's parser, so that a DeepSpeed that reads other keys is followed.
    assert {"enabled", "autoep_size", "preset_model", "expert_w3", "load_balance_coeff"} <= autoep_section_keys()
    section = {"enabled": True, "autoep_sise": 2, "preset_model": "mixtral", "zzz": 1}
    for _ in range(2):  # once, not once per layer
        moe_config_from({"expert_parallel": section, "moe": {"backend": "comet"}})
    assert warnings_said[0] == (
        "ds_config \"expert_parallel\" key 'autoep_sise' is not one that DeepSpeed's AutoEP reads, and it ignores "
        "it: did you mean 'autoep_size'?"
    ), warnings_said
    assert len(warnings_said) == 2 and "'zzz' is not one that DeepSpeed's AutoEP reads" in warnings_said[1]
    assert "it reads async_split_plan, autoep_size," in warnings_said[1], warnings_said[1]


@pytest.mark.parametrize("backend", ["comet", "deepspeed"])
def test_an_expert_of_another_width_is_refused_when_the_layer_is_built(backend):
    config = {"moe": {"backend": backend}}
    with pytest.raises(
        ValueError, match=r"the expert FeedForward takes rows of 12 features, the layer's hidden_size is 16"
    ):
        build_moe(config, hidden_size=16, expert=FeedForward(12, 32), num_experts=4, k=1)
    with pytest.raises(ValueError, match=r"the expert FeedForward takes rows of 12 features"):
        ds_comet.MoE(16, FeedForward(12, 32), num_experts=4, k=1, config=config)
    wide_out = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 20))
    with pytest.raises(ValueError, match=r"returns rows of 20 features, the layer's hidden_size is 16"):
        build_moe(config, hidden_size=16, expert=wide_out, num_experts=4, k=1)
    # Another class: refused when none of its nn.Linear layers takes the hidden size.
    custom = torch.nn.ModuleDict({"a": torch.nn.Linear(12, 32), "b": torch.nn.Linear(32, 16)})
    with pytest.raises(ValueError, match=r"the expert ModuleDict's nn.Linear layers take rows of 12, 32 features"):
        build_moe(config, hidden_size=16, expert=custom, num_experts=4, k=1)
    # A stock layer of another width, converted by ds_comet.initialize, is refused as well.
    if backend == "deepspeed":
        stock = deepspeed.moe.layer.MoE(16, FeedForward(12, 32), num_experts=4, k=1)
        with pytest.raises(ValueError, match=r"takes rows of 12 features"):
            CometMOELayer.adopt(stock.deepspeed_moe, CometMoEConfig(backend="comet"))
