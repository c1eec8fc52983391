"""Layer 5: the fused multi-GPU ops: tensor parallel (tp: shared helpers; GEMM+ReduceScatter,
GEMM+AllReduce, AllGather+GEMM), ring attention (and the sequence layout), expert parallel MoE."""
