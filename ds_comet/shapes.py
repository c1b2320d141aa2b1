"""The MoE layer shapes the benchmarks measure (from shared/device/README.md), by name.

A shape is (H, F, E, k, T): hidden size, expert FFN size, experts, top-k, tokens per rank. This
module imports nothing of the package, so tools that must not import DeepSpeed can load it alone.
"""

SHAPES = {
    "H4096-F14336-E8-k2-T8192": (4096, 14336, 8, 2, 8192),
    "H2048-F1408-E64-k4-T8192": (2048, 1408, 64, 4, 8192),
    "H7168-F2048-E32-k8-T4096": (7168, 2048, 32, 8, 4096),
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
