"""The model family the course trains (GPT-2 and tiny), where weights come from, the spec of any model."""
