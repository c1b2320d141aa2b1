"""The ``"moe"`` section of a ds_config: which MoE backend a job runs and how; and ``read_ds_config``,
which reads a ds_config file as DeepSpeed does.

DeepSpeed ignores top-level keys it does not know, so the section lives beside DeepSpeed's own
ones. It is not called ``"comet"``: DeepSpeed's Comet ML monitor owns that key. Since a misspelled
section would be ignored as silently, ``moe_config_from`` warns, once each, about top-level keys
that look like ``"moe"`` (``"MoE"``, ``"moe "``, ``"comet_moe"``) and about keys of
``"expert_parallel"`` that DeepSpeed's AutoEP parser does not read (``unread_keys_warnings``).
"""

import base64
import binascii
import difflib
import functools
import inspect
import os
import re
from collections.abc import Mapping
from typing import Any, Literal, get_args, get_origin

import hjson
from deepspeed.runtime.config_utils import DeepSpeedConfigModel, dict_raise_error_on_duplicate_keys
from deepspeed.utils import logger
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# Four minutes: the wait and the roll call after it (as long again) end before torch's NCCL
# watchdog, 10 minutes by default for the groups DeepSpeed makes (CometMoEConfig.wait_timeout_s).
DEFAULT_WAIT_TIMEOUT_S = 240.0
# The shortest bound. A healthy job's ranks reach a collective apart by the work one rank does
# alone (rank 0 writes the log and the monitor's files) and by pauses (garbage collection, a busy
# host scheduling a rank late), and a host's wait on gloo or NCCL takes milliseconds even when all
# ranks are there: a bound of milliseconds ends healthy jobs, with every rank waiting in the same
# collective. One second leaves those an order of magnitude.
MIN_WAIT_TIMEOUT_S = 1.0
MOE_SECTION = "moe"
AUTOEP_SECTION = "expert_parallel"
_warned_ignored = set()
_warned_unread = set()
_warned_recipe_off = set()


