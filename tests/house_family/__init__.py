"""A throwaway family outside the package (Chroma, which no family of ours covers), to prove that adding a family
touches only its own files (`tp_plans/chroma.py`, `pipelines/chroma.py`, `tiny/chroma.py`) and one registry line:
the `register` call below. `tests/test_family_house.py` runs `plan verify` and `generate` on it."""

from neuron_diffusers import families

families.register(families.Family("chroma", "Chroma", "ChromaAdapter", package=__name__,
                                  pipelines=(families.PipelineClass("ChromaPipeline"),)))
