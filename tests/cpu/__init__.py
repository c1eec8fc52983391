"""Tests without the gpu marker: they run on any machine (tests/run.sh)."""
