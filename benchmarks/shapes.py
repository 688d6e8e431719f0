"""Named benchmark suites, shared by benchmarks and GPU tests."""

# (name, M, N, K) GEMM problems of issue 2: square sizes and decode-shaped (skinny) M.
MATMUL_SQUARE = [(f"{s}^3", s, s, s) for s in (1024, 2048, 4096, 8192)]
MATMUL_SKINNY = [("M=16 N=K=8192", 16, 8192, 8192), ("M=128 N=K=8192", 128, 8192, 8192)]
MATMUL_EPILOGUE = [("4096^3 +bias+gelu", 4096, 4096, 4096)]
