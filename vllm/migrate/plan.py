"""The edits one migration makes, collected by the piece rewriters and applied in one
pass over the tree (so every edit is keyed by a node of the module as read)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import libcst as cst

from vllm.migrate.analysis import ModuleInfo
from vllm.migrate.imports import ImportPlan
from vllm.migrate.report import ManualStep

Edit = Callable[[Any], Any]
"""Given the updated node, the node (or removal) that replaces it."""


@dataclass
class Plan:
    info: ModuleInfo
    remove: set[cst.CSTNode] = field(default_factory=set)
    edits: dict[cst.CSTNode, list[Edit]] = field(default_factory=dict)
    markers: dict[cst.CSTNode, list[ManualStep]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    imports: ImportPlan = field(default_factory=ImportPlan)

    def code(self, node: cst.CSTNode) -> str:
        return self.info.module.code_for_node(node).strip()

    def edit(self, node: cst.CSTNode, edit: Edit) -> None:
        self.edits.setdefault(node, []).append(edit)

    def replace(self, node: cst.CSTNode, new: cst.CSTNode) -> None:
        self.edit(node, lambda _updated: new)

    def mark(self, statement: cst.CSTNode, reason: str, todo: str) -> None:
        """Leave ``statement`` in place with a marker comment and a manual step."""
        steps = self.markers.setdefault(statement, [])
        step = ManualStep(reason, todo)
        if step not in steps:
            steps.append(step)

    def need(self, module: str, *names: str) -> None:
        self.imports.need(module, *names)


class Apply(cst.CSTTransformer):
    """Applies a :class:`Plan`: removals, edits, then marker comments."""

    def __init__(self, plan: Plan) -> None:
        super().__init__()
        self.plan = plan

    def on_leave(self, original_node: Any, updated_node: Any) -> Any:
        result: Any = super().on_leave(original_node, updated_node)
        if original_node in self.plan.remove:
            return cst.RemoveFromParent()
        for edit in self.plan.edits.get(original_node, ()):
            result = edit(result)
        steps = self.plan.markers.get(original_node)
        if steps and hasattr(result, "leading_lines"):
            comments = [cst.EmptyLine(comment=cst.Comment(line)) for s in steps
                        for line in s.comment]
            result = result.with_changes(leading_lines=[*result.leading_lines, *comments])
        return result

    def leave_IndentedBlock(self, original_node: cst.IndentedBlock,
                            updated_node: cst.IndentedBlock) -> cst.IndentedBlock:
        body = list(updated_node.body)
        if not body:
            return updated_node.with_changes(body=[cst.SimpleStatementLine(body=[cst.Pass()])])
        if original_node.body and original_node.body[0] in self.plan.remove:
            # the first statement went: the next one does not start with a blank line
            first = body[0]
            lines = list(getattr(first, "leading_lines", ()))
            while lines and lines[0].comment is None:
                lines.pop(0)
            body[0] = first.with_changes(leading_lines=lines)
            return updated_node.with_changes(body=body)
        return updated_node


def method_from(text: str) -> cst.FunctionDef:
    """A method parsed from its source as written inside a top-level class (4 spaces)."""
    module = cst.parse_module("class _Wrapper:\n" + text)
    cls = module.body[0]
    assert isinstance(cls, cst.ClassDef) and isinstance(cls.body, cst.IndentedBlock)
    fn = cls.body.body[0]
    assert isinstance(fn, cst.FunctionDef)
    return fn


def statements_from(text: str) -> list[cst.BaseStatement]:
    """Statements parsed from source indented as where they go (continuation lines keep
    their literal indentation); the first line's indentation is the block's."""
    if not text.startswith((" ", "\t")):
        return list(cst.parse_module(text).body)
    node = cst.parse_module("if True:\n" + text).body[0]
    assert isinstance(node, cst.If) and isinstance(node.body, cst.IndentedBlock)
    return list(node.body.body)


def statement(text: str) -> cst.BaseStatement:
    return cst.parse_statement(text if text.endswith("\n") else text + "\n")


def expression(text: str) -> cst.BaseExpression:
    return cst.parse_expression(text)
