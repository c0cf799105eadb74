"""MiniMax-H3 batches: several requests' packed sequences in one transformer forward, each its own attention document.

The transformer's batch axis only replicates one layout (its docstring: every batch item shares `position_ids`,
`token_tags`, the row indices), and the text length shifts the whole media clock, so requests of different text
lengths cannot share it. Its packed sequence can hold several documents, though: every per-row input (rotary
position, modality tag, timestep index) is indexed per row, which is how the reference packs them (`cu_seqlens`).
So a batch runs the stock blocks as they are, on their own inputs:

1. `prepare`: the stock layout, noise and timestep blocks, once per request, each with its own generator (the same
   noise, layout and row timesteps as the request made alone);
2. `loop`: the stock denoising loop once, over the requests' rows concatenated (the row indices offset), while
   `PackedSequencePadding` hands every main block a block-diagonal mask (and the token refiner one over the texts),
   so no row attends to another request's rows. The scheduler step is elementwise, so one step over all rows is
   each request's step;
3. `after`: the stock unpacking, once per request, on its own rows.

Each request's latents then equal the request made alone up to float rounding (tests/test_batching.py). The cost:
attention runs over the whole pack with a dense mask, so it and the mask grow with the square of the batch's rows
(a varlen attention, as the reference's `cu_seqlens`, would not: not done here, the stock processor takes a mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.modular_pipelines import LoopSequentialPipelineBlocks, SequentialPipelineBlocks

#: The layout fields (`denoiser_input_fields`) the stock layout step makes: per-row ones, concatenated, and row
#: indices into the packed sequence, offset by the rows packed before.
ROW_FIELDS = ("position_ids", "token_tags")
INDEX_FIELDS = ("video_indices", "audio_indices", "text_indices")


@dataclass
class DenoisePieces:
    """The stock denoise blocks in three pipelines that share the denoiser's components (see the module doc)."""

    prepare: object
    loop: object
    after: object


def denoise_pieces(denoiser, path) -> DenoisePieces:
    """The denoiser's blocks before, at and after its denoising loop, as pipelines on the same components."""
    blocks = denoiser.blocks.sub_blocks
    names = list(blocks)
    loops = [index for index, block in enumerate(blocks.values()) if isinstance(block, LoopSequentialPipelineBlocks)]
    if len(loops) != 1:
        raise RuntimeError(f"MiniMax-H3's denoise blocks ({', '.join(names)}) hold {len(loops)} denoising loops, "
                           "not one: this diffusers release batches differently; generate with batch_size=1.")

    def piece(chosen: list[str]):
        pipe = SequentialPipelineBlocks.from_blocks_dict({name: blocks[name] for name in chosen}).init_pipeline(
            str(path))
        pipe.update_components(**{name: getattr(denoiser, name) for name in pipe.component_names})
        pipe.vae, pipe.audio_vae = denoiser.vae, denoiser.audio_vae  # the geometry the blocks read (h3.py)
        return pipe

    at = loops[0]
    return DenoisePieces(piece(names[:at]), piece(names[at:at + 1]), piece(names[at + 1:]))


def unstack(embeds: dict[str, torch.Tensor], count: int) -> list[dict[str, torch.Tensor]]:
    """Each request's own encoding again from a stacked batch (`batching.stack_rows`: the texts right-padded to one
    length with a mask, the 1-D token tags concatenated)."""
    stacked, mask = embeds["prompt_embeds"], embeds.get("prompt_embeds_mask")
    lengths = mask.sum(1).tolist() if mask is not None else [stacked.shape[1]] * count
    tags = embeds["text_token_tags"].split(lengths)
    return [{"prompt_embeds": stacked[index:index + 1, :length].contiguous(), "text_token_tags": tags[index]}
            for index, length in enumerate(lengths)]


def denoise_batch(pieces: DenoisePieces, padding, rows: list[dict], generators: list, kwargs: dict) -> list[dict]:
    """Each request's denoised `latents` and `audio_latents`, from one transformer forward per step."""
    takes = {param.name for param in pieces.prepare.blocks.inputs}
    prepare_kwargs = {name: value for name, value in kwargs.items() if name in takes}
    states = [pieces.prepare(text_token_tags=row["text_token_tags"], **prepare_kwargs, generator=generator)
              for row, generator in zip(rows, generators, strict=True)]
    rest = {name: value for name, value in kwargs.items() if name not in takes}
    with padding.batch([(row["text_token_tags"].numel(), state.position_ids.shape[0])
                        for row, state in zip(rows, states, strict=True)]):
        made = pieces.loop(**_packed(states, rows), **rest, output=["latents", "audio_latents"])
    video = made["latents"].split([state.latents.shape[0] for state in states])
    audio = made["audio_latents"].split([state.audio_latents.shape[0] for state in states])
    return [pieces.after(latents=video[index], audio_latents=audio[index], output=["latents", "audio_latents"],
                         **{name: state.get(name) for name in ("num_latent_frames", "latent_height", "latent_width",
                                                                "num_audio_latents")})
            for index, state in enumerate(states)]


def _packed(states: list, rows: list[dict]) -> dict:
    """The denoising loop's inputs for all requests at once: their rows concatenated in request order."""
    first = states[0]
    for state in states:
        if state.num_condition_video_rows or state.num_condition_audio_rows:
            raise ValueError("MiniMax-H3 batches only text-to-video requests (no conditioning rows); generate "
                             "requests with keyframes or references with batch_size=1.")
        if not (torch.equal(state.timesteps, first.timesteps)
                and torch.equal(state.audio_timesteps, first.audio_timesteps)):
            raise ValueError("The requests of a MiniMax-H3 batch have different schedules: batch requests with the "
                             "same steps.")
    fields = first.get_by_kwargs("denoiser_input_fields")
    if set(fields) != {*ROW_FIELDS, *INDEX_FIELDS}:
        raise RuntimeError(f"MiniMax-H3's layout has the fields {sorted(fields)}, not "
                           f"{sorted(ROW_FIELDS + INDEX_FIELDS)}: this diffusers release packs differently; generate "
                           "with batch_size=1.")
    offsets = [0]
    for state in states[:-1]:
        offsets.append(offsets[-1] + state.position_ids.shape[0])
    layout = {name: torch.cat([state.get(name) for state in states]) for name in ROW_FIELDS}
    layout |= {name: torch.cat([state.get(name) + offset for state, offset in zip(states, offsets, strict=True)])
               for name in INDEX_FIELDS}
    return {
        "latents": torch.cat([state.latents for state in states]),
        "audio_latents": torch.cat([state.audio_latents for state in states]),
        "prompt_embeds": torch.cat([row["prompt_embeds"] for row in rows], dim=1),
        "row_timestep_plan": _joint_plan([state.row_timestep_plan for state in states]),
        "denoiser_input_fields": layout,
        "timesteps": first.timesteps,
        "audio_timesteps": first.audio_timesteps,
    }


def _joint_plan(plans: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's distinct timesteps (the same for every request of one schedule) and every row's index into them,
    in packing order."""
    joint = []
    for steps in zip(*plans, strict=True):
        timesteps = steps[0][0]
        if any(not torch.equal(step[0], timesteps) for step in steps):
            raise ValueError("The requests of a MiniMax-H3 batch have different noise levels at one step: batch "
                             "requests with the same steps.")
        joint.append((timesteps, torch.cat([step[1] for step in steps])))
    return joint
