# Only here because the proxy extension is built by cffi (API mode); metadata lives in setup.cfg.
from setuptools import setup

setup()
