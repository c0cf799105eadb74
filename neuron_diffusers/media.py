"""Generated media written to disk (PNG images, MP4 video with an optional WAV soundtrack, a run's JSON summary), and
the input images a request reads.

Every file is written to a temporary name beside its destination and renamed into place only
once it is complete, so a job killed mid-write (preempted, out of memory, Ctrl-C) never leaves a
truncated file under the name a user or a downstream job will pick up.

Video gets two files because MiniMax-H3 makes video and audio together: an MP4 (H.264 + AAC) that
any player opens, and the untouched audio as a 16-bit WAV, since AAC is lossy and accepts only
some sample rates, so the MP4's soundtrack may have been resampled.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import secrets
import wave
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

import PIL.Image
import torch
import torch.nn.functional as F
from PIL.PngImagePlugin import PngInfo

if TYPE_CHECKING:
    import av

# Sample rates the AAC encoder accepts (it also takes 7350, which no model of ours produces).
AAC_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000)


@dataclass
class VideoWithAudio:
    """A generated clip: frames plus an optional soundtrack (MiniMax-H3 makes both)."""

    frames: torch.Tensor  # (num_frames, 3, height, width), float in [0, 1]
    fps: float
    audio: torch.Tensor | None = None  # (channels, samples), float in [-1, 1]
    sampling_rate: int | None = None


#: How `_staged` names its temporary files: `.<name>.<8 hex digits>.tmp` beside the destination.
_TEMP_NAME = re.compile(r"\..+\.[0-9a-f]{8}\.tmp")


def _temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")


def remove_stale_temps(folder: Path) -> list[Path]:
    """Delete the temporary files a killed writer left in `folder` (a SIGKILL, or a SIGTERM during a save, gives it no
    chance to clean up); returns them. Only a job that holds the folder's lock may call this: a live writer's
    temporary file looks the same."""
    stale = [path for path in folder.glob(".*.tmp") if _TEMP_NAME.fullmatch(path.name) and path.is_file()]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


@contextmanager
def _staged(paths: Sequence[Path]) -> Iterator[list[Path]]:
    """Yield one empty temporary file beside each of `paths`; on success rename each into place.

    On any failure, the temporary files and any destination already renamed by this call are
    removed, so the caller leaves either all of `paths` complete or none of them.
    """
    temps: list[Path] = []
    renamed: list[Path] = []
    try:
        for path in paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            temp = _temp_path(path)
            # Not tempfile: its files are private (0600), and the renamed file would stay so. O_EXCL
            # with mode 0666 gives the permissions a plain open() would (the umask applies).
            os.close(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            temps.append(temp)
        yield temps
        for temp, path in zip(temps, paths, strict=True):
            os.replace(temp, path)
            renamed.append(path)
    except BaseException:
        for leftover in temps + renamed:
            leftover.unlink(missing_ok=True)
        raise


def save_png(image: PIL.Image.Image, path: str | os.PathLike[str], text: Mapping[str, str] | None = None) -> Path:
    """Write `image` to `path` as a PNG with `text` as tEXt chunks (e.g. the prompt and seed), atomically.

    The text travels inside the image, so a PNG copied elsewhere still says how it was made.
    """
    path = Path(path)
    with _staged([path]) as (temp,):
        image.save(temp, format="PNG", pnginfo=_png_info(text))
    return path


def png_bytes(image: PIL.Image.Image, text: Mapping[str, str] | None = None) -> bytes:
    """`image` as the bytes of the PNG `save_png` would write (the same text chunks): what the server sends."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", pnginfo=_png_info(text))
    return buffer.getvalue()


def _png_info(text: Mapping[str, str] | None) -> PngInfo:
    info = PngInfo()
    for key, value in (text or {}).items():
        info.add_text(key, value)
    return info


def read_png_text(path: str | os.PathLike[str]) -> dict[str, str] | None:
    """The text chunks of the PNG at `path`, or None when it is not a complete PNG (missing, a folder, empty,
    truncated, garbage): every chunk's checksum is verified, which reads the file once without decoding pixels."""
    try:
        with PIL.Image.open(path) as image:
            image.verify()
            # `save_png` writes its text chunks before the image data, where opening the file already reads them.
            return {key: value for key, value in image.info.items() if isinstance(value, str)}
    except (OSError, SyntaxError, ValueError, PIL.Image.DecompressionBombError):  # what PIL raises for bad files
        return None


