"""The commands: run, doctor, bench, estimate, regenerate (with its plan and report), distributed."""
