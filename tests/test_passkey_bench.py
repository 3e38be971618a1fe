"""bench/passkey.py: its prompts hide the key where asked and fit the context; f16 finds it on the dev model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pykvq import Model

import passkey
import readme_tables

import device


@pytest.mark.parametrize("depth", [0, 50, 100])
def test_the_key_sits_at_its_depth_and_the_prompt_fits(model: Model, depth: int) -> None:
    prompt = passkey.build_prompt(model, 512, depth, "12345")
    assert 400 < len(prompt.tokens) <= 512 - passkey.N_ANSWER
    text = model.detokenize(prompt.tokens)
    filler = text[len(passkey.INTRO):text.index("The pass key is 12345")]
    total = text.count(passkey.FILLER.strip())
    assert filler.count(passkey.FILLER.strip()) == round(total * depth / 100)


@pytest.mark.parametrize("depth", [0, 50, 100])
def test_in_prose_the_key_sits_at_its_depth_among_whole_lines_and_the_prompt_fits(model: Model, depth: int) -> None:
    filler = passkey.Filler.of_text("hamlet_gut")
    prompt = passkey.build_prompt(model, 512, depth, "12345", filler)
    assert 450 < len(prompt.tokens) <= 512 - passkey.N_ANSWER
    text = model.detokenize(prompt.tokens)
    before, after = text[len(passkey.INTRO):text.index(passkey.QUESTION)].split(passkey.NEEDLE.format(key="12345"))
    n_before, n_after = before.count("\n"), after.count("\n")
    assert n_before == round((n_before + n_after) * depth / 100)
    # the stretch is the text's own lines, in order, from the line the key picks
    start = 12345 % len(filler.lines)
    assert (before + after).startswith("".join(filler.lines[start:start + 3]))
    # another key, another stretch of the text
    other = model.detokenize(passkey.build_prompt(model, 512, depth, "12346", filler).tokens)
    assert other.replace("12346", "12345") != text


def test_an_answer_counts_when_its_first_number_is_the_key() -> None:
    assert passkey.found(" 12345. Remember", "12345")
    assert not passkey.found(" 1234. Remember 12345", "12345")
    assert not passkey.found(" the pass key.", "12345")


def test_f16_finds_the_key_and_the_record_is_written(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(passkey, "RESULTS", tmp_path)
    passkey.main(["--lengths", "256", "--depths", "0", "100", "--trials", "1", "--kv-types", "f16,q8_0", "-t", "2",
                  "--ngl", str(device.NGL)])
    record = json.loads(next(tmp_path.glob("passkey-*.json")).read_text())
    assert record["kv_types"] == ["f16", "q8_0"] and len(record["rows"]) == 4
    f16 = record["summary"][0]
    assert {k: f16[k] for k in ("kv_type", "accuracy", "below_f16")} == {"kv_type": "f16", "accuracy": 1.0,
                                                                         "below_f16": []}
    # the key was decoded, so its first token led: by the margin each row records
    assert all(0.0 < r["margin"] <= r["p_key"] <= 1.0 for r in record["rows"] if r["kv_type"] == "f16")
    assert f16["mean_margin"] > 0.0
    assert next(tmp_path.glob("passkey-*.png")).stat().st_size > 0


def test_the_reference_must_come_first(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        passkey.parse_args(["--kv-types", "kivi2,f16"])
    assert "--kv-types must start with f16" in capsys.readouterr().err


def test_selections_run_each_kivi_type(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(passkey, "RESULTS", tmp_path)
    passkey.main(["--lengths", "512", "--depths", "50", "--trials", "1", "--kv-types", "f16,kivi2", "-t", "2",
                  "--kv-select", "0.25,0.25", "--ngl", str(device.NGL)])
    record = json.loads(next(tmp_path.glob("passkey-*-select.json")).read_text())
    assert record["kv_types"] == ["f16", "kivi2", "kivi2 sel 0.25/0.25"] and len(record["rows"]) == 3


def test_sinks_go_to_the_kivi_settings_only() -> None:
    args = passkey.parse_args(["--kv-types", "f16,kivi2", "--kv-select", "0.25,0.25,32", "--kv-sinks", "4"])
    assert [s.label for s in args.settings] == ["f16", "kivi2 +4 sinks", "kivi2 +4 sinks sel 0.25/0.25 obs 32"]
    assert [passkey.kv_config(s).sinks for s in args.settings] == [None, 4, 4]


def test_per_layer_types_join_as_kivi_settings() -> None:
    mix = "k:0-9=kivi4,10-=kivi2;v:*=kivi1"
    args = passkey.parse_args(["--kv-types", "f16", "--kv-layers", mix, "--kv-sinks", "4"])
    assert [s.spec.label for s in args.settings] == ["f16", mix]
    assert passkey.kv_config(args.settings[1]).layers == mix and args.settings[1].sinks == 4


@pytest.mark.parametrize("empty", ["", "none"])
def test_an_empty_per_layer_spec_is_refused_not_run_as_the_plain_type(empty: str) -> None:
    with pytest.raises(ValueError, match="give each layer's K and V type"):
        passkey.parse_args(["--kv-types", "f16", "--kv-layers", empty])


def test_rotation_and_clip_go_to_the_kivi_settings_only() -> None:
    args = passkey.parse_args(["--kv-types", "f16,q4_0,kivi2+rot", "--kv-rotate", "off", "--kv-clip", "k:*=0.9"])
    assert [s.label for s in args.settings] == ["f16", "q4_0", "kivi2+rot rot off clip k:*=0.9"]
    configs = [passkey.kv_config(s) for s in args.settings]
    assert [(c.rotate, c.clip) for c in configs] == [(None, None), (None, None), ("off", "k:*=0.9")]
    # without the options: +rot rotates, a plain kivi type takes the model's
    plain = passkey.parse_args(["--kv-types", "f16,kivi2,kivi2+rot"])
    assert [passkey.kv_config(s).rotate for s in plain.settings] == [None, None, True]


def one_key_at_100(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *extra: str) -> Path:
    """The one record a run of one f16 key at 100% of 256 tokens writes, with ``extra`` arguments."""
    monkeypatch.setattr(passkey, "RESULTS", tmp_path)
    passkey.main(["--lengths", "256", "--depths", "100", "--trials", "1", "--kv-types", "f16", "-t", "2",
                  "--ngl", str(device.NGL), *extra])
    records = list(tmp_path.glob("passkey-*.json"))
    assert len(records) == 1
    return records[0]


def test_a_run_at_some_depths_keeps_its_own_record(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert one_key_at_100(monkeypatch, tmp_path).name == "passkey-smollm2-135m-instruct-q4-1-256-at-100.json"


def test_a_study_keeps_its_own_record_and_names_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    record = one_key_at_100(monkeypatch, tmp_path, "--study", "v-halves")
    assert record.name == "passkey-smollm2-135m-instruct-q4-1-256-at-100-v-halves.json"
    assert "bench/passkey.py --study v-halves)" in readme_tables.passkey_table(record)


def test_a_prose_filler_keeps_its_own_record_and_names_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    record = one_key_at_100(monkeypatch, tmp_path, "--filler", "hamlet_gut")
    assert record.name == "passkey-smollm2-135m-instruct-q4-1-256-at-100-in-hamlet-gut.json"
    assert json.loads(record.read_text())["filler"] == "hamlet_gut"
    assert "key at 100% of the lines of hamlet_gut," in readme_tables.passkey_table(record)


def test_an_unknown_filler_text_is_a_clear_error() -> None:
    with pytest.raises(SystemExit, match="--filler no_such_text: no text 'no_such_text'"):
        passkey.main(["--lengths", "256", "--kv-types", "f16", "--filler", "no_such_text"])


@pytest.mark.parametrize("study", ["V halves", "../x", "a--b", "-a", ""])
def test_a_study_name_that_cannot_name_a_file_is_refused(study: str, capsys: pytest.CaptureFixture[str]) -> None:
    # --study=NAME: as two words, "-a" would be taken for an option and refused before the name is judged
    with pytest.raises(SystemExit):
        passkey.parse_args([f"--study={study}"])
    assert "lower-case letters, digits and single hyphens" in capsys.readouterr().err
