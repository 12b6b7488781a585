"""No import cycle anywhere in ``vllm`` and ``shim``, the two packages taken together
(deferred and ``TYPE_CHECKING`` imports included; the graph builder and its own tests
are in ``tests/runner/test_import_cycles.py``)."""

from __future__ import annotations

from tests.runner.test_import_cycles import ROOT, cycles, import_graph


def test_vllm_and_shim_have_no_import_cycle() -> None:
    # the two packages only: a virtual environment or a build folder in the checkout
    # holds other code (site-packages, some of it not even this Python's syntax)
    graph = import_graph(ROOT / "vllm", ROOT, ROOT / "shim")
    ours = {m: deps for m, deps in graph.items() if m.split(".")[0] in ("vllm", "shim")}
    assert "shim.adapter" in graph["vllm.attention.registry"]  # the packages do meet
    found = [c for c in cycles(graph) if any(m in ours for m in c)]
    assert found == [], found
