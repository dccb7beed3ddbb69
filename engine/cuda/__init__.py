"""The GPU backend: kernels_cu/ compiled to fatbins (build.py, or NVRTC at start-up), loaded through
cuda-python (library.py; driver calls and launches in driver.py), launched by one thin wrapper module per
.cu file (wrappers/, with the argument checks they share in checks.py), exposed to the model as CudaOps
(ops.py), on the engine's own streams (streams.py), replayed from CUDA graphs (graphs.py).

Importing this package needs neither a GPU nor cuda-python; loading the kernels does."""
