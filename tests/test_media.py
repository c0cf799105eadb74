"""`neuron_diffusers.media`: PNG and MP4 + WAV files that are complete, playable, or absent."""

import os
import wave

import av
import numpy as np
import PIL.Image
import pytest
import torch

from neuron_diffusers import media
from neuron_diffusers.media import VideoWithAudio, save_png, save_video


def moving_gradient(num_frames: int = 24, height: int = 32, width: int = 32) -> torch.Tensor:
    """(num_frames, 3, height, width) in [0, 1]: red ramps across and drifts right, green ramps down."""
    x = torch.linspace(0, 1, width)
    y = torch.linspace(0, 1, height)
    frames = torch.empty(num_frames, 3, height, width)
    for i in range(num_frames):
        frames[i, 0] = ((x + i / num_frames) / 2).expand(height, width)
        frames[i, 1] = y[:, None].expand(height, width)
        frames[i, 2] = 0.5
    return frames


def stereo_tone(samples: int, sampling_rate: int) -> torch.Tensor:
    """(2, samples): a sine on the left, its negative at half volume on the right."""
    t = torch.arange(samples) / sampling_rate
    left = 0.8 * torch.sin(2 * torch.pi * 5 * t)
    return torch.stack([left, -0.5 * left])


def decoded_frames(path) -> list[torch.Tensor]:
    with av.open(str(path)) as container:
        return [torch.from_numpy(f.to_ndarray(format="rgb24")).permute(2, 0, 1).float() / 255
                for f in container.decode(video=0)]


def test_png_round_trip_keeps_text_and_pixels(tmp_path):
    pixels = np.random.default_rng(0).integers(0, 256, (17, 23, 3), dtype=np.uint8)
    text = {"prompt": "a red fox, über alles", "seed": "7"}

    path = save_png(PIL.Image.fromarray(pixels), tmp_path / "fox.png", text)

    assert path == tmp_path / "fox.png"
    assert sorted(tmp_path.iterdir()) == [path]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as open() makes it, not a temp file's 0600
    with PIL.Image.open(path) as image:
        assert image.text == text
        assert np.array_equal(np.asarray(image), pixels)


def test_png_failure_mid_write_leaves_nothing_and_keeps_the_old_file(tmp_path, monkeypatch):
    old = tmp_path / "out.png"
    save_png(PIL.Image.new("RGB", (4, 4), "blue"), old)
    before = old.read_bytes()

    def crash_after_some_bytes(self, fp, *args, **kwargs):
        with open(fp, "wb") as handle:
            handle.write(b"\x89PNG\r\n\x1a\n half a file")
        raise OSError("disk full")

    monkeypatch.setattr(PIL.Image.Image, "save", crash_after_some_bytes)
    with pytest.raises(OSError, match="disk full"):
        save_png(PIL.Image.new("RGB", (4, 4), "red"), old)
    with pytest.raises(OSError, match="disk full"):
        save_png(PIL.Image.new("RGB", (4, 4), "red"), tmp_path / "new.png")

    assert sorted(tmp_path.iterdir()) == [old]
    assert old.read_bytes() == before


def test_video_with_audio_is_playable_and_wav_is_exact(tmp_path):
    frames = moving_gradient()
    audio = stereo_tone(320, 160)

    paths = save_video(VideoWithAudio(frames, fps=24, audio=audio, sampling_rate=160), tmp_path / "clip.mp4")

    assert paths == [tmp_path / "clip.mp4", tmp_path / "clip.wav"]
    assert sorted(tmp_path.iterdir()) == sorted(paths)
    with av.open(str(paths[0])) as container:
        (video,) = container.streams.video
        (sound,) = container.streams.audio
        assert video.codec_context.name == "h264"
        assert (video.width, video.height) == (32, 32)
        assert video.average_rate == 24
        assert sound.codec_context.name == "aac"
        assert sound.sample_rate == 8000  # 160 Hz is below AAC's slowest rate
        assert sound.channels == 2
    decoded = decoded_frames(paths[0])
    assert len(decoded) == 24
    assert (decoded[0] - frames[0]).abs().mean() < 8 / 255
    assert (decoded[-1] - frames[-1]).abs().mean() < 8 / 255

    with wave.open(str(paths[1])) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate(), wav.getnframes()) == (2, 2, 160, 320)
        pcm = np.frombuffer(wav.readframes(320), dtype="<i2").reshape(320, 2).T
    assert np.abs(pcm / 32767 - audio.numpy()).max() <= 1 / 32767