class Fp8Recipe(DeepSpeedConfigModel):
    """The ``"moe": {"fp8": {...}}`` section: which of the experts' GEMMs run in FP8, how their
    operands are scaled, and whether rows cross the exchange in FP8 (docs/configuration.md).

    The numbers are defined once, in ``ds_comet/fp8.py``; the reference pipeline emulates them
    (``pipelines/fp8_emulation.py``). Combinations that cannot run are refused with the fix.
    """

    model_config = ConfigDict(strict=True)

    enabled: bool = False
    """Run the experts under this recipe."""

    scaling: Literal["blockwise", "rowwise"] = "blockwise"
    """How operands are scaled. ``"blockwise"`` (DeepSeek-V3's, Transformer Engine's
    Float8BlockScaling): rows (activations and gradients) in 1x128 tiles along each GEMM's
    reduction dimension, weights in 128x128 blocks; needs hidden and FFN sizes that are multiples
    of 128. ``"rowwise"`` (torchao's rowwise): one scale per row of activations and gradients, one
    per output channel of a weight in the forward and per input channel in the backward's products
    (the axis the GEMM does not reduce over)."""

    forward: bool = True
    """The forward's two GEMMs (the rows by W1 and W3, the activation by W2) in FP8."""

    input_gradients: bool = True
    """The backward's GEMMs for the input gradients (the output gradient by W2, the gradient of the
    first layer's products by W1 and W3) in FP8."""

    gemm2: bool = True
    """Within ``forward`` and ``input_gradients``, GEMM2 in FP8 too: the activation by W2 (forward)
    and the gradient of the first layer's products by W1 and W3 (backward), the GEMMs whose rows the
    combine takes. ``false``: those two run in high precision and only the first layer's GEMMs (the
    rows by W1 and W3, the output gradient by W2) in FP8."""

    weight_gradients: bool = False
    """The weight gradients' GEMMs (``dW = dA^T x`` over each expert's rows) in FP8, under rowwise
    scaling only: both operands scaled per column over each expert's rows (the channels the product
    does not reduce over), the gradient in ``gradient_format``, as torchao's rowwise MoE recipe
    scales them per group. ``false``: they run in high precision from the operands as the expert's
    rank holds them, as torchao's "rowwise_with_gw_hp" does."""

    gradient_format: Literal["e4m3", "e5m2"] = "e4m3"
    """The format of the gradients' rows in FP8 GEMMs: ``"e4m3"`` (DeepSeek-V3), or ``"e5m2"``
    (Transformer Engine's HYBRID: one exponent bit more, one mantissa bit less). Activations and
    weights are always e4m3."""

    dispatch: Literal["fp8", "bf16"] = "fp8"
    """``"fp8"``: the forward's rows cross the exchange as e4m3 with their scales, the operand of
    the first GEMM as it is (needs ``forward``); the expert's rank then holds only those rows, and
    W1's gradient is taken from them. ``"bf16"``: the rows cross in the tokens' dtype."""

    gradient_dispatch: Literal["fp8", "bf16"] = "bf16"
    """``"fp8"``: the backward's output gradient crosses to the experts' ranks in
    ``gradient_format`` with its scales, the operand of the GEMM by W2 (needs ``input_gradients``):
    each route's row is its gate times the token's quantised row, not quantised again.
    ``"bf16"``: it crosses in the tokens' dtype and each route's row is quantised there."""

    fallback: Literal["error", "bf16"] = "error"
    """Where the recipe cannot run (experts the kernels do not compute, sizes blockwise scaling
    cannot tile, or ``"overlap": "fused"`` where the fused pipeline cannot run FP8): ``"error"``, or
    ``"bf16"``: the layer runs without the recipe, with a warning naming the reason."""

    def __init__(self, **data):
        super().__init__(strict=True, **data)  # as CometMoEConfig: no value spelled "auto" is dropped

    def described(self) -> str:
        """The recipe in a few words, for the job's log line: its scaling and the GEMMs it puts in FP8
        (``"rowwise: forward, input gradients, weight gradients"``; ``", GEMM2 in high precision"``
        with ``"gemm2": false``)."""
        gemms = (("forward", self.forward), ("input gradients", self.input_gradients))
        named = [name for name, on in (*gemms, ("weight gradients", self.weight_gradients)) if on]
        gemm2 = "" if self.gemm2 or not (self.forward or self.input_gradients) else ", GEMM2 in high precision"
        return f"{self.scaling}: {', '.join(named)}{gemm2}"

    @model_validator(mode="after")
    def _refuse_what_cannot_run(self) -> "Fp8Recipe":
        if self.weight_gradients and self.scaling != "rowwise":
            raise ValueError(
                '"weight_gradients": true runs under "scaling": "rowwise" only (on torch._scaled_grouped_mm; the '
                'blockwise recipe\'s kernels have no FP8 weight-gradient GEMM): set "scaling": "rowwise", or '
                '"weight_gradients": false to keep them in high precision'
            )
        if self.enabled and not (self.forward or self.input_gradients or self.weight_gradients):
            raise ValueError(
                'the recipe is enabled with no GEMM in FP8: set "forward", "input_gradients" or "weight_gradients" '
                'to true, or "enabled": false'
            )
        if self.dispatch == "fp8" and not self.forward:
            default = "" if "dispatch" in self.model_fields_set else " (the default)"
            raise ValueError(
                f'"dispatch": "fp8"{default} sends the rows as the forward\'s FP8 GEMM takes them, and "forward" is '
                'false: set "dispatch": "bf16", or "forward": true'
            )
        if self.gradient_dispatch == "fp8" and not self.input_gradients:
            raise ValueError(
                '"gradient_dispatch": "fp8" sends the output gradient as the backward\'s FP8 GEMM takes it, and '
                '"input_gradients" is false: set "gradient_dispatch": "bf16", or "input_gradients": true'
            )
        # A setting that can change nothing is refused, not ignored: it says the user meant another recipe.
        if "gradient_format" in self.model_fields_set and not (self.input_gradients or self.weight_gradients):
            raise ValueError(
                '"gradient_format" is the format of the gradients in the FP8 input-gradient and weight-gradient '
                'GEMMs, and neither runs in FP8 ("input_gradients" and "weight_gradients" are false): remove it, '
                "or set one of them to true"
            )
        if "gemm2" in self.model_fields_set and not (self.forward or self.input_gradients):
            raise ValueError(
                '"gemm2" chooses GEMM2\'s precision within "forward" and "input_gradients", and both are false: '
                "remove it, or set one of them to true"
            )
        return self


