"""LoRA adapters on a tensor-parallel transformer: fused into each rank's own shard, switched in place.

Stock diffusers refuses a LoRA on a sharded model (`load_lora_adapter` raises for tensor parallelism): PEFT would wrap
each sharded Linear in a full-size adapter. We keep stock's reading and change only where the adapter lands:

- The file is read by the pipeline's own `lora_state_dict`, so every format `load_lora_weights` reads works
  (PEFT/diffusers keys, kohya, XLabs, ... through diffusers' converters). PEFT itself, injecting the adapter into a
  meta-device copy of the transformer through the loader's `load_lora_into_transformer`, gives each module's scaling
  (alpha / r, network alphas, alpha and rank patterns, rsLoRA): no LoRA semantics are re-implemented here.
- Each rank adds `scale * scaling * B @ A` to its local shard only: the rows of B its weight rows are for a
  column-sharded Linear (packed blocks slice block by block, with diffusers' own slicing), the columns of A for a
  row-sharded one, the whole product for a replicated one. No rank builds a full base weight or a full delta; all
  active LoRAs are summed in fp32 and rounded to the weight's dtype once. Fused, a LoRA costs nothing per step.
- Before its first change a touched local shard is copied to CPU, so `set([])` restores it bit for bit (in every
  dtype: subtracting the delta again would not be exact) and a switch rewrites the same tensors in place: compiled
  graphs keep their parameters and never recompile. Cost: host memory equal to the touched local shards.
- A quantized shard (`parallel/quantize.py`) is dequantized, gets the deltas (summed in float64) and is quantized
  again by the load's own per-row-and-block rule, in place; its copy is the quantized bytes and scales, so `set([])`
  restores them bit for bit (docs/quantization.md).
- Text-encoder parts go to the TP leader's CPU encoder as stock PEFT adapters (unfused: it runs once per prompt).

Every request is read and checked in full on every rank before anything changes, and the ranks of a replica (its TP
group, and its CFG partner) agree on the outcome, so a bad LoRA raises the same `LoraError` everywhere and leaves the
weights as they were. Context parallelism needs nothing here: it splits activations, not weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import itertools
import json
import re
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
from diffusers.utils import convert_unet_state_dict_to_peft
from huggingface_hub import snapshot_download
from peft.tuners.lora import LoraLayer
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from torch.distributed.tensor import DTensor, Replicate, Shard

from .. import families
from ..compat import plans as compat_plans
from ..compat import tp_loading
from .quantize import is_quantized, quantized_local, requantize_rows

#: The adapter name PEFT injects under in the meta-device copy that reports each module's scaling.
_ADAPTER = "neuron_diffusers"
#: How many bytes of read LoRAs are kept on CPU for switching back (the most recent one always is).
_CACHED_BYTES = 1 << 30
#: The fp32 working memory of fusing one Linear (a block of its local rows at a time).
FP32_CHUNK_BYTES = 8 << 20
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


class LoraError(ValueError):
    """A LoRA request that cannot be applied; raised before any weight is changed, the same on every rank."""


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA of a set: a `.safetensors` file, a folder holding exactly one, or a Hub id; and its weight.

    `scale` multiplies the adapter as stock `set_adapters([name], adapter_weights=[scale])` does.
    """

    source: str
    scale: float = 1.0

    @classmethod
    def of(cls, item) -> LoraSpec:
        """A spec from a spec, a `(source, scale)` pair, or a bare source (scale 1)."""
        if isinstance(item, LoraSpec):
            return item
        if isinstance(item, (tuple, list)):
            if len(item) != 2:
                raise LoraError(f"A LoRA is given as (path_or_hub_id, scale), got a {len(item)}-tuple: {item!r}.")
            source, scale = item
        else:
            source, scale = item, 1.0
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise LoraError(f"LoRA {source}: the scale must be a number, got {scale!r}.")
        return cls(str(source), float(scale))

    def file(self) -> Path:
        """The local safetensors file: the file itself, the one in a folder, or the one of a Hub repository."""
        path = Path(self.source)
        hub_id = _HUB_ID.fullmatch(self.source) and not self.source.startswith((".", "/"))
        if not path.exists() and hub_id and not self.source.endswith(".safetensors"):
            try:  # diffusers would fetch it the same way; a local snapshot gives us a file to hash and cache
                path = Path(snapshot_download(self.source, allow_patterns=["*.safetensors"]))
            except Exception as error:  # offline, gated, misspelt: all mean "no local copy"
                raise LoraError(f"LoRA '{self.source}' is not a local path and could not be fetched from the Hub "
                                f"({type(error).__name__}: {error}). Download it and pass the file.") from error
        if path.is_dir():
            files = sorted(path.glob("*.safetensors"))
            if len(files) != 1:
                found = ", ".join(f.name for f in files) or "none"
                raise LoraError(f"LoRA folder {self.source} must hold exactly one .safetensors file (found: {found}). "
                                "Pass the file itself.")
            path = files[0]
        if not path.is_file():
            raise LoraError(f"LoRA '{self.source}' is neither a file, a folder nor a Hub id (owner/name). Check the "
                            "path.")
        read_file(path)  # a file that is no safetensors is refused here, and read once for every later use
        return path

    def record(self) -> dict:
        """What identifies this LoRA in an output's metadata (and a resume key): source, scale, the file's sha256."""
        return {"source": self.source, "scale": self.scale, "sha256": read_file(self.file()).sha256}


