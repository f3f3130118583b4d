"""Lab 03, gradient checkpointing: the variants, each trained and checked, and the lab's report."""
