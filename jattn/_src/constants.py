"""Named constants shared by every op."""

# Environment variable that overrides the platform's default implementation.
IMPLEMENTATION_ENV = "JATTN_IMPLEMENTATION"

# Triton's dot needs at least 16 rows and columns per operand tile.
MIN_DOT_TILE = 16

# exp(x) == exp2(x * LOG2_E): kernels run the softmax in base 2 (exp2 is one instruction).
LOG2_E = 1.4426950408889634

# Finite stand-in for -inf on masked scores, so running-max updates never compute -inf - -inf.
MASK_VALUE = -0.7 * 3.4028234663852886e38
