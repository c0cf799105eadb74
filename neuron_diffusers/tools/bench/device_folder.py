"""A checkpoint folder for a full-size transformer that `bench device` builds in memory: everything but its weights.

`load_pipeline(folder, transformer=module)` reads the transformer's config from the folder and the rest (tokenizers,
text encoders, VAEs, scheduler) from its files. Writing a 12-60 GB random checkpoint would take longer than the
benchmark, so the folder is the family's tiny checkpoint with:

- `transformer/`: the transformer class's full-size default config, and no weights;
- the text encoders widened where their output meets the transformer (FLUX.1's T5 and CLIP, FLUX.2's Mistral at a
  third of its stacked width, the Qwen encoders' hidden size) but still a few narrow layers deep: real-width
  embeddings at the tiny encoders' speed, so the text the transformer reads has the real shape, not the real cost;
- the VAEs widened to the transformer's latent channels only (the decode stays tiny).

Built once per family on CPU in seconds and cached beside the tiny checkpoints.

`slice_folder` is the same folder with weights, for benches that load a pipeline on several ranks (`bench
throughput --width full`): the transformer at the released width with a few blocks of each kind (`bench step`'s
`bench_config`), random weights saved so each rank streams its own slice as `load_pipeline` does.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import diffusers
import torch
import transformers

from ... import families, tiny

#: FLUX.2 stacks the text encoder's hidden states of 3 layers (`Flux2Pipeline`'s `text_encoder_out_layers`).
_FLUX2_STACKED_LAYERS = 3
#: The tiny Qwen2.5-VL's head width: its head count follows the hidden size (its config has no `head_dim`).
_QWEN2_5_HEAD_DIM = 16


def _zeros_and_ones(channels: int) -> dict:
    return {"latents_mean": [0.0] * channels, "latents_std": [1.0] * channels}


def config_edits(family: str, config: dict) -> dict[str, dict]:
    """Per component, the config values (dotted for nested configs) that make it meet a transformer of `config`."""
    if family == "flux":
        return {"text_encoder": {"hidden_size": config["pooled_projection_dim"]},
                "text_encoder_2": {"d_model": config["joint_attention_dim"]},
                "vae": {"latent_channels": config["in_channels"] // 4}}  # 2x2 latent patches per token
    if family == "flux2":
        return {"text_encoder": {"text_config.hidden_size": config["joint_attention_dim"] // _FLUX2_STACKED_LAYERS},
                "vae": {"latent_channels": config["in_channels"] // 4}}
    if family == "qwenimage":
        width = config["joint_attention_dim"]
        return {"text_encoder": {"text_config.hidden_size": width,
                                 "text_config.num_attention_heads": width // _QWEN2_5_HEAD_DIM,
                                 "vision_config.out_hidden_size": width},
                "vae": {"z_dim": config["out_channels"]}}
    if family == "qwenimage21":
        width = config["context_in_dim"]
        return {"text_encoder": {"text_config.hidden_size": width, "vision_config.out_hidden_size": width},
                "vae": {"z_dim": config["out_channels"]}}
    if family == "h3":
        width = config["text_dim"]
        return {"text_encoder": {"text_config.hidden_size": width, "vision_config.out_hidden_size": width},
                "vae": {"latent_channels": config["in_channels"], **_zeros_and_ones(config["in_channels"])},
                # The audio VAE's `latent_dim` must be a multiple of its latent channels.
                "audio_vae": {"latent_channels": config["audio_in_channels"],
                              "latent_dim": 2 * config["audio_in_channels"],
                              **_zeros_and_ones(config["audio_in_channels"])}}
    raise ValueError(f"No full-size folder recipe for family '{family}'.")


def _set(config, dotted: str, value) -> None:
    *parents, name = dotted.split(".")
    for parent in parents:
        config = getattr(config, parent)
    setattr(config, name, value)


def _rebuild(folder: Path, library: str, class_name: str, edits: dict) -> None:
    """Replace the component in `folder` by a random one of its class with `edits` applied to its config."""
    torch.manual_seed(0)
    if library == "transformers":
        cls = getattr(transformers, class_name)
        config = cls.config_class.from_pretrained(folder)
        for name, value in edits.items():
            _set(config, name, value)
        module = cls(config)
    else:
        cls = getattr(diffusers, class_name)
        module = cls.from_config({**cls.load_config(folder), **edits})
    shutil.rmtree(folder)
    module.save_pretrained(folder)


def _index(path: Path) -> dict:
    return json.loads(next(path / name for name in ("model_index.json", "modular_model_index.json")
                           if (path / name).is_file()).read_text())


def _build(family: str, path: Path) -> None:
    cls = families.get(family).model_class()
    with torch.device("meta"):
        config = dict(cls().config)
    shutil.copytree(tiny.cached_tiny(family), path, dirs_exist_ok=True)
    transformer = path / "transformer"
    shutil.rmtree(transformer)
    transformer.mkdir()
    (transformer / "config.json").write_text(json.dumps({"_class_name": cls.__name__, **_plain(config)}, indent=2))
    index = _index(path)
    if (path / "modular_model_index.json").is_file():
        index = _released_modular_index(index, path)
    for component, edits in config_edits(family, config).items():
        library, class_name = _spec(index[component])
        _rebuild(path / component, library, class_name, edits)


#: Pipeline configs the tiny MiniMax-H3 shrinks (its canvas) that the stock blocks default to the released values.
_TINY_PIPELINE_CONFIGS = ("canvas_short_edge", "canvas_max_pixels", "reference_image_short_edge")


def _released_modular_index(index: dict, path: Path) -> dict:
    """A modular index pointing at `path` (the tiny one names the folder it was saved in), with the stock defaults
    for the pipeline configs the tiny checkpoint shrank."""
    index = {key: value for key, value in index.items() if key not in _TINY_PIPELINE_CONFIGS}
    for entry in index.values():
        if isinstance(entry, list) and entry and isinstance(entry[-1], dict):
            entry[-1]["pretrained_model_name_or_path"] = str(path)
    (path / "modular_model_index.json").write_text(json.dumps(index, indent=2))
    return index


def _plain(config: dict) -> dict:
    """The config as JSON values (tuples as lists), without the private keys `save_config` would not write."""
    return {key: list(value) if isinstance(value, tuple) else value for key, value in config.items()
            if not key.startswith("_")}


def _spec(entry) -> tuple[str, str]:
    """(library, class) of a model index entry: `[library, class]`, or a modular index's `[library, class, spec]`."""
    library, class_name = entry[0], entry[1]
    if library is None and isinstance(entry[-1], dict):  # modular: the class lives in the loading spec
        library, class_name = entry[-1]["type_hint"]
    return library, class_name


