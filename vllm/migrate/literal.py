"""Evaluating a legacy method whose value is literal, without importing the module.

Legacy backends declare what they support in small methods (``get_supported_head_sizes``
returning a list, ``supports_head_size`` comparing its argument, ``get_kv_cache_shape``
returning a tuple of its arguments and raising for block sizes it cannot page). This
evaluates such a method for given arguments: literals, the arguments, arithmetic,
comparisons, ``if``/``elif``/``else``, local names, ``raise``, and a few names of the
legacy surface (``torch.float16``, ``AttentionType.DECODER``, ``MultipleOf(16)``,
``get_kv_cache_layout()``, which answers upstream's default ``"NHD"``). Anything else
makes the value :data:`NOT_LITERAL`: the command then leaves the method for a person.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import libcst as cst

from vllm.attention.types import AttentionType
from vllm.migrate.analysis import ModuleInfo, dotted, function_body, is_docstring, params


class _NotLiteral:
    def __repr__(self) -> str:
        return "NOT_LITERAL"


NOT_LITERAL: Final = _NotLiteral()
"""The value of code the evaluator does not follow."""


@dataclass(frozen=True)
class Raised:
    """The method raised ``exception`` (its class name)."""

    exception: str


@dataclass(frozen=True)
class TorchDType:
    """``torch.<name>`` (a dtype named in the legacy code)."""

    name: str


@dataclass(frozen=True)
class MultipleOfSize:
    """Upstream's ``MultipleOf(base)`` kernel block size."""

    base: int


DEFAULT_KV_CACHE_LAYOUT: Final = "NHD"
"""What upstream's ``get_kv_cache_layout()`` answers when ``VLLM_KV_CACHE_LAYOUT`` is unset."""

_BINARY: Final[Mapping[type[cst.BaseBinaryOp], Callable[[Any, Any], Any]]] = {
    cst.Add: operator.add, cst.Subtract: operator.sub, cst.Multiply: operator.mul,
    cst.FloorDivide: operator.floordiv, cst.Modulo: operator.mod,
    cst.BitAnd: operator.and_, cst.BitOr: operator.or_,
    cst.Power: operator.pow,
}
_COMPARE: Final[Mapping[type[cst.BaseCompOp], Callable[[Any, Any], Any]]] = {
    cst.Equal: operator.eq, cst.NotEqual: operator.ne, cst.LessThan: operator.lt,
    cst.LessThanEqual: operator.le, cst.GreaterThan: operator.gt,
    cst.GreaterThanEqual: operator.ge, cst.In: lambda a, b: a in b,
    cst.NotIn: lambda a, b: a not in b, cst.Is: operator.is_, cst.IsNot: operator.is_not,
}


_METHODS: Final[Mapping[str, tuple[type, Callable[..., object]]]] = {
    "get": (dict, dict.get),
    "startswith": (str, str.startswith),
    "endswith": (str, str.endswith),
}
"""Methods of literal values the evaluator follows."""


class _Stop(Exception):
    """Control flow of the evaluated function: a return, a raise, or code not followed."""

    def __init__(self, value: object) -> None:
        super().__init__()
        self.value = value


