"""The kernels the fused pipeline launches: the CUDA op built from csrc/ (``ops.py``), its constants
(``constants.py``, read from csrc/comet.h), the metadata layout (``layout.py``) and the Triton
GEMMs (``triton_gemm.py``)."""
