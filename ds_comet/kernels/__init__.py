"""The kernels and their launches: the CUDA op built from csrc/ (``ops.py``), its constants
(``constants.py``, read from csrc/comet.h) and the metadata layout (``layout.py``); the group's
workspace (``workspace.py``), the fused dispatch's routing plan (``routing_plan.py``), the experts'
weight view (``fused_experts.py``) and the launches of one call (``launch.py``); the GEMM phases
(``gemm_phases.py``) and their implementations, chosen per phase from one table (``gemm_table.py``:
``triton_phases.py`` on the Triton GEMMs of ``triton_gemm.py`` and ``triton_activation.py``,
``library_phases.py`` on torch's grouped GEMM). Nothing here imports ``pipelines`` or
``integrations``."""
