"""Kernels apart from the models: specdist's C kernels for the CPU (``cpu_kernels.c``, built at install by
``setup.py``, loaded by :mod:`~specdist.models.kernels.cpu_kernels`; their kinds and flags defined once in
:mod:`~specdist.models.kernels.kernel_abi`) and the Triton kernels of the paged attention backend
(:mod:`~specdist.models.kernels.triton_attention`). Each is tested against a torch reference."""