def full_size_folder(family: str) -> Path:
    """The cached folder for `family`'s full-size default transformer, built on first use."""
    digest = hashlib.sha256(Path(__file__).read_bytes() + str(tiny.cached_tiny(family)).encode()).hexdigest()[:12]
    path = tiny.cache_dir() / "device" / f"{family}-{digest}"
    if path.is_dir() and any(path.iterdir()):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        _build(family, staging)
        staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if not (path.is_dir() and any(path.iterdir())):  # another builder may have won the rename
            raise
    return path


def slice_folder(family: str, width: str, blocks: int, into: Path) -> Path:
    """`into` made a checkpoint of `family`'s pipeline whose transformer has the `width` ("full": the released widths,
    the text encoders and VAE widened to meet it as above; "tiny": the tiny checkpoint's) and `blocks` blocks of each
    kind, random weights (seeded 0, float32) saved; the rest as `full_size_folder` (or the tiny checkpoint) has it."""
    from .step import bench_config  # the one recipe of a bench slice's config

    config = bench_config(family, blocks, width)
    shutil.copytree(full_size_folder(family) if width == "full" else tiny.cached_tiny(family), into,
                    dirs_exist_ok=True)
    shutil.rmtree(into / "transformer")
    torch.manual_seed(0)
    families.get(family).model_class().from_config(config).save_pretrained(into / "transformer")
    return into