def parse_lora_option(text: str) -> LoraSpec:
    """The CLI's `--lora PATH[:SCALE]`: a trailing `:number` is the scale (so `C:/x.safetensors` stays a path)."""
    path, colon, scale = text.rpartition(":")
    if colon and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", scale):
        return LoraSpec(path, float(scale))
    return LoraSpec(text)


@dataclass(frozen=True)
class LoraFile:
    """One LoRA file's contents, read once: its tensors, diffusers' adapter metadata from its header, its sha256."""

    tensors: dict
    metadata: dict | None
    sha256: str


@dataclass
class _CachedFile:
    """One LoRA file in the read cache: its contents and its reads against transformer configs (`read_lora`), kept
    and dropped together. A read's factors are often the file's own tensors, so they are counted once."""

    file: LoraFile
    reads: dict[tuple, LoadedLora] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        tensors = [*self.file.tensors.values(), *(t for lora in self.reads.values() for t in lora.tensors())]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())


#: The one read cache: recent LoRA files by path, size and mtime (up to `_CACHED_BYTES`; the latest always), so the
#: checks before loading, the sha256 outputs record, the load and switching back to a LoRA read each file once.
_cache: OrderedDict[tuple, _CachedFile] = OrderedDict()


def _cached(path: Path) -> _CachedFile:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _cache:
        with open(path, "rb") as handle:
            data = handle.read()
        _cache[key] = _CachedFile(_parse(path, data))
        _evict()
    _cache.move_to_end(key)
    return _cache[key]


def _evict() -> None:
    """Drop the least recently used files (with their reads) while the cache holds over `_CACHED_BYTES`."""
    while len(_cache) > 1 and sum(entry.nbytes for entry in _cache.values()) > _CACHED_BYTES:
        _cache.popitem(last=False)


def read_file(path: Path) -> LoraFile:
    """The file's tensors, metadata and sha256 from one read of its bytes (a job opens each LoRA file once per
    rank: checking, recording and loading all use this)."""
    return _cached(path).file


def _parse(path: Path, data: bytes) -> LoraFile:
    """Tensors and header metadata from a safetensors file's bytes (what stock `_fetch_state_dict` reads from it)."""
    try:
        tensors = load_safetensors(data)
        header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")]).get("__metadata__") or {}
    except (SafetensorError, ValueError, UnicodeDecodeError, AttributeError) as error:
        raise LoraError(
            f"LoRA file {path} is not a safetensors file ({type(error).__name__}: {error}). Only safetensors is read "
            "(pickled .bin/.pt files can run code on load): convert it with `safetensors.torch.save_file`."
        ) from None
    raw = header.get(LORA_ADAPTER_METADATA_KEY)
    return LoraFile(tensors, json.loads(raw) if raw else None, hashlib.sha256(data).hexdigest())


@dataclass
class LoraFactors:
    """One Linear's adapter: `delta = scaling * B @ A` (A: [rank, in], B: [out, rank])."""

    A: torch.Tensor
    B: torch.Tensor
    scaling: float


@dataclass
class LoadedLora:
    """A LoRA read and checked against one transformer config: its factors per Linear, and its text-encoder part
    (state dict, network alphas, metadata: what stock `load_lora_into_text_encoder` takes)."""

    spec: LoraSpec
    factors: dict[str, LoraFactors]
    text_state_dict: dict[str, torch.Tensor] = field(default_factory=dict)
    network_alphas: dict | None = None
    metadata: dict | None = None

    def tensors(self) -> list[torch.Tensor]:
        """The tensors it holds (what the read cache counts)."""
        return [t for f in self.factors.values() for t in (f.A, f.B)] + list(self.text_state_dict.values())


