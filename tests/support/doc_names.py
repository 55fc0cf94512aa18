"""Check that the code a document names in backticks exists where the document says.

A document is cut into paragraphs (a list item, a table row, a heading, or lines between blank lines; fenced
blocks are left out: diagrams and commands). Each inline code span of a paragraph is read by the first rule
that matches it:

1. ``section.key`` or ``section.key: value`` with ``section`` one of the config's sections (``engine``,
   ``draft``, ...): a config key, checked against the dataclasses of :mod:`specdist.config` (a ``draft.`` key may
   also be a field of a draft method's ``settings``). ``section:`` alone names the section.
2. A span with a space: a command or an expression. ``specdist SUB [SUB]`` must name subcommands of
   ``specdist``'s parser; ``python -m MODULE`` an existing module; any path (``x/y.py``) or ``specdist.``,
   ``workers.``, ``cluster.`` dotted name inside it is checked as in 3-5; the rest is prose.
3. A path (it has a ``/`` or ends in a file extension): a file or folder of the repository, from its root, from
   ``specdist/``, or as the unique file whose path ends with it. ``dir/module.attr`` and ``module:attr`` name an
   attribute of that module.
4. A dotted name starting ``specdist.``, ``workers.`` or ``cluster.``: a module, then names defined or imported
   in it, then members (methods, class attributes, dataclass fields, ``self.x`` assignments, along the bases).
5. A name ``A``, ``A.b``, ``a()``: ``A`` is defined (class, function, constant) in a module the paragraph names,
   or in exactly one module of specdist, workers and cluster (tests/support counts where the paragraph names
   it); or ``A`` is the short name of one module (``runner._lm_head``). A bare name may also be a member of a
   class the paragraph names or of a class of a module it names, a config key's last part, an attribute the
   code reads, or a field of the transformers config of a model family (``qwen2``) the paragraph names. A
   call's arguments are not checked.
6. A message, enum, service, rpc or field of ``proto/``; a string the code holds (a config value: ``gumbel``,
   ``paged-torch``; a health service's name), or a word of one (``non-torch``); an HTTP route (``/health``):
   a string of the code; a Prometheus series (``specdist_..._total{label}``): its name joined from strings of
   the code; what pyproject.toml holds (a contract's id, a requirement's name; ``[a.b]``: a table); a Kubernetes
   kind the chart makes; a name the code imports from a library (``Protocol``); a library's dotted name that
   imports (``torch.compile``). A glob must match a file (``*.proto``) or a config key (``suffix_*``);
   ``name[i]`` is checked as ``name``; ``name=value`` needs a parameter ``name`` in the code; ``pkg==1.0`` a
   requirement ``pkg``.

Not checked: a command alone (``lint-imports``), a flag (``--no-deps``), Python's and YAML's constants, an
elided name (``..._total``), an ``owner/name`` that is no repository path (a Hugging Face model id), and the
entries of NOT_CODE, each with its reason (maths notation, a model folder's files).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import re
import typing
from dataclasses import dataclass
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]
CODE_ROOTS = ("specdist", "workers", "cluster")
READ = (*CODE_ROOTS, "tests/support")  # the folders whose modules are read (the tests' helpers too)
FILE_EXTENSIONS = (
    ".py",
    ".md",
    ".proto",
    ".yaml",
    ".yml",
    ".toml",
    ".sh",
    ".c",
    ".json",
    ".jsonl",
    ".png",
    ".tpl",
    ".txt",
    ".cfg",
    ".gguf",
)
COMMANDS = {
    "specdist",
    "python",
    "pip",
    "ruff",
    "lint-imports",
    "pytest",
    "helm",
    "kubectl",
    "ray",
    "docker",
    "curl",
    "git",
    "bash",
}
# The maths and the protocol's notation the docs use in backticks: not names of the code.
NOT_CODE = {
    "k_b": "a request's draft length in the step's formula",
    "k": "the draft length",
    "p": "the target's distribution",
    "q": "the draft's distribution",
    "u": "a uniform",
    "x": "a token",
    "y": "a token",
    "d_1": "a draft token",
    "items[i]": "the field path of a batch call's item i in an error",
    "_private": "the form of a private name",
    "config.json": "a Hugging Face model folder's file",
    "pytorch_model.bin": "a Hugging Face model folder's file",
    "d_k": "a draft token",
    "d_1..d_k": "the draft tokens",
}
LITERALS = {"None", "True", "False", "null", "true", "false"}  # Python's and YAML's constants

FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
DOTTED = re.compile(rf"@?({IDENT}(?:\.{IDENT})*)(\(.*\))?")
EMBEDDED = re.compile(r"(?<![\w./-])((?:specdist|workers|cluster)(?:\.[A-Za-z_]\w*)+|[\w.-]+(?:/[\w.-]+)+/?|\w+\.py)")


@dataclass(frozen=True)
class Mention:
    line: int
    span: str
    paragraph: str


def mentions(text: str) -> list[Mention]:
    """The inline code spans of ``text`` outside fenced blocks, each with its line and its paragraph."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    out, block, start = [], [], 0

    def flush() -> None:
        para = "\n".join(block)
        for m in SPAN.finditer(para):
            out.append(Mention(start + para.count("\n", 0, m.start()) + 1, m.group(1).strip(), para))

    for i, line in enumerate(text.split("\n")):
        new_item = re.match(r"\s*([-*]|\d+\.)\s|\s*\||#", line)
        if not line.strip() or new_item:
            if block:
                flush()
            block, start = ([line], i) if line.strip() else ([], i + 1)
        else:
            if not block:
                start = i
            block.append(line)
    if block:
        flush()
    return out


