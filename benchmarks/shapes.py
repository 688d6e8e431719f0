"""Named benchmark suites, shared by benchmarks and GPU tests."""

# (name, M, N, K) GEMM problems of issue 2: square sizes and decode-shaped (skinny) M.
MATMUL_SQUARE = [(f"{s}^3", s, s, s) for s in (1024, 2048, 4096, 8192)]
MATMUL_SKINNY = [("M=16 N=K=8192", 16, 8192, 8192), ("M=128 N=K=8192", 128, 8192, 8192)]
MATMUL_EPILOGUE = [("4096^3 +bias+gelu", 4096, 4096, 4096)]
# (name, batch, M, N, K): jattn.bmm against jnp.matmul and torch.bmm.
MATMUL_BATCHED = [("bmm 16x1024^3", 16, 1024, 1024, 1024),
                  ("bmm 64x512x512x128", 64, 512, 512, 128),
                  ("bmm 4x2048x2048x4096", 4, 2048, 2048, 4096)]

# (name, B, H, L, D) attention problems of issue 3; H is both query and kv heads.
ATTENTION = [("B4 H16 L4096 D128", 4, 16, 4096, 128), ("B4 H32 L4096 D64", 4, 32, 4096, 64),
             ("B1 H16 L16384 D128", 1, 16, 16384, 128)]
ATTENTION_MASKS = ["full", "causal", "sliding1024", "document8", "packed_causal", "alibi",
                   "softcap"]