def lora_loader(adapter):
    """The diffusers class whose `lora_state_dict` and `load_lora_into_transformer` serve `adapter`'s pipeline."""
    loader = adapter.lora_loader()
    if loader is None or not all(hasattr(loader, n) for n in ("lora_state_dict", "load_lora_into_transformer")):
        raise LoraError(f"diffusers has no LoRA loader for {adapter.pipeline_class}, so it takes no LoRA here either.")
    return loader


# -- reading -------------------------------------------------------------------------------------------------------


def _stock_state_dict(loader, path: Path, label: str) -> tuple[dict, dict | None, dict | None]:
    """`loader.lora_state_dict` as `load_lora_weights` calls it: (state dict, network alphas, adapter metadata).
    It is handed the tensors `read_file` read (a copy of the dict: converters pop keys), and the header's metadata,
    which stock reads from the file itself: so the file is not opened again."""
    takes_alphas = "return_alphas" in inspect.signature(loader.lora_state_dict).parameters  # FLUX.1's only
    file = read_file(path)
    try:
        out = loader.lora_state_dict(dict(file.tensors), return_lora_metadata=True,
                                     **({"return_alphas": True} if takes_alphas else {}))
    except Exception as error:  # diffusers' converters raise assorted types for a file they cannot read
        raise LoraError(f"{loader.__name__}.lora_state_dict could not read LoRA {label}: "
                        f"{type(error).__name__}: {error}") from error
    state_dict, alphas = out[0], (out[1] if takes_alphas else None)
    metadata = file.metadata
    if not state_dict:
        raise LoraError(f"LoRA {label} holds no tensors.")
    return state_dict, alphas or None, metadata


def _factor_groups(state_dict: dict, component: str, label: str) -> dict[str, dict[str, torch.Tensor]]:
    """`{module: {"lora_A": A, "lora_B": B}}`; any other kind of key is refused with its name."""
    groups, unsupported = {}, []
    for key, value in state_dict.items():
        module, _, kind = key.rpartition(".lora_")
        if kind in ("A.weight", "B.weight"):
            groups.setdefault(module, {})[f"lora_{kind[0]}"] = value
        else:
            unsupported.append(key)
    if unsupported:
        raise LoraError(
            f"LoRA {label} has {len(unsupported)} {component} keys that are not LoRA factors (lora_A/lora_B weights), "
            f"e.g. {unsupported[:3]}. LoRA biases, DoRA, LoKr and full-weight (control) parts are not supported on a "
            "sharded model; use a plain LoRA."
        )
    unpaired = sorted(m for m, pair in groups.items() if len(pair) != 2)
    if unpaired:
        raise LoraError(f"LoRA {label} has a lora_A without its lora_B (or the reverse) for {unpaired[:5]}.")
    return groups


def _check_shapes(groups: dict, modules: dict[str, torch.nn.Module], component: str, label: str, hint=None) -> None:
    """Every factor pair names a Linear of `modules` and fits it: A [rank, in], B [out, rank]."""
    modules = {name: getattr(m, "base_layer", m) for name, m in modules.items()}  # a text encoder's PEFT-wrapped ones
    missing = sorted(name for name in groups if not isinstance(modules.get(name), torch.nn.Linear))
    if missing:
        raise LoraError(
            f"LoRA {label} names {len(missing)} {component} modules that are not Linears of this model: "
            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}.{hint(missing) if hint else ''}"
        )
    for name, pair in sorted(groups.items()):
        a, b = pair["lora_A"], pair["lora_B"]
        out_features, in_features = modules[name].weight.shape
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoraError(f"LoRA {label}: {component}.{name} has lora_A {tuple(a.shape)} and lora_B "
                            f"{tuple(b.shape)}, which are not [rank, in] and [out, rank] of one rank.")
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise LoraError(
                f"LoRA {label}: {component}.{name} is a Linear {in_features} -> {out_features}, but the LoRA's "
                f"factors are for {a.shape[1]} -> {b.shape[0]} (lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}). "
                "The LoRA was made for another model or size."
            )


