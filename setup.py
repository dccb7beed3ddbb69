"""Build hook: generate the gRPC stubs from protos/ before packages are collected."""
import runpy

from setuptools import setup

runpy.run_path("protos/generate.py")["generate"]()
setup()
