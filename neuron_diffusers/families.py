"""The model families neuron_diffusers runs: one record each, and the only place a family is named.

A family is one transformer class with our tensor-parallel plan (`tp_plans/<name>.py`), and, where we run its
pipelines, a pipeline adapter (`pipelines/`) and a tiny random checkpoint builder (`tiny/<name>.py`). Everything
else looks families up here: the CLI's family names, the tiny builds, plan and bench tools, and the checkpoint
resolver (by the pipeline or transformer class a checkpoint's index names). `name` is the one spelling used in the
CLI, in file names (plans, tiny builders, samples) and in docs; `display_name` is what people call the model.
Adding a family: docs/architecture.md, "Adding a family" (its own files and one registry line).

A family's transformer often serves several stock pipeline classes (one FLUX.1 folder runs FluxPipeline,
FluxImg2ImgPipeline, FluxInpaintPipeline and FluxKontextPipeline). `pipelines` lists the ones verified here, with
what `generate` must know of each that it cannot read from the class; any other stock class built on the
transformer is found by that transformer and runs with conservative defaults (`PipelineClass(name)`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import diffusers

from .compat import plans as compat_plans
from .parallel import blocks, coalesce, quantize, quantize_config

if TYPE_CHECKING:  # annotations only: the record names its adapter by class name, imported on first use
    from .pipelines import PipelineAdapter


@dataclass(frozen=True)
class PipelineClass:
    """A stock pipeline class on a family's transformer, and what `generate` needs to know of it."""

    name: str
    #: Whether `image` may be several reference images (FLUX.2, Qwen-Image-Edit-Plus, Qwen-Image-2.1), not one.
    references: bool = False
    #: Whether stock takes a list with one image (and mask) per prompt and encodes each row with its own generator
    #: (FLUX.1's Kontext, img2img and inpainting), so a batch of prompts, each with its own input image, is one call.
    image_per_prompt: bool = False
    #: Whether its true CFG calls the transformer under `cache_context("cond"/"uncond")`, which CFG parallelism
    #: needs to tell the two branches apart (FLUX.1's img2img, inpainting and Kontext call it bare).
    named_cfg_branches: bool = False
    #: The tiny checkpoint that runs it: `tiny/<tiny>.py`, or None for the family's own.
    tiny: str | None = None