def _family_hint(model_class: type):
    """A hint naming the family whose tensor-parallel plan names the modules a mismatched LoRA targets, if one does."""

    def hint(missing: list[str]) -> str:
        for family in families.FAMILIES:
            if issubclass(model_class, family.model_class()):
                continue
            rules = [re.compile(re.escape(rule).replace(r"\*", r"\d+")) for rule in family.plan]
            if any(rule.fullmatch(name) for name in missing for rule in rules):
                return (f" Modules of {family.model_class_name} are named like that: this LoRA looks made for the "
                        f"'{family.name}' family ({family.display_name}).")
        return " Is the LoRA for another model?"

    return hint


def _peft_scalings(loader, skeleton: torch.nn.Module, state_dict: dict, alphas, metadata, label: str) -> dict:
    """Each module's scaling as stock computes it: PEFT injects the adapter into `skeleton` (a meta-device copy)."""
    kwargs = {"transformer": skeleton, "adapter_name": _ADAPTER, "metadata": metadata, "low_cpu_mem_usage": True}
    if "network_alphas" in inspect.signature(loader.load_lora_into_transformer).parameters:
        kwargs["network_alphas"] = alphas
    try:
        with warnings.catch_warnings():  # PEFT's notes on this throwaway copy (e.g. targets without weights)
            warnings.simplefilter("ignore")
            loader.load_lora_into_transformer(dict(state_dict), **kwargs)
    except Exception as error:  # PEFT's and diffusers' own checks
        raise LoraError(f"Stock LoRA loading refused {label}: {type(error).__name__}: {error}") from error
    scalings = {}
    for name, module in skeleton.named_modules():
        if isinstance(module, LoraLayer) and _ADAPTER in module.scaling:
            if module.use_dora.get(_ADAPTER) or module.lora_bias.get(_ADAPTER) or module.fan_in_fan_out:
                raise LoraError(f"LoRA {label} configures DoRA, LoRA biases or fan_in_fan_out for {name}: only plain "
                                "LoRAs can be fused into a sharded model.")
            scalings[name] = float(module.scaling[_ADAPTER])
    return scalings


def _config_key(model_class: type, config) -> str:
    """The transformer's init arguments, defaults filled in: the same key for a `config.json` and a loaded model."""
    parameters = list(inspect.signature(model_class.__init__).parameters.values())[1:]
    values = {p.name: config.get(p.name, p.default) for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD}
    return json.dumps(values, sort_keys=True, default=str)


def read_lora(spec: LoraSpec, loader, model_class: type, config) -> LoadedLora:
    """Read `spec` with stock `loader.lora_state_dict` and check it against a `model_class(**config)`; the model
    itself is only built on the meta device, so nothing is loaded or modified.

    The read is kept with its file in the read cache (by the transformer's class and config, not the scale), so the
    checks before loading, the load and switching back to a LoRA read and check each file once.
    """
    path = spec.file()
    entry = _cached(path)
    key = (model_class, _config_key(model_class, config))
    if key not in entry.reads:
        entry.reads[key] = _read(LoraSpec(str(path), spec.scale), path, loader, model_class, config)
        _evict()
    return dataclasses.replace(entry.reads[key], spec=spec)


def _read(spec: LoraSpec, path: Path, loader, model_class: type, config) -> LoadedLora:
    state_dict, alphas, metadata = _stock_state_dict(loader, path, spec.source)
    prefix = f"{loader.transformer_name}."
    text_names = [n for n in (getattr(loader, "text_encoder_name", None),) if n]
    transformer_part = {k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)}
    text_part = {k: v for k, v in state_dict.items() if k.split(".", 1)[0] in text_names}
    stray = sorted(set(state_dict) - set(text_part) - {prefix + k for k in transformer_part})
    if stray:
        raise LoraError(
            f"LoRA {spec.source} has {len(stray)} keys for no part {loader.__name__} loads LoRAs into here "
            f"({', '.join([loader.transformer_name, *text_names])}), e.g. {stray[:3]}. Is it for another pipeline?"
        )
    if transformer_part and not any("lora_A" in k for k in itertools.islice(transformer_part, 1)):
        transformer_part = convert_unet_state_dict_to_peft(transformer_part)  # as `load_lora_adapter` does
    groups = _factor_groups(transformer_part, loader.transformer_name, spec.source)
    if not groups and not text_part:
        raise LoraError(f"LoRA {spec.source} has no weights for this pipeline.")
    if not groups:
        return LoadedLora(spec, {}, text_part, alphas, metadata)
    with torch.device("meta"):
        skeleton = model_class.from_config(config)
    _check_shapes(groups, dict(skeleton.named_modules()), loader.transformer_name, spec.source,
                  _family_hint(model_class))
    scalings = _peft_scalings(loader, skeleton, {prefix + k: v for k, v in transformer_part.items()}, alphas,
                              metadata, spec.source)
    ignored = sorted(set(groups) - set(scalings))  # stock would drop them with a warning: refuse instead
    if ignored:
        raise LoraError(f"LoRA {spec.source} has factors for modules its own adapter config does not target, which "
                        f"stock loading would ignore: {ignored[:5]}. Fix the file's `target_modules` metadata.")
    factors = {name: LoraFactors(pair["lora_A"], pair["lora_B"], scalings[name]) for name, pair in groups.items()}
    return LoadedLora(spec, factors, text_part, alphas, metadata)


