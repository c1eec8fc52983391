"""Tests marked gpu: they need an sm_90 GPU and skip with a reason elsewhere (tests/run_gpu.sh runs them)."""
