"""Layer 3 (on runtime): the single-GPU engines the fused ops build on: the Hopper GEMM (plain and
grouped) and the attention forward."""
