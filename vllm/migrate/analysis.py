"""What a legacy backend module holds: its imports, its classes, and which of them are
the backend, its impl, its metadata builder and its metadata."""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst
from libcst.metadata import CodeRange, MetadataWrapper, PositionProvider

from vllm.migrate.report import MigrationError
from vllm.migrate.source import parse_source

LEGACY_MODULES = frozenset({
    "vllm.attention.backends.abstract",
    "vllm.attention.backends.utils",
    "vllm.v1.attention.backend",
    "vllm.v1.attention.backends.utils",
    "vllm.v1.attention.backends.registry",
    "vllm.v1.kv_cache_interface",
    "vllm.config",
    "vllm.config.cache",
    "vllm.logger",
    "vllm.utils",
    "vllm.utils.math_utils",
    "vllm.platforms",
    "vllm.platforms.interface",
    "vllm.distributed",
    "vllm.distributed.parallel_state",
    "vllm.model_executor.layers.attention",
    "vllm.model_executor.layers.batch_invariant",
    "vllm._custom_ops",
})
"""Upstream's import paths that this package serves as the deprecated legacy surface."""

NEW_BACKEND_BASES = frozenset({"vllm.attention.AttentionBackend",
                               "vllm.attention.backend.AttentionBackend"})

LEGACY_REQUIRED = ("get_name", "get_impl_cls", "get_builder_cls", "get_kv_cache_shape")
"""The classmethods that make a plain class a legacy backend (as the adapter reads it)."""


def is_legacy_module(module: str) -> bool:
    return module in LEGACY_MODULES or module == "shim" or module.startswith("shim.")


def dotted(expr: cst.BaseExpression) -> str | None:
    """``a.b.c`` of a name or attribute chain, else None."""
    if isinstance(expr, cst.Name):
        return expr.value
    if isinstance(expr, cst.Attribute):
        head = dotted(expr.value)
        return None if head is None else f"{head}.{expr.attr.value}"
    return None


def module_name(node: cst.BaseExpression | None, dots: int = 0) -> str:
    text = "" if node is None else (dotted(node) or "")
    return "." * dots + text


@dataclass(frozen=True)
class Imported:
    """One name bound by an import statement."""

    local: str
    qualified: str
    """What it names: ``vllm.attention.backends.abstract.AttentionBackend``, ``torch``,
    ``vllm._custom_ops``; relative imports keep their dots (``.kernels.attend``)."""
    module: str
    """The module of a ``from`` import (``""`` for ``import x``)."""
    statement: cst.SimpleStatementLine


@dataclass
class ClassInfo:
    node: cst.ClassDef
    bases: list[str]
    """Qualified names of the bases (subscripts such as ``AttentionImpl[M]`` by their value)."""
    methods: dict[str, cst.FunctionDef] = field(default_factory=dict)
    attrs: dict[str, cst.BaseExpression] = field(default_factory=dict)
    """Class-level assignments: name -> value."""
    attr_lines: dict[str, cst.SimpleStatementLine] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.node.name.value


