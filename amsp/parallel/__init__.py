"""Model parallelism beside AMSP: the mesh of TP/PP/DP groups, tensor + sequence parallelism and
pipeline stages, all applied to the pure model from outside."""
