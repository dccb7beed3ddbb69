"""The GPU backend: kernels_cu/ compiled to fatbins (build.py), loaded and launched through cuda-python
(kernels.py), exposed to the model as CudaOps (ops.py), on the engine's own streams (streams.py).

Importing this package needs neither a GPU nor cuda-python; loading the kernels does."""
