"""Legacy backends written against the interface of public upstream code, run unchanged
through the adapter.

Each module cites the code whose interface it keeps (repository, commit, path): its
framework imports, class and method names, signatures, metadata fields and calls into
the framework. The code is this project's own; the CUDA / vendor kernels it calls come
from :mod:`.kernels` under upstream's names.
"""