def check_loras(checkpoint, loras: Sequence) -> list[LoraSpec]:
    """Every LoRA of `loras` read and checked against `checkpoint`'s transformer config, before any weight is read."""
    specs = [LoraSpec.of(item) for item in loras]
    if specs:
        loader = lora_loader(checkpoint.adapter)
        for spec in specs:
            read_lora(spec, loader, checkpoint.transformer_class(), checkpoint.config("transformer"))
    return specs


# -- fusing --------------------------------------------------------------------------------------------------------


def _local(weight: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (a DTensor's local shard is the same storage, so writes land in the parameter)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight.data


@dataclass(frozen=True)
class QuantizedCopy:
    """The CPU copy of a quantized Linear's local shard (its stored bytes and its scales): what restores it."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes


def _base_copy(module: torch.nn.Module) -> torch.Tensor | QuantizedCopy:
    """A CPU copy of what fusing changes in `module`: its local weight, or a quantized shard's data and scales."""
    if is_quantized(module):
        return QuantizedCopy(*(t.detach().to("cpu", copy=True) for t in quantized_local(module)))
    return _local(module.weight).detach().to("cpu", copy=True)


def _restore(module: torch.nn.Module, saved: torch.Tensor | QuantizedCopy) -> None:
    """`module`'s base back in place, bit for bit (the same tensors: compiled graphs keep them)."""
    if isinstance(saved, QuantizedCopy):
        data, scale = quantized_local(module)
        data.copy_(saved.data)
        scale.copy_(saved.scale)
    else:
        _local(module.weight).copy_(saved)


def _fuse_quantized(module: torch.nn.Module, shape: torch.Size, deltas: list) -> None:
    """The deltas added to a quantized shard a block of rows at a time (`quantize.requantize_rows`). They are summed
    in float64: the products of two float32 factors are exact there, so a row's sum rounds to the same float32 on
    every layout (a float32 matmul's rounding may vary with the shard's shape, and one last bit can move a weight
    across a quantization step)."""
    factors = [((a.double(), b.double()), weight) for (a, b), weight in deltas]
    rows = max(1, FP32_CHUNK_BYTES // (8 * shape[1]))
    for start in range(0, shape[0], rows):
        stop = min(start + rows, shape[0])

        def add(weight, start=start, stop=stop):
            for (a, b), alpha in factors:
                weight.addmm_(b[start:stop], a, alpha=alpha)

        requantize_rows(module, start, stop, add)


class FusedLoras:
    """The active LoRA set of one (possibly sharded) transformer, fused into this rank's weights.

    Every rank of the replica must call `set` with the same list. `plan` is the plan the transformer was sharded with
    (default: its class's, which `from_pretrained(parallel_config=...)` used); `groups` are the process groups the
    ranks agree over (a TP group, then its CFG pair's group). `encoder` (TP leader only) is the stock pipeline holding
    the text encoder, which gets the text parts.
    """

    def __init__(self, transformer: torch.nn.Module, loader, *, encoder=None, plan: dict | None = None,
                 groups: Sequence = ()):
        self.transformer = transformer
        self.loader = loader
        self.encoder = encoder
        self.groups = list(groups)
        self.active: list[LoraSpec] = []
        self._plan = plan
        self._specs: dict | None = None  # the shard layouts, resolved on the first LoRA
        self._loaded: list[LoadedLora] = []
        self._base: dict[str, torch.Tensor | QuantizedCopy] = {}  # module name -> CPU copy of its untouched shard
        self._text_adapters: list[tuple[str, float]] = []
        self._names = (f"{_ADAPTER}_{i}" for i in itertools.count())
        self._modules = dict(transformer.named_modules())

    @property
    def base_copies(self) -> dict[str, torch.Tensor | QuantizedCopy]:
        """The CPU copies of the local weights the active set changed, by module name: what restores the base."""
        return dict(self._base)

    @classmethod
    def for_pipeline(cls, adapter, pipe, encoder, mesh) -> FusedLoras:
        """The `FusedLoras` of a `load_pipeline` result: its transformer, the TP group (and the context-parallel ranks
        of its image group) and CFG partner to agree with, and (on a TP leader) the text encoder."""
        groups = [mesh[dim].get_group() for dim in ("tp", "ring", "ulysses", "cfg")
                  if dim in mesh.mesh_dim_names and mesh[dim].size() > 1]
        return cls(adapter.transformer_of(pipe), lora_loader(adapter), encoder=encoder, groups=groups)

    def set(self, loras: Sequence) -> None:
        """Make `loras` (specs, `(source, scale)` pairs, sources, or `LoadedLora`s) the active set; `[]` restores the
        base weights.

        Reads and checks every LoRA first; the replica agrees before any weight changes, so a bad request raises the
        same `LoraError` on every rank and leaves the model (and the previous set) as it was.
        """
        loaded, new_text, error = [], [], None
        try:
            loaded = [self._read(item) for item in loras]
            specs = [lora.spec for lora in loaded]
            for lora in loaded:
                for name in lora.factors:
                    self._layout(name)
            new_text = self._load_text(loaded)
        except Exception as exc:  # any rank's failure must become every rank's error
            error = exc
        failure = self._agree(error)
        if failure is not None:
            self._delete_text(new_text)
            self._activate_text()
            raise failure from error
        try:
            self._fuse(loaded)
        except Exception as exc:
            error = exc
        failure = self._agree(error)
        if failure is not None:  # e.g. out of memory on one rank: every rank goes back to the previous set
            self._fuse(self._loaded)
            self._delete_text(new_text)
            self._activate_text()
            raise failure from error
        old_text, self._text_adapters = self._text_adapters, new_text
        self._delete_text(old_text)
        self._activate_text()
        self._loaded, self.active = loaded, specs

    def _read(self, item) -> LoadedLora:
        """`read_lora` against this transformer (a `LoadedLora` read at planning is taken as it is: no file is read
        again); on the TP leader also the text part against its encoder."""
        if isinstance(item, LoadedLora):
            lora, spec = item, item.spec
        else:
            spec = LoraSpec.of(item)
            lora = read_lora(spec, self.loader, type(self.transformer), self.transformer.config)
        for name, model in self._text_encoders().items():
            part = {k.removeprefix(f"{name}."): v for k, v in lora.text_state_dict.items() if k.startswith(f"{name}.")}
            if part and all("lora_A" in k or "lora_B" in k for k in part):  # other layouts: stock converts and checks
                _check_shapes(_factor_groups(part, name, spec.source), dict(model.named_modules()), name, spec.source)
        return lora

    def _agree(self, error: BaseException | None) -> LoraError | None:
        """The replica's outcome: None if every rank succeeded, else one error with the same text on every rank."""
        message = None if error is None else (
            str(error) if isinstance(error, LoraError) else f"{type(error).__name__}: {error}")
        messages = {dist.get_rank() if dist.is_initialized() else 0: message}
        for group in self.groups:  # the TP group, then the CFG pair: every rank ends with every rank's outcome
            gathered = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, messages, group=group)
            messages = {rank: text for part in gathered for rank, text in part.items()}
        failed = sorted((rank, text) for rank, text in messages.items() if text is not None)
        if not failed:
            return None
        if len({text for _, text in failed}) == 1 and len(failed) == len(messages):
            return LoraError(failed[0][1])
        return LoraError("LoRA setup failed on " + "; ".join(f"rank {rank}: {text}" for rank, text in failed))

    # -- transformer: per-rank fusion ------------------------------------------------------------------------------

    def _layout(self, name: str) -> tuple[int | None, list[int] | None, object]:
        """How module `name`'s weight is split over the ranks: (dim, block sizes, mesh), or (None, None, None)."""
        weight = self._modules[name].weight
        if not isinstance(weight, DTensor) or all(isinstance(p, Replicate) for p in weight.placements):
            return None, None, None
        if self._specs is None:
            plan = compat_plans.tp_plan_of(self.transformer) if self._plan is None else self._plan
            self._specs = tp_loading.shard_specs(self.transformer, plan, weight.device_mesh.size(), whole_plan=False)
        placement, spec = weight.placements[0], self._specs.get(f"{name}.weight")
        if len(weight.placements) != 1 or not isinstance(placement, Shard) or spec is None or spec.dim != placement.dim:
            raise LoraError(
                f"{name}.weight is laid out as {weight.placements}, which the tensor-parallel plan does not say "
                f"({spec}). Pass the plan the model was sharded with (`FusedLoras(..., plan=...)`)."
            )
        return spec.dim, spec.block_sizes, weight.device_mesh

    def _local_factors(self, name: str, factors: LoraFactors, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(A, B) in fp32 on `device`, restricted so that `B @ A` is this rank's shard of module `name`'s delta."""
        dim, blocks, mesh = self._layout(name)
        a, b = (t.to(device=device, dtype=torch.float32) for t in (factors.A, factors.B))
        if dim == 0:
            b = tp_loading.local_shard(b, 0, blocks, mesh)
        elif dim == 1:
            a = tp_loading.local_shard(a, 1, blocks, mesh)
        return a, b

    @torch.no_grad()
    def _fuse(self, loaded: list[LoadedLora]) -> None:
        """Base weights back from the CPU copies, then every LoRA of `loaded` added: summed in fp32 and rounded once,
        a block of rows at a time, so the fp32 working memory stays at `FP32_CHUNK_BYTES` whatever the weight
        (a quantized shard: dequantized, summed in float64 and quantized again, `_fuse_quantized`)."""
        for name, saved in self._base.items():
            _restore(self._modules[name], saved)
        targets = sorted({name for lora in loaded for name in lora.factors})
        for name in set(self._base) - set(targets):
            del self._base[name]
        for name in targets:
            module = self._modules[name]
            if name not in self._base:
                self._base[name] = _base_copy(module)
            local = _local(module.weight)
            deltas = [(self._local_factors(name, lora.factors[name], local.device),
                       lora.spec.scale * lora.factors[name].scaling) for lora in loaded if name in lora.factors]
            if is_quantized(module):
                _fuse_quantized(module, local.shape, deltas)
                continue
            rows = max(1, FP32_CHUNK_BYTES // (4 * local.shape[1]))
            for start in range(0, local.shape[0], rows):
                part = local[start:start + rows]
                total = part.float()  # an fp32 weight: `part` itself, updated in place
                for (a, b), weight in deltas:
                    total.addmm_(b[start:start + rows], a, alpha=weight)
                if total is not part:
                    part.copy_(total)

    # -- text encoder: stock PEFT adapters on the leader -----------------------------------------------------------

    def _text_encoders(self) -> dict:
        if self.encoder is None:
            return {}
        names = [n for n in (getattr(self.loader, "text_encoder_name", None),) if n]
        return {n: getattr(self.encoder, n) for n in names if getattr(self.encoder, n, None) is not None}

    def _load_text(self, loaded: list[LoadedLora]) -> list[tuple[str, float]]:
        """Stock `load_lora_into_text_encoder` for each LoRA's text part (leader only); names and weights."""
        encoders = self._text_encoders()
        added = []
        try:
            for lora in loaded:
                if not (encoders and lora.text_state_dict):
                    continue
                added.append((next(self._names), lora.spec.scale))
                for component, model in encoders.items():
                    self.loader.load_lora_into_text_encoder(
                        lora.text_state_dict, network_alphas=lora.network_alphas, text_encoder=model, prefix=component,
                        adapter_name=added[-1][0], metadata=lora.metadata)
        except Exception:
            self._delete_text(added)
            raise
        return added

    def _delete_text(self, adapters: list[tuple[str, float]]) -> None:
        """Remove `adapters` from the leader's encoder (then `_activate_text`: loading an adapter may activate it)."""
        if self.encoder is None or not adapters:
            return
        present = {n for names in self.encoder.get_list_adapters().values() for n in names}
        names = [n for n, _ in adapters if n in present]
        if names:
            self.encoder.delete_adapters(names)

    def _activate_text(self) -> None:
        if self.encoder is not None and self._text_adapters:
            self.encoder.set_adapters([n for n, _ in self._text_adapters],
                                      adapter_weights=[s for _, s in self._text_adapters])
