"""`neuron_diffusers.compat`, the one place touching diffusers' privates: pinned once, every private name and signature
it relies on still there, every wrapper calling stock's function as it is at call time."""

import inspect
import types
import warnings

import diffusers
import pytest
import torch
from diffusers.hooks import context_parallel, tensor_parallel
from diffusers.models import _modeling_parallel, attention_dispatch
from diffusers.models.modeling_utils import ModelMixin

from neuron_diffusers import families
from neuron_diffusers.compat import install, plans, privates, tp_loading, version
from neuron_diffusers.pipelines.qwenimage21_padding import exact_text_padding


def test_every_private_name_the_package_relies_on_exists():
    missing = [f"{getattr(owner, '__name__', owner)}.{name}" for owner, name in privates.PRIVATE_NAMES
               if not hasattr(owner, name)]
    assert missing == []
    for module, name in privates.LAZY_PRIVATE_NAMES:
        assert privates.internal(module, name) is not None
    # The class attributes stock reads plans and repeated blocks from, on every family's transformer.
    for family in families.FAMILIES:
        cls = family.model_class()
        assert plans.tp_plan_of(cls) is family.plan
        if family.adapter is not None:
            assert plans.repeated_blocks(cls), cls.__name__
    # `plan report --cores` reads where diffusers splits the sequence (Qwen-Image-2.1 ships no plan in 0.42.1).
    for name in ("flux", "flux2", "qwenimage", "h3"):
        assert plans.cp_plan_of(families.get(name).model_class()), name


@pytest.mark.parametrize("key", list(privates.SIGNATURES), ids=lambda key: f"{key[0].__name__}.{key[1]}")
def test_every_private_signature_is_the_one_we_call(key):
    owner, name = key
    assert tuple(inspect.signature(privates.stock(owner, name)).parameters) == privates.SIGNATURES[key]


def test_the_pin_is_read_from_pyproject_and_another_release_is_refused_with_the_fix():
    assert str(version.pinned_diffusers()) == "~=0.42.1"  # pyproject.toml's `dependencies`, the one spelling
    version.check_diffusers_version(diffusers.__version__)
    expected = r"needs diffusers~=0\.42\.1 \(found 0\.43\.0\).*pip install 'diffusers~=0\.42\.1'"
    with pytest.raises(ImportError, match=expected):
        version.check_diffusers_version("0.43.0")


def test_the_pin_is_read_from_the_source_tree_when_not_installed(monkeypatch):
    def not_installed(name):
        raise version.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(version.importlib.metadata, "requires", not_installed)
    version.pinned_diffusers.cache_clear()
    try:
        assert str(version.pinned_diffusers()) == "~=0.42.1"
    finally:
        version.pinned_diffusers.cache_clear()


def test_using_plan_brings_stock_back_and_restores_ours():
    cls = families.get("flux").model_class()
    stock = plans.stock_plan(cls)
    assert stock is not None and stock != families.get("flux").plan
    with plans.using_plan(cls, stock):
        assert plans.tp_plan_of(cls) is stock
    assert plans.tp_plan_of(cls) is families.get("flux").plan
    assert plans.stock_plan(families.get("h3").model_class()) is None  # diffusers plans no MiniMax-H3


def test_stock_plans_are_kept_by_class_not_by_name():
    cls = families.get("flux").model_class()
    namesake = type(cls.__name__, (cls,), {"_tp_plan": None})
    assert plans.stock_plan(namesake) is None and plans.stock_plan(cls) is not None


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
    assert tp_loading.local_shard(rows, 0, [4, 8], Mesh(1)).flatten().tolist() == [2, 3, 8, 9, 10, 11]
    assert tp_loading.local_shard(rows.T, 1, [12], Mesh(0)).flatten().tolist() == [0, 1, 2, 3, 4, 5]


def test_every_private_instance_attribute_the_package_reads_exists():
    missing = [f"{factory.__name__}().{name}" for factory, name in privates.PRIVATE_INSTANCE_ATTRIBUTES
               if not hasattr(factory(), name)]
    assert missing == []


def test_qwenimage21_gets_our_context_parallel_plan_the_others_keep_stock():
    for family in families.FAMILIES:
        cls = family.model_class()
        plan = plans.cp_plan_of(cls)
        if family.name == "qwenimage21":
            assert plan is family.cp_plan and "transformer_blocks.0" in plan and "proj_out" in plan
            assert plans.cp_quirks_of(cls) is not None
        elif family.name != "hunyuanvideo":
            assert plan is cls.__dict__["_cp_plan"], family.name  # diffusers' own
            assert plans.cp_quirks_of(cls) is None


def test_parallel_config_accepts_context_and_tensor_parallelism_together():
    config = diffusers.ParallelConfig(context_parallel_config=diffusers.ContextParallelConfig(ulysses_degree=2),
                                      tensor_parallel_config=diffusers.TensorParallelConfig(tp_degree=2))
    assert config.context_parallel_config.ulysses_degree == 2 and config.tensor_parallel_config.tp_degree == 2
    with pytest.raises(ValueError, match="Either ring_degree or ulysses_degree"):  # stock's own checks still run
        diffusers.ContextParallelConfig()


# --- every wrapper calls stock's function as it is at call time ---------------------------------------------------


class Reached(Exception):
    """Raised by a stand-in for a stock function: the wrapper called it."""


def _reach(*args, **kwargs):
    raise Reached


