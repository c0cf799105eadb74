"""Rank jobs for tests/test_reliability.py, run on the session's pool of ranks (`rank_pool`): one job a topic, each
case recorded on its own (`rank_cases.record`), so a case that fails fails only the test that reads it.

A pool's rank runs other jobs before and after these: every job leaves the process as it found it (threads, logging
handlers, patched functions)."""

from __future__ import annotations

import errno
import logging
import time

import numpy as np
import torch
import torch.distributed as dist
from rank_cases import CaseError, one_thread, record

#: A prompt whose encoding fails on the encoding rank only (`_leader_encoding_fails`): what a tokenizer error is.
LEADER_ONLY_FAILURE = "a prompt the leader's tokenizer refuses"
LEADER_ERROR = "the leader's tokenizer refused this prompt"
GOOD = {"height": 32, "width": 32, "num_inference_steps": 2, "output_type": "np"}


def _outcome(call) -> dict:
    """What `call()` raised on this rank (type and message), or that it returned."""
    try:
        call()
        return {"type": None, "message": "returned"}
    except Exception as error:  # every kind counts: the test compares them across ranks
        return {"type": type(error).__name__, "message": str(error)}


def _image(outputs):
    return None if outputs is None else np.asarray(outputs[0])


def _leader_encoding_fails(pipe) -> None:
    """A test probe: the encoding rank raises for `LEADER_ONLY_FAILURE`, as a tokenizer error would. (A prompt
    longer than the largest length bucket used to be this failure; it now runs, as it does in stock.)"""
    if not pipe.is_leader:
        return
    encode = pipe.adapter.encode

    def failing(encoder, prompt, *args, **kwargs):
        if prompt == LEADER_ONLY_FAILURE:
            raise ValueError(LEADER_ERROR)
        return encode(encoder, prompt, *args, **kwargs)

    pipe.adapter.encode = failing


def _every_case_failed(names, error: CaseError) -> dict:
    """A job whose set-up (the load) failed: every case reports that failure, so each test says why."""
    return dict.fromkeys(names, error)


SERVING_CASES = ("first", "again", "partial", "after_partial", "mismatch", "after_mismatch", "seconds")


def _bad_requests(pipe) -> dict:
    """Eight kinds of bad request on a serving loop, by the name the test reads."""
    return {
        "prompt not a string": lambda: pipe.generate(5, seed=0, **GOOD),
        "encoding fails on the leader only": lambda: pipe.generate(LEADER_ONLY_FAILURE, seed=0, **GOOD),
        "bad return option": lambda: pipe.generate("a red fox", seed=0, **{**GOOD, "output_type": "bogus"}),
        "negative prompt not a string": lambda: pipe.generate("a red fox", seed=0, negative_prompt=5, **GOOD),
        "NaN guidance": lambda: pipe.generate("a red fox", seed=0, true_cfg_scale=float("nan"), **GOOD),
        "unknown keyword": lambda: pipe.generate("a red fox", seed=0, guidance_scal=4.0, **GOOD),
        "seed beyond 64 bits": lambda: pipe.generate(["a", "b"], seed=2**64 - 1, **GOOD),
        "size beyond the model": lambda: pipe.generate("a red fox", seed=0, **{**GOOD, "height": 98320}),
    }


def serving_loop(checkpoint) -> dict:
    """A serving loop on a TP=2 group: a good request, eight kinds of bad request (cases `("bad", kind)`), the good
    one again, then a call by part of the group and one with different arguments, each followed by the good one.

    A group put out of step would wait at its next collective and fail there (the pool's collective timeout)."""
    import neuron_diffusers as nd

    report = {}
    with one_thread():
        pipe = record(report, "load", nd.load_pipeline, checkpoint, nd.init_distributed(tp=2), buckets=(16,))
        if isinstance(pipe, CaseError):
            return _every_case_failed([*SERVING_CASES, *(("bad", kind) for kind in _bad_requests(None))], pipe)
        _leader_encoding_fails(pipe)
        start = time.monotonic()
        record(report, "first", lambda: _image(pipe.generate("a red fox", seed=0, **GOOD)))
        for kind, call in _bad_requests(pipe).items():
            report["bad", kind] = _outcome(call)
        record(report, "again", lambda: _image(pipe.generate("a red fox", seed=0, **GOOD)))

        # Part of the group: rank 0 calls alone (rank 1 waits in a barrier meanwhile) and gives up after the entry
        # timeout; the next call pairs the ranks up again.
        pipe.entry_timeout_s = 3.0
        report["partial"] = (_outcome(lambda: pipe.generate("a red fox", seed=0, **GOOD)) if dist.get_rank() == 0
                             else None)
        dist.barrier()
        record(report, "after_partial", lambda: _image(pipe.generate("a red fox", seed=0, **GOOD)))
        # Different arguments on the two ranks: both refuse, before any collective.
        report["mismatch"] = _outcome(lambda: pipe.generate("a red fox", seed=dist.get_rank(), **GOOD))
        record(report, "after_mismatch", lambda: _image(pipe.generate("a red fox", seed=0, **GOOD)))
        report["seconds"] = time.monotonic() - start
    del report["load"]
    return report


