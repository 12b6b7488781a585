"""The MLA family: one thin module per backend over :mod:`.common`.

Each module declares its capabilities as class data and names its vendor decode
kernel; the shared impl runs that kernel when it can, else the portable Triton /
torch paths over the same cache (``docs/mla.md``).
"""
