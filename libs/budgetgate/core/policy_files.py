"""Policy files as read: bounded, safe YAML with the line of every field, for error messages.

YAML is read with the safe loader and bounded before anything is built from it: nesting deeper
than MAX_DEPTH (aliases expanded), a document expanding (aliases included) to more than
MAX_NODES nodes, a node that contains itself and duplicate keys are errors with file and line,
never a hang. A number YAML 1.1 reads in another base (`010` is 8, `0x10` 16, `1:30` 90) is
kept as its text (`NotDecimal`), which validation refuses where a number belongs."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path, PurePosixPath
from typing import Any

import yaml
from yaml.constructor import SafeConstructor

from budgetgate.core.sources import PolicyError

MAX_FILE_BYTES = 1 << 20
# Keys whose values are names, not numbers: `cost-center: 1042` means the string "1042".
_RAW_SCALAR_PARENTS = frozenset({"labels", "id", "namespace", "namespaces", "flavor", "region"})


class PolicyValidationError(ValueError):
    """One or more policy documents are invalid; `errors` lists each with file and line."""

    def __init__(self, errors: Sequence[PolicyError]) -> None:
        self.errors = tuple(sorted(errors, key=lambda e: (e.file, e.line, e.message)))
        super().__init__("\n".join(str(e) for e in self.errors))


@dataclass(frozen=True, slots=True)
class SourceDocument:
    """One YAML document as read, with a map from field paths to lines for error messages."""

    file: str
    line: int
    data: Any
    lines: dict[tuple[Any, ...], int]

    def line_of(self, path: Iterable[Any]) -> int:
        path = tuple(path)
        while path and path not in self.lines:
            path = path[:-1]
        return self.lines.get(path, self.line)


def unstorable_text(doc: SourceDocument) -> list[PolicyError]:
    """A key or text of `doc` holding the NUL character, which Postgres cannot store (and no
    policy means): one error per place, with its line where the document was read from YAML."""
    errors: list[PolicyError] = []
    pending: list[tuple[tuple[Any, ...], Any]] = [((), doc.data)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, str):
            if "\x00" in value:
                errors.append(PolicyError(doc.file, doc.line_of(path), f"{_dotted(path) or 'the document'} holds the NUL character (\\u0000); remove it"))
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and "\x00" in key:
                    where = _dotted(path) or "the document"
                    errors.append(PolicyError(doc.file, doc.line_of(path), f"a key of {where} holds the NUL character (\\u0000): {key!r}"))
                pending.append(((*path, key), item))
        elif isinstance(value, list):
            pending.extend(((*path, i), item) for i, item in enumerate(value))
    return errors


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(p).replace("\x00", "\\u0000") for p in path)


def read_directory(directory: Path) -> list[SourceDocument]:
    """Every document of every *.yaml / *.yml file below `directory`, in path order."""
    documents, errors = parse_files(directory_files(directory))
    if errors:
        raise PolicyValidationError(errors)
    return documents


def directory_files(path: Path) -> list[tuple[str, bytes | OSError]]:
    """(name, content) of every *.yaml / *.yml file below a directory, or of one file; a file
    that cannot be read comes with its error instead."""
    if path.is_file():
        files, root = [path], path.parent
    elif path.is_dir():
        found = (p for p in path.rglob("*") if p.suffix in (".yaml", ".yml") and ".git" not in p.relative_to(path).parts)
        files, root = sorted(found, key=lambda p: path_order(p.relative_to(path).as_posix())), path
    else:
        raise PolicyValidationError([PolicyError(str(path), 0, "no such file or directory")])
    result: list[tuple[str, bytes | OSError]] = []
    for file in files:
        name = file.relative_to(root).as_posix()
        try:
            if file.stat().st_size > MAX_FILE_BYTES:
                result.append((name, OSError(f"file is larger than {MAX_FILE_BYTES} bytes")))
                continue
            result.append((name, file.read_bytes()))
        except OSError as exc:
            result.append((name, exc))
    return result


def path_order(name: str) -> tuple[str, ...]:
    """The order policy files are read in, wherever they come from (a folder, a commit, a work
    tree): by path, folder by folder (`a/x.yaml` before `a-b/x.yaml`). Policy order decides the
    order of a decision's evaluations, so it must not depend on anything else."""
    return PurePosixPath(name).parts


