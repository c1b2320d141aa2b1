"""Benchmarks and measuring tools (``python -m ds_comet.bench`` for one MoE layer, against stock
DeepSpeed and AutoEP). The runtime does not import this package."""