@dataclass
class ModuleInfo:
    path: Path
    module: cst.Module
    imports: dict[str, Imported] = field(default_factory=dict)
    classes: dict[str, ClassInfo] = field(default_factory=dict)
    functions: dict[str, cst.FunctionDef] = field(default_factory=dict)
    constants: dict[str, cst.BaseExpression] = field(default_factory=dict)
    """Module-level ``NAME = <value>`` assignments (the last one of each name)."""
    positions: Mapping[cst.CSTNode, CodeRange] = field(default_factory=dict, repr=False)
    """Where each node of ``module`` starts and ends."""
    foreign: dict[Path, ModuleInfo] = field(default_factory=dict, repr=False)
    """Other modules of the project read for a base class, by file."""
    metadata_class: str = ""
    """The backend's metadata class, once known."""
    metadata_fields: list[str] = field(default_factory=list)
    _parents: dict[cst.CSTNode, cst.CSTNode] = field(default_factory=dict, repr=False)

    def parent(self, node: cst.CSTNode) -> cst.CSTNode | None:
        if not self._parents:
            _fill_parents(self.module, self._parents)
        return self._parents.get(node)

    def statement_of(self, node: cst.CSTNode) -> cst.CSTNode:
        """The statement (simple line or compound statement) that holds ``node``."""
        current: cst.CSTNode | None = node
        while current is not None and not isinstance(
                current, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            current = self.parent(current)
        return current if current is not None else node

    def within(self, node: cst.CSTNode, nodes: Container[cst.CSTNode]) -> bool:
        """Whether ``node`` or a node that holds it is one of ``nodes``."""
        current: cst.CSTNode | None = node
        while current is not None:
            if current in nodes:
                return True
            current = self.parent(current)
        return False

    def column(self, node: cst.CSTNode) -> int:
        """The column ``node`` starts at (0 when unknown)."""
        where = self.positions.get(node)
        return where.start.column if where is not None else 0

    def line(self, node: cst.CSTNode) -> int:
        where = self.positions.get(node)
        return where.start.line if where is not None else 0

    def ref(self, name: str, at: cst.CSTNode, *, annotation: bool) -> str:
        """``name`` as code at ``at``: quoted when it is a class of this module defined
        further down, so evaluating it there would fail (an annotation never is under
        ``from __future__ import annotations``)."""
        cls = self.classes.get(name)
        future = self.imports.get("annotations")
        if cls is None or (annotation and future is not None and future.module == "__future__"):
            return name
        return name if self.line(cls.node) <= self.line(at) else f'"{name}"'

    def qualify(self, name: str) -> str:
        """The qualified name of a dotted name as used in the module (``ops.x`` ->
        ``vllm._custom_ops.x``); names not imported stay as they are."""
        head, _, rest = name.partition(".")
        imported = self.imports.get(head)
        if imported is None:
            return name
        return f"{imported.qualified}.{rest}" if rest else imported.qualified

    def qualified(self, expr: cst.BaseExpression) -> str | None:
        name = dotted(expr)
        return None if name is None else self.qualify(name)

    def is_legacy_name(self, expr: cst.BaseExpression, attr: str) -> bool:
        """True for ``attr`` imported from the legacy surface (any of its paths)."""
        q = self.qualified(expr)
        if q is None or not q.endswith("." + attr):
            return False
        return is_legacy_module(q[: -len(attr) - 1])

    def methods_of(self, cls: ClassInfo) -> dict[str, cst.FunctionDef]:
        """Methods of ``cls`` and of its bases defined in this module (nearest first)."""
        found: dict[str, cst.FunctionDef] = {}
        for c in self.local_mro(cls):
            for name, fn in c.methods.items():
                found.setdefault(name, fn)
        return found

    def local_mro(self, cls: ClassInfo) -> list[ClassInfo]:
        order, todo = [], [cls]
        while todo:
            c = todo.pop(0)
            if c in order:
                continue
            order.append(c)
            todo.extend(self.classes[b] for b in c.bases if b in self.classes)
        return order


def alias_local(alias: cst.ImportAlias) -> str:
    """The name an import binds: its ``as`` name, else the first part of the imported
    name (``import a.b`` binds ``a``)."""
    if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
        return alias.asname.name.value
    return (dotted(alias.name) or "").split(".")[0]


def _assigned(small: cst.BaseSmallStatement) -> tuple[str, cst.BaseExpression | None] | None:
    """The name and the value (None without one) of ``name = value`` or
    ``name: T [= value]``."""
    target: cst.BaseExpression | None = None
    value: cst.BaseExpression | None = None
    if isinstance(small, cst.Assign) and len(small.targets) == 1:
        target, value = small.targets[0].target, small.value
    elif isinstance(small, cst.AnnAssign):
        target, value = small.target, small.value
    return (target.value, value) if isinstance(target, cst.Name) else None


def _fill_parents(root: cst.CSTNode, parents: dict[cst.CSTNode, cst.CSTNode]) -> None:
    stack = [root]
    while stack:
        node = stack.pop()
        for child in node.children:
            parents[child] = node
            stack.append(child)


def _base_expr(arg: cst.Arg) -> cst.BaseExpression:
    value = arg.value
    return value.value if isinstance(value, cst.Subscript) else value


def read_module(path: Path, module: cst.Module) -> ModuleInfo:
    positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    info = ModuleInfo(path, module, positions=positions)
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                assigned = _assigned(small)
                if isinstance(small, cst.ImportFrom):
                    _read_import_from(info, small, stmt)
                elif isinstance(small, cst.Import):
                    for alias in small.names:
                        local = alias_local(alias)
                        qualified = (dotted(alias.name) or "") if alias.asname else local
                        info.imports[local] = Imported(local, qualified, "", stmt)
                elif assigned is not None and assigned[1] is not None:
                    info.constants[assigned[0]] = assigned[1]
        elif isinstance(stmt, cst.ClassDef):
            info.classes[stmt.name.value] = _read_class(info, stmt)
        elif isinstance(stmt, cst.FunctionDef):
            info.functions[stmt.name.value] = stmt
    return info


def _read_import_from(info: ModuleInfo, node: cst.ImportFrom,
                      stmt: cst.SimpleStatementLine) -> None:
    module = module_name(node.module, len(node.relative))
    if isinstance(node.names, cst.ImportStar):
        return
    for alias in node.names:
        name = dotted(alias.name) or ""
        local = alias_local(alias)
        info.imports[local] = Imported(local, f"{module}.{name}" if module else name, module,
                                       stmt)


def _read_class(info: ModuleInfo, node: cst.ClassDef) -> ClassInfo:
    bases = []
    for arg in node.bases:
        if arg.keyword is None:
            q = info.qualified(_base_expr(arg))
            bases.append(q or "?")
    cls = ClassInfo(node, bases)
    for stmt in class_body(node):
        if isinstance(stmt, cst.FunctionDef):
            cls.methods[stmt.name.value] = stmt
        elif isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                assigned = _assigned(small)
                if assigned is not None:
                    name, value = assigned
                    if value is not None:
                        cls.attrs[name] = value
                    cls.attr_lines[name] = stmt
    return cls


def class_body(node: cst.ClassDef) -> list[cst.BaseStatement]:
    """The statements of a class body; a one-line body (``class A: x = 1``) gives its
    small statements as they are."""
    return list(node.body.body)  # type: ignore[arg-type]


def suite_body(suite: cst.BaseSuite) -> list[cst.BaseStatement]:
    """The statements of a block; those of a one-line suite (``if x: a; b``) as one line."""
    if isinstance(suite, cst.IndentedBlock):
        return list(suite.body)
    return [cst.SimpleStatementLine(body=list(suite.body))]  # type: ignore[arg-type]


def function_body(fn: cst.FunctionDef) -> list[cst.BaseStatement]:
    return suite_body(fn.body)


def is_docstring(stmt: cst.BaseStatement) -> bool:
    return (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1
            and isinstance(stmt.body[0], cst.Expr)
            and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString)))


