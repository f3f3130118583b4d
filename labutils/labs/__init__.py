"""The labs: the registry (each lab's notebook, runs and claims) and one folder of helpers per lab."""