def cfg_pair_loop(checkpoint) -> dict:
    """One CFG pair (tp=1, cfg=2): a bad true-CFG request fails alike on both groups; the pair then still works."""
    import neuron_diffusers as nd

    report = {}
    with one_thread():
        pipe = record(report, "load", nd.load_pipeline, checkpoint, nd.init_distributed(tp=1, cfg=2), buckets=(16,))
        if isinstance(pipe, CaseError):
            return _every_case_failed(("leader_only", "leader_only_split", "good"), pipe)
        _leader_encoding_fails(pipe)
        cfg = {**GOOD, "negative_prompt": "blurry", "true_cfg_scale": 4.0}
        report["leader_only"] = _outcome(lambda: pipe.generate(LEADER_ONLY_FAILURE, seed=0, **cfg))
        report["leader_only_split"] = _outcome(lambda: pipe.generate(["a red fox", LEADER_ONLY_FAILURE], seed=0,
                                                                     **GOOD))
        record(report, "good", lambda: _image(pipe.generate("a red fox", seed=0, **cfg)))
    del report["load"]
    return report


class _Collect(logging.Handler):
    """The package's warnings while a job runs."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def nan_checks(nan_checkpoint) -> dict:
    """A checkpoint with NaN weights at TP=2 fails with `NonFiniteLatentsError` (no plan warning); one rank's NaN
    latents are caught by the latent check, which `abs(a - b) > tol` alone would miss."""
    import neuron_diffusers as nd
    from neuron_diffusers.consistency import LatentAgreement

    collect, logger = _Collect(), logging.getLogger("neuron_diffusers")
    logger.addHandler(collect)
    report = {}
    try:
        with one_thread():
            mesh = nd.init_distributed(tp=2)
            pipe = record(report, "load", nd.load_pipeline, nan_checkpoint, mesh)
            report["nan_checkpoint"] = pipe if isinstance(pipe, CaseError) else _outcome(
                lambda: pipe.generate("a red fox", seed=0, **GOOD))
            latents = torch.ones(1, 4, 8)
            if dist.get_rank() == 1:
                latents[0, 0, 3] = float("nan")  # one element, on one rank
            check = LatentAgreement(mesh["tp"].get_group())
            report["one_nan"] = _outcome(lambda: check.check([latents], "step 3"))
    finally:
        logger.removeHandler(collect)
    report["warnings"] = report["load"] if isinstance(report["load"], CaseError) else collect.messages
    del report["load"]
    return report


def disk_full(argv_tp2: list[str], argv_dp2: list[str]) -> dict:
    """The job with rank 0's second PNG write failing with ENOSPC mid-file, at TP=2 (one group) and DP=2 (two
    groups, the other one healthy): every rank must end with the same error."""
    import PIL.Image

    from neuron_diffusers.cli import _parser
    from neuron_diffusers.distributed import detect_runtime
    from neuron_diffusers.job import plan_job, run_job

    real_save = PIL.Image.Image.save
    writes = []

    def save(self, fp, *args, **kwargs):
        writes.append(fp)
        if dist.get_rank() == 0 and len(writes) == 2:
            with open(fp, "wb") as file:
                file.write(b"\x89PNG half an image")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(self, fp, *args, **kwargs)

    PIL.Image.Image.save = save
    report = {}
    try:
        with one_thread():
            for name, argv in (("tp2", argv_tp2), ("dp2", argv_dp2)):
                writes.clear()
                args = _parser().parse_args(["generate", *argv])
                report[name] = _outcome(lambda args=args: run_job(plan_job(args, detect_runtime().world_size, "cpu"),
                                                                   overwrite=False, compile_backend=None, warm=False,
                                                                   timeout_s=60))
    finally:
        PIL.Image.Image.save = real_save
    return report
