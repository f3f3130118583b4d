"""Lab 04, memory profiling: saved tensors, profiler and snapshot runs, figures, C6 and C7."""
