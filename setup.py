# Only here because the proxy extension is built by cffi (API mode); metadata lives in setup.cfg.
from setuptools import setup

setup(cffi_modules=["mkernel/verbs/build_proxy.py:ffibuilder"])
