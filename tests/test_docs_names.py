"""Every code name the docs mention exists in the code.

The docs drifted: they named functions and a module that no longer existed
(`admission.py` after it became a package, `_apply_policy` and `_pressure_view` after the
judgement of readings moved to `judgement.py`), and a reader who looks such a name up
finds nothing. So each inline code span of `docs/*.md` and `README.md` that reads as a
name of this project's code is looked up here:

* a path that ends in `.py`, or starts with `vacancyd/`, `tests/`, `tools/`, `docs/` or
  `conf/`, must exist; a shorter `proxy/policy.py` is looked for under `vacancyd/`,
  `tests/` and `tools/`, and a bare `gate.py` anywhere below them;
* `vacancyd.x.y` must be a module, or a name that module defines at its top level (an
  import counts only in a package's `__init__` or in the module's `__all__`);
* `module.name` and `module.name()`, where `module` is one of vacancyd's modules
  (`gate`, or a dotted path below `vacancyd` such as `collect.nvml.naming`), are checked
  the same way, and may also name a method of one of the module's classes
  (`state.request_sample()` names the shared state's method). A `module.key` whose key is
  no function or class anywhere is a config or JSON key (`owner.presence`,
  `reclaim.last`) and is left alone;
* `CamelCase` must be defined in the project (a class, `Name = ...`, an enum member), and
  `CamelCase.name` must be defined in that class or a base of it that the project defines;
* `name()` must be a function or method of the project, and a private `_name_of_thing`
  something the project defines.

Config keys, JSON keys, HTTP paths, metric names, shell commands and plain words are not
code names and are not checked: a span is taken for a name only by its shape, as above.
Names of other projects that have the shape of ours (HTTP headers, D-Bus methods, systemd
directives, other libraries' classes) are listed in NOT_OURS, each with its reason. That
list is checked too: an entry no doc uses any more, or one that became a name of ours,
must go.

The layer drawings and the list of import contracts on docs/architecture.md are held to
pyproject.toml's `[tool.importlinter]` here as well. The route tables and the /status
document are held to the code by tests/test_routes_doc.py and tests/test_status_doc.py.
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import attrs

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "vacancyd"
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
# where a file the docs name may live, and a definition (a doc names a test or a tool by
# its file, so only the tests' helpers in tests/support are read for definitions)
SOURCE_DIRS = ("vacancyd", "tests", "tools")
DEFINITION_DIRS = ("vacancyd", "tests/support")
# a span that starts with one of these is a path of the repository
REPOSITORY_DIRS = (*SOURCE_DIRS, "docs", "conf")

HTTP = "an HTTP header or auth scheme, not a class"
DBUS = "a D-Bus method, property or value (logind, UPower, MPRIS)"
SYSTEMD = "a systemd unit directive"
ALERT = "a Prometheus alert of the fleet rules (conf/prometheus/), not a class"
NOT_OURS: dict[str, str] = {
    "Allow": HTTP,
    "Authorization": HTTP,
    "Basic": HTTP,
    "Bearer": HTTP,
    "Connection": HTTP,
    "Host": HTTP,
    "Location": HTTP,
    "Origin": HTTP,
    "Trailer": HTTP,
    "Upgrade": HTTP,
    "Vary": HTTP,
    "Active": DBUS,
    "BlockInhibited": DBUS,
    "InhibitDelayMaxUSec": DBUS,
    "ListInhibitors": DBUS,
    "ListSessions": DBUS,
    "OnBattery": DBUS,
    "PlaybackStatus": DBUS,
    "Playing": DBUS,
    "Version": DBUS,
    "GetIdletime": "the X11 screen saver extension's idle time",
    "InhibitDelayMaxSec": "a logind.conf setting",
    "MemAvailable": "a field of /proc/meminfo",
    "MemTotal": "a field of /proc/meminfo",
    "MemoryDenyWriteExecute": SYSTEMD,
    "NoNewPrivileges": SYSTEMD,
    "PrivateDevices": SYSTEMD,
    "PrivateUsers": SYSTEMD,
    "ProcSubset": SYSTEMD,
    "ProtectProc": SYSTEMD,
    "VacancydLenderDown": ALERT,
    "VacancydRefusingForHours": ALERT,
    "VacancydStateFileProblem": ALERT,
    "VacancydUpstreamUnreachable": ALERT,
    "APIConnectionError": "litellm's exception for a connection that failed",
    "APIError": "the openai client's base exception",
    "AsyncClient": "httpx's client",
    "CooldownCache": "the LiteLLM router's cooldown cache",
    "MockClock": "trio's test clock",
    "NVMLError": "pynvml's exception, which collect/nvml/binding.py turns into NvmlError",
    "ResponseError": "the ollama client's exception",
    "ps": "the ollama client's list of loaded models",
}

_FENCE = re.compile(r"\s*(```|~~~)")
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_PATH = re.compile(r"[\w.*/-]+")
_DOTTED = re.compile(rf"{_IDENT}(?:\.{_IDENT})+")
_CAMEL = re.compile(r"[A-Z][a-z0-9]+(?:[A-Z][A-Za-z0-9]*)*|[A-Z]{2,}[a-z][A-Za-z0-9]*")
_PRIVATE = re.compile(r"_[a-z][a-z0-9]*(?:_[a-z0-9]+)+")
_FUNCTION = re.compile(r"[a-z_][a-z0-9_]*")
_FILE_NAME = re.compile(r".+\.(json|ya?ml|toml|txt|md|sh|sock|gz|pem|so)")
_DEFINITION = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


# --- what the docs mention ---------------------------------------------------------------


@attrs.frozen
class Mention:
    doc: str
    line: int
    text: str


def _paragraphs(text: str) -> Iterator[list[tuple[int, str]]]:
    """Runs of non-blank lines outside fenced code blocks, with their line numbers."""
    paragraph: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and line.strip():
            paragraph.append((number, line))
            continue
        if paragraph:
            yield paragraph
            paragraph = []
    if paragraph:
        yield paragraph


def code_spans(text: str) -> Iterator[tuple[int, str]]:
    """(line, content) of each inline code span, read as CommonMark reads them: a run of
    backticks opens a span that the next run of the same length closes, possibly on a later
    line of the paragraph."""
    for paragraph in _paragraphs(text):
        joined = "\n".join(line for _, line in paragraph)
        starts = [0]
        for _, line in paragraph[:-1]:
            starts.append(starts[-1] + len(line) + 1)
        runs = list(re.finditer(r"`+", joined))
        index = 0
        while index < len(runs):
            opening = runs[index]
            closing = next(
                (i for i in range(index + 1, len(runs)) if runs[i].group() == opening.group()),
                None,
            )
            if closing is None:
                index += 1
                continue
            content = joined[opening.end() : runs[closing].start()].replace("\n", " ")
            at = max(i for i, start in enumerate(starts) if start <= opening.start())
            yield paragraph[at][0], content.strip()
            index = closing + 1


def mentions() -> list[Mention]:
    return [
        Mention(str(doc.relative_to(ROOT)), line, content)
        for doc in DOCS
        for line, content in code_spans(doc.read_text(encoding="utf-8"))
    ]


# --- what the project defines ------------------------------------------------------------


@attrs.frozen
class ModuleInfo:
    top: frozenset[str]
    classes: dict[str, ast.ClassDef]


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


@cache
def sources() -> tuple[Path, ...]:
    return tuple(
        path
        for directory in DEFINITION_DIRS
        for path in sorted((ROOT / directory).rglob("*.py"))
        if "__pycache__" not in path.parts
    )


def _bound(node: ast.stmt, *, imports: bool) -> set[str]:
    """The names one statement binds at its own level (under `if` and `try` too)."""
    if isinstance(node, _DEFINITION):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    if isinstance(node, ast.Import | ast.ImportFrom):
        return {(a.asname or a.name).split(".")[0] for a in node.names} if imports else set()
    inner: list[ast.stmt] = []
    if isinstance(node, ast.If | ast.Try):
        inner = [*node.body, *node.orelse]
    if isinstance(node, ast.Try):
        inner += [*node.finalbody, *(s for h in node.handlers for s in h.body)]
    return set().union(*(_bound(s, imports=imports) for s in inner))


@cache
def members(node: ast.ClassDef) -> frozenset[str]:
    """What a class defines: in its body, and as `self.name = ...` in its methods."""
    found: set[str] = set()
    for item in node.body:
        found |= _bound(item, imports=False)
    for inner in ast.walk(node):
        targets: list[ast.expr] = []
        if isinstance(inner, ast.Assign):
            targets = inner.targets
        elif isinstance(inner, ast.AnnAssign | ast.AugAssign):
            targets = [inner.target]
        found |= {
            t.attr
            for t in targets
            if isinstance(t, ast.Attribute)
            and isinstance(t.value, ast.Name)
            and t.value.id == "self"
        }
    return frozenset(found)


def bases(node: ast.ClassDef) -> list[str]:
    return [
        b.id if isinstance(b, ast.Name) else b.attr
        for b in node.bases
        if isinstance(b, ast.Name | ast.Attribute)
    ]


def _exported(tree: ast.Module) -> set[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                value = node.value
                if isinstance(value, ast.List | ast.Tuple):
                    return {
                        e.value
                        for e in value.elts
                        if isinstance(e, ast.Constant) and isinstance(e.value, str)
                    }
    return set()


@cache
def module_info(path: Path) -> ModuleInfo:
    """What a module defines at its top level: what it binds, and what it imports where
    that is its interface (a package's `__init__`, or a name in `__all__`)."""
    tree = _tree(path)
    top: set[str] = set()
    imported: set[str] = set()
    for node in tree.body:
        top |= _bound(node, imports=False)
        imported |= _bound(node, imports=True)
    top |= imported if path.name == "__init__.py" else imported & _exported(tree)
    classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    return ModuleInfo(frozenset(top), classes)


@attrs.frozen
class Index:
    defined: frozenset[str]  # bound at a module's or a class's level, or a def or class
    functions: frozenset[str]
    callables: frozenset[str]  # functions and classes
    classes: dict[str, list[ast.ClassDef]]


def _declarations(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of a module or class body, and of the classes and functions in it
    (not every expression: the walk stays quick)."""
    for node in body:
        yield node
        if isinstance(node, _DEFINITION):
            yield from _declarations(node.body)
        elif isinstance(node, ast.If | ast.Try):
            yield from _declarations([*node.body, *node.orelse])


@cache
def index() -> Index:
    """What the project (DEFINITION_DIRS) defines."""
    defined: set[str] = set()
    functions: set[str] = set()
    found: dict[str, list[ast.ClassDef]] = {}
    for path in sources():
        for node in _declarations(_tree(path).body):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                functions.add(node.name)
            elif isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(node)
                for item in node.body:
                    defined |= _bound(item, imports=False)
        for item in _tree(path).body:
            defined |= _bound(item, imports=False)
    callables = functions | found.keys()
    return Index(frozenset(defined | callables), frozenset(functions), frozenset(callables), found)


def class_has(name: str, member: str, seen: frozenset[str] = frozenset()) -> bool | None:
    """Whether a class of that name has `member`, itself or through a base the project
    defines; None when the project has no class of that name."""
    nodes = index().classes.get(name)
    if not nodes:
        return None
    return any(
        member in members(node)
        or any(b not in seen and class_has(b, member, seen | {name}) for b in bases(node))
        for node in nodes
    )


@cache
def modules() -> dict[str, Path]:
    """vacancyd's modules by their dotted name below `vacancyd`: 'gate',
    'collect.nvml.naming', 'adapters' (its `__init__`)."""
    found: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if "__pycache__" in path.parts or parts == ("__init__",):
            continue
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


# --- what a span names -------------------------------------------------------------------


def problem(text: str) -> str | None:
    """Why a span names code of ours that does not exist; None when what it names exists,
    or when it is no code name of ours."""
    call = text.endswith("()")
    name = text.removesuffix("()")
    if name in NOT_OURS or name.split(".", 1)[0] in NOT_OURS:
        return None
    if not _PATH.fullmatch(name):
        return None  # a call with arguments, a command, a sentence, a placeholder
    if name.endswith(".py") or name.startswith(tuple(f"{d}/" for d in REPOSITORY_DIRS)):
        return None if _path_exists(name) else "no such file"
    if _DOTTED.fullmatch(name) and not _FILE_NAME.fullmatch(name):
        head, *_, last = name.split(".")
        if head == "vacancyd":
            return _module_problem(name.removeprefix("vacancyd."), qualified=True)
        if _CAMEL.fullmatch(head):
            return _member_problem(name)
        if head not in modules():
            return None  # another library's name, a file name, a D-Bus interface
        if call or _CAMEL.fullmatch(last) or last in index().callables or name in modules():
            return _module_problem(name, qualified=False)
        return None  # `owner.presence`, `reclaim.last`: a config or JSON key
    if _CAMEL.fullmatch(name) or _PRIVATE.fullmatch(name):
        return None if name in index().defined else "the project defines nothing of this name"
    if call and _FUNCTION.fullmatch(name):
        return None if name in index().functions else "the project has no function of this name"
    return None


def _path_exists(text: str) -> bool:
    if text.startswith(tuple(f"{d}/" for d in REPOSITORY_DIRS)):
        return any(ROOT.glob(text.rstrip("/")))
    if "/" not in text:
        return any(any((ROOT / d).rglob(text)) for d in SOURCE_DIRS)
    return any(any(base.glob(text)) for base in [ROOT, *(ROOT / d for d in SOURCE_DIRS)])


def _module_problem(text: str, *, qualified: bool) -> str | None:
    """`text`, a dotted name below `vacancyd`, is a module, or a module and a name (and a
    member of it) that the module defines."""
    if text in modules():
        return None
    parts = text.split(".")
    cut = max((c for c in range(1, len(parts)) if ".".join(parts[:c]) in modules()), default=0)
    if not cut:
        return "vacancyd has no such module"
    module, name, rest = ".".join(parts[:cut]), parts[cut], parts[cut + 1 :]
    info = module_info(modules()[module])
    if name in info.top:
        if not rest or class_has(name, rest[0]) is not False:
            return None
    elif not qualified and not rest and any(name in members(c) for c in info.classes.values()):
        return None  # `state.request_sample()`: the module's object, and its method
    return f"vacancyd.{module} defines no {'.'.join(parts[cut:])}"


def _member_problem(text: str) -> str | None:
    name, member = text.split(".")[:2]
    has = class_has(name, member)
    if has is None:
        return None if name in index().defined else f"the project defines no {name}"
    return None if has else f"{name} has no {member}"


# --- the tests ---------------------------------------------------------------------------


def test_the_docs_name_only_code_that_exists() -> None:
    missing = [
        f"{m.doc}:{m.line}: `{m.text}`: {why}"
        for m in mentions()
        if (why := problem(m.text)) is not None
    ]
    assert not missing, "the docs name code that does not exist:\n" + "\n".join(missing)


def test_names_of_other_projects_are_still_used_and_not_ours() -> None:
    used = {part for m in mentions() for part in (m.text.removesuffix("()"), m.text.split(".")[0])}
    ours = index().callables
    stale = [
        f"{name}: " + ("the project defines it" if name in ours else "no doc mentions it")
        for name in NOT_OURS
        if name in ours or name not in used
    ]
    assert not stale, "NOT_OURS needs an edit:\n" + "\n".join(stale)


def test_a_name_that_does_not_exist_is_reported() -> None:
    """The checks above can fail: each kind of name, misspelt, is caught."""
    for absent in [
        "vacancyd/proxy/nonexistent.py",
        "proxy/nonexistent.py",
        "nonexistent.py",
        "vacancyd.proxy.nonexistent",
        "vacancyd.gate.no_such_rule",
        "gate.no_such_rule()",
        "gate.plan_reclaim",  # a function that lives in another module
        "NoSuchClass",
        "SharedState.no_such_view",
        "no_such_function()",
        "_no_such_helper",
        "vacancyd.adapters.Adapter",  # the package stopped re-exporting its modules
    ]:
        assert problem(absent) is not None, absent
    for present in [
        "vacancyd/proxy/policy.py",
        "proxy/policy.py",
        "gate.py",
        "adapters/*_actions.py",
        "vacancyd.adapters.routes",
        "vacancyd.errors.ConfigError",
        "collect.nvml.naming",
        "gate.decide",
        "reclaim_plan.plan_reclaim",
        "state.request_sample()",
        "probe.CallLane",
        "SharedState",
        "Ledger.try_reserve",
        "EdgeKind",
        "owner.presence",  # a config key
        "reclaim.last",  # a /status key
        "holds.json",
        "Origin",
        "trio.current_time()",
        "POST /admin/lending",
    ]:
        assert problem(present) is None, present


# --- the architecture page's import rules follow pyproject.toml -------------------------

ARCHITECTURE = ROOT / "docs" / "architecture.md"
LAYERS_SECTION = "## Layers and import rules"


def _contracts() -> list[dict[str, Any]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contracts: list[dict[str, Any]] = config["tool"]["importlinter"]["contracts"]
    return contracts


def _layer(text: str) -> frozenset[str]:
    """The modules of one layer, `a | b`, short for `vacancyd.a` and `vacancyd.b`."""
    names = (name.strip().strip("()") for name in re.split(r"[|:]", text))
    return frozenset(name.removeprefix("vacancyd.") for name in names if name)


def _section() -> str:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    start = text.index(LAYERS_SECTION)
    end = text.find("\n## ", start + len(LAYERS_SECTION))
    return text[start : end if end > 0 else None]


def _drawn() -> tuple[list[frozenset[str]], dict[str, list[frozenset[str]]]]:
    """The section's two drawings: the package's layers, top first (a line that starts
    with `  |` goes on naming the layer above; the words after two spaces describe it),
    and each inner package's layers (`proxy/  a | b > c`, continued on indented lines)."""
    outer, inner = re.findall(r"```\n(.*?)```", _section(), re.S)[:2]
    layers: list[set[str]] = []
    for line in outer.splitlines():
        names = re.split(r"\s{2,}", line.strip())[0]
        if line.startswith("  |"):
            layers[-1] |= set(re.findall(r"[a-z_]+", names))
        elif line and not line[0].isspace():
            layers.append(set(re.findall(r"[a-z_]+", names)))
    stacks: dict[str, str] = {}
    container = ""
    for line in inner.splitlines():
        if line and not line[0].isspace():
            container, _, rest = line.partition(" ")
            stacks[container] = rest
        elif line.strip():
            stacks[container] += " " + line.strip()
    return (
        [frozenset(layer) for layer in layers],
        {c: [_layer(part) for part in stack.split(">")] for c, stack in stacks.items()},
    )


def test_the_architecture_page_draws_the_layers_of_pyproject() -> None:
    drawn, drawn_inside = _drawn()
    expected_inside: dict[str, list[frozenset[str]]] = {}
    for contract in _contracts():
        if contract["type"] != "layers":
            continue
        for container in contract.get("containers", []):
            short = container.removeprefix("vacancyd.").replace(".", "/") + "/"
            expected_inside[short] = [_layer(layer) for layer in contract["layers"]]
        if not contract.get("containers"):
            assert drawn == [_layer(layer) for layer in contract["layers"]], (
                f"docs/architecture.md's layer drawing differs from {contract['name']!r}"
            )
    assert drawn_inside == expected_inside, "the inner packages' layers differ"


def test_the_architecture_page_names_every_contract() -> None:
    section = _section()
    missing = [c["name"] for c in _contracts() if c["name"].split(":")[0] not in section]
    assert not missing, f"docs/architecture.md does not describe: {missing}"
    (pure,) = [c for c in _contracts() if c["name"].startswith("the pure core")]
    bullet = section[section.index('**"the pure core') :].split(" import no ")[0]
    listed = set(re.findall(r"`([a-z_.]+)`", bullet))
    expected = {m.removeprefix("vacancyd.") for m in pure["source_modules"]}
    assert listed == expected, (
        f"the pure core's modules on docs/architecture.md: {sorted(listed - expected)} are "
        f"not in the contract, {sorted(expected - listed)} are missing"
    )
