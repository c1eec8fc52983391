"""The test suite (a package: its modules import each other as ``tests.*``, never through sys.path)."""
