"""Kernels apart from the models: specdist's C kernels for the CPU (``cpu_kernels.c``, built at install by
``setup.py``, loaded by :mod:`~specdist.models.kernels.cpu_kernels`; their kinds and flags defined once in
:mod:`~specdist.models.kernels.kernel_abi`), the Triton kernels of the paged attention backend
(:mod:`~specdist.models.kernels.triton_attention`) and of a decoder layer's residual adds, norms and SiLU on the
paged CUDA path (:mod:`~specdist.models.kernels.triton_layer`). Each is tested against a torch reference."""
