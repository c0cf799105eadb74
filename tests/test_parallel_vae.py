"""Parallel VAE: decode and encode split over 2 ranks give the stock single-process result.

Each test runs its own job on the session's 2 gloo ranks (`rank_pool`): `load_pipeline(..., parallel_vae=True)
.generate(...)` at TP=2 against the stock pipeline alone in this process (FLUX.1 and Qwen-Image at 256x256,
MiniMax-H3's video per frame), compared before the 8-bit rounding (float image, frames, audio samples) with another
prompt as the control; then each VAE alone, stock against parallel, with another latent (another image for the
encoder) as the control. Row-split VAEs are equal within float32 rounding (a band's convolution may accumulate in
another order; GroupNorm statistics are combined from per-band moments); MiniMax-H3's clips are dealt out whole and
blended by a sum with one non-zero term per element, so without spatial tiles its decode is bit-exact (asserted).
"""

import pytest
import runner_jobs
import torch
import vae_jobs
from test_runner import OTHER_PROMPT, assert_equals_stock_with_control, stock_output

from neuron_diffusers import tiny
from neuron_diffusers.compat.vae import vae_blocks
from neuron_diffusers.parallel.vae import check_supported, resolve_parallel_vae
from neuron_diffusers.parallel.vae_rows import RowGeometry, split_rows

#: Max abs difference allowed for float32 rounding: outputs are O(1), and a band's convolution or a combined GroupNorm
#: only reorders sums (eps 1.2e-7 times the hundreds of terms of a VAE's reductions; measured at most 2.4e-5, FLUX.1's
#: uneven batch; another latent moves stock's decode by more than 1).
ROUNDING = 1e-4
GENERATIONS = {"flux": {"height": 256, "width": 256, "num_inference_steps": 2},
               "qwenimage": {"height": 256, "width": 256, "num_inference_steps": 2},
               "h3": tiny.smallest_call("h3"),  # 124 frames: 37 latent frames, decoded as 4 clips
               "wan": {**tiny.smallest_call("wan"), "num_frames": 9}}  # 3 latent frames of 4 x 4 rows
#: Under context parallelism (Ulysses=2, TP=1) the image group's ranks hold the VAE and split the decode too.
CONTEXT_PARALLEL = {family: GENERATIONS[family] for family in ("flux", "qwenimage", "h3")}
SMALL_TILES = {"tile_sample_min_height": 64, "tile_sample_min_width": 64,
               "tile_sample_min_overlap_height": 16, "tile_sample_min_overlap_width": 16}
CASES = {  # latents are 8x (16x for Qwen-Image-2.1 and MiniMax-H3) smaller than the images
    "flux": {"family": "flux", "latent": [1, 4, 32, 32], "image": [1, 3, 256, 256], "naive": True},
    "flux uneven": {"family": "flux", "latent": [2, 4, 33, 25], "image": [2, 3, 264, 200]},
    "flux2": {"family": "flux2", "latent": [1, 4, 32, 32], "image": [1, 3, 256, 256]},
    "qwenimage video": {"family": "qwenimage", "latent": [1, 16, 3, 16, 16], "image": [1, 3, 5, 128, 128]},
    "wan video": {"family": "wan", "latent": [1, 4, 3, 16, 16], "image": [1, 3, 9, 128, 128]},
    "qwenimage21": {"family": "qwenimage21", "latent": [1, 64, 1, 16, 16], "image": [1, 4, 1, 256, 256]},
    # 3 x 3 tiles of 64 px per clip; 22 frames encode as 2 clips, 7 latent frames decode as 1.
    "h3 tiles": {"family": "h3", "latent": [1, 4, 7, 8, 8], "image": [1, 3, 22, 128, 128], "tiling": SMALL_TILES},
    # No spatial tiles: whole clips dealt out (19 latent frames decode as 2 clips, 22 frames encode as 2).
    "h3": {"family": "h3", "latent": [1, 4, 19, 8, 8], "image": [1, 3, 22, 128, 128]},
}
ROW_CASES = [case for case, spec in CASES.items() if spec["family"] != "h3"]


def _generated(rank_pool, tiny_checkpoint, family, layout):
    return rank_pool.run(vae_jobs.generation_check, 2, tiny_checkpoint(family), layout,
                         runner_jobs.float_call(family, GENERATIONS[family]), timeout_s=1200)


def _stock(tiny_checkpoint, family, prompt=runner_jobs.PROMPT):
    return stock_output(tiny_checkpoint(family), family, GENERATIONS[family], prompt=prompt)


