"""The MoE pipelines: dispatch, experts and combine of one layer's call.

``ReferencePipeline`` (``reference.py``) runs them in plain torch over any process group and
defines the numbers; ``FusedPipeline`` (``fused.py``) runs the fused COMET kernels on one node;
``PipelineSelection`` (``selection.py``) picks one per call and says why not the fused one
(``policy.py``), with parameters from ``parameters.py`` and a workspace from
``kernels.workspace``. Both pipelines are a ``Pipeline`` (``interface.py``): the same call, tokens
``[S, H]``, route indices ``[k, S]`` and route weights ``[k, S]``, and what the gate before them may
do, so an integration runs whichever the selection hands it; both take the experts as
``expert_weights.LocalExperts``, whichever integration holds them. Under an
enabled ``"fp8"`` recipe the reference pipeline emulates it (``fp8_emulation.py``).
"""
