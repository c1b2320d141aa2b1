"""Where DeepSpeed's MoE layers meet ds_comet's pipelines: ``legacy`` (``deepspeed.moe.layer.MoE``)
and ``autoep`` (DeepSpeed AutoEP's ``AutoEPMoELayer``)."""
