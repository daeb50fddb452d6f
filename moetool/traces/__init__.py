"""Routing recorded elsewhere: serving and training engines' routing dumps read into moetool's own trace, and
placements written back in the files the engines load.

* :mod:`.shape` -- what ``--config`` says about the model: its decoder layers, which are MoE, n and K of each;
* :mod:`.readers` -- the engines' dumps (vLLM and SGLang per-request routed experts, SGLang's expert distribution
  recorder, Megatron-Core's router trace), each read as a stream of :class:`~.readers.Chunk` (per-token routing) or
  one :class:`~.readers.Counts` (per (layer, expert) counts only), with the format sniffed from the files;
* :mod:`.store` -- those written as moetool's trace Parquet (the schema ``moetool trace`` writes) or a loads
  Parquet, and read back, streamed, into the per-layer sums the ``--trace`` analyses need;
* :mod:`.export` -- a placement as SGLang's ``--init-expert-location`` file and EPLB's ``phy2log/log2phy/logcnt``.

This package sits at the experiments' layer: it reads files, the model's shape through ``loading.py`` and the
adapters (:mod:`.shape`), writes through ``engine/stream.py`` (:mod:`.store`) and builds EPLB's tables with
placement's own ``rebalance_experts`` (:mod:`.export`); the experiments on a trace
(``moetool.experiments.trace_analyses``) import it.
"""
