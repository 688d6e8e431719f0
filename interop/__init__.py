"""PyTorch bridge for jattn kernels (torch is imported only under this package).

Only the package skeleton exists so far; the torch ops arrive with the interop work (issue 4).
"""