@pytest.fixture(scope="module")
def vae_case(rank_pool, tiny_checkpoint):
    """`vae_case(name)` → both ranks' results of VAE case `name`, one job a case (run on first use)."""
    made = {}

    def get(case):
        if case not in made:
            made[case] = rank_pool.run(vae_jobs.vae_case_check, 2, tiny_checkpoint(CASES[case]["family"]), CASES,
                                       case, timeout_s=1200)
        return made[case]

    return get


@pytest.mark.parametrize("layout", ["", "ulysses2 "], ids=["tp2", "ulysses2"])
@pytest.mark.parametrize("family", ["flux", "qwenimage"])
def test_parallel_vae_generate_gives_the_stock_image(rank_pool, tiny_checkpoint, family, layout):
    expected, control = _stock(tiny_checkpoint, family), _stock(tiny_checkpoint, family, OTHER_PROMPT)
    generated = dict(enumerate(_generated(rank_pool, tiny_checkpoint, family, layout)))
    image = generated[0]["output"]["image"]
    assert image.shape == expected["image"].shape == (256, 256, 3)
    assert_equals_stock_with_control(generated[0]["output"], expected, control, f"{family} {layout}")
    assert generated[1]["output"] is None, "only the image group's leader returns the image"
    for report in generated.values():  # every rank of the image group holds the VAE and took part in the decode
        assert report["decode_calls"] > 0
        assert any("Autoencoder" in name for name in report["models_in_memory"])


@pytest.mark.parametrize("layout", ["", "ulysses2 "], ids=["tp2", "ulysses2"])
def test_parallel_vae_h3_video_matches_stock_per_frame(rank_pool, tiny_checkpoint, layout):
    """Every frame and audio sample within float32 rounding of stock (the transformer's TP sums reorder; the VAE's
    own split is bit-exact, below), and another prompt further than that."""
    expected, control = _stock(tiny_checkpoint, "h3"), _stock(tiny_checkpoint, "h3", OTHER_PROMPT)
    leader, other = _generated(rank_pool, tiny_checkpoint, "h3", layout)
    assert_equals_stock_with_control(leader["output"], expected, control, f"h3 {layout}")
    assert other["output"] is None and other["decode_calls"] > 0


@pytest.mark.parametrize("layout", ["", "ulysses2 "], ids=["tp2", "ulysses2"])
def test_parallel_vae_wan_video_matches_stock(rank_pool, tiny_checkpoint, layout):
    """Wan's causal 3-D VAE split by rows like Qwen-Image's video frames: every frame within float32 rounding of
    stock, another prompt further than that, and both ranks decoding."""
    expected, control = _stock(tiny_checkpoint, "wan"), _stock(tiny_checkpoint, "wan", OTHER_PROMPT)
    leader, other = _generated(rank_pool, tiny_checkpoint, "wan", layout)
    assert_equals_stock_with_control(leader["output"], expected, control, f"wan {layout}")
    assert other["output"] is None and other["decode_calls"] > 0 and leader["decode_calls"] > 0


def _assert_controls_exceed(ranks, case, bar=ROUNDING):
    """Another latent (another image) moves stock's decode (encode) by more than `bar`: the comparison can fail."""
    for rank, result in enumerate(ranks):
        control = result["control"]
        assert control["decode"]["max"] > bar and control["encode"]["max"] > bar, f"{case} {rank} blind: {control}"


@pytest.mark.parametrize("case", ROW_CASES)
def test_row_split_decode_and_encode_equal_stock(vae_case, case):
    ranks = vae_case(case)
    _assert_controls_exceed(ranks, case)
    decode = ranks[0]["decode"]
    assert decode["max"] < ROUNDING and decode["mean"] < 1e-5, f"{case} decode: {decode}"
    for rank, result in enumerate(ranks):
        assert result["encode"]["max"] < ROUNDING and result["encode"]["mean"] < 1e-5, f"{case} encode {rank}"
        assert result["same_posterior_on_every_rank"] and result["removed_is_stock"] and result["hooks_left"] == 0


def test_naive_bands_would_fail_the_same_check(vae_case):
    """Without halos and global norms the bands differ visibly: the check above can fail."""
    assert vae_case("flux")[0]["naive_bands"]["mean"] > 1 / 255


