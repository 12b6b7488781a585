from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from vllm.attention.errors import ForwardContextError, InvalidArgumentError
from vllm.forward_context import get_forward_context, is_forward_context_available, set_forward_context


def test_outside_a_context_is_a_clear_error() -> None:
    with pytest.raises(ForwardContextError, match="outside a forward context"):
        get_forward_context()
    assert not is_forward_context_available()


def test_context_holds_per_layer_slot_mappings_and_restores() -> None:
    s = torch.tensor([3, -1, 5])
    with set_forward_context(attn_metadata={}, slot_mapping={"l0": s, "l1": s}) as ctx:
        assert get_forward_context() is ctx
        assert ctx.slot_mapping_for("l1") is s
        with pytest.raises(ForwardContextError, match="'l2'.*l0"):
            ctx.slot_mapping_for("l2")
    with pytest.raises(ForwardContextError):
        get_forward_context()


def test_restored_after_exception_and_nesting() -> None:
    a, b = torch.tensor([1]), torch.tensor([2])
    with set_forward_context(attn_metadata={}, slot_mapping={"l": a}):
        with pytest.raises(RuntimeError):
            with set_forward_context(attn_metadata={}, slot_mapping={"l": b}):
                raise RuntimeError("boom")
        assert get_forward_context().slot_mapping["l"] is a


@pytest.mark.parametrize(
    "bad, match",
    [({"l": torch.tensor([1], dtype=torch.int32)}, "int64"),
     ({"l": torch.zeros(2, 2, dtype=torch.int64)}, r"\[num_tokens\]"),
     ({"l": [1, 2]}, "torch.Tensor")],
)
def test_bad_slot_mapping_rejected(bad: dict[str, object], match: str) -> None:
    with pytest.raises((InvalidArgumentError, TypeError), match=match):
        with set_forward_context(attn_metadata={}, slot_mapping=bad):  # type: ignore[arg-type]
            pass


def test_threads_never_see_each_others_context() -> None:
    errors: list[str] = []
    barrier = threading.Barrier(8)

    def work(i: int) -> None:
        mine = torch.tensor([i], dtype=torch.int64)
        with set_forward_context(attn_metadata={}, slot_mapping={"l": mine}):
            barrier.wait()
            for _ in range(200):
                if int(get_forward_context().slot_mapping["l"][0]) != i:
                    errors.append(f"thread {i} saw another's slots")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_asyncio_tasks_never_see_each_others_context() -> None:
    async def task(i: int) -> int:
        with set_forward_context(attn_metadata={}, slot_mapping={"l": torch.tensor([i])}):
            for _ in range(5):
                await asyncio.sleep(0)
                assert int(get_forward_context().slot_mapping["l"][0]) == i
        return i

    async def main() -> list[int]:
        return list(await asyncio.gather(*(task(i) for i in range(8))))

    assert asyncio.run(main()) == list(range(8))
