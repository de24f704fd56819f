"""The committed generated code matches proto/, and every event follows the envelope rule."""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path
from types import ModuleType

import pytest
from google.protobuf.descriptor import FieldDescriptor

from budgetgate.contracts import build as contracts_build, topics

COMMON = "common"


def _modules() -> dict[str, ModuleType]:
    root = contracts_build.find_proto_root()
    stems = [p.stem for p in contracts_build.proto_files(root)]
    return {stem: importlib.import_module(f"budgetgate.v1.{stem}_pb2") for stem in stems}


def test_committed_generated_code_is_fresh(tmp_path: Path) -> None:
    fresh = contracts_build.generate(tmp_path)

    stale = contracts_build.stale_files(fresh, contracts_build.generated_package_dir())

    assert not stale, f"generated code is stale: {', '.join(stale)}; run `python -m budgetgate.contracts.build` and commit"


def test_stale_check_names_changed_missing_and_leftover_files(tmp_path: Path) -> None:
    fresh = contracts_build.generate(tmp_path / "fresh")
    committed = tmp_path / "committed"
    shutil.copytree(fresh, committed)
    (committed / "usage_pb2.py").write_text((committed / "usage_pb2.py").read_text() + "# edited\n")
    (committed / "actions_pb2.pyi").unlink()
    (committed / "retired_pb2.py").write_text("")
    (committed / "__init__.py").write_text("")  # not generated: never reported

    assert contracts_build.stale_files(fresh, committed) == ["actions_pb2.pyi", "retired_pb2.py", "usage_pb2.py"]


def test_build_repairs_a_stale_target(tmp_path: Path) -> None:
    target = tmp_path / "v1"
    shutil.copytree(contracts_build.generate(tmp_path / "gen"), target)
    (target / "__init__.py").write_text("")
    (target / "usage_pb2.py").write_text("broken = True\n")
    (target / "retired_pb2.py").write_text("")

    assert contracts_build.build(check=True, target=target) == ["retired_pb2.py", "usage_pb2.py"]
    assert (target / "usage_pb2.py").read_text() == "broken = True\n"  # check writes nothing
    assert contracts_build.build(target=target) == ["retired_pb2.py", "usage_pb2.py"]
    assert contracts_build.build(check=True, target=target) == []
    assert not (target / "retired_pb2.py").exists()
    assert (target / "__init__.py").exists()


def test_proto_root_is_found_from_any_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    root = contracts_build.find_proto_root()
    assert (root / "budgetgate" / "v1" / "decisions.proto").is_file()


def test_missing_proto_root_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(contracts_build.ContractsBuildError, match="no .proto files"):
        contracts_build.generate(tmp_path / "out", proto_root=tmp_path)


@pytest.mark.parametrize("stem", sorted(set(_modules()) - {COMMON}))
def test_every_top_level_message_is_an_event(stem: str) -> None:
    module = _modules()[stem]
    messages = list(module.DESCRIPTOR.message_types_by_name.values())
    assert messages, f"{stem}.proto defines no message"
    for message in messages:
        event_id = message.fields_by_number.get(1)
        event_time = message.fields_by_number.get(2)
        assert event_id is not None and event_id.name == "event_id", message.full_name
        assert event_id.type == FieldDescriptor.TYPE_STRING, message.full_name
        assert event_time is not None and event_time.name == "event_time", message.full_name
        assert event_time.message_type.full_name == "google.protobuf.Timestamp", message.full_name


def test_common_proto_holds_no_events() -> None:
    common = _modules()[COMMON].DESCRIPTOR
    assert all("event_id" not in m.fields_by_name for m in common.message_types_by_name.values())


def test_one_file_per_topic() -> None:
    files = {cls.DESCRIPTOR.file.name for cls in topics.MESSAGE_TYPES.values()}
    event_files = {m.DESCRIPTOR.name for stem, m in _modules().items() if stem != COMMON}

    assert len(files) == len(topics.MESSAGE_TYPES)
    assert files == event_files


def test_all_contracts_share_one_package() -> None:
    assert {m.DESCRIPTOR.package for m in _modules().values()} == {"budgetgate.v1"}