def parse_files(files: Iterable[tuple[str, bytes | OSError]]) -> tuple[list[SourceDocument], list[PolicyError]]:
    """Documents of the readable files and the errors of the others, so that a syntax error in
    one file does not hide what is wrong with the rest."""
    documents: list[SourceDocument] = []
    errors: list[PolicyError] = []
    for name, content in files:
        if isinstance(content, OSError):
            errors.append(PolicyError(name, 0, f"cannot read file: {content.strerror or content}"))
            continue
        if len(content) > MAX_FILE_BYTES:
            errors.append(PolicyError(name, 0, f"file is larger than {MAX_FILE_BYTES} bytes"))
            continue
        try:
            documents.extend(parse_text(content.decode("utf-8"), name))
        except UnicodeDecodeError as exc:
            errors.append(PolicyError(name, 0, f"cannot read file: not UTF-8 ({exc.reason})"))
        except PolicyValidationError as exc:
            errors.extend(exc.errors)
    return documents, errors


# Documents are small: one expanding to more nodes than this is an alias bomb, and one nested
# deeper than this would only exhaust the parser's stack.
MAX_NODES = 50_000
MAX_DEPTH = 64
# libyaml when present: much faster on big files; the same events, nodes and marks.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_STR = "tag:yaml.org,2002:str"


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
# What YAML 1.2 and every reader agree on: decimal digits (with _ between groups, as before).
_DECIMAL_INT = re.compile(r"[-+]?(0|[1-9][0-9_]*)")


class NotDecimal(str):
    """A scalar YAML 1.1 reads as a number in another base (`010` octal, `0x10`, `0b10`,
    `1:30` base 60), kept as its text: a name where a name belongs (`owner: 010`), refused
    where a number does (see documents.py), never silently another number."""

    yaml_value: Any

    def __new__(cls, text: str, yaml_value: Any) -> NotDecimal:
        made = super().__new__(cls, text)
        made.yaml_value = yaml_value
        return made

    def problem(self) -> str:
        return (
            f"{str(self)!r} is not a plain decimal number (YAML 1.1 reads it as {self.yaml_value}: a leading 0 is octal, "
            "0x hexadecimal, 0b binary, a colon base 60); write it in decimal digits"
        )


class _YamlProblem(Exception):
    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line = line
        self.message = message


