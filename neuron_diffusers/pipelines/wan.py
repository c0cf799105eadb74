"""WanPipeline (Wan 2.1 text-to-video): UMT5 embeddings, classifier-free guidance by `guidance_scale`, MP4 output.

The text length is static by construction, as for FLUX.1: stock pads every prompt's embeddings with zeros to
`max_sequence_length` (512) and the cross-attention attends to every position with no mask, so the padded
positions (which the text projection's biases make non-zero) are part of the model's input and a shorter bucket
would change the video. Nothing is bucketed; every prompt already runs at one shape. Context parallelism splits the
video tokens only (diffusers' `_cp_plan` for Wan leaves the text whole), so only they must divide the degree.

Wan guides with a negative prompt whenever `guidance_scale > 1` (5.0 by default), an empty one when none is given,
so the leader encodes the negative too (stock's own `encode_prompt`) whenever the call guides.
"""

from __future__ import annotations

import inspect

from ..media import VideoWithAudio, read_video_text, save_video
from .base import StockPipelineAdapter

#: Wan 2.1 makes 16 frames per second (the rate of its training clips and of diffusers' example); the pipeline does
#: not say it, so the MP4 is written at this rate.
FPS = 16.0


class WanAdapter(StockPipelineAdapter):
    pipeline_class = "WanPipeline"
    batch_refusal = "Wan's call here returns one clip; batching videos is not supported yet: use batch_size=1"
    static_text_length = True
    #: Wan 2.2 A14B's low-noise expert (below the pipeline's `boundary_ratio`), the same class as `transformer`.
    experts = ("transformer_2",)
    cp_text = "fixed"
    text_components = ("text_encoder", "tokenizer")
    # `guidance_scale` decides whether the pipeline reads negative embeddings, so the encoding must know it.
    encode_kwargs = ("max_sequence_length", "guidance_scale")
    output_suffix = ".mp4"
    #: "latent": the latents; "pt" (the default): the video, a `VideoWithAudio` of float frames (no audio), as MP4.
    output_types = ("pt", "latent")
    #: The MP4's frame rate.
    fps = FPS

    def _default(self, name: str):
        return inspect.signature(self.pipeline_cls().__call__).parameters[name].default

    def encode(self, encoder, prompt, negative_prompt, max_sequence_length=None, guidance_scale=None):
        """Stock `encode_prompt` on CPU: the prompt, and the negative (empty if none) when the call guides."""
        guidance = self._default("guidance_scale") if guidance_scale is None else guidance_scale
        length = self._default("max_sequence_length") if max_sequence_length is None else max_sequence_length
        positive, negative = encoder.encode_prompt(prompt, negative_prompt=negative_prompt,
                                                   do_classifier_free_guidance=guidance > 1,
                                                   max_sequence_length=length, device="cpu")
        return {"prompt_embeds": positive} | ({} if negative is None else {"negative_prompt_embeds": negative})

    def uses_true_cfg(self, negative_prompt, call_kwargs: dict) -> bool:
        """Wan guides whenever `guidance_scale > 1`, with or without a negative prompt."""
        return call_kwargs.get("guidance_scale", self._default("guidance_scale")) > 1

    def vae_scale_factor(self, vae_config: dict) -> int:
        return vae_config.get("scale_factor_spatial", 8)

    def size_multiple(self, checkpoint) -> int:
        """The VAE's spatial compression times the transformer's patch (stock rounds other sizes down, warning)."""
        patch = checkpoint.config("transformer").get("patch_size", (1, 2, 2))
        return self.vae_scale_factor(checkpoint.config("vae")) * patch[1]

    def max_side(self, checkpoint) -> tuple[int, str]:
        """Wan's rotary tables hold `rope_max_seq_len` positions per axis (1024 released), counted in patches."""
        positions = checkpoint.config("transformer").get("rope_max_seq_len", 1024)
        token = self.size_multiple(checkpoint)
        return positions * token, (f"its rotary tables hold {positions} positions per axis, one per {token}-pixel "
                                   "patch")

    def split_lengths(self, checkpoint, call_kwargs: dict) -> dict[str, int]:
        """The video tokens: latent frames x (height / multiple) x (width / multiple); the text is not split."""
        if "height" not in call_kwargs or "width" not in call_kwargs:
            return {}
        temporal = checkpoint.config("vae").get("scale_factor_temporal", 4)
        frames = call_kwargs.get("num_frames", self._default("num_frames"))
        if frames % temporal != 1:  # as stock rounds it (with a warning)
            frames = frames // temporal * temporal + 1
        latent_frames = (max(frames, 1) - 1) // temporal + 1
        multiple = self.size_multiple(checkpoint)
        tokens = latent_frames * (call_kwargs["height"] // multiple) * (call_kwargs["width"] // multiple)
        return {"video tokens": tokens}

    def save(self, output: VideoWithAudio, path, text: dict[str, str]) -> list:
        """An MP4 (H.264, the settings in its metadata); Wan makes no audio."""
        return save_video(output, path, text=text)

    def read_settings(self, path) -> dict[str, str] | None:
        return read_video_text(path, audio=False)

    def __call__(self, pipe, embeds, *, generator, decodes: bool, check, buckets=(), helps_decode: bool = False,
                 **kwargs):
        """The stock call; the latents with `output_type="latent"`, else the frames as a `VideoWithAudio`."""
        latent = kwargs.get("output_type") == "latent"
        kwargs["output_type"] = "latent" if latent else "pt"
        output = pipe(**embeds, generator=generator, callback_on_step_end=check.step_end,
                      callback_on_step_end_tensor_inputs=["latents"],
                      **{**kwargs, "output_type": kwargs["output_type"] if decodes or helps_decode else "latent"})
        if not decodes:
            return None
        frames = output.frames[0]
        return frames if latent else VideoWithAudio(frames=frames.float().cpu(), fps=self.fps)