class CometMoEConfig(DeepSpeedConfigModel):
    """The ``"moe"`` section of a ds_config, validated; every key is optional.

    Made by ``moe_config_from(ds_config)`` (a dict, a JSON path, a ``DeepSpeedConfig``, an engine),
    or from the section's keys directly: ``CometMoEConfig(backend="comet", overlap="fused")``. Each
    field's own docstring below says what it does; docs/configuration.md is the users' reference.

    Args:
        **data: the section's keys and their JSON values (str, int, float, bool; null for the
            rule's choice where a key has a rule). A value of the wrong type or an unknown key
            raises pydantic's ``ValidationError``, which ``moe_config_from`` turns into a
            ``ValueError`` naming the key and the values it takes.

    Attributes:
        backend: ``"deepspeed"`` (stock MoE) or ``"comet"`` (this package's layers).
        overlap: ``"auto"``, ``"fused"`` or ``"none"``: which pipeline the comet layers may run.
        comm_blocks, combine_blocks: int or None: thread blocks of the fused dispatch and combine.
        tile_m, tile_n: int (tile_n None for the rule): the fused GEMMs' tile.
        n_chunks: int or None: GEMM2's column chunks.
        max_tokens_per_rank: int or None: sizes the fused workspace.
        activation_rows: ``"bound"`` or ``"received"``: how the fused pipeline sizes activations.
        internode_chunks, internode_forwarding: int or None, bool: the reference pipeline's
            exchange where the group spans nodes.
        internode_hybrid: bool: where the group spans nodes, the fused kernels among each node's
            ranks (the hybrid pipeline).
        cuda_graph_gate: bool: replay the DeepSpeed gate from CUDA graphs on the fused path.
        wait_timeout_s: float seconds: the longest wait on a peer rank.
    """

    # A JSON value of the wrong type (true or "8" for a count, "yes" for a flag) is an error, not
    # converted; an integer is still a valid number of seconds.
    model_config = ConfigDict(strict=True)

    backend: Literal["deepspeed", "comet"] = "deepspeed"
    """``"deepspeed"``: stock ``deepspeed.moe.layer.MoE``. ``"comet"``: this package's layer."""

    overlap: Literal["auto", "fused", "none"] = "auto"
    """How the comet backend overlaps communication with the experts.

    ``"none"``: the reference pipeline (plain torch, any torch.distributed backend).
    ``"fused"``: the fused COMET kernels, an error where they cannot run.
    ``"auto"``: fused where it can run, else the reference pipeline, saying once why.
    """

    comm_blocks: int | None = Field(None, ge=1)
    """Thread blocks that dispatch tokens while the rest run GEMM1 (default: a rule on the layer's shape)."""

    combine_blocks: int | None = Field(None, ge=1)
    """Thread blocks that combine expert outputs while the rest run GEMM2 (default: a rule); at most
    ``comm_blocks``, which a larger value is lowered to."""

    tile_m: Literal[64, 128] = 128
    """Rows of a GEMM tile: the granularity at which arriving tokens start their GEMM."""

    tile_n: Literal[64, 128, 256] | None = None
    """Columns of a GEMM tile, for both GEMMs (default: a rule, 256 for both, 128 for a gated GEMM1)."""

    n_chunks: int | None = Field(None, ge=1, le=64)
    """Column chunks of GEMM2; the combine of chunk j overlaps GEMM2 of chunk j+1 (default: a rule)."""

    max_tokens_per_rank: int | None = Field(None, ge=1)
    """Most tokens one rank feeds one MoE layer; sizes the fused workspace (default: the first call's)."""

    activation_rows: Literal["bound", "received"] = "bound"
    """How the fused pipeline sizes a call's activations (kept for the backward when training: the
    received rows, their expert outputs and the products before the activation).
    ``"bound"``: by the most rows a rank can receive in one call (the gate's capacity; without
    dropping, as AutoEP runs, every rank's tokens once per local expert they pick), with no host
    sync. ``"received"``: by the rows the call received, read back to the host once per layer call
    after the counts are exchanged (the fused path's one host sync; under CUDA graph capture the
    bound). Without dropping at EP 4 and up the bound is several times the rows that arrive."""

    internode_chunks: int | None = Field(None, ge=1, le=64)
    """Chunks the rows travel in when the expert-parallel group spans nodes: the experts of one chunk
    run while the next is exchanged (default: a rule, 2 to 8 by the routes a rank sends; 1 sends
    them whole)."""

    internode_forwarding: bool = False
    """Where the expert-parallel group spans nodes: send each token once to each node that holds one
    of its experts (to that node's rank in the sender's lane) and forward it inside the node, rather
    than once to each rank; each node returns one row a token. Fewer rows cross between nodes (the
    cost model in docs/design.md), for two exchanges each way. Needs the group's ranks to fill its
    nodes in order, the same number each; otherwise the rows go to each rank, with a warning."""

    internode_hybrid: bool = True
    """Where the expert-parallel group spans nodes: run the fused kernels among each node's ranks on
    the routes to that node's experts, and the reference pipeline's exchange (chunked, forwarded if
    ``internode_forwarding``) between nodes on the others (the hybrid pipeline,
    ``pipelines/hybrid.py``). Needs the group's ranks to fill its nodes in order, two or more each,
    and the fused pipeline's conditions on every rank. ``False``: the reference pipeline for the whole
    group."""

    cuda_graph_gate: bool = False
    """Replay the gate's routing from CUDA graphs on the fused path: bit for bit the same routes,
    gates, aux loss and gradients, 0.24-0.53 ms less per forward and 0.43-0.59 ms less per training
    step of one layer on 2 x H200 (the bench's shapes), for memory its graphs hold permanently
    (about 6 bytes x tokens x hidden per layer; 218-326 MiB reserved at the bench's shapes;
    ds_comet/integrations/legacy/gate_graph.py)."""

    wait_timeout_s: float = Field(DEFAULT_WAIT_TIMEOUT_S, ge=MIN_WAIT_TIMEOUT_S, le=1e6, allow_inf_nan=False)
    """Longest a layer waits for a peer rank before it raises: a fused kernel's wait (the kernels
    count it in 64-bit nanoseconds), or any of the reference pipeline's waits on its group or of
    the group's agreement at a layer's first call (which then look as long again for the ranks that
    stalled, to name them). At least a second (``MIN_WAIT_TIMEOUT_S``: less ends healthy jobs). The
    default lets a rank fall behind its peers by four minutes (a slow batch, a checkpoint or an
    evaluation on one rank) without ending the job, and ends the wait and that roll call before
    torch's NCCL watchdog (10 minutes for the expert groups DeepSpeed makes) would abort the
    process without naming the rank. Past 300 s the watchdog may come first, unless the script
    starts its process groups with ``ds_comet.launch.init_distributed(ds_config=...)``, which also
    bounds the script's own collectives by it and sets the process groups' timeout to
    2 x ``wait_timeout_s`` + 10 s (``ds_comet.collectives``), whatever the backend."""

    fp8: Fp8Recipe = Field(default_factory=Fp8Recipe)
    """The FP8 recipe of the experts' GEMMs and the exchange's rows (off by default)."""

    def __init__(self, **data):
        # strict: DeepSpeedConfigModel otherwise drops every value spelled "auto", which would
        # turn a mistyped {"backend": "auto"} into the default instead of an error.
        super().__init__(strict=True, **data)


