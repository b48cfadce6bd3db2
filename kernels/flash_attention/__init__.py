from . import kernel, reference, tiling
