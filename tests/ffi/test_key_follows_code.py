"""A variant's key follows the code the compiler sees, not the prose around it: editing a
comment or a docstring in a kernel source keeps the key (and every compiled artifact), editing
code changes it."""
from __future__ import annotations

import re

import pytest

from jaxflash.ffi import variant
from jaxflash.kernels.variants.fwd import FwdConfig
from jaxflash.kernels.variants.fwd_launch import fwd_launch


@pytest.fixture
def edited(monkeypatch):
    """edit(module path suffix, function of source) -> the launch key with that edit."""
    real = variant._read_source

    def key_with(suffix, change):
        variant._hash_files.cache_clear()
        monkeypatch.setattr(variant, "_read_source",
                            lambda p: change(real(p)) if p.endswith(suffix) else real(p))
        try:
            return fwd_launch(FwdConfig(head_dim=128, is_causal=True), "sm_90a").key
        finally:
            monkeypatch.setattr(variant, "_read_source", real)
            variant._hash_files.cache_clear()

    return key_with


KERNEL = "jaxflash/kernels/sm90/fwd.py"
SHARED = "jaxflash/kernels/common/mask.py"


def _first_comment(src: str) -> re.Match:
    m = re.search(r"^(\s+)# .*$", src, re.M)
    assert m, "the kernel source has an indented comment line"
    return m


@pytest.mark.parametrize("suffix", [KERNEL, SHARED])
def test_prose_edits_keep_the_key(edited, suffix):
    base = edited(suffix, lambda s: s)
    # reword a comment, add a comment line, append a trailing comment, reword the docstring
    reword = lambda s: s.replace(_first_comment(s).group(0),
                                 _first_comment(s).group(1) + "# reworded, same code", 1)
    add_line = lambda s: s.replace(_first_comment(s).group(0), _first_comment(s).group(0)
                                   + "\n" + _first_comment(s).group(1) + "# a new note", 1)
    docstring = lambda s: s.replace('"""', '"""A reworded docstring. ', 1)
    blank = lambda s: s.replace("\n\n", "\n\n\n", 3)
    for change in (reword, add_line, docstring, blank):
        assert edited(suffix, change) == base


@pytest.mark.parametrize("suffix", [KERNEL, SHARED])
def test_code_edits_change_the_key(edited, suffix):
    base = edited(suffix, lambda s: s)
    # a new statement, and an existing statement changed
    assert edited(suffix, lambda s: s + "\n_UNUSED = 1\n") != base
    changed = lambda s: re.sub(r"^(\s+return )(.+)$", r"\1(\2)", s, count=1, flags=re.M)
    assert edited(suffix, changed) != base


def test_code_text_keeps_strings_that_are_code():
    src = 'def f():\n    """doc"""\n    x = "# not a comment"  # a comment\n    return x\n'
    assert variant.code_text(src) == 'def f():\n    x = "# not a comment"\n    return x'


def test_fp4_constants_are_in_the_fp4_kernels_key():
    """The sm_100a FP4 kernel compiles the Direct-P constants (jaxflash.fp4.constants): editing
    one changes its key; a bf16 kernel does not read them."""
    from jaxflash.kernels.variants.fwd_fp4_launch import sm100_fwd_fp4_launch
    from jaxflash.kernels.variants.sm100_fwd_fp4 import Sm100FwdFp4Config
    launch = sm100_fwd_fp4_launch(Sm100FwdFp4Config(head_dim=128), "sm_100a")
    mods = [m for m, _ in variant.source_files(launch.kernel, variant._ref(launch.config))]
    assert "jaxflash.fp4.constants" in mods
    real = variant._read_source
    try:
        variant._hash_files.cache_clear()
        before = launch.key
        variant._read_source = lambda p: (real(p).replace("E8M0_BIAS = 127", "E8M0_BIAS = 126")
                                          if p.endswith("jaxflash/fp4/constants.py") else real(p))
        variant._hash_files.cache_clear()
        assert launch.key != before
    finally:
        variant._read_source = real
        variant._hash_files.cache_clear()
    bf16 = fwd_launch(FwdConfig(head_dim=128), "sm_90a")
    assert not any(m.startswith("jaxflash.fp4")
                   for m, _ in variant.source_files(bf16.kernel, variant._ref(bf16.config)))


def test_dsl_build_settings_key_their_own_artifacts(monkeypatch):
    """A build with line info (or debug code, assertions, another optimization level) is
    another binary: another key. Unset or "0" is the default build, whose key is unchanged."""
    launch = fwd_launch(FwdConfig(head_dim=128), "sm_90a")
    for name in variant.DSL_BUILD_ENV:
        monkeypatch.delenv(name, raising=False)
    default = launch.key
    monkeypatch.setenv("CUTE_DSL_LINEINFO", "0")
    assert launch.key == default
    monkeypatch.setenv("CUTE_DSL_LINEINFO", "1")
    assert launch.key != default
