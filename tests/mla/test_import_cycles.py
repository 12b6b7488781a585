"""No import cycle runs through the MLA modules (deferred and ``TYPE_CHECKING``
imports included, as in ``tests/runner/test_import_cycles.py``)."""

from __future__ import annotations

from tests.runner.test_import_cycles import ROOT, cycles, import_graph

MLA_PREFIXES = ("vllm.attention.backends.mla", "vllm.attention.ops.mla",
                "vllm.attention.ops.triton_mla")


def test_mla_modules_are_in_no_import_cycle() -> None:
    graph = import_graph(ROOT / "vllm" / "attention", ROOT)
    # the spec both the backends and the vendor kernels read sits below them
    spec = "vllm.attention.backends.mla.spec"
    assert spec in graph["vllm.attention.ops.mla_vendor"]
    assert spec in graph["vllm.attention.backends.mla.common"]
    found = [c for c in cycles(graph) if any(m.startswith(MLA_PREFIXES) for m in c)]
    assert found == []
