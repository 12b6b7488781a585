"""Real legacy backends transcribed from public code, run unchanged through the adapter.

Each module cites its source (repository, commit, path) and lists what was changed: only
the CUDA / vendor kernel imports, which come from :mod:`.kernels` under the same names.
"""
