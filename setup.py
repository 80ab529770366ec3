# All metadata lives in setup.cfg; pip needs this file to build from source.
from setuptools import setup

setup()
