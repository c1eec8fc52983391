"""Layer 6: what checks the library as a whole: the main job (python -m mkernel), the runtime self test,
the environment report."""
