"""One thin launch wrapper module per kernels_cu/*.cu file, named after it. A wrapper takes the KernelLibrary
(engine/cuda/library.py) first, checks its arguments' shapes, dtypes, contiguity and alignment
(engine/cuda/checks.py; a refusal raises KernelArgError naming the argument), then launches the kernel the
library hands out by name on the current torch stream (`lib.stream()`). Each module also holds its kernels'
launch constants and the heuristics that size their grids."""