def single_return(fn: cst.FunctionDef) -> cst.BaseExpression | None:
    """The value of ``fn``'s only statement when it is ``return <value>`` (a docstring
    before it allowed), else None."""
    body = [s for s in function_body(fn) if not is_docstring(s)]
    if len(body) != 1 or not isinstance(body[0], cst.SimpleStatementLine):
        return None
    small = body[0].body
    if len(small) == 1 and isinstance(small[0], cst.Return):
        return small[0].value
    return None


def params(fn: cst.FunctionDef) -> list[cst.Param]:
    """Positional parameters (``self``/``cls`` included) followed by keyword-only ones."""
    p = fn.params
    return [*p.posonly_params, *p.params, *p.kwonly_params]


def target_names(target: cst.BaseExpression) -> list[cst.Name]:
    """The names an assignment or ``for`` target binds: ``a``, ``a, [b, c]`` (not
    ``x.a`` or ``x[i]``)."""
    if isinstance(target, cst.Name):
        return [target]
    if isinstance(target, (cst.Tuple, cst.List)):
        return [n for el in target.elements for n in target_names(el.value)]
    return []


def names_in(node: cst.CSTNode) -> set[str]:
    """Every name ``node`` mentions but the attribute of ``x.attr``."""
    found: set[str] = set()

    class Visitor(cst.CSTVisitor):
        def visit_Name(self, n: cst.Name) -> None:
            found.add(n.value)

        def visit_Attribute(self, n: cst.Attribute) -> bool:
            n.value.visit(self)
            return False

    node.visit(Visitor())
    return found


def name_loads(node: cst.CSTNode, names: Container[str],
               skip: Callable[[cst.CSTNode], bool] | None = None) -> list[cst.Name]:
    """The ``Name`` nodes of ``node`` that read one of ``names``: not the attribute of
    ``x.attr`` nor the keyword of ``f(keyword=x)``, and nothing inside a node ``skip``
    picks."""
    found: list[cst.Name] = []

    class Visitor(cst.CSTVisitor):
        def on_visit(self, n: cst.CSTNode) -> bool:
            if skip is not None and skip(n):
                return False
            if isinstance(n, (cst.Attribute, cst.Arg)):
                n.value.visit(self)
                return False
            if isinstance(n, cst.Name) and n.value in names:
                found.append(n)
            return True

    node.visit(Visitor())
    return found


