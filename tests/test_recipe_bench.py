"""bench/recipe.py: issue 19's targets are judged against the right upstream row, with the fixed bar where that row
collapsed, and the README table says which were met."""

from __future__ import annotations


import recipe
from readme_tables import recipe_record_table


def row(label: str, delta: float, kv_type: str | None = None, code_bits: float | None = 2.0) -> dict:
    return {"label": label, "kv_type": kv_type or label, "delta_pct": delta, "ppl": 10.0 * (1 + delta / 100),
            "error": 0.1, "bpe_k": 4.0, "bpe_v": 4.0, "code_bits": code_bits}


def rows(q4_0: float, q4_1: float, mix: float, uniform: float) -> list[dict]:
    return [row("f16", 0.0, code_bits=None), row("q4_0", q4_0, code_bits=None), row("q4_1", q4_1, code_bits=None),
            row("kivi2", 19.0), row("calibrated kivi2", uniform, "kivi2"),
            row("calibrated mix", mix, "k:0=kivi4,1-=kivi1;v:*=kivi2")]


def test_each_target_is_judged_against_its_upstream_row() -> None:
    targets = {t["row"]: t for t in recipe.judged(rows(q4_0=5.5, q4_1=2.8, mix=5.0, uniform=3.0))}
    assert targets["calibrated mix"]["against"] == "q4_0" and targets["calibrated mix"]["met"]
    assert targets["calibrated kivi2"]["bar_pct"] == 2.8 and not targets["calibrated kivi2"]["met"]


def test_a_collapsed_upstream_row_sets_the_fixed_bar() -> None:
    targets = {t["row"]: t for t in recipe.judged(rows(q4_0=20000.0, q4_1=27000.0, mix=1.6, uniform=0.9))}
    assert targets["calibrated mix"]["collapsed"] and targets["calibrated mix"]["bar_pct"] == 1.5
    assert not targets["calibrated mix"]["met"]
    assert targets["calibrated kivi2"]["met"]


def test_the_table_names_the_mix_and_the_verdicts() -> None:
    scored = rows(q4_0=5.5, q4_1=2.8, mix=5.0, uniform=3.0)
    record = {"model": "m", "text": "t", "n_ctx": 2048, "chunks": 4, "rows": scored, "targets": recipe.judged(scored),
              "calibration": {"n_tokens": 1024, "seconds": 90.0, "threads": 2, "kvq.sinks": 4, "kvq.window": 64,
                              "kvq.calibration.window_ctx": 2048,
                              "kvq.kv_clip": "k:*=0.9"}}
    table = recipe_record_table(record)
    assert "calibrated mix: +5.00% against q4_0's +5.50%: **met**" in table
    assert "calibrated kivi2: +3.00% against q4_1's +2.80%: **not met**" in table
    assert "`--kv-layers 'k:0=kivi4,1-=kivi1;v:*=kivi2'`" in table
    assert "chose 4 sinks, a 64-token window (--kv-window auto), " in table
    # one ratio (or mse) a part is spelled out, by layer range or by "*"; several a part are the JSON's to tell
    for spec, words in (("k:0-17=0.95;v:0-17=mse", "--kv-clip 'k:0-17=0.95;v:0-17=mse'"),
                        ("k:*=0.9", "--kv-clip 'k:*=0.9'"), ("k:0=0.9,1-17=0.8;v:*=mse", "per-layer clip ratios")):
        record["calibration"]["kvq.kv_clip"] = spec
        assert f"(--kv-window auto), {words} and " in recipe_record_table(record)


def test_the_table_says_which_v_dither_was_chosen_or_that_none_was_measured() -> None:
    measured = ["the mix's cost by V dither: none: 0.0060, v:*=0.5: 0.0074, v:*=1: 0.0109 -> --kv-dither 'none'"]
    scored = rows(q4_0=5.5, q4_1=2.8, mix=5.0, uniform=3.0)

    def table(**calibration: object) -> str:
        c = {"n_tokens": 512, "seconds": 60.0, "threads": 2, "kvq.sinks": 8, "kvq.window": 128,
             "kvq.kv_clip": "k:*=0.9", **calibration}
        return recipe_record_table({"model": "m", "text": "t", "n_ctx": 2048, "chunks": 4, "rows": scored,
                                    "targets": recipe.judged(scored), "calibration": c})

    assert ", V dither v:*=0.5 and the mix below" in table(**{"kvq.kv_dither": "v:*=0.5", "summary": measured})
    assert ", V rounded to nearest (no dither spread measured lower) and" in table(**{"kvq.kv_dither": None,
                                                                                      "summary": measured})
    old = table(**{"summary": ["mean code bits 2.000 (budget 2)"]})
    assert "dither" not in old and "nearest" not in old


def test_the_table_says_what_the_held_out_check_chose() -> None:
    limited = ["mean code bits 2.000 (budget 2); ...; a mix's prose divergence kept within kivi2 everywhere's 0.0096"]
    scored = rows(q4_0=5.5, q4_1=2.8, mix=5.0, uniform=3.0)

    def table(**calibration: object) -> str:
        c = {"n_tokens": 512, "seconds": 60.0, "threads": 2, "kvq.sinks": 8, "kvq.window": 128,
             "kvq.kv_clip": "k:*=0.9", "summary": limited, **calibration}
        return recipe_record_table({"model": "m", "text": "t", "n_ctx": 2048, "chunks": 4, "rows": scored,
                                    "targets": recipe.judged(scored), "calibration": c})

    assert "and kivi2 everywhere as its mix (the refined mix's KL divergence on 2048 held-out tokens of Macbeth, " \
           "0.0125, was over kivi2 everywhere's 0.0115)" in table(**{"kvq.calibration.held_out": 2048,
                                                                      "kvq.calibration.held_out_kld": [0.0125, 0.0115]})
    assert "the mix below (its divergence on the text within kivi2 everywhere's on the probe, and on 2048 held-out " \
           "tokens of Macbeth: 0.0100 against 0.0115)" in table(**{"kvq.calibration.held_out": 2048,
                                                                    "kvq.calibration.held_out_kld": [0.01, 0.0115]})
    # records from before the check, and calibrations that ran none
    for c in ({}, {"kvq.calibration.held_out": 0}):
        assert "the mix below (its divergence on the text within kivi2 everywhere's);" in table(**c)