@dataclass(frozen=True)
class Family:
    """One family: its names, and where its files are. Its files are found by convention from `package` and `name`
    (`<package>.tp_plans.<name>`, `<package>.pipelines.<name>`, `<package>.tiny.<name>`) and imported on first use,
    so the registry imports none of them (no import cycle: adapters and tiny builders may import the registry)."""

    name: str
    display_name: str
    #: The adapter's class name in `pipelines/<name>.py`; None for a family we only plan (no pipeline runs it here).
    adapter_class: str | None = None
    #: Where the released weights live on the Hugging Face Hub (samples and docs point there).
    hub_id: str | None = None
    #: The stock pipeline classes verified on the family's transformer, the adapter's own class first.
    pipelines: tuple[PipelineClass, ...] = ()
    #: The package holding the family's `tp_plans/`, `pipelines/` and `tiny/` modules: ours, or another one that
    #: registers a family of its own (`register`).
    package: str = __package__

    def module(self, folder: str) -> ModuleType:
        """The family's own module in `folder` (`tp_plans`, `pipelines`, `tiny`), imported on first use."""
        return importlib.import_module(f"{self.package}.{folder}.{self.name}")

    @property
    def adapter(self) -> type[PipelineAdapter] | None:
        """The pipeline adapter class (`pipelines/<name>.py`); None for a family we only plan."""
        return None if self.adapter_class is None else getattr(self.module("pipelines"), self.adapter_class)

    @property
    def plan_module(self) -> ModuleType:
        """`tp_plans/<name>.py`: `PLAN` (our default plan), `LEAN_PLAN` where memory trades against collectives,
        and `MODEL_CLASS` (the diffusers class they are written for)."""
        return self.module("tp_plans")

    @property
    def plan(self) -> dict:
        """The default plan: the fewest collectives per forward, then the least memory per rank."""
        return self.plan_module.PLAN

    @property
    def plan_variants(self) -> dict[str, dict]:
        """Our named plans: "default", and "lean" where a family holds less per rank for more collectives."""
        lean = getattr(self.plan_module, "LEAN_PLAN", None)
        return {"default": self.plan, **({"lean": lean} if lean is not None else {})}

    @property
    def cp_plan(self) -> dict | None:
        """Our context-parallel plan (`CP_PLAN`) for a class diffusers ships none for; None: stock's, if any."""
        return getattr(self.plan_module, "CP_PLAN", None)

    #: Whether attention processors that bypass diffusers' dispatch are routed through it under context parallelism
    #: (drafted families whose verified CP plan needs it; the five families' processors all use dispatch).
    routes_attention = False

    def check_context_parallel(self) -> None:
        """Refuse context parallelism where the family cannot run it, before any weight is read (the registered
        families: their plans are proven by their tests, and compat refuses a class with no `_cp_plan`)."""

    @property
    def cp_quirks(self) -> ModuleType | None:
        """The hooks a class whose attention stock context parallelism cannot split as is needs under it (the
        module `CP_QUIRKS` in the plan file names, inside the family's package; `compat.plans`); None for most."""
        name = getattr(self.plan_module, "CP_QUIRKS", None)
        return None if name is None else importlib.import_module(f"{self.package}.{name}")

    @property
    def coalesced_forwards(self) -> dict[type, coalesce.CoalescedForward]:
        """Block class -> the family's coalesced forward for `PartialRowwiseParallel(reduced_at="block")` (`FORWARDS`
        of the module `BLOCK_FORWARDS` in the plan file names, inside the family's package); {} for most."""
        name = getattr(self.plan_module, "BLOCK_FORWARDS", None)
        return {} if name is None else importlib.import_module(f"{self.package}.{name}").FORWARDS

    @property
    def model_class_name(self) -> str:
        return self.plan_module.MODEL_CLASS

    def model_class(self):
        """The diffusers transformer class."""
        return getattr(diffusers, self.model_class_name)

    @property
    def cache_block_metadata(self) -> dict[str, tuple]:
        """Step-cache metadata for block classes diffusers has none for (`CACHE_BLOCK_METADATA` in the plan file)."""
        return getattr(self.plan_module, "CACHE_BLOCK_METADATA", {})

    @property
    def has_tiny(self) -> bool:
        """Whether `tiny/<name>.py` builds a tiny random pipeline of the family (every family with an adapter)."""
        return self.adapter_class is not None

    @property
    def tiny_module(self) -> ModuleType:
        """`tiny/<name>.py`, imported on demand: it imports the family's whole stock pipeline and text encoders."""
        if not self.has_tiny:
            raise ValueError(f"There is no tiny pipeline of {self.display_name}: only its tensor-parallel plan ships.")
        return self.module("tiny")


FAMILIES: tuple[Family, ...] = (
    Family("flux", "FLUX.1", "FluxAdapter", "black-forest-labs/FLUX.1-dev", (
        PipelineClass("FluxPipeline", named_cfg_branches=True),
        PipelineClass("FluxKontextPipeline", image_per_prompt=True),
        PipelineClass("FluxImg2ImgPipeline", image_per_prompt=True),
        PipelineClass("FluxInpaintPipeline", image_per_prompt=True),
    )),
    Family("flux2", "FLUX.2", "Flux2Adapter", "black-forest-labs/FLUX.2-dev", (
        PipelineClass("Flux2Pipeline", references=True),
    )),
    Family("qwenimage", "Qwen-Image", "QwenImageAdapter", "Qwen/Qwen-Image", (
        PipelineClass("QwenImagePipeline", named_cfg_branches=True),
        PipelineClass("QwenImageEditPlusPipeline", references=True, named_cfg_branches=True, tiny="qwenimage_edit"),
    )),
    Family("qwenimage21", "Qwen-Image-2.1", "QwenImage21Adapter", "Qwen/Qwen-Image-2.1", (
        PipelineClass("QwenImage21Pipeline", references=True, named_cfg_branches=True),
    )),
    Family("h3", "MiniMax-H3", "MiniMaxH3Adapter", "MiniMaxAI/MiniMax-H3", (PipelineClass("MiniMaxH3Blocks"),)),
    Family("wan", "Wan 2.1", "WanAdapter", "Wan-AI/Wan2.1-T2V-14B-Diffusers",
           (PipelineClass("WanPipeline", named_cfg_branches=True),)),
    # The worked example of docs/authoring.md: a plan, no pipeline.
    Family("hunyuanvideo", "HunyuanVideo"),
)



def _pipeline_families() -> tuple[str, ...]:
    return tuple(family.name for family in FAMILIES if family.adapter_class is not None)


