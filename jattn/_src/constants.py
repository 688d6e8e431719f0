"""Named constants shared by every op."""

# The names accepted by every op's `implementation=` argument.
IMPLEMENTATIONS = ("pallas_triton", "xla", "interpret")

# Environment variable that overrides the platform's default implementation.
IMPLEMENTATION_ENV = "JATTN_IMPLEMENTATION"

# Triton's dot needs at least 16 rows and columns per operand tile.
MIN_DOT_TILE = 16
