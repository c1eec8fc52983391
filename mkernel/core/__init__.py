"""Layer 0: errors, environment variables, logging, the tuning knobs. Imports nothing of mkernel."""
