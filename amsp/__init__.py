"""AMSP: the data-parallel layer (independent P/G/OS sharding, hierarchical collectives)."""
