"""TOML parsing on every Python SkyFed runs on: ``tomllib`` (3.11+), else its backport ``tomli`` (3.10, the
Python of JetPack 6 on Jetson boards; the same parser, published by the same author)."""

import sys

if sys.version_info >= (3, 11):
    import tomllib  # novermin - only imported on 3.11+
else:
    import tomli as tomllib

load = tomllib.load
loads = tomllib.loads
TOMLDecodeError = tomllib.TOMLDecodeError