def reads_attribute(node: cst.CSTNode, attr: str,
                    skip: Callable[[cst.CSTNode], bool]) -> bool:
    """Whether ``node`` reads ``<x>.attr`` outside the nodes ``skip`` picks."""
    found = False

    class Visitor(cst.CSTVisitor):
        def on_visit(self, n: cst.CSTNode) -> bool:
            nonlocal found
            if found or skip(n):
                return False
            if isinstance(n, cst.Attribute) and n.attr.value == attr:
                found = True
            return True

    node.visit(Visitor())
    return found


@dataclass
class Pieces:
    """The classes of one legacy backend, all defined in the module."""

    backend: ClassInfo
    impl: ClassInfo
    builder: ClassInfo
    metadata: ClassInfo


def _returned_class(info: ModuleInfo, backend: ClassInfo, method: str) -> ClassInfo | None:
    fn = info.methods_of(backend).get(method)
    if fn is None:
        return None
    value = single_return(fn)
    where = f"{info.path}: {backend.name}.{method}()"
    if value is None or not isinstance(value, cst.Name):
        raise MigrationError(
            f"{where} does not simply return a class (return SomeClass); the command reads "
            "the backend's pieces from such returns")
    name = value.value
    if name in info.classes:
        return info.classes[name]
    imported = info.imports.get(name)
    origin = f"imported from {imported.module or imported.qualified}" if imported else \
        "not defined in this module"
    raise MigrationError(
        f"{where} returns {name}, which is {origin}: the command migrates one module that "
        "defines the backend with its impl, builder and metadata classes; move them into "
        "one module first")


def _annotation_class(info: ModuleInfo, fn: cst.FunctionDef | None,
                      param: str | None) -> ClassInfo | None:
    """The module's class named by ``fn``'s return annotation (``param`` None) or by the
    annotation of its parameter ``param``."""
    if fn is None:
        return None
    ann: cst.Annotation | None = fn.returns
    if param is not None:
        ann = next((p.annotation for p in params(fn) if p.name.value == param), None)
    if ann is None:
        return None
    expr = ann.annotation
    if isinstance(expr, cst.SimpleString):
        name = expr.evaluated_value if isinstance(expr.evaluated_value, str) else ""
        return info.classes.get(name)
    if isinstance(expr, cst.Name):
        return info.classes.get(expr.value)
    return None


def find_pieces(info: ModuleInfo, backend: ClassInfo) -> Pieces:
    impl = _returned_class(info, backend, "get_impl_cls")
    builder = _returned_class(info, backend, "get_builder_cls")
    assert impl is not None and builder is not None  # LEGACY_REQUIRED were checked
    metadata = _returned_class(info, backend, "get_metadata_cls")
    if metadata is None:
        metadata = _annotation_class(info, builder.methods.get("build"), None)
    if metadata is None:
        forward = impl.methods.get("forward")
        metadata = _annotation_class(info, forward, _param_name(forward, 6))
    if metadata is None:
        raise MigrationError(
            f"{info.path}: cannot tell {backend.name}'s metadata class: it has no "
            "get_metadata_cls(), and neither its builder's build() return annotation nor "
            "its impl's forward() attn_metadata annotation names a class of this module; "
            "add get_metadata_cls() returning it")
    return Pieces(backend, impl, builder, metadata)


def _param_name(fn: cst.FunctionDef | None, index: int) -> str | None:
    if fn is None:
        return None
    ps = params(fn)
    return ps[index].name.value if len(ps) > index else None


def is_new_style(info: ModuleInfo, cls: ClassInfo) -> bool:
    return any(b in NEW_BACKEND_BASES for b in cls.bases) or any(
        is_new_style(info, info.classes[b]) for b in cls.bases if b in info.classes)


def is_legacy_backend(info: ModuleInfo, cls: ClassInfo) -> bool:
    if is_new_style(info, cls):
        return False
    for c in info.local_mro(cls):
        if any(b.endswith(".AttentionBackend") and is_legacy_module(b.rpartition(".")[0])
               for b in c.bases):
            return True
    methods = info.methods_of(cls)
    return all(m in methods for m in LEGACY_REQUIRED) or imported_base(info, cls) is not None


