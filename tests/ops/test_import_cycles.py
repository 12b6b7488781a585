"""No import cycles among the compute ops' modules (deferred imports included: see
``tests/runner/test_import_cycles.py``, whose graph builder this reuses)."""

from __future__ import annotations

from tests.runner.test_import_cycles import ROOT, cycles, import_graph


def test_ops_have_no_import_cycle() -> None:
    graph = import_graph(ROOT / "vllm" / "attention" / "ops", ROOT)
    # the two modules that used to import each other still depend on what moved down
    assert "vllm.attention.ops.paged_args" in graph["vllm.attention.ops.triton_paged_attention"]
    assert "vllm.attention.ops.paged_args" in graph["vllm.attention.ops.paged_attention"]
    assert cycles(graph) == []