# ------------------------------------------------------------------------------------------------ the code


@dataclass
class Module:
    name: str
    path: Path
    defined: set[str]  # top-level classes, functions, assignments
    imported: set[str]  # names imported at top level (re-exports)
    classes: dict[str, ast.ClassDef]


class Code:
    """What the repository defines, read from its sources (nothing is imported but :mod:`specdist.config`,
    the draft methods' registry and the command line's parser)."""

    def __init__(self) -> None:
        self.modules: dict[str, Module] = {}
        self.literals: set[str] = set()
        self.words: set[str] = set()  # the words of the code's strings (``non-torch`` of a log line)
        self.attributes: set[str] = set()
        self.imports: set[str] = set()  # names imported anywhere (from x import Name)
        self.parameters: set[str] = set()  # parameter names of the code's functions
        for root in READ:
            for path in sorted((REPO / root).rglob("*.py")):
                self._read(path)
        self.files = sorted(
            str(p.relative_to(REPO))
            for p in REPO.rglob("*")
            if ".git" not in p.parts and "build" not in p.parts and "egg-info" not in str(p)
        )
        self.proto = set()
        for proto in (REPO / "proto").rglob("*.proto"):
            src = proto.read_text(encoding="utf-8")
            self.proto |= set(re.findall(rf"(?:message|enum|service|rpc)\s+({IDENT})", src))
            self.proto |= set(re.findall(rf"^\s*(?:repeated\s+|optional\s+)?[\w.]+\s+({IDENT})\s*=\s*\d+", src, re.M))
            self.proto |= set(re.findall(rf"^\s*({IDENT})\s*=\s*\d+;", src, re.M))
            self.proto.add(".".join(re.findall(r"^package\s+([\w.]+);", src, re.M)))
        pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
        self.toml_tables, self.toml_strings = set(), set()

        def walk(value, path: str) -> None:
            if isinstance(value, dict):
                self.toml_tables.add(path)
                for k, v in value.items():
                    walk(v, f"{path}.{k}" if path else k)
            elif isinstance(value, list):
                for v in value:
                    walk(v, path)
            elif isinstance(value, str):
                self.toml_strings.add(value)

        walk(pyproject, "")
        project = pyproject["project"]
        self.requirements = {
            re.split(r"[\s\[<>=~;]", r, maxsplit=1)[0]
            for r in project["dependencies"] + sum(project["optional-dependencies"].values(), [])
        }
        self.kinds = {
            k
            for f in (REPO / "helm").rglob("*")
            if f.suffix in (".yaml", ".tpl")
            for k in re.findall(r"^\s*kind:\s*(\w+)", f.read_text(encoding="utf-8"), re.M)
        }

    def _read(self, path: Path) -> None:
        rel = path.relative_to(REPO).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defined, imported, classes = set(), set(), {}
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
                if isinstance(node, ast.ClassDef):
                    classes[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for t in ast.walk(target):
                        if isinstance(t, ast.Name):
                            defined.add(t.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if len(node.value) < 80:
                    self.literals.add(node.value)
                self.words |= set(re.findall(r"[A-Za-z][\w-]*[A-Za-z0-9]", node.value))
            elif isinstance(node, ast.Attribute):
                self.attributes.add(node.attr)
            elif isinstance(node, ast.ImportFrom):
                self.imports |= {a.name for a in node.names}
            elif isinstance(node, ast.arg):
                self.parameters.add(node.arg)
        self.modules[name] = Module(name, path, defined, imported, classes)

    @functools.cached_property
    def short_names(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for name in self.modules:
            out.setdefault(name.rsplit(".", 1)[-1], []).append(name)
        return out

    def defining(self, name: str) -> list[str]:
        return [m.name for m in self.modules.values() if name in m.defined]

    def members(self, module: str, cls: str, seen: frozenset = frozenset()) -> set[str]:
        """Methods, class attributes, annotated fields and ``self.x`` assignments of ``cls``, with its bases'."""
        node = self.modules[module].classes.get(cls)
        if node is None or (module, cls) in seen:
            return set()
        out = set()
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(item.name)
            elif isinstance(item, ast.Assign):
                out |= {t.id for t in item.targets if isinstance(t, ast.Name)}
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                out.add(item.target.id)
        for sub in ast.walk(node):
            if (
                isinstance(sub, ast.Attribute)
                and isinstance(sub.ctx, ast.Store)
                and isinstance(sub.value, ast.Name)
                and sub.value.id == "self"
            ):
                out.add(sub.attr)
        for base in node.bases:
            base_name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
            for owner in self.defining(base_name or ""):
                out |= self.members(owner, base_name, seen | {(module, cls)})
        if any(getattr(b, "id", getattr(b, "attr", "")) in ("Enum", "StrEnum", "str") for b in node.bases):
            out |= {"value", "name"}
        return out

    def resolve_in(self, module: str, parts: list[str]) -> bool:
        """``parts`` name something in ``module``: a top-level name, then members of the class it is."""
        mod = self.modules.get(module)
        if mod is None:
            return False
        if not parts:
            return True
        head, rest = parts[0], parts[1:]
        if f"{module}.{head}" in self.modules:
            return self.resolve_in(f"{module}.{head}", rest)
        if head not in mod.defined:
            if head in mod.imported and not rest:
                return True
            return False
        if not rest:
            return True
        if head not in mod.classes:
            return False
        members = self.members(module, head)
        if rest[0] not in members:
            return False
        if len(rest) == 1:
            return True
        inner = mod.classes[head]  # a nested class
        return any(isinstance(n, ast.ClassDef) and n.name == rest[0] for n in inner.body) and self.resolve_in_class(
            module, inner, rest[1:]
        )

    def resolve_in_class(self, module: str, node: ast.ClassDef, parts: list[str]) -> bool:
        names = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        return len(parts) == 1 and parts[0] in names

    def find_file(self, path: str) -> list[str]:
        """The repository paths ``path`` names: from the root, from ``specdist/``, or as a unique suffix."""
        path = path.rstrip("/")
        for base in ("", "specdist/"):
            if (REPO / base / path).exists():
                return [base + path]
        return [f for f in self.files if f.endswith("/" + path)]


@functools.cache
def code() -> Code:
    return Code()


# ------------------------------------------------------------------------------------------------ config keys


@functools.cache
def config_sections() -> dict[str, type]:
    from specdist.config import Config

    return {f.name: f.type if isinstance(f.type, type) else _config_type(f.type) for f in dataclasses.fields(Config)}


def _config_type(annotation):
    import specdist.config as config

    if isinstance(annotation, str):
        return getattr(config, annotation.split("|")[0].strip(), None)
    return annotation


def config_key_exists(key: str) -> bool:
    import specdist.config as config

    parts = key.split(".")
    cls = config_sections().get(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        if cls is None or not dataclasses.is_dataclass(cls):
            return False
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            return parts[0] == "draft" and i == 1 and len(parts) == 2 and part in draft_method_keys()
        hints = typing.get_type_hints(cls, vars(config))
        nxt = hints.get(part)
        # a field typed loosely (``object``) that a dataclass of its name reads: cluster.replicas -> ReplicasConfig
        cls = nxt if dataclasses.is_dataclass(nxt) else getattr(config, f"{part.title().replace('_', '')}Config", None)
    return True


@functools.cache
def config_key_names() -> set[str]:
    """The last part of every config key (``draft.`` methods' own keys too)."""
    import specdist.config as config

    names, todo = set(draft_method_keys()), list(config_sections().values())
    while todo:
        cls = todo.pop()
        hints = typing.get_type_hints(cls, vars(config))
        for f in dataclasses.fields(cls):
            names.add(f.name)
            nxt = hints.get(f.name)
            if not dataclasses.is_dataclass(nxt):
                nxt = getattr(config, f"{f.name.title().replace('_', '')}Config", None)
            if nxt is not None and dataclasses.is_dataclass(nxt):
                todo.append(nxt)
    return names


@functools.cache
def draft_method_keys() -> set[str]:
    from specdist.cores.proposers import proposer_class, proposer_methods

    keys = set()
    for method in proposer_methods():
        settings = getattr(proposer_class(method), "settings", None)
        if settings is not None and dataclasses.is_dataclass(settings):
            keys |= {f.name for f in dataclasses.fields(settings)}
    return keys


@functools.cache
def cli_commands() -> dict[str, set[str]]:
    """``specdist``'s subcommands, each with its own subcommands."""
    import argparse

    from specdist.cli import build_parser

    def choices(parser) -> dict:
        for action in parser._actions:  # noqa: SLF001  argparse keeps its subparsers here alone
            if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
                return action.choices
        return {}

    return {name: set(choices(sub)) for name, sub in choices(build_parser()).items()}


# ------------------------------------------------------------------------------------------------ the rules


def problem(m: Mention) -> str | None:
    """Why ``m`` does not name what exists, or None."""
    span = m.span
    if span in NOT_CODE:
        return None
    key = re.fullmatch(r"([a-z_][\w.]*):(?:\s+\S.*)?", span)
    if key and key.group(1).split(".")[0] in config_sections():
        return None if config_key_exists(key.group(1)) else f"no config key {key.group(1)}"
    if " " in span:
        return command_problem(span)
    if span in COMMANDS or span in LITERALS or span.startswith("-"):  # a command, a constant, a flag
        return None
    c = code()
    if span in c.toml_strings or span in c.requirements or span in c.kinds:
        return None
    if not DOTTED.fullmatch(span) and (span in c.literals or span in c.words):  # ``paged-torch``, ``non-torch``
        return None
    if re.fullmatch(r"[\w.-]+(==|>=|<=|~=)\S+", span):  # a requirement
        name = re.split(r"[=<>~]", span, maxsplit=1)[0]
        return None if name in c.requirements else f"{name}: not a requirement of pyproject.toml"
    metric = re.fullmatch(r"(specdist_\w+)(\{[\w,]*\})?", span)
    if metric:  # a Prometheus series: its name joined from at most three strings of the code, then _total
        name = metric.group(1)
        return None if joined(name, 3) or joined(name.removesuffix("_total"), 3) else f"{name}: no metric of the code"
    if span.startswith("...") or span.endswith("..."):  # an elided name
        return None
    if span.startswith("["):
        return None if span.strip("[]") in c.toml_tables else f"pyproject.toml has no table {span}"
    if "*" in span:
        if "/" in span:
            return None if any(REPO.glob(span)) else f"no file matches {span}"
        pattern = re.compile(re.escape(span).replace(r"\*", ".*"))
        return (
            None
            if any(pattern.fullmatch(k) for k in config_key_names()) or any(pattern.match(lit) for lit in c.literals)
            else f"nothing of the code matches {span}"
        )
    if span.startswith("/"):
        return f"{span}: no route of the code"
    if re.fullmatch(r"\w+=.+", span):  # a keyword argument
        name = span.split("=", 1)[0]
        return None if name in c.parameters else f"{name}: no parameter of the code"
    if re.fullmatch(r"[\w.]+\[[^]]*\]", span):  # an element
        span = span.split("[", 1)[0]
    return name_problem(span, m.paragraph)


def command_problem(span: str) -> str | None:
    words = span.split()
    if words[0] == "specdist" and len(words) > 1 and not words[1].startswith("-"):
        commands = cli_commands()
        if words[1] not in commands:
            return f"specdist has no subcommand {words[1]}"
        if (
            commands[words[1]]
            and len(words) > 2
            and re.fullmatch(r"[a-z-]+", words[2])
            and words[2] not in commands[words[1]]
        ):
            return f"specdist {words[1]} has no subcommand {words[2]}"
    if words[0] == "python" and "-m" in words:
        module = words[words.index("-m") + 1]
        if module.split(".")[0] in CODE_ROOTS and module not in code().modules:
            return f"no module {module}"
    for token in EMBEDDED.findall(span):
        token = token.rstrip(".,;:")
        if token.split(".")[0] in CODE_ROOTS and "/" not in token:
            why = dotted_problem(token)
        elif is_repo_path(token):
            why = path_problem(token)
        else:
            continue
        if why:
            return why
    return None


def joined(name: str, pieces: int) -> bool:
    """``name`` is at most ``pieces`` string literals of the code put end to end."""
    return bool(name) and (
        name in code().literals
        or pieces > 1
        and any(name[:i] in code().literals and joined(name[i:], pieces - 1) for i in range(1, len(name)))
    )


def is_repo_path(span: str) -> bool:
    """A path of the repository: it ends in a file extension or ``/``, or starts at a top-level entry of the
    repository or a subpackage of specdist. Other ``a/b`` (a Hugging Face model id, a ratio) are not paths."""
    first = span.split("/", 1)[0]
    return (
        span.endswith(FILE_EXTENSIONS)
        or span.endswith("/")
        or (REPO / first).exists()
        or (REPO / "specdist" / first).is_dir()
    )


def name_problem(span: str, paragraph: str) -> str | None:
    if "/" in span and not is_repo_path(span):
        return None  # a model id (owner/name)
    if "/" in span or span.endswith(FILE_EXTENSIONS) or ":" in span and "." in span.split(":")[0]:
        return path_problem(span)
    m = DOTTED.fullmatch(span)
    if not m:
        return None if span in code().literals else f"{span}: not a name, and no string of the code"
    parts = m.group(1).split(".")
    if len(parts) > 1 and span in code().literals:  # a name the code holds as a string (a health service's)
        return None
    if parts[0] in CODE_ROOTS and len(parts) > 1:
        why = dotted_problem(m.group(1))
        if why is None or parts[0] != "cluster":
            return why
    if parts[0] in config_sections() and len(parts) > 1:
        return None if config_key_exists(m.group(1)) else f"no config key {m.group(1)}"
    if len(parts) > 1 and all(len(p) > 1 and p in code().literals for p in parts) and not m.group(2):
        return None  # a path of fields in a JSON body (``usage.speculative``)
    if (
        parts[0] not in code().modules
        and not code().defining(parts[0])
        and not code().short_names.get(parts[0])
        and len(parts) > 1
        and importlib.util.find_spec(parts[0]) is not None
    ):
        return library_problem(parts)
    return bare_problem(parts, paragraph)


def library_problem(parts: list[str]) -> str | None:
    """A library's dotted name: its longest importable module, then attributes."""
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return f"{'.'.join(parts[:cut])} has no {'.'.join(parts[cut:])}"
            obj = getattr(obj, attr)
        return None
    return f"no module {parts[0]}"


def dotted_problem(name: str) -> str | None:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module in code().modules:
            return None if code().resolve_in(module, parts[cut:]) else f"{module} has no {'.'.join(parts[cut:])}"
    return f"no module {name}"


def path_problem(span: str) -> str | None:
    attr = None
    if ":" in span:
        span, attr = span.split(":", 1)
        span = span.replace(".", "/") + ".py"
    elif not span.endswith(FILE_EXTENSIONS) and not span.endswith("/") and "." in span.rsplit("/", 1)[-1]:
        span, attr = span.rsplit(".", 1)
        span += ".py"
    found = code().find_file(span)
    if not found:
        return f"no file {span}"
    if len(found) > 1:
        return f"{span} is ambiguous: {', '.join(found)}"
    if attr is not None:
        module = found[0].removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        if not code().resolve_in(module, attr.split(".")):
            return f"{found[0]} has no {attr}"
    return None


def context_modules(paragraph: str) -> set[str]:
    """Modules the paragraph names: as a path, a dotted name, or the short name of a module."""
    out = set()
    for token in EMBEDDED.findall(paragraph):
        token = token.rstrip(".,;:")
        if "/" in token or token.endswith(".py"):
            for f in code().find_file(token.split(":")[0]):
                if f.endswith(".py"):
                    out.add(f.removesuffix(".py").replace("/", ".").removesuffix(".__init__"))
                elif (REPO / f).is_dir():
                    prefix = f.replace("/", ".")
                    out |= {m for m in code().modules if m.startswith(prefix + ".") or m == prefix}
        else:
            parts = token.split(".")
            out |= {".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in code().modules}
    return out


def bare_problem(parts: list[str], paragraph: str) -> str | None:
    c = code()
    head, rest = parts[0], parts[1:]
    context = context_modules(paragraph)
    # the tests' helpers count only where the paragraph names them
    owners = [o for o in c.defining(head) if o.split(".")[0] != "tests" or o in context]
    near = [o for o in owners if o in context]
    if not rest and not near:  # a member of a class the paragraph names, or of a class of a module it names
        classes = [
            (mod, cls)
            for mod in c.modules.values()
            for cls in mod.classes
            if re.search(rf"`{cls}\b", paragraph) or mod.name in context
        ]
        if any(head in c.members(mod.name, cls) for mod, cls in classes):
            return None
    for owner in near or (owners if len(owners) == 1 else []):
        if c.resolve_in(owner, parts):
            return None
    if near or len(owners) == 1:
        return f"{(near or owners)[0]} has no {'.'.join(parts)}"
    modules = c.short_names.get(head, [])
    in_context = [mod for mod in modules if mod in context] or (modules if len(modules) == 1 else [])
    if rest and in_context:
        if any(c.resolve_in(mod, rest) for mod in in_context):
            return None
        return f"{in_context[0]} has no {'.'.join(rest)}"
    if not rest and modules:
        return None  # a module by its short name
    if len(owners) > 1:
        return f"{head} is defined in {len(owners)} modules ({', '.join(sorted(owners))}) and the paragraph names none"
    if not rest:
        if (
            head in NOT_CODE
            or head in c.proto
            or head in c.literals
            or head in c.imports
            or head in config_key_names()
            or head in c.attributes
            or model_config_field(head, paragraph)
        ):
            return None
        return f"{head}: no name of the code, the config, the protos or the paragraph's classes"
    if head in c.proto and len(rest) == 1 and rest[0] in c.proto:
        return None
    return f"{'.'.join(parts)}: {head} is no name of the code"


def model_config_field(name: str, paragraph: str) -> bool:
    """``name`` is a field of the transformers config of a model family (``model_type``) the paragraph names."""
    from specdist.models.families import SUPPORTED_MODEL_TYPES

    types = [t for t in re.findall(r"`(\w+)`", paragraph) if t in SUPPORTED_MODEL_TYPES]
    if not types:
        return False
    from transformers import AutoConfig

    return any(hasattr(AutoConfig.for_model(t), name) for t in types)


def problems(text: str) -> list[str]:
    out = []
    for m in mentions(text):
        why = problem(m)
        if why:
            out.append(f"line {m.line}: `{m.span}`: {why}")
    return out