def package_root(path: Path) -> Path:
    """The directory above the outermost package holding ``path``."""
    folder = path.resolve().parent
    while (folder / "__init__.py").is_file():
        folder = folder.parent
    return folder


def module_file(info: ModuleInfo, module: str) -> Path | None:
    """The source file of ``module`` as ``info``'s module imports it (a relative import,
    or an absolute one inside the same tree), or None."""
    if module.startswith("."):
        dots = len(module) - len(module.lstrip("."))
        base = info.path.resolve().parent
        for _ in range(dots - 1):
            base = base.parent
        rest = module.lstrip(".").replace(".", "/")
    else:
        base, rest = package_root(info.path), module.replace(".", "/")
    for candidate in (base / f"{rest}.py", base / rest / "__init__.py"):
        if rest and candidate.is_file():
            return candidate
    return None


def imported_base(info: ModuleInfo, cls: ClassInfo) -> tuple[ModuleInfo, ClassInfo] | None:
    """The legacy backend ``cls`` subclasses from another module of the same project
    (a plugin deriving from a backend it imports), read from that module's source."""
    for base in cls.bases:
        module, _, name = base.rpartition(".")
        if base in info.classes or not module or is_legacy_module(module) or \
                base in NEW_BACKEND_BASES or module in ("torch", "abc", "typing"):
            continue
        path = module_file(info, module)
        if path is None:
            continue
        other = info.foreign.get(path)
        if other is None:
            other = read_module(path, parse_source(path, path.read_text(encoding="utf-8")))
            info.foreign[path] = other
        found = other.classes.get(name)
        if found is not None and is_legacy_backend(other, found):
            return other, found
    return None


def choose_backend(info: ModuleInfo, class_name: str | None) -> ClassInfo:
    """The legacy backend class to migrate, or a :class:`MigrationError` saying why none."""
    legacy = [c for c in info.classes.values() if is_legacy_backend(info, c)]
    new = [c for c in info.classes.values() if is_new_style(info, c)]
    if class_name is not None:
        cls = info.classes.get(class_name)
        if cls is None:
            have = ", ".join(info.classes) or "none"
            raise MigrationError(
                f"{info.path}:{class_name}: no class {class_name} in the module (classes: "
                f"{have})")
        if is_new_style(info, cls):
            raise MigrationError(
                f"{info.path}:{class_name} is already a new-style backend (it subclasses "
                "vllm.attention.AttentionBackend): nothing to migrate")
        if cls not in legacy:
            missing = [m for m in LEGACY_REQUIRED if m not in info.methods_of(cls)]
            raise MigrationError(
                f"{info.path}:{class_name} is not a legacy attention backend: it neither "
                "subclasses a legacy AttentionBackend nor defines "
                f"{', '.join(LEGACY_REQUIRED)} (missing {', '.join(missing)})")
        return cls
    if len(legacy) == 1:
        return legacy[0]
    if legacy:
        names = ", ".join(c.name for c in legacy)
        raise MigrationError(
            f"{info.path}: the module holds several legacy backends ({names}); name the one "
            f"to migrate as {info.path}:{legacy[0].name}")
    if new:
        names = ", ".join(c.name for c in new)
        raise MigrationError(
            f"{info.path}: no legacy backend to migrate: {names} already "
            f"{'subclasses' if len(new) == 1 else 'subclass'} vllm.attention.AttentionBackend")
    raise MigrationError(
        f"{info.path}: not an attention backend module: no class subclasses a legacy "
        f"AttentionBackend or defines {', '.join(LEGACY_REQUIRED)}")


def unset_self_reads(cls: ClassInfo, names: frozenset[str] | set[str]
                     ) -> list[tuple[cst.Attribute, str]]:
    """Reads of ``self.<name>`` (``name`` in ``names``) in ``cls`` that the class never
    assigns itself: state a legacy base set, which its migration does not."""
    assigned: set[str] = set(cls.attrs)
    reads: list[tuple[cst.Attribute, str]] = []

    class Visitor(cst.CSTVisitor):
        def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
            t = node.target
            if isinstance(t, cst.Attribute) and isinstance(t.value, cst.Name) and \
                    t.value.value == "self":
                assigned.add(t.attr.value)

        def visit_Attribute(self, node: cst.Attribute) -> None:
            if isinstance(node.value, cst.Name) and node.value.value == "self" and \
                    node.attr.value in names:
                reads.append((node, node.attr.value))

    cls.node.visit(Visitor())
    return [(node, attr) for node, attr in reads if attr not in assigned]