def parse_text(text: str, file: str) -> list[SourceDocument]:
    """The documents of one YAML text; YAML syntax errors, duplicate keys, deep nesting,
    recursive aliases and documents that expand beyond MAX_NODES carry their line."""
    try:
        _check_depth(text)
        nodes = list(yaml.compose_all(text, Loader=_LOADER))
    except _YamlProblem as problem:
        raise PolicyValidationError([PolicyError(file, problem.line, problem.message)]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 0
        raise PolicyValidationError([PolicyError(file, line, f"invalid YAML: {getattr(exc, 'problem', exc)}")]) from exc
    documents, errors = [], []
    for node in nodes:
        if node is None:
            continue
        lines: dict[tuple[Any, ...], int] = {}
        try:
            if _expanded(node, {}, set(), depth=0, at=node.start_mark.line + 1)[0] > MAX_NODES:
                raise _YamlProblem(node.start_mark.line + 1, f"the document expands to more than {MAX_NODES} YAML nodes (an alias bomb?)")
            data = _Converter(lines).convert(node, (), raw=False)
        except _YamlProblem as problem:
            errors.append(PolicyError(file, problem.line, problem.message))
            continue
        documents.append(SourceDocument(file, node.start_mark.line + 1, data, lines))
    if errors:
        raise PolicyValidationError(errors)
    return documents


def _check_depth(text: str) -> None:
    # The event parser is iterative; composing nodes is not, so bound the nesting first.
    depth = events = 0
    for event in yaml.parse(text, Loader=_LOADER):
        events += 1
        if events > 2 * MAX_NODES:
            raise _YamlProblem(event.start_mark.line + 1, f"more than {MAX_NODES} YAML nodes")
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise _YamlProblem(event.start_mark.line + 1, f"nested more than {MAX_DEPTH} levels deep")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def _expanded(node: yaml.Node, known: dict[int, tuple[int, int]], open_: set[int], *, depth: int, at: int) -> tuple[int, int]:
    """How many nodes `node` becomes once every alias is expanded, and how many levels of
    collections deep, without expanding them. `depth` counts the collections around it (from
    the document's root), `at` is the line of the one it is in. Nesting through aliases counts:
    anchors each nesting the one before deeper are past MAX_DEPTH before they are past Python's
    stack (the conversion after this one recurses as deep)."""
    key = id(node)
    if key in known:
        size, height = known[key]
    elif key in open_:
        raise _YamlProblem(node.start_mark.line + 1, "a YAML alias refers to a node that contains it (recursive alias)")
    else:
        size, height = 1, 0
        if isinstance(node, yaml.CollectionNode):
            at = node.start_mark.line + 1
            if depth + 1 > MAX_DEPTH:
                raise _YamlProblem(at, f"nested more than {MAX_DEPTH} levels deep (aliases expanded)")
            open_.add(key)
            children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else node.value
            for child in children:
                child_size, child_height = _expanded(child, known, open_, depth=depth + 1, at=at)
                size, height = size + child_size, max(height, child_height)
            height += 1
            open_.discard(key)
        known[key] = (size, height)
    if depth + height > MAX_DEPTH:
        # An alias to a node already measured: it nests that deep where it is used.
        raise _YamlProblem(at, f"nested more than {MAX_DEPTH} levels deep (aliases expanded)")
    return size, height


class _Converter:
    """YAML nodes (checked by _expanded) to Python values, with the line of every path."""

    def __init__(self, lines: dict[tuple[Any, ...], int]) -> None:
        self.lines = lines
        self.constructor = SafeConstructor()

    def convert(self, node: yaml.Node, path: tuple[Any, ...], *, raw: bool) -> Any:
        line = node.start_mark.line + 1
        self.lines.setdefault(path, line)
        if isinstance(node, yaml.MappingNode):
            result: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    raise _YamlProblem(key_node.start_mark.line + 1, "a mapping key must be a plain name")
                key = key_node.value
                if key in result:
                    raise _YamlProblem(key_node.start_mark.line + 1, f"duplicate key {key!r} (first at line {self.lines[(*path, key)]})")
                self.lines[(*path, key)] = key_node.start_mark.line + 1
                result[key] = self.convert(value_node, (*path, key), raw=raw or key in _RAW_SCALAR_PARENTS)
            return result
        if isinstance(node, yaml.SequenceNode):
            return [self.convert(item, (*path, i), raw=raw) for i, item in enumerate(node.value)]
        if node.tag == _STR or (raw and node.tag != "tag:yaml.org,2002:null"):
            return node.value
        if (node.tag == _INT and not _DECIMAL_INT.fullmatch(node.value)) or (node.tag == _FLOAT and ":" in node.value):
            return NotDecimal(node.value, self._construct(node, line))
        if node.tag == _FLOAT:
            # Limits and rates are exact decimals; going through float would round 3.933.
            try:
                return Decimal(node.value.replace("_", ""))
            except ArithmeticError:
                pass  # .inf / .nan: let validation reject them by name
        return self._construct(node, line)

    def _construct(self, node: yaml.Node, line: int) -> Any:
        try:
            return self.constructor.construct_object(node, deep=True)
        except yaml.YAMLError as exc:
            raise _YamlProblem(line, f"invalid YAML value: {getattr(exc, 'problem', exc)}") from exc
