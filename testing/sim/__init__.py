"""The paper-scale simulation's parts that the tests and the benchmarks share: one trace through the
real scheduler in virtual time (``runs``), the contiguous Orca baselines (``baseline_allocators``),
the block-level sharing models (``sharing_model``) and what is read off many runs (``paper``)."""
