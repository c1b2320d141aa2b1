"""ds_comet under stock DeepSpeed's ``deepspeed.moe.layer.MoE``: the layer, its gate and the graphed gate."""
