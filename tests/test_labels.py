"""The label-map parser on odd but valid files, and on broken ones."""

from __future__ import annotations

import pytest

from app.errors import ModelError
from app.inference.labels import load_label_map, parse_label_map


def test_display_name_wins_then_name_then_class_id():
    text = """
    item { id: 1 name: 'person' display_name: 'Person' }
    item { name: "bicycle" id: 2 }
    item { id: 3 }
    """
    assert parse_label_map(text) == {1: "Person", 2: "bicycle", 3: "class_3"}


def test_odd_but_valid_syntax():
    text = """# a comment line
    item: {            # colon before the message
      display_name: "Traffic \\"light\\""
      id: 10;          # semicolons and commas separate fields too
      name: 'traffic_light',
      keypoints { id: 0 label: "nose" }   # nested messages are skipped
      frequency: FREQUENT
    }
    item <id: -1 name: 'background'>
    item{id:7 name:'x y'}"""
    assert parse_label_map(text) == {10: 'Traffic "light"', -1: "background", 7: "x y"}


def test_empty_file_has_no_labels():
    assert parse_label_map("# nothing here\n") == {}


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("item { id: 1 name: 'a' ", "missing '}'"),
        ("item { name: 'a' }", "has no id"),
        ("item { id: one }", "not an integer"),
        ("item { id: 1 name: 'a }", "line 1: unexpected character"),
        ("item { id: 1 }\n}\n", "line 2: expected a field name"),
        ("item { id: }", "expected a value for 'id'"),
    ],
)
def test_broken_files_name_the_problem(text, fragment):
    with pytest.raises(ModelError, match=fragment):
        parse_label_map(text, "label_map.pbtxt")


def test_a_missing_file_means_no_labels(tmp_path):
    assert load_label_map(tmp_path / "label_map.pbtxt") == {}


def test_file_errors_name_the_file(tmp_path):
    path = tmp_path / "label_map.pbtxt"
    path.write_text("item { id: x }")
    with pytest.raises(ModelError, match=str(path)):
        load_label_map(path)
