"""THE one place that reaches into diffusers' (and torch's) private internals, pinned to the series pyproject.toml
names (`version`); every private name it or any other module reaches is registered in `privates`.

diffusers 0.42 ships tensor parallelism (`TensorParallelConfig`, `hooks/tensor_parallel.py`, a slice-streaming
loader) that we build on rather than copy. These gaps are closed here, and only here (module in brackets):

1. CPU meshes [`tp_loading`]. Stock lists the device types it accepts in `_SUPPORTED_TP_DEVICES` (no `cpu`) and
   computes the rank's device as `rank % torch.accelerator.device_count()`, which divides by zero on a CPU-only host.
   We add `cpu` and derive the device from the mesh the user passed [`context`].
2. Checks before any weight is read [`tp_loading`]. Stock validates the mesh's device type only in
   `apply_tensor_parallel`, after the whole checkpoint was streamed. We run that check (and a mesh shape check)
   inside `_check_tp_supported`, which both entry points call before loading.
3. A failed `enable_parallelism` leaves the model half-sharded and marked "already applied" [`enable`]. We snapshot
   the model and restore it exactly on any failure.
4. Our plan styles, `GatheredColwiseParallel` and `PartialRowwiseParallel` (see `tp_plans/styles.py`), taught to the
   three stock dispatchers [`tp_loading`]: shard specs (so the loader streams only each rank's slice: they are laid
   out exactly like colwise / rowwise), partitioning styles, and hooks-only styles (used after a streaming load, on
   Neuron too). Their forward-time behaviour is installed by `coalesce.install` right after stock's
   `apply_tensor_parallel`.
5. Attention processors that split heads with `attn.heads` (MiniMax-H3's, HunyuanVideo's, the stock
   `AttnProcessor2_0`) see the rank's local head count once `to_q` is sharded [`tp_loading`].
6. The class attributes stock reads plans and repeated blocks from (`_tp_plan`, `_cp_plan`, `_repeated_blocks`) are
   read and written through `plans` only (`register`, `tp_plan_of`, `using_plan`, `record_tp_plan`,
   `compile_blocks`). The plans are pushed in by `neuron_diffusers/__init__.py`: `compat` names no family.
7. A LoRA factor must be sliced exactly like the weight shard it updates (`parallel/lora.py`): `local_shard` is the
   loader's own slicing (`_local_shard`, packed blocks included) [`tp_loading`].
8. Image inputs on ranks without a VAE (`pipelines/image_inputs.py`): the posterior every diffusers KL VAE's
   `encode` returns, and its output container, are not exported; `vae_encode_output` rebuilds them from the
   leader's shared parameters so that stock `retrieve_latents` runs unchanged on every rank [`vae`].
9. Step caches (`parallel/cache.py`): the block metadata FirstBlockCache and MagCache look up, which block lists
   they hook, the hooks' names, and the two decision points (FirstBlockCache's data-dependent one, TaylorSeer's
   counter) that `cache.py` wraps per hook instance so a group of ranks takes every decision together [`cache`].
10. Parallel VAE (`parallel/vae_rows.py`) recognises the VAEs' building blocks by class: diffusers does not export
    them, so they are looked up here (`vae_blocks`), and registered so that a release that renames or moves one
    fails a test rather than an image (an unknown block is refused when parallel VAE is installed) [`vae`].

Context parallelism (Ulysses, ring) next to TP in one `ParallelConfig`. diffusers 0.42 has both halves but keeps them
apart; diffusers PR #14725 and JingyaHuang/diffusers#2 (open) close the same gaps upstream:

11. `ParallelConfig.__post_init__` refuses a config carrying both. We allow it [`context`].
12. `_resolve_parallel_config` hands one mesh to both configs (TP would take the whole mesh as its degree) and
    computes the device as `rank % accelerator.device_count()` for CP too. We set CP up on a mesh with "ring" and
    "ulysses" dims and TP on its "tp" dim, the device from the mesh, after the layout checks [`context`].
13. `from_pretrained(parallel_config=...)` applies only the TP half when both are given: no error, right numbers,
    every rank computing the whole sequence. We attach the CP half after it returns; the checks run before loading
    [`context`].
14. `enable_parallelism` registers the CP hooks *before* TP; diffusers' hook registry captures a module's `forward`
    at registration, so the coalesced block forwards TP installs afterwards (a class swap) would be bypassed. We run
    stock with an empty CP plan (it still checks the backend and hands the config to the processors), then attach
    the real plan after TP, all or nothing (the processors' configs, outside the module snapshot, restored too)
    [`enable`].
15. Ring attention needs the log-sum-exp of each partial attention; the native backend refuses `return_lse`, so ring
    cannot run on CPU. We compute it with ATen's CPU flash-attention kernel (inference only) [`collectives`].
16. The `*_anything` modes exchange per-rank lengths with `gather_size_by_comm`, which gathers on the CPU only when
    the backend string names "cpu" ("cpu:gloo,cuda:nccl"); a plain gloo group is sent to the accelerator (none on a
    CPU host). We gather on the CPU for gloo. Their output gather (`_all_gather_anything`) all-gathers tensors of
    unequal lengths, which gloo refuses: for gloo we pad to the longest and trim [`collectives`].
17. Qwen-Image-2.1 ships no `_cp_plan`: ours (`tp_plans/qwenimage21.py`, `CP_PLAN`) is registered as the class
    default, like `_tp_plan`, with its block-causal hooks (`pipelines/qwenimage21_context.py`) as the class's
    context-parallel quirks [`plans`].

18. `from_pretrained` refuses a `quantization_config` with a tensor-parallel `parallel_config`. We map a torchao
    config onto the shard-safe scheme of `parallel/quantize.py` (or refuse it, saying why), check it on the meta-device
    model, load unquantized shards, and quantize each rank's own [`quantized`].

Qwen-Image-2.1's exact text padding (a feature, not a gap) lives with its user, `pipelines/qwenimage21.py`, and reaches
the rotary class through `privates.internal`.

Each name touched here is private and may move in another release: importing this package refuses any diffusers
outside the pinned series before a single private module is imported (tests/test_patches.py checks every registered
name and signature still exists). `install` (called by `import neuron_diffusers`) applies the wrappers.
"""

from .version import check_diffusers_version

check_diffusers_version()  # before any private module is imported (the submodules import them)
