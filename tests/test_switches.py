"""ds4lab.harness.switches: the step's and the model check's ``--set MODULE.NAME=VALUE`` overrides."""
import argparse

import pytest

from ds4lab.harness import switches as S
from ds4lab.model import backend_kernel as BK


@pytest.mark.parametrize("text, words", [
    ("COMPRESS_ONE_LAUNCH=True", "MODULE.NAME=VALUE"),
    ("backend_kernel.COMPRESS_ONE_LAUNCH", "MODULE.NAME=VALUE"),
    ("backend_kernel.fuse=True", "upper-case"),
    ("backend_kernel._X=1", "upper-case"),
    ("backend_kernel.COMPRESS_ONE_LAUNCH=yes please", "not a Python literal"),
    ("no-such.X=1", "not a name"),
])
def test_malformed_settings_name_the_argument(text, words):
    with pytest.raises(ValueError, match="--set") as e:
        S.apply_settings([text])
    assert words in str(e.value)


def test_apply_rebinds_and_restores(monkeypatch):
    monkeypatch.setattr(BK, "COMPRESS_ONE_LAUNCH", BK.COMPRESS_ONE_LAUNCH)
    monkeypatch.setattr(BK, "INDEXER_FUSED_MAX_N", BK.INDEXER_FUSED_MAX_N)
    old = BK.COMPRESS_ONE_LAUNCH
    applied = S.apply_settings([f"backend_kernel.COMPRESS_ONE_LAUNCH={not old}",
                                "backend_kernel.INDEXER_FUSED_MAX_N=0"])
    assert BK.COMPRESS_ONE_LAUNCH is (not old) and BK.INDEXER_FUSED_MAX_N == 0
    assert applied[0] == ("ds4lab.model.backend_kernel", "COMPRESS_ONE_LAUNCH", old, not old)
    assert S.describe(applied) == (f"set backend_kernel.COMPRESS_ONE_LAUNCH={not old!r}; "
                                   "backend_kernel.INDEXER_FUSED_MAX_N=0")


def test_kernel_module_table_keeps_its_type(monkeypatch):
    from ds4lab_kernels import moe_gate
    monkeypatch.setattr(moe_gate, "SPREAD_CANDIDATES", moe_gate.SPREAD_CANDIDATES)
    S.apply_settings(['moe_gate.SPREAD_CANDIDATES=["r4w8"]'])
    assert moe_gate.SPREAD_CANDIDATES == ("r4w8",)


@pytest.mark.parametrize("text, words", [
    ("backend_kernel.NO_SUCH_SWITCH=1", "has no NO_SUCH_SWITCH"),
    ("backend_kernel.COMPRESS_ONE_LAUNCH=1", "is bool"),
    ("backend_kernel.INDEXER_FUSED_MAX_N=2.5", "is int"),
    ("not_a_kernel_module.X=1", "does not import"),
])
def test_bad_target_rebinds_nothing(monkeypatch, text, words):
    monkeypatch.setattr(BK, "INDEXER_FUSED_MAX_B", BK.INDEXER_FUSED_MAX_B)
    before = BK.INDEXER_FUSED_MAX_B
    with pytest.raises(ValueError, match=words):
        S.apply_settings([f"backend_kernel.INDEXER_FUSED_MAX_B={before + 1}", text])
    assert BK.INDEXER_FUSED_MAX_B == before   # the good first setting was not applied either


def test_step_cli_takes_repeated_set():
    from ds4lab.harness import step
    p = argparse.ArgumentParser()
    step.add_arguments(p)
    a = p.parse_args(["--set", "backend_kernel.COMPRESS_ONE_LAUNCH=True", "--set", "moe_w4a16.DECODE_MAX_PAIRS=96"])
    assert a.settings == ["backend_kernel.COMPRESS_ONE_LAUNCH=True", "moe_w4a16.DECODE_MAX_PAIRS=96"]


@pytest.mark.parametrize("text, parts", [
    ("backend_kernel.COMPRESS_ONE_LAUNCH=False", ("backend_kernel.COMPRESS_ONE_LAUNCH=False",)),
    ("backend_kernel.BRANCH_MAIN_FIRST=('attn', 'moe'),moe_gate.X=1",
     ("backend_kernel.BRANCH_MAIN_FIRST=('attn', 'moe')", "moe_gate.X=1")),
    ("indexer.PAGED_TOPK_DEFAULT={'sm_89': 'a', 'sm_90': 'b'}, backend_kernel.INDEXER_FUSED_MAX_NEXT_N=2",
     ("indexer.PAGED_TOPK_DEFAULT={'sm_89': 'a', 'sm_90': 'b'}", "backend_kernel.INDEXER_FUSED_MAX_NEXT_N=2")),
    ("backend_kernel.BRANCH_BLOCKS=['moe','attn'],", ("backend_kernel.BRANCH_BLOCKS=['moe','attn']",)),
])
def test_split_settings_keeps_a_literal_s_commas(text, parts):
    """``--ab`` splits only at a comma that starts a new ``MODULE.NAME=``; each part then applies."""
    assert S.split_settings(text) == parts


def test_optional_switch_takes_a_value_and_none(monkeypatch):
    """A switch that is None (off) takes a value, and a value switch takes None (session 13: the step's
    ``--ab "moe_w4a16.DECODE_ROW_WIDE='...'"`` was refused while the row was None); restore puts None back."""
    monkeypatch.setattr(BK, "OPTIONAL_ROW", None, raising=False)
    applied = S.apply_settings(["backend_kernel.OPTIONAL_ROW='mmaq_n64s2xl_w2n128'"])
    assert BK.OPTIONAL_ROW == "mmaq_n64s2xl_w2n128"
    S.restore(applied)
    assert BK.OPTIONAL_ROW is None
    monkeypatch.setattr(BK, "OPTIONAL_ROW", "mmaq_n64s2x")
    S.apply_settings(["backend_kernel.OPTIONAL_ROW=None"])
    assert BK.OPTIONAL_ROW is None
