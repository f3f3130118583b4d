"""A training step's peak memory predicted without a GPU (the replay), and what fits a budget."""
