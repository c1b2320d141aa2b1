"""python -m ds_comet.bench: one MoE layer against stock DeepSpeed and AutoEP (see ds_comet/bench/layer.py)."""

from .layer import main

main()
