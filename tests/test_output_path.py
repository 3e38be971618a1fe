"""pykvq.output_path: the -o of calibrate and convert, checked before any work and never one of their inputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from pykvq import output_path


def inputs(tmp_path: Path) -> list[tuple[str, Path]]:
    text = tmp_path / "text.txt"
    text.write_text("the user's text")
    return [("the calibration text", text)]


def assert_refused(out: Path, named: list[tuple[str, Path]], message: str) -> None:
    with pytest.raises(ValueError, match=message), output_path.new_output(out, named):
        pytest.fail("the command ran")


@pytest.mark.parametrize("given", ["text.txt", "link.txt", "hard.txt", "new/../text.txt"])
def test_an_input_is_refused_through_links_and_dots(tmp_path: Path, given: str) -> None:
    named = inputs(tmp_path)
    (tmp_path / "link.txt").symlink_to("text.txt")
    (tmp_path / "hard.txt").hardlink_to(tmp_path / "text.txt")
    assert_refused(tmp_path / given, named, "is the calibration text .*-o must name a new file")
    assert (tmp_path / "text.txt").read_text() == "the user's text"


def test_a_folder_or_a_place_that_takes_no_file_is_refused(tmp_path: Path) -> None:
    assert_refused(tmp_path, [], "is a folder: name the GGUF file to write")
    assert_refused(Path("/proc/out.gguf"), [], "a new file cannot be written in /proc")
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert_refused(blocked / "out.gguf", [], "a new file cannot be written")


@pytest.mark.parametrize("failure", [RuntimeError, KeyboardInterrupt])
def test_folders_made_for_the_output_go_when_the_command_fails(tmp_path: Path, failure: type[BaseException]) -> None:
    out = tmp_path / "new" / "sub" / "out.gguf"
    with pytest.raises(failure), output_path.new_output(out, inputs(tmp_path)):
        assert out.parent.is_dir() and list(out.parent.iterdir()) == []  # the probe file is gone
        raise failure
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text.txt"]


def test_folders_are_kept_when_it_succeeds_or_when_they_were_there(tmp_path: Path) -> None:
    out = tmp_path / "new" / "out.gguf"
    with output_path.new_output(out, []):
        out.write_text("written")
    assert out.read_text() == "written"
    with pytest.raises(RuntimeError), output_path.new_output(tmp_path / "new" / "other.gguf", []):
        raise RuntimeError
    assert out.read_text() == "written"
