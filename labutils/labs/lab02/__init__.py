"""Lab 02, gradient accumulation: the cells' gradient experiments and the batch-split sweeps."""
