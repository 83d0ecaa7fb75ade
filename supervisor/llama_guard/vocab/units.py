"""Byte units: one definition for every module that turns bytes into MiB (NVML, GGUF, status)."""

MIB = 2**20
"""Bytes in a mebibyte."""
