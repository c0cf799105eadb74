"""The one module touching diffusers' privates: pinned, and every private name it relies on still there."""

import diffusers
import pytest
import torch

from neuron_diffusers import families
from neuron_diffusers.parallel import patches


def test_every_private_name_patches_relies_on_exists():
    missing = [f"{getattr(owner, '__name__', owner)}.{name}" for owner, name in patches.PRIVATE_NAMES
               if not hasattr(owner, name)]
    assert missing == []
    for module, name in patches.LAZY_PRIVATE_NAMES:
        assert patches.internal(module, name) is not None
    # The class attributes stock reads plans and repeated blocks from, on every family's transformer.
    for family in families.FAMILIES:
        cls = family.model_class()
        assert patches.tp_plan_of(cls) is family.plan
        if family.adapter is not None:
            assert patches.repeated_blocks(cls), cls.__name__
    # `plan report --cores` reads where diffusers splits the sequence (Qwen-Image-2.1 ships no plan in 0.42.1).
    for name in ("flux", "flux2", "qwenimage", "h3"):
        assert patches.cp_plan_of(families.get(name).model_class()), name


def test_another_diffusers_release_is_refused_with_the_fix():
    patches.check_diffusers_version(diffusers.__version__)
    expected = r"needs diffusers 0\.42\.x \(found 0\.43\.0\).*pip install 'diffusers~=0\.42\.1'"
    with pytest.raises(ImportError, match=expected):
        patches.check_diffusers_version("0.43.0")


def test_using_plan_brings_stock_back_and_restores_ours():
    cls = families.get("flux").model_class()
    stock = patches.stock_plan(cls)
    assert stock is not None and stock != families.get("flux").plan
    with patches.using_plan(cls, stock):
        assert patches.tp_plan_of(cls) is stock
    assert patches.tp_plan_of(cls) is families.get("flux").plan
    assert patches.stock_plan(families.get("h3").model_class()) is None  # diffusers plans no MiniMax-H3


def test_local_shard_slices_packed_blocks_like_the_loader():
    """What `parallel/lora.py` cuts a LoRA factor with: each block's rank slice, concatenated (a packed weight's local
    layout), the same as diffusers' loader gives the weight itself."""

    class Mesh:  # the two things `_local_shard` asks a mesh
        def __init__(self, rank):
            self.rank = rank

        def get_local_rank(self):
            return self.rank

        def size(self):
            return 2

    rows = torch.arange(12).view(12, 1)
    assert patches.local_shard(rows, 0, [4, 8], Mesh(1)).flatten().tolist() == [2, 3, 8, 9, 10, 11]
    assert patches.local_shard(rows.T, 1, [12], Mesh(0)).flatten().tolist() == [0, 1, 2, 3, 4, 5]


def test_every_private_instance_attribute_patches_reads_exists():
    missing = [f"{factory.__name__}().{name}" for factory, name in patches.PRIVATE_INSTANCE_ATTRIBUTES
               if not hasattr(factory(), name)]
    assert missing == []


def test_qwenimage21_gets_our_context_parallel_plan_the_others_keep_stock():
    from neuron_diffusers.parallel import context_qwenimage21

    for family in families.FAMILIES:
        cls = family.model_class()
        plan = patches.cp_plan_of(cls)
        if family.name == "qwenimage21":
            assert plan is not None and "transformer_blocks.0" in plan and "proj_out" in plan
        elif family.name != "hunyuanvideo":
            assert plan is cls.__dict__["_cp_plan"], family.name  # diffusers' own
    assert context_qwenimage21.MODEL_CLASS == families.get("qwenimage21").model_class_name


def test_parallel_config_accepts_context_and_tensor_parallelism_together():
    config = diffusers.ParallelConfig(context_parallel_config=diffusers.ContextParallelConfig(ulysses_degree=2),
                                      tensor_parallel_config=diffusers.TensorParallelConfig(tp_degree=2))
    assert config.context_parallel_config.ulysses_degree == 2 and config.tensor_parallel_config.tp_degree == 2
    with pytest.raises(ValueError, match="Either ring_degree or ulysses_degree"):  # stock's own checks still run
        diffusers.ContextParallelConfig()


def test_exact_text_padding_refuses_another_transformer_and_installs_once(tiny_checkpoint):
    from diffusers import QwenImage21Transformer2DModel

    with pytest.raises(TypeError, match="needs a Qwen-Image-2.1 transformer .* got Linear"):
        patches.exact_text_padding(torch.nn.Linear(1, 1))
    transformer = QwenImage21Transformer2DModel.from_pretrained(tiny_checkpoint("qwenimage21"), subfolder="transformer")
    handle = patches.exact_text_padding(transformer)
    assert patches.exact_text_padding(transformer) is handle  # hooks once: a second set would drop rows twice
    handle.remove()
    assert not transformer._forward_pre_hooks and not transformer.pos_embed._forward_pre_hooks
    assert patches.exact_text_padding(transformer) is not handle