def test_h3_tiles_take_turns_and_match_stock(vae_case):
    ranks = vae_case("h3 tiles")
    _assert_controls_exceed(ranks, "h3 tiles")
    # Each decode (encode) deals its calls (clips x tiles) out in turn, starting from rank 0.
    first, second = (result["calls_run"] for result in ranks)
    assert second > 0 and 0 <= first - second <= 2
    decode = ranks[0]["decode"]  # corners blend 4 tiles: sums in another order
    assert decode["worst_frame_mean"] < 1e-6 and decode["max"] < ROUNDING
    for result in ranks:
        assert result["encode"]["max"] < ROUNDING and result["same_posterior_on_every_rank"]
        assert result["removed_is_stock"] and result["hooks_left"] == 0


def test_h3_without_tiles_decodes_and_encodes_bit_exact(vae_case):
    """Whole clips dealt out, blended by a sum whose other term is an exact zero: the leader's video and every
    rank's posterior are stock's bit for bit (max difference 0.0), while another latent (another video) moves stock's
    output (the control: 0.0 is not a blind bar)."""
    ranks = vae_case("h3")
    first, second = (result["calls_run"] for result in ranks)
    assert first > 0 and second > 0, "both ranks must decode a clip"
    _assert_controls_exceed(ranks, "h3", bar=0.0)
    assert ranks[0]["decode"]["max"] == 0.0, ranks[0]["decode"]
    for result in ranks:
        assert result["encode"]["max"] == 0.0 and result["same_posterior_on_every_rank"], result["encode"]
        assert result["removed_is_stock"] and result["hooks_left"] == 0


def test_unknown_module_is_refused_and_vae_left_as_it_was(rank_pool, tiny_checkpoint):
    for refusal in rank_pool.run(vae_jobs.refusal_check, 2, tiny_checkpoint("flux")):
        assert "nonlinearity (GELU)" in refusal["message"]
        assert refusal["hooks_left"] == 0


def test_split_rows_is_even_aligned_and_gives_the_remainder_to_the_last_rank():
    assert split_rows(33, 2) == [(0, 17), (17, 33)]
    assert split_rows(260, 2, multiple=8) == [(0, 128), (128, 260)]  # 32 whole 8-row units, then 4 rows
    assert split_rows(32, 3, multiple=8) == [(0, 16), (16, 24), (24, 32)]
    assert split_rows(16, 4, multiple=8) is None  # fewer units than ranks: every rank runs it whole


@pytest.mark.parametrize("conv, fixes, halos", [
    (torch.nn.Conv2d(1, 1, 3, padding=1), (1, 1), (1, 1)),
    (torch.nn.Conv2d(1, 1, 3, stride=2, padding=1), (1, 0), (2, 0)),
    (torch.nn.Conv2d(1, 1, 5, padding=2), (2, 2), (2, 2)),
])
def test_row_geometry_names_the_rows_that_read_past_a_band_edge(conv, fixes, halos):
    geometry = RowGeometry.of_conv(conv)
    assert (geometry.top_fix, geometry.bottom_fix) == fixes
    assert (geometry.halo_top, geometry.halo_bottom) == halos


def test_downsample_pad_then_conv_unit():
    """diffusers' Downsample2D(padding=0) and Qwen's ZeroPad2d((0, 1, 0, 1)) + conv: one bottom row from below."""
    geometry = RowGeometry.of_conv(torch.nn.Conv2d(1, 1, 3, stride=2), pad_top=0, pad_bottom=1)
    assert (geometry.top_fix, geometry.bottom_fix, geometry.halo_top, geometry.halo_bottom) == (0, 1, 0, 1)
    downsample = vae_blocks("bottom_padded_downsample")[0](4, use_conv=True, padding=0)
    assert (downsample.use_conv, downsample.padding, type(downsample.conv)) == (True, 0, torch.nn.Conv2d)


def test_unsupported_vae_class_is_refused_by_name_before_loading():
    check_supported("AutoencoderKLQwenImage")
    with pytest.raises(ValueError, match="does not support AutoencoderKLCogVideoX.*parallel_vae=False"):
        resolve_parallel_vae(True, "AutoencoderKLCogVideoX", 2)
    assert resolve_parallel_vae(None, "AutoencoderKLCogVideoX", 2) is None  # the default leaves it to the leader
    assert resolve_parallel_vae(True, "AutoencoderKL", 1) is None  # one rank: nothing to split
    assert resolve_parallel_vae(False, "AutoencoderKLMiniMaxH3", 2) is None
    assert resolve_parallel_vae(True, "AutoencoderKL", 2) == 0  # asked for: every size
    assert resolve_parallel_vae(None, "AutoencoderKL", 2) == 1024 * 1024
    assert resolve_parallel_vae(None, "AutoencoderKLMiniMaxH3", 2) == 0
