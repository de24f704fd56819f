"""Regenerate the Python code of the wire contracts from `proto/`.

`python -m budgetgate.contracts.build` rewrites `libs/budgetgate/v1/*_pb2.py` (and `.pyi`) with
the protoc shipped in grpcio-tools; `--check` only reports stale files and exits 1 if any.
The generated code is committed, and `tests/unit/test_proto_fresh.py` fails when it drifts.

Proto files live at `proto/budgetgate/v1/` and are compiled with `-Iproto`, so generated modules
import each other as `budgetgate.v1.x_pb2`, the same name they have in the installed package.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

PACKAGE_PATH = Path("budgetgate") / "v1"
_GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi")
# The source tree is libs/budgetgate/contracts/build.py; proto/ sits beside libs/.
_SOURCE_ROOT = Path(__file__).resolve().parents[3]


class ContractsBuildError(RuntimeError):
    """protoc failed, or the proto directory could not be found."""


def find_proto_root(start: Path | None = None) -> Path:
    """The `proto/` directory: next to the package source, else under `start` (default: cwd)."""
    candidates = [_SOURCE_ROOT / "proto", (start or Path.cwd()) / "proto"]
    for candidate in candidates:
        if (candidate / PACKAGE_PATH).is_dir():
            return candidate
    tried = ", ".join(str(c) for c in candidates)
    raise ContractsBuildError(f"no proto/{PACKAGE_PATH.as_posix()} directory found (tried {tried})")


def generated_package_dir() -> Path:
    """Where the committed generated modules live (`libs/budgetgate/v1`)."""
    return Path(__file__).resolve().parent.parent / "v1"


def proto_files(proto_root: Path) -> list[Path]:
    """The contract's .proto files, relative to `proto_root`, in a stable order."""
    return sorted(p.relative_to(proto_root) for p in (proto_root / PACKAGE_PATH).glob("*.proto"))


def generate(out_root: Path, *, proto_root: Path | None = None) -> Path:
    """Run protoc into `out_root`; returns `out_root/budgetgate/v1` holding the generated files."""
    # Imported here so that importing this module (e.g. for find_proto_root) needs no dev tools.
    from grpc_tools import protoc

    proto_root = proto_root or find_proto_root()
    files = proto_files(proto_root)
    if not files:
        raise ContractsBuildError(f"no .proto files under {proto_root / PACKAGE_PATH}")
    well_known = resources.files("grpc_tools") / "_proto"
    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        *(f.as_posix() for f in files),
    ]
    code = protoc.main(args)
    if code != 0:
        raise ContractsBuildError(f"protoc exited with {code} (args: {' '.join(args)})")
    return out_root / PACKAGE_PATH


def _generated_names(directory: Path) -> set[str]:
    if not directory.is_dir():
        return set()
    return {p.name for p in directory.iterdir() if p.name.endswith(_GENERATED_SUFFIXES)}


def stale_files(expected_dir: Path, actual_dir: Path) -> list[str]:
    """Generated file names that differ, are missing from `actual_dir`, or are left over in it."""
    expected, actual = _generated_names(expected_dir), _generated_names(actual_dir)
    differing = {name for name in expected & actual if not filecmp.cmp(expected_dir / name, actual_dir / name, shallow=False)}
    return sorted(differing | (expected ^ actual))


def build(*, check: bool = False, proto_root: Path | None = None, target: Path | None = None) -> list[str]:
    """Regenerate into `target` (default: the package); returns the files that were stale.

    With `check`, nothing is written. Stale means changed, new, or generated from a .proto
    that no longer exists (those are deleted).
    """
    target = target or generated_package_dir()
    with tempfile.TemporaryDirectory(prefix="budgetgate-contracts-") as tmp:
        fresh = generate(Path(tmp), proto_root=proto_root)
        stale = stale_files(fresh, target)
        if check:
            return stale
        target.mkdir(parents=True, exist_ok=True)
        for name in stale:
            if (fresh / name).exists():
                shutil.copyfile(fresh / name, target / name)
            else:
                (target / name).unlink()
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m budgetgate.contracts.build", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report stale generated files; write nothing")
    parser.add_argument("--proto-root", type=Path, default=None, help="the proto/ directory (default: found)")
    args = parser.parse_args(argv)
    try:
        stale = build(check=args.check, proto_root=args.proto_root)
    except ContractsBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    verb = "stale" if args.check else "regenerated"
    for name in stale:
        print(f"{verb}: {(PACKAGE_PATH / name).as_posix()}")
    if not stale:
        print("generated contracts are up to date")
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    raise SystemExit(main())
