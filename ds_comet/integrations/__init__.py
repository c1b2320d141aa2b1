"""Where DeepSpeed's MoE layers meet ds_comet's pipelines: ``legacy`` (``deepspeed.moe.layer.MoE``)
and ``autoep`` (DeepSpeed AutoEP's ``AutoEPMoELayer``); ``layer_classes`` is the table of which
DeepSpeed class each comet class replaces, which every user of that knowledge reads."""
