"""Cached launches: a writer that has validated one call signature (shapes, strides,
dtypes, devices) keeps a :class:`CachedLaunch` for it. Its first call goes through
Triton's own launcher, which compiles (or finds) the kernel; later calls rebuild only
the pointers and call the compiled kernel's low-level launch function directly: one
dict lookup and one launch per write instead of Triton's argument binding and
specialisation per call."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from vllm.attention.writers.kernels.device import direct_launch
from vllm.attention.writers.kernels.launch import Launch, _kernels_for


LIVE_ROLES: Final[dict[str, int]] = {
    "key": 0, "value": 1, "cache": 2, "slots": 3, "k_scale": 4, "v_scale": 5,
    "query": 6, "positions": 7, "cos_sin": 8,
}
"""Index of each :attr:`Launch.roles` name in the ``live`` tensors a cached launch gets:
``(key, value, kv_cache, slot_mapping, k_scale, v_scale[, query, positions, cos_sin_cache])``
(MLA: ``kv_c_normed`` is the key, ``k_pe`` the value)."""


class BoundLaunch:
    """One launch bound to a compiled GPU kernel's low-level launch function.

    :meth:`bind` records, for every pointer argument of a :class:`Launch`, which live
    tensor it addresses and at what byte offset (views of the cache sit at fixed
    offsets for fixed strides); calling it with new live tensors of the same signature
    recomputes those pointers and launches. Everything else (grid, integer arguments,
    constexprs) is a function of the signature and is kept as built. The call is a
    small function generated for this launch (no per-call loops or list copies).
    """

    __slots__ = ("call", "source")

    def __init__(self, call: Callable[[Sequence[torch.Tensor]], bool], source: str) -> None:
        self.call = call
        """``call(live) -> bool``: launch on the current stream; False (nothing launched)
        when a pointer is not 16-byte aligned (the kernel assumed it) or another device
        is current."""
        self.source = source
        """The generated function's source (for tests and debugging)."""

    def __call__(self, live: Sequence[torch.Tensor]) -> bool:
        return self.call(live)

    @classmethod
    def bind(cls, compiled: object, launch: Launch, live: Sequence[torch.Tensor], *,
             arg_names: Sequence[str], device: int,
             get_device: Callable[[], int], get_stream: Callable[[int], int],
             knobs: object | None = None) -> BoundLaunch | None:
        """Bind ``launch`` (just run through Triton, which returned ``compiled``) to the
        ``live`` tensors it was built from. None where this launch cannot be replayed
        directly: a launcher of another shape than Triton 3.x's CUDA one, launch hooks
        set (a profiler), per-launch scratch memory, or a pointer Triton specialised as
        unaligned; such calls keep going through Triton.

        ``knobs``: where Triton keeps its launch hooks (``triton.knobs.runtime``: the
        attributes ``launch_enter_hook`` / ``launch_exit_hook``); None: no hooks. Each hook
        must be None or an empty ``knobs.HookChain`` (Triton 3.4+ keeps empty chains where
        older versions kept None; the launcher calls neither, so the bound call passes
        None). Every call first checks, inline, that the attributes still hold those
        objects and that they are still empty, and otherwise returns False, so a profiler
        that adds a hook later sees every launch."""
        hooks: tuple[object, object] = (
            (None, None) if knobs is None
            else (getattr(knobs, "launch_enter_hook", None),
                  getattr(knobs, "launch_exit_hook", None)))
        if not all(hooks_quiet(h) for h in hooks):
            return None
        try:
            launcher: Any = getattr(compiled, "run")
            raw = launcher.launch
            if launcher.global_scratch_size or launcher.profile_scratch_size:
                return None
            cooperative, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
            metadata = getattr(compiled, "packed_metadata")
            function = getattr(compiled, "function")
        except AttributeError:
            return None
        n = len(launch.args)
        tail = list(arg_names[n:])
        if len(arg_names) < n or set(tail) != set(launch.constexprs):
            return None
        values: list[object] = [*launch.args, *(launch.constexprs[k] for k in tail)]
        tensors = [i for i, a in enumerate(launch.args) if isinstance(a, torch.Tensor)]
        if len(tensors) != len(launch.roles):
            return None
        ns: dict[str, object] = {"raw": raw, "function": function, "metadata": metadata,
                                 "cooperative": cooperative, "pdl": pdl,
                                 "get_device": get_device, "get_stream": get_stream}
        body: list[str] = []
        if knobs is not None:
            ns.update(knobs=knobs, enter0=hooks[0], exit0=hooks[1])
            tests = ["knobs.launch_enter_hook is not enter0",
                     "knobs.launch_exit_hook is not exit0"]
            # an empty HookChain now must stay empty
            tests += [f"{name}.calls" for name, hook in (("enter0", hooks[0]),
                                                         ("exit0", hooks[1]))
                      if hook is not None]
            body += [f"    if {' or '.join(tests)}:", "        return False"]
        bases: dict[int, str] = {}
        exprs: list[str] = []
        for pos, role in zip(tensors, launch.roles):
            arg = launch.args[pos]
            assert isinstance(arg, torch.Tensor)  # internal: tensors selected above
            idx = LIVE_ROLES[role]
            p = arg.data_ptr()
            if p % 16:
                return None  # compiled without the alignment assumption: keep Triton's path
            if idx not in bases:
                bases[idx] = f"b{idx}"
                body.append(f"    b{idx} = live[{idx}].data_ptr()")
            off = p - live[idx].data_ptr()
            values[pos] = f"b{idx}" if off == 0 else f"(b{idx} + {off})"
        for i, v in enumerate(values):
            if i in tensors:
                exprs.append(str(v))
            elif type(v) is int or type(v) is bool:
                exprs.append(repr(v))
            else:
                ns[f"c{i}"] = v
                exprs.append(f"c{i}")
        grid = (*launch.grid, 1, 1)[:3]
        check = " | ".join(bases.values())
        source = "\n".join([
            "def call(live):",
            *body,
            f"    if ({check}) & 15 or get_device() != {int(device)}:",
            "        return False",
            f"    raw({grid[0]}, {grid[1]}, {grid[2]}, get_stream({int(device)}), function, "
            f"cooperative, pdl, None, None, metadata, None, None, None, {', '.join(exprs)})",
            "    return True",
        ])
        exec(compile(source, f"<bound launch of {launch.kernel}>", "exec"), ns)  # noqa: S102
        call: Callable[[Sequence[torch.Tensor]], bool] = ns["call"]  # type: ignore[assignment]
        return cls(call, source)