def _owner(path: tuple) -> type[BaseModel] | None:
    """The section model that holds the last key of ``path`` (a location inside the "moe" section)."""
    model = CometMoEConfig
    for part in path[:-1]:
        field = model.model_fields.get(part)
        annotation = field.annotation if field is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _allowed_values(path: tuple):
    model = _owner(path)
    field = model.model_fields.get(path[-1]) if model is not None and path else None
    annotation = field.annotation if field is not None else None
    return get_args(annotation) if get_origin(annotation) is Literal else None


def _explain(error: ValidationError, section: Mapping[str, Any]) -> str:
    lines = []
    for item in error.errors():
        path = tuple(item["loc"])
        key = ".".join(str(part) for part in (MOE_SECTION, *path))
        if item["type"] == "extra_forbidden":
            owner = _owner(path)
            allowed_keys = ", ".join(owner.model_fields) if owner is not None else ""
            where = "the section" if len(path) == 1 else f"'{key.rpartition('.')[0]}'"
            known = list(owner.model_fields) if owner is not None else []
            close = closest_key(path[-1], known)
            hint = f"; did you mean {close!r}?" if close else ""
            lines.append(f"unknown key '{key}'{hint}; {where} takes: {allowed_keys}")
            continue
        if item["type"] == "value_error":  # a section's own check: its message names the fix
            lines.append(f"'{key}': {item['ctx']['error']}")
            continue
        if item["type"] == "model_type":
            lines.append(f"'{key}' must be a JSON object, got {item.get('input')!r}")
            continue
        allowed = _allowed_values(path)
        value = _value_at(section, path, item.get("input"))
        if allowed:
            choices = ", ".join(repr(v) for v in allowed)
            lines.append(f"'{key}' is {value!r}; allowed values: {choices}")
        else:
            lines.append(f"'{key}' is {value!r}: {item['msg']}")
    return "invalid ds_config: " + "; ".join(lines)


