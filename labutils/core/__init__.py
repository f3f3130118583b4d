"""The one training loop and what it measures with: config, precisions, device, memory, FLOPs, results."""