def _cuda_runtime() -> tuple[Callable[[], int], Callable[[int], int]]:
    return torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream


@functools.cache
def _runtime_knobs() -> Any:
    from triton import knobs

    return knobs.runtime


def hooks_quiet(hook: object) -> bool:
    """Whether a Triton launch hook does nothing: None, or a ``knobs.HookChain`` (any
    object with a ``calls`` list) holding no function."""
    if hook is None:
        return True
    calls = getattr(hook, "calls", None)
    return isinstance(calls, list) and not calls


class CachedLaunch:
    """The runner of one validated write signature on the Triton path.

    ``build(live)`` makes the :class:`Launch` from live tensors (no checks: the
    signature was validated once). On an NVIDIA GPU the first two calls run it through
    Triton, the second binds a :class:`BoundLaunch`; later calls use that. Elsewhere (ROCm,
    the interpreter: :func:`~vllm.attention.writers.kernels.device.direct_launch`) every
    call builds and runs.
    """

    __slots__ = ("_build", "_bound", "_tried", "_seen", "binding")

    def __init__(self, build: Callable[[Sequence[torch.Tensor]], Launch]) -> None:
        self._build = build
        self._bound: Callable[[Sequence[torch.Tensor]], bool] | None = None
        self._tried = False
        self._seen = False
        self.binding: BoundLaunch | None = None
        """The direct launch once bound (None before, and where it cannot be)."""

    @property
    def bound(self) -> bool:
        """Whether calls go through the compiled kernel's launcher directly."""
        return self._bound is not None

    def __call__(self, live: Sequence[torch.Tensor]) -> None:
        bound = self._bound
        if bound is not None:
            try:
                if bound(live):
                    return
            except (TypeError, ValueError, SystemError, OverflowError):
                # the launcher rejected the arguments before launching: another Triton's
                # calling convention; keep Triton's own launch for this signature
                self._bound = self.binding = None
        launch = self._build(live)
        compiled = launch.launch()
        if self._tried or compiled is None:
            return
        if not self._seen:  # bind from the second call on: a one-off signature (a
            self._seen = True  # writer whose cache is cleared every call) never pays it
            return
        self._tried = True
        cache = live[LIVE_ROLES["cache"]]
        if not direct_launch(cache.device):
            return
        get_device, get_stream = _cuda_runtime()
        fn = getattr(_kernels_for(cache), launch.kernel)
        self.binding = BoundLaunch.bind(
            compiled, launch, live, arg_names=list(fn.arg_names),
            device=int(cache.get_device()),
            get_device=get_device, get_stream=get_stream, knobs=_runtime_knobs())
        self._bound = None if self.binding is None else self.binding.call