class Evaluator:
    """Evaluates methods of one module (``info``) for given arguments."""

    def __init__(self, info: ModuleInfo,
                 class_attrs: Mapping[str, cst.BaseExpression] | None = None, *,
                 kv_cache_layout: str = DEFAULT_KV_CACHE_LAYOUT) -> None:
        self.info = info
        self.class_attrs = class_attrs or {}
        self.kv_cache_layout = kv_cache_layout
        """What ``get_kv_cache_layout()`` answers."""
        self._resolving: set[str] = set()

    def call(self, fn: cst.FunctionDef, *args: object, **kwargs: object) -> object:
        """The value ``fn`` returns (or :class:`Raised`) for these arguments; parameters
        without an argument take their literal defaults."""
        env: dict[str, object] = {}
        ps = params(fn)
        static = any(isinstance(d.decorator, cst.Name) and d.decorator.value == "staticmethod"
                     for d in fn.decorators)
        if ps and not static:  # self or cls
            ps = ps[1:]
        for i, p in enumerate(ps):
            name = p.name.value
            if i < len(args):
                env[name] = args[i]
            elif name in kwargs:
                env[name] = kwargs[name]
            elif p.default is not None:
                env[name] = self.expr(p.default, env)
            else:
                return NOT_LITERAL
        try:
            self._block(function_body(fn), env)
        except _Stop as stop:
            return stop.value
        return None

    # -- statements ---------------------------------------------------------------------
    def _block(self, body: list[cst.BaseStatement], env: dict[str, object]) -> None:
        for stmt in body:
            if is_docstring(stmt):
                continue
            if isinstance(stmt, cst.SimpleStatementLine):
                for small in stmt.body:
                    self._small(small, env)
            elif isinstance(stmt, cst.If):
                self._if(stmt, env)
            else:
                raise _Stop(NOT_LITERAL)

    def _if(self, stmt: cst.If, env: dict[str, object]) -> None:
        test = self.expr(stmt.test, env)
        if test is NOT_LITERAL:
            raise _Stop(NOT_LITERAL)
        if test:
            self._block(list(stmt.body.body), env)  # type: ignore[arg-type]
        elif isinstance(stmt.orelse, cst.If):
            self._if(stmt.orelse, env)
        elif isinstance(stmt.orelse, cst.Else):
            self._block(list(stmt.orelse.body.body), env)  # type: ignore[arg-type]

    def _small(self, small: cst.BaseSmallStatement, env: dict[str, object]) -> None:
        if isinstance(small, cst.Return):
            raise _Stop(None if small.value is None else self.expr(small.value, env))
        if isinstance(small, cst.Raise):
            exc = small.exc
            target = exc.func if isinstance(exc, cst.Call) else exc
            name = target.value if isinstance(target, cst.Name) else "Exception"
            raise _Stop(Raised(name))
        if isinstance(small, (cst.Assign, cst.AnnAssign)):
            targets = ([t.target for t in small.targets] if isinstance(small, cst.Assign)
                       else [small.target])
            if small.value is None or not all(isinstance(t, cst.Name) for t in targets):
                raise _Stop(NOT_LITERAL)
            value = self.expr(small.value, env)
            for t in targets:
                env[t.value] = value  # type: ignore[attr-defined]
            return
        if isinstance(small, cst.Pass):
            return
        raise _Stop(NOT_LITERAL)

    # -- expressions --------------------------------------------------------------------
    def expr(self, node: cst.BaseExpression, env: Mapping[str, object]) -> object:
        try:
            return self._expr(node, env)
        except (TypeError, ValueError, ZeroDivisionError, ArithmeticError, LookupError):
            return NOT_LITERAL

    def _expr(self, node: cst.BaseExpression, env: Mapping[str, object]) -> object:
        if isinstance(node, cst.Integer):
            return int(node.evaluated_value)
        if isinstance(node, cst.Float):
            return float(node.evaluated_value)
        if isinstance(node, (cst.SimpleString, cst.ConcatenatedString)):
            text = node.evaluated_value
            return text if isinstance(text, str) else NOT_LITERAL
        if isinstance(node, cst.Name):
            if node.value in env:
                return env[node.value]
            constant = self.info.constants.get(node.value)
            if constant is not None and node.value not in self._resolving:
                self._resolving.add(node.value)  # a module-level constant
                try:
                    return self._expr(constant, {})
                finally:
                    self._resolving.discard(node.value)
            return {"True": True, "False": False, "None": None}.get(node.value, NOT_LITERAL)
        if isinstance(node, cst.Dict):
            mapping: dict[object, object] = {}
            for entry in node.elements:
                if not isinstance(entry, cst.DictElement):
                    return NOT_LITERAL
                k, v = self._expr(entry.key, env), self._expr(entry.value, env)
                if NOT_LITERAL in (k, v):
                    return NOT_LITERAL
                mapping[k] = v
            return mapping
        if isinstance(node, cst.Subscript) and len(node.slice) == 1 and isinstance(
                node.slice[0].slice, cst.Index):
            container = self._expr(node.value, env)
            index = self._expr(node.slice[0].slice.value, env)
            if NOT_LITERAL in (container, index):
                return NOT_LITERAL
            return container[index]  # type: ignore[index]
        if isinstance(node, (cst.Tuple, cst.List, cst.Set)):
            items = []
            for el in node.elements:
                if not isinstance(el, cst.Element):
                    return NOT_LITERAL
                items.append(self._expr(el.value, env))
            if any(i is NOT_LITERAL for i in items):
                return NOT_LITERAL
            if isinstance(node, cst.Tuple):
                return tuple(items)
            return list(items) if isinstance(node, cst.List) else frozenset(items)
        if isinstance(node, cst.Attribute):
            return self._attribute(node, env)
        if isinstance(node, cst.BinaryOperation):
            left, right = self._expr(node.left, env), self._expr(node.right, env)
            op = _BINARY.get(type(node.operator))
            if op is None or NOT_LITERAL in (left, right):
                return NOT_LITERAL
            return op(left, right)
        if isinstance(node, cst.UnaryOperation):
            value = self._expr(node.expression, env)
            if value is NOT_LITERAL:
                return NOT_LITERAL
            if isinstance(node.operator, cst.Not):
                return not value
            if isinstance(node.operator, cst.Minus):
                return -value  # type: ignore[operator]
            return NOT_LITERAL
        if isinstance(node, cst.BooleanOperation):
            left = self._expr(node.left, env)
            if left is NOT_LITERAL:
                return NOT_LITERAL
            if isinstance(node.operator, cst.And):
                return self._expr(node.right, env) if left else left
            return left if left else self._expr(node.right, env)
        if isinstance(node, cst.Comparison):
            left = self._expr(node.left, env)
            for target in node.comparisons:
                right = self._expr(target.comparator, env)
                op = _COMPARE.get(type(target.operator))
                if op is None or NOT_LITERAL in (left, right):
                    return NOT_LITERAL
                if not op(left, right):
                    return False
                left = right
            return True
        if isinstance(node, cst.Call):
            return self._call(node, env)
        return NOT_LITERAL

    def _attribute(self, node: cst.Attribute, env: Mapping[str, object]) -> object:
        name = dotted(node)
        if name is not None and name in env:  # self.x, set earlier from an argument
            return env[name]
        q = self.info.qualified(node)
        if q is None:
            return NOT_LITERAL
        head, _, attr = q.rpartition(".")
        if head == "torch":
            return TorchDType(attr)
        if head.endswith("AttentionType"):
            member = AttentionType.__members__.get(attr)
            return member.value if member is not None else NOT_LITERAL
        if head == "cls" and attr in self.class_attrs:
            return self._expr(self.class_attrs[attr], {})
        return NOT_LITERAL

    def _call(self, node: cst.Call, env: Mapping[str, object]) -> object:
        q = self.info.qualified(node.func) or ""
        last = q.rpartition(".")[2]
        args = [self._expr(a.value, env) for a in node.args if a.keyword is None and not a.star]
        if NOT_LITERAL in args:
            return NOT_LITERAL
        func = node.func
        if isinstance(func, cst.Attribute) and func.attr.value in _METHODS and not any(
                a.keyword or a.star for a in node.args):
            receiver = self._expr(func.value, env)  # dict.get, str.startswith on literals
            kind, method = _METHODS[func.attr.value]
            if isinstance(receiver, kind):
                return method(receiver, *args)
        if last == "MultipleOf" and len(args) == 1 and isinstance(args[0], int):
            return MultipleOfSize(args[0])
        if last == "get_kv_cache_layout" and not args:
            return self.kv_cache_layout
        if last == "is_quantized_kv_cache" and len(args) == 1 and isinstance(args[0], str):
            return args[0] not in ("auto", "bfloat16", "float16", "float32")
        if q == "range" and 1 <= len(args) <= 3 and all(isinstance(a, int) for a in args):
            return range(*(int(a) for a in args if isinstance(a, int)))
        if q in ("len", "list", "tuple", "frozenset", "set", "int") and len(args) == 1:
            return {"len": len, "list": list, "tuple": tuple, "frozenset": frozenset,
                    "set": frozenset, "int": int}[q](args[0])  # type: ignore[operator]
        return NOT_LITERAL