def test_odd_size_is_padded_to_even_and_plays(tmp_path):
    frames = moving_gradient(num_frames=5, height=33, width=31)

    (path,) = save_video(VideoWithAudio(frames, fps=8), tmp_path / "odd.mp4")

    decoded = decoded_frames(path)
    assert len(decoded) == 5
    assert decoded[0].shape == (3, 34, 32)
    assert (decoded[0][:, :33, :31] - frames[0]).abs().mean() < 8 / 255
    # The padding repeats the last row and column rather than adding a black edge.
    assert (decoded[0][:, 33, :31] - frames[0][:, 32]).abs().mean() < 8 / 255
    assert (decoded[0][:, :33, 31] - frames[0][:, :, 30]).abs().mean() < 8 / 255


def test_json_is_written_atomically(tmp_path):
    path = media.save_json({"images": [{"seed": 3}]}, tmp_path / "summary.json")
    assert path.read_text().startswith("{\n  \"images\"") and sorted(os.listdir(tmp_path)) == ["summary.json"]


def test_video_metadata_travels_in_the_mp4(tmp_path):
    (path,) = save_video(VideoWithAudio(moving_gradient(num_frames=2), fps=2), tmp_path / "clip.mp4",
                         text={"prompt": "a red fox", "seed": "7"})
    with av.open(str(path)) as container:
        assert container.metadata["prompt"] == "a red fox" and container.metadata["seed"] == "7"


def test_audio_at_an_aac_rate_is_not_resampled(tmp_path):
    audio = stereo_tone(16000, 16000)[:1]  # one second, mono

    paths = save_video(VideoWithAudio(moving_gradient(num_frames=4), fps=4, audio=audio, sampling_rate=16000),
                       tmp_path / "clip.mp4")

    with av.open(str(paths[0])) as container:
        (sound,) = container.streams.audio
        assert (sound.sample_rate, sound.channels) == (16000, 1)
        decoded = sum(frame.samples for frame in container.decode(audio=0))
    assert decoded >= 16000  # AAC adds encoder padding, never drops samples


@pytest.mark.parametrize("video, path, message", [
    (VideoWithAudio(torch.zeros(3, 8, 8), fps=8), "a.mp4", "num_frames, 3, height, width"),
    (VideoWithAudio(torch.zeros(2, 4, 8, 8), fps=8), "a.mp4", "RGB"),
    (VideoWithAudio(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), fps=8), "a.mp4", "floats"),
    (VideoWithAudio(torch.full((2, 3, 8, 8), float("nan")), fps=8), "a.mp4", "NaN"),
    (VideoWithAudio(torch.zeros(2, 3, 8, 8), fps=0), "a.mp4", "fps"),
    (VideoWithAudio(torch.zeros(2, 3, 8, 8), fps=8, audio=torch.zeros(100)), "a.mp4", "channels, samples"),
    (VideoWithAudio(torch.zeros(2, 3, 8, 8), fps=8, audio=torch.zeros(2, 100)), "a.mp4", "sampling_rate"),
    (VideoWithAudio(torch.zeros(2, 3, 8, 8), fps=8), "a.mov", r"\.mp4"),
])
def test_bad_input_raises_before_writing_anything(tmp_path, video, path, message):
    with pytest.raises(ValueError, match=message):
        save_video(video, tmp_path / "out" / path)
    assert list(tmp_path.iterdir()) == []


def _raise(*args, **kwargs):
    raise RuntimeError("encoder crashed")


def test_failure_while_encoding_leaves_no_file(tmp_path, monkeypatch):
    # The resampler is built after every video frame has been muxed, so the MP4 is half written.
    monkeypatch.setattr(av, "AudioResampler", _raise)
    video = VideoWithAudio(moving_gradient(num_frames=4), fps=4, audio=stereo_tone(160, 160), sampling_rate=160)

    with pytest.raises(RuntimeError, match="encoder crashed"):
        save_video(video, tmp_path / "clip.mp4")
    assert list(tmp_path.iterdir()) == []


def test_failure_writing_the_wav_leaves_no_mp4(tmp_path, monkeypatch):
    monkeypatch.setattr(media.wave, "open", _raise)
    video = VideoWithAudio(moving_gradient(num_frames=4), fps=4, audio=stereo_tone(160, 160), sampling_rate=160)

    with pytest.raises(RuntimeError, match="encoder crashed"):
        save_video(video, tmp_path / "clip.mp4")
    assert list(tmp_path.iterdir()) == []


def test_failure_renaming_the_wav_removes_the_renamed_mp4(tmp_path, monkeypatch):
    real_replace = media.os.replace

    def replace_once_then_fail(src, dst):
        if str(dst).endswith(".wav"):
            raise OSError("rename failed")
        real_replace(src, dst)

    monkeypatch.setattr(media.os, "replace", replace_once_then_fail)
    video = VideoWithAudio(moving_gradient(num_frames=4), fps=4, audio=stereo_tone(160, 160), sampling_rate=160)

    with pytest.raises(OSError, match="rename failed"):
        save_video(video, tmp_path / "clip.mp4")
    assert list(tmp_path.iterdir()) == []