def read_video_text(path: str | os.PathLike[str], audio: bool = True) -> dict[str, str] | None:
    """The metadata `save_video` wrote into the MP4 at `path`, or None when it is not a playable MP4 with a video
    stream (missing, a folder, empty, truncated, garbage), or, with `audio`, when the WAV beside it is not complete."""
    import av  # imported here so that importing this module stays cheap

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                return None
            metadata = dict(container.metadata)
        if audio:
            with wave.open(str(Path(path).with_suffix(".wav"))) as wav:
                if wav.getnframes() == 0:
                    return None
        return metadata
    except (OSError, EOFError, av.FFmpegError, wave.Error, ValueError):
        return None


def save_json(data: Mapping, path: str | os.PathLike[str]) -> Path:
    """Write `data` as indented JSON to `path`, atomically (a run's `summary.json`)."""
    path = Path(path)
    with _staged([path]) as (temp,):
        temp.write_text(json.dumps(data, indent=2, default=str))
    return path


def save_video(video: VideoWithAudio, path: str | os.PathLike[str],
               text: Mapping[str, str] | None = None) -> list[Path]:
    """Write `video` to `path` (an .mp4) and, when it has audio, the audio to `path` with a .wav suffix.

    `text` goes into the MP4's metadata (custom keys kept with `movflags=use_metadata_tags`), as PNG text
    chunks do for images: how the clip was made travels with it.

    The MP4 is H.264 in yuv420p, the pixel format every player decodes, at `video.fps`. yuv420p
    stores colour once per 2x2 pixel block, so it needs an even width and height; an odd one is
    padded by one pixel that repeats the last row/column, because black padding would share those
    blocks with the real edge pixels and darken their colour. The MP4 is then one pixel larger.

    Audio is muxed into the MP4 as AAC. AAC accepts only the rates in `AAC_RATES`, so audio at
    another rate (our tiny test models make 160 Hz) is resampled into the MP4 at the nearest
    accepted rate above it (8000 Hz for anything slower, 96000 Hz for anything faster). The WAV
    keeps the samples exactly as given, at `video.sampling_rate`, as 16-bit PCM.

    Inputs are checked before any file is created; both files appear together or not at all.
    Returns the written paths, the MP4 first.
    """
    path = Path(path)
    _check_video(video, path)
    paths = [path] if video.audio is None else [path, path.with_suffix(".wav")]
    with _staged(paths) as temps:
        _write_mp4(video, temps[0], text or {})
        if video.audio is not None:
            _write_wav(video.audio, video.sampling_rate, temps[1])
    return paths


def _check_video(video: VideoWithAudio, path: Path) -> None:
    if path.suffix.lower() != ".mp4":
        raise ValueError(f"save_video writes MP4 (H.264 + AAC), but the path {path} does not end in .mp4. "
                         f"Pass a path ending in .mp4, e.g. {path.with_suffix('.mp4')}.")
    _check_floats("frames", video.frames, "(num_frames, 3, height, width)", "[0, 1]",
                  "For one image add a frame axis with frames.unsqueeze(0); for channels-last frames "
                  "use frames.permute(0, 3, 1, 2).")
    if video.frames.shape[1] != 3:
        raise ValueError(f"frames must be RGB, channels first: (num_frames, 3, height, width), got shape "
                         f"{tuple(video.frames.shape)}. For channels-last frames use frames.permute(0, 3, 1, 2).")
    if not (isinstance(video.fps, (int, float)) and math.isfinite(video.fps) and video.fps > 0):
        raise ValueError(f"fps must be a positive number of frames per second, got {video.fps!r}.")
    if video.audio is None:
        return
    _check_floats("audio", video.audio, "(channels, samples)", "[-1, 1]",
                  "For mono audio add a channel axis with audio.unsqueeze(0).")
    rate = video.sampling_rate
    if isinstance(rate, bool) or not isinstance(rate, int) or rate <= 0:
        raise ValueError(f"audio was given, so sampling_rate must be its rate in Hz as a positive int, got "
                         f"{rate!r}. Take it from the pipeline's vocoder or audio VAE config.")


def _check_floats(name: str, tensor: torch.Tensor, shape: str, bounds: str, hint: str) -> None:
    """`tensor` is a non-empty float tensor with as many axes as `shape` names, and all finite."""
    if not isinstance(tensor, torch.Tensor) or tensor.ndim != shape.count(",") + 1 or tensor.numel() == 0:
        got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"{name} must be a non-empty tensor of shape {shape}, got {got}. {hint}")
    if not tensor.is_floating_point():
        raise ValueError(f"{name} must be floats in {bounds}, got dtype {tensor.dtype}. Scale it into "
                         f"{bounds} as floats first (uint8 pixels: / 255; int16 samples: / 32768).")
    if not torch.isfinite(tensor).all():
        raise ValueError(f"{name} has NaN or infinite values: the generation itself went wrong (often "
                         "float16 overflow), so there is nothing sensible to write.")


