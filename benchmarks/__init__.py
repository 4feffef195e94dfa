"""Benchmarks of fxsplit against Hugging Face Accelerate and the block-level optimum.

Run ``python benchmarks/run.py [--quick]``; see ``benchmarks/README.md``.
"""
