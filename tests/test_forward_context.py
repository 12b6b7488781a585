from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
import torch

from vllm.attention.backend import PagedAttentionMetadata
from vllm.attention.backends.torch_ref import TorchRefBackend
from vllm.attention.batch import PagedBatch, make_paged_batch
from vllm.attention.errors import ForwardContextError, InvalidArgumentError
from vllm.attention.layer import Attention
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


# ---------------------------------------------------------------- layers under concurrency

WORKERS, BS, H, D = 8, 16, 2, 8


@dataclass
class Worker:
    """One thread's / task's step: its own requests (own blocks of the shared cache),
    slot mapping, metadata, inputs; what its connector saw; its outputs."""

    batch: PagedBatch
    meta: PagedAttentionMetadata
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    seen: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)

    def on_kv_written(self, layer_name: str, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
        self.seen.append(slot_mapping)

    def context(self) -> object:
        return set_forward_context(attn_metadata={"l0": self.meta},
                                   slot_mapping={"l0": self.batch.new_slots}, kv_connector=self)


def _shared_layer_and_workers() -> tuple[Attention, torch.Tensor, list[Worker]]:
    """One layer and one cache; worker ``i`` owns blocks ``[6 i, 6 i + 6)``."""
    layer = Attention(num_heads=4, num_kv_heads=H, head_size=D, scale=0.3,
                      backend=TorchRefBackend, layer_name="l0")
    cache = torch.zeros(6 * WORKERS, 2, BS, H, D)
    layer.bind_kv_cache(cache, BS)
    workers = []
    for i in range(WORKERS):
        g = torch.Generator().manual_seed(i)
        batch = make_paged_batch([3 + i, 1], [0, 5 + 2 * i], block_size=BS, num_blocks=6,
                                 generator=g)
        offset = 6 * i  # move the request's blocks into this worker's range
        shifted = dataclasses.replace(
            batch, common=dataclasses.replace(batch.common,
                                              block_table=batch.common.block_table + offset),
            new_slots=batch.new_slots + offset * BS,
            context_slots=batch.context_slots + offset * BS,
        )
        meta = TorchRefBackend.get_builder_cls()(layer.spec, torch.device("cpu")).build(
            shifted.common)
        n = shifted.new_slots.shape[0]
        workers.append(Worker(shifted, meta, torch.randn(n, 4, D, generator=g),
                              torch.randn(n, H, D, generator=g) + 100 * i,
                              torch.randn(n, H, D, generator=g) - 100 * i))
    return layer, cache, workers


def _check_workers(layer: Attention, cache: torch.Tensor, workers: list[Worker]) -> None:
    """Each worker's rows are in its own slots, its connector saw only its own slot
    mapping, and its outputs equal a single-threaded run over the final cache."""
    for i, w in enumerate(workers):
        assert w.seen and all(s is w.batch.new_slots for s in w.seen), f"worker {i}"
        for j, slot in enumerate(w.batch.new_slots.tolist()):
            assert torch.equal(cache[slot // BS, 0, slot % BS], w.k[j]), (i, slot)
            assert torch.equal(cache[slot // BS, 1, slot % BS], w.v[j]), (i, slot)
    for w in workers:  # the reference, one at a time: the same writes, then attention
        with w.context():
            want = layer(w.q, w.k, w.v)
        assert all(torch.equal(out, want) for out in w.outputs)


def test_threads_write_and_attend_through_one_layer_with_their_own_slots() -> None:
    """8 threads share one layer and one cache; each step reads its own slot mapping
    from the context (never another thread's), so each thread's K/V land in its own
    blocks and its attention output is the single-threaded one."""
    layer, cache, workers = _shared_layer_and_workers()
    barrier = threading.Barrier(WORKERS)
    errors: list[BaseException] = []

    def run(w: Worker) -> None:
        try:
            for _ in range(20):
                with w.context():
                    barrier.wait(timeout=30)  # every thread is inside its own context now
                    w.outputs.append(layer(w.q, w.k, w.v))
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    _check_workers(layer, cache, workers)


def test_asyncio_tasks_write_and_attend_through_one_layer_with_their_own_slots() -> None:
    """Concurrent tasks that yield inside their contexts (between steps and between
    entering the context and calling the layer) each see only their own."""
    layer, cache, workers = _shared_layer_and_workers()

    async def run(w: Worker) -> None:
        for _ in range(10):
            with w.context():
                await asyncio.sleep(0)
                w.outputs.append(layer(w.q, w.k, w.v))
                await asyncio.sleep(0)
                assert get_forward_context().slot_mapping["l0"] is w.batch.new_slots

    async def main() -> None:
        await asyncio.gather(*(run(w) for w in workers))

    asyncio.run(main())
    _check_workers(layer, cache, workers)


def test_context_restored_after_exceptions_in_threads_and_tasks() -> None:
    def step(i: int) -> None:
        outer = torch.tensor([i])
        with set_forward_context(attn_metadata={}, slot_mapping={"l": outer}):
            for _ in range(50):
                with pytest.raises(ZeroDivisionError):
                    with set_forward_context(attn_metadata={},
                                             slot_mapping={"l": torch.tensor([-i])}):
                        raise ZeroDivisionError
                assert get_forward_context().slot_mapping["l"] is outer
        assert not is_forward_context_available()

    with ThreadPoolExecutor(WORKERS) as pool:
        list(pool.map(step, range(WORKERS)))

    async def task(i: int) -> None:
        outer = torch.tensor([i])
        with set_forward_context(attn_metadata={}, slot_mapping={"l": outer}):
            for _ in range(10):
                try:
                    with set_forward_context(attn_metadata={},
                                             slot_mapping={"l": torch.tensor([-i])}):
                        await asyncio.sleep(0)  # others run while this one is nested
                        raise KeyError(i)
                except KeyError:
                    pass
                assert get_forward_context().slot_mapping["l"] is outer
        assert not is_forward_context_available()

    async def main() -> None:
        await asyncio.gather(*(task(i) for i in range(WORKERS)))

    asyncio.run(main())
    assert not is_forward_context_available()


def test_a_failed_step_leaves_nothing_behind_in_a_reused_worker_thread() -> None:
    """Thread-pool workers are reused: a step that raised inside its context must not
    leave that context to the next step run on the same thread."""
    def failing() -> None:
        with set_forward_context(attn_metadata={}, slot_mapping={"l": torch.tensor([1])}):
            raise RuntimeError("step failed")

    with ThreadPoolExecutor(1) as pool:
        with pytest.raises(RuntimeError, match="step failed"):
            pool.submit(failing).result()
        assert pool.submit(is_forward_context_available).result() is False


def test_new_threads_start_without_a_context_unless_it_is_passed_explicitly() -> None:
    """``threading.Thread`` does not copy context variables: a thread started inside a
    step sees no context (a clear error, not the parent's slots). Passing it on is
    explicit, with ``contextvars.copy_context().run``."""
    seen: dict[str, object] = {}
    s = torch.tensor([7])
    with set_forward_context(attn_metadata={}, slot_mapping={"l": s}):
        def probe() -> None:
            try:
                get_forward_context()
                seen["plain"] = "a context"
            except ForwardContextError:
                seen["plain"] = None

        t = threading.Thread(target=probe)
        t.start()
        t.join()
        copied = contextvars.copy_context()
        with ThreadPoolExecutor(1) as pool:
            seen["copied"] = pool.submit(
                copied.run, lambda: get_forward_context().slot_mapping["l"]).result()
    assert seen == {"plain": None, "copied": s}


def test_child_tasks_see_a_snapshot_and_never_leak_back() -> None:
    async def main() -> None:
        parent = torch.tensor([1])
        child_ready = asyncio.Event()
        release = asyncio.Event()

        async def child() -> torch.Tensor:
            inherited = get_forward_context().slot_mapping["l"]
            with set_forward_context(attn_metadata={}, slot_mapping={"l": torch.tensor([2])}):
                child_ready.set()
                await release.wait()  # the parent checks its own while this is active
            return inherited

        with set_forward_context(attn_metadata={}, slot_mapping={"l": parent}):
            task = asyncio.create_task(child())
            await child_ready.wait()
            assert get_forward_context().slot_mapping["l"] is parent
            release.set()
            assert await task is parent
            assert get_forward_context().slot_mapping["l"] is parent
        assert not is_forward_context_available()

    asyncio.run(main())
