"""The MoE pipelines: dispatch, experts and combine of one layer's call.

``ReferencePipeline`` (``reference.py``) runs them in plain torch over any process group and
defines the numbers; ``FusedPipeline`` (``fused.py``) runs the fused COMET kernels on one node;
``PipelineSelection`` (``selection.py``) picks one per call and says why not the fused one
(``policy.py``), with parameters from ``parameters.py`` and a workspace from ``workspace.py``. Both
pipelines take a call as tokens ``[S, H]``, route indices ``[k, S]`` and route weights ``[k, S]``,
and the experts as ``expert_weights.LocalExperts``, whichever integration holds them. Under an
enabled ``"fp8"`` recipe the reference pipeline emulates it (``fp8_emulation.py``).
"""