def _tiny_checkpoints() -> tuple[str, ...]:
    further = (p.tiny for family in FAMILIES for p in family.pipelines if p.tiny is not None)
    return PIPELINE_FAMILIES + tuple(dict.fromkeys(name for name in further if name not in PIPELINE_FAMILIES))


#: The families whose pipelines run here (a tiny checkpoint, `generate`), in registry order.
PIPELINE_FAMILIES: tuple[str, ...] = _pipeline_families()

#: Every tiny checkpoint `tiny/` builds: one per pipeline family, then those of further verified classes.
TINY_CHECKPOINTS: tuple[str, ...] = _tiny_checkpoints()

_BY_NAME = {family.name: family for family in FAMILIES}


def install(family: Family) -> None:
    """Push `family`'s plans into the mechanisms, which name no family: its TP plan as the class default (stock's
    kept for `stock_plan`), its CP plan where diffusers ships none and its CP quirks (`compat.plans`), its coalesced
    block forwards (`parallel.coalesce`), its step-cache block metadata (`parallel.blocks`) and its `QUANTIZE` rules
    (`parallel.quantize_config`). Everything is read before anything is pushed, so a family whose files do not
    import leaves the mechanisms as they were. Called for each of ours by `neuron_diffusers/__init__.py`, and by
    `register` for one from outside."""
    model_class, plan, cp_plan, cp_quirks = family.model_class(), family.plan, family.cp_plan, family.cp_quirks
    forwards, metadata = family.coalesced_forwards, family.cache_block_metadata
    rules = quantize.quantize_rules(family)
    compat_plans.register(model_class, plan, cp_plan=cp_plan, cp_quirks=cp_quirks)
    for block_class, forward in forwards.items():
        coalesce.register_forward(block_class, forward)
    blocks.add_cache_metadata(metadata)
    quantize_config.register_rules(model_class, rules)  # what from_pretrained(quantization_config=) selects


def register(family: Family) -> Family:
    """Add `family` to the registry (a package of one's own, `Family(..., package="my_pkg")`; ours are listed in
    `FAMILIES` above) and push its plans (`install`): every lookup below, the CLI's family names, the tiny builds,
    loading and sharding then know it; returns it. Ranks that `tools.spawn` starts register it again."""
    global FAMILIES, PIPELINE_FAMILIES, TINY_CHECKPOINTS
    if family.name in _BY_NAME:
        if _BY_NAME[family.name] == family:
            return family
        raise ValueError(f"A family called '{family.name}' is registered already ({_BY_NAME[family.name]}). "
                         "Give the new one another name.")
    install(family)
    FAMILIES = (*FAMILIES, family)
    _BY_NAME[family.name] = family
    PIPELINE_FAMILIES, TINY_CHECKPOINTS = _pipeline_families(), _tiny_checkpoints()
    return family


def outside_families() -> tuple[Family, ...]:
    """The families registered from other packages (`register`), which a spawned rank must register again."""
    return tuple(family for family in FAMILIES if family.package != __package__)


def get(name: str) -> Family:
    """The family called `name`; a `ValueError` lists the names there are."""
    if name not in _BY_NAME:
        raise ValueError(f"Unknown model family '{name}'. Choose one of: {', '.join(_BY_NAME)}.")
    return _BY_NAME[name]


def is_family(name: str) -> bool:
    return name in _BY_NAME


def by_pipeline_class(class_name: str) -> Family | None:
    """The family whose verified pipeline classes include `class_name` (None if none does)."""
    return next((f for f in FAMILIES if f.adapter_class is not None and any(p.name == class_name for p in f.pipelines)),
                None)


def pipeline_record(family: Family, class_name: str) -> PipelineClass:
    """What the family verified of the stock class `class_name`, or the conservative defaults for another one."""
    return next((p for p in family.pipelines if p.name == class_name), PipelineClass(class_name))


def tiny_module(name: str) -> ModuleType:
    """`tiny/<name>.py` of a tiny checkpoint (`TINY_CHECKPOINTS`), imported on demand."""
    if name in PIPELINE_FAMILIES:
        return get(name).tiny_module
    if name not in TINY_CHECKPOINTS:
        raise ValueError(f"Unknown tiny family '{name}'. Choose one of: {', '.join(TINY_CHECKPOINTS)}.")
    return importlib.import_module(f"{__package__}.tiny.{name}")


def by_model_class(class_name: str) -> Family | None:
    """The family whose plan is written for the transformer class `class_name` (None if none is)."""
    return next((f for f in FAMILIES if f.model_class_name == class_name), None)