def _value_at(section: Mapping[str, Any], path: tuple, default):
    """The value the user wrote at ``path`` inside the section, else ``default``."""
    value = section
    for part in path:
        if not isinstance(value, Mapping) or part not in value:
            return default
        value = value[part]
    return value


def _config_dict(ds_config) -> Mapping[str, Any]:
    """The ds_config as a dict, from any of the forms DeepSpeed users hold it in."""
    if ds_config is None:
        return {}
    if isinstance(ds_config, Mapping):
        return ds_config
    if isinstance(ds_config, (str, os.PathLike)):
        return read_ds_config(ds_config)
    # DeepSpeedConfig keeps the parsed JSON in _param_dict.
    param_dict = getattr(ds_config, "_param_dict", None)
    if isinstance(param_dict, Mapping):
        return param_dict
    # A DeepSpeedEngine: .config is what the user passed to deepspeed.initialize.
    engine_config = getattr(ds_config, "config", None)
    if engine_config is not None and engine_config is not ds_config:
        return _config_dict(engine_config)
    raise TypeError(
        f"cannot read a ds_config from {type(ds_config).__name__}: pass a dict, a path to a JSON file, "
        "a deepspeed DeepSpeedConfig, a DeepSpeed engine or a CometMoEConfig"
    )


def read_ds_config(source: str | os.PathLike) -> dict[str, Any]:
    """A ds_config, read as DeepSpeed's ``DeepSpeedConfig`` reads the string it is given.

    HJSON, so comments and trailing commas are allowed; in a file a key given twice in one object is
    an error, as in DeepSpeed (which does not check the keys of a base64 string).

    Args:
        source: a path to an HJSON (or JSON) file, or a base64-encoded config (DeepSpeed's
            ``--deepspeed_config`` takes either).

    Returns:
        The config as a dict.

    Raises:
        ValueError: the file is no valid HJSON, repeats a key, or holds another value than an object;
            the message names the file.
        FileNotFoundError: ``source`` is neither an existing file nor a base64-encoded config.
        OSError: the file exists but cannot be read.
    """
    if os.path.exists(source):
        try:
            with open(source) as handle:
                loaded = hjson.load(handle, object_pairs_hook=dict_raise_error_on_duplicate_keys)
        except ValueError as error:  # hjson's decode errors and the duplicate keys' error
            raise ValueError(f"invalid ds_config file {os.fspath(source)}: {error}") from None
        if not isinstance(loaded, Mapping):
            raise ValueError(
                f"invalid ds_config file {os.fspath(source)}: it holds a {type(loaded).__name__}, not a JSON object"
            )
        return dict(loaded)
    try:
        loaded = hjson.loads(base64.urlsafe_b64decode(os.fspath(source)).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, binascii.Error):
        loaded = None
    if not isinstance(loaded, Mapping):  # HJSON reads most garbage as a quoteless string
        raise FileNotFoundError(
            f"ds_config {os.fspath(source)!r} is neither an existing file nor a base64-encoded JSON config"
        )
    return dict(loaded)


def moe_config_from(ds_config=None) -> CometMoEConfig:
    """The validated ``"moe"`` section of ``ds_config`` (defaults where it has none)."""
    if isinstance(ds_config, CometMoEConfig):
        return ds_config
    whole = _config_dict(ds_config)
    for message in unread_keys_warnings(whole):
        if message not in _warned_unread:  # once, not once per MoE layer
            _warned_unread.add(message)
            logger.warning(message)
    section: Any | None = whole.get(MOE_SECTION, {})
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise ValueError(f"invalid ds_config: '{MOE_SECTION}' must be a JSON object, got {type(section).__name__}")
    try:
        config = CometMoEConfig(**section)
    except ValidationError as error:
        raise ValueError(_explain(error, section)) from None
    # wait_timeout_s also bounds a script's own collectives (ds_comet.collectives), whatever the backend.
    ignored = tuple(sorted(key for key in section if key not in ("backend", "wait_timeout_s")))
    if config.backend == "deepspeed" and ignored and ignored not in _warned_ignored:
        _warned_ignored.add(ignored)  # once, not once per MoE layer
        logger.warning(
            f'ds_config \'{MOE_SECTION}\' keys {", ".join(ignored)} only apply to "backend": "comet"; '
            "this job runs stock DeepSpeed's MoE and ignores them"
        )
    recipe_keys = tuple(sorted(config.fp8.model_fields_set))
    if (
        config.backend == "comet"
        and recipe_keys
        and "enabled" not in recipe_keys
        and recipe_keys not in _warned_recipe_off
    ):
        _warned_recipe_off.add(recipe_keys)  # a section written without "enabled" most likely meant to run
        logger.warning(
            f"ds_config '{MOE_SECTION}.fp8' sets {', '.join(recipe_keys)} but not \"enabled\", which is false by "
            'default: the recipe does not run; set "enabled": true to run it (or "enabled": false to keep it off '
            "without this warning)"
        )
    return config


