"""Reading a user's file (``loader_server.wire.files``): one place where a parse error
becomes ``PATH: not WHAT (reason at line L column C)``."""

from __future__ import annotations

import pytest

from loader_server.wire.files import file_error, read_json, read_toml


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"a": 1,\n "b": }', "not a config (Expecting value at line 2 column 7)"),
        ('{"a": 1', "not a config (Expecting ',' delimiter at line 1 column 8)"),
        ("", "not a config (Expecting value at line 1 column 1)"),
    ],
)
def test_json_errors_name_the_file_and_where(tmp_path, text, says):
    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        read_json(path, "a config")
    assert str(e.value) == f"{path}: {says}"


def test_toml_errors_name_the_file_line_and_column(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("a = 1\nb = = 2\n")
    with pytest.raises(ValueError, match=rf"^{path}: not TOML \(.*line 2, column 5\)\)$"):
        read_toml(path)
    ok = tmp_path / "ok.toml"
    ok.write_text("x = [1, 2]\n")
    assert read_toml(ok) == {"x": [1, 2]}


def test_bytes_that_are_not_text_are_named_not_decoded(tmp_path):
    path = tmp_path / "w.json"
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ValueError, match=rf"^{path}: not JSON \(not UTF-8 text: byte 7 is 0xff\)$"):
        read_json(path)


def test_any_parser_s_exception_becomes_one_line():
    reason = RuntimeError("Error while deserializing header:\n  incomplete metadata")
    err = file_error("/x/model.safetensors", "safetensors weights", reason)
    assert str(err) == (
        "/x/model.safetensors: not safetensors weights (Error while deserializing header: "
        "incomplete metadata)"
    )
    assert str(file_error("/x/a.arrow", "Arrow", OSError())) == "/x/a.arrow: not Arrow (OSError)"