def _not_gloo(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")


#: How to drive each wrapper to its stock call: (owner, name) -> a function(monkeypatch) calling the public path.
_CALLS = {
    (tensor_parallel, "_check_tp_supported"): lambda mp: tensor_parallel._check_tp_supported(
        "Model", {}, 4, diffusers.TensorParallelConfig(tp_degree=2)),
    (tensor_parallel, "resolve_tp_shard_specs"): lambda mp: tensor_parallel.resolve_tp_shard_specs(
        torch.nn.Linear(2, 2), {}, 2),
    (tensor_parallel, "_styles"): lambda mp: tensor_parallel._styles({"a": "colwise"}),
    (tensor_parallel, "_hooks_only_styles"): lambda mp: install.tensor_parallel_neuron._hooks_only_styles(
        {"a": "colwise"}),
    (tensor_parallel, "apply_tensor_parallel"): lambda mp: install.hooks.apply_tensor_parallel(
        torch.nn.Identity(), types.SimpleNamespace(_mesh=None), {}),
    (ModelMixin, "_resolve_parallel_config"): lambda mp: ModelMixin._resolve_parallel_config(
        torch.nn.Identity(), diffusers.ParallelConfig()),
    (ModelMixin, "enable_parallelism"): lambda mp: ModelMixin.enable_parallelism(
        torch.nn.Identity(), config=diffusers.ParallelConfig()),
    (ModelMixin, "from_pretrained"): lambda mp: diffusers.FluxTransformer2DModel.from_pretrained("nowhere"),
    (diffusers.ParallelConfig, "__post_init__"): lambda mp: diffusers.ParallelConfig(),
    (attention_dispatch, "_native_attention_forward_op"): lambda mp: attention_dispatch._native_attention_forward_op(
        None, *(torch.zeros(1, 1, 1, 1),) * 3),
    (_modeling_parallel, "gather_size_by_comm"): lambda mp: (_not_gloo(mp), context_parallel.gather_size_by_comm(
        1, None)),
    (context_parallel, "_all_gather_anything"): lambda mp: (_not_gloo(mp), context_parallel._all_gather_anything(
        torch.zeros(1), 0, None)),
}


def test_every_wrapped_function_is_driven_here():
    assert set(_CALLS) == {(owner, name) for owner, name, _ in install.WRAPPERS}


@pytest.mark.parametrize("key", list(_CALLS), ids=lambda key: key[1])
def test_a_wrapper_calls_stock_as_it_is_at_call_time(key, monkeypatch):
    """Rebinding diffusers' own function after `install` takes effect: the wrapper holds no stale reference."""
    owner, name = key
    wrapper = inspect.getattr_static(owner, name)
    wrapper = getattr(wrapper, "__func__", wrapper)
    for target in (owner, *install.ALSO_BOUND_IN.get(key, ())):  # every name stock code looks it up by
        bound = inspect.getattr_static(target, name)
        assert getattr(bound, "__func__", bound) is wrapper, f"{target.__name__}.{name}"
    stock = wrapper.__wrapped__
    assert isinstance(stock, privates.StockCall) and stock.__wrapped__ is privates.STOCK[key]
    monkeypatch.setitem(privates.STOCK, key, _reach)
    with pytest.raises(Reached):
        _CALLS[key](monkeypatch)


def test_exact_text_padding_refuses_another_transformer_and_installs_once(tiny_checkpoint):
    from diffusers import QwenImage21Transformer2DModel

    with pytest.raises(TypeError, match="needs a Qwen-Image-2.1 transformer .* got Linear"):
        exact_text_padding(torch.nn.Linear(1, 1))
    transformer = QwenImage21Transformer2DModel.from_pretrained(tiny_checkpoint("qwenimage21"), subfolder="transformer")
    handle = exact_text_padding(transformer)
    assert exact_text_padding(transformer) is handle  # hooks once: a second set would drop rows twice
    handle.remove()
    assert not transformer._forward_pre_hooks and not transformer.pos_embed._forward_pre_hooks
    assert exact_text_padding(transformer) is not handle


def test_the_old_patches_module_still_resolves_with_a_deprecation_warning():
    from neuron_diffusers.parallel import patches

    with pytest.warns(DeprecationWarning, match="moved to neuron_diffusers.compat.plans.stock_plan"):
        assert patches.stock_plan is plans.stock_plan
    with warnings.catch_warnings(), pytest.raises(AttributeError):
        warnings.simplefilter("error")
        patches.no_such_name  # noqa: B018


def test_compat_names_no_family():
    """`compat` imports none of `families`, `pipelines`, `tiny`: the plans are pushed in (`plans.register`)."""
    import ast
    import pathlib

    import neuron_diffusers.compat

    folder = pathlib.Path(neuron_diffusers.compat.__file__).parent
    imported = {(path.name, node.module or "") for path in folder.glob("*.py")
                for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom) and node.level}
    assert [(name, module) for name, module in imported
            if module.split(".")[0] in ("families", "pipelines", "tiny")] == []


def test_an_unpinned_diffusers_is_refused_before_any_private_is_imported():
    import subprocess
    import sys

    code = ("import sys, diffusers; diffusers.__version__ = '0.43.0'\n"
            "try:\n    import neuron_diffusers\nexcept ImportError as error:\n    print(error)\n"
            "print(sorted(m for m in sys.modules if m.startswith(('diffusers.hooks', 'diffusers.models._'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    refusal, private_modules = result.stdout.strip().splitlines()
    assert "needs diffusers~=0.42.1 (found 0.43.0)" in refusal
    assert private_modules == "[]"
