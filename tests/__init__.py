"""The test suite, a package: tests/cpu (no gpu marker), tests/gpu (marked gpu), and tests/helpers, which
the test files import explicitly (``from tests.helpers.arrays import dev``); no test file imports another.
pytest imports the files as ``tests.cpu.test_x`` from the repository root; a file run as a program runs
as a module from there too (``python3 -m tests.gpu.test_attention_gpu --child all``)."""
