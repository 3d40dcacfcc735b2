"""Spec layer: RefitCtx, LocalParamSpec hooks, HFToLocalParamMap, RefitBuilderInterface."""

import torch

from megatron_reshard.wire.spec import HFToLocalParamMap, LocalParamSpec, RefitBuilderInterface, RefitCtx


def test_refit_ctx_defaults_to_no_buffer_and_a_fresh_extra_dict():
    a, b = RefitCtx(), RefitCtx()
    assert a.buf is None and a.extra == {}
    a.extra["region"] = 1
    assert b.extra == {}


def test_spec_without_pre_hands_base_itself_to_the_transfer():
    base = torch.zeros(3)
    ctx = LocalParamSpec(base=base).begin()
    assert ctx.buf is base


def test_spec_pre_materialises_the_buffer_and_post_finishes_it():
    base = torch.zeros(4)

    def pre(b):
        return RefitCtx(buf=torch.empty(2), extra={"region": slice(1, 3)})

    def post(ctx):
        base[ctx.extra["region"]] = ctx.buf

    spec = LocalParamSpec(base=base, pre=pre, post=post)
    ctx = spec.begin()
    ctx.buf.fill_(7)  # stands in for the transfer writing the buffer
    spec.finish(ctx)
    assert base.tolist() == [0, 7, 7, 0]


def test_spec_without_post_finishes_as_a_no_op():
    base = torch.ones(2)
    spec = LocalParamSpec(base=base)
    spec.finish(spec.begin())
    assert base.tolist() == [1, 1]


def test_param_map_get_returns_spec_or_default():
    spec = LocalParamSpec(base=torch.zeros(1))
    m = HFToLocalParamMap(specs={"a.weight": spec})
    assert m.get("a.weight") is spec
    assert m.get("b.weight") is None
    assert m.get("b.weight", spec) is spec
    assert "a.weight" in m and len(m) == 1


def test_param_maps_do_not_share_their_default_dict():
    a, b = HFToLocalParamMap(), HFToLocalParamMap()
    a.specs["x"] = LocalParamSpec()
    assert len(b) == 0


def test_refit_builder_interface_is_structural_and_runtime_checkable():
    class Builder:
        def build_hf_to_local_param_map(self, refit_info):
            return HFToLocalParamMap()

    class NotABuilder:
        pass

    assert isinstance(Builder(), RefitBuilderInterface)
    assert not isinstance(NotABuilder(), RefitBuilderInterface)
