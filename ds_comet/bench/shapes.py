"""The MoE layer shapes the benchmarks measure, by name.

A shape is (H, F, E, k, T): hidden size, expert FFN size, experts, top-k, tokens per rank. The
first three are the shapes the fused pipeline was tuned on (GELU FFN experts unless ``--gated``);
the last three are those of models DeepSpeed AutoEP converts (SwiGLU experts always: ``SWIGLU``).
"""

SHAPES = {
    "H4096-F14336-E8-k2-T8192": (4096, 14336, 8, 2, 8192),
    "H2048-F1408-E64-k4-T8192": (2048, 1408, 64, 4, 8192),
    "H7168-F2048-E32-k8-T4096": (7168, 2048, 32, 8, 4096),
    "mixtral-H4096-F14336-E8-k2-T8192": (4096, 14336, 8, 2, 8192),
    "qwen3-30b-a3b-H2048-F768-E128-k8-T8192": (2048, 768, 128, 8, 8192),
    "gpt-oss-H2880-F2880-E32-k4-T8192": (2880, 2880, 32, 4, 8192),
}
# Shapes of models whose experts are SwiGLU, and the AutoEP preset whose Hugging Face block stands
# for them in the AutoEP rows (gpt-oss's own activation is a clamped SwiGLU that the fused kernels
# do not compute: its shape runs with Mixtral's block).
SWIGLU = {
    "mixtral-H4096-F14336-E8-k2-T8192": "mixtral",
    "qwen3-30b-a3b-H2048-F768-E128-k8-T8192": "qwen3_moe",
    "gpt-oss-H2880-F2880-E32-k4-T8192": "mixtral",
}


def selected_shapes(names, custom):
    """The named default shapes (all of them when neither names nor custom are given) and the
    custom ones, each "H,F,E,K,T"."""
    shapes = {name: SHAPES[name] for name in (names or ([] if custom else SHAPES))}
    for spec in custom:
        values = tuple(int(v) for v in spec.split(","))
        if len(values) != 5:
            raise SystemExit(f"--custom takes H,F,E,K,T, got {spec!r}")
        shapes["H{}-F{}-E{}-k{}-T{}".format(*values)] = values
    return shapes
