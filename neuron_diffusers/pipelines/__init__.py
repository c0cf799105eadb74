"""One small adapter per stock pipeline family (the family records in `families.py` name them).

An adapter knows how to encode a prompt on CPU, which call kwargs carry the embeddings and masks, whether they may
be padded to a static length bucket, which components each rank needs, and how its output is saved. It never
copies pipeline code.
"""

from .base import PipelineAdapter, StockPipelineAdapter, bucket_for

__all__ = ["PipelineAdapter", "StockPipelineAdapter", "bucket_for"]