def closest_key(key, known: list[str]) -> str | None:
    """The key of ``known`` that ``key`` most likely meant: one that differs only in case, else the
    closest spelling (difflib's, case ignored), else None."""
    by_lower = {name.lower(): name for name in known}
    lowered = str(key).lower()
    close = difflib.get_close_matches(lowered, list(by_lower), n=1, cutoff=0.6)
    return by_lower.get(lowered) or (by_lower[close[0]] if close else None)


def _looks_like_moe(key: str) -> bool:
    """Whether top-level ``key``, not ``"moe"`` itself, was likely meant as the section: ``"moe"``
    in other case or with spaces, one edit away from it, or a word of it (``"comet_moe"``)."""
    if key == MOE_SECTION or not isinstance(key, str):
        return False
    name = key.strip().lower()
    if name == MOE_SECTION or MOE_SECTION in re.split(r"[^a-z0-9]+", name):
        return True
    return _within_one_edit(name, MOE_SECTION)


def _within_one_edit(a: str, b: str) -> bool:
    if abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b)) <= 1
    shorter, longer = sorted((a, b), key=len)
    return any(longer[:i] + longer[i + 1 :] == shorter for i in range(len(longer)))


@functools.cache
def autoep_section_keys() -> frozenset[str]:
    """The keys of ``"expert_parallel"`` that DeepSpeed's AutoEP parser reads, from its source, so
    that a DeepSpeed that reads other keys is followed; empty for a DeepSpeed without AutoEP."""
    try:
        from deepspeed.module_inject.auto_ep_config import parse_autoep_config
    except ImportError:
        return frozenset()
    source = inspect.getsource(parse_autoep_config)
    # param_dict.get("key", ...), param_dict["key"] and "key" in param_dict
    found = re.findall(r'param_dict(?:\.get\(|\[)"(\w+)"|"(\w+)" in param_dict', source)
    return frozenset(key for pair in found for key in pair if key)


def unread_keys_warnings(ds_config: Mapping[str, Any]) -> list[str]:
    """What to tell the user of a ds_config (a dict) whose keys nothing reads, though they look
    meant for a section that is read: top-level keys like ``"moe"`` (``"MoE"``, ``"moe "``,
    ``"comet_moe"``), settings of that section written beside it (``"fp8"``), and keys of
    ``"expert_parallel"`` that DeepSpeed's AutoEP parser does not read (it ignores them: a
    misspelled ``"autoep_size"`` runs at EP 1), each with the closest key that is read."""
    messages = []
    for key in ds_config:
        if _looks_like_moe(key):
            if MOE_SECTION in ds_config:
                read = f'only "{MOE_SECTION}" is, whose settings stand'
            else:
                read = (
                    f'the MoE backend\'s section is spelled "{MOE_SECTION}" (lower case, no spaces), and without '
                    "one the job runs stock DeepSpeed's MoE"
                )
            messages.append(f"ds_config key {key!r} is not read: {read}")
        elif isinstance(key, str) and key.lower() in CometMoEConfig.model_fields:
            setting = key.lower()
            messages.append(
                f'ds_config key {key!r} is not read at the top level: "{setting}" is a setting of the '
                f'"{MOE_SECTION}" section, and goes inside it ("{MOE_SECTION}": {{"{setting}": ...}})'
            )
    section = ds_config.get(AUTOEP_SECTION)
    known = autoep_section_keys()
    if isinstance(section, Mapping) and known:
        for key in section:
            if key in known:
                continue
            close = closest_key(key, sorted(known))
            hint = f"did you mean {close!r}?" if close else f"it reads {', '.join(sorted(known))}"
            messages.append(
                f'ds_config "{AUTOEP_SECTION}" key {key!r} is not one that DeepSpeed\'s AutoEP reads, and it '
                f"ignores it: {hint}"
            )
    return messages