def _rgb_uint8(frames: torch.Tensor) -> torch.Tensor:
    """(N, 3, H, W) floats in [0, 1] → (N, H', W', 3) uint8, with H' and W' rounded up to even."""
    frames = frames.detach().to("cpu", torch.float32).clamp(0, 1)
    height, width = frames.shape[-2:]
    frames = F.pad(frames, (0, width % 2, 0, height % 2), mode="replicate")
    return (frames * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def _write_mp4(video: VideoWithAudio, target: Path, text: Mapping[str, str]) -> None:
    import av  # imported here so that importing this module stays cheap

    rgb = _rgb_uint8(video.frames).numpy()
    with av.open(str(target), "w", format="mp4", options={"movflags": "use_metadata_tags"}) as container:
        container.metadata.update(text)
        # Every stream must exist before the first packet is muxed (that writes the MP4 header).
        picture = container.add_stream("libx264", rate=Fraction(video.fps).limit_denominator(1001))
        picture.height, picture.width = rgb.shape[1:3]
        picture.pix_fmt = "yuv420p"
        sound = None if video.audio is None else _add_aac_stream(container, video.audio.shape[0],
                                                                  video.sampling_rate)

        for image in rgb:
            container.mux(picture.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(picture.encode())

        if sound is not None:
            samples = video.audio.detach().to("cpu", torch.float32).clamp(-1, 1).contiguous().numpy()
            frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout=sound.layout)
            frame.sample_rate, frame.pts = video.sampling_rate, 0
            # The resampler also cuts the audio into the fixed-size frames AAC encodes, even when
            # the rate does not change.
            resampler = av.AudioResampler(format="fltp", layout=sound.layout, rate=sound.rate,
                                          frame_size=sound.frame_size)
            for chunk in resampler.resample(frame) + resampler.resample(None):
                container.mux(sound.encode(chunk))
            container.mux(sound.encode())


def _add_aac_stream(container: av.container.OutputContainer, channels: int,
                    sampling_rate: int) -> av.AudioStream:
    """An opened AAC stream at the accepted rate nearest above `sampling_rate` (see `save_video`)."""
    rate = min((r for r in AAC_RATES if r >= sampling_rate), default=AAC_RATES[-1])
    sound = container.add_stream("aac", rate=rate)
    sound.layout = f"{channels}c"  # FFmpeg's default layout for that many channels
    sound.codec_context.open()  # opening sets frame_size, the samples per AAC frame
    return sound


def _write_wav(audio: torch.Tensor, sampling_rate: int, target: Path) -> None:
    """16-bit PCM, channels interleaved sample by sample, as WAV requires."""
    pcm = (audio.detach().to("cpu", torch.float32).clamp(-1, 1) * 32767).round().to(torch.int16)
    with wave.open(str(target), "wb") as wav:
        wav.setnchannels(pcm.shape[0])
        wav.setsampwidth(2)
        wav.setframerate(sampling_rate)
        wav.writeframes(pcm.T.contiguous().numpy().astype("<i2").tobytes())


@dataclass(frozen=True)
class InputImage:
    """An input image (or mask) of a request: the file it was read from, its size, and the sha256 of its bytes, which
    the output records and which makes its settings (and so its resume key) differ when the file does."""

    path: str
    sha256: str
    width: int
    height: int

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> InputImage:
        """Read and check `path` once: a readable file that PIL decodes whole (a clear error otherwise)."""
        data, image = _decode(Path(path))
        return cls(str(path), hashlib.sha256(data).hexdigest(), *image.size)

    def load(self) -> PIL.Image.Image:
        """The decoded image, refused if the file changed since `read` (the output would record other bytes)."""
        data, image = _decode(Path(self.path))
        if hashlib.sha256(data).hexdigest() != self.sha256:
            raise ValueError(f"{self.path} changed while the job ran: its output would not record the image it was "
                             "made from. Leave input images unchanged during a run, and rerun.")
        return image

    def record(self) -> dict[str, str]:
        """What an output's metadata records of it."""
        return {"path": self.path, "sha256": self.sha256}


def _decode(path: Path) -> tuple[bytes, PIL.Image.Image]:
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ValueError(f"Cannot read the input image {path}: {error.strerror or error}. Check the path (prompt "
                         "files name images relative to themselves).") from None
    try:
        image = PIL.Image.open(io.BytesIO(data))
        image.load()
    except (OSError, SyntaxError, ValueError, PIL.Image.DecompressionBombError) as error:
        raise ValueError(f"{path} is not an image PIL can read ({error}): give a PNG, JPEG or WebP file.") from None
    return data, image
