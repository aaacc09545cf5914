"""The gate that keeps kernel variants not yet checked on a GPU out of dispatch
(`jaxflash.kernels.verified`): refused with a reason naming the features, admitted with the
switch, and every variant the default dispatch picks today is verified."""
from __future__ import annotations

import dataclasses

import pytest

from jaxflash.kernels import verified
from jaxflash.kernels.bwd_config import BwdConfig
from jaxflash.kernels.config import FwdConfig


@dataclasses.dataclass(frozen=True)
class _Fake:
    key: str = "fake_variant"
    pending: tuple = ("a new mask",)

    def unverified(self):
        return self.pending


def test_unverified_refused_with_reason(monkeypatch):
    monkeypatch.delenv(verified.ENV, raising=False)
    with pytest.raises(NotImplementedError, match=r"fake_variant uses a new mask.*"
                                                  + verified.ENV):
        verified.require_verified(_Fake(), "backward")


def test_switch_admits(monkeypatch):
    monkeypatch.setenv(verified.ENV, "1")
    verified.require_verified(_Fake(), "backward")
    monkeypatch.setenv(verified.ENV, "0")
    with pytest.raises(NotImplementedError):
        verified.require_verified(_Fake(), "backward")


def test_verified_passes(monkeypatch):
    monkeypatch.delenv(verified.ENV, raising=False)
    verified.require_verified(_Fake(pending=()), "forward")


def test_fwd_no_overlap_192_is_unverified():
    assert FwdConfig(head_dim=64, tile_m=192, intra_wg_overlap=False).unverified()
    assert not FwdConfig(head_dim=64, tile_m=192).unverified()
    assert not FwdConfig(head_dim=128, is_causal=True).unverified()


def test_default_backward_variants_verified():
    for d in (64, 96, 128):
        for causal in (False, True):
            assert BwdConfig(head_dim=d, is_causal=causal).unverified() == ()


def test_backward_features_written_2026_12_01_are_unverified():
    assert BwdConfig(head_dim=256, is_causal=True).unverified()
    assert BwdConfig(head_dim=192).unverified()
    assert "ALiBi" in " ".join(BwdConfig(head_dim=64, has_alibi=True).unverified())
    assert "segment" in " ".join(BwdConfig(head_dim=128, has_segments=True).unverified())


def test_wide_backward_refuses_segments():
    ok, why = BwdConfig.check.__get__(BwdConfig(head_dim=256))()
    assert ok
    with pytest.raises(ValueError, match="segment ids at head_dim 256"):
        BwdConfig(head_dim=256, has_segments=True)
