"""h3cute-bench: the prior-art comparison harness of the H3 conditioning ops.

`problems` (the op table: inputs, per-row vs shared, gradients, sizes), `candidates` (h3cute, the
diffusers replays and modules, peers, cuBLAS modes), `checks` (batch invariance, accuracy, latency,
floors), `prior_art` (one subprocess per mode, merged report), `report` (schema reader shared with the
B200 seed reports, markdown, plots), `sweep` (tile configs), `cli`. Never imports the CuTe DSL.
"""
